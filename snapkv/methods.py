"""Compression methods: which of a layer's cached positions are worth keeping.

A method is a small frozen dataclass with a name and a pure scoring function over the observation
window's queries and the layer's keys (higher is kept). The layer hook, the file metadata, the store
key, `info`, bench and eval take a method by name (`method_from_dict`) and never branch on which one
it is beyond that.
"""

from dataclasses import asdict, dataclass
from typing import ClassVar, Literal, Protocol

import torch

from .errors import ConfigError
from .scoring import mean_over_query_groups, pool_scores, window_attention_scores

Pooling = Literal["max", "avg"]


class Method(Protocol):
    name: ClassVar[str]

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
        """window_queries (batch, q_heads, w, head_dim), keys (batch, kv_heads, n, head_dim), both after
        RoPE, the window's own keys last -> (batch, kv_heads, n - w) scores of the keys before the window."""
        ...


@dataclass(frozen=True)
class SnapKV:
    """arXiv 2404.14469: the attention the window pays each earlier key, pooled, averaged per GQA group.

    kernel:  width of the 1-D pooling over the scores (odd), so that clusters (a number's digits) survive.
    pooling: "max" or "avg".
    """

    name: ClassVar[str] = "snapkv"
    kernel: int = 15
    pooling: Pooling = "max"

    def __post_init__(self) -> None:
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"kernel must be an odd number >= 1, got {self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise ConfigError(f"pooling must be 'max' or 'avg', got {self.pooling!r}")

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
        scores = window_attention_scores(window_queries, keys, scaling)  # (batch, q_heads, n - w)
        scores = pool_scores(scores, self.kernel, self.pooling)
        return mean_over_query_groups(scores, keys.shape[1])  # (batch, kv_heads, n - w)


METHODS: dict[str, type] = {SnapKV.name: SnapKV}


def method_to_dict(method: Method) -> dict:
    """{"method": name, **its settings}: what file metadata, store keys and reports record."""
    return {"method": method.name, **asdict(method)}


def method_from_dict(data: dict) -> Method:
    """The method a dict from method_to_dict names, with its settings; ConfigError for an unknown one."""
    settings = dict(data)
    name = settings.pop("method", None)
    if name not in METHODS:
        raise ConfigError(f"unknown compression method {name!r}; known: {', '.join(sorted(METHODS))}")
    try:
        return METHODS[name](**settings)
    except TypeError as error:
        raise ConfigError(f"settings of method {name!r} not understood: {error}") from error
