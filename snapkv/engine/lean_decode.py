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

question_pass does the same for a question's tokens over a saved cache, cutting each layer as snapkv.compression.compress's hook
would, right after its attention; q/k/v and gate/up each in one kernel call where their blocks are fused, RoPE in one C
call (the same bits). A follow-up at 8k tokens of the embedded model: ~7 ms of a ~0.23 s pass (interleaved runs). With
snapkv.engine.native_decode's QuestionLayers the parts around each attention run in C instead (within rounding), and a layer
of a deferred cache is attended and cut straight from its codes (snapkv.engine.coded_attention, within rounding too) rather
than restored whole first.
"""

from contextlib import nullcontext

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from snapkv import native
from snapkv.compression.compress import CompressionPlan, capturing, cut_layer
from snapkv.engine.coded_attention import attend_and_cut
from snapkv.modeling.block_weights import FUSIBLE, fused_outputs

PLAIN_LLAMA = ("llama", "mistral", "qwen2")
QKV, GATE_UP = FUSIBLE  # projections read by one kernel call where their 4/8-bit blocks are fused


def _has_hooks(model) -> bool:
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def qualifies(model, cache: DynamicCache) -> bool:
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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def decode_step(model, token: int, position: int, cache: DynamicCache) -> torch.Tensor:
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
        query, key, value = (part.view(shape).transpose(1, 2) for part in projected)
        query = (query * cos) + (_rotate_half(query) * sin)
        key = (key * cos) + (_rotate_half(key) * sin)
        keys, values = cache.update(key, value, attention.layer_idx)
        output, _ = attend(attention, query, keys, values, None, dropout=0.0, scaling=attention.scaling)
        hidden = hidden + attention.o_proj(output.reshape(1, 1, -1).contiguous())
        normed = rms_norm(layer.post_attention_layernorm, hidden)
        mlp = layer.mlp
        gate, up = fused_outputs(mlp, GATE_UP, normed) or [getattr(mlp, name)(normed) for name in GATE_UP]
        hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
    return model.lm_head(rms_norm(inner.norm, hidden))[0, -1]


def _question_mask(rows: int, cached: int) -> torch.Tensor:
    """(1, 1, rows, cached + rows) bool, True where attended: every cached position, and the question's own tokens
    causally (what transformers' sdpa mask holds for these rows after a cache of `cached`)."""
    mask = torch.ones(1, 1, rows, cached + rows, dtype=torch.bool)
    mask[..., cached:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    return mask


def _with_rope(projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A question's q or k projection (1, q, heads * head_dim) -> (1, heads, q, head_dim) with RoPE, as
    apply_rotary_pos_emb computes it: in one C call in fp32 on CPU (snapkv/native/kernels/decode_step.c's rope_rows, the
    same bits, written in the layout attention reads), else PyTorch's ops. cos, sin: (1, q, head_dim)."""
    _, rows, width = projected.shape
    if (projected.dtype == cos.dtype == sin.dtype == torch.float32 and projected.device.type == "cpu"
            and native.unavailable_reason() is None):
        x, cos, sin = projected.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty(1, width // head_dim, rows, head_dim)
        fp32, angles = torch.float32, (1, rows, head_dim)
        if native.kernels().rope_rows(native.pointer(x, fp32, (1, rows, width)), rows, width // head_dim, head_dim,
                                      native.pointer(cos, fp32, angles), native.pointer(sin, fp32, angles),
                                      native.pointer(out, fp32)) == 0:
            return out
    x = projected.view(1, rows, -1, head_dim).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (1, 1, q, head_dim): over the heads
    return (x * cos) + (_rotate_half(x) * sin)


@torch.inference_mode()
def question_pass(model, question_ids: torch.Tensor, start: int, cache: DynamicCache,
                  plan: CompressionPlan | None, layers=None, from_codes: bool = False) -> torch.Tensor:
    """The question's tokens (q,) at positions start.. appended to `cache`, each compressible layer then cut by `plan`
    (None: none is) as snapkv.compression.compress.compressing cuts it; the last token's logits (vocab,).

    layers: a snapkv.engine.native_decode.QuestionLayers: each layer's parts before and after its attention in C (the same
    formulas summed in another order: logits within rounding of these PyTorch ops'), or None: PyTorch's ops.
    from_codes: each cut layer of a deferred cache attended and cut straight from its codes where
    snapkv.engine.coded_attention takes it (within rounding of restoring it first); False: every layer restored, so that
    the pass is the model's forward to the bit."""
    inner = model.model
    attend = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    rows = question_ids.shape[0]
    hidden = inner.embed_tokens(question_ids.unsqueeze(0)).contiguous()  # (1, q, hidden): its own, written in place
    cos, sin = inner.rotary_emb(hidden, torch.arange(start, start + rows).unsqueeze(0))  # (1, q, head_dim) each
    mask = _question_mask(rows, cache.get_seq_length())  # one mask for every layer, as transformers makes it
    with capturing(model, plan.window) if plan is not None else nullcontext(()) as cut_modules:
        for index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            # (1, heads, q, head_dim) and (1, kv_heads, q, head_dim)
            if layers is not None:
                normed, query, key, value = layers.before(index, hidden, cos, sin)
            else:
                normed = rms_norm(layer.input_layernorm, hidden)
                projected = fused_outputs(attention, QKV, normed) or [getattr(attention, name)(normed) for name in QKV]
                query, key = (_with_rope(part, cos, sin, attention.head_dim) for part in projected[:2])
                value = projected[2].view(1, rows, -1, attention.head_dim).transpose(1, 2)
            attended = None  # (1, q, heads * head_dim)
            if from_codes and attention in cut_modules:  # straight from the layer's codes where it can
                attended = attend_and_cut(attention, query, key, value, cache.layers[attention.layer_idx], plan)
            if attended is None:
                keys, values = cache.update(key, value, attention.layer_idx)
                output, _ = attend(attention, query, keys, values, mask, dropout=0.0, scaling=attention.scaling)
                if attention in cut_modules:
                    cut_layer(plan, attention, normed, cache, (cos, sin))
                attended = output.reshape(1, rows, -1)
            if layers is not None:
                layers.after(index, attended, hidden)  # in place
                continue
            hidden = hidden + attention.o_proj(attended.contiguous())
            normed = rms_norm(layer.post_attention_layernorm, hidden)
            mlp = layer.mlp
            gate, up = fused_outputs(mlp, GATE_UP, normed) or [getattr(mlp, name)(normed) for name in GATE_UP]
            hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
    return model.lm_head(rms_norm(inner.norm, hidden)[:, -1:])[0, -1]
