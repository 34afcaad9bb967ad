"""How much memory a prefill needs, checked against what is free before the work starts.

Prefill with SnapKV holds, at its peak: the compressed caches of the layers already run, the full cache of
the one layer running, and that layer's activations (hidden states, attention and MLP intermediates).
The model's weights are already loaded when the check runs, so they are not counted again.
"""

import threading
import time
from dataclasses import dataclass

import torch

from snapkv.base.errors import OutOfMemoryError
from snapkv.compression.config import Cut
from snapkv.modeling.chunking import DEFAULT_CHUNK_TOKENS

# Allocator slack and temporaries the formula does not name (fp32 upcasts in norms and softmax, RoPE
# tables, attention workspaces). CPU: `snapkv bench --length 7k` on the embedded model (bf16) measured a
# prefill peak RSS growth of 1.75x (full cache) and 2.0x (query-aware tier) the named terms. CUDA: the
# caching allocator wastes less; 1.25 is an assumption until a GPU run measures it (bench JSON has both).
SLACK = {"cpu": 2.0, "cuda": 1.25}
# Refuse when the estimate exceeds this share of free memory.
USABLE_SHARE = 0.9


@dataclass(frozen=True)
class PrefillEstimate:
    tokens: int
    kv_bytes: int                # all layers' caches at the peak: kept tiers + one full layer
    full_layer_kv_bytes: int     # the one layer whose whole cache exists before its cut
    activation_bytes: int        # hidden states, attention and MLP intermediates of one layer

    slack: float = SLACK["cpu"]

    @property
    def total_bytes(self) -> int:
        return int(self.slack * (self.kv_bytes + self.activation_bytes))


def _shape(config) -> dict:
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "intermediate": getattr(config, "intermediate_size", 4 * config.hidden_size),
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
    }


def estimate_prefill(config, tokens: int, dtype: torch.dtype, tier: Cut | None,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS, device_type: str = "cpu") -> PrefillEstimate:
    """Peak memory of prefilling `tokens` tokens, beyond the weights.

    tier: the compression applied during prefill (None: every layer keeps its whole cache).
    chunk_tokens: the MLP slice size prefill uses (snapkv.modeling.chunking).
    """
    shape = _shape(config)
    item = torch.empty((), dtype=dtype).element_size()
    per_token_layer = 2 * shape["kv_heads"] * shape["head_dim"] * item  # K and V of one token in one layer
    # a prefill in chunks runs `step` tokens at a time over at most budget + step held positions
    step = tokens if tier is None or tier.chunk is None else min(tokens, tier.chunk)
    held = tokens if step == tokens else min(tokens, tier.budget + step)
    full_layer = held * per_token_layer
    kept = held if tier is None else min(held, tier.budget)
    kv = (shape["layers"] - 1) * kept * per_token_layer + full_layer
    window = 0 if tier is None else min(tier.window, step)
    activations = (
        step * item * (4 * shape["hidden"]                 # residual, normed input, attention output, sum
                       + 2 * shape["heads"] * shape["head_dim"])  # queries and the attention result
        + min(step, chunk_tokens) * item * 3 * shape["intermediate"]  # gate, up, product: one MLP slice
        + 4 * window * held * shape["heads"] * 2           # fp32 window scores and their pooled copy
    )
    return PrefillEstimate(tokens, kv, full_layer, activations, SLACK.get(device_type, SLACK["cpu"]))


def free_bytes(device: torch.device) -> int:
    """Memory free for new allocations on `device` (CUDA: the driver's free count; CPU: available RAM)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    import psutil

    return psutil.virtual_memory().available


def check_prefill_fits(model, tokens: int, device: torch.device, dtype: torch.dtype,
                       tier: Cut | None) -> PrefillEstimate:
    """Refuse, before any work, a prefill that cannot fit in free memory (OutOfMemoryError, with the numbers)."""
    estimate = estimate_prefill(model.config, tokens, dtype, tier, device_type=device.type)
    free = free_bytes(device)
    if estimate.total_bytes > USABLE_SHARE * free:
        gib = 2**30
        raise OutOfMemoryError(
            f"prefilling {tokens} tokens needs about {estimate.total_bytes / gib:.2f} GiB beyond the model's "
            f"weights (KV cache {estimate.kv_bytes / gib:.2f} GiB, of which one layer's full cache "
            f"{estimate.full_layer_kv_bytes / gib:.2f} GiB; activations {estimate.activation_bytes / gib:.2f} GiB; "
            f"x{estimate.slack} for allocator slack), and {free / gib:.2f} GiB is free on {device}. Use a shorter document "
            "(--truncate), compress during prefill (--no-query-aware or a smaller budget), or another device."
        )
    return estimate


def is_out_of_memory(error: BaseException) -> bool:
    """True for the ways torch and Python report a failed allocation."""
    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def release_device_memory(device: torch.device) -> None:
    """After a failed allocation: give cached CUDA blocks back so the process can go on."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def release_freed_memory() -> None:
    """Hand memory freed by Python and torch back to the OS, so RSS measures what is really in use.

    Without this, glibc keeps freed blocks mapped: a later measurement in the same process reuses them
    and its RSS growth reads too small.
    """
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
            pass


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count()))


_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


_lifetime = {"peak": 0}  # the kernel's peak RSS as it stood before each reset


def _kernel_peak_reset() -> bool:
    """Reset the kernel's record of this process's peak RSS (Linux: VmHWM); False where there is none."""
    try:
        _lifetime["peak"] = max(_lifetime["peak"], _kernel_peak())
        with open(_CLEAR_REFS, "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _kernel_peak() -> int:
    """The kernel's peak RSS of this process since the last reset, in bytes (Linux)."""
    with open(_STATUS) as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


class PeakMemory:
    """Peak memory of a block (one phase: prefill, an answer).

    CUDA: torch.cuda.max_memory_allocated during the block, summed over the GPUs (a model spread with
    device_map uses several), weights included. CPU: the most the process's RSS rose above its start, so
    the weights already loaded are not counted: on Linux the kernel's own peak (VmHWM, reset at the start of
    the block, exact); elsewhere RSS sampled every 2 ms by a thread (which can miss a short spike).
    """

    def __init__(self, device: torch.device, release: bool = False) -> None:
        """release: on CPU, first hand freed memory back to the OS (gc + malloc_trim, about 0.15 s) so that
        a block after earlier work in the same process is not understated; benchmarks want it, answers not."""
        self.device = device
        self.release = release
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            for index in _cuda_devices():
                torch.cuda.synchronize(index)
                torch.cuda.reset_peak_memory_stats(index)
            return self
        import psutil

        if self.release:
            release_freed_memory()
        process = self._process = psutil.Process()
        self._kernel = _kernel_peak_reset()
        self._start = self._high = process.memory_info().rss
        self._thread = None
        if not self._kernel:
            self._stop = threading.Event()

            def sample():
                while not self._stop.is_set():
                    self._high = max(self._high, process.memory_info().rss)
                    time.sleep(0.002)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            for index in _cuda_devices():
                torch.cuda.synchronize(index)
            self.peak = sum(torch.cuda.max_memory_allocated(index) for index in _cuda_devices())
            return
        if self._kernel:
            self._high = _kernel_peak()
        else:
            self._stop.set()
            self._thread.join()
        self._high = max(self._high, self._process.memory_info().rss)  # the end state, however short the block
        self.peak = self._high - self._start


def process_peak_bytes(device: torch.device) -> int:
    """The process's peak memory so far: CUDA max allocated summed over the GPUs, else peak RSS (psutil's,
    which is right on every OS; ru_maxrss is kilobytes on Linux and bytes on macOS)."""
    if device.type == "cuda":
        return sum(torch.cuda.max_memory_allocated(index) for index in _cuda_devices())
    import psutil

    info = psutil.Process().memory_info()
    return max(getattr(info, "peak_wset", 0), info.rss, _lifetime_peak())


def _lifetime_peak() -> int:
    """Linux: the peak RSS the kernel recorded over the process's life (PeakMemory blocks reset its record)."""
    try:
        return max(_lifetime["peak"], _kernel_peak())
    except OSError:
        return 0


def wait_for_device(device: torch.device) -> None:
    """Wait until the device has done the work queued on it (CUDA runs asynchronously; a CPU has nothing
    to wait for)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
