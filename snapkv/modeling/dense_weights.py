"""Plain bf16 or fp32 weights, the way the native decode reads them: q/k/v and gate/up rows fused into one matrix each,
a product for a few fp32 rows (snapkv/native/kernels/dense_rows.c), and fp32 weights that are exactly bf16 values held
in bf16 (Bf16Linear).

A user's checkpoint (Llama, Qwen, Mistral in bf16) is not 4/8-bit blocks (snapkv.modeling.block_weights), so without
this the native engine turned it down and every token went through PyTorch's steps. `fuse_dense` puts each layer's
q/k/v (and gate/up) weights one after another in one tensor and points every nn.Linear at its rows (views: no second
copy, PyTorch's forward unchanged), so that decode_step.c reads them in one product, as it reads fused blocks. The
products sum in fp32 whatever the weights' dtype: a bf16 weight is read as its exact fp32 value, half the bytes.

A bf16 checkpoint loaded in fp32 (`--dtype auto` on CPU: fp32 weights, the prefill's products in bf16 by autocast)
holds every weight twice as wide as its values need. `narrow_exact_bf16` keeps those matrices in bf16 as Bf16Linear:
under autocast the products are the very ones the fp32 weights gave (autocast rounds them to bf16 anyway); outside it
fp32 rows are multiplied in fp32 over the same values. Half the memory, and half the bytes each decoded token reads.
"""

import sys

import torch
import torch.nn.functional as F

from snapkv import native
from snapkv.modeling.block_weights import FEW_ROWS, FUSIBLE
from snapkv.native.threads import threads_now

FUSED_DENSE = "snapkv_fused_dense"  # on a module: {(child names): their weights' rows, one after another}
DENSE_DTYPES = {torch.bfloat16: 16, torch.float32: 32}  # dtype: the bits decode_step.c's matrix is told


class Bf16Linear(torch.nn.Module):
    """An nn.Linear of an fp32 model whose weights are exactly bf16 values, held in bf16 (weight: (out, in) bf16).

    forward: under CPU autocast to bf16, or for bf16 input, F.linear over the bf16 weight (the products autocast made of
    the fp32 weight, which it rounded to these very values); fp32 rows otherwise in fp32 over the same values, up to
    FEW_ROWS (a decoded token, a question) by dense_rows.c, more (or in a graph torch.compile traces) by F.linear over
    the weight widened for the call."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu") or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        y = None
        if rows <= FEW_ROWS and native.unavailable_reason() is None and not torch.compiler.is_compiling():
            y = dense_matmul(x.reshape(rows, self.in_features).contiguous(), self.weight)
        if y is None:
            return F.linear(x, self.weight.float(), self.bias)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 weights (exact)"


def _exactly_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of a contiguous fp32 weight is a bf16 value (a bf16 checkpoint loaded in fp32): the low 16
    bits of every value zero, read in place (one pass, no copy); the first row tried first, so that a float
    checkpoint's matrix is turned down after one row."""
    rows = weight.detach()
    if sys.byteorder != "little" or not rows.is_contiguous():
        return all(torch.equal(part.to(torch.bfloat16).float(), part) for part in (rows[:1], rows))
    low_halves = rows.view(torch.int16)[..., 0::2]  # (out, in): each value's low 16 bits
    return all(int(torch.count_nonzero(part)) == 0 for part in (low_halves[:1], low_halves))


@torch.no_grad()
def narrow_exact_bf16(model: torch.nn.Module) -> int:
    """Swap every nn.Linear of an fp32 model on CPU whose weight is exactly bf16 values for a Bf16Linear (a weight tied
    to the input embeddings stays as it is: the embeddings read it in fp32). Returns how many were swapped."""
    tied = model.get_input_embeddings().weight
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is torch.nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"
                    and child.weight is not tied and _exactly_bf16(child.weight)):
                setattr(parent, name, Bf16Linear(child))
                swapped += 1
    return swapped


def _plain(linear, bias_allowed: bool = False) -> bool:
    return (type(linear) in (torch.nn.Linear, Bf16Linear) and (bias_allowed or linear.bias is None)
            and linear.weight.dtype in DENSE_DTYPES and linear.weight.device.type == "cpu"
            and linear.weight.is_contiguous())


@torch.no_grad()
def fuse_dense(model: torch.nn.Module) -> int:
    """For every module whose q/k/v (or gate/up) projections are plain nn.Linear of one dtype (bf16 or fp32) and one
    input size, on CPU: their weights in one tensor (out_q + out_k + out_v, in), kept as FUSED_DENSE on the module, each
    Linear's weight a view of its rows (biases stay with their Linears: the C step adds them apart). Returns how many
    groups were fused (0 where nothing fits)."""
    fused_groups = 0
    for parent in model.modules():
        for names in FUSIBLE:
            linears = [getattr(parent, name, None) for name in names]
            if (not all(_plain(linear, bias_allowed=True) for linear in linears)
                    or names in parent.__dict__.get(FUSED_DENSE, {})):
                continue
            if len({(linear.weight.dtype, linear.in_features) for linear in linears}) != 1:
                continue
            fused = torch.cat([linear.weight.detach() for linear in linears])  # (sum of outputs, in)
            start = 0
            for linear in linears:
                linear.weight = torch.nn.Parameter(fused[start:start + linear.out_features], requires_grad=False)
                start += linear.out_features
            parent.__dict__.setdefault(FUSED_DENSE, {})[names] = fused
            fused_groups += 1
    return fused_groups


def fused_dense(parent: torch.nn.Module, names: tuple[str, ...]) -> torch.Tensor | None:
    """The weights of `parent`'s projections `names` fused by fuse_dense, (sum of outputs, in), or None."""
    return parent.__dict__.get(FUSED_DENSE, {}).get(names)


def plain_weight(linear: torch.nn.Module) -> torch.Tensor | None:
    """A bias-free nn.Linear's weight (out, in) where decode_step.c can read it as it is (bf16 or fp32, contiguous,
    on CPU), else None."""
    return linear.weight if _plain(linear) else None


def dense_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x (rows, in) fp32 contiguous -> (rows, out) = x @ W^T in fp32 for W (out, in) bf16 or fp32, by
    kernels/dense_rows.c (None where it refuses the shape: `in` not a multiple of 8)."""
    rows, inputs = x.shape
    y = torch.empty(rows, weight.shape[0])
    status = native.kernels().matmul_dense(
        native.pointer(x, torch.float32), rows, inputs, native.pointer(weight, weight.dtype, (None, inputs)),
        int(weight.dtype == torch.bfloat16), weight.shape[0], native.pointer(y, torch.float32), threads_now())
    return y if status == 0 else None
