"""A transformers cache layer sized once for an answer and written in place.

DynamicLayer appends by concatenation: every decoded token copies the layer's whole cache (at 7k tokens
of the full cache in fp32, about 320 MB per token for the embedded model, more than its weights). A
PresizedLayer holds one buffer with room for the whole answer; each token is written into its slot and
attention reads a view of the filled part. The first token past the room doubles it (never expected:
room is sized from max_new_tokens).

The question pass's counterpart over a saved cache is snapkv.storage.deferred's RestoringLayer; both reach the engines
behind snapkv.engine.working_cache.WorkingCache (make_room).
"""

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PresizedLayer(DynamicLayer):
    """keys, values: views (batch, kv_heads, filled, head_dim) of buffers with `room` more slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        super().__init__()
        self.device = keys.device
        self.is_initialized = True
        self._filled = keys.shape[-2]
        self._key_buffer = self._allocate(keys, self._filled + room)
        self._value_buffer = self._allocate(values, self._filled + room)
        self._point_views()

    @staticmethod
    def _allocate(states: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, filled, dim = states.shape
        buffer = states.new_empty((batch, heads, capacity, dim))
        buffer[:, :, :filled].copy_(states)
        return buffer

    def _point_views(self) -> None:
        self.keys = self._key_buffer[:, :, : self._filled]
        self.values = self._value_buffer[:, :, : self._filled]

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers (batch, kv_heads, capacity, head_dim), filled up to `filled`."""
        return self._key_buffer, self._value_buffer

    @property
    def filled(self) -> int:
        return self._filled

    def written_to(self, filled: int) -> None:
        """Slots up to `filled` were written into the buffers from outside (snapkv.engine.native_decode): show them."""
        self._filled = filled
        self._point_views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        end = self._filled + new
        if end > self._key_buffer.shape[-2]:
            self._key_buffer = self._allocate(self.keys, 2 * end)
            self._value_buffer = self._allocate(self.values, 2 * end)
        self._key_buffer[:, :, self._filled : end].copy_(key_states)
        self._value_buffer[:, :, self._filled : end].copy_(value_states)
        self._filled = end
        self._point_views()
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._filled = self.keys.shape[-2]


def presize_pays(model, cache: DynamicCache) -> bool:
    """Whether writing in place beats concatenation for this cache: not where the model decodes by plain
    matmuls (snapkv.modeling.cpu_attention: on CPU in 16 bits), which copy a view of a larger buffer whole on every
    token; measured at 7k tokens (benchmarks/decode.py engines, bf16): concatenation 63.0 against 85.7
    ms/token for the full cache, 40.4 against 45.2 for SnapKV 1024. Elsewhere (fp32 on CPU: 99.6 against
    117.1 for the full cache; GPUs) sdpa reads the view as it is."""
    from snapkv.modeling import cpu_attention

    keys = next((layer.keys for layer in cache.layers if layer.is_initialized), None)
    return keys is None or not cpu_attention.decodes_by_matmuls(model, keys)


def presize(cache: DynamicCache, room: int) -> None:
    """Turn every plain full-attention layer of `cache` into a PresizedLayer with `room` free slots (a copy of
    what it holds, once). Sliding-window layers keep their own bounded update."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            cache.layers[index] = PresizedLayer(layer.keys, layer.values, room)
