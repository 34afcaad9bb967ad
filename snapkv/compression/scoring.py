"""Selection as pure tensor functions: window attention scores, pooling, GQA mean, kept indices, gather."""

import torch
import torch.nn.functional as F

from snapkv import native
from snapkv.native.threads import threads_now


def window_attention_weights(window_queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """The observation window's attention weights onto every earlier key, query heads grouped by KV head.

    window_queries: (batch, q_heads, w, head_dim), after RoPE; the last w positions of the sequence.
    keys:           (batch, kv_heads, n, head_dim), after RoPE; n >= w, the window's keys last.
    Returns (batch, kv_heads, group, w, n - w): softmax weights (fp32, causal inside the window) over all
    n keys, for the keys before the window.
    """
    batch, q_heads, w, head_dim = window_queries.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    # (batch, kv_heads, group, w, head_dim): query heads grouped by the KV head they share
    # scaled here, on the small tensor, rather than on the logits
    grouped = (window_queries.float() * scaling).view(batch, kv_heads, group, w, head_dim)
    # (batch, kv_heads, group, w, n)
    logits = torch.einsum("bhgwd,bhnd->bhgwn", grouped, keys.float())
    # query i of the window sees window key j only if j <= i
    future = torch.ones(w, w, dtype=torch.bool, device=keys.device).triu(diagonal=1)
    logits[..., n - w :].masked_fill_(future, float("-inf"))
    return logits.softmax(dim=-1)[..., : n - w]


def summed_over_window(weights: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, group, w, n - w) window attention weights -> (batch, q_heads, n - w): summed over the
    window's queries, one row per query head."""
    batch, kv_heads, group, _, earlier = weights.shape
    return weights.sum(dim=-2).reshape(batch, kv_heads * group, earlier)


def window_attention_scores(window_queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """How much attention the observation window pays to every earlier key, per query head.

    Returns (batch, q_heads, n - w): the weights of window_attention_weights summed over the window's queries.
    """
    return summed_over_window(window_attention_weights(window_queries, keys, scaling))


def peak_attention_scores(window_queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """The most attention any window query of any head in a KV head's group pays each earlier key.

    Returns (batch, kv_heads, n - w): KVzip's score (arXiv 2505.23416), a max over queries and the group.
    """
    return window_attention_weights(window_queries, keys, scaling).amax(dim=(2, 3))


def key_norms(keys: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, n, head_dim) -> (batch, kv_heads, n): each key's L2 norm, in fp32."""
    return keys.float().norm(dim=-1)


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Smooth scores along the sequence (stride 1, same length) so neighbours of a hit score too.

    scores: (batch, heads, n) -> (batch, heads, n)
    """
    if kernel == 1 or scores.shape[-1] == 0:
        return scores
    batch, heads, n = scores.shape
    flat = scores.reshape(batch * heads, 1, n)
    if pooling == "max":
        pooled = F.max_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(batch, heads, n)


def chunk_means(scores: torch.Tensor, size: int) -> torch.Tensor:
    """Each position's score replaced by the mean over its chunk of `size` positions (chunks from position 0; the
    last one may be shorter), so that a chunk ranks as one.

    scores: (batch, heads, n) -> (batch, heads, n)
    """
    if size == 1 or scores.shape[-1] == 0:
        return scores
    batch, heads, n = scores.shape
    if _natively(scores) and scores.dtype == torch.float32:  # snapkv/native/kernels/window_cut.c, as the coded cut does
        means = scores.contiguous().clone()
        if native.kernels().chunk_means(native.pointer(means, torch.float32), batch * heads, n, size) == 0:
            return means
    chunks = -(-n // size)
    padded = F.pad(scores, (0, chunks * size - n))  # (batch, heads, chunks * size), zeros after the end
    counts = torch.full((chunks,), float(size), device=scores.device, dtype=scores.dtype)
    counts[-1] = n - (chunks - 1) * size
    means = padded.view(batch, heads, chunks, size).sum(dim=-1) / counts  # (batch, heads, chunks)
    return means.repeat_interleave(size, dim=-1)[..., :n]


def word_maxima(scores: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Each position's score replaced by the best score of its word, so that a word ranks as one (its tokens tie,
    and top_positions keeps the earliest of tied positions first).

    scores: (batch, heads, n); words: (heads, n) int64, a word id per position, equal ids for one word's positions
    (ascending along the positions, as snapkv.engine.prompting.Prompter.word_ids gives them) -> (batch, heads, n)
    """
    batch, heads, n = scores.shape
    if n == 0:
        return scores
    if _natively(scores) and scores.dtype == torch.float32 and words.dtype == torch.int64:  # window_cut.c, as the coded cut
        maxima = scores.contiguous().clone()
        spread = words.contiguous().expand(batch, heads, n).contiguous()  # (batch, heads, n)
        if native.kernels().word_maxima(native.pointer(maxima, torch.float32), native.pointer(spread, torch.int64),
                                        batch * heads, n) == 0:
            return maxima
    local = words - words[:, :1]  # (heads, n): from 0 in each head
    width = int(local.max()) + 1
    flat = (local + width * torch.arange(heads, device=words.device).view(heads, 1)).reshape(-1)  # (heads * n,)
    flat = flat.to(scores.device).expand(batch, -1)  # (batch, heads * n)
    best = torch.full((batch, heads * width), float("-inf"), dtype=scores.dtype, device=scores.device)
    best.scatter_reduce_(1, flat, scores.reshape(batch, heads * n), reduce="amax")
    return best.gather(1, flat).view(batch, heads, n)


def mean_over_query_groups(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Average the scores of the query heads that share one KV head.

    scores: (batch, q_heads, n) -> (batch, kv_heads, n)
    """
    batch, q_heads, n = scores.shape
    return scores.view(batch, kv_heads, q_heads // kv_heads, n).mean(dim=2)


def kept_indices(prefix_scores: torch.Tensor, prefix_keep: int, window: int) -> torch.Tensor:
    """Indices to keep per KV head: the `prefix_keep` best earlier positions plus the whole window.

    prefix_scores: (batch, kv_heads, n - window)
    Returns (batch, kv_heads, prefix_keep + window), int64, ascending (original order kept).
    """
    batch, kv_heads, n_prefix = prefix_scores.shape
    if _natively(prefix_scores) and prefix_scores.dtype == torch.float32:  # snapkv/native/kernels/window_cut.c
        scores = prefix_scores.contiguous()
        indices = torch.empty(batch, kv_heads, min(prefix_keep, n_prefix) + window, dtype=torch.int64)
        if native.kernels().top_positions(native.pointer(scores, torch.float32), batch * kv_heads, n_prefix,
                                          prefix_keep, window, native.pointer(indices, torch.int64),
                                          threads_now()) == 0:
            return indices
    best = prefix_scores.topk(min(prefix_keep, n_prefix), dim=-1).indices
    window_positions = torch.arange(n_prefix, n_prefix + window, device=prefix_scores.device)
    window_positions = window_positions.expand(batch, kv_heads, window)
    return torch.cat([best, window_positions], dim=-1).sort(dim=-1).values


def gather_positions(states: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Keep the given sequence positions of a KV tensor.

    states: (batch, kv_heads, n, head_dim), indices: (batch, kv_heads, k) -> (batch, kv_heads, k, head_dim)
    """
    batch, heads = indices.shape[:2]
    if (_natively(states) and batch == 1 and states.stride(-1) == 1 and states.stride(-2) == states.shape[-1]
            and indices.dtype == torch.int64):  # snapkv/native/kernels/window_cut.c: one copy per row
        wanted = indices.contiguous()
        out = torch.empty(1, heads, wanted.shape[2], states.shape[-1], dtype=states.dtype)
        row_bytes = states.shape[-1] * states.element_size()
        if native.kernels().gather_rows(native.pointer(states, states.dtype, strided=True), heads,
                                        states.stride(1) * states.element_size(), states.shape[2], row_bytes,
                                        native.pointer(wanted, torch.int64), wanted.shape[2],
                                        native.pointer(out, out.dtype), threads_now()) == 0:
            return out
    # whole rows by advanced indexing: on a CPU 4x faster than gather with an index expanded over head_dim (185 against
    # 703 us for 3 heads keeping 1042 of 8018 positions), and it reads a strided view (deferred.RestoringLayer's) as it is
    batch_index = torch.arange(batch, device=indices.device).view(batch, 1, 1)
    head_index = torch.arange(heads, device=indices.device).view(1, heads, 1)
    return states[batch_index, head_index, indices]


def pooled_window_scores(weights: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """SnapKV's scores from the window's attention weights: summed over the window's queries, pooled along the
    positions, averaged over each KV head's query heads.

    weights: (batch, kv_heads, group, w, n - w) -> (batch, kv_heads, n - w)
    """
    batch, kv_heads, group, w, earlier = weights.shape
    if _natively(weights) and weights.dtype == torch.float32 and batch == 1 and weights.stride(-1) == 1:
        scores = torch.empty(1, kv_heads, earlier)  # snapkv/native/kernels/window_cut.c: one pass over the weights
        if native.kernels().window_scores(native.pointer(weights, torch.float32, strided=True), kv_heads, group, w,
                                          earlier, weights.stride(1), weights.stride(2), weights.stride(3), kernel,
                                          int(pooling == "max"), native.pointer(scores, torch.float32),
                                          threads_now()) == 0:
            return scores
    return mean_over_query_groups(pool_scores(summed_over_window(weights), kernel, pooling), kv_heads)


def _natively(tensor: torch.Tensor) -> bool:
    """Whether snapkv's C kernels are to take this CPU tensor."""
    return tensor.device.type == "cpu" and native.unavailable_reason() is None
