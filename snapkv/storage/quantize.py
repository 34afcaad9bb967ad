"""Keys and values in fewer bits: group-wise asymmetric quantization (KIVI, arXiv 2402.02750).

Groups of `group` consecutive values along one axis share a scale and a minimum (fp16):
q = round((x - minimum) / scale), x ~ q * scale + minimum, with q in [0, 2^bits - 1], packed into bytes.
KIVI's axes: keys grouped along tokens (per channel, as their outliers sit in a few channels) and values
along channels (per token). A scheme may first rotate each head's vectors by an orthonormal (block) Hadamard
matrix, as QuaRot (arXiv 2404.00456) does: the rotation spreads outlier channels over all channels, so the
groups hold evener values and round with less error; it is undone after dequantizing, so the model never sees
it. A Mixed tensor keeps a share of each head's positions (the ones the model needs most) in more bits than
the rest, as MiKV (arXiv 2402.18096) does. Tensor functions (dequantizing by snapkv's C kernel where it is
available); what a file stores is snapkv.storage.cachefile's business.
"""

import ctypes
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import torch

from snapkv import native
from snapkv.base.bits import (AXIS_NAMES, CHANNELS, SUPPORTED_BITS, TOKENS, Bits, Form,  # noqa: F401 (re-exported)
                              Scheme, values_per_chunk)
from snapkv.compression.scoring import gather_positions
from snapkv.native.threads import threads_now

GROUP = 32  # KIVI's group size; unrotated 128-token key groups (and head-wide value groups) lost needles at 4 bits


# Below 8 bits, rotated, keys per channel over 128 tokens and values per token over the head: measured on
# the embedded model (docs/what-is-saved.md), 4/3 bits this way (4.1x smaller than 16) answered the sweep's
# needles and facts as the full cache did and missed 2 of 44 needles of the whole grid; KIVI's unrotated groups
# of 32 at 4/4 (3.2x) did no better.
LOW_BITS_KEY_GROUP = 128


def stored_schemes(bits: Bits, head_dim: int) -> tuple[Scheme | None, Scheme | None]:
    """(keys, values) schemes a cache is stored with: None for a kind kept in 16 bits; at 8 bits KIVI's groups of
    32, unrotated; fewer bits Hadamard-rotated, keys per channel in groups of 128 tokens, values per token over the
    whole head (the group's scale and minimum cost less, the rotation keeps the error low). A kind's Form (bits.
    key_form, bits.value_form: "8r", "4g32") replaces its rotation or its group size."""
    def scheme(kind_bits: int, axis: int, form: Form) -> Scheme | None:
        if kind_bits == 16:
            return None
        if kind_bits == 8:
            chosen = Scheme(8, axis, GROUP if axis == TOKENS else min(GROUP, head_dim))
        else:
            chosen = Scheme(kind_bits, axis, LOW_BITS_KEY_GROUP if axis == TOKENS else head_dim, rotated=True)
        return replace(chosen, **{name: getattr(form, name) for name in ("rotated", "group")
                                  if getattr(form, name) is not None})

    return scheme(bits.keys, TOKENS, bits.key_form), scheme(bits.values, CHANNELS, bits.value_form)


@lru_cache(maxsize=8)
def _hadamard_block(head_dim: int) -> torch.Tensor:
    """An orthonormal, symmetric Hadamard matrix of the largest power of two that divides head_dim (64 for 64,
    32 for 96): applied to each block of a head's channels."""
    size = head_dim & -head_dim
    block = torch.ones(1, 1)
    while block.shape[0] < size:
        block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
    return block / size**0.5


def hadamard_rotated(x: torch.Tensor) -> torch.Tensor:
    """(..., head_dim) float32 -> the same, each block of channels times the Hadamard block (its own inverse)."""
    block = _hadamard_block(x.shape[-1]).to(x.device)
    return (x.reshape(*x.shape[:-1], -1, block.shape[0]) @ block).reshape(x.shape)


@dataclass
class Quantized:
    """A (kv_heads, tokens, head_dim) tensor in `scheme.bits` bits.

    packed:  (kv_heads, other, groups, group * bits / 8) uint8, the grouped axis last
    scale, minimum: (kv_heads, other, groups) fp16
    """

    packed: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    shape: tuple[int, int, int]
    scheme: Scheme

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.minimum))


@dataclass
class Mixed:
    """A (kv_heads, tokens, head_dim) tensor with a sharper share of each head's tokens in more bits.

    sharp: (kv_heads, tokens) bool, True at the sharper tokens, as many in every head
    high:  Quantized (kv_heads, sharper tokens, head_dim), those tokens in order
    low:   Quantized (kv_heads, the other tokens, head_dim), the rest in order
    """

    sharp: torch.Tensor
    high: Quantized
    low: Quantized
    _destinations: dict = field(default_factory=dict, repr=False, compare=False)  # room -> destination_rows(room)

    def destination_rows(self, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(high, low) (count,) int64: the rows of a (kv_heads * (tokens + room), head_dim) buffer that each part's
        rows go to, a head's tokens in order; kept, as each question's pass restores into the same layout (at 8k
        tokens of the embedded model, 0.2 MB per layer's keys or values); found in one pass in C where it can be."""
        if room not in self._destinations:
            heads, tokens = self.sharp.shape
            high = torch.empty(heads * self.high.shape[1], dtype=torch.int64)
            low = torch.empty(heads * self.low.shape[1], dtype=torch.int64)
            sharp = self.sharp.contiguous()
            if (sharp.device.type == "cpu" and native.unavailable_reason() is None  # one pass in C
                    and native.kernels().part_rows(native.pointer(sharp, torch.bool), heads, tokens, room,
                                                   native.pointer(high, torch.int64), high.shape[0],
                                                   native.pointer(low, torch.int64), low.shape[0]) == 0):
                self._destinations[room] = (high, low)
            else:
                sharp = torch.nn.functional.pad(self.sharp.to(self.high.scale.device), (0, room))  # (kv_heads, tokens + room)
                self._destinations[room] = (_rows_of(sharp), _rows_of(_held(heads, tokens, room, sharp.device) & ~sharp))
        return self._destinations[room]

    @property
    def shape(self) -> tuple[int, int, int]:
        heads, tokens = self.sharp.shape
        return heads, tokens, self.high.shape[2]

    @property
    def nbytes(self) -> int:
        """As stored: both parts and the mask at one bit per position."""
        heads, tokens = self.sharp.shape
        return self.high.nbytes + self.low.nbytes + heads * (-(-tokens // 8))


def _rows_of(chosen: torch.Tensor) -> torch.Tensor:
    """(kv_heads, tokens) bool -> (count,) int64: the chosen rows of a (kv_heads * tokens, head_dim) view, a
    head's tokens in order, head after head (the order a Mixed part holds them in)."""
    if chosen.device.type == "cpu":  # numpy's flatnonzero: 4x faster than torch's nonzero (28 against 117 us at 3 x 8k)
        return torch.from_numpy(np.flatnonzero(chosen.numpy()))
    return chosen.reshape(-1).nonzero().squeeze(1)


def quantize_mixed(x: torch.Tensor, sharp: torch.Tensor, high: "Scheme", low: "Scheme") -> Mixed:
    """x (kv_heads, tokens, head_dim); sharp (kv_heads, tokens) bool with as many True per head: those tokens
    quantized with `high`, the rest with `low`, each part as a tensor of its own."""
    if sharp.shape != x.shape[:2] or bool((sharp.sum(dim=1) != sharp[:1].sum()).any()):
        raise ValueError("a sharper share must pick as many tokens in every head")
    heads, _, head_dim = x.shape
    rows = x.reshape(-1, head_dim)  # (kv_heads * tokens, head_dim)
    return Mixed(sharp, quantize(rows.index_select(0, _rows_of(sharp)).reshape(heads, -1, head_dim), high),
                 quantize(rows.index_select(0, _rows_of(~sharp)).reshape(heads, -1, head_dim), low))


def _grouped(x: torch.Tensor, axis: int, group: int) -> torch.Tensor:
    """(kv_heads, tokens, head_dim) -> (kv_heads, other, groups, group), the axis padded with its last value."""
    x = x.transpose(axis, -1) if axis != x.dim() - 1 else x
    length = x.shape[-1]
    pad = (-length) % group
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def _ungrouped(x: torch.Tensor, shape: tuple[int, int, int], axis: int) -> torch.Tensor:
    """The inverse of _grouped: (kv_heads, other, groups, group) -> `shape`."""
    length = shape[axis]
    x = x.reshape(*x.shape[:-2], -1)[..., :length]
    return x.transpose(axis, -1) if axis != len(shape) - 1 else x


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., group) values below 2^bits -> (..., group * bits / 8) bytes, little-endian: the first value in the
    lowest bits of the first byte (at 2, 4 and 8 bits a byte holds whole values; at 3 bits 8 values span 3)."""
    per_chunk = values_per_chunk(bits)
    if bits * per_chunk == 8:  # whole values per byte: shifts in uint8
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
        return (q.reshape(*q.shape[:-1], -1, per_chunk) << shifts).sum(dim=-1, dtype=torch.uint8)
    chunks = q.reshape(*q.shape[:-1], -1, per_chunk).to(torch.int64)
    shifts = torch.arange(0, bits * per_chunk, bits, device=q.device)
    words = (chunks << shifts).sum(dim=-1, keepdim=True)  # (..., chunks, 1): 24 bits at 3 bits
    byte_shifts = torch.arange(0, bits * per_chunk, 8, device=q.device)
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*q.shape[:-1], -1)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_chunk = values_per_chunk(bits)
    if bits == 8:
        return packed
    if bits * per_chunk == 8:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        q = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return q.reshape(*packed.shape[:-1], -1)
    chunk_bytes = bits * per_chunk // 8
    chunks = packed.reshape(*packed.shape[:-1], -1, chunk_bytes).to(torch.int32)
    byte_shifts = torch.arange(0, 8 * chunk_bytes, 8, dtype=torch.int32, device=packed.device)
    words = (chunks << byte_shifts).sum(dim=-1, keepdim=True, dtype=torch.int32)
    shifts = torch.arange(0, bits * per_chunk, bits, dtype=torch.int32, device=packed.device)
    q = (words >> shifts) & ((1 << bits) - 1)
    return q.to(torch.uint8).reshape(*packed.shape[:-1], -1)


def quantize(x: torch.Tensor, scheme: Scheme) -> Quantized:
    """x: (kv_heads, tokens, head_dim), any float dtype."""
    if scheme.bits not in SUPPORTED_BITS:
        raise ValueError(f"quantize takes {', '.join(map(str, SUPPORTED_BITS))} bits, not {scheme.bits}")
    if scheme.group % values_per_chunk(scheme.bits):
        raise ValueError(f"a group of {scheme.group} does not pack into bytes at {scheme.bits} bits")
    x = hadamard_rotated(x.float()) if scheme.rotated else x.float()
    grouped = _grouped(x, scheme.axis, scheme.group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    levels = (1 << scheme.bits) - 1
    minimum = low.to(torch.float16)
    scale = ((high - minimum.float()) / levels).clamp_min(1e-8).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # fp16 underflow of a flat group
    q = ((grouped - minimum.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round().clamp(0, levels)
    return Quantized(_pack(q.to(torch.uint8), scheme.bits), scale, minimum, tuple(x.shape), scheme)


def first_rows(part: "Quantized | Mixed | torch.Tensor", length: int) -> "Quantized | torch.Tensor | None":
    """A stored (kv_heads, tokens, head_dim) part's first `length` tokens, where each token is stored on its own (16
    bits, or grouped along channels); None where tokens share groups (keys grouped along tokens, a sharper share)."""
    if isinstance(part, torch.Tensor):
        return part[:, :length]
    if isinstance(part, Quantized) and part.scheme.axis == CHANNELS:
        return Quantized(part.packed[:, :length], part.scale[:, :length], part.minimum[:, :length],
                         (part.shape[0], length, part.shape[2]), part.scheme)
    return None


def joined_rows(first: "Quantized | torch.Tensor", second: "Quantized | torch.Tensor") -> "Quantized | torch.Tensor":
    """Two stored parts of one scheme (first_rows' kind) as one, the second's tokens after the first's."""
    if isinstance(first, torch.Tensor):
        return torch.cat([first, second.to(first.dtype)], dim=1)
    return Quantized(*(torch.cat([a, b], dim=1) for a, b in ((first.packed, second.packed),
                                                              (first.scale, second.scale),
                                                              (first.minimum, second.minimum))),
                     (first.shape[0], first.shape[1] + second.shape[1], first.shape[2]), first.scheme)


NATIVE_OUTPUTS = {torch.float32: 0, torch.bfloat16: 1}  # the C kernel's out_kind


def _dequantize_natively(quantized: Quantized, rows: torch.Tensor, destination: torch.Tensor | None) -> bool:
    """Dequantize into `rows` (kv_heads * tokens or more, head_dim), fp32 or bf16, with the C kernel, row
    (head, token) at destination[head * tokens + token] (None: in order); False where the kernel is not to be
    used here."""
    if rows.dtype not in NATIVE_OUTPUTS or rows.device.type != "cpu" or native.unavailable_reason() is not None:
        return False
    heads, tokens, head_dim = quantized.shape
    scheme = quantized.scheme
    packed, scale, minimum = (t.contiguous() for t in (quantized.packed, quantized.scale, quantized.minimum))
    status = native.kernels().dequantize_rows(
        native.pointer(packed, torch.uint8), native.pointer(scale, torch.float16),
        native.pointer(minimum, torch.float16, tuple(scale.shape)), heads, tokens, head_dim, scheme.bits,
        int(scheme.axis == TOKENS), scheme.group, (head_dim & -head_dim) if scheme.rotated else 0,
        None if destination is None else native.pointer(destination, torch.int64, (heads * tokens,)),
        native.pointer(rows, rows.dtype, (None, head_dim)), NATIVE_OUTPUTS[rows.dtype], threads_now())
    return status == 0


def dequantize(quantized: "Quantized | Mixed | torch.Tensor", dtype: torch.dtype = torch.float32, room: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """(kv_heads, tokens, head_dim) in `dtype`. In fp32 or bf16 on a CPU with snapkv's C kernels, one pass in C
    (snapkv/native/kernels/dequantize.c: the same values, a rotated tensor within rounding); else PyTorch's ops.

    room: free rows left after each head's tokens (the result is a view of a (kv_heads, tokens + room,
    head_dim) buffer), where a question can be written without copying the rest (snapkv.storage.deferred).
    out: a flat buffer of `dtype` with at least kv_heads * (tokens + room) * head_dim elements to restore into
    (its start is that buffer); None: a new one."""
    heads, tokens, head_dim = quantized.shape
    if isinstance(quantized, torch.Tensor):  # a kind stored in 16 bits (Bits(16, 8)'s keys): copied as it is
        device = quantized.device
    else:
        device = quantized.scale.device if isinstance(quantized, Quantized) else quantized.high.scale.device
    if out is None:
        buffer = torch.empty((heads, tokens + room, head_dim), dtype=dtype, device=device)
    else:
        buffer = out[: heads * (tokens + room) * head_dim].view(heads, tokens + room, head_dim)
    out = buffer[:, :tokens]
    if isinstance(quantized, torch.Tensor):
        return out.copy_(quantized)
    rows = buffer.view(heads * (tokens + room), head_dim)
    if isinstance(quantized, Mixed):
        for destination, part in zip(quantized.destination_rows(room), (quantized.high, quantized.low)):
            if not _dequantize_natively(part, rows, destination):
                rows.index_copy_(0, destination, dequantize(part, dtype).reshape(-1, head_dim))
        return out
    if _dequantize_natively(quantized, rows, _rows_of(_held(heads, tokens, room, device)) if room else None):
        return out
    q = _unpack(quantized.packed, quantized.scheme.bits).float()
    x = q * quantized.scale.float().unsqueeze(-1) + quantized.minimum.float().unsqueeze(-1)
    x = _ungrouped(x, quantized.shape, quantized.scheme.axis)
    return out.copy_(hadamard_rotated(x) if quantized.scheme.rotated else x)


def restored_positions(stored: "Quantized | Mixed | torch.Tensor", positions: torch.Tensor,
                       after: torch.Tensor) -> torch.Tensor:
    """(1, kv_heads, kept, head_dim) fp32: the rows at `positions` (1, kv_heads, kept) int64 of `stored` (kv_heads,
    tokens, head_dim) followed by `after` (1, kv_heads, a, head_dim) fp32 (positions from `tokens` on are its rows): a
    cut of a layer still in its stored bits. On a CPU with snapkv's C kernels only those rows are decoded
    (snapkv/native/kernels/dequantize.c's dequantize_positions: the same bits as dequantize's); else the whole is
    restored and the rows gathered."""
    heads, tokens, head_dim = stored.shape
    kept = positions.shape[2]
    parts = [stored] if isinstance(stored, Quantized) else [stored.high, stored.low] if isinstance(stored, Mixed) else []
    if (parts and after.dtype == torch.float32 and after.device.type == "cpu" and native.unavailable_reason() is None
            and head_dim <= native.limit("snapkv_max_stored_head_dim")):
        held = [(t.contiguous(), dtype) for part in parts for t, dtype in (
            (part.packed, torch.uint8), (part.scale, torch.float16), (part.minimum, torch.float16))]
        pointers = (ctypes.c_void_p * len(held))(*[native.pointer(t, dtype) for t, dtype in held])
        shapes = (ctypes.c_int64 * (5 * len(parts)))(*[number for part in parts for number in (
            part.shape[1], part.scheme.bits, int(part.scheme.axis == TOKENS), part.scheme.group,
            (head_dim & -head_dim) if part.scheme.rotated else 0)])
        columns = None
        if isinstance(stored, Mixed):  # each position's column: a head's sharper tokens first, then its others
            sharp = stored.sharp.contiguous()
            columns = torch.empty(heads, tokens, dtype=torch.int64)
            native.kernels().part_columns(native.pointer(sharp, torch.bool), heads, tokens,
                                          native.pointer(columns, torch.int64))
        wanted, rows = positions.contiguous(), after.contiguous()
        out = torch.empty(1, heads, kept, head_dim)
        if native.kernels().dequantize_positions(
                pointers, shapes, len(parts), None if columns is None else native.pointer(columns, torch.int64),
                heads, tokens, head_dim, native.pointer(wanted, torch.int64), kept,
                native.pointer(rows, torch.float32), rows.shape[2], native.pointer(out, torch.float32),
                threads_now()) == 0:
            return out
    whole = torch.cat([dequantize(stored).unsqueeze(0).to(after.device), after.float()], dim=2)
    return gather_positions(whole, positions)


def _held(heads: int, tokens: int, room: int, device: torch.device) -> torch.Tensor:
    """(kv_heads, tokens + room) bool: True on the tokens, False on the room after them."""
    return (torch.arange(tokens + room, device=device) < tokens).expand(heads, -1)


def storage_dtype(compute: torch.dtype, tensors: list[torch.Tensor]) -> torch.dtype:
    """The 16-bit dtype a cache is stored in: the model's own when it is 16-bit; else fp16 (finer than bf16),
    or bf16 where a value would not fit fp16's range."""
    if compute in (torch.float16, torch.bfloat16):
        return compute
    largest = max((float(t.abs().amax()) for t in tensors if t.numel()), default=0.0)
    return torch.float16 if largest < 60000 else torch.bfloat16
