"""Prefill a prompt into a CompressedCache, and answer questions against it token by token.

The engine knows token ids only; callers decode and print.
"""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import DynamicCache

from .architectures import attention_layers
from .cache import CompressedCache
from .chunking import DEFAULT_CHUNK_TOKENS, chunked_feed_forward
from .compress import CompressionPlan, compressing
from .config import Cut, Tier


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy when temperature is 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


def model_device(model) -> torch.device:
    """Where token ids enter the model (the first device of several with a device_map)."""
    return model.get_input_embeddings().weight.device


@torch.inference_mode()
def run_forward(
    model, input_ids: torch.Tensor, cache: DynamicCache, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """One forward that appends input_ids (1, s) to `cache`; returns the last position's logits (vocab,)."""
    output = model(
        input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1
    )
    return output.logits[0, -1]


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


@contextmanager
def _reporting_layers(model, on_layer: Callable[[int, int], None] | None):
    """Call on_layer(layers_done, layers_total) after each attention layer of the block's forwards."""
    if on_layer is None:
        yield
        return
    layers = attention_layers(model)
    done = iter(range(1, len(layers) + 1))
    handles = [layer.module.register_forward_hook(lambda *_: on_layer(next(done), len(layers)))
               for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def prefill(model, context_ids: torch.Tensor, cut: Cut | None,
            on_layer: Callable[[int, int], None] | None = None,
            chunk_tokens: int = DEFAULT_CHUNK_TOKENS, tier: Tier | None = None,
            document: range | None = None) -> CompressedCache:
    """Run the prompt through the model, compressing each layer as it goes (cut None: keep everything).

    context_ids: (n,) token ids. A prompt no longer than the budget is left whole.
    cut: a method that scores during the prefill (SnapKV, the prompt's tail as the window); stored tiers
    chosen after the prefill are snapkv.tiers' business.
    tier: the description the cache carries (default: this cut, no truncation).
    document: where the document sits in the prompt (default: all of it).
    on_layer: progress callback, called with (layers done, layers in all) as each layer finishes.
    chunk_tokens: the MLPs run over at most this many positions at a time (bounded activations).
    Each layer's cache stays on that layer's device (several with accelerate's device_map).
    """
    if cut is not None and not cut.method.scores_during_prefill:
        raise ValueError(f"{cut.method.name} does not score during the prefill; see snapkv.tiers")
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
) -> Iterator[int]:
    """Yield the answer's token ids, one at a time (stop tokens are not yielded).

    question_ids: (q,) the question and the start of the assistant turn; placed at positions
    original_length.. so that RoPE continues where the prompt ended, however much was dropped.
    per_question: query-aware mode: the question is the observation window and the stored tier is
    cut to this budget before decoding. None: decode against the cache as it is.

    `cache` is never modified: the forward passes work on a copy, so an interrupted answer, or any
    number of answers, leave it as it was.
    """
    device = model_device(model)
    working = cache.to_dynamic_cache(model.config)
    q = question_ids.shape[0]
    start = cache.original_length
    plan = None
    if per_question is not None and cache.kept_tokens > per_question.prefix_keep:
        plan = CompressionPlan(per_question, window=q)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    # (1, q)
    positions = torch.arange(start, start + q, device=device).unsqueeze(0)
    with compressing(model, plan) if plan else nullcontext():
        logits = run_forward(model, question_ids.to(device).unsqueeze(0), working, positions)
    for step in range(max_new_tokens):
        token = _pick_token(logits, sampling, generator)
        if token in stop_ids:
            return
        yield token
        if step + 1 == max_new_tokens:
            return
        position = start + q + step
        logits = run_forward(
            model, torch.tensor([[token]], device=device), working, torch.tensor([[position]], device=device)
        )
