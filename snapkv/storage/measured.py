"""What `snapkv eval fidelity` measured, for people choosing settings: `snapkv info` shows the figures of a file's own
model, stored bits, per-question budget and system message, or says they were not measured.

Free of torch (`info` reads it). The figures live in measured.json beside this module, generated from the result
files under benchmarks/results by `python scripts/publish_measured.py` (snapkv.measure.published); a test
regenerates them and fails where they differ, so nothing here is typed by hand.
"""

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from snapkv.base.bits import Bits, parse_tier, tier_name


@dataclass(frozen=True)
class Measured:
    """One setting's answers against its reference's, over one run of the benchmark.

    kind:      "storage" (a stored tier against the 16-bit file, both cut to `budget`), "compression" (the 16-bit
               file cut to `budget` against the full cache) or "floor" (the full cache through a second engine)
    setting, reference: the benchmark's names ("16/8 @4096", "16 @4096", "full")
    """

    kind: str
    model: str
    dtype: str
    system_sha256: str | None  # the system message's digest; None where the run did not record it
    bits: str
    budget: int | None
    method: str                # the per-question cut's method, its pooling width, and whether it keeps words whole
    kernel: int
    whole_words: bool
    setting: str
    reference: str
    answers: str               # what was compared: "64 tokens" or "first sentence"
    questions: int
    identical: int
    changed: int               # answers with a fact lacking, altered, added or moved (snapkv.io.facts.compare)
    changed_right: int         # of those, where the reference stated the expected fact
    lost: int                  # expected facts the reference stated and this setting did not
    gained: int
    smaller: float             # times smaller than the reference's files (0: not a storage comparison)
    beyond_floor: bool | None  # beyond the run's noise floor by more than chance (None: no floor measured)
    cpu: str
    source: str                # the result file it was computed from
    pyramid: bool = False      # the cut's budget differs by layer (snapkv.compression.config.Cut.pyramid)
    numbers_with_neighbours: bool = False  # numbers kept whole with the words either side (Cut's flag)

    def describe(self) -> str:
        cut = f"{self.budget}{' by ' + self.method if self.method != 'snapkv' else ''}" + (
            ", whole words" if self.whole_words else "") + (
            ", numbers with their neighbours" if self.numbers_with_neighbours else "") + (
            ", budgets per layer" if self.pyramid else "")
        bits, share = parse_tier(self.bits)
        stored = f"{bits} bits" + ("" if share is None else f", {share:.0%} of the document stored,")
        what = {"storage": f"{stored} against 16 bits, both cut to {cut}",
                "compression": f"the cut to {cut} against the full cache",
                "floor": "the noise floor (a second engine)"}[self.kind]
        floor = ("" if self.beyond_floor is None
                 else "; beyond the noise floor" if self.beyond_floor else "; within the noise floor")
        smaller = f"; {self.smaller:.2f}x smaller" if self.smaller else ""
        return (f"{what}: {self.identical} of {self.questions} answers identical, {self.changed} with a fact changed "
                f"({self.changed_right} where the reference was right), {self.lost} fact{'' if self.lost == 1 else 's'} "
                f"lost, {self.gained} gained"
                f"{smaller}{floor} ({self.answers} compared, {self.dtype}, {self.source})")


@lru_cache(maxsize=1)
def all_measured() -> tuple[Measured, ...]:
    """Every published figure (measured.json), later runs after earlier ones."""
    text = resources.files("snapkv.storage").joinpath("measured.json").read_text(encoding="utf-8")
    return tuple(Measured(**entry) for entry in json.loads(text)["entries"])


def stored_tier_name(bits: "Bits | int | str", stored_cut: dict | None) -> str | None:
    """The benchmark's name of a file's stored tier (snapkv.measure.fidelity.Setting.tier): its bits ("8"), with the
    share of the document it keeps where it keeps one by the pseudo-question probes ("8~50%"); None for a tier the
    benchmark does not make (a budget per head, another method) or bits that do not parse."""
    try:
        bits = Bits.parse(bits)
    except ValueError:
        return None
    if not stored_cut:
        return tier_name(bits, None)
    keep = stored_cut.get("keep")
    if keep is None or stored_cut.get("method") != "pseudo-question":
        return None
    return tier_name(bits, keep)


def measured_for(model: str, bits: "Bits | int | str", cut: dict | None,
                 system_sha256: str | None, stored_cut: dict | None = None) -> list[Measured]:
    """The figures measured for a file's own settings (cut: its per-question cut as its metadata holds it; stored_cut:
    the cut that chose its stored tier, None for the whole prompt): its stored tier against 16 bits at its cut, and
    its cut against the full cache; the latest run of each. [] where these settings were not measured."""
    wanted = stored_tier_name(bits, stored_cut)
    if system_sha256 is None or not cut or cut.get("budget") is None or cut.get("keep") is not None:
        return []
    method, kernel = cut.get("method"), cut.get("kernel")
    flags = tuple(bool(cut.get(flag, False)) for flag in ("whole_words", "pyramid", "numbers_with_neighbours"))
    found: dict[str, Measured] = {}
    for entry in all_measured():
        if (entry.model != model or entry.system_sha256 != system_sha256 or entry.budget != cut["budget"]
                or entry.kind == "floor" or (entry.method, entry.kernel) != (method, kernel)
                or (entry.whole_words, entry.pyramid, entry.numbers_with_neighbours) != flags):
            continue
        if (entry.kind == "storage" and wanted is not None and entry.bits == wanted) or entry.kind == "compression":
            found[entry.kind] = entry
    return [found[kind] for kind in ("storage", "compression") if kind in found]
