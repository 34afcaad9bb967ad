"""snapkv models: what can be used here, from disk only (snapkv never downloads)."""

import json

import typer


def models(as_json: bool = typer.Option(False, "--json", help="Print them as one JSON object.")) -> None:
    """List the models that can be used here: the embedded one, GGUF files in the snapkv home, the local Hugging Face
    cache, converted GGUFs.

    Pass a name to --model (or SNAPKV_MODEL); a model folder or a .gguf file anywhere works too.
    """
    from dataclasses import asdict

    from rich.table import Table

    from snapkv.engine.catalog import EMBEDDED, available_models

    from .consoles import SCHEMA_VERSION, inert, stdout_console

    entries = available_models()
    if as_json:
        print(json.dumps({"schema_version": SCHEMA_VERSION,
                          "models": [{**asdict(e), "supported": e.supported} for e in entries]}))
        return
    table = Table(box=None, pad_edge=False)
    for column in ("--model", "from", "size", "context", "family"):
        table.add_column(column, overflow="fold")
    for entry in entries:
        family = entry.model_type or "?"
        if not entry.supported:
            family += " (not supported)"
        table.add_row(inert(entry.name or f"(default) {EMBEDDED}"), entry.kind, f"{entry.size_bytes / 2**20:,.0f} MiB",
                      str(entry.context or "?"), family)
    console = stdout_console()
    console.print(table)
    if not any(e.kind == "hugging face cache" for e in entries):
        console.print("no models in the local Hugging Face cache; to use one, download it first "
                      "(hf download ID), then pass its id to --model")
