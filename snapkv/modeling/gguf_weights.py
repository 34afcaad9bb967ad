"""Linear layers and embeddings whose weights stay in a GGUF file's own blocks (Q4_K, Q6_K, Q5_0, Q8_0, ...), read
where the file is mapped (snapkv.modeling.gguf_file): memory is the file, never an fp32 or bf16 copy of the model.

A few rows of fp32 activations (a decoded token, a question's rows) are multiplied by the blocks themselves
(snapkv/native/kernels/gguf_blocks.c's gguf_matmul); more rows (a prompt's chunk) by PyTorch over the layer's weights
turned into a bf16 or fp32 tile for that one product (gguf_dequantize: the very values gguf-py and llama.cpp give),
freed right after. An embedding looks up the rows it is asked for the same way.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from snapkv import native
from snapkv.native.threads import threads_now

FEW_ROWS = 64  # rows multiplied by the blocks themselves (native.MAX_ROWS); more: a dequantized tile
DENSE = {"F32": torch.float32, "BF16": torch.bfloat16}  # read as they are, by dense_rows.c and PyTorch


@dataclass(frozen=True)
class GGUFMatrix:
    """A (outputs, inputs) matrix as the file stores it: `blocks` (outputs, row bytes) uint8, a view of the mapping
    (or a gathered copy of it, for rows a file stores in another order), in ggml's type `type_id`."""

    type_id: int
    type_name: str
    blocks: torch.Tensor
    outputs: int
    inputs: int

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, order: torch.Tensor) -> "GGUFMatrix":
        """The same matrix with its rows taken in `order` (a copy of those rows' blocks)."""
        return GGUFMatrix(self.type_id, self.type_name, self.blocks[order].contiguous(), len(order), self.inputs)

    def dense(self) -> torch.Tensor | None:
        """F32 and BF16 matrices as they are, (outputs, inputs); None for block types."""
        if self.type_name not in DENSE:
            return None
        return self.blocks.view(DENSE[self.type_name]).view(self.outputs, self.inputs)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(outputs, inputs) in fp32 or bf16: every weight as gguf-py computes it (bf16 rounded from that)."""
        dense = self.dense()
        if dense is not None:
            return dense.to(dtype)
        wanted = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        out = torch.empty(self.outputs, self.inputs, dtype=wanted)
        status = native.kernels().gguf_dequantize(self.type_id, native.pointer(self.blocks, torch.uint8),
                                                  self.outputs, self.inputs, self.blocks.shape[1],
                                                  native.pointer(out, wanted), int(wanted == torch.bfloat16),
                                                  threads_now())
        if status != 0:
            raise ValueError(f"the kernels do not read {self.type_name} matrices of {self.inputs} inputs")
        return out.to(dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` (any shape) -> (*ids.shape, inputs) fp32."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        dense = self.dense()
        if dense is not None:
            return dense[flat].float().reshape(*ids.shape, self.inputs)
        out = torch.empty(flat.numel(), self.inputs)
        if native.kernels().gguf_rows(self.type_id, native.pointer(self.blocks, torch.uint8), self.outputs,
                                      self.inputs, self.blocks.shape[1], native.pointer(flat, torch.int64),
                                      flat.numel(), native.pointer(out, torch.float32)) != 0:
            raise IndexError(f"a token id out of range 0..{self.outputs - 1}")
        return out.reshape(*ids.shape, self.inputs)

    def times(self, x: torch.Tensor) -> torch.Tensor | None:
        """x (rows, inputs) fp32 contiguous, rows <= FEW_ROWS -> (rows, outputs) = x @ W^T from the blocks (None
        where the kernel refuses)."""
        rows = x.shape[0]
        y = torch.empty(rows, self.outputs)
        status = native.kernels().gguf_matmul(native.pointer(x, torch.float32, (rows, self.inputs)), rows,
                                              self.inputs, self.type_id, native.pointer(self.blocks, torch.uint8),
                                              self.blocks.shape[1], self.outputs, native.pointer(y, torch.float32),
                                              threads_now())
        return y if status == 0 else None


def _tile_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a product with many rows runs in: CPU autocast's where it is on, else the activations'."""
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return x.dtype


class GGUFLinear(torch.nn.Module):
    """An nn.Linear whose weight is a GGUFMatrix: few fp32 rows by the blocks, more by a dequantized tile. The
    blocks are a buffer (a view of the file: state_dict and the weights' digest see them, nothing is copied)."""

    def __init__(self, matrix: GGUFMatrix, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = matrix.inputs, matrix.outputs
        self.matrix = matrix
        self.register_buffer("blocks", matrix.blocks)
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.kept_tiles: dict[torch.dtype, torch.Tensor] | None = None  # within tiles_kept: each tile made once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= FEW_ROWS and x.dtype == torch.float32 and x.device.type == "cpu" and self.matrix.dense() is None:
            y = self.matrix.times(x.reshape(rows, self.in_features).contiguous())
            if y is not None:
                if self.bias is not None:
                    y += self.bias
                return y.reshape(*x.shape[:-1], self.out_features)
        dtype = _tile_dtype(x)
        tiles = self.kept_tiles
        tile = tiles.get(dtype) if tiles is not None else None
        if tile is None:
            tile = self.matrix.dequantized(dtype)  # (outputs, inputs)
            if tiles is not None:
                tiles[dtype] = tile
        return F.linear(x.to(dtype), tile, None if self.bias is None else self.bias.to(dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.matrix.type_name} blocks"


@contextmanager
def tiles_kept(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, each GGUFLinear under `module` dequantizes its matrix once per dtype and keeps that tile
    (an MLP run over a prompt in slices: snapkv.modeling.chunking); released after it."""
    linears = [linear for linear in module.modules() if isinstance(linear, GGUFLinear)]
    for linear in linears:
        linear.kept_tiles = {}
    try:
        yield
    finally:
        for linear in linears:
            linear.kept_tiles = None


class GGUFEmbedding(torch.nn.Module):
    """An nn.Embedding whose table is a GGUFMatrix (vocab, hidden): the rows asked for, dequantized to fp32.
    `weight` is an empty (0, hidden) fp32 tensor: its dtype and device say what the embeddings give, and it holds
    no values (code that reads the table reads `matrix`)."""

    def __init__(self, matrix: GGUFMatrix) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = matrix.outputs, matrix.inputs
        self.matrix = matrix
        self.register_buffer("blocks", matrix.blocks)
        self.register_buffer("weight", torch.empty(0, matrix.inputs), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix.lookup(ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.matrix.type_name} blocks"


SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,)}  # where each type keeps its fp16 scales (and minimums) in a block


def random_matrix(type_name: str, outputs: int, inputs: int, generator: torch.Generator) -> GGUFMatrix:
    """A matrix of random blocks of `type_name` in memory (speed and memory measures: `bench --random-weights
    --weight-blocks`): random codes and 6-bit scales, the fp16 scales small positive values, so that every product
    stays finite. Raises ValueError for a type without blocks or inputs that are not whole blocks."""
    from snapkv.modeling.gguf_file import TENSOR_TYPES

    found = [(type_id, elements, size) for type_id, (name, elements, size) in TENSOR_TYPES.items()
             if name == type_name]
    if type_name not in SCALE_FIELDS or not found or inputs % found[0][1]:
        raise ValueError(f"random {type_name} blocks of {inputs} inputs: the types are {', '.join(SCALE_FIELDS)}, "
                         "and the inputs must be whole blocks")
    type_id, elements, size = found[0]
    count = inputs // elements
    raw = torch.randint(0, 256, (outputs, count, size), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(outputs, count, generator=generator) * 0.002 + 0.0005).half().view(torch.uint8)
    for offset in SCALE_FIELDS[type_name]:
        raw[:, :, offset:offset + 2] = scale.view(outputs, count, 2)
    return GGUFMatrix(type_id, type_name, raw.view(outputs, count * size), outputs, inputs)
