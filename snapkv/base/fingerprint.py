"""Identities that decide whether a saved cache may be reused: model, tokenizer, chat template."""

import hashlib
import json

import torch

# Config fields that describe how a model was loaded or saved, not what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation",
                         "_attn_implementation_internal", "attn_implementation", "use_cache", "architectures",
                         "_commit_hash", "quantization_config"}
_SAMPLE = 256


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_hash(config) -> str:
    values = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return _sha256(json.dumps(values, sort_keys=True, default=str).encode())


@torch.no_grad()
def weights_hash(model: torch.nn.Module) -> str:
    """A digest of every parameter's name, shape and a strided sample of its values (in fp32).

    Reading all weights of a 8B model would take seconds; fine-tunes and other seeds differ in every
    tensor, so a sample of each tells them apart. Values are hashed in fp32 so that the same weights
    loaded in bf16 or fp32 hash alike only when they are equal after rounding to bf16.
    """
    digest = hashlib.sha256()
    for name, parameter in sorted(model.state_dict().items()):
        flat = parameter.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLE)
        sample = flat[::step][:_SAMPLE].to(device="cpu", dtype=torch.bfloat16).float()
        digest.update(f"{name}:{tuple(parameter.shape)}:".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return _sha256(backend.to_str().encode())
    vocab = sorted(tokenizer.get_vocab().items())
    return _sha256(json.dumps(vocab).encode())


def chat_template_hash(tokenizer) -> str:
    return _sha256((getattr(tokenizer, "chat_template", None) or "").encode())


def rope_settings(config) -> dict:
    """The settings that decide what RoPE did to the stored keys."""
    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "partial_rotary_factor",
            "head_dim", "rope_local_base_freq", "sliding_window")
    values = config.to_dict()
    return {k: values[k] for k in keys if k in values}
