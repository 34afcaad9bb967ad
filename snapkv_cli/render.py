"""What the commands show: consoles, progress while loading and prefilling, the stats panel, the JSON report.

Everything shown is computed from what the library returns (a PreparedDocument, AnswerResults); nothing
is read off a session.
"""

import re
import resource
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from snapkv.models import LoadedModel, load_model
from snapkv.session import AnswerResult, PreparedDocument, Session

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def inert(text: str) -> str:
    """Text safe to show on a terminal: control characters (escape sequences included) removed.

    Always print it with markup off, so "[bold]" in a document or an answer stays text.
    """
    return _CONTROL.sub("", text)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def stdout_console() -> Console:
    return Console(highlight=False, markup=False, emoji=False)


def warn(err: Console, message: str) -> None:
    err.print("warning: " + inert(message), markup=False)


def pyplot():
    """matplotlib's pyplot on a file-only backend, or a usage error naming the extra to install."""
    from snapkv.errors import ConfigError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ConfigError('plots need matplotlib: pip install -e ".[plot]"') from error
    return plt


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return sum(torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count()))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_with_status(err: Console, model: str | None, device: str, dtype: str,
                     device_map: str | None = None) -> tuple[LoadedModel, float]:
    with err.status("Loading model..."):
        started = time.perf_counter()
        loaded = load_model(model, device=device, dtype=dtype, device_map=device_map)
    return loaded, time.perf_counter() - started


@contextmanager
def prefill_progress(err: Console, tokens: int):
    """A per-layer progress bar with tokens/s; yields the on_layer callback for Session.prepare."""
    progress = Progress(TextColumn("Prefilling {task.fields[detail]}"), BarColumn(),
                        TextColumn("layer {task.completed}/{task.total}"), TextColumn("{task.fields[rate]}"),
                        TimeElapsedColumn(), console=err, transient=True)
    task = None
    started = time.perf_counter()

    def on_layer(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            task = progress.add_task("prefill", total=total, detail=f"{tokens} tokens", rate="")
        elapsed = time.perf_counter() - started
        progress.update(task, completed=done, rate=f"{tokens * done / total / max(elapsed, 1e-9):,.0f} tokens/s")

    with progress:
        yield on_layer


def prepare_with_progress(err: Console, session: Session, document) -> PreparedDocument:
    """The document's cache (a store hit or a prefill with a progress bar), warnings shown."""
    prompt = session.prompt(document)
    if prompt.truncation:
        warn(err, f"the document was cut by {prompt.truncation.tokens} tokens ({prompt.truncation.side}) "
                  "to fit the model's context")
    with prefill_progress(err, prompt.tokens) as on_layer:
        prepared = session.prepare(prompt, on_layer=on_layer)
    for note in prepared.notes:
        warn(err, note)
    return prepared


def load_file_with_status(err: Console, session: Session, path: str,
                          explicit: frozenset[str] = frozenset()) -> PreparedDocument:
    """A saved .snapkv cache, answered as the file says or as `explicit` settings ask; warnings shown."""
    with err.status("Loading saved cache..."):
        prepared = session.load_file(path, explicit=explicit)
    for note in prepared.notes:
        warn(err, note)
    return prepared


def report(loaded: LoadedModel, prepared: PreparedDocument, answers: list[AnswerResult], timings: dict) -> dict:
    """The --json object (and what the stats panel shows)."""
    cache, cut = prepared.cache, prepared.per_question or prepared.tier.cut
    truncation = prepared.tier.truncation
    return {
        "answers": [
            {"question": a.question, "answer": a.text, "new_tokens": a.new_tokens,
             "ttft_seconds": round(a.ttft_seconds, 4), "decode_tokens_per_second": round(a.decode_tokens_per_second, 2)}
            for a in answers
        ],
        "document": {"tokens": prepared.tokens, "truncated_tokens": truncation.tokens if truncation else 0,
                     "sources": [asdict(s) for s in prepared.document.sources]},
        "compression": {
            "mode": prepared.mode,
            "method": cut.method.name if cut else "none",
            **({"budget": cut.budget, "window": cut.window} if cut else {"budget": None, "window": None}),
            "kernel": getattr(cut.method, "kernel", None) if cut else None,
            "pooling": getattr(cut.method, "pooling", None) if cut else None,
            "query_aware": prepared.per_question is not None,
            "stored_tier": prepared.tier.to_dict(),
            "kept_tokens": prepared.kept_per_question,
            "stored_tokens": cache.kept_tokens,
            "kv_bytes": cache.kv_bytes,
            "kv_bytes_full": cache.full_kv_bytes(),
        },
        "cache": {"path": str(prepared.path) if prepared.path else None, "hit": prepared.hit,
                  "bytes": prepared.file_bytes, "load_seconds": round(prepared.load_seconds, 4),
                  "save_seconds": round(prepared.save_seconds, 4)},
        "timings": {k: round(v, 4) for k, v in {**timings, "prefill_seconds": prepared.prefill_seconds}.items()},
        "memory": {"peak_bytes": peak_memory_bytes(loaded.device), "device": str(loaded.device),
                   # per phase: CUDA max allocated (weights included) / CPU RSS growth during the phase
                   "prefill_peak_bytes": prepared.prefill_peak_bytes,
                   "answer_peak_bytes": max((a.peak_bytes for a in answers), default=0)},
        "model": {"name": loaded.name, "context_length": loaded.context_length},
    }


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"


def stats_table(data: dict) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column(overflow="fold")
    comp, cache = data["compression"], data["cache"]
    table.add_row("document", f"{data['document']['tokens']} tokens")
    ratio = data["document"]["tokens"] / max(comp["kept_tokens"], 1)
    if comp["mode"] == "full":
        table.add_row("kept", "everything (full cache)")
    else:
        table.add_row("kept", f"{comp['kept_tokens']} per head per layer ({ratio:.1f}x fewer, {comp['mode']})")
    table.add_row("KV memory", f"{_mib(comp['kv_bytes'])} stored, {_mib(comp['kv_bytes_full'])} full")
    if cache["hit"]:
        table.add_row("cache", f"hit, loaded in {cache['load_seconds']:.2f} s: {cache['path']} ({_mib(cache['bytes'])})")
    else:
        table.add_row("prefill", f"{data['timings']['prefill_seconds']:.2f} s")
        if cache["path"]:
            table.add_row("cache", f"saved in {cache['save_seconds']:.2f} s: {cache['path']} ({_mib(cache['bytes'])})")
    for answer in data["answers"]:
        table.add_row("answer", f"first token {answer['ttft_seconds']:.2f} s, "
                                f"{answer['decode_tokens_per_second']:.1f} tokens/s, {answer['new_tokens']} tokens")
    memory = data["memory"]
    if memory["device"].startswith("cuda"):
        phases = f"prefill {_mib(memory['prefill_peak_bytes'])}, " if not cache["hit"] else ""
        table.add_row("peak memory", f"{_mib(memory['peak_bytes'])} CUDA max allocated "
                                     f"({phases}answers {_mib(memory['answer_peak_bytes'])})")
    else:
        phases = f"prefill +{_mib(memory['prefill_peak_bytes'])}, " if not cache["hit"] else ""
        table.add_row("peak memory", f"{_mib(memory['peak_bytes'])} RSS ({phases}answers "
                                     f"+{_mib(memory['answer_peak_bytes'])})")
    return table
