"""A transformers cache layer sized once for an answer and written in place.

DynamicLayer appends by concatenation: every decoded token copies the layer's whole cache (at 7k tokens
of the full cache in fp32, about 320 MB per token for the embedded model, more than its weights). A
PresizedLayer holds one buffer with room for the whole answer; each token is written into its slot and
attention reads a view of the filled part. The first token past the room doubles it (never expected:
room is sized from max_new_tokens).

A RoomLayer is the question pass's counterpart over a saved cache restored with free rows after each head's
positions (snapkv.cachefile.load_cache's question_room): the question's keys and values go there instead of
into a concatenated copy of the whole layer.
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
        """Slots up to `filled` were written into the buffers from outside (snapkv.native_decode): show them."""
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
    matmuls (snapkv.cpu_attention: on CPU in 16 bits), which copy a view of a larger buffer whole on every
    token; measured at 7k tokens (benchmarks/decode_engines.py, bf16): concatenation 63.0 against 85.7
    ms/token for the full cache, 40.4 against 45.2 for SnapKV 1024. Elsewhere (fp32 on CPU: 99.6 against
    117.1 for the full cache; GPUs) sdpa reads the view as it is."""
    from . import cpu_attention

    keys = next((layer.keys for layer in cache.layers if layer.is_initialized), None)
    return keys is None or not cpu_attention.decodes_by_matmuls(model, keys)


def presize(cache: DynamicCache, room: int) -> None:
    """Turn every plain full-attention layer of `cache` into a PresizedLayer with `room` free slots (a copy of
    what it holds, once). Sliding-window layers keep their own bounded update."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            cache.layers[index] = PresizedLayer(layer.keys, layer.values, room)


def free_rows(states: torch.Tensor) -> int:
    """Rows free after each head's positions of states (batch 1, kv_heads, n, head_dim) inside its storage, as its
    strides lay them out: each head's rows contiguous and heads (n + free) rows apart."""
    batch, heads, n, head_dim = states.shape
    if batch != 1 or states.stride(-1) != 1 or states.stride(-2) != head_dim or states.stride(1) % head_dim:
        return 0
    free = states.stride(1) // head_dim - n
    end = states.storage_offset() + (heads - 1) * states.stride(1) + (n + free) * head_dim  # past the last head's room
    return free if free > 0 and end * states.element_size() <= states.untyped_storage().nbytes() else 0


class RoomLayer(DynamicLayer):
    """A layer over a cache's own keys and values (batch 1, kv_heads, n, head_dim) that have `room` rows free after
    each head's positions: the first update (a question) is written there, not concatenated; any later one
    concatenates as DynamicLayer does. The room belongs to the cache and the next question writes it again, so
    this is for one forward, a question's pass (one at a time per cache, as a Session answers); call
    `release_room` after it. A layer the pass cuts (snapkv.compress) leaves the room behind at once."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        super().__init__()
        self.device = keys.device
        self.is_initialized = True
        self.keys, self.values = keys, values
        self.room = min(room, free_rows(keys), free_rows(values))  # never past what the strides and storage hold
        self.storage = keys.untyped_storage().data_ptr()
        self.wrote = False  # True once a question is written into the room

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        if not 0 < new <= self.room:
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys, self.values = (_written_after(states, added) for states, added in
                                  ((self.keys, key_states), (self.values, value_states)))
        self.room, self.wrote = 0, True
        return self.keys, self.values

    def in_room(self) -> bool:
        """Whether the layer still shows the cache's storage (not cut since)."""
        return self.keys.untyped_storage().data_ptr() == self.storage


def _written_after(states: torch.Tensor, added: torch.Tensor) -> torch.Tensor:
    """states (1, kv_heads, n, head_dim) with `added`'s rows (1, kv_heads, a, head_dim) written into the free rows
    after each head's: a view of (1, kv_heads, n + a, head_dim) over the same storage."""
    n = states.shape[-2]
    grown = states.as_strided((*states.shape[:2], n + added.shape[-2], states.shape[-1]), states.stride())
    grown[:, :, n:].copy_(added)
    return grown


def release_room(cache: DynamicCache) -> None:
    """After the question's forward: every RoomLayer becomes a plain DynamicLayer, with its own copy where it still
    shows the cache's storage (a layer that was not cut), so that nothing decoded later touches the cache."""
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, RoomLayer):
            plain = DynamicLayer()
            plain.device, plain.is_initialized = layer.device, True
            copy = layer.wrote and layer.in_room()
            plain.keys, plain.values = ((layer.keys.clone(), layer.values.clone()) if copy
                                        else (layer.keys, layer.values))
            cache.layers[index] = plain
