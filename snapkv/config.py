"""SnapKV settings, validated once at construction."""

from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError

Pooling = Literal["max", "avg"]


@dataclass(frozen=True)
class SnapKVConfig:
    """How a prompt's KV cache is compressed.

    budget:       positions kept per KV head per layer, the observation window included.
    window:       the last `window` prompt positions whose attention decides what is kept.
    kernel:       width of the 1-D pooling over the scores (odd), so that clusters survive.
    pooling:      "max" or "avg" pooling.
    query_aware:  if True, the cache is kept at `store_budget` (None: whole) and each question is run
                  through the model as the observation window, compressing to `budget` per question.
    store_budget: the stored tier's size in query-aware mode; None keeps the whole prompt.
    """

    budget: int = 1024
    window: int = 32
    kernel: int = 15
    pooling: Pooling = "max"
    query_aware: bool = True
    store_budget: int | None = None

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"window must be at least 1, got {self.window}")
        if self.budget <= self.window:
            raise ConfigError(
                f"budget ({self.budget}) must be larger than the observation window ({self.window}): "
                "the budget counts the window's own positions"
            )
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"kernel must be an odd number >= 1, got {self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise ConfigError(f"pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.store_budget is not None and self.store_budget < self.budget:
            raise ConfigError(
                f"store_budget ({self.store_budget}) must be at least the budget ({self.budget})"
            )

    @property
    def prefix_keep(self) -> int:
        """Positions kept outside the observation window."""
        return self.budget - self.window

    @property
    def stored_tier(self) -> "SnapKVConfig | None":
        """The compression applied at prefill time: None means the whole cache is kept."""
        if not self.query_aware:
            return self
        if self.store_budget is None:
            return None
        return SnapKVConfig(
            budget=self.store_budget, window=self.window, kernel=self.kernel,
            pooling=self.pooling, query_aware=False,
        )
