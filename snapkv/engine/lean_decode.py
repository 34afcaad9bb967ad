"""One decoded token, or a question's pass, through a Llama-family model on CPU, written out as the few PyTorch calls
it needs.

transformers' forward of one token through the embedded model makes about 2,400 PyTorch calls, with Python
around each layer (mask construction, keyword plumbing, output wrappers, module hooks); on a 2-core CPU that
costs more per token than reading the weights from their 4-bit blocks. For the architectures whose decoder
layer is plain Llama (pre-norm RMSNorm, q/k/v/o projections with RoPE, a gated MLP: Llama, Mistral, Qwen2)
this step computes the same thing with the same modules' weights, the same rotary embedding module, the same
attention function and the same arithmetic (each formula as transformers writes it, so fp32 results agree to
the bit), and none of the plumbing. Everything else (other architectures, sliding windows, GPUs, a model
with hooks such as accelerate's device_map) keeps the model's own forward. Checked against it, logits and
greedy tokens, in tests/test_engine.py. Where the projections are also 4/8-bit blocks (the embedded model in fp32),
snapkv.engine.native_decode runs these same layers in one C call per token instead.

A question's pass over a saved cache is the torch engine's snapkv.engine.torch_question (the native engine's:
snapkv.engine.native_question); both take `qualifies` and `rms_norm` from here.
"""

import torch
from transformers.cache_utils import DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from snapkv.engine.working_cache import WorkingCache
from snapkv.modeling.block_weights import FUSIBLE, fused_outputs

PLAIN_LLAMA = ("llama", "mistral", "qwen2", "qwen3")  # Qwen3: a Llama with each q and k head RMS-normed
QKV, GATE_UP = FUSIBLE  # projections read by one kernel call where their 4/8-bit blocks are fused


def _has_hooks(model) -> bool:
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def qualifies(model, cache: WorkingCache) -> bool:
    """A plain Llama-family decoder on CPU, every layer full attention in a plain (or presized) cache layer,
    no module hooks."""
    config = model.config
    if config.model_type not in PLAIN_LLAMA or getattr(config, "hidden_act", None) != "silu":
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False  # Mistral/Qwen2 with a window: the model's own masks
    if getattr(config, "pretraining_tp", 1) != 1 or getattr(config, "mlp_bias", False):
        return False
    if config._attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        return False  # eager attention: the model's own forward
    device = model.get_input_embeddings().weight.device
    return (device.type == "cpu" and all(isinstance(layer, DynamicLayer) for layer in cache.layers)
            and not _has_hooks(model))


def rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """As transformers' LlamaRMSNorm computes it."""
    states = hidden.to(torch.float32)
    variance = states.pow(2).mean(-1, keepdim=True)
    states = states * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * states.to(hidden.dtype)


def head_norms(attention: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projections (..., heads * head_dim) with each q and k head RMS-normed where the attention has norms
    for them (Qwen3's q_norm and k_norm, as its forward applies them: before RoPE); as they are elsewhere."""
    if getattr(attention, "q_norm", None) is None:
        return query, key, value
    head_dim = attention.head_dim
    query, key = (rms_norm(norm, part.view(*part.shape[:-1], -1, head_dim)).flatten(-2)
                  for norm, part in ((attention.q_norm, query), (attention.k_norm, key)))
    return query, key, value


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def decode_step(model, token: int, position: int, cache: WorkingCache) -> torch.Tensor:
    """Append `token` at `position` to `cache`; the next logits (vocab,)."""
    inner = model.model
    attend = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    hidden = inner.embed_tokens(torch.tensor([[token]]))  # (1, 1, hidden)
    cos, sin = inner.rotary_emb(hidden, torch.tensor([[position]]))  # (1, 1, head_dim) each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (1, 1, 1, head_dim): over the heads
    for layer in inner.layers:
        attention = layer.self_attn
        normed = rms_norm(layer.input_layernorm, hidden)
        shape = (1, 1, -1, attention.head_dim)
        # (1, heads, 1, head_dim) and (1, kv_heads, 1, head_dim)
        projected = fused_outputs(attention, QKV, normed) or [getattr(attention, name)(normed) for name in QKV]
        query, key, value = (part.view(shape) for part in head_norms(attention, *projected))
        query, key, value = (part.transpose(1, 2) for part in (query, key, value))
        query = (query * cos) + (rotate_half(query) * sin)
        key = (key * cos) + (rotate_half(key) * sin)
        keys, values = cache.update(key, value, attention.layer_idx)
        output, _ = attend(attention, query, keys, values, None, dropout=0.0, scaling=attention.scaling)
        hidden = hidden + attention.o_proj(output.reshape(1, 1, -1).contiguous())
        normed = rms_norm(layer.post_attention_layernorm, hidden)
        mlp = layer.mlp
        gate, up = fused_outputs(mlp, GATE_UP, normed) or [getattr(mlp, name)(normed) for name in GATE_UP]
        hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
    return model.lm_head(rms_norm(inner.norm, hidden))[0, -1]
