"""snapkv ask: answer questions about a document, streaming each answer, then show the stats."""

import json
import resource
import sys
import time
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from snapkv.config import SnapKVConfig
from snapkv.documents import read_sources
from snapkv.generation import Sampling
from snapkv.models import load_model
from snapkv.session import Session
from snapkv.store import SUFFIX, CacheStore


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"


def ask(
    source: str = typer.Argument(..., help="A document (.txt, .md, .pdf, .html), a folder of them, - for stdin, "
                                           "or a saved .snapkv cache."),
    questions: list[str] = typer.Argument(..., help="One or more questions, answered in turn against one cache."),
    model: Optional[str] = typer.Option(None, "--model", "-m", envvar="SNAPKV_MODEL",
                                        help="Hugging Face id (local cache), model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct."),
    budget: int = typer.Option(1024, help="Positions kept per KV head per layer (observation window included)."),
    window: int = typer.Option(32, help="Observation window: how many final positions decide what is kept."),
    kernel: int = typer.Option(15, help="Width of the pooling over attention scores (odd)."),
    pooling: str = typer.Option("max", help="Pooling of the scores: max or avg."),
    query_aware: bool = typer.Option(True, "--query-aware/--no-query-aware",
                                     help="Keep the whole prompt's cache and compress per question, with the question as the window."),
    no_compress: bool = typer.Option(False, "--no-compress", help="Keep the full cache (the baseline)."),
    no_store: bool = typer.Option(False, "--no-store",
                                  help="Neither look the document up in the cache store nor save it there."),
    skip_digest: bool = typer.Option(False, "--skip-digest",
                                     help="Do not check a saved cache's payload digest when loading it "
                                          "(faster for very large files; damage then goes unnoticed)."),
    max_new_tokens: int = typer.Option(256, help="Longest answer, in tokens."),
    temperature: float = typer.Option(0.0, help="0 for greedy decoding."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling threshold when temperature > 0."),
    answer_prefix: str = typer.Option("", help="Text that starts each answer (small models follow it well)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", help="auto (bf16 on GPU and on CPUs with bf16 units, else fp32), float32, bfloat16, float16."),
    password: Optional[str] = typer.Option(None, help="Password of an encrypted PDF."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout; progress goes to stderr."),
) -> None:
    """Answer QUESTIONS about SOURCE with one prefill, streaming each answer."""
    settings = None if no_compress else SnapKVConfig(
        budget=budget, window=window, kernel=kernel, pooling=pooling, query_aware=query_aware
    )
    sampling = Sampling(temperature=temperature, top_p=top_p)
    err = Console(stderr=True, highlight=False)
    out = Console(highlight=False, markup=False, emoji=False)

    from_file = source.endswith(SUFFIX)
    with err.status("Reading documents..."):
        started = time.perf_counter()
        document = None if from_file else read_sources(source, password)
        ingest_seconds = time.perf_counter() - started
    with err.status("Loading model..."):
        started = time.perf_counter()
        loaded = load_model(model, device=device, dtype=dtype)
        model_load_seconds = time.perf_counter() - started
    session = Session(loaded, settings, store=None if no_store else CacheStore(), verify=not skip_digest)
    if from_file:
        with err.status("Loading saved cache..."):
            prepared = session.load_file(source)
    else:
        with err.status("Looking up the cache, or prefilling and compressing..."):
            prepared = session.prepare(document)
    document = prepared.document
    if prepared.note:
        err.print("warning: " + prepared.note, markup=False)

    answers = []
    for question in questions:
        stream = session.ask(prepared, question, answer_prefix=answer_prefix,
                             max_new_tokens=max_new_tokens, sampling=sampling)
        if not as_json:
            err.print("Q: " + question, markup=False)
            out.print(answer_prefix, end="", markup=False)
        for piece in stream:
            if not as_json:
                out.print(piece, end="", markup=False)
                out.file.flush()
        if not as_json:
            out.print()
        answers.append(stream.result)

    cache = prepared.cache
    report = {
        "answers": [
            {"question": a.question, "answer": a.text, "new_tokens": a.new_tokens,
             "ttft_seconds": round(a.ttft_seconds, 4),
             "decode_tokens_per_second": round(a.decode_tokens_per_second, 2)}
            for a in answers
        ],
        "document": {"tokens": prepared.tokens,
                     "sources": [s.__dict__ for s in document.sources]},
        "compression": {
            "method": "none" if settings is None else "snapkv",
            "budget": None if settings is None else settings.budget,
            "window": None if settings is None else settings.window,
            "kernel": None if settings is None else settings.kernel,
            "pooling": None if settings is None else settings.pooling,
            "query_aware": bool(settings and settings.query_aware),
            "kept_tokens": cache.kept_tokens if settings is None or not settings.query_aware
            else min(cache.kept_tokens, settings.budget),
            "kv_bytes": cache.kv_bytes,
            "kv_bytes_full": cache.full_kv_bytes(),
        },
        "cache": {"path": str(prepared.path) if prepared.path else None, "hit": prepared.hit,
                  "bytes": prepared.file_bytes, "load_seconds": round(prepared.load_seconds, 4),
                  "save_seconds": round(prepared.save_seconds, 4)},
        "timings": {"model_load_seconds": round(model_load_seconds, 3),
                    "ingest_seconds": round(ingest_seconds, 3),
                    "prefill_seconds": round(prepared.prefill_seconds, 3)},
        "memory": {"peak_bytes": _peak_rss_bytes(), "device": str(loaded.device)},
        "model": {"name": loaded.name, "context_length": loaded.context_length},
    }
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
        return
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_row("document tokens", str(prepared.tokens))
    comp = report["compression"]
    table.add_row("kept per head", f"{comp['kept_tokens']} ({comp['method']})")
    table.add_row("KV memory", f"{_mib(comp['kv_bytes'])} stored, {_mib(comp['kv_bytes_full'])} full")
    if prepared.hit:
        table.add_row("cache", f"hit: loaded {prepared.path} ({_mib(prepared.file_bytes)}) in {prepared.load_seconds:.2f} s")
    else:
        table.add_row("prefill", f"{prepared.prefill_seconds:.2f} s")
        if prepared.path:
            table.add_row("cache", f"saved {prepared.path} ({_mib(prepared.file_bytes)}) in {prepared.save_seconds:.2f} s")
    for a in answers:
        table.add_row("answer", f"first token {a.ttft_seconds:.2f} s, {a.decode_tokens_per_second:.1f} tokens/s")
    table.add_row("peak memory", f"{_mib(report['memory']['peak_bytes'])} RSS")
    err.print(table)
