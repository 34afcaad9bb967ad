"""Plain bf16 or fp32 weights, the way the native decode reads them: q/k/v and gate/up rows fused into one matrix each,
and a product for a few fp32 rows (snapkv/native/kernels/dense_rows.c).

A user's checkpoint (Llama, Qwen, Mistral in bf16) is not 4/8-bit blocks (snapkv.modeling.block_weights), so without
this the native engine turned it down and every token went through PyTorch's steps. `fuse_dense` puts each layer's
q/k/v (and gate/up) weights one after another in one tensor and points every nn.Linear at its rows (views: no second
copy, PyTorch's forward unchanged), so that decode_step.c reads them in one product, as it reads fused blocks. The
products sum in fp32 whatever the weights' dtype: a bf16 weight is read as its exact fp32 value, half the bytes.
"""

import torch

from snapkv import native
from snapkv.modeling.block_weights import FUSIBLE
from snapkv.native.threads import threads_now

FUSED_DENSE = "snapkv_fused_dense"  # on a module: {(child names): their weights' rows, one after another}
DENSE_DTYPES = {torch.bfloat16: 16, torch.float32: 32}  # dtype: the bits decode_step.c's matrix is told


def _plain(linear) -> bool:
    return (type(linear) is torch.nn.Linear and linear.bias is None and linear.weight.dtype in DENSE_DTYPES
            and linear.weight.device.type == "cpu" and linear.weight.is_contiguous())


@torch.no_grad()
def fuse_dense(model: torch.nn.Module) -> int:
    """For every module whose q/k/v (or gate/up) projections are plain nn.Linear of one dtype (bf16 or fp32) and one
    input size, without bias, on CPU: their weights in one tensor (out_q + out_k + out_v, in), kept as FUSED_DENSE on the
    module, each Linear's weight a view of its rows. Returns how many groups were fused (0 where nothing fits)."""
    fused_groups = 0
    for parent in model.modules():
        for names in FUSIBLE:
            linears = [getattr(parent, name, None) for name in names]
            if not all(_plain(linear) for linear in linears) or names in parent.__dict__.get(FUSED_DENSE, {}):
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
