"""What the commands share: options, settings, progress, the stats panel and the JSON report."""

import re
import resource
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Annotated, Optional

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from snapkv.config import SnapKVConfig
from snapkv.errors import ConfigError
from snapkv.models import LoadedModel, load_model
from snapkv.session import AnswerResult, PreparedDocument, Session

ModelOption = Annotated[Optional[str], typer.Option(
    "--model", "-m", envvar="SNAPKV_MODEL",
    help="Hugging Face id (local cache only), model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.")]
BudgetOption = Annotated[int, typer.Option(help="Positions kept per KV head per layer, the observation window included.")]
WindowOption = Annotated[int, typer.Option(help="Observation window: how many final positions decide what is kept.")]
KernelOption = Annotated[int, typer.Option(help="Width of the pooling over attention scores (odd); wider keeps whole numbers and names.")]
PoolingOption = Annotated[str, typer.Option(help="Pooling of the scores: max or avg.")]
QueryAwareOption = Annotated[bool, typer.Option(
    "--query-aware/--no-query-aware",
    help="Query-aware: keep the whole prompt's cache and compress it per question, with the question as the "
         "window. Otherwise compress once at prefill with the document's tail as the window.")]
NoCompressOption = Annotated[bool, typer.Option("--no-compress", help="Keep the full cache (the baseline).")]
DeviceOption = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
DeviceMapOption = Annotated[Optional[str], typer.Option(
    help="Spread a model too large for one GPU over several with accelerate: auto, balanced or sequential. "
         "Each layer's cache stays on that layer's device.")]
DtypeOption = Annotated[str, typer.Option(
    help="auto (bf16 on GPU and on CPUs with bf16 units, else fp32), float32, bfloat16 or float16.")]
PasswordOption = Annotated[Optional[str], typer.Option(help="Password of an encrypted PDF.")]
TruncateOption = Annotated[Optional[str], typer.Option(
    help="Cut a document longer than the model's context: start, middle or end (the part removed).")]
SkipDigestOption = Annotated[bool, typer.Option(
    "--skip-digest", help="Do not check a saved cache's payload digest when loading it (faster for very "
                          "large files; damage then goes unnoticed).")]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def inert(text: str) -> str:
    """Text safe to show on a terminal: control characters (escape sequences included) removed.

    Always print it with markup off, so "[bold]" in a document or an answer stays text.
    """
    return _CONTROL.sub("", text)


def int_list(text: str, option: str) -> list[int]:
    """'512,1024' -> [512, 1024]; anything else is a usage error naming the option."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ConfigError(f"{option} takes whole numbers separated by commas, got {text!r}") from error


def pyplot():
    """matplotlib's pyplot on a file-only backend, or a usage error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ConfigError('plots need matplotlib: pip install -e ".[plot]"') from error
    return plt


def settings_from(budget: int, window: int, kernel: int, pooling: str, query_aware: bool,
                  no_compress: bool) -> SnapKVConfig | None:
    if no_compress:
        return None
    return SnapKVConfig(budget=budget, window=window, kernel=kernel, pooling=pooling, query_aware=query_aware)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def stdout_console() -> Console:
    return Console(highlight=False, markup=False, emoji=False)


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
def prefill_progress(err: Console, session: Session, tokens_hint: str = ""):
    """A per-layer progress bar with tokens/s while the session prefills."""
    progress = Progress(TextColumn("Prefilling {task.fields[detail]}"), BarColumn(), TextColumn("layer {task.completed}/{task.total}"),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err, transient=True)
    task = None
    started = time.perf_counter()

    def on_layer(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            task = progress.add_task("prefill", total=total, detail=tokens_hint, rate="")
        elapsed = time.perf_counter() - started
        progress.update(task, completed=done, rate=f"{session.last_prompt_tokens * done / total / max(elapsed, 1e-9):,.0f} tokens/s")

    session.on_layer = on_layer
    try:
        with progress:
            yield
    finally:
        session.on_layer = None


def prepare_with_progress(err: Console, session: Session, document) -> PreparedDocument:
    with prefill_progress(err, session):
        prepared = session.prepare(document)
    if session.truncated_tokens:
        err.print(f"warning: the document was cut by {session.truncated_tokens} tokens "
                  f"({session.truncate}) to fit the model's context", markup=False)
    if prepared.note:
        err.print("warning: " + prepared.note, markup=False)
    return prepared


def load_file_with_status(err: Console, session: Session, path: str) -> PreparedDocument:
    """A saved .snapkv cache, with a warning when its source document has changed since."""
    with err.status("Loading saved cache..."):
        prepared = session.load_file(path)
    if prepared.note:
        err.print("warning: " + inert(prepared.note), markup=False)
    return prepared


def kept_per_question(session: Session, prepared: PreparedDocument) -> int:
    settings = session.settings
    if settings is not None and settings.query_aware:
        return min(prepared.cache.kept_tokens, settings.budget)
    return prepared.cache.kept_tokens


def report(session: Session, prepared: PreparedDocument, answers: list[AnswerResult],
           timings: dict) -> dict:
    """The --json object (and what the stats panel shows)."""
    loaded, settings, cache = session.loaded, session.settings, prepared.cache
    return {
        "answers": [
            {"question": a.question, "answer": a.text, "new_tokens": a.new_tokens,
             "ttft_seconds": round(a.ttft_seconds, 4), "decode_tokens_per_second": round(a.decode_tokens_per_second, 2)}
            for a in answers
        ],
        "document": {"tokens": prepared.tokens, "truncated_tokens": session.truncated_tokens,
                     "sources": [asdict(s) for s in prepared.document.sources]},
        "compression": {
            "method": "none" if settings is None else "snapkv",
            "budget": None if settings is None else settings.budget,
            "window": None if settings is None else settings.window,
            "kernel": None if settings is None else settings.kernel,
            "pooling": None if settings is None else settings.pooling,
            "query_aware": bool(settings and settings.query_aware),
            "kept_tokens": kept_per_question(session, prepared),
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
    table.add_row("kept", f"{comp['kept_tokens']} per head per layer ({ratio:.1f}x fewer)" if comp["method"] == "snapkv"
                  else "everything (--no-compress)")
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
