"""CompressedCache: a prompt's KV cache after SnapKV, independent of transformers' Cache classes."""

from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .config import Tier


@dataclass
class CompressedCache:
    """Per-layer keys and values (RoPE applied), which prompt positions they hold, and the prompt length.

    keys[i], values[i]: (kv_heads, kept_i, head_dim)
    positions[i]:       (kv_heads, kept_i) int64, ascending original positions of the kept entries
    original_length:    tokens in the prompt; whatever follows it is placed from this position on
    token_ids:          (original_length,) int64, the prompt itself
    tier:               what the cache holds and how it was made (the cut at prefill, truncation);
                        a saved file's metadata is written from it
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    original_length: int
    token_ids: torch.Tensor
    tier: Tier = field(default_factory=Tier)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def kept_tokens(self) -> int:
        """Positions held per KV head in the largest layer."""
        return max(k.shape[1] for k in self.keys)

    @property
    def compressed(self) -> bool:
        """True if SnapKV dropped positions (sliding-window layers hold a tail anyway and do not count)."""
        return self.kept_tokens < self.original_length

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def full_kv_bytes(self) -> int:
        """What the uncompressed cache of the same prompt takes."""
        per_position = sum(
            (k.shape[0] * k.shape[2]) * k.element_size() * 2 for k in self.keys
        )
        return per_position * self.original_length

    def to_dynamic_cache(self, model_config) -> DynamicCache:
        """A fresh transformers cache over these tensors, ready for a forward pass.

        Full-attention layers start from these very tensors, without a copy: DynamicLayer only ever
        replaces its tensors (appending concatenates into new ones, SnapKV gathers into new ones),
        so a forward on the returned cache never changes this object. Sliding-window layers go
        through the public update(), which copies.
        """
        cache = DynamicCache(config=model_config)
        for index, (keys, values) in enumerate(zip(self.keys, self.values)):
            # (1, kv_heads, kept, head_dim)
            keys, values = keys.unsqueeze(0), values.unsqueeze(0)
            layer = cache.layers[index]
            if type(layer) is DynamicLayer:
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            else:
                cache.update(keys, values, index)
        return cache

    @classmethod
    def from_dynamic_cache(
        cls,
        cache: DynamicCache,
        positions: list[torch.Tensor],
        original_length: int,
        token_ids: torch.Tensor,
        tier: Tier,
    ) -> "CompressedCache":
        keys = [layer.keys[0] for layer in cache.layers]
        values = [layer.values[0] for layer in cache.layers]
        return cls(keys, values, positions, original_length, token_ids, tier)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "CompressedCache":
        return replace(
            self,
            keys=[k.to(device=device, dtype=dtype) for k in self.keys],
            values=[v.to(device=device, dtype=dtype) for v in self.values],
            positions=[p.to(device) for p in self.positions],
        )
