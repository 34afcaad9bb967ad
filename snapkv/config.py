"""Settings, validated once at construction; the defaults live here and nowhere else.

    SnapKVConfig  what a user asks for (the command-line flags, the library's one settings object)
    Cut           one selection of positions: a method, a budget and an observation window
    Tier          what a cache holds: the cut made at prefill (or every position) and any truncation

A SnapKVConfig says once which cut is made at prefill (`stored_tier`) and which per question
(`per_question`); a cache carries its Tier, so a saved file describes itself whatever the session
that later loads it is set to.
"""

from dataclasses import dataclass, fields
from typing import Literal

from .errors import ConfigError
from .methods import Method, Pooling, SnapKV, method_from_dict, method_to_dict

Mode = Literal["full", "document-window", "query-aware"]
TruncateSide = Literal["start", "middle", "end"]


@dataclass(frozen=True)
class Cut:
    """Keep `budget` positions per KV head, the observation window's own `window` included, the rest
    chosen by `method` from the attention the window pays them."""

    budget: int
    window: int
    method: Method = SnapKV()

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"window must be at least 1, got {self.window}")
        if self.budget <= self.window:
            raise ConfigError(
                f"budget ({self.budget}) must be larger than the observation window ({self.window}): "
                "the budget counts the window's own positions"
            )

    @property
    def prefix_keep(self) -> int:
        """Positions kept outside the observation window."""
        return self.budget - self.window

    def to_dict(self) -> dict:
        return {"budget": self.budget, "window": self.window, **method_to_dict(self.method)}

    @classmethod
    def from_dict(cls, data: dict) -> "Cut":
        data = dict(data)
        try:
            budget, window = int(data.pop("budget")), int(data.pop("window"))
        except (KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"a cut needs a whole budget and window, got {data!r}") from error
        return cls(budget, window, method_from_dict(data))

    def describe(self) -> str:
        method = self.method
        extras = ", ".join(f"{f.name} {getattr(method, f.name)}" for f in fields(method))
        return f"{method.name} budget {self.budget} (window {self.window}{', ' + extras if extras else ''})"


@dataclass(frozen=True)
class Truncation:
    """A document cut to fit the model's context: which part was removed, and how many tokens."""

    side: TruncateSide
    tokens: int

    def to_dict(self) -> dict:
        return {"side": self.side, "tokens": self.tokens}


@dataclass(frozen=True)
class Tier:
    """What a cache holds: the cut made at prefill (None: every prompt position) and any truncation."""

    cut: Cut | None = None
    truncation: Truncation | None = None

    def to_dict(self) -> dict:
        return {"cut": self.cut.to_dict() if self.cut else None,
                "truncation": self.truncation.to_dict() if self.truncation else None}

    @classmethod
    def from_dict(cls, data: dict) -> "Tier":
        truncation = data.get("truncation")
        return cls(cut=Cut.from_dict(data["cut"]) if data.get("cut") else None,
                   truncation=Truncation(**truncation) if truncation else None)

    def describe(self) -> str:
        held = "whole prompt" if self.cut is None else self.cut.describe()
        if self.truncation:
            held += f"; document cut by {self.truncation.tokens} tokens at the {self.truncation.side}"
        return held


def mode_of(stored: Cut | None, per_question: Cut | None) -> Mode:
    """The name of a way of answering: cut per question, cut once at prefill, or nothing dropped."""
    if per_question is not None:
        return "query-aware"
    return "document-window" if stored is not None else "full"


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
    method:       the scoring method's name (see snapkv.methods).
    """

    budget: int = 1024
    window: int = 32
    kernel: int = SnapKV.kernel
    pooling: Pooling = SnapKV.pooling
    query_aware: bool = True
    store_budget: int | None = None
    method: str = SnapKV.name

    def __post_init__(self) -> None:
        self.cut  # validates budget, window and the method's own settings
        if self.store_budget is not None and self.store_budget < self.budget:
            raise ConfigError(
                f"store_budget ({self.store_budget}) must be at least the budget ({self.budget})"
            )

    @property
    def scorer(self) -> Method:
        return method_from_dict({"method": self.method, "kernel": self.kernel, "pooling": self.pooling})

    @property
    def cut(self) -> Cut:
        """The cut at `budget` these settings describe."""
        return Cut(self.budget, self.window, self.scorer)

    @property
    def stored_tier(self) -> Cut | None:
        """The cut made at prefill: None keeps every position."""
        if not self.query_aware:
            return self.cut
        if self.store_budget is None:
            return None
        return Cut(self.store_budget, self.window, self.scorer)

    @property
    def per_question(self) -> Cut | None:
        """The cut made for each question, with the question as the window (query-aware mode only)."""
        return self.cut if self.query_aware else None

    @property
    def mode(self) -> Mode:
        return mode_of(self.stored_tier, self.per_question)


DEFAULTS = SnapKVConfig()


def stored_tier_of(settings: SnapKVConfig | None) -> Cut | None:
    """The prefill cut of some settings; None (the full cache) keeps everything."""
    return settings.stored_tier if settings is not None else None


def per_question_of(settings: SnapKVConfig | None) -> Cut | None:
    return settings.per_question if settings is not None else None
