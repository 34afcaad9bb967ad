"""Keys or values transform-coded, simulated in memory: a measure of what entropy coding could store.

KVTC (arXiv 2511.01815) and CacheGen (arXiv 2310.07240) shrink a KV cache for storage by decorrelating it and
entropy-coding what is left. Here each head's vectors are:

  1. centred on their mean and turned into a basis (`TRANSFORMS`): the head's own principal components (PCA over its
     held positions: the components the file would store with it), a Hadamard rotation, or the channels as they are;
  2. rounded with one uniform step for the whole head (every component's error at most half a step: the sink's large
     values and a small channel alike), the step the largest whose codes cost at most `rate` bits a value;
  3. turned back.

The cost of a code is its component's order-0 entropy over the head's positions: what an ideal coder with a table
per component would spend (a real one, such as zstd's FSE, spends a little more and stores its tables). Nothing here
is written to a file: snapkv.measure.simulated puts the values restored back into the cache, and `snapkv eval
fidelity` judges the answers.
"""

import math

import torch

from snapkv.storage.quantize import hadamard_rotated

TRANSFORMS = ("pca", "hadamard", "channels")
MAX_RATE = 16  # bits a value: the 16-bit tier, stored as it is
STEP_SEARCHES = 24  # bisections of log2(step) over rate + 10 doublings: the step found within a millionth of one


def principal_basis(centred: torch.Tensor) -> torch.Tensor:
    """centred (held, head_dim) float32 -> (head_dim, head_dim): the principal components as columns, largest first."""
    covariance = (centred.T.double() @ centred.double()) / max(1, centred.shape[0])
    _, vectors = torch.linalg.eigh(covariance)  # ascending eigenvalues
    return vectors.flip(-1).float()


def entropy_per_value(codes: torch.Tensor) -> float:
    """codes (held, components) int64 -> the mean over components of each one's order-0 entropy, bits."""
    held, components = codes.shape
    shifted = codes - codes.min(dim=0).values
    width = int(shifted.max()) + 1
    flat = (shifted + torch.arange(components) * width).flatten()
    counts = torch.bincount(flat, minlength=components * width).view(components, width).double()
    share = counts / held
    logs = torch.where(share > 0, share.log2(), torch.zeros_like(share))
    return float(-(share * logs).sum() / components)


def _coded_step(components: torch.Tensor, rate: float) -> float:
    """The largest uniform step whose codes of `components` (held, head_dim) cost at most `rate` bits a value.

    The search starts at the step that spans the largest component in 2^(rate + 8) levels (a finer one would cost
    more than `rate` for any spread-out component, and its counts would not fit in memory); where even that step
    costs less, it is the one taken."""
    spread = float(components.abs().max())
    if spread == 0:
        return 1.0
    low, high = math.log(spread / 2 ** (rate + 8)), math.log(spread * 4)  # entropy above `rate` at low, 0 at high
    for _ in range(STEP_SEARCHES):
        middle = (low + high) / 2
        if entropy_per_value(torch.round(components / math.exp(middle)).long()) > rate:
            low = middle
        else:
            high = middle
    return math.exp(high)


def transform_coded_head(x: torch.Tensor, rate: float, transform: str) -> torch.Tensor:
    """x (held, head_dim) float32 -> the same as stored at `rate` bits a value by `transform` and restored
    (a rate of 16 or more: as it is, as a 16-bit tier stores it)."""
    if transform not in TRANSFORMS:
        raise ValueError(f"a transform is one of {', '.join(TRANSFORMS)}; not {transform!r}")
    if rate >= MAX_RATE:
        return x
    mean = x.mean(dim=0)
    centred = x - mean
    if transform == "pca":
        basis = principal_basis(centred)
        components = centred @ basis
    elif transform == "hadamard":
        components = hadamard_rotated(centred)
    else:
        components = centred
    step = _coded_step(components, rate)
    restored = torch.round(components / step) * step
    if transform == "pca":
        restored = restored @ basis.T
    elif transform == "hadamard":
        restored = hadamard_rotated(restored)  # the Hadamard block is its own inverse
    return restored + mean


def transform_coded(x: torch.Tensor, rate: float, transform: str) -> torch.Tensor:
    """x (kv_heads, held, head_dim) -> each head transform-coded at `rate` bits a value, float32."""
    return torch.stack([transform_coded_head(head.float(), rate, transform) for head in x])


def side_bits_per_value(transform: str, held: int, head_dim: int) -> float:
    """What a head stores beside its codes, per value: its mean and step, and its basis for PCA, in fp16 (the
    simulation uses them in fp32: fp16's rounding of an orthonormal basis adds a squared error of about 1e-7 of the
    values', far below the 8-bit codes')."""
    side = (head_dim + 2) * 16 + (head_dim * head_dim * 16 if transform == "pca" else 0)
    return side / (held * head_dim)
