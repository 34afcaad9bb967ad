"""snapkv cache list|rm|clear: the store of saved caches."""

import json
import time

import typer
from snapkv.base.errors import ConfigError

from .usage import PlainCommand

app = typer.Typer(help="List and delete the saved caches in the store.", no_args_is_help=True, rich_markup_mode=None)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _iso(seconds: float) -> str:
    """A file time as ISO 8601 in the local time zone, to the second."""
    import datetime

    return datetime.datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")


def _bits(metadata: dict | None) -> "str | None":
    """The stored bits a cache file records ("16/8"), None where unreadable."""
    bits = ((metadata or {}).get("storage") or {}).get("bits", 16 if metadata else None)
    return None if bits is None else str(bits)


def _tier(metadata: dict | None) -> "str | None":
    """Which positions a cache file stores ("whole prompt", "70% by pseudo-question"), None where unreadable."""
    from snapkv.compression.config import Tier

    try:
        tier = Tier.from_dict((metadata or {})["tier"])
    except Exception:  # an older or unreadable file: the column says "-"
        return None
    return "whole prompt" if tier.cut is None else tier.cut.describe()


@app.command(name="list", cls=PlainCommand)
def list_entries(as_json: bool = typer.Option(False, "--json", help="Print the entries as JSON.")) -> None:
    """List the saved caches with their sizes, ages, models and sources."""
    from rich.table import Table

    from snapkv.storage.remote import open_store

    from .consoles import inert, stdout_console

    store = open_store()
    entries = store.entries()
    if as_json:
        print(json.dumps([{"key": e.key, "path": str(e.path), "bytes": e.size, "modified": e.modified,
                           "modified_iso": _iso(e.modified), "bits": _bits(e.metadata), "tier": _tier(e.metadata),
                           "metadata": e.metadata}
                          for e in entries]))
        return
    console = stdout_console()
    count = f"{len(entries)} cache{'' if len(entries) == 1 else 's'}"
    console.print(f"{count}, {sum(e.size for e in entries) / 2**20:.1f} MiB, in {inert(store.where)}",
                  soft_wrap=True)
    table = Table()
    for column in ("key", "size", "bits", "tier", "age", "model", "tokens", "mode", "sources"):
        table.add_column(column, overflow="fold")
    now = time.time()
    for entry in entries:
        meta = entry.metadata or {}
        sources = ", ".join(s["name"] for s in meta.get("sources", [])) or "-"
        table.add_row(entry.key[:12], f"{entry.size / 2**20:.1f} MiB", str(_bits(meta) or "-"),
                      inert(_tier(meta) or "-"), _age(now - entry.modified),
                      inert(str(meta.get("model", {}).get("name", "unreadable"))), str(meta.get("original_length", "-")),
                      str(meta.get("mode", "-")), inert(sources))
    console.print(table)


@app.command(name="rm", cls=PlainCommand)
def remove(keys: list[str] = typer.Argument(..., metavar="KEY", help="Keys (or unique key prefixes) from `snapkv cache list`.")) -> None:
    """Delete saved caches by key."""
    from snapkv.storage.remote import open_store

    store = open_store()
    known = [entry.key for entry in store.entries()]
    for prefix in keys:
        matches = [key for key in known if key.startswith(prefix)]
        if len(matches) != 1:
            raise ConfigError(f"{prefix!r} matches {len(matches)} saved caches; give more of the key")
        store.remove(matches[0])
        print(f"removed {matches[0]}")


@app.command(name="clear", cls=PlainCommand)
def clear(yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation.")) -> None:
    """Delete every saved cache."""
    from snapkv.storage.remote import open_store

    store = open_store()
    entries = store.entries()
    if not entries:
        print("the store is empty")
        return
    if not yes and not typer.confirm(f"Delete {len(entries)} saved caches ({sum(e.size for e in entries) / 2**20:.1f} MiB)?"):
        raise typer.Abort()
    print(f"removed {store.clear()} caches")
