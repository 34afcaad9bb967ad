"""Settings, validated once at construction; the defaults live here and nowhere else.

    SnapKVConfig  what a user asks for (the command-line flags, the library's one settings object)
    Cut           one selection of positions: a method, a budget and an observation window
    Tier          what a cache holds: the cut made at prefill (or every position) and any truncation

A SnapKVConfig says once which cut is made at prefill (`stored_tier`) and which per question
(`per_question`); a cache carries its Tier, so a saved file describes itself whatever the session
that later loads it is set to.
"""

import os
from dataclasses import dataclass, fields, replace
from typing import Literal

from snapkv.base.bits import Bits
from snapkv.base.errors import ConfigError
from snapkv.compression.methods import (METHODS, Method, Pooling, PseudoQuestion, SnapKV, method_from_dict,
                                        method_to_dict)

# The system message every prompt starts with unless one is given (--system, SNAPKV_SYSTEM): neutral, so that no
# template's own ("You are ... named SmolLM", "You are Qwen") speaks through the answers; "" uses the template's.
# The embedded model's own message without its name: "You are a helpful assistant." made it repeat itself in answers.
DEFAULT_SYSTEM = "You are a helpful AI assistant."


# Cut.pyramid: the first layer keeps this much more than the budget, the last this much less
PYRAMID_SPREAD = 0.5

Mode = Literal["full", "document-window", "tier-only", "query-aware"]
TruncateSide = Literal["start", "middle", "end"]


@dataclass(frozen=True)
class Cut:
    """Keep `budget` positions per KV head, the observation window's own `window` included, the rest
    chosen by `method`.

    keep: a stored tier may be asked for as a fraction of the document's positions instead; `sized_for`
    turns it into a budget for one prompt (the positions around the document are always kept too).
    chunk: a cut made during the prefill, chunk by chunk of this many tokens, cutting back to the budget
    after each (snapkv.engine.generation.chunked_prefill): bounded memory and linear attention cost.
    whole_words: a question's cut ranks each word (a number, a code, a name) as its best-scored token, so that a
    word is kept or dropped whole: "04817" is not cut to "04" (snapkv.compression.scoring.word_maxima). Needs the
    prompt's tokens (a per-question cut; the prefill's cut ignores it).
    numbers_with_neighbours: with whole_words, a word holding a digit ranks as one with the words either side ("on 14
    March 2025 at"), so that a figure is kept with what it counts and a date with its year (Prompter.word_ids).
    pyramid: a question's cut keeps more in the lower layers and fewer in the upper ones, the same in all
    (prefix_keep_at); the prefill's cut ignores it.
    """

    budget: int | None
    window: int
    method: Method = SnapKV()
    keep: float | None = None
    chunk: int | None = None
    whole_words: bool = False
    pyramid: bool = False
    numbers_with_neighbours: bool = False

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"window must be at least 1, got {self.window}")
        if self.numbers_with_neighbours and not self.whole_words:
            raise ConfigError("numbers are kept with their neighbours by a cut that keeps words whole")
        if self.keep is not None and not 0 < self.keep <= 1:
            raise ConfigError(f"the kept fraction must be above 0 and at most 1, got {self.keep}")
        if self.budget is None and self.keep is None:
            raise ConfigError("a cut needs a budget or a kept fraction")
        if self.chunk is not None and (self.chunk <= self.window or not self.method.scores_during_prefill
                                       or self.budget is None):
            raise ConfigError(f"a prefill in chunks needs chunks longer than the window ({self.window}), got "
                              f"{self.chunk}, and a budget cut by a method that scores during the prefill (snapkv)")
        if self.budget is not None and self.budget <= self.window:
            raise ConfigError(
                f"budget ({self.budget}) must be larger than the observation window ({self.window}): "
                "the budget counts the window's own positions"
            )

    @property
    def prefix_keep(self) -> int:
        """Positions kept outside the observation window."""
        return self.budget - self.window

    def prefix_keep_at(self, layer: int, layers: int) -> int:
        """Positions kept outside the window in layer `layer` of `layers`: prefix_keep in every layer, or with
        `pyramid` from (1 + PYRAMID_SPREAD) x prefix_keep in the first layer down to (1 - PYRAMID_SPREAD) x in the
        last, linearly, the same in all (PyramidKV, arXiv 2406.02069: lower layers attend broadly, upper ones
        narrowly)."""
        if not self.pyramid or layers < 2:
            return self.prefix_keep
        return max(1, round(self.prefix_keep * (1 + PYRAMID_SPREAD * (1 - 2 * layer / (layers - 1)))))

    def sized_for(self, length: int, document: range) -> "Cut":
        """This cut with its budget for a prompt of `length` positions holding the document at `document`."""
        if self.keep is None:
            return self
        around = length - len(document)
        budget = max(around + round(self.keep * len(document)), self.window + 1)
        return replace(self, budget=budget)

    def to_dict(self) -> dict:
        kept = {"keep": self.keep} if self.keep is not None else {}
        # "prefill_chunk", not "chunk": a method's own settings (Reconstruction's chunk) share this dict
        chunked = {"prefill_chunk": self.chunk} if self.chunk is not None else {}
        words = {"whole_words": True} if self.whole_words else {}
        words |= {"pyramid": True} if self.pyramid else {}
        words |= {"numbers_with_neighbours": True} if self.numbers_with_neighbours else {}
        return {"budget": self.budget, "window": self.window, **kept, **chunked, **words, **method_to_dict(self.method)}

    @classmethod
    def from_dict(cls, data: dict) -> "Cut":
        data = dict(data)
        try:
            budget, window = data.pop("budget"), int(data.pop("window"))
            keep, chunk = data.pop("keep", None), data.pop("prefill_chunk", None)
            words, pyramid = bool(data.pop("whole_words", False)), bool(data.pop("pyramid", False))
            numbers = bool(data.pop("numbers_with_neighbours", False))
            budget = None if budget is None else int(budget)
            keep = None if keep is None else float(keep)
            chunk = None if chunk is None else int(chunk)
        except (KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"a cut needs a whole budget or a fraction, and a window, got {data!r}") from error
        return cls(budget, window, method_from_dict(data), keep, chunk, words, pyramid, numbers)

    def describe(self) -> str:
        method = self.method
        extras = ", ".join(f"{f.name} {getattr(method, f.name)}" for f in fields(method))
        size = f"{self.keep:.0%} of the document" if self.keep is not None else ""
        if self.budget is not None:
            size += f"{' = ' if size else ''}budget {self.budget}"
        chunked = f"; prefilled in chunks of {self.chunk}" if self.chunk is not None else ""
        words = ", whole words" if self.whole_words else ""
        words += ", numbers with their neighbours" if self.numbers_with_neighbours else ""
        words += ", budgets per layer from 1.5x to 0.5x" if self.pyramid else ""
        return f"{method.name} {size} (window {self.window}{', ' + extras if extras else ''}{words}{chunked})"


@dataclass(frozen=True)
class Truncation:
    """A document cut to fit the model's context: which part was removed, and how many tokens."""

    side: TruncateSide
    tokens: int

    def to_dict(self) -> dict:
        return {"side": self.side, "tokens": self.tokens}


@dataclass(frozen=True)
class Tier:
    """What a cache holds: the cut that chose its positions (None: every prompt position), the bits each
    key and value is stored in, and any truncation."""

    cut: Cut | None = None
    bits: Bits = Bits(16)  # an int or "4/3" is taken too
    truncation: Truncation | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", parse_bits(self.bits, "stored bits"))

    def to_dict(self) -> dict:
        return {"cut": self.cut.to_dict() if self.cut else None, "bits": self.bits.to_json(),
                "truncation": self.truncation.to_dict() if self.truncation else None}

    @classmethod
    def from_dict(cls, data: dict) -> "Tier":
        truncation = data.get("truncation")
        return cls(cut=Cut.from_dict(data["cut"]) if data.get("cut") else None, bits=data.get("bits", 16),
                   truncation=Truncation(**truncation) if truncation else None)

    def describe(self) -> str:
        held = "whole prompt" if self.cut is None else self.cut.describe()
        held += f", {self.bits.describe()}"
        if self.truncation:
            held += f"; document cut by {self.truncation.tokens} tokens at the {self.truncation.side}"
        return held


def parse_bits(bits: "Bits | int | str", name: str) -> Bits:
    try:
        return Bits.parse(bits)
    except ValueError as error:
        raise ConfigError(f"{name}: {error}") from None


def mode_of(stored: Cut | None, per_question: Cut | None) -> Mode:
    """The name of a way of answering: cut per question (query-aware); else from all that is held, which is
    everything (full), a cut made at prefill with the document's tail as the window (document-window), or a
    stored tier chosen after the prefill (tier-only)."""
    if per_question is not None:
        return "query-aware"
    if stored is None:
        return "full"
    return "document-window" if stored.method.scores_during_prefill else "tier-only"


CHUNKED_STORE_FACTOR = 4  # query-aware with a chunked prefill: the stored tier, in budgets, when not given


@dataclass(frozen=True)
class SnapKVConfig:
    """How a prompt's KV cache is compressed.

    budget:       positions kept per KV head per layer, the observation window included.
    window:       the last `window` prompt positions whose attention decides what is kept.
    kernel:       width of the 1-D pooling over the scores (odd), so that clusters survive.
    pooling:      "max" or "avg" pooling.
    query_aware:  if True, the stored tier is what is saved (below) and each question is run through the
                  model as the observation window, compressing to `budget` per question. If False, the
                  cache is compressed once at prefill to `budget` with the prompt's tail as the window.
    method:       the per-question (and document-window) scoring method's name (see snapkv.compression.methods).
    store_keep:   query-aware: the fraction of the document's positions the stored tier keeps, chosen by
                  `store_method`; None (with no store_budget) keeps the whole prompt.
    store_budget: query-aware: the stored tier as positions per head instead of a fraction.
    store_method: how the stored tier is chosen: reconstruction, snapkv (the document's tail as the window),
                  pseudo-question or key-norm (see snapkv.compression.methods), or such a method with its own settings.
    store_bits:   bits per stored key and value (any mode): 16, 8, 4, 3 or 2, or keys and values apart as
                  KEYS/VALUES (Bits(4, 3), or "4/3"); below 8 bits Hadamard-rotated (snapkv.storage.quantize), a
                  kind's rotation or group size chosen after its bits ("8r/8": 8-bit keys rotated, "8/4g32"); with
                  a sharper share, "4/2+20%@4": each head's 20% of positions the pseudo-question probes rank
                  highest in 4 bits, the rest in 4/2 (snapkv.engine.tiers.sharper_positions).
    store_kernel: pooling width over the stored tier's scores, for methods that pool (None: `kernel` for the
                  methods that score as SnapKV does, the method's own default for the others).
    whole_words:  query-aware: each question's cut keeps or drops a word (a number, a code, a name) whole (Cut).
    pyramid, numbers_with_neighbours: query-aware: the question's cut with budgets per layer, or numbers ranked with the
                  words either side (Cut); measured, not the default (docs/how-it-works.md, "Defaults, and why").
    prefill_chunk: prefill prompts longer than this in chunks of this many tokens, cutting every layer back
                  after each chunk with SnapKV (the chunk's tail as the window): memory bounded, attention cost
                  linear. The stored tier is then made that way: `budget` positions (document-window), or
                  `store_budget` (default 4 x budget) in query-aware mode, cut to `budget` per question;
                  store_keep and store_method do not apply. None: the exact prefill.
    """

    # budget and whole_words chosen by `snapkv eval fidelity` against the full cache (docs/how-it-works.md, "Defaults,
    # and why"): at 2048 with words kept whole the cut lost 1 fact the full cache found; token by token, 6
    budget: int = 2048
    window: int = 32
    kernel: int = SnapKV.kernel
    pooling: Pooling = SnapKV.pooling
    query_aware: bool = True
    store_budget: int | None = None
    method: str = SnapKV.name
    # The saved file by default: the whole prompt, keys and values in 8 bits (1.77x smaller than 16 bits).
    # Chosen by `snapkv eval fidelity` (README "What is saved"): the smallest tier measured to lose no fact the
    # 16-bit file answers. At the default cut (2048, whole words; 322 questions) it lost none and changed an answer
    # the 16-bit file had right 3 times, as 16/8 did (1.28x); its other changes were in answers the 16-bit file
    # had wrong too. Rotated 8-bit keys (8r/8) lost 1, every smaller tier more.
    store_keep: float | None = None
    store_method: str | Method = PseudoQuestion.name
    store_bits: Bits = Bits(8)  # an int, "16/8", "4/3", "8r/8" or "3/2+20%@8/4" is taken too
    store_kernel: int | None = None
    prefill_chunk: int | None = None
    whole_words: bool = True
    pyramid: bool = False
    numbers_with_neighbours: bool = False

    def __post_init__(self) -> None:
        self.cut  # validates budget, window and the method's own settings
        self.stored_tier  # and the stored tier's
        if self.store_budget is not None and self.store_budget < self.budget:
            raise ConfigError(
                f"store_budget ({self.store_budget}) must be at least the budget ({self.budget})"
            )
        if self.store_keep is not None and not 0 < self.store_keep <= 1:
            raise ConfigError(f"store_keep is a fraction above 0 and at most 1, got {self.store_keep}")
        if self.store_budget is not None and self.store_keep is not None:
            raise ConfigError("give the stored tier as a fraction (store_keep) or as positions (store_budget), not both")
        if isinstance(self.store_method, str) and self.store_method not in METHODS:
            raise ConfigError(f"unknown stored-tier method {self.store_method!r}; known: {', '.join(sorted(METHODS))}")
        object.__setattr__(self, "store_bits", parse_bits(self.store_bits, "store_bits"))

    @property
    def scorer(self) -> Method:
        return method_from_dict({"method": self.method, "kernel": self.kernel, "pooling": self.pooling})

    @property
    def cut(self) -> Cut:
        """The cut at `budget` these settings describe."""
        return Cut(self.budget, self.window, self.scorer, whole_words=self.whole_words, pyramid=self.pyramid,
                   numbers_with_neighbours=self.numbers_with_neighbours)

    @property
    def store_scorer(self) -> Method:
        """The stored tier's method, pooling its scores over `store_kernel` (default: `kernel`) where it pools;
        `store_method` may also be a method with settings of its own, taken as it is."""
        if not isinstance(self.store_method, str):
            return self.store_method
        settings = {"method": self.store_method}
        method_fields = {f.name for f in fields(METHODS.get(self.store_method, SnapKV))}
        if "pooling" in method_fields:  # SnapKV's scores with other windows: pooled as the per-question cut is
            settings.update(kernel=self.kernel, pooling=self.pooling)
        if "kernel" in method_fields and self.store_kernel is not None:
            settings["kernel"] = self.store_kernel
        return method_from_dict(settings)

    @property
    def stored_tier(self) -> Cut | None:
        """The cut that chooses what is stored (at prefill, or after it): None keeps every position."""
        if self.prefill_chunk is not None:
            bound = self.budget if not self.query_aware else self.store_budget or CHUNKED_STORE_FACTOR * self.budget
            return Cut(bound, self.window, self.scorer, chunk=self.prefill_chunk)
        if not self.query_aware:
            return replace(self.cut, whole_words=False, pyramid=False, numbers_with_neighbours=False)  # the prompt's tail as the window: no words to keep whole
        if self.store_budget is None and (self.store_keep is None or self.store_keep >= 1):
            return None  # the whole prompt
        return Cut(self.store_budget, self.window, self.store_scorer, self.store_keep)

    @property
    def per_question(self) -> Cut | None:
        """The cut made for each question, with the question as the window (query-aware mode only)."""
        return self.cut if self.query_aware else None

    @property
    def mode(self) -> Mode:
        return mode_of(self.stored_tier, self.per_question)


DEFAULTS = SnapKVConfig()


@dataclass(frozen=True)
class Plan:
    """SnapKVConfig resolved once (a Session does it when it is made) and passed down as it is: nothing below
    parses settings again.

    stored:       the stored tier's cut (None: every position is kept, the full cache)
    bits:         the bits it is stored in
    per_question: the cut each question makes of it (None: answered from the tier as it is)
    """

    stored: Cut | None
    bits: Bits
    per_question: Cut | None

    @classmethod
    def of(cls, settings: SnapKVConfig | None) -> "Plan":
        """The plan of some settings; None (the full cache, the baseline) is kept whole in 16 bits."""
        if settings is None:
            return cls(None, Bits(16), None)
        return cls(settings.stored_tier, settings.store_bits, settings.per_question)

    @property
    def mode(self) -> Mode:
        return mode_of(self.stored, self.per_question)

    def sized_for(self, length: int, document: range) -> "Plan":
        """This plan with its stored cut's budget for a prompt of `length` positions holding the document at
        `document` (Cut.sized_for)."""
        return replace(self, stored=self.stored.sized_for(length, document) if self.stored is not None else None)

    @property
    def during_prefill(self) -> Cut | None:
        """The stored cut where it is made as the prompt is prefilled (SnapKV's document window), else None."""
        return self.stored if self.stored is not None and self.stored.method.scores_during_prefill else None

    @property
    def after_prefill(self) -> Cut | None:
        """The stored cut where it is chosen after the prefill, by probes (the query-aware tiers), else None."""
        return self.stored if self.stored is not None and not self.stored.method.scores_during_prefill else None


# ---- how answers run (snapkv.engine.engines) and which C kernels (snapkv.native): read from the environment ----

ENGINE_SETTING = "SNAPKV_ENGINE"
ENGINE_CHOICES = ("auto", "native", "torch", "compiled", "reference")


def engine_setting(value: str | None = None) -> str:
    """The engine asked for: `value`, else SNAPKV_ENGINE, else auto; ConfigError for a name it does not take."""
    chosen = (value if value is not None else os.environ.get(ENGINE_SETTING, "")).strip().lower() or "auto"
    if chosen not in ENGINE_CHOICES:
        raise ConfigError(f"the engine is one of {', '.join(ENGINE_CHOICES)}, not {chosen!r} "
                          f"(--engine or {ENGINE_SETTING})")
    return chosen


def check_runtime_settings() -> None:
    """SNAPKV_ENGINE, SNAPKV_THREADS and SNAPKV_KERNELS, checked before a command loads anything: ConfigError for a
    bad value."""
    from snapkv import native
    from snapkv.native.threads import threads_setting

    engine_setting()
    threads_setting()
    try:
        native.setting()
    except ValueError as error:
        raise ConfigError(str(error)) from None
