"""Prefill a prompt into a CompressedCache, and answer questions against it token by token.

The engine knows token ids only; callers decode and print.
"""

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import DynamicCache

from snapkv import native
from snapkv.compression.compress import CompressionPlan, compressing
from snapkv.compression.config import Cut, Tier
from snapkv.engine.engines import (EngineUse, engine_order, model_device,  # run_forward: the model's own forward
                                   run_forward)
from snapkv.engine.working_cache import WorkingCache
from snapkv.modeling.architectures import attention_layers, hooked_attention
from snapkv.modeling.chunking import DEFAULT_CHUNK_TOKENS, chunked_feed_forward
from snapkv.storage.cache import CompressedCache


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy when temperature is 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


def _layer_positions(plan: CompressionPlan | None, layer_index: int, layer_length: int,
                     source_positions: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Original positions of what a layer holds after a forward.

    source_positions: (kv_heads, n) original positions of the layer's cache before any cut.
    A cut layer holds the plan's indices; an uncut one holds the last `layer_length` entries
    (everything, or a sliding window's tail).
    """
    source_positions = source_positions.expand(kv_heads, -1)
    if plan is not None and layer_index in plan.kept:
        # (kv_heads, kept)
        return source_positions.gather(1, plan.kept[layer_index][0])
    return source_positions[:, source_positions.shape[1] - layer_length :]


def _reporting_layers(model, on_layer: Callable[[int, int], None] | None):
    """Within the block, on_layer(layers_done, layers_total) is called after each attention layer of its forwards."""
    if on_layer is None:
        return nullcontext()
    total = len(attention_layers(model))
    done = iter(range(1, total + 1))
    return hooked_attention(model, lambda *_: on_layer(next(done), total))


@torch.inference_mode()
def prefill(model, context_ids: torch.Tensor, cut: Cut | None,
            on_layer: Callable[[int, int], None] | None = None,
            chunk_tokens: int = DEFAULT_CHUNK_TOKENS, tier: Tier | None = None,
            document: range | None = None) -> CompressedCache:
    """Run the prompt through the model, compressing each layer as it goes (cut None: keep everything).

    context_ids: (n,) token ids. A prompt no longer than the budget is left whole.
    cut: a method that scores during the prefill (SnapKV, the prompt's tail as the window); stored tiers
    chosen after the prefill are snapkv.engine.tiers' business.
    tier: the description the cache carries (default: this cut, no truncation).
    document: where the document sits in the prompt (default: all of it).
    on_layer: progress callback, called with (layers done, layers in all) as each layer finishes.
    chunk_tokens: the MLPs run over at most this many positions at a time (bounded activations).
    Each layer's cache stays on that layer's device (several with accelerate's device_map).
    """
    if cut is not None and not cut.method.scores_during_prefill:
        raise ValueError(f"{cut.method.name} does not score during the prefill; see snapkv.engine.tiers")
    device = model_device(model)
    n = context_ids.shape[0]
    cache = DynamicCache(config=model.config)
    plan = None
    if cut is not None and n > cut.budget:
        plan = CompressionPlan(cut, cut.window)
    with (compressing(model, plan) if plan else nullcontext(), _reporting_layers(model, on_layer),
          chunked_feed_forward(model, chunk_tokens) if n > chunk_tokens else nullcontext()):
        run_forward(model, context_ids.to(device).unsqueeze(0), cache)
    positions = []
    for index, layer in enumerate(cache.layers):
        kv_heads, length = layer.keys.shape[1], layer.keys.shape[2]
        all_positions = torch.arange(n, device=layer.keys.device).unsqueeze(0)  # (1, n)
        positions.append(_layer_positions(plan, index, length, all_positions, kv_heads).contiguous())
    tier = tier if tier is not None else Tier(cut)
    return CompressedCache.from_dynamic_cache(cache, positions, n, context_ids.cpu(), tier, document)


@torch.inference_mode()
def chunked_prefill(model, context_ids: torch.Tensor, cut: Cut, chunk: int,
                    on_chunk: Callable[[int, int], None] | None = None, tier: Tier | None = None,
                    document: range | None = None) -> CompressedCache:
    """The prompt through the model `chunk` tokens at a time, each layer cut back to `cut.budget` after every
    chunk with the chunk's tail as the observation window: the cache never holds more than the budget plus
    one chunk, and attention costs grow linearly with the prompt instead of quadratically.

    Each chunk attends to what was kept of the chunks before it and to itself (causally); RoPE places every
    position at its place in the prompt. The last chunk's cut is the exact prefill's (the prompt's tail as the
    window); earlier cuts could not see the later text, which is the price (README, Long contexts).
    on_chunk: progress, called with (tokens done, tokens in all).
    """
    if not cut.method.scores_during_prefill:
        raise ValueError(f"{cut.method.name} does not score during the prefill")
    if chunk <= cut.window:
        raise ValueError(f"the prefill chunk ({chunk}) must be longer than the observation window ({cut.window})")
    device = model_device(model)
    n = context_ids.shape[0]
    cache = DynamicCache(config=model.config)
    positions: list[torch.Tensor] = []  # per layer (kv_heads, held): original positions of what it holds
    starts = list(range(0, n, chunk))
    if len(starts) > 1 and n - starts[-1] < cut.window:
        starts.pop()  # a last piece shorter than the window joins the chunk before it: the final cut sees a full window
    for number, start in enumerate(starts):
        end = starts[number + 1] if number + 1 < len(starts) else n
        piece = context_ids[start:end]  # (c,)
        plan = CompressionPlan(cut, cut.window)
        position_ids = torch.arange(start, start + piece.shape[0], device=device).unsqueeze(0)  # (1, c)
        with compressing(model, plan), (chunked_feed_forward(model, DEFAULT_CHUNK_TOKENS)
                                        if piece.shape[0] > DEFAULT_CHUNK_TOKENS else nullcontext()):
            run_forward(model, piece.to(device).unsqueeze(0), cache, position_ids)
        held = []
        for index, layer in enumerate(cache.layers):
            kv_heads, length = layer.keys.shape[1], layer.keys.shape[2]
            fresh = torch.arange(start, start + piece.shape[0], device=layer.keys.device).expand(kv_heads, -1)
            before = positions[index] if positions else fresh[:, :0]
            source = torch.cat([before, fresh], dim=1)  # (kv_heads, held before + c)
            held.append(_layer_positions(plan, index, length, source, kv_heads).contiguous())
        positions = held
        if on_chunk is not None:
            on_chunk(end, n)
    tier = tier if tier is not None else Tier(cut)
    return CompressedCache.from_dynamic_cache(cache, positions, n, context_ids.cpu(), tier, document)


def _pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """logits: (vocab,) -> the next token id."""
    if sampling.temperature <= 0:
        return int(logits.argmax())
    probs = (logits.float() / sampling.temperature).softmax(dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > sampling.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def answer(
    model,
    cache: CompressedCache,
    question_ids: torch.Tensor,
    *,
    per_question: Cut | None = None,
    max_new_tokens: int = 128,
    stop_ids: frozenset[int] = frozenset(),
    sampling: Sampling = Sampling(),
    engine: str = "auto",
    used: EngineUse | None = None,
    words: torch.Tensor | None = None,
) -> Iterator[int]:
    """Yield the answer's token ids, one at a time (stop tokens are not yielded).

    question_ids: (q,) the question and the start of the assistant turn; placed at positions
    original_length.. so that RoPE continues where the prompt ended, however much was dropped.
    per_question: query-aware mode: the question is the observation window and the stored tier is
    cut to this budget before decoding. None: decode against the cache as it is.
    engine: which engine runs the question pass and the steps (snapkv.engine.engines: auto, native, torch, compiled,
    reference), each falling back to the next in its order where it does not apply; `used` is filled with what ran.
    words: (original_length,) the word id of every prompt position (Prompter.word_ids), for a cut that keeps words
    whole (Cut.whole_words); None: the cut ranks tokens one by one.

    `cache` is never modified: the forward passes work on a copy, so an interrupted answer, or any
    number of answers, leave it as it was.
    """
    device = model_device(model)
    q = question_ids.shape[0]
    start = cache.original_length
    plan = None
    layers = cache.num_layers
    if per_question is not None and cache.kept_tokens > per_question.prefix_keep_at(layers - 1, layers):
        plan = CompressionPlan(per_question, window=q, layers=layers)
        if per_question.whole_words and words is not None:
            # per layer (kv_heads, kept): the word of each position it holds
            plan.words = [words[held.cpu()] for held in cache.positions]
    engines = engine_order(engine)
    used = used if used is not None else EngineUse()
    used.kernels = native.variant() if device.type == "cpu" else None  # the C kernels run on CPU only
    working = WorkingCache.of(cache, model.config, for_question=True)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    for candidate in engines:
        logits = candidate.question_pass(model, question_ids, start, working, plan)
        if logits is not None:
            used.question = candidate.name
            break
    working.question_done()
    steppers = iter(engines)
    stepper = None
    for step in range(max_new_tokens):
        token = _pick_token(logits, sampling, generator)
        if token in stop_ids:
            return
        yield token
        if step + 1 == max_new_tokens:
            return
        position = start + q + step
        while True:  # the first engine in the order that steps here (made ready after the first token is out)
            if stepper is None:
                candidate = next(steppers)
                stepper = candidate.stepper(model, working, position, max_new_tokens - 1 - step)
                used.steps = candidate.name if stepper is not None else used.steps
                continue
            logits = stepper.step(token, position)
            if logits is not None:
                break
            stepper.hand_over()
            stepper = None


@torch.inference_mode()
def extended(model, cache: CompressedCache, ids: torch.Tensor) -> CompressedCache:
    """`cache` with `ids` (n,) appended at positions original_length.. (a conversation's finished turns): their keys
    and values computed by the model's forward against what the cache holds, nothing cut. A new cache, never
    saved as it is (its stored form is gone); `cache` itself is unchanged."""
    start, n = cache.original_length, ids.shape[0]
    # every layer; a deferred cache's restored for this forward only (the document's cache keeps its stored codes)
    working = WorkingCache.of(cache, model.config, through=cache.num_layers - 1)
    device = model_device(model)
    run_forward(model, ids.to(device).unsqueeze(0), working, torch.arange(start, start + n, device=device).unsqueeze(0))
    added = torch.arange(start, start + n)
    positions = []
    for held, layer in zip(cache.positions, working.layers):  # (kv_heads, kept) each, on its layer's device
        joined = torch.cat([held, added.to(held.device).expand(held.shape[0], n)], dim=1)
        positions.append(joined[:, joined.shape[1] - layer.keys.shape[2]:])  # a sliding window keeps its tail
    token_ids = torch.cat([cache.token_ids, ids.to(cache.token_ids.device)])
    return CompressedCache.from_dynamic_cache(working, positions, start + n, token_ids, cache.tier,
                                              cache.document_span)
