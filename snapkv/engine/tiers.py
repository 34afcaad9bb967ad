"""Stored tiers: which positions a cache keeps, chosen during or after the prefill, and the bits it is kept in.

    build_tier(...)    prefill -> (the cut, during the prefill or after it by probes) -> stored precision
    derive_tier(...)   the same from a whole prompt's cache already at hand (no new prefill)

A stored precision with a sharper share (Bits "4/2+20%@4") ranks each head's held positions by the
pseudo-question probes (sharper_positions) and keeps the best share in more bits.

A cut by a probing method (snapkv.compression.methods: reconstruction, pseudo-question, key-norm) needs the whole
prompt's cache: each probe is fed after the prompt with a working copy of the cache attached, and a hook
on every attention layer scores the cached keys with the probe's queries, then drops the probe's own
keys again. The cached tensors themselves are never written.
"""

import time
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import Callable

import torch

from snapkv.base.bits import Bits
from snapkv.compression.compress import cache_argument
from snapkv.compression.config import Cut, Plan, Tier
from snapkv.compression.methods import Method, Probe, PseudoQuestion, WindowAttention
from snapkv.compression.scoring import gather_positions
from snapkv.engine.generation import chunked_prefill, extended, model_device, prefill, run_forward
from snapkv.engine.working_cache import WorkingCache
from snapkv.modeling.architectures import attention_layers, hooked_attention, window_queries
from snapkv.storage.cache import CompressedCache
from snapkv.storage.quantize import first_rows

Progress = Callable[[int, int], None]


class _ProbeScores:
    """Per layer, the best score any probe gave each cached position so far: (kv_heads, n), -inf where unscored."""

    def __init__(self, cache: CompressedCache) -> None:
        self.lengths = [keys.shape[1] for keys in cache.keys]
        self.scores = [torch.full(keys.shape[:2], float("-inf"), device=keys.device) for keys in cache.keys]
        self.probe: Probe | None = None


def _score_layer_hook(method: Method, state: _ProbeScores, module, args, kwargs, output) -> None:
    cache = cache_argument(kwargs)
    index = module.layer_idx
    layer = cache.layers[index]
    n, probe = state.lengths[index], state.probe
    scored = range(probe.scored.start, min(probe.scored.stop, n))  # a cut cache holds fewer than the prompt
    hidden_states = args[0] if args else kwargs["hidden_states"]  # (1, p, hidden): the probe's tokens
    queries = window_queries(module, hidden_states, kwargs["position_embeddings"])  # (1, q_heads, p, head_dim)
    keys = layer.keys  # (1, kv_heads, n + p, head_dim)
    subset = torch.cat([keys[:, :, probe.sinks.start:probe.sinks.stop], keys[:, :, scored.start:scored.stop],
                        keys[:, :, n:]], dim=2)
    scores = method.score(WindowAttention(subset, module.scaling, queries=queries))[0, :, len(probe.sinks):]
    # (kv_heads, len(scored))
    best = state.scores[index][:, scored.start:scored.stop]
    torch.maximum(best, scores.to(best.device), out=best)
    # the probe's own keys are not needed by later layers of this forward: drop them now
    layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


def _scoring(model, method: Method, state: _ProbeScores):
    return hooked_attention(model, partial(_score_layer_hook, method, state), compressible_only=True, with_kwargs=True)


@torch.inference_mode()
def probe_scores(model, cache: CompressedCache, method: Method, probes: list[Probe],
                 on_step: Progress | None = None) -> list[torch.Tensor]:
    """Per layer (kv_heads, n): the most any probe's queries scored each position of a whole-prompt cache.

    With no probes the method scores the keys alone. Layers that are not compressed (sliding windows) stay
    -inf: they are kept as they are.
    """
    state = _ProbeScores(cache)
    if not probes:
        compressible = {layer.index for layer in attention_layers(model) if layer.compressible}
        for index, keys in enumerate(cache.keys):
            if index in compressible:
                state.scores[index] = method.score(WindowAttention(keys.unsqueeze(0)))[0].float()
        return state.scores
    device = model_device(model)
    with _scoring(model, method, state):
        for step, probe in enumerate(probes):
            state.probe = probe
            working = WorkingCache.of(cache, model.config)
            positions = torch.arange(cache.original_length, cache.original_length + len(probe.ids), device=device)
            run_forward(model, probe.ids.to(device).unsqueeze(0), working, positions.unsqueeze(0))
            if on_step:
                on_step(step + 1, len(probes))
    return state.scores


def keep_best(cache: CompressedCache, scores: list[torch.Tensor], cut: Cut, protected: list[range]) -> CompressedCache:
    """Each scored layer cut to `cut.budget` positions per KV head: the protected ones, then the best scored.

    scores: per layer (kv_heads, n), -inf for a layer that is not cut. The kept positions stay in order.
    """
    keys, values, positions = [], [], []
    for layer_keys, layer_values, layer_positions, layer_scores in zip(cache.keys, cache.values, cache.positions,
                                                                        scores):
        n = layer_keys.shape[1]
        if n <= cut.budget or bool(torch.isneginf(layer_scores).all()):
            keys.append(layer_keys), values.append(layer_values), positions.append(layer_positions)
            continue
        layer_scores = layer_scores.clone()
        for span in protected:
            layer_scores[:, span.start:span.stop] = float("inf")
        # (1, kv_heads, budget), ascending
        kept = layer_scores.topk(cut.budget, dim=-1).indices.sort(dim=-1).values.unsqueeze(0)
        keys.append(gather_positions(layer_keys.unsqueeze(0), kept)[0])
        values.append(gather_positions(layer_values.unsqueeze(0), kept)[0])
        positions.append(layer_positions.gather(1, kept[0]))
    return replace(cache, keys=keys, values=values, positions=positions, tier=replace(cache.tier, cut=cut))


# What ranks the positions of a sharper share: a generic question and the document's tail, as the
# pseudo-question tier does (measured on the embedded model, docs/what-is-saved.md).
SHARPENING = PseudoQuestion()


@torch.inference_mode()
def sharper_positions(model, prompter, cache: CompressedCache, share: float,
                      on_step: Progress | None = None) -> list[torch.Tensor]:
    """Per layer (kv_heads, held) bool: each head's `share` of held positions the probes say the model needs
    most, the template around the document first. Works on a cut cache as on a whole one (the probes score
    what it holds, in order)."""
    probes = SHARPENING.probes(prompter, cache.token_ids, cache.document)
    scores = probe_scores(model, cache, SHARPENING, probes, on_step)
    document = cache.document
    found = []
    for layer_scores, positions in zip(scores, cache.positions):
        heads, held = positions.shape
        outside = (positions < document.start) | (positions >= document.stop)  # (kv_heads, held)
        ranked = layer_scores.masked_fill(outside.to(layer_scores.device), float("inf"))
        chosen = torch.zeros(heads, held, dtype=torch.bool, device=positions.device)
        count = round(share * held)
        if count:
            chosen.scatter_(1, ranked.topk(count, dim=-1).indices.to(positions.device), True)
        found.append(chosen)
    return found


def at_stored_precision(model, prompter, cache: CompressedCache, bits: "Bits | int",
                        on_step: Progress | None = None, question_room: int = 0) -> CompressedCache:
    """`cache` rounded to `bits`, its sharper share (if any) ranked by the probes; deferred where it can be with
    question_room > 0 (CompressedCache.at_precision)."""
    bits = Bits.parse(bits)
    sharp = sharper_positions(model, prompter, cache, bits.share, on_step) if bits.share else None
    return cache.at_precision(bits, sharp, question_room)


def _protected(cache: CompressedCache) -> list[range]:
    """The positions around the document (template, instruction): kept whatever the scores say."""
    document = cache.document
    return [range(0, document.start), range(document.stop, cache.original_length)]


def derive_tier(model, prompter, whole: CompressedCache, cut: Cut | None, bits: "Bits | int",
                on_step: Progress | None = None, scores_memo: dict | None = None,
                question_room: int = 0) -> CompressedCache:
    """The stored tier `cut` (sized for this prompt already, or None) of a whole-prompt cache, in `bits` bits.

    scores_memo: a dict in which the scores of each method are kept for this cache (measurements that cut
    one cache at several sizes score it once).
    question_room: > 0 to hold the tier deferred where it can be, as a loaded file's (CompressedCache.at_precision).
    """
    if cut is not None:
        if whole.compressed or whole.tier.bits != 16 or whole.payload is None or cut.method.scores_during_prefill:
            raise ValueError("derive_tier cuts a whole prompt's cache, rounded to 16 bits, by a probing method")
        method = cut.method
        scores = scores_memo.get(method) if scores_memo is not None else None
        if scores is None:
            probes = method.probes(prompter, whole.token_ids, whole.document)
            scores = probe_scores(model, whole, method, probes, on_step)
            if scores_memo is not None:
                scores_memo[method] = scores
        whole = keep_best(whole, scores, cut, _protected(whole))
    return at_stored_precision(model, prompter, whole, bits, on_step, question_room)


def build_tier(model, prompter, context_ids: torch.Tensor, document: range, plan: Plan, tier: Tier,
               on_layer: Progress | None = None, on_step: Progress | None = None,
               timings: dict | None = None, on_chunk: Progress | None = None,
               prefill_dtype: torch.dtype | None = None, question_room: int = 0) -> CompressedCache:
    """Prefill a prompt into the cache that is stored, as `plan` says: cut during the prefill (snapkv's document
    window) or after it by probes, then rounded to its stored bits. `tier` carries the truncation.

    timings: filled with "prefill_seconds" and "tier_seconds" (the scoring, cut and rounding after it).
    on_chunk: progress of a prefill in chunks (tokens done, in all); on_layer if not given.
    prefill_dtype: the prefill's matrix products in this dtype (CPU autocast: bf16 over fp32 weights), its keys and
    values then held in the weights' dtype as any other cache.
    question_room: > 0 to have the cache deferred where it can be, as a loaded file's (CompressedCache._holding),
    with this many free rows for a question.
    """
    plan = plan.sized_for(len(context_ids), document)
    during, after, bits = plan.during_prefill, plan.after_prefill, plan.bits
    started = time.perf_counter()
    with (torch.autocast("cpu", dtype=prefill_dtype) if prefill_dtype is not None else nullcontext()):
        if during is not None and during.chunk is not None and len(context_ids) > during.chunk:
            cache = chunked_prefill(model, context_ids, during, during.chunk, on_chunk=on_chunk or on_layer,
                                    tier=replace(tier, cut=during, bits=16), document=document)
        else:
            cache = prefill(model, context_ids, during, on_layer=on_layer, tier=replace(tier, cut=during, bits=16),
                            document=document)
    compute = model.get_input_embeddings().weight.dtype  # a bf16 prefill's cache is restored in the weights' dtype
    prefilled = time.perf_counter()
    if after is None and not bits.share:
        # through 16 bits first, as a whole 16-bit file of it would hold it (a no-op for a 16-bit model), one layer
        # at a time
        cache = cache.stored_one_layer_at_a_time(bits, compute, question_room)
    else:
        cache = cache.to(cache.device, compute).at_precision(16)
        if after is not None:
            # cut the whole cache as a 16-bit file of it would hold it, so that deriving this tier later from such
            # a file gives the same cache
            cache = derive_tier(model, prompter, cache, after, bits, on_step, question_room=question_room)
        else:
            cache = at_stored_precision(model, prompter, cache, bits, on_step, question_room)
    if timings is not None:
        timings.update(prefill_seconds=prefilled - started, tier_seconds=time.perf_counter() - prefilled)
    return cache


# A prompt's part after a reused prefix is fed in pieces of at most this many tokens (bounded activations).
EXTENSION_PIECE = 2048


def extend_tier(model, prompter, saved: CompressedCache, context_ids: torch.Tensor, shared: int, document: range,
                plan: Plan, tier: Tier) -> CompressedCache:
    """The stored cache of a prompt whose first `shared` ids are those of a saved cache holding every position (a
    whole stored tier): that prefix reused, the rest run against it (snapkv.engine.generation.extended), then
    rounded to the stored bits as build_tier rounds a prefill. `tier` carries the truncation."""
    if plan.stored is not None:
        raise ValueError("a prefix is reused only where the whole prompt is stored")
    cache = saved.prefix(shared)
    for start in range(shared, context_ids.shape[0], EXTENSION_PIECE):
        cache = extended(model, cache, context_ids[start:start + EXTENSION_PIECE])
    cache = replace(cache, tier=replace(tier, cut=None, bits=Bits(16)), document_span=document)
    bits = Bits.parse(plan.bits)
    # where each token is stored on its own (16 bits, values per token), the prefix's stored rows are taken as they
    # are and only the rest rounded: the same numbers as rounding it all, at a fraction of the cost
    prefix = None if saved.payload is None or bits.share or saved.tier.bits != bits else [
        tuple(first_rows(part, shared) for part in layer) for layer in saved.payload]
    if prefix is not None and all(part is not None for layer in prefix for part in layer):
        return cache.at_precision_after(prefix, shared, bits)
    return at_stored_precision(model, prompter, cache.at_precision(16), bits)
