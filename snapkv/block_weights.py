"""Linear layers whose weights are 4-bit or 8-bit blocks, decoded from those blocks on CPU in fp32.

A GGUF file (the embedded model's) stores its matrices in blocks of 32 weights along the input: Q4_1
(w = scale * q + minimum, q in 0..15) and Q8_0 (w = scale * q, q in -127..127), scale and minimum in fp16.
Loaded for PyTorch they become fp32, 4 bytes per weight where the file had 0.625 and 1.06, and every decoded
token reads all of them. `exact_blocks` finds the blocks back from the fp32 values, and only when every weight
comes back exactly; `BlockLinear` then multiplies a few rows (a decoded token, up to KERNEL_ROWS) with
snapkv/kernels/blockwise_matmul.c over the blocks, and anything longer (the prompt) with PyTorch's fp32 matmul
over the fp32 weights, kept for that. Nothing is rounded: weights that are not exactly blocks (a bf16
checkpoint) stay as they are.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import native

BLOCK = 32
KERNEL_ROWS = 1  # rows taken by the kernel; more go to PyTorch (the kernel measured no faster at 2+, see README)


@dataclass(frozen=True)
class Blocks:
    """A (out, in) matrix as blocks of 32 along `in`. codes: 4-bit (out, in / 2) uint8, element j of a block
    in the low nibble of its byte j and element j + 16 in the high nibble; 8-bit (out, in) int8.
    scale, minimum: (out, in / 32) fp32; minimum None for 8-bit (symmetric)."""

    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        parts = (self.codes, self.scale) + ((self.minimum,) if self.minimum is not None else ())
        return sum(part.numel() * part.element_size() for part in parts)


def _fp16_exact(values: torch.Tensor) -> bool:
    return bool((values.half().float() == values).all())


def exact_blocks(weight: torch.Tensor) -> Blocks | None:
    """The 4-bit (tried first) or 8-bit blocks that give back every weight exactly in fp32, or None.

    weight: (out, in) fp32 on CPU, `in` a multiple of 32. 4-bit: a block's minimum is its smallest weight
    (q = 0) and its scale (largest - smallest) / 15 rounded to fp16, as Q4_1 quantizes; 8-bit: the scale is
    the largest magnitude / 127 in fp16, as Q8_0 does. Checked by rebuilding every weight as the GGUF loader
    computes it (scale * q + minimum in fp32)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % BLOCK:
        return None
    out, inputs = weight.shape
    grouped = weight.detach().reshape(out, inputs // BLOCK, BLOCK)  # (out, blocks, 32)
    smallest = grouped.amin(dim=-1, keepdim=True)
    scale = ((grouped.amax(dim=-1, keepdim=True) - smallest) / 15).half().float()
    codes = ((grouped - smallest) / scale.where(scale > 0, 1.0)).round().clamp(0, 15)
    if _fp16_exact(smallest) and torch.equal(codes * scale + smallest, grouped):
        nibbles = codes.to(torch.uint8).reshape(out, inputs // BLOCK, 2, BLOCK // 2)  # halves: elements j, j + 16
        packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)  # (out, blocks, 16)
        return Blocks(4, packed.reshape(out, inputs // 2).contiguous(), scale.reshape(out, -1).contiguous(),
                      smallest.reshape(out, -1).contiguous())
    scale = (grouped.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    codes = (grouped / scale.where(scale > 0, 1.0)).round().clamp(-127, 127)
    if torch.equal(codes * scale, grouped):
        return Blocks(8, codes.to(torch.int8).reshape(out, inputs).contiguous(), scale.reshape(out, -1).contiguous(),
                      None)
    return None


def blockwise_matmul(x: torch.Tensor, blocks: Blocks, out_features: int) -> torch.Tensor:
    """x (rows, in) fp32 contiguous, rows <= native.MAX_ROWS -> (rows, out) = x @ W^T, W given as blocks."""
    library = native.kernels()
    rows, inputs = x.shape
    y = torch.empty(rows, out_features)
    threads = torch.get_num_threads()
    if blocks.bits == 4:
        status = library.matmul_4bit(x.data_ptr(), rows, inputs, blocks.codes.data_ptr(), blocks.scale.data_ptr(),
                                     blocks.minimum.data_ptr(), out_features, y.data_ptr(), threads)
    else:
        status = library.matmul_8bit(x.data_ptr(), rows, inputs, blocks.codes.data_ptr(), blocks.scale.data_ptr(),
                                     out_features, y.data_ptr(), threads)
    if status != 0:
        raise ValueError(f"the blockwise kernel refused {rows} rows of {inputs}")
    return y


class BlockLinear(torch.nn.Module):
    """An nn.Linear that also holds its weight as exact Blocks: up to KERNEL_ROWS rows of fp32 on CPU are
    multiplied from the blocks, everything else by F.linear over `weight` (the same Parameter as before, so a
    weight tied to the input embeddings stays tied)."""

    def __init__(self, linear: torch.nn.Linear, blocks: Blocks) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > KERNEL_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        y = blockwise_matmul(x.reshape(rows, self.in_features).contiguous(), self.blocks, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.blocks.bits}-bit blocks"


@dataclass(frozen=True)
class BlockReport:
    """What use_block_weights did: how many linear layers decode from blocks, of how many, and why not if none."""

    packed: int
    linear_layers: int
    block_bytes: int
    reason: str | None = None

    def describe(self) -> str:
        if self.reason:
            return f"fp32 weights ({self.reason})"
        return (f"{self.packed} of {self.linear_layers} linear layers decode from exact 4/8-bit blocks "
                f"({self.block_bytes / 2**20:.0f} MiB)")


def use_block_weights(model: torch.nn.Module) -> BlockReport:
    """Swap every nn.Linear of `model` whose fp32 weight is exactly blocks for a BlockLinear; the rest stay.
    Nothing is swapped when the kernels are unavailable (the report says why)."""
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]
    reason = native.unavailable_reason()
    if reason:
        return BlockReport(0, len(linears), 0, reason)
    packed, block_bytes = 0, 0
    for parent, name, linear in linears:
        blocks = exact_blocks(linear.weight)
        if blocks is None:
            continue
        setattr(parent, name, BlockLinear(linear, blocks))
        packed += 1
        block_bytes += blocks.nbytes
    reason = None if packed else "no linear layer's weights are exact 4/8-bit blocks"
    return BlockReport(packed, len(linears), block_bytes, reason)
