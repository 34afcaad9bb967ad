"""CompressedCache: a prompt's KV cache after SnapKV, independent of transformers' Cache classes."""

from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from snapkv.base.bits import Bits
from snapkv.compression.config import Tier
from snapkv.storage.deferred import StoredLayers
from snapkv.storage.quantize import (dequantize, joined_rows, quantize, quantize_mixed, storage_dtype,
                                     stored_schemes)


@dataclass
class CompressedCache:
    """Per-layer keys and values (RoPE applied), which prompt positions they hold, and the prompt length.

    keys[i], values[i]: (kv_heads, kept_i, head_dim); a cache loaded deferred (snapkv.storage.cachefile.load_cache) holds
                        StoredLayers here: its layers stay in their stored bits, and each question's pass restores
                        them one at a time (snapkv.storage.deferred); reading an item restores that layer
    positions[i]:       (kv_heads, kept_i) int64, ascending original positions of the kept entries
    original_length:    tokens in the prompt; whatever follows it is placed from this position on
    token_ids:          (original_length,) int64, the prompt itself
    tier:               what the cache holds and how it was made (the cut, the stored bits, truncation);
                        a saved file's metadata is written from it
    document_span:      where the document sits in the prompt (None: all of it)
    question_room:      for a deferred cache, rows left free after each head's positions in the buffer a question's
                        pass restores each layer into, where the question's keys and values are written instead of
                        copying the layer (snapkv.storage.deferred); 0: none
    payload:            per layer, (keys, values) as a file stores them (16-bit tensors, or
                        snapkv.storage.quantize.Quantized or Mixed); keys and values above are these, restored. None until
                        the cache is rounded to its stored precision (at_precision)
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    original_length: int
    token_ids: torch.Tensor
    tier: Tier = field(default_factory=Tier)
    document_span: range | None = None
    payload: list[tuple] | None = None
    question_room: int = 0

    @property
    def document(self) -> range:
        return self.document_span if self.document_span is not None else range(0, self.original_length)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def deferred(self) -> bool:
        """True where the layers stay in their stored bits until a question's pass restores them."""
        return isinstance(self.keys, StoredLayers)

    def layer_shapes(self) -> list[tuple[int, int, int]]:
        """Per layer (kv_heads, kept, head_dim) of its keys (and values), without restoring a deferred layer."""
        if self.deferred:
            return [self.keys.shape(index) for index in range(len(self.keys))]
        return [tuple(k.shape) for k in self.keys]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.keys.dtype if self.deferred else self.keys[0].dtype

    @property
    def kept_tokens(self) -> int:
        """Positions held per KV head in the largest layer."""
        return max(p.shape[1] for p in self.positions)

    @property
    def holds_every_position(self) -> bool:
        """True where every layer holds every prompt position (no cut, no sliding window's tail): any prefix of
        the prompt is then a prefix of the cache (prefix)."""
        return all(p.shape[1] == self.original_length for p in self.positions)

    def prefix(self, length: int) -> "CompressedCache":
        """The cache of the prompt's first `length` positions, restored to the compute dtype (a deferred cache's
        layers one at a time); only where it holds every position. Not rounded: its stored form is gone."""
        if not self.holds_every_position or not 0 < length <= self.original_length:
            raise ValueError(f"a prefix of {length} positions of a cache holding {self.kept_tokens} of "
                             f"{self.original_length}")
        keys, values = [], []
        for index in range(self.num_layers):
            layer_keys = self.keys.restored(index) if self.deferred else self.keys[index]
            layer_values = self.values.restored(index) if self.deferred else self.values[index]
            keys.append(layer_keys[:, :length])  # (kv_heads, length, head_dim)
            values.append(layer_values[:, :length])
        span = self.document
        return CompressedCache(keys, values, [p[:, :length] for p in self.positions], length,
                               self.token_ids[:length].clone(), replace(self.tier, bits=Bits(16)),
                               range(min(span.start, length), min(span.stop, length)))

    @property
    def compressed(self) -> bool:
        """True if SnapKV dropped positions (sliding-window layers hold a tail anyway and do not count)."""
        return self.kept_tokens < self.original_length

    @property
    def kv_bytes(self) -> int:
        """What the keys and values take in memory, in the compute dtype (a deferred cache: once restored)."""
        element = self.compute_dtype.itemsize
        return sum(2 * heads * kept * head_dim * element for heads, kept, head_dim in self.layer_shapes())

    @property
    def stored_kv_bytes(self) -> int:
        """What they take as stored (fewer bits); kv_bytes until rounded to the stored precision."""
        return sum(self.stored_layer_bytes())

    @property
    def device(self) -> torch.device:
        return self.positions[0].device

    def full_kv_bytes(self, element_size: int | None = None) -> int:
        """What the uncompressed cache of the same prompt takes (in `element_size` bytes per number; default
        the compute dtype's)."""
        element = element_size or self.compute_dtype.itemsize
        per_position = sum(heads * head_dim * element * 2 for heads, _, head_dim in self.layer_shapes())
        return per_position * self.original_length

    def stored_layer_bytes(self) -> list[int]:
        """Per layer, the bytes its keys and values take as stored."""
        if self.payload is None:
            return [k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(self.keys, self.values)]
        return [sum(part.numel() * part.element_size() if isinstance(part, torch.Tensor) else part.nbytes
                    for part in pair) for pair in self.payload]

    @classmethod
    def from_dynamic_cache(
        cls,
        cache: DynamicCache,
        positions: list[torch.Tensor],
        original_length: int,
        token_ids: torch.Tensor,
        tier: Tier,
        document_span: range | None = None,
    ) -> "CompressedCache":
        keys = [layer.keys[0] for layer in cache.layers]
        values = [layer.values[0] for layer in cache.layers]
        return cls(keys, values, positions, original_length, token_ids, tier, document_span)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "CompressedCache":
        return replace(
            self,
            keys=[k.to(device=device, dtype=dtype) for k in self.keys],
            values=[v.to(device=device, dtype=dtype) for v in self.values],
            positions=[p.to(device) for p in self.positions],
        )

    def at_precision_after(self, stored_prefix: list[tuple], length: int, bits: "Bits | int") -> "CompressedCache":
        """The cache as it is stored (at_precision), its first `length` positions taken as `stored_prefix` holds them
        (per layer (keys, values) stored parts, first_rows of a saved cache whose restored form these positions are),
        only the positions after them rounded: a saved prefix is stored again byte for byte."""
        bits = Bits.parse(bits)
        compute = self.keys[0].dtype
        keys, values, payload = [], [], []
        for (layer_keys, layer_values), prefix_parts in zip(zip(self.keys, self.values), stored_prefix):
            schemes = stored_schemes(bits, layer_keys.shape[-1])
            stored, restored = [], []
            for x, scheme, prefix in zip((layer_keys, layer_values), schemes, prefix_parts):
                rest = x[:, length:]  # (kv_heads, new positions, head_dim)
                rest = rest.to(prefix.dtype) if scheme is None else quantize(rest, scheme)
                stored.append(joined_rows(prefix, rest))
                rest = rest.to(compute) if scheme is None else dequantize(rest, compute)
                restored.append(torch.cat([x[:, :length], rest], dim=1))
            keys.append(restored[0])
            values.append(restored[1])
            payload.append(tuple(stored))
        return replace(self, keys=keys, values=values, payload=payload, tier=replace(self.tier, bits=bits))

    def stored_one_layer_at_a_time(self, bits: "Bits | int", compute: torch.dtype | None = None,
                                   question_room: int = 0) -> "CompressedCache":
        """`self.to(compute).at_precision(16).at_precision(bits)` (no sharper share), the same values, made one layer
        at a time: each of this cache's layers is released once rounded (its keys and values lists are emptied), so
        that the prefill's cache is never held beside two more copies of itself (the 1.5B at 31k held 8.5 GB so).

        compute: the dtype the keys and values are restored in (default: theirs; a bf16 prefill's cache over fp32
        weights is restored in fp32). question_room > 0: the result deferred where it can be, with this many free rows
        after each head's positions (_holding).
        """
        bits = Bits.parse(bits)
        if bits.share:
            raise ValueError(f"{bits} bits rank a sharper share by probes over the whole cache: use at_precision")
        compute = compute or self.keys[0].dtype
        kinds = (self.keys, self.values)
        kind_bits = (bits.keys, bits.values)
        # at_precision's 16-bit dtypes, from each kind's largest magnitude (rounding keeps the order of magnitudes,
        # so the largest of a rounded kind is the rounded largest)
        largest = [max((float(t.abs().amax()) for t in kind if t.numel()), default=0.0) for kind in kinds]
        through = storage_dtype(compute, [torch.tensor(largest)])
        rounded = [float(torch.tensor(value, dtype=compute).to(through).abs()) for value in largest]
        in_sixteen = [value for value, b in zip(rounded, kind_bits) if b == 16]
        sixteen = storage_dtype(compute, [torch.tensor(in_sixteen)]) if in_sixteen else None
        payload = []
        for index in range(len(self.keys)):
            layer = (self.keys[index], self.values[index])
            self.keys[index] = self.values[index] = None  # released with `layer` once rounded
            schemes = stored_schemes(bits, layer[0].shape[-1])
            restored_16 = (x.to(compute).to(through).to(compute) for x in layer)  # as a 16-bit file of it holds it
            payload.append(tuple(x.to(sixteen) if scheme is None else quantize(x, scheme)
                                 for x, scheme in zip(restored_16, schemes)))
            del layer
        self.keys, self.values = [], []
        return self._holding(payload, bits, compute, question_room)

    def _holding(self, payload: list[tuple], bits: Bits, compute: torch.dtype, question_room: int) -> "CompressedCache":
        """This cache holding `payload` (per layer its stored (keys, values)) in `bits`: deferred with question_room
        > 0 on a CPU where each layer keeps its values in fewer bits (snapkv.storage.deferred: as a loaded file is),
        else restored in `compute`."""
        tier = replace(self.tier, bits=bits)
        if question_room > 0 and bits.values < 16 and compute in (torch.float32, torch.bfloat16) \
                and self.device.type == "cpu":
            keys, values = (StoredLayers([pair[kind] for pair in payload], compute) for kind in (0, 1))
            return replace(self, keys=keys, values=values, payload=payload, tier=tier, question_room=question_room)
        keys, values = ([part.to(compute) if isinstance(part, torch.Tensor) else dequantize(part, compute)
                         for part in (pair[kind] for pair in payload)] for kind in (0, 1))
        return replace(self, keys=keys, values=values, payload=payload, tier=tier, question_room=0)

    def at_precision(self, bits: "Bits | int", sharp: list[torch.Tensor] | None = None,
                     question_room: int = 0) -> "CompressedCache":
        """The cache as it is stored: every key and value rounded to `bits` bits (16: a 16-bit dtype, whatever
        the compute dtype), with that stored form kept as `payload` for the file, so that a cache answers the
        same before it is saved and after it is loaded.

        sharp: with a sharper share (Bits.share), per layer (kv_heads, kept) bool, the held positions kept in
        the share's bits (snapkv.engine.tiers.sharper_positions chooses them).
        question_room: > 0 to hold it deferred where it can be (_holding), never restored whole.
        """
        bits = Bits.parse(bits)
        if bool(bits.share) != (sharp is not None):
            raise ValueError(f"{bits} bits {'need' if bits.share else 'take no'} sharper positions")
        compute = self.keys[0].dtype
        payload = []
        in_sixteen = [part for part, kind_bits in ((self.keys, bits.keys), (self.values, bits.values)) if kind_bits == 16]
        sixteen = storage_dtype(compute, [t for part in in_sixteen for t in part]) if in_sixteen else None
        for index, (layer_keys, layer_values) in enumerate(zip(self.keys, self.values)):
            if sharp is None:
                schemes = stored_schemes(bits, layer_keys.shape[-1])  # None: that kind in 16 bits
                stored = tuple(x.to(sixteen) if scheme is None else quantize(x, scheme)
                               for x, scheme in zip((layer_keys, layer_values), schemes))
            else:
                schemes = stored_schemes(bits.rest, layer_keys.shape[-1])
                sharper = stored_schemes(bits.sharper, layer_keys.shape[-1])
                stored = tuple(quantize_mixed(x, sharp[index], high, low) for x, high, low
                               in zip((layer_keys, layer_values), sharper, schemes))
            payload.append(stored)
        return self._holding(payload, bits, compute, question_room)
