"""snapkv info: what a saved cache holds, from its metadata and tensors."""

import datetime
import json
from pathlib import Path
from typing import Optional

import typer
from snapkv.base.errors import IncompatibleCacheError

from .options import PasswordOption


def describe(path: Path) -> dict:
    """The metadata plus sizes and per-layer kept counts, from the file's header and raw bytes: checked as a load
    checks it (its checksum included), without torch (snapkv.storage.cacheinfo)."""
    from dataclasses import asdict

    from snapkv.storage.cacheinfo import describe_file
    from snapkv.storage.measured import measured_for

    described = describe_file(path)
    metadata = described.metadata
    measured = measured_for(metadata.get("model", {}).get("name", ""), metadata.get("storage", {}).get("bits", 16),
                            metadata.get("per_question"), metadata.get("system_sha256"),
                            (metadata.get("tier") or {}).get("cut"))
    return {
        **metadata,
        "path": str(path),
        "file_bytes": path.stat().st_size,
        "kv_bytes": described.stored_kv_bytes,
        "kv_bytes_full": described.full_kv_bytes(2),
        "kept_per_layer": described.kept_per_layer,
        "bytes_per_layer": described.layer_bytes,
        "held": described.tier.describe(),
        "answered_with": described.per_question.describe() if described.per_question else "the cache as it is",
        # what `snapkv eval fidelity` measured for its model, bits, budget and system message ([]: not measured)
        "fidelity": [asdict(entry) for entry in measured],
    }


def staleness(data: dict, document: str | None, password: str | None) -> list[str]:
    """Why the cache no longer matches its document (the one given, else the recorded paths); [] if fresh."""
    from snapkv.storage.cachemeta import recorded_sources
    from snapkv.io.documents import read_sources, stale_sources

    recorded = recorded_sources(data["path"], data)
    given = read_sources(document, password) if document is not None else None
    return stale_sources(recorded, given)


def info(
    file: Path = typer.Argument(..., metavar="FILE", help="A saved .snapkv cache."),
    document: Optional[str] = typer.Argument(
        None, help="The document the cache was made from: check that it has not changed since (exit code 5 "
                   "when it has). Without it, the source paths recorded in the cache are checked."),
    password: PasswordOption = None,
    as_json: bool = typer.Option(False, "--json", help="Print the metadata as one JSON object."),
) -> None:
    """Show what a saved cache holds: model, sources, lengths, settings, sizes, and whether it is stale."""
    from .consoles import stderr_console

    with stderr_console().status("Reading..."):
        data = describe(file)
        stale = staleness(data, document, password)
    data["stale"] = stale
    data["matches"] = None if document is None else not stale  # whether the document given made this cache
    if as_json:
        print(json.dumps(data))
    else:
        show(data, document)
    if stale and document is not None:
        raise IncompatibleCacheError(f"{file} is stale: " + "; ".join(stale) + ". Build a new cache from the document.")


def _bits_described(bits) -> str:
    from snapkv.base.bits import Bits

    try:
        return Bits.parse(bits).describe()
    except ValueError:
        return f"{bits} bits (unknown)"


def _fidelity_described(data: dict) -> str:
    """What `snapkv eval fidelity` measured for this file's own settings (describe()'s "fidelity"), or that it was not."""
    from snapkv.storage.measured import Measured

    if not data["fidelity"]:
        budget = (data.get("per_question") or {}).get("budget")
        return (f"not measured for these settings ({data.get('model', {}).get('name')}, "
                f"{data.get('storage', {}).get('bits', 16)} bits, budget {budget}, this system message)")
    return "; ".join(Measured(**entry).describe() for entry in data["fidelity"])


def _runs(values) -> list[tuple[int, int, object]]:
    """Consecutive equal values as (first index, last index, value): thirty identical layers are one entry."""
    runs: list[list] = []
    for index, value in enumerate(values):
        if runs and runs[-1][2] == value:
            runs[-1][1] = index
        else:
            runs.append([index, index, value])
    return [tuple(run) for run in runs]


def _span(first: int, last: int) -> str:
    return f"layers {first}-{last}" if last > first else f"layer {first}"


def show(data: dict, document: str | None = None) -> None:
    """describe()'s data, with "stale" and "matches" added, as a table; `document`: the one the user named."""
    from rich.table import Table

    from .consoles import inert, stdout_console

    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column(overflow="fold")
    model = data.get("model", {})
    table.add_row("file", inert(f"{data['path']} ({data['file_bytes'] / 2**20:.1f} MiB, format {data['version']})"))
    storage = data.get("storage", {})
    bits = _bits_described(storage.get("bits", 16))
    stored = storage.get("dtype") if storage.get("bits") == 16 else bits
    table.add_row("model", inert(f"{model.get('name')} ({model.get('model_type')}); stored {stored}"))
    for source in data.get("sources", []):
        pages = f", {source['pages']} pages" if source.get("pages") else ""
        table.add_row("source", inert(f"{source['name']} ({source['size']} bytes{pages}, sha256 {source['sha256'][:12]})"))
    kept = data["kept_per_layer"]
    table.add_row("prompt", f"{data['original_length']} tokens")
    table.add_row("kept", f"{min(kept)}-{max(kept)} per KV head per layer, {len(kept)} layers")
    table.add_row("mode", inert(str(data.get("mode"))))
    table.add_row("holds", inert(data["held"]))
    table.add_row("answers", inert(f"per question: {data['answered_with']}"))
    table.add_row("fidelity", inert(_fidelity_described(data)))
    table.add_row("KV", f"{data['kv_bytes'] / 2**20:.1f} MiB stored, {data['kv_bytes_full'] / 2**20:.1f} MiB for the "
                        f"full cache in 16 bits ({data['kv_bytes_full'] / max(data['kv_bytes'], 1):.1f}x)")
    table.add_row("per layer", "; ".join(f"{_span(first, last)}: {kept} x {bits}, {size / 2**10:.0f} KiB"
                                         for first, last, (kept, size) in _runs(zip(kept, data["bytes_per_layer"]))))
    producer = data.get("producer", {})
    created = datetime.datetime.fromtimestamp(data.get("created", 0)).strftime("%Y-%m-%d %H:%M")
    table.add_row("made", inert(f"{created} by snapkv {producer.get('snapkv')}, transformers {producer.get('transformers')}"))
    if data["stale"]:
        table.add_row("status", inert("STALE: " + "; ".join(data["stale"])))
    elif data.get("matches"):
        table.add_row("status", inert(f"matches {document}: the cache was made from it"))
    stdout_console().print(table)
