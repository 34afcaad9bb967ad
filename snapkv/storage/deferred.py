"""A loaded cache's keys and values left in their stored bits, restored one layer at a time as a question needs them.

Restoring a whole saved cache at load (8k tokens of the embedded model: 360 MB of fp32 from a 42 MB file) took
longer than the question's pass itself, most of it in fresh memory pages. A deferred cache keeps the codes it
read (StoredLayers). Each question's pass restores layer after layer into one buffer (RestoreBuffer) with free
rows after each head's positions, where the question's keys and values are written (RestoringLayer); the
question's cut (snapkv.compression.compress) then gathers the kept positions out of it, and the buffer serves the next layer.
A layer that is not cut is copied out of the buffer before the next layer takes it. Anything else that reads a
deferred cache's keys or values gets each layer restored on its own, once, as an eagerly loaded cache holds it.
Where snapkv.engine.coded_attention takes a layer (the native engine's question pass in fp32 on a CPU with AVX-512), the
layer never enters the buffer: it is attended from its codes and the cut restores only the positions it keeps.
These layers reach the engines behind snapkv.engine.working_cache.WorkingCache (for_question).
"""

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from snapkv.compression.compress import KeepsItsPositions
from snapkv.compression.scoring import gather_positions
from snapkv.storage.quantize import Mixed, Quantized, dequantize, restored_positions


class StoredLayers(Sequence):
    """One kind (keys or values) of every layer as stored (Quantized or Mixed, or a 16-bit tensor where that kind is
    kept in 16 bits beside quantized other one; each (kv_heads, kept, head_dim)),
    read as a list of tensors: item i is layer i restored in `dtype` the first time it is read, then kept."""

    def __init__(self, parts: list["Quantized | Mixed"], dtype: torch.dtype) -> None:
        self.parts = parts
        self.dtype = dtype
        self._restored: list[torch.Tensor | None] = [None] * len(parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if self._restored[index] is None:
            self._restored[index] = dequantize(self.parts[index], self.dtype)
        return self._restored[index]

    def restored(self, index: int) -> torch.Tensor:
        """Layer `index` in `dtype` for one use, not kept (the kept one where it was read before)."""
        kept = self._restored[index]
        return kept if kept is not None else dequantize(self.parts[index], self.dtype)

    def __add__(self, other) -> list[torch.Tensor]:
        return list(self) + list(other)

    def shape(self, index: int) -> tuple[int, int, int]:
        """Layer `index`'s (kv_heads, kept, head_dim), without restoring it."""
        return tuple(self.parts[index].shape)

    @property
    def device(self) -> torch.device:
        part = self.parts[0]
        if isinstance(part, torch.Tensor):
            return part.device
        return (part if isinstance(part, Quantized) else part.high).scale.device


class RestoreBuffer:
    """Room for one layer's keys and values in the compute dtype, with `room` free rows after each head's
    positions, lent to one RestoringLayer at a time: taking it over copies the previous holder out first if
    that layer still shows it (it was not cut)."""

    def __init__(self, keys: StoredLayers, values: StoredLayers, room: int) -> None:
        self.room = room
        elements = max(heads * (kept + room) * head_dim
                       for heads, kept, head_dim in (keys.shape(i) for i in range(len(keys))))
        self.keys = torch.empty(elements, dtype=keys.dtype, device=keys.device)  # flat; viewed per layer
        self.values = torch.empty(elements, dtype=values.dtype, device=values.device)
        self.holder: "RestoringLayer | None" = None

    def holds(self, states: torch.Tensor) -> bool:
        return states.untyped_storage().data_ptr() in (self.keys.data_ptr(), self.values.data_ptr())

    def lend(self, layer: "RestoringLayer") -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values restored into the buffer: views (1, kv_heads, kept, head_dim) with
        `room` free rows after each head's."""
        if self.holder is not None and self.holder is not layer:
            self.holder.keep_own_copy()
        self.holder = layer
        restored = [dequantize(part, dtype=buffer.dtype, room=self.room, out=buffer).unsqueeze(0)
                    for part, buffer in ((layer.stored_keys, self.keys), (layer.stored_values, self.values))]
        return restored[0], restored[1]


class RestoringLayer(DynamicLayer, KeepsItsPositions):
    """A transformers cache layer over one deferred layer, for a question's pass: its first update (the question)
    restores the layer into the RestoreBuffer and writes the question after each head's positions, or appends it
    by concatenation where it is longer than the room; any later update concatenates as DynamicLayer does.
    Or the question's attention read the codes themselves (snapkv.engine.coded_attention): the question's rows are
    then held apart (hold_question) until the cut keeps its positions, only those restored (keep_positions).
    Until restored, keys and values only tell the shape (1, kv_heads, held, head_dim): they hold no data."""

    def __init__(self, stored_keys: "Quantized | Mixed", stored_values: "Quantized | Mixed", buffer: RestoreBuffer,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.stored_keys, self.stored_values, self.buffer = stored_keys, stored_values, buffer
        heads, kept, head_dim = stored_keys.shape
        self.device = buffer.keys.device
        self.is_initialized = True
        self.restored = False
        self.question: tuple[torch.Tensor, torch.Tensor] | None = None  # held by hold_question until the cut
        self.keys = self.values = _placeholder(dtype, self.device, heads, kept, head_dim)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.restored:
            return super().update(key_states, value_states, *args, **kwargs)
        keys, values = self.buffer.lend(self)
        self.restored = True
        if key_states.shape[-2] <= self.buffer.room:
            self.keys, self.values = _written_after(keys, key_states), _written_after(values, value_states)
        else:  # copies out of the buffer: the layer holds its own tensors from here on
            self.keys, self.values = torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        return self.keys, self.values

    def hold_question(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The question's keys and values (1, kv_heads, q, head_dim) held after the stored positions, none of them
        restored (their attention was read from the codes); the cut that follows keeps positions with keep_positions."""
        heads, kept, head_dim = self.stored_keys.shape
        self.question = (key_states, value_states)
        self.keys = self.values = _placeholder(self.keys.dtype, self.device, heads, kept + key_states.shape[-2],
                                               head_dim)

    def keep_positions(self, indices: torch.Tensor) -> None:
        """Keep only the positions `indices` (1, kv_heads, k), ascending: gathered where the layer was restored;
        where it is still in its stored bits (hold_question), only those positions restored, the question's own rows
        after them (the same bits as restoring the whole layer and gathering)."""
        if self.restored:
            self.keys, self.values = gather_positions(self.keys, indices), gather_positions(self.values, indices)
            return
        (question_keys, question_values), self.question = self.question, None
        self.keys = restored_positions(self.stored_keys, indices, question_keys)
        self.values = restored_positions(self.stored_values, indices, question_values)
        self.restored = True

    def keep_own_copy(self) -> None:
        """Copy the keys and values out of the buffer where they still are there (the layer was not cut)."""
        if self.restored and self.buffer.holds(self.keys):
            self.keys = self.keys.clone()
        if self.restored and self.buffer.holds(self.values):
            self.values = self.values.clone()

    def released(self) -> DynamicLayer:
        """A plain DynamicLayer holding what this one holds, none of it in the buffer."""
        if self.question is not None:  # held, but no cut came: every position restored
            held = self.keys.shape[-2]
            self.keep_positions(torch.arange(held).expand(1, self.keys.shape[1], held))
        self.keep_own_copy()
        return plain_layer(self.keys, self.values, self.device)


def _placeholder(dtype: torch.dtype, device: torch.device, heads: int, held: int, head_dim: int) -> torch.Tensor:
    """(1, heads, held, head_dim) that tells a shape and holds no data (one element, expanded)."""
    return torch.empty((), dtype=dtype, device=device).expand(1, heads, held, head_dim)


def plain_layer(keys: torch.Tensor, values: torch.Tensor, device: torch.device) -> DynamicLayer:
    """A transformers DynamicLayer holding keys and values (1, kv_heads, held, head_dim) as they are, not copied."""
    plain = DynamicLayer()
    plain.device, plain.is_initialized = device, True
    plain.keys, plain.values = keys, values
    return plain


def _written_after(states: torch.Tensor, added: torch.Tensor) -> torch.Tensor:
    """states (1, kv_heads, n, head_dim), a view with free rows after each head's, with `added`'s rows
    (1, kv_heads, a, head_dim) written into them: a view (1, kv_heads, n + a, head_dim) of the same storage."""
    n = states.shape[-2]
    grown = states.as_strided((*states.shape[:2], n + added.shape[-2], states.shape[-1]), states.stride())
    grown[:, :, n:].copy_(added)
    return grown


def restoring_layers(keys: StoredLayers, values: StoredLayers, room: int) -> list[RestoringLayer]:
    """One RestoringLayer per layer, sharing one new RestoreBuffer with `room` free rows per head."""
    buffer = RestoreBuffer(keys, values, room)
    return [RestoringLayer(k, v, buffer, keys.dtype) for k, v in zip(keys.parts, values.parts)]


def release_buffers(cache: DynamicCache) -> None:
    """After the question's forward: every RestoringLayer becomes a plain DynamicLayer with tensors of its own,
    so that nothing decoded later touches the buffer (and the buffer can go)."""
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, RestoringLayer):
            cache.layers[index] = layer.released()
