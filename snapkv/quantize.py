"""Keys and values in fewer bits: group-wise asymmetric quantization (KIVI, arXiv 2402.02750).

Groups of `group` consecutive values along one axis share a scale and a minimum (fp16):
q = round((x - minimum) / scale), x ~ q * scale + minimum, with q in [0, 2^bits - 1], packed into bytes.
KIVI's axes: keys grouped along tokens (per channel, as their outliers sit in a few channels) and values
along channels (per token). Pure tensor functions; what a file stores is snapkv.cachefile's business.
"""

from dataclasses import dataclass

import torch

# Axis of the (kv_heads, tokens, head_dim) tensors along which a group runs.
TOKENS, CHANNELS = 1, 2
AXIS_NAMES = {TOKENS: "tokens", CHANNELS: "channels"}


@dataclass(frozen=True)
class Scheme:
    """How one kind of tensor (keys or values) is quantized: bits, the axis its groups run along, group size."""

    bits: int
    axis: int
    group: int

    def to_dict(self) -> dict:
        return {"bits": self.bits, "axis": AXIS_NAMES[self.axis], "group": self.group}

    @classmethod
    def from_dict(cls, data: dict) -> "Scheme":
        """ValueError (or KeyError, TypeError) for a scheme this module cannot read."""
        axis = {name: number for number, name in AXIS_NAMES.items()}[data["axis"]]
        scheme = cls(int(data["bits"]), axis, int(data["group"]))
        if scheme.bits not in (2, 4, 8) or scheme.group < 1 or scheme.group % (8 // scheme.bits):
            raise ValueError(f"unreadable quantization scheme {data}")
        return scheme

    def stored_shapes(self, shape: tuple[int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(codes, scale and minimum) shapes of a (kv_heads, tokens, head_dim) tensor quantized this way."""
        other = shape[CHANNELS] if self.axis == TOKENS else shape[TOKENS]
        groups = -(-shape[self.axis] // self.group)
        return (shape[0], other, groups, self.group * self.bits // 8), (shape[0], other, groups)


GROUP = 32  # KIVI's group size; 128-token key groups (and a head's channels for values) lost needles at 4 bits


def kivi_schemes(bits: int, head_dim: int) -> tuple[Scheme, Scheme]:
    """(keys, values): keys per channel in groups of 32 tokens, values per token in groups of 32 channels (or a
    head's channels, if fewer)."""
    return Scheme(bits, TOKENS, GROUP), Scheme(bits, CHANNELS, min(GROUP, head_dim))


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
    """(..., group) values below 2^bits -> (..., group * bits / 8) bytes, low bits first."""
    per_byte = 8 // bits
    q = q.reshape(*q.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
    return (q << shifts).sum(dim=-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    q = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(*packed.shape[:-1], -1)


def quantize(x: torch.Tensor, scheme: Scheme) -> Quantized:
    """x: (kv_heads, tokens, head_dim), any float dtype."""
    if scheme.bits not in (2, 4, 8):
        raise ValueError(f"quantize takes 2, 4 or 8 bits, not {scheme.bits}")
    if scheme.group % (8 // scheme.bits):
        raise ValueError(f"a group of {scheme.group} does not pack into bytes at {scheme.bits} bits")
    grouped = _grouped(x.float(), scheme.axis, scheme.group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    levels = (1 << scheme.bits) - 1
    minimum = low.to(torch.float16)
    scale = ((high - minimum.float()) / levels).clamp_min(1e-8).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # fp16 underflow of a flat group
    q = ((grouped - minimum.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round().clamp(0, levels)
    return Quantized(_pack(q.to(torch.uint8), scheme.bits), scale, minimum, tuple(x.shape), scheme)


def dequantize(quantized: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(kv_heads, tokens, head_dim) in `dtype`."""
    q = _unpack(quantized.packed, quantized.scheme.bits).float()
    x = q * quantized.scale.float().unsqueeze(-1) + quantized.minimum.float().unsqueeze(-1)
    return _ungrouped(x, quantized.shape, quantized.scheme.axis).to(dtype).contiguous()


def storage_dtype(compute: torch.dtype, tensors: list[torch.Tensor]) -> torch.dtype:
    """The 16-bit dtype a cache is stored in: the model's own when it is 16-bit; else fp16 (finer than bf16),
    or bf16 where a value would not fit fp16's range."""
    if compute in (torch.float16, torch.bfloat16):
        return compute
    largest = max((float(t.abs().amax()) for t in tensors if t.numel()), default=0.0)
    return torch.float16 if largest < 60000 else torch.bfloat16
