"""Load a causal LM and its tokenizer: the embedded default, a Hub id, a local folder or a .gguf file."""

import importlib.util
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

import torch

from snapkv.base import fingerprint
from snapkv.base.errors import ConfigError, ModelNotFoundError, OutOfMemoryError
from snapkv.base.paths import models_dir
from snapkv.engine.conversion import EMBEDDED_NAME, convert_gguf, embedded_gguf_path
from snapkv.engine.memory import USABLE_SHARE, free_bytes
from snapkv.engine.prompting import Prompter
from snapkv.modeling.architectures import check_supported, layer_devices, text_config
from snapkv.native.threads import threads_now


@dataclass
class LoadedModel:
    """A model ready for prefill: weights, tokenizer, where it runs, and its name."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    weights: str = "as loaded"  # how decoding reads the weights (snapkv.modeling.block_weights), for reports
    prefill_dtype: torch.dtype | None = None  # where the prefill's matrix products run in another dtype than the
                                              # weights (CPU autocast; pick_precision), else None

    @property
    def precision(self) -> str:
        """The dtypes in words, for reports: "float32", or "float32 weights, bfloat16 prefill"."""
        weights = str(self.dtype).replace("torch.", "")
        if self.prefill_dtype is None:
            return weights
        return f"{weights} weights, {str(self.prefill_dtype).replace('torch.', '')} prefill"

    _identity: dict | None = None

    @property
    def identity(self) -> dict:
        """What a saved cache must match to be reused with this model (computed once)."""
        if self._identity is None:
            config = text_config(self.model)
            self._identity = {
                "name": self.name,
                "model_type": config.model_type,
                "config_sha256": fingerprint.config_hash(config),
                "weights_sha256": fingerprint.weights_hash(self.model),
                "tokenizer_sha256": fingerprint.tokenizer_hash(self.tokenizer),
                "chat_template_sha256": fingerprint.chat_template_hash(self.tokenizer),
                "rope": fingerprint.rope_settings(config),
                "num_layers": config.num_hidden_layers,
                "kv_heads": config.num_key_value_heads,
                "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            }
        return self._identity

    @cached_property
    def prompter(self) -> Prompter:
        """The chat template around documents and questions, with the default system message, tokenized once."""
        return Prompter(self.tokenizer)

    def prompter_for(self, system: str | None) -> Prompter:
        """The template with this system message (None: the default), each tokenized once."""
        if system is None or system == self.prompter.system:
            return self.prompter
        prompters = self.__dict__.setdefault("_prompters", {})
        if system not in prompters:
            prompters[system] = Prompter(self.tokenizer, system)
        return prompters[system]

    @property
    def layer_devices(self) -> list[torch.device]:
        """Where each layer's cache lives: its attention layer's device (several with a device_map)."""
        return layer_devices(self.model)

    @property
    def context_length(self) -> int:
        return int(getattr(text_config(self.model), "max_position_embeddings", 0) or 0)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end an answer: the generation config's EOS ids and the tokenizer's."""
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        end_of_turn = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id:
            ids.add(end_of_turn)
        return frozenset(ids)


def resolve_model_source(spec: str | None, on_convert: Callable[[int, int], None] | None = None) -> tuple[str, str]:
    """(display name, what from_pretrained loads) for a --model value; None means the embedded model.

    on_convert: progress of a GGUF file's one-time conversion, (steps done, steps in all).
    """
    if not spec:
        spec = os.environ.get("SNAPKV_MODEL") or None
    if not spec or spec == EMBEDDED_NAME:  # the name `snapkv models` prints for it is taken too
        return EMBEDDED_NAME, str(convert_gguf(embedded_gguf_path(), on_convert))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"no such GGUF file: {spec}")
        return path.stem, str(path)  # read in its own blocks (snapkv.engine.gguf_model), never converted
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec} is a folder but holds no config.json: not a Hugging Face model folder")
        return path.name, str(path)
    if path.exists():
        raise ModelNotFoundError(f"{spec} is a file but not a .gguf model; pass a .gguf file, a model folder or a Hub id")
    from snapkv.engine.catalog import installed_gguf

    installed = installed_gguf(spec)
    if installed is not None:  # a GGUF in the snapkv home, by its name (`snapkv models` lists them)
        return spec, str(installed)
    return spec, spec


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as error:
        raise ConfigError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from error
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but no CUDA GPU is available")
    return chosen


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cpu_has_bf16_units() -> bool:
    """True if the CPU multiplies bf16 natively (AMX or AVX512-BF16: Linux's /proc/cpuinfo flags) and PyTorch's kernels
    may use them (its CPU capability AVX-512: ATEN_CPU_CAPABILITY=avx2, as when measuring what an AVX2 box does, says
    no)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    if "amx_bf16" not in flags and "avx512_bf16" not in flags:
        return False
    return torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")


def cpu_description() -> str:
    """The CPU in a few words, for reports beside every figure: "AMD EPYC, 2 cores, AVX-512 with bf16"."""
    import os

    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        info = ""
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    vectors = ("AMX" if "amx_bf16" in flags else "AVX-512 with bf16" if "avx512_bf16" in flags
               else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{names[0] if names else 'unknown CPU'}, {cores} cores, {vectors}"


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on GPU; on CPU bf16 where the CPU has bf16 units (prefill measured 2.5x faster than
    fp32 there, see benchmarks/prefill.py dtype), else fp32."""
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_bf16_units():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def pick_precision(dtype: str, device: torch.device, weight_bytes: int) -> tuple[torch.dtype, torch.dtype | None]:
    """(the weights' dtype, the prefill's where it runs in another: CPU autocast, else None).

    auto on a CPU with bf16 units: fp32 weights, which the native decode reads (its 4/8-bit blocks, fp32 cache), with
    the prefill's matrix products in bf16, where those units make it 2.5-3x faster than fp32; bf16 throughout where
    fp32 weights (about weight_bytes, the files' size, times two) would take more than half of the machine's memory.
    auto on another CPU: fp32 throughout, or bf16 weights where fp32 would take more than half the memory (where the
    memory cannot be read, fp32). Any other choice: pick_dtype."""
    if dtype == "auto" and device.type == "cpu":
        memory = memory_bytes()
        fp32_fits = 2 * weight_bytes <= memory // 2
        if cpu_has_bf16_units():
            return (torch.float32, torch.bfloat16) if fp32_fits else (torch.bfloat16, None)
        return (torch.float32, None) if fp32_fits or memory == 0 else (torch.bfloat16, None)
    return pick_dtype(dtype, device), None


def memory_bytes() -> int:
    """The machine's memory (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _weight_bytes(source: str) -> int:
    """What a model's weight files take on disk (0 for a Hub id resolved elsewhere)."""
    folder = Path(source)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt") for f in folder.glob(pattern))


def pick_attention(device: torch.device) -> str:
    """flash_attention_2 on CUDA when flash-attn is installed; on CPU sdpa with decoding in 16 bits by plain
    matmuls (snapkv.modeling.cpu_attention: sdpa's bf16 kernel is slow for one query); else PyTorch's sdpa."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if device.type == "cpu":
        from snapkv.modeling import cpu_attention

        return cpu_attention.NAME
    return "sdpa"


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def load_model(spec: str | None = None, device: str = "auto", dtype: str = "auto",
               device_map: str | None = None, on_convert: Callable[[int, int], None] | None = None,
               block_weights: bool = True) -> LoadedModel:
    """Load a model for snapkv. Raises ModelNotFoundError or UnsupportedModelError with a clear message.

    device_map: spread the layers over the GPUs (and CPU) with accelerate ("auto", "balanced", ...), for
    models larger than one device; each layer's cache then lives on that layer's device.
    on_convert: progress of a GGUF file's one-time conversion (the embedded model's first load).
    block_weights: on CPU in fp32, decode from the weights' exact 4/8-bit blocks where they are such blocks
    (a GGUF's Q4_1/Q8_0 matrices; snapkv.modeling.block_weights). False: read the fp32 weights, to measure against.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    if device_map is not None and device_map not in DEVICE_MAPS:
        raise ConfigError(f"unknown device map {device_map!r}: use {', '.join(DEVICE_MAPS)}")
    torch_device = pick_device(device)
    threads_now()  # the first reading of what other processes use: the load's seconds are the first window
    name, source = resolve_model_source(spec, on_convert)
    if source.endswith(".gguf"):
        return _load_gguf(name, Path(source), torch_device, dtype, device_map, on_convert)
    torch_dtype, prefill_dtype = pick_precision(dtype, torch_device, _weight_bytes(source))
    transformers_logging.disable_progress_bar()  # loading takes seconds; its per-tensor bar is noise
    placement = {"device_map": device_map} if device_map else {}
    try:  # local_files_only: a Hub id resolves from the local Hugging Face cache, never from the network
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, attn_implementation=pick_attention(torch_device), local_files_only=True,
            **placement
        )
    except OSError as error:
        raise ModelNotFoundError(
            f"model {spec!r} is not a model folder, a .gguf file, or a model in the local Hugging Face cache, and "
            "snapkv never downloads. `snapkv models` lists the models that can be used here; to use a Hub model, "
            f"download it first (hf download {spec}) or pass its folder."
        ) from error
    check_supported(model)
    if device_map:
        torch_device = model.get_input_embeddings().weight.device  # where prompts enter the model
    else:
        model.to(torch_device)
    model.eval()
    weights = "as loaded"
    if block_weights and torch_device.type == "cpu" and torch_dtype == torch.float32 and not device_map:
        from snapkv.modeling.block_weights import use_block_weights

        weights = use_block_weights(model, saved_in=Path(source) if _converted_here(source) else None).describe()
    if torch_device.type == "cpu" and not device_map:
        weights = _plain_weights(model, narrow=block_weights) or weights
    return LoadedModel(model, tokenizer, name, torch_device, torch_dtype, weights, prefill_dtype)


def _blocks_prefill_dtype(dtype: str) -> torch.dtype | None:
    """The prefill's tiles' dtype for weights in GGUF blocks (decoded in fp32 either way): bf16 where asked, or under
    auto where the CPU has bf16 units; else None (fp32 tiles)."""
    return torch.bfloat16 if dtype in ("bfloat16", "bf16") or (dtype == "auto" and cpu_has_bf16_units()) else None


def _load_gguf(name: str, path: Path, device: torch.device, dtype: str, device_map: str | None,
               on_convert: Callable[[int, int], None] | None) -> LoadedModel:
    """A user's GGUF file, its weights read in the file's own blocks where it is mapped (snapkv.engine.gguf_model):
    on the CPU only, the products in fp32 from the blocks for a few rows, the prefill's tiles in bf16 where the CPU
    has bf16 units (else fp32) unless --dtype float32 asks for fp32 throughout."""
    from snapkv import native
    from snapkv.engine.gguf_model import load_gguf

    if device.type != "cpu" or device_map:
        raise ConfigError(f"{path.name}: a GGUF file runs on the CPU, in its own blocks; for a GPU, pass the "
                          "model's Hugging Face folder (safetensors)")
    reason = native.unavailable_reason()
    if reason:
        raise ConfigError(f"{path.name}: a GGUF file is read by snapkv's C kernels, which are unavailable here "
                          f"({reason})")
    if dtype not in ("auto", "float32", "fp32", "bfloat16", "bf16"):
        raise ConfigError(f"{path.name}: --dtype {dtype} is not one a GGUF file runs in: use auto, float32 or bfloat16")
    loaded = load_gguf(path, pick_attention(device), on_convert)
    check_supported(loaded.model)
    result = LoadedModel(loaded.model, loaded.tokenizer, name, device, torch.float32, loaded.describe(),
                         _blocks_prefill_dtype(dtype))
    result.__dict__["gguf"] = loaded  # the mapped file lives as long as the model
    return result


def _plain_weights(model, narrow: bool = True) -> str | None:
    """Where the kernels are available: an fp32 model's weights that are exactly bf16 values (a bf16 checkpoint) held
    in bf16 (with `narrow`), and q/k/v and gate/up weights that are not 4/8-bit blocks fused into one matrix each,
    which the native decode reads (snapkv.modeling.dense_weights). What was narrowed, in words (None: nothing)."""
    from snapkv import native
    from snapkv.modeling.dense_weights import fuse_dense, narrow_exact_bf16

    if native.unavailable_reason() is not None:
        return None
    narrowed = narrow_exact_bf16(model) if narrow and model.dtype == torch.float32 else 0
    fuse_dense(model)
    return f"{narrowed} linear layers held in bf16 (their exact values)" if narrowed else None


def _converted_here(source: str) -> bool:
    """Whether a model folder is one snapkv converted (under its home's models/, itself or by a link)."""
    path, home = Path(source), models_dir()
    return path.absolute().is_relative_to(home.absolute()) or path.resolve().is_relative_to(home.resolve())


def random_weights_model(config_file: str, device: str = "auto", dtype: str = "auto",
                         tokenizer: str | None = None, weight_blocks: str | None = None) -> LoadedModel:
    """A model of a real shape (a config.json) with random weights, for speed and memory only.

    tokenizer: a folder with tokenizer files to make the prompts; default the embedded model's. Answers
    are meaningless. Refused before any allocation when the weights alone would not fit in free memory.
    weight_blocks: a GGUF block type (Q4_K, Q6_K, Q8_0, ...): the weights random blocks of that type, read as a GGUF
    file's are (CPU only), so that a shape's speed and memory in a Q4_K_M file are measured with no file.
    """
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(config_file).expanduser()
    try:
        values = json.loads(path.read_text())
        config = AutoConfig.for_model(**values)
    except (OSError, ValueError, KeyError) as error:
        raise ModelNotFoundError(f"{config_file}: not a readable model config ({error})") from error
    torch_device = pick_device(device)
    if weight_blocks is not None:
        return _random_blocks_model(config, path.stem, torch_device, dtype, tokenizer, weight_blocks)
    torch_dtype = pick_dtype(dtype, torch_device)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    needed = parameters * torch.empty((), dtype=torch_dtype).element_size()
    free = free_bytes(torch_device)
    if needed > USABLE_SHARE * free:
        raise OutOfMemoryError(
            f"{path.name}: {parameters / 1e9:.1f}B parameters need {needed / 2**30:.1f} GiB in {torch_dtype}, "
            f"and only {free / 2**30:.1f} GiB is free on {torch_device}; use a GPU or a smaller shape"
        )
    torch.manual_seed(0)
    with torch_device:  # initialised where it will run, not copied there
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype,
                                                 attn_implementation=pick_attention(torch_device))
    check_supported(model)
    model.eval()
    if torch_device.type == "cpu":
        _plain_weights(model)
    return LoadedModel(model, _tokenizer_for(tokenizer), f"{path.stem} (random weights)", torch_device, torch_dtype)


def _tokenizer_for(tokenizer: str | None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer or resolve_model_source(None)[1], local_files_only=True)
    except OSError as error:
        raise ModelNotFoundError(f"tokenizer {tokenizer!r}: not a folder of tokenizer files ({error})") from error


def _random_blocks_model(config, stem: str, device: torch.device, dtype: str, tokenizer: str | None,
                         type_name: str) -> LoadedModel:
    """random_weights_model's weights as random blocks of a GGUF type (snapkv.engine.gguf_model.random_blocks_model),
    refused before any allocation where they would not fit in free memory."""
    from snapkv.engine.gguf_model import random_blocks_model
    from snapkv.modeling.gguf_file import TENSOR_TYPES
    from snapkv.modeling.gguf_weights import SCALE_FIELDS

    if device.type != "cpu":
        raise ConfigError("--weight-blocks: blocks of a GGUF type run on the CPU")
    if type_name not in SCALE_FIELDS:
        raise ConfigError(f"--weight-blocks {type_name}: use one of {', '.join(SCALE_FIELDS)}")
    _, elements, size = next(form for form in TENSOR_TYPES.values() if form[0] == type_name)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters() if p.dim() > 1)
    needed, free = parameters * size // elements, free_bytes(device)
    if needed > USABLE_SHARE * free:
        raise OutOfMemoryError(f"{stem}: {parameters / 1e9:.1f}B weights in {type_name} blocks need "
                               f"{needed / 2**30:.1f} GiB, and only {free / 2**30:.1f} GiB is free")
    try:
        model = random_blocks_model(config, pick_attention(device), type_name)
    except ValueError as error:
        raise ConfigError(f"--weight-blocks {type_name}: {error}") from error
    check_supported(model)
    return LoadedModel(model, _tokenizer_for(tokenizer), f"{stem} (random {type_name} blocks)", device, torch.float32,
                       f"random {type_name} blocks, {needed / 2**30:.2f} GiB", _blocks_prefill_dtype(dtype))


class ModelPool:
    """The model last asked for, kept loaded between commands (`snapkv serve`): asking again with the same
    settings costs nothing; other settings load the other model in its place."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._loaded: LoadedModel | None = None

    def get(self, spec: str | None = None, device: str = "auto", dtype: str = "auto", device_map: str | None = None,
            on_convert: Callable[[int, int], None] | None = None) -> LoadedModel:
        key = (spec or os.environ.get("SNAPKV_MODEL") or None, device, dtype, device_map)
        if key != self._key or self._loaded is None:
            self._key, self._loaded = None, None  # the old model can be freed before the new one loads
            self._loaded = load_model(spec, device=device, dtype=dtype, device_map=device_map, on_convert=on_convert)
            self._key = key
        return self._loaded


MODEL_POOL: ModelPool | None = None  # set by `snapkv serve`: commands it runs load their model from here
