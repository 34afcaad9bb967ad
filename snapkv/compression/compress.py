"""Compress each attention layer's cache right after the layer runs, inside one model forward.

Used for the prefill (the window is the prompt's tail) and, in query-aware mode, for the question
pass (the window is the question). Because each layer is cut down as soon as it is written, the
full cache of all layers never exists at once.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator

import torch

from snapkv.compression.config import Cut
from snapkv.compression.methods import WindowAttention
from snapkv.compression.scoring import gather_positions, kept_indices, word_maxima
from snapkv.modeling import cpu_attention
from snapkv.modeling.architectures import attention_layers, hooked_attention, window_queries


@dataclass
class CompressionPlan:
    """What one forward pass keeps per layer.

    cut:    the method and budget; `cut.prefix_keep_at(layer, layers)` positions are kept before the observation window.
    window: the observation window: this many of the forward's last new tokens (capped at the number
            of new tokens). The cut's own window at prefill; the whole question in a question pass.
    """

    cut: Cut
    window: int
    # layer index -> (batch, kv_heads, kept) physical indices into the layer's cache before the cut;
    # layers that were not cut are absent.
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    # with cut.whole_words: per layer (kv_heads, held) the word id of each position the layer's cache held before
    # the forward (snapkv.engine.prompting.Prompter.word_ids); None: words are not known, scores are per token
    words: list[torch.Tensor] | None = None
    # the model's layer count, for a cut whose budget differs by layer (Cut.pyramid); 0: the same in every layer
    layers: int = 0

    def word_ids(self, layer_index: int, n: int) -> torch.Tensor | None:
        """(kv_heads, n) word ids of a layer's first n positions (the forward's own new tokens one word each), or
        None where this plan keeps no words whole."""
        if not self.cut.whole_words or self.words is None:
            return None
        held = self.words[layer_index]  # (kv_heads, held)
        if held.shape[1] >= n:
            return held[:, :n]
        fresh = held[:, -1:] + 1 + torch.arange(n - held.shape[1], device=held.device)  # (kv_heads, new)
        return torch.cat([held, fresh.expand(held.shape[0], -1)], dim=1)

    def prefix_keep_at(self, layer_index: int) -> int:
        """Positions this plan keeps outside the window in that layer (Cut.prefix_keep_at)."""
        return self.cut.prefix_keep_at(layer_index, self.layers)


def cache_argument(kwargs: dict):
    """The cache a decoder layer's attention was called with (None outside a cached forward)."""
    # transformers >= 5.24 names it `cache`, earlier 5.x releases `past_key_values`.
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


class KeepsItsPositions:
    """A cache layer that keeps a cut's positions itself (snapkv.storage.deferred.RestoringLayer, whose rows may still
    be codes): cut_layer hands it the kept indices rather than gathering its keys and values."""

    def keep_positions(self, indices: torch.Tensor) -> None:
        """Keep only the positions `indices` (batch, kv_heads, k), ascending."""
        raise NotImplementedError


def _window_attention(captured: cpu_attention.Captured | None, module, hidden_states: torch.Tensor, keys: torch.Tensor,
                      window: int, position_embeddings) -> WindowAttention:
    """What the method scores the layer's keys (batch, kv_heads, n, head_dim) from: the attention weights the layer just
    computed where it kept them for these keys (snapkv.modeling.cpu_attention keeps them in fp32 for a few query rows:
    the weights where PyTorch's matmuls made them, their sums over the window where its C kernel did), and the window's
    queries again, made only if the method needs them."""
    n = keys.shape[2]
    sums = weights = None
    if captured is not None:
        if captured.window_sums is not None and captured.window_sums.shape[-1] == n and captured.window == window:
            sums = captured.window_sums[..., : n - window]
        elif (captured.weights is not None and captured.weights.shape[-1] == n
              and captured.weights.shape[-2] >= window):
            weights = captured.weights[..., -window:, : n - window]

    def queries() -> torch.Tensor:  # (batch, q_heads, window, head_dim)
        cos, sin = position_embeddings
        return window_queries(module, hidden_states[:, -window:], (cos[:, -window:], sin[:, -window:]))

    return WindowAttention(keys, module.scaling, window, queries, weights=weights, sums=sums)


def cut_layer(plan: CompressionPlan, module, hidden_states: torch.Tensor, cache, position_embeddings) -> None:
    """Cut the cache layer of attention `module` to the plan, right after the module ran in a forward over
    hidden_states (batch, new tokens, hidden) with RoPE's (cos, sin); scored from the attention weights the module
    kept (snapkv.modeling.cpu_attention with CAPTURE set by `capturing`, or snapkv.engine.coded_attention's sums over a
    saved layer's codes) where it did, else from the window's queries. The one cut of a layer in every pass: a layer
    still in its stored bits (KeepsItsPositions) restores only the positions kept."""
    captured = module.__dict__.pop(cpu_attention.CAPTURED, None)  # this forward's, used once or dropped
    layer = cache.layers[module.layer_idx]
    keys, values = layer.keys, layer.values  # (batch, kv_heads, n, head_dim)
    n = keys.shape[2]
    window = min(plan.window, hidden_states.shape[1])
    prefix_keep = plan.prefix_keep_at(module.layer_idx)
    if n <= prefix_keep + window:
        return  # nothing to drop: the layer is left whole
    attention = _window_attention(captured, module, hidden_states, keys, window, position_embeddings)
    scores = plan.cut.method.score(attention)  # (batch, kv_heads, n - window)
    words = plan.word_ids(module.layer_idx, n - window)
    if words is not None:
        scores = word_maxima(scores, words)
    indices = kept_indices(scores, prefix_keep, window)
    if isinstance(layer, KeepsItsPositions):
        layer.keep_positions(indices)
    else:
        layer.keys = gather_positions(keys, indices)
        layer.values = gather_positions(values, indices)
    plan.kept[module.layer_idx] = indices


def _compress_layer_hook(plan: CompressionPlan, module, args, kwargs, output) -> None:
    cache = cache_argument(kwargs)
    if cache is None:
        module.__dict__.pop(cpu_attention.CAPTURED, None)
        return
    hidden_states = args[0] if args else kwargs["hidden_states"]
    cut_layer(plan, module, hidden_states, cache, kwargs.get("position_embeddings"))


@contextmanager
def capturing(model, window: int) -> Iterator[list[torch.nn.Module]]:
    """Within the block, every compressible attention module keeps its attention weights over the last `window`
    rows (snapkv.modeling.cpu_attention's CAPTURE) for cut_layer; yields those modules."""
    modules = [layer.module for layer in attention_layers(model) if layer.compressible]
    try:
        for module in modules:
            setattr(module, cpu_attention.CAPTURE, window)
        yield modules
    finally:
        for module in modules:
            module.__dict__.pop(cpu_attention.CAPTURE, None)
            module.__dict__.pop(cpu_attention.CAPTURED, None)


@contextmanager
def compressing(model, plan: CompressionPlan) -> Iterator[CompressionPlan]:
    """Within the block, every compressible attention layer cuts its cache to the plan after it runs."""
    with (capturing(model, plan.window),
          hooked_attention(model, partial(_compress_layer_hook, plan), compressible_only=True, with_kwargs=True)):
        yield plan
