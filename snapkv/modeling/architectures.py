"""What snapkv needs to know about each supported model family's attention layers.

SnapKV scores keys with the observation window's queries after RoPE. transformers does not keep
those queries, so they are recomputed for the window's few positions from the layer's own
projections, norms and RoPE function, exactly as the layer's forward computes them.
"""

import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from snapkv.base.errors import UnsupportedModelError
from snapkv.base.supported import SUPPORTED_MODEL_TYPES


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module and whether snapkv compresses its cache."""

    index: int
    module: nn.Module
    compressible: bool  # False for sliding-window layers, whose cache is bounded already


def text_config(model: nn.Module):
    """The config that describes the decoder (multimodal wrappers keep it under text_config)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_supported(model: nn.Module) -> str:
    model_type = text_config(model).model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"snapkv does not know how to compress the attention of '{model_type}' models; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


_found_layers: "weakref.WeakKeyDictionary[nn.Module, tuple[AttentionLayer, ...]]" = weakref.WeakKeyDictionary()


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """The decoder's attention modules in layer order. Found once per model, then remembered while it lives (a
    walk over every module: ~1.5 ms for the embedded model, twice in each follow-up question otherwise); snapkv
    never replaces a loaded model's attention modules."""
    found = _found_layers.get(model)
    if found is None:
        found = _found_layers[model] = tuple(_walked_attention_layers(model))
    return list(found)


def _walked_attention_layers(model: nn.Module) -> list[AttentionLayer]:
    check_supported(model)
    layers = []
    for name, module in model.named_modules():
        if name.endswith("self_attn") and hasattr(module, "layer_idx"):
            sliding = bool(getattr(module, "is_sliding", False) or getattr(module, "sliding_window", None))
            layers.append(AttentionLayer(module.layer_idx, module, compressible=not sliding))
    layers.sort(key=lambda layer: layer.index)
    if not layers:
        raise UnsupportedModelError("found no attention layers (modules named 'self_attn') in this model")
    return layers


def window_queries(
    module: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Queries after RoPE for the given positions, as the layer's forward computes them.

    hidden_states: (batch, w, hidden), the layer's input at the window positions.
    position_embeddings: (cos, sin) for those positions, each (batch, w, rotary_dim).
    Returns (batch, q_heads, w, head_dim).
    """
    batch, w, _ = hidden_states.shape
    head_dim = module.head_dim
    if hasattr(module, "qkv_proj"):  # Phi3 fuses q, k and v into one projection
        query_width = module.config.num_attention_heads * head_dim
        queries = module.qkv_proj(hidden_states)[..., :query_width]
    else:
        queries = module.q_proj(hidden_states)
    # (batch, w, q_heads, head_dim)
    queries = queries.view(batch, w, -1, head_dim)
    if hasattr(module, "q_norm"):  # Qwen3, Gemma3: RMSNorm over head_dim before RoPE
        queries = module.q_norm(queries)
    # (batch, q_heads, w, head_dim)
    queries = queries.transpose(1, 2)
    apply_rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
    cos, sin = position_embeddings
    queries, _ = apply_rotary(queries, queries, cos, sin)
    return queries


def feed_forward_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP (modules named '<layer>.mlp' beside a 'self_attn'), in layer order."""
    modules = dict(model.named_modules())
    found = []
    for layer in attention_layers(model):
        attention_name = next(name for name, module in modules.items() if module is layer.module)
        mlp = modules.get(attention_name.removesuffix("self_attn") + "mlp")
        if mlp is not None:
            found.append(mlp)
    return found


def layer_devices(model: nn.Module) -> list[torch.device]:
    """The device each attention layer runs on (several with accelerate's device_map), in layer order."""
    # a layer's parameters, or its buffers where it has none (a GGUF file's projections hold blocks, not parameters)
    return [next(iter([*layer.module.parameters(), *layer.module.buffers()])).device
            for layer in attention_layers(model)]


@contextmanager
def hooked_attention(model: nn.Module, hook: Callable, *, compressible_only: bool = False,
                     with_kwargs: bool = False) -> Iterator[None]:
    """Within the block, `hook` runs after the forward of every attention module (only those snapkv compresses, with
    compressible_only), as torch's forward hooks run: (module, args, output), or (module, args, kwargs, output) with
    with_kwargs."""
    handles = []
    try:
        for layer in attention_layers(model):
            if layer.compressible or not compressible_only:
                handles.append(layer.module.register_forward_hook(hook, with_kwargs=with_kwargs))
        yield
    finally:
        for handle in handles:
            handle.remove()
