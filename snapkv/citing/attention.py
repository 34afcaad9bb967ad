"""How much attention an answer's tokens paid each position of the prompt, layer by layer and head by head.

The question and the answer are fed once more after the cache (a working copy: the cache is never changed), and a
hook on every attention layer computes, from the queries of the rows that produced the answer's tokens, their
softmax over the keys the layer holds. Positions a cut cache dropped get nothing; the cache's own positions map
what it holds back to places in the prompt.
"""

from functools import partial
from typing import Callable

import torch

from snapkv.compression.compress import cache_argument
from snapkv.engine.engines import model_device, run_forward
from snapkv.engine.working_cache import WorkingCache
from snapkv.modeling.architectures import hooked_attention, window_queries
from snapkv.storage.cache import CompressedCache

# Query rows scored together: their logits are rows x query heads x held keys, so a bound on them bounds the
# memory of one step (2**26 fp32 values: 256 MiB) whatever the cache's length.
MAX_SCORED_VALUES = 2**26

# Called per layer with (layer index, attention summed over the answer's rows (q_heads, held) fp32, the prompt
# positions of what the layer holds (q_heads, held) int64).
Reducer = Callable[[int, torch.Tensor, torch.Tensor], None]


def rows_attention(queries: torch.Tensor, keys: torch.Tensor, held: int, first_row: int, scaling: float) -> torch.Tensor:
    """The softmax of some fed rows over every key they see, summed over the rows, for the held keys only.

    queries: (q_heads, r, head_dim) after RoPE: fed rows first_row .. first_row + r
    keys:    (kv_heads, held + fed, head_dim) after RoPE: the held keys, then the fed rows' own
    Returns (q_heads, held) fp32.
    """
    q_heads, rows, head_dim = queries.shape
    kv_heads = keys.shape[0]
    group = q_heads // kv_heads
    visible = held + first_row + rows  # each row sees the held keys and the fed rows up to itself
    # (kv_heads, group * r, head_dim): the query heads of each KV head, their rows one after another
    grouped = (queries.float() * scaling).reshape(kv_heads, group * rows, head_dim)
    logits = torch.matmul(grouped, keys[:, :visible].transpose(1, 2).to(grouped.dtype))  # (kv_heads, group * r, visible)
    logits = logits.view(kv_heads, group, rows, visible)
    future = torch.ones(rows, rows, dtype=torch.bool, device=keys.device).triu(diagonal=1)  # row i sees fed j <= i
    logits[..., visible - rows:].masked_fill_(future, float("-inf"))
    weights = logits.softmax(dim=-1)[..., :held]  # (kv_heads, group, r, held)
    return weights.sum(dim=2).reshape(q_heads, held)


class _State:
    def __init__(self, cache: CompressedCache, working, rows: int, layers: set[int] | None, reduce: Reducer) -> None:
        self.held = [held for _, held, _ in cache.layer_shapes()]  # a deferred cache's layers left stored
        self.positions = cache.positions  # per layer (kv_heads, held)
        # each layer's own tensors, put back once it has run: the copy the forward appended to is then freed
        self.originals = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in working.layers]
        self.rows, self.layers, self.reduce = rows, layers, reduce


def _attention_hook(state: _State, module, args, kwargs, output) -> None:
    index = module.layer_idx
    layer = cache_argument(kwargs).layers[index]
    held = state.held[index]
    hidden_states = args[0] if args else kwargs["hidden_states"]  # (1, fed, hidden)
    fed = hidden_states.shape[1]
    if (state.layers is None or index in state.layers) and layer.keys.shape[2] == held + fed:
        keys = layer.keys[0].float()  # (kv_heads, held + fed, head_dim), once for every chunk of rows
        q_heads = module.config.num_attention_heads
        chunk = max(1, MAX_SCORED_VALUES // max(q_heads * (held + fed), 1))
        cos, sin = kwargs["position_embeddings"]
        summed = torch.zeros(q_heads, held, device=keys.device)
        for start in range(fed - state.rows, fed, chunk):
            stop = min(start + chunk, fed)
            queries = window_queries(module, hidden_states[:, start:stop],
                                     (cos[:, start:stop], sin[:, start:stop]))[0]  # (q_heads, r, head_dim)
            summed += rows_attention(queries, keys, held, start, module.scaling)
        positions = state.positions[index].to(keys.device)  # (kv_heads, held)
        state.reduce(index, summed, positions.repeat_interleave(q_heads // positions.shape[0], dim=0))
    # the fed rows' keys are not needed by later layers of this forward: drop them (and the copy holding them) now
    if layer.keys.shape[2] == held + fed:
        layer.keys, layer.values = state.originals[index]
    if state.layers is not None and index >= max(state.layers):
        raise _Done


class _Done(Exception):
    """Raised after the last layer asked for: the layers after it need not run."""


@torch.inference_mode()
def answer_attention(model, cache: CompressedCache, fed_ids: torch.Tensor, rows: int, reduce: Reducer,
                     layers: set[int] | None = None) -> None:
    """Feed `fed_ids` (f,) after the cache (at positions original_length..) and hand `reduce`, layer by layer, the
    attention the last `rows` of them paid the positions the cache holds (None for `layers`: every layer; the forward
    stops after the last one asked for)."""
    if rows < 1 or fed_ids.shape[0] < rows:
        raise ValueError(f"{rows} rows asked of {fed_ids.shape[0]} fed tokens")
    device = model_device(model)
    start = cache.original_length
    # the layers up to the last asked for (a deferred cache's restored for this pass only)
    working = WorkingCache.of(cache, model.config, through=None if layers is None else max(layers))
    positions = torch.arange(start, start + fed_ids.shape[0], device=device).unsqueeze(0)
    state = _State(cache, working, rows, layers, reduce)
    with hooked_attention(model, partial(_attention_hook, state), with_kwargs=True):
        try:
            run_forward(model, fed_ids.to(device).unsqueeze(0), working, positions)
        except _Done:  # the working copy is dropped half-way: nothing after the last layer asked for is needed
            pass
