"""Linear layers whose weights are 4-bit or 8-bit blocks, decoded from those blocks on CPU in fp32.

A GGUF file (the embedded model's) stores its matrices in blocks of 32 weights along the input: Q4_1
(w = scale * q + minimum, q in 0..15) and Q8_0 (w = scale * q, q in -127..127), scale and minimum in fp16.
Loaded for PyTorch they become fp32, 4 bytes per weight where the file had 0.625 and 1.06, and every decoded
token reads all of them. `exact_blocks` finds the blocks back from the fp32 values, and only when every weight
comes back exactly; `BlockLinear` then multiplies a few rows (a decoded token, up to KERNEL_ROWS) with
snapkv/native/kernels/blockwise_matmul.c over the blocks, and anything longer (the prompt) with PyTorch's fp32 matmul
over the fp32 weights, kept for that. Nothing is rounded: weights that are not exactly blocks (a bf16
checkpoint) stay as they are.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from snapkv import native
from snapkv.native.threads import threads_now

BLOCK = 32
KERNEL_ROWS = 1  # rows taken by the block kernel (it measured no faster at 2+, see docs/measurements.md)
FEW_ROWS = 64  # up to this many rows (a question) are multiplied with the fp32 weights by kernels/few_rows.c


@dataclass(frozen=True)
class Blocks:
    """A (out, in) matrix as blocks of 32 along `in`. codes: 4-bit (out, in / 2) uint8, element j of a block
    in the low nibble of its byte j and element j + 16 in the high nibble; 8-bit (out, in) int8.
    scale, minimum: (out, in / 32) fp32; minimum None for 8-bit (symmetric)."""

    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None

    def pointers(self) -> tuple[int, int, int | None]:
        """The addresses of codes, scale and minimum (None for 8-bit) to hand to a kernel, checked by
        snapkv.native.pointer against the layout above."""
        outputs, count = self.scale.shape
        codes = native.pointer(self.codes, torch.uint8 if self.bits == 4 else torch.int8, (outputs, None))
        minimum = None if self.minimum is None else native.pointer(self.minimum, torch.float32, (outputs, count))
        return codes, native.pointer(self.scale, torch.float32), minimum

    @property
    def nbytes(self) -> int:
        parts = (self.codes, self.scale) + ((self.minimum,) if self.minimum is not None else ())
        return sum(part.numel() * part.element_size() for part in parts)


def _fp16_exact(values: torch.Tensor) -> bool:
    return bool((values.half().float() == values).all())


def _four_bit(grouped: torch.Tensor) -> Blocks | None:
    """grouped (out, blocks, 32) -> Q4_1 blocks that give back every weight exactly, or None."""
    out, count, _ = grouped.shape
    smallest = grouped.amin(dim=-1, keepdim=True)
    scale = ((grouped.amax(dim=-1, keepdim=True) - smallest) / 15).half().float()
    codes = ((grouped - smallest) / scale.where(scale > 0, 1.0)).round().clamp(0, 15)
    if not (_fp16_exact(smallest) and torch.equal(codes * scale + smallest, grouped)):
        return None
    nibbles = codes.to(torch.uint8).reshape(out, count, 2, BLOCK // 2)  # halves: elements j, j + 16
    packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)  # (out, blocks, 16)
    return Blocks(4, packed.reshape(out, count * BLOCK // 2).contiguous(), scale.reshape(out, -1).contiguous(),
                  smallest.reshape(out, -1).contiguous())


def _eight_bit(grouped: torch.Tensor) -> Blocks | None:
    """grouped (out, blocks, 32) -> Q8_0 blocks that give back every weight exactly, or None."""
    out, count, _ = grouped.shape
    scale = (grouped.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    codes = (grouped / scale.where(scale > 0, 1.0)).round().clamp(-127, 127)
    if not torch.equal(codes * scale, grouped):
        return None
    return Blocks(8, codes.to(torch.int8).reshape(out, count * BLOCK).contiguous(), scale.reshape(out, -1).contiguous(),
                  None)


def exact_blocks(weight: torch.Tensor) -> Blocks | None:
    """The 4-bit or 8-bit blocks that give back every weight exactly in fp32, or None.

    weight: (out, in) fp32 on CPU, `in` a multiple of 32. 4-bit: a block's minimum is its smallest weight
    (q = 0) and its scale (largest - smallest) / 15 rounded to fp16, as Q4_1 quantizes; 8-bit: the scale is
    the largest magnitude / 127 in fp16, as Q8_0 does. Checked by rebuilding every weight as the GGUF loader
    computes it (scale * q + minimum in fp32). A form is tried on the whole matrix only where its first row
    fits, so a float checkpoint's matrix is turned down after one row."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % BLOCK:
        return None
    out, inputs = weight.shape
    grouped = weight.detach().reshape(out, inputs // BLOCK, BLOCK)  # (out, blocks, 32)
    for form in (_four_bit, _eight_bit):
        if form(grouped[:1]) is not None and (blocks := form(grouped)) is not None:
            return blocks
    return None


def few_rows_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (rows, in) fp32 contiguous -> (rows, out) = x @ W^T with W (out, in) fp32, by kernels/few_rows.c (F.linear
    where its shape or layout does not fit)."""
    rows, inputs = x.shape
    if inputs % 8 or weight.dtype != torch.float32 or not weight.is_contiguous():
        return F.linear(x, weight)
    y = torch.empty(rows, weight.shape[0])
    fp32 = torch.float32
    if native.kernels().linear_rows(native.pointer(x, fp32), rows, inputs, native.pointer(weight, fp32, (None, inputs)),
                                    weight.shape[0], native.pointer(y, fp32), threads_now()) != 0:
        return F.linear(x, weight)
    return y


def few_rows_blocks_matmul(x: torch.Tensor, blocks: Blocks, out_features: int) -> torch.Tensor | None:
    """x (rows, in) fp32 contiguous -> (rows, out) = x @ W^T with W given as exact blocks, by kernels/few_rows.c:
    the same bits as few_rows_matmul over the fp32 weights, reading a fifth of the bytes (None where the kernel
    refuses the shape)."""
    rows, inputs = x.shape
    y = torch.empty(rows, out_features)
    codes, scale, minimum = blocks.pointers()
    status = native.kernels().linear_rows_blocks(native.pointer(x, torch.float32), rows, inputs, blocks.bits, codes,
                                                 scale, minimum, out_features, native.pointer(y, torch.float32),
                                                 threads_now())
    return y if status == 0 else None


def rows_times_blocks(x: torch.Tensor, blocks: Blocks, out_features: int) -> torch.Tensor | None:
    """x (rows, in) fp32 contiguous, rows <= FEW_ROWS -> (rows, out) = x @ W^T from W's blocks: up to KERNEL_ROWS
    rows by the block kernel, more by kernels/few_rows.c (None where it refuses the shape)."""
    if x.shape[0] <= KERNEL_ROWS:
        return blockwise_matmul(x, blocks, out_features)
    return few_rows_blocks_matmul(x, blocks, out_features)


def blockwise_matmul(x: torch.Tensor, blocks: Blocks, out_features: int) -> torch.Tensor:
    """x (rows, in) fp32 contiguous, rows <= native.MAX_ROWS -> (rows, out) = x @ W^T, W given as blocks."""
    library = native.kernels()
    rows, inputs = x.shape
    y = torch.empty(rows, out_features)
    threads = threads_now()
    codes, scale, minimum = blocks.pointers()
    x_address, y_address = native.pointer(x, torch.float32), native.pointer(y, torch.float32)
    if blocks.bits == 4:
        status = library.matmul_4bit(x_address, rows, inputs, codes, scale, minimum, out_features, y_address, threads)
    else:
        status = library.matmul_8bit(x_address, rows, inputs, codes, scale, out_features, y_address, threads)
    if status != 0:
        raise ValueError(f"the blockwise kernel refused {rows} rows of {inputs}")
    return y


class BlockLinear(torch.nn.Module):
    """An nn.Linear that also holds its weight as exact Blocks: up to KERNEL_ROWS rows of fp32 on CPU are
    multiplied from the blocks, up to FEW_ROWS (a question) by snapkv/native/kernels/few_rows.c (1.5-2x PyTorch's matmul
    at 18 rows here) from the blocks too, decoded a tile at a time to the very fp32 values of `weight` (a fifth of
    the bytes read), everything else by F.linear over `weight` (the same Parameter as before,
    so a weight tied to the input embeddings stays tied). Made only where the kernels were available."""

    def __init__(self, linear: torch.nn.Linear, blocks: Blocks) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > FEW_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        y = rows_times_blocks(flat, self.blocks, self.out_features)
        y = y if y is not None else few_rows_matmul(flat, self.weight)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.blocks.bits}-bit blocks"


FUSED = "snapkv_fused_blocks"  # on a module: {(child names): Blocks over their rows, one after another}
FUSIBLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # read by one product in lean_decode


def _fuse(parent: torch.nn.Module) -> None:
    """Where a module's q/k/v (or gate/up) projections are all BlockLinear of the same bits and inputs, put their
    blocks in one tensor each (their rows one after another) kept as FUSED on the module, and point every BlockLinear
    at its rows (views: no second copy). One product over the whole then gives each projection's outputs, the same
    numbers, in one kernel call instead of several (each one's bias, Qwen2's, added after it as its own forward does)."""
    for names in FUSIBLE:
        linears = [getattr(parent, name, None) for name in names]
        if not all(isinstance(linear, BlockLinear) for linear in linears):
            continue
        parts = [linear.blocks for linear in linears]
        if len({(part.bits, part.codes.shape[1]) for part in parts}) != 1:
            continue
        fused = Blocks(parts[0].bits, torch.cat([part.codes for part in parts]),
                       torch.cat([part.scale for part in parts]),
                       None if parts[0].minimum is None else torch.cat([part.minimum for part in parts]))
        start = 0
        for linear in linears:
            rows = slice(start, start + linear.out_features)
            linear.blocks = Blocks(fused.bits, fused.codes[rows], fused.scale[rows],
                                   None if fused.minimum is None else fused.minimum[rows])
            start += linear.out_features
        parent.__dict__.setdefault(FUSED, {})[names] = fused


def fused_blocks(parent: torch.nn.Module, names: tuple[str, ...]) -> Blocks | None:
    """The blocks of `parent`'s projections `names` fused into one (see _fuse), or None."""
    return parent.__dict__.get(FUSED, {}).get(names)


def fused_outputs(parent: torch.nn.Module, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """The outputs of `parent`'s projections `names` for fp32 rows x (..., in) on CPU (a decoded token, a question:
    up to FEW_ROWS) from their fused blocks, in one kernel call, each (..., out): the same bits as each projection
    called on its own (every output's sum runs over the inputs in the same order). None where they are not fused
    or the rows do not fit (call them one by one)."""
    fused = fused_blocks(parent, names)
    rows = x.numel() // x.shape[-1]
    if (fused is None or rows > FEW_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
            or torch.is_grad_enabled()):
        return None
    linears = [getattr(parent, name) for name in names]
    sizes = [linear.out_features for linear in linears]
    y = rows_times_blocks(x.reshape(rows, -1).contiguous(), fused, sum(sizes))
    if y is None:
        return None
    parts = [part.reshape(*x.shape[:-1], -1) for part in y.split(sizes, dim=-1)]
    return [part + linear.bias if linear.bias is not None else part for part, linear in zip(parts, linears)]


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


SAVED_NAME = "snapkv-blocks.safetensors"  # beside a converted model's weights
SAVED_FORMAT = "snapkv-blocks-1"  # with the names of the layers examined


def _weights_stamp(folder: Path) -> str:
    """What the saved blocks were found from: the folder's weight files, by name, size and modification time."""
    files = sorted(path for path in folder.glob("*.safetensors") if path.name != SAVED_NAME)
    return json.dumps([[path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in files])


def _read_saved(folder: Path) -> tuple[set[str], dict[str, Blocks]] | None:
    """What was found beside these very weight files: (the linear layers examined, by name; the blocks of
    those that are blocks), or None (no file, other weight files, or unreadable)."""
    from safetensors import safe_open

    path = folder / SAVED_NAME
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as saved:
            metadata = saved.metadata() or {}
            if metadata.get("format") != SAVED_FORMAT or metadata.get("weights") != _weights_stamp(folder):
                return None
            tensors = {name: saved.get_tensor(name) for name in saved.keys()}
        examined, found = set(json.loads(metadata["examined"])), {}
        for name in json.loads(metadata["layers"]):
            codes = tensors[f"{name}.codes"]
            found[name] = Blocks(4 if codes.dtype == torch.uint8 else 8, codes, tensors[f"{name}.scale"],
                                 tensors.get(f"{name}.minimum"))
        return examined, found
    except Exception:  # unreadable or damaged: found again from the weights, and saved anew
        return None


def _save(folder: Path, examined: list[str], found: dict[str, Blocks]) -> None:
    """Save what was found beside the weights (atomic; any failure only means finding them again next time)."""
    from safetensors.torch import save_file

    from snapkv.base.atomic import write_atomically

    tensors = {}
    for name, blocks in found.items():
        tensors[f"{name}.codes"], tensors[f"{name}.scale"] = blocks.codes, blocks.scale
        if blocks.minimum is not None:
            tensors[f"{name}.minimum"] = blocks.minimum
    try:
        metadata = {"format": SAVED_FORMAT, "weights": _weights_stamp(folder), "examined": json.dumps(sorted(examined)),
                    "layers": json.dumps(sorted(found))}
        write_atomically(folder / SAVED_NAME, lambda temp: save_file(tensors, str(temp), metadata=metadata),
                         "the weights' blocks")
    except Exception:
        pass


def _saved_fits(blocks: Blocks, weight: torch.Tensor) -> bool:
    """Whether saved blocks can stand for `weight`: the dtypes and shapes the kernel reads (checked before it
    ever reads them) and the first row rebuilt exactly (a cheap guard against a mix-up, not a proof)."""
    out, inputs = weight.shape
    codes_form = (torch.uint8, (out, inputs // 2)) if blocks.bits == 4 else (torch.int8, (out, inputs))
    parts = [(blocks.codes, *codes_form), (blocks.scale, torch.float32, (out, inputs // BLOCK))]
    if (blocks.minimum is None) != (blocks.bits == 8):
        return False
    if blocks.minimum is not None:
        parts.append((blocks.minimum, torch.float32, (out, inputs // BLOCK)))
    if inputs % BLOCK or not all(part.dtype == dtype and tuple(part.shape) == shape and part.is_contiguous()
                                 for part, dtype, shape in parts):
        return False
    first = Blocks(blocks.bits, blocks.codes[:1], blocks.scale[:1],
                   None if blocks.minimum is None else blocks.minimum[:1])
    return torch.equal(unpacked(first), weight[:1].detach())


def unpacked(blocks: Blocks) -> torch.Tensor:
    """(out, in) fp32: the weights the blocks stand for, computed as the GGUF loader computes them."""
    out = blocks.scale.shape[0]
    if blocks.bits == 8:
        codes = blocks.codes.float().reshape(out, -1, BLOCK)
        return (codes * blocks.scale[..., None]).reshape(out, -1)
    low, high = (blocks.codes & 0x0F), (blocks.codes >> 4)
    codes = torch.stack([low.reshape(out, -1, BLOCK // 2), high.reshape(out, -1, BLOCK // 2)], dim=2).float()
    codes = codes.reshape(out, -1, BLOCK)
    return (codes * blocks.scale[..., None] + blocks.minimum[..., None]).reshape(out, -1)


def use_block_weights(model: torch.nn.Module, saved_in: Path | None = None) -> BlockReport:
    """Swap every nn.Linear of `model` whose fp32 weight is exactly blocks for a BlockLinear; the rest stay.
    Nothing is swapped when the kernels are unavailable (the report says why).

    saved_in: the model's own folder where snapkv may keep what it found (a converted GGUF's, in the snapkv
    home): read from SAVED_NAME there when it was found from these very weight files (about 0.1 s instead of
    about 1 s to find them), else found and saved there."""
    linears = [(f"{prefix}.{name}".lstrip("."), parent, name, child) for prefix, parent in model.named_modules()
               for name, child in parent.named_children() if type(child) is torch.nn.Linear]
    reason = native.unavailable_reason()
    if reason:
        return BlockReport(0, len(linears), 0, reason)
    saved = _read_saved(saved_in) if saved_in is not None else None
    examined, saved_blocks = saved if saved is not None else (set(), {})
    outdated = saved is None
    found: dict[str, Blocks] = {}
    for qualified, parent, name, linear in linears:
        if qualified in saved_blocks and _saved_fits(saved_blocks[qualified], linear.weight):
            blocks = saved_blocks[qualified]
        elif qualified in examined and qualified not in saved_blocks:
            blocks = None  # found not to be blocks in these weight files
        else:  # not saved, or saved blocks that do not fit this weight
            blocks = exact_blocks(linear.weight)
            outdated = True
        if blocks is not None:
            setattr(parent, name, BlockLinear(linear, blocks))
            found[qualified] = blocks
    if saved_in is not None and outdated:
        _save(saved_in, [qualified for qualified, *_ in linears], found)
    for module in model.modules():
        _fuse(module)
    block_bytes = sum(blocks.nbytes for blocks in found.values())
    reason = None if found else "no linear layer's weights are exact 4/8-bit blocks"
    return BlockReport(len(found), len(linears), block_bytes, reason)
