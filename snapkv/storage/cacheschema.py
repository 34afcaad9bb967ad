"""One check of a saved cache's metadata: every value's type and bound, before any of it is used.

A file's checksum proves that it is intact, not that it can be trusted: anyone can write a file with a matching
one. So every value of the metadata is checked here against what a real model can have, and a file that fails
is refused by naming the field (read_metadata turns SchemaError into CacheFileError: exit code 5). Keys this
version does not know are left alone (a later minor version may add some); the ones it reads are held to
these rules, in every format.
"""

import math
import re

from snapkv.base.bits import MAX_GROUP

# What a real model can have, with room to spare; nothing sized by these is large.
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 1024          # a Hadamard rotation holds head_dim x head_dim floats
MAX_POSITIONS = 1 << 24      # 16M tokens: prompt lengths, budgets, windows, chunks
MAX_KERNEL = 1023            # the pooling width over scores (15 by default)
MAX_VOCABULARY = 1 << 24     # token ids are below this (and below the model's vocabulary where one is given)
MAX_TEXT = 4096              # a name, a path, a pseudo-question
MAX_SOURCES = 100_000
MAX_QUESTIONS = 64

MODES = ("query-aware", "document-window", "full", "tier-only")
SIDES = ("start", "middle", "end")
QUANTIZED_BITS = (2, 3, 4, 8)
AXES = ("tokens", "channels")
DTYPES = ("bfloat16", "float16")
HEX = re.compile(r"[0-9a-f]{1,128}")


class SchemaError(ValueError):
    """A metadata value of the wrong type or out of bounds: `field` names it (e.g. "storage.head_dim")."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


# ------------------------------------------------------------------------------------------- values

def _whole(field: str, value, low: int, high: int, *, optional: bool = False) -> None:
    """A JSON integer (not a bool, not a float) in [low, high]."""
    if value is None and optional:
        return
    if type(value) is not int:
        raise SchemaError(field, f"a whole number is needed, got {_shown(value)}")
    if not low <= value <= high:
        raise SchemaError(field, f"{value} is outside {low}..{high}")


def _text(field: str, value, *, optional: bool = False, choices: tuple = (), pattern: re.Pattern | None = None) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise SchemaError(field, f"a text of at most {MAX_TEXT} characters is needed, got {_shown(value)}")
    if choices and value not in choices:
        raise SchemaError(field, f"{value!r} is not one of {', '.join(choices)}")
    if pattern is not None and not pattern.fullmatch(value):
        raise SchemaError(field, f"{value!r} is not a hex digest")


def _number(field: str, value, low: float, high: float, *, optional: bool = False, open_low: bool = False) -> None:
    if value is None and optional:
        return
    if type(value) not in (int, float) or not math.isfinite(value):
        raise SchemaError(field, f"a finite number is needed, got {_shown(value)}")
    if value < low or value > high or (open_low and value == low):
        raise SchemaError(field, f"{value} is outside {'(' if open_low else '['}{low}, {high}]")


def _mapping(field: str, value, *, optional: bool = False) -> dict:
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise SchemaError(field, f"an object is needed, got {_shown(value)}")
    return value


def _known_keys(field: str, value: dict, known: set) -> None:
    unknown = sorted(set(value) - known)
    if unknown:
        raise SchemaError(field, f"unknown setting {unknown[0]!r}")


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


# ------------------------------------------------------------------------------------------- parts

def _bits(field: str, value) -> None:
    from snapkv.base.bits import Bits

    if type(value) is not int and not (isinstance(value, str) and len(value) <= 64):
        raise SchemaError(field, f"bits as a number or a text like \"16/8\" are needed, got {_shown(value)}")
    try:
        Bits.parse(value)
    except (ValueError, TypeError) as error:
        raise SchemaError(field, str(error)) from None


def check_cut(field: str, value) -> None:
    """A cut: budget, window, kept share, prefill chunk, and its method with that method's settings."""
    from snapkv.compression.methods import METHODS

    cut = _mapping(field, value)
    _whole(f"{field}.budget", cut.get("budget"), 1, MAX_POSITIONS, optional=True)
    _whole(f"{field}.window", cut.get("window"), 1, MAX_POSITIONS)
    _number(f"{field}.keep", cut.get("keep"), 0, 1, optional=True, open_low=True)
    _whole(f"{field}.prefill_chunk", cut.get("prefill_chunk"), 1, MAX_POSITIONS, optional=True)
    _text(f"{field}.method", cut.get("method"), choices=tuple(sorted(METHODS)))
    settings = {"kernel", "pooling", "chunk", "overlap", "tail", "questions", "size"}
    _known_keys(field, cut, {"budget", "window", "keep", "prefill_chunk", "method", "whole_words", "pyramid",
                             "numbers_with_neighbours"} | settings)
    for flag in ("whole_words", "pyramid", "numbers_with_neighbours"):
        if flag in cut and not isinstance(cut[flag], bool):
            raise SchemaError(f"{field}.{flag}", f"true or false is needed, got {_shown(cut[flag])}")
    if "kernel" in cut:
        _whole(f"{field}.kernel", cut["kernel"], 1, MAX_KERNEL)
        if cut["kernel"] % 2 == 0:
            raise SchemaError(f"{field}.kernel", f"{cut['kernel']} is even; a pooling width is odd")
    if "pooling" in cut:
        _text(f"{field}.pooling", cut["pooling"], choices=("max", "avg"))
    _whole(f"{field}.chunk", cut.get("chunk"), 1, MAX_POSITIONS, optional=True)
    _whole(f"{field}.size", cut.get("size"), 1, MAX_POSITIONS, optional=True)
    for name in ("overlap", "tail"):
        _whole(f"{field}.{name}", cut.get(name), 0, MAX_POSITIONS, optional=True)
    if "questions" in cut:
        questions = cut["questions"]
        if not isinstance(questions, list) or not 1 <= len(questions) <= MAX_QUESTIONS:
            raise SchemaError(f"{field}.questions", f"a list of 1 to {MAX_QUESTIONS} texts is needed")
        for index, question in enumerate(questions):
            _text(f"{field}.questions[{index}]", question)


def _scheme(field: str, value) -> None:
    scheme = _mapping(field, value)
    _known_keys(field, scheme, {"bits", "axis", "group", "rotation"})
    _whole(f"{field}.bits", scheme.get("bits"), 2, 8)
    if scheme["bits"] not in QUANTIZED_BITS:
        raise SchemaError(f"{field}.bits", f"{scheme['bits']} is not one of {QUANTIZED_BITS}")
    _text(f"{field}.axis", scheme.get("axis"), choices=AXES)
    _whole(f"{field}.group", scheme.get("group"), 1, MAX_GROUP)
    _text(f"{field}.rotation", scheme.get("rotation"), optional=True, choices=("hadamard",))


def _storage(value, major: int) -> None:
    storage = _mapping("storage", value)
    _bits("storage.bits", storage.get("bits", 16))
    if "format" in storage and major != 1:  # set only when a format 1 file is read (read_metadata's upgrade)
        raise SchemaError("storage.format", f"a format {major} file cannot declare another format's layout")
    if major == 1:  # plain tensors, written from the model's dtype
        _text("storage.dtype", storage.get("dtype"), optional=True, choices=DTYPES + ("float32",))
        return
    _text("storage.dtype", storage.get("dtype"), optional=True, choices=DTYPES)
    _whole("storage.head_dim", storage.get("head_dim"), 1, MAX_HEAD_DIM)
    _whole("storage.kv_heads", storage.get("kv_heads"), 1, MAX_KV_HEADS)
    for kind in ("keys", "values", "sharp_keys", "sharp_values"):
        if storage.get(kind) is not None:
            _scheme(f"storage.{kind}", storage[kind])


def _model(value) -> None:
    model = _mapping("model", value, optional=True)
    _text("model.name", model.get("name"), optional=True)
    _text("model.model_type", model.get("model_type"), optional=True)
    for key in ("config_sha256", "weights_sha256", "tokenizer_sha256", "chat_template_sha256"):
        _text(f"model.{key}", model.get(key), optional=True, pattern=HEX)
    _whole("model.num_layers", model.get("num_layers"), 1, MAX_LAYERS, optional=True)
    _whole("model.kv_heads", model.get("kv_heads"), 1, MAX_KV_HEADS, optional=True)
    _whole("model.head_dim", model.get("head_dim"), 1, MAX_HEAD_DIM, optional=True)
    _small_json("model.rope", model.get("rope"))


def _small_json(field: str, value, depth: int = 0) -> None:
    """A small JSON value (compared, never used to size anything): bounded depth, lengths and numbers."""
    if depth > 4:
        raise SchemaError(field, "nested too deeply")
    if isinstance(value, dict):
        if len(value) > 64:
            raise SchemaError(field, "too many entries")
        for key, item in value.items():
            _small_json(f"{field}.{key}"[:200], item, depth + 1)
    elif isinstance(value, list):
        if len(value) > 64:
            raise SchemaError(field, "too many entries")
        for item in value:
            _small_json(field, item, depth + 1)
    elif isinstance(value, str):
        _text(field, value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise SchemaError(field, "not a finite number")


def _sources(value) -> None:
    if value is None:
        return
    if not isinstance(value, list) or len(value) > MAX_SOURCES:
        raise SchemaError("sources", f"a list of at most {MAX_SOURCES} sources is needed, got {_shown(value)}")
    for index, source in enumerate(value):
        field = f"sources[{index}]"
        _mapping(field, source)
        _known_keys(field, source, {"name", "size", "sha256", "pages"})
        _text(f"{field}.name", source.get("name"))
        _whole(f"{field}.size", source.get("size"), 0, 1 << 50)
        _text(f"{field}.sha256", source.get("sha256"), pattern=HEX)
        _whole(f"{field}.pages", source.get("pages"), 0, 1 << 31, optional=True)


def _tier(value) -> None:
    tier = _mapping("tier", value, optional=True)
    if tier.get("cut") is not None:
        check_cut("tier.cut", tier["cut"])
    _bits("tier.bits", tier.get("bits", 16))
    truncation = tier.get("truncation")
    if truncation is not None:
        _mapping("tier.truncation", truncation)
        _known_keys("tier.truncation", truncation, {"side", "tokens"})
        _text("tier.truncation.side", truncation.get("side"), choices=SIDES)
        _whole("tier.truncation.tokens", truncation.get("tokens"), 0, MAX_POSITIONS)


def _same_bits(metadata: dict) -> None:
    """The tier's bits are those its storage describes."""
    from snapkv.base.bits import Bits

    tier_bits = Bits.parse((metadata.get("tier") or {}).get("bits", 16))
    if tier_bits != Bits.parse(metadata["storage"].get("bits", 16)):
        raise SchemaError("tier.bits", f"{tier_bits} differs from storage.bits {metadata['storage'].get('bits')}")


# ------------------------------------------------------------------------------------------- the whole

def check_metadata(metadata: dict, major: int) -> None:
    """Every value read from a cache's metadata, typed and bounded; SchemaError naming the first that is not.

    major: the file's format major version (format 1 files have no storage layout of their own)."""
    _whole("original_length", metadata.get("original_length"), 1, MAX_POSITIONS)
    _whole("num_layers", metadata.get("num_layers"), 1, MAX_LAYERS)
    _model(metadata.get("model"))
    _tier(metadata.get("tier"))
    if metadata.get("per_question") is not None:
        check_cut("per_question", metadata["per_question"])
    _text("mode", metadata.get("mode"), optional=True, choices=MODES)
    span = metadata.get("document_span")
    if span is not None:
        if not isinstance(span, list) or len(span) != 2:
            raise SchemaError("document_span", f"two positions are needed, got {_shown(span)}")
        _whole("document_span[0]", span[0], 0, metadata["original_length"])
        _whole("document_span[1]", span[1], span[0], metadata["original_length"])
    _sources(metadata.get("sources"))
    _number("created", metadata.get("created"), 0, 1e11, optional=True)
    producer = _mapping("producer", metadata.get("producer"), optional=True)
    for key, version in producer.items():
        _text(f"producer.{key}"[:200], version, optional=True)
    _storage(metadata.get("storage"), major)
    _same_bits(metadata)
    for key in ("payload_xxh3_128", "payload_sha256", "system_sha256"):
        _text(key, metadata.get(key), optional=True, pattern=HEX)
    lanes = metadata.get("payload_sha256_lanes")
    if lanes is not None:
        _mapping("payload_sha256_lanes", lanes)
        _whole("payload_sha256_lanes.lanes", lanes.get("lanes"), 1, 64)
        _text("payload_sha256_lanes.sha256", lanes.get("sha256"), pattern=HEX)
