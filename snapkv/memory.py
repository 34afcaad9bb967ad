"""How much memory a prefill needs, checked against what is free before the work starts.

Prefill with SnapKV holds, at its peak: the compressed caches of the layers already run, the full cache of
the one layer running, and that layer's activations (hidden states, attention and MLP intermediates).
The model's weights are already loaded when the check runs, so they are not counted again.
"""

from dataclasses import dataclass

import torch

from .config import SnapKVConfig
from .errors import OutOfMemoryError

# Allocator slack and temporaries the formula does not name (fp32 upcasts in norms and softmax, RoPE
# tables, attention workspaces): `snapkv bench --length 7k` on the embedded model (bf16, CPU) measured a
# prefill peak RSS growth of 1.75x (full cache) and 2.0x (query-aware tier) the named terms.
SLACK = 2.0
# Refuse when the estimate exceeds this share of free memory.
USABLE_SHARE = 0.9


@dataclass(frozen=True)
class PrefillEstimate:
    tokens: int
    kv_bytes: int                # all layers' caches at the peak: kept tiers + one full layer
    full_layer_kv_bytes: int     # the one layer whose whole cache exists before its cut
    activation_bytes: int        # hidden states, attention and MLP intermediates of one layer

    @property
    def total_bytes(self) -> int:
        return int(SLACK * (self.kv_bytes + self.activation_bytes))


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


def estimate_prefill(config, tokens: int, dtype: torch.dtype, tier: SnapKVConfig | None) -> PrefillEstimate:
    """Peak memory of prefilling `tokens` tokens, beyond the weights.

    tier: the compression applied during prefill (None: every layer keeps its whole cache).
    """
    shape = _shape(config)
    item = torch.empty((), dtype=dtype).element_size()
    per_token_layer = 2 * shape["kv_heads"] * shape["head_dim"] * item  # K and V of one token in one layer
    full_layer = tokens * per_token_layer
    kept = tokens if tier is None else min(tokens, tier.budget)
    kv = (shape["layers"] - 1) * kept * per_token_layer + full_layer
    window = 0 if tier is None else min(tier.window, tokens)
    activations = tokens * item * (
        4 * shape["hidden"]                                  # residual, normed input, attention output, sum
        + 3 * shape["intermediate"]                          # gate, up and their product in the MLP
        + 2 * shape["heads"] * shape["head_dim"]             # queries and the attention result
    ) + 4 * window * tokens * shape["heads"] * 2               # fp32 window scores and their pooled copy
    return PrefillEstimate(tokens, kv, full_layer, activations)


def free_bytes(device: torch.device) -> int:
    """Memory free for new allocations on `device` (CUDA: the driver's free count; CPU: available RAM)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    import psutil

    return psutil.virtual_memory().available


def check_prefill_fits(model, tokens: int, device: torch.device, dtype: torch.dtype,
                       tier: SnapKVConfig | None) -> PrefillEstimate:
    """Refuse, before any work, a prefill that cannot fit in free memory (OutOfMemoryError, with the numbers)."""
    estimate = estimate_prefill(model.config, tokens, dtype, tier)
    free = free_bytes(device)
    if estimate.total_bytes > USABLE_SHARE * free:
        gib = 2**30
        raise OutOfMemoryError(
            f"prefilling {tokens} tokens needs about {estimate.total_bytes / gib:.2f} GiB beyond the model's "
            f"weights (KV cache {estimate.kv_bytes / gib:.2f} GiB, of which one layer's full cache "
            f"{estimate.full_layer_kv_bytes / gib:.2f} GiB; activations {estimate.activation_bytes / gib:.2f} GiB; "
            f"x{SLACK} for allocator slack), and {free / gib:.2f} GiB is free on {device}. Use a shorter document "
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
