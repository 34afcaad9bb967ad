"""The torch engine's question pass: a question's tokens through a Llama-family model on CPU (snapkv.engine.lean_decode
says which qualify) over a saved cache, written out as the few PyTorch calls each layer needs, each layer cut as
snapkv.compression.compress's hook would cut it, right after its attention. The same modules' weights and the same
arithmetic as the model's own forward: logits and kept positions to the bit (tests/test_engine.py).

q/k/v and gate/up each in one kernel call where their 4/8-bit blocks are fused, RoPE in one C call (the same bits). A
follow-up at 8k tokens of the embedded model: ~7 ms of a ~0.23 s pass (interleaved runs). The native engine's pass
(snapkv.engine.native_question) takes this module's parts where its C ones do not apply.
"""

from contextlib import nullcontext

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from snapkv import native
from snapkv.compression.compress import CompressionPlan, capturing, cut_layer
from snapkv.engine.lean_decode import GATE_UP, QKV, head_norms, rotate_half, rms_norm
from snapkv.engine.working_cache import WorkingCache
from snapkv.modeling.block_weights import fused_outputs


def question_mask(rows: int, cached: int) -> torch.Tensor:
    """(1, 1, rows, cached + rows) bool, True where attended: every cached position, and the question's own tokens
    causally (what transformers' sdpa mask holds for these rows after a cache of `cached`)."""
    mask = torch.ones(1, 1, rows, cached + rows, dtype=torch.bool)
    mask[..., cached:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    return mask


def with_rope(projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
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
    return (x * cos) + (rotate_half(x) * sin)


class LayerParts:
    """Each decoder layer's parts before and after its attention, in PyTorch's ops (the interface of
    snapkv.engine.native_decode.QuestionLayers, which computes them in C)."""

    def __init__(self, model) -> None:
        self._layers = model.model.layers

    def before(self, index: int, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden (1, q, hidden); cos, sin (1, q, head_dim) -> normed (1, q, hidden), query (1, heads, q, head_dim)
        with RoPE, key (1, kv_heads, q, head_dim) with RoPE, value (1, kv_heads, q, head_dim)."""
        layer = self._layers[index]
        attention = layer.self_attn
        normed = rms_norm(layer.input_layernorm, hidden)
        projected = fused_outputs(attention, QKV, normed) or [getattr(attention, name)(normed) for name in QKV]
        projected = head_norms(attention, *projected)
        query, key = (with_rope(part, cos, sin, attention.head_dim) for part in projected[:2])
        value = projected[2].view(1, hidden.shape[1], -1, attention.head_dim).transpose(1, 2)
        return normed, query, key, value

    def after(self, index: int, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (1, q, hidden) plus the attention's projection of attended (1, q, heads * head_dim), then plus the
        MLP's output: the layer's output."""
        layer = self._layers[index]
        hidden = hidden + layer.self_attn.o_proj(attended.contiguous())
        normed = rms_norm(layer.post_attention_layernorm, hidden)
        mlp = layer.mlp
        gate, up = fused_outputs(mlp, GATE_UP, normed) or [getattr(mlp, name)(normed) for name in GATE_UP]
        return hidden + mlp.down_proj(mlp.act_fn(gate) * up)


def attend_over_cache(model, attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      cache: WorkingCache, mask: torch.Tensor) -> torch.Tensor:
    """A layer's attention over its cache with the question's key and value appended (LayerParts.before's rows): its
    output (1, q, heads * head_dim)."""
    attend = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    keys, values = cache.update(key, value, attention.layer_idx)
    output, _ = attend(attention, query, keys, values, mask, dropout=0.0, scaling=attention.scaling)
    return output.reshape(1, query.shape[2], -1)


@torch.inference_mode()
def question_pass(model, question_ids: torch.Tensor, start: int, cache: WorkingCache,
                  plan: CompressionPlan | None) -> torch.Tensor:
    """The question's tokens (q,) at positions start.. appended to `cache`, each compressible layer then cut by `plan`
    (None: none is) as snapkv.compression.compress.compressing cuts it; the last token's logits (vocab,)."""
    inner = model.model
    parts = LayerParts(model)
    rows = question_ids.shape[0]
    hidden = inner.embed_tokens(question_ids.unsqueeze(0)).contiguous()  # (1, q, hidden)
    cos, sin = inner.rotary_emb(hidden, torch.arange(start, start + rows).unsqueeze(0))  # (1, q, head_dim) each
    mask = question_mask(rows, cache.get_seq_length())  # one mask for every layer, as transformers makes it
    with capturing(model, plan.window) if plan is not None else nullcontext(()) as cut_modules:
        for index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            normed, query, key, value = parts.before(index, hidden, cos, sin)
            attended = attend_over_cache(model, attention, query, key, value, cache, mask)
            if attention in cut_modules:  # as the hook cuts it, right after its attention
                cut_layer(plan, attention, normed, cache, (cos, sin))
            hidden = parts.after(index, attended, hidden)
    return model.lm_head(rms_norm(inner.norm, hidden)[:, -1:])[0, -1]
