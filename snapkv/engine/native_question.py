"""The native engine's question pass: the torch engine's (snapkv.engine.torch_question) with each layer's parts around
its attention in C where the model's projections are 4/8-bit blocks (snapkv.engine.native_decode.QuestionLayers: the
same formulas summed in another order, logits within rounding), and each cut layer of a deferred cache attended and cut
straight from its codes (snapkv.engine.coded_attention, within rounding of restoring it first) rather than restored
whole; where either does not apply, the torch engine's part or attention.
"""

from contextlib import nullcontext

import torch

from snapkv.compression.compress import CompressionPlan, capturing
from snapkv.engine.coded_attention import attend_and_cut
from snapkv.engine.native_decode import QuestionLayers, output_logits
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
            found = parts.before(index, hidden, cos, sin)  # normed, query, key, value
            cut = attention in cut_modules
            attended = None  # (1, q, heads * head_dim)
            if cut:  # straight from the layer's codes where it can
                attended = attend_and_cut(attention, *found[1:], cache.still_stored(attention.layer_idx), plan)
            if attended is None:
                attended = attend_over_cache(model, attention, found, cache, mask, plan, cut, (cos, sin))
            hidden = parts.after(index, attended, hidden)
    return output_logits(model, hidden)
