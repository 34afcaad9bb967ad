"""snapkv/storage/measured.json from the benchmark's result files: every comparison of each run, scored again with
today's measure (snapkv.io.facts), so that what `snapkv info` shows is computed, never typed.

    python scripts/publish_measured.py      writes it; tests/test_fidelity.py fails where the shipped file differs
"""

import json
from pathlib import Path

from snapkv.base.digests import text_digest
from snapkv.compression.config import DEFAULT_SYSTEM
from snapkv.compression.methods import SnapKV
from snapkv.measure.fidelity import FidelityResult, Setting, summarize

# The runs published, oldest first (a later run of the same settings wins in `info`), with the system message of
# the runs that did not record theirs: the embedded model's own (""), then snapkv's default.
# A run may be several files over the same documents, merged (merged()).
RESULTS: tuple[tuple[tuple[str, ...], str | None], ...] = (
    (("benchmarks/results/fidelity-fp32-budget4096.json",), ""),
    (("benchmarks/results/fidelity-fp32-budget4096-system.json",), DEFAULT_SYSTEM),
    (("benchmarks/results/fidelity-cut-fp32-long.json", "benchmarks/results/fidelity-cut-fp32-new.json",
      "benchmarks/results/fidelity-cut-fp32-words.json", "benchmarks/results/fidelity-cut-fp32-pyramid.json",
      "benchmarks/results/fidelity-cut-fp32-numbers.json", "benchmarks/results/fidelity-floor-bf16.json",
      "benchmarks/results/fidelity-storage-fp32-2048-words.json"), None),
    # the tiers with a form (8r/8, 8r/4g32), under --dtype auto (fp32 weights, bf16 prefill; the file says float32)
    (("benchmarks/results/fidelity-storage-auto-2048-forms.json",), None),
    # values in 4 bits per token by 32 or over the head; the 16 and 8 answers are the run above's, to the letter
    (("benchmarks/results/fidelity-storage-auto-2048-value-groups.json",), None),
    # values in 4 bits by 32, a sharper share of 10% or 20% in 8 bits; the 8 answers are the runs above's to the letter
    (("benchmarks/results/fidelity-storage-auto-2048-sharper.json",), None),
    # keys in 4 bits per channel after RoPE, unrotated, by 32 tokens (4ug32/8); the 8 answers are the runs above's
    (("benchmarks/results/fidelity-storage-auto-2048-keys-per-channel.json",), None),
    # 8 bits in larger groups: keys by 128 tokens with values over the head (8g128/8g64), and both by 64; the 8
    # answers are the runs above's to the letter
    (("benchmarks/results/fidelity-storage-auto-2048-groups.json",), None),
    # the whole prompt's 8 bits with only a share of the document stored (8~70%, 8~50%, 8~40%: --store-keep); the 8
    # answers are the runs above's to the letter
    (("benchmarks/results/fidelity-storage-auto-2048-stored-share.json",), None),
)
MEASURED_JSON = Path(__file__).resolve().parents[1] / "storage" / "measured.json"


def merged(runs: list[dict]) -> dict:
    """Runs over the same documents with different settings as one (the first run's description, every run's
    answers per document); ValueError where two runs answered one setting differently (not the same computation)."""
    first = dict(runs[0])
    documents = {d["name"]: {**d, "answers": dict(d["answers"]), "seconds": dict(d.get("seconds", {})),
                             "file_bytes": dict(d.get("file_bytes", {}))} for d in first["documents"]}
    settings = list(first["settings"])
    for run in runs[1:]:
        for document in run["documents"]:
            into = documents.setdefault(document["name"], {**document, "answers": {}, "seconds": {}, "file_bytes": {}})
            for name, answers in document["answers"].items():
                texts = [a["text"] for a in answers]
                if name in into["answers"] and [a["text"] for a in into["answers"][name]] != texts:
                    raise ValueError(f"{document['name']}: two runs answered {name} differently")
                into["answers"][name] = answers
                into["seconds"][name] = document.get("seconds", {}).get(name, 0.0)
                if name in document.get("file_bytes", {}):
                    into["file_bytes"][name] = document["file_bytes"][name]
        settings += [name for name in run["settings"] if name not in settings]
    # only documents every setting answered
    kept = [d for d in documents.values() if all(name in d["answers"] for name in settings)]
    return {**first, "settings": settings, "documents": kept,
            "seconds": sum(run.get("seconds", 0.0) for run in runs)}


def rescore(data: dict) -> FidelityResult:
    """A result file's data with its comparisons computed again from its answers."""
    settings = [Setting.parse(name) for name in data["settings"]]
    result = FidelityResult(data["model"], data["dtype"], data["budget"], data["settings"],
                            documents=data["documents"], seconds=data.get("seconds", 0.0),
                            system=data.get("system"), cpu=data.get("cpu", ""))
    summarize(result, settings)
    return result


def entries_of(data: dict, source: str, system: str | None) -> list[dict]:
    """The published entries (snapkv.storage.measured.Measured's fields) of one run."""
    result = rescore(data)
    system = data.get("system", system)
    answers = f"{data['answer_tokens']} tokens" if data.get("answer_tokens") else "first sentence"
    entries = []
    groups = [("storage", result.storage), ("compression", result.compression), ("floor", result.floors)]
    for kind, comparisons in groups:
        for comparison in comparisons:
            setting = Setting.parse(comparison.setting)
            entries.append({
                "kind": kind, "model": data["model"], "dtype": data["dtype"],
                "system_sha256": None if system is None else text_digest(system), "bits": setting.tier,
                "budget": setting.budget, "method": setting.method, "kernel": setting.kernel or SnapKV.kernel,
                "whole_words": setting.words, "setting": comparison.setting, "reference": comparison.reference,
                "answers": answers, "questions": comparison.questions, "identical": comparison.agreed,
                "changed": comparison.changed, "changed_right": comparison.changed_right, "lost": comparison.lost,
                "gained": comparison.gained, "smaller": round(comparison.bytes_ratio, 3) if kind == "storage" else 0.0,
                "beyond_floor": comparison.beyond_floor, "cpu": data.get("cpu", ""), "source": source,
                **({"pyramid": True} if setting.pyramid else {}),
                **({"numbers_with_neighbours": True} if setting.numbers else {})})
    return entries


def published(root: Path) -> dict:
    """measured.json's content, from the RESULTS under `root` (the repository)."""
    entries = []
    for sources, system in RESULTS:
        data = merged([json.loads((root / source).read_text(encoding="utf-8")) for source in sources])
        entries += entries_of(data, " + ".join(Path(source).name for source in sources), system)
    return {"generated_by": "python scripts/publish_measured.py", "entries": entries}


def write(root: Path, path: Path = MEASURED_JSON) -> Path:
    from snapkv.base.atomic import write_atomically

    text = json.dumps(published(root), indent=1) + "\n"
    write_atomically(path, lambda temp: temp.write_text(text, encoding="utf-8"), "the measured figures")
    return path


def markdown_table(comparisons: list, with_bytes: bool = False) -> str:
    """The comparisons of a run as README's and docs' tables: identical, changed, changed of right, lost, gained,
    found, against the noise floor, seconds per answer (and the file's size against the reference's)."""
    head = ["setting", "identical", "changed", "of right", "lost", "gained", "found (reference)", "vs the floor",
            "s/answer"] + (["smaller"] if with_bytes else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparisons:
        floor = "-" if c.beyond_floor is None else (
            f"{'beyond' if c.beyond_floor else 'within'} (p {c.p_lost:.2g} lost, {c.p_changed_right:.2g} of right)")
        cells = [c.setting, f"{c.agreed} ({c.agreement:.0%})", str(c.changed), str(c.changed_right), str(c.lost),
                 str(c.gained), f"{c.found} ({c.reference_found})", floor, f"{c.seconds_per_answer:.2f}"]
        rows.append("| " + " | ".join(cells + ([f"{c.bytes_ratio:.2f}x"] if with_bytes else [])) + " |")
    return "\n".join(rows)


def tables(root: Path, sources: tuple[str, ...]) -> str:
    """Markdown tables of a run made of these result files (merged): the floor, storage, compression."""
    result = rescore(merged([json.loads((root / source).read_text(encoding="utf-8")) for source in sources]))
    parts = []
    if result.floors:
        parts.append(markdown_table(result.floors))
    if result.storage:
        parts.append(markdown_table(result.storage, with_bytes=True))
    parts.append(markdown_table(result.compression))
    return "\n\n".join(parts)
