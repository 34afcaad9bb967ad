"""Which cut answers a saved cache: the file's own, or what the command line asks where that is meaningful.

A file holds a tier (the whole prompt, or a cut made at prefill) and records the cut its answers are
made with per question. Settings given explicitly when it is loaded are applied where the file can
serve them (a per-question budget no larger than what it holds) and refused, saying what the file
holds and what was asked, where it cannot (a document-window cut is made at prefill and cannot be
made again from a file; positions that were dropped cannot come back).
"""

from dataclasses import replace
from pathlib import Path

from snapkv.base.errors import ConfigError
from snapkv.compression.config import DEFAULTS, Cut, SnapKVConfig, Tier, mode_of

CUT_FIELDS = ("budget", "window", "kernel", "pooling", "method", "whole_words")
STORE_FIELDS = ("store_budget", "store_keep", "store_method", "store_bits")


def _held(path: Path, tier: Tier, kept: int, saved: Cut | None) -> str:
    how = f"answered with a per-question cut of {saved.describe()}" if saved else "answered as it is"
    return f"{path} holds a {mode_of(tier.cut, saved)} cache ({tier.describe()}, {kept} positions per head; {how})"


def _same_tier(tier: Tier, requested: SnapKVConfig) -> bool:
    """Whether the stored tier `requested` asks for is the one the file holds."""
    wanted, held = requested.stored_tier, tier.cut
    if requested.store_bits != tier.bits or (wanted is None) != (held is None):
        return False
    return wanted is None or (wanted.method == held.method and wanted.keep == held.keep
                              and (wanted.budget is None or wanted.budget == held.budget))


def _merged(base: Cut, requested: SnapKVConfig, explicit: frozenset[str]) -> Cut:
    """`base` with the explicitly given cut settings of `requested` on top."""
    values = {"budget": base.budget, "window": base.window, "method": base.method.name, "whole_words": base.whole_words}
    values.update({name: getattr(base.method, name) for name in ("kernel", "pooling") if hasattr(base.method, name)})
    values.update({name: getattr(requested, name) for name in CUT_FIELDS if name in explicit})
    return replace(DEFAULTS, **values, query_aware=True, store_budget=None).cut


def cut_for_file(path: Path, tier: Tier, kept: int, saved: Cut | None, requested: SnapKVConfig | None,
                 explicit: frozenset[str]) -> tuple[Cut | None, list[str]]:
    """(the per-question cut to answer with, notes for the user); ConfigError where the file cannot serve the request.

    tier, kept, saved: what the file holds, its positions per head, its recorded per-question cut.
    requested: the session's settings (None: --no-compress); explicit: which of them the user gave.
    """
    if not explicit:
        return saved, []
    holds = _held(path, tier, kept, saved)
    if requested is not None and explicit & set(STORE_FIELDS) and not _same_tier(tier, requested):
        raise ConfigError(f"{holds}; the --store-* options describe another stored tier, and what a file holds is "
                          "fixed. Leave them out, or cut a whole-prompt file to a new one with snapkv compress FILE "
                          "--store-keep ... -o NEW.snapkv.")
    if requested is None:  # --no-compress: answer against everything
        if tier.cut is not None:
            raise ConfigError(f"{holds}; --no-compress asks for the full cache, whose dropped positions it "
                              "does not have. Ask the document itself with --no-compress.")
        return None, []
    base = saved or tier.cut or DEFAULTS.cut
    wanted = _merged(base, requested, explicit)
    query_aware = requested.query_aware if "query_aware" in explicit else saved is not None
    if not query_aware:
        if tier.cut is None:
            if "query_aware" in explicit:
                raise ConfigError(f"{holds}; --no-query-aware asks for a document-window cache, which is cut at "
                                  "prefill with the document's tail as the window. Ask the document itself with "
                                  "--no-query-aware, or leave the flag out to use the file as it is.")
            if explicit & set(CUT_FIELDS):  # a whole-prompt file answered as is: a budget means a per-question cut
                return wanted, [f"each question cuts the file's whole-prompt cache to {wanted.describe()}"]
            return None, []
        if wanted == tier.cut:
            return None, []
        if "query_aware" not in explicit and wanted.budget < tier.cut.budget:
            return wanted, [f"{path} holds a document-window cache of {tier.cut.budget} positions per head; each "
                            f"question cuts it further to {wanted.describe()}"]
        raise ConfigError(f"{holds}; you asked for a document-window cache of {wanted.describe()}. A document-window "
                          "cut is made at prefill: ask the document itself with these settings, or leave them out "
                          "to use the file as it is.")
    if "budget" in explicit and tier.cut is not None and wanted.budget > tier.cut.budget:
        raise ConfigError(f"{holds}; --budget {wanted.budget} asks for more positions per head than it holds. Use "
                          f"--budget {tier.cut.budget} or less, or build the cache again from the document.")
    return wanted, []
