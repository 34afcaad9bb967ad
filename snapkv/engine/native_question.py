"""The native engine's question pass: the torch engine's (snapkv.engine.torch_question) with each layer's parts around
its attention in C where the model's projections are 4/8-bit blocks (snapkv.engine.native_decode.QuestionLayers: the
same formulas summed in another order, logits within rounding), and each cut layer of a deferred cache attended straight
from its codes (snapkv.engine.coded_attention, within rounding of restoring it first) rather than restored whole; where
either does not apply, the torch engine's part or attention. Every layer is cut by the torch engine's cut
(snapkv.compression.compress.cut_layer), which restores only the kept positions of a layer still in its codes.
"""

from contextlib import nullcontext

import torch

from snapkv.compression.compress import CompressionPlan, capturing, cut_layer
from snapkv.engine.coded_attention import attend_coded
from snapkv.engine.native_decode import QuestionLayers, output_head, output_logits
from snapkv.engine.torch_question import LayerParts, attend_over_cache, question_mask
from snapkv.engine.working_cache import WorkingCache


@torch.inference_mode()
def question_pass(model, question_ids: torch.Tensor, start: int, cache: WorkingCache, plan: CompressionPlan | None,
                  layers: QuestionLayers | None) -> torch.Tensor:
    """As snapkv.engine.torch_question.question_pass; layers: the C parts (None: PyTorch's ops)."""
    inner = model.model
    parts = layers if layers is not None else LayerParts(model)
    rows = question_ids.shape[0]
    hidden = inner.embed_tokens(question_ids.unsqueeze(0)).contiguous()  # (1, q, hidden): its own, written in place
    cos, sin = inner.rotary_emb(hidden, torch.arange(start, start + rows).unsqueeze(0))  # (1, q, head_dim) each
    mask = question_mask(rows, cache.get_seq_length())
    with capturing(model, plan.window) if plan is not None else nullcontext(()) as cut_modules:
        for index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            normed, query, key, value = parts.before(index, hidden, cos, sin)
            cut = attention in cut_modules
            attended = None  # (1, q, heads * head_dim)
            if cut:  # over the layer's codes where it can
                attended = attend_coded(attention, query, key, value, cache.still_stored(attention.layer_idx), plan)
            if attended is None:
                attended = attend_over_cache(model, attention, query, key, value, cache, mask)
            if cut:  # the torch engine's cut: a layer still in its codes restores only the positions kept
                cut_layer(plan, attention, normed, cache, (cos, sin))
            hidden = parts.after(index, attended, hidden)
    return output_logits(model, hidden, output_head(model))
