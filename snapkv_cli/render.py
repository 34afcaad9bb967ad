"""What the commands show: consoles, progress while loading and prefilling, the stats panel, the JSON report.

Everything shown is computed from what the library returns (a PreparedDocument, AnswerResults); nothing
is read off a session.
"""

import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from snapkv.engine.memory import process_peak_bytes
from snapkv.engine.models import LoadedModel, load_model
from snapkv.engine.generation import Sampling
from snapkv.session import AnswerResult, PreparedDocument, Session

from .consoles import (SCHEMA_VERSION, done, inert, source_names, stderr_console,  # noqa: F401 (re-exported)
                       stdout_console, warn, working)


def pyplot():
    """matplotlib's pyplot on a file-only backend, or a usage error naming the extra to install."""
    from snapkv.base.errors import ConfigError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ConfigError('plots need matplotlib: pip install -e ".[plot]"') from error
    return plt


def load_with_status(err: Console, model: str | None, device: str, dtype: str,
                     device_map: str | None = None) -> tuple[LoadedModel, float]:
    """The model, with a spinner while it loads and one progress bar of ours the first time a GGUF file is prepared
    (the embedded model converted, another's config and tokenizer read); off a terminal, a line for each."""
    from snapkv.engine.models import MODEL_POOL

    live = err.is_terminal
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err,
                        transient=True)
    task, converting_since = None, None

    def on_convert(done_parts: int, total: int) -> None:
        nonlocal task, converting_since
        if converting_since is None:
            converting_since = time.perf_counter()
            done(err, "preparing the model once: the embedded one converted to safetensors, a GGUF file's config "
                      "and tokenizer read (about 30 s; later loads take seconds)")
        if live and task is None:
            status.stop()
            progress.start()
            task = progress.add_task("Preparing the model once (about 30 s; later loads take seconds)", total=total)
        if live:
            progress.update(task, completed=done_parts, total=total)
        elif done_parts == total:
            done(err, f"prepared the model in {time.perf_counter() - converting_since:.1f} s")

    status = err.status("Loading model...")
    if live:
        status.start()
    started = time.perf_counter()
    try:
        loader = MODEL_POOL.get if MODEL_POOL is not None else load_model
        loaded = loader(model, device=device, dtype=dtype, device_map=device_map, on_convert=on_convert)
    finally:
        if live:
            status.stop()
            progress.stop()
    seconds = time.perf_counter() - started
    done(err, f"loaded {loaded.name} ({loaded.device}, {loaded.precision}) in {seconds:.1f} s")
    return loaded, seconds


@contextmanager
def prefill_progress(err: Console, tokens: int, scoring: str | None = None):
    """Progress bars for a prefill (per layer, with tokens/s) and, where the stored tier is chosen after it,
    for its scoring passes; yields the (on_layer, on_step) callbacks for Session.prepare. Off a terminal, a
    line when the prefill starts and one when the scoring does."""
    live = err.is_terminal
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[unit]}"),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err, transient=True)
    tasks: dict[str, int] = {}
    started = time.perf_counter()

    def on_layer(done_parts: int, total: int) -> None:
        if "prefill" not in tasks:
            tasks["prefill"] = progress.add_task(f"Prefilling {tokens} tokens", total=total, unit="", rate="")
            done(err, f"prefilling {tokens} tokens")
        elapsed = time.perf_counter() - started
        unit = "tokens" if total == tokens else "layer"  # a prefill in chunks reports tokens, an exact one layers
        progress.update(tasks["prefill"], completed=done_parts, unit=f"{unit} {done_parts}/{total}",
                        rate=f"{tokens * done_parts / total / max(elapsed, 1e-9):,.0f} tokens/s")

    def on_step(done_parts: int, total: int) -> None:
        if "scoring" not in tasks:
            tasks["scoring"] = progress.add_task(f"Choosing the stored tier ({scoring})", total=total, unit="", rate="")
            done(err, f"choosing the stored tier ({scoring})")
        progress.update(tasks["scoring"], completed=done_parts, total=total, unit=f"pass {done_parts}/{total}")

    if not live:
        yield on_layer, on_step
        return
    with progress:
        yield on_layer, on_step


def scoring_label(settings) -> str | None:
    """What the passes after the prefill choose: the stored tier's positions, its sharper share, or both."""
    if settings is None:
        return None
    parts = [str(settings.store_method)] if settings.stored_tier is not None else []
    if settings.store_bits.share:
        parts.append(f"the {round(settings.store_bits.share * 100)}% kept in {settings.store_bits.sharper}-bit")
    return ", then ".join(parts) or None


def prepare_with_progress(err: Console, session: Session, document) -> PreparedDocument:
    """The document's cache (a store hit or a prefill with a progress bar), warnings shown."""
    prompt = session.prompt(document)
    if prompt.truncation:
        warn(err, f"the document was cut by {prompt.truncation.tokens} tokens ({prompt.truncation.side}) "
                  "to fit the model's context")
    with prefill_progress(err, prompt.tokens, scoring_label(session.settings)) as (on_layer, on_step):
        prepared = session.prepare(prompt, on_layer=on_layer, on_step=on_step)
    for note in prepared.notes:
        warn(err, note)
    if prepared.hit:
        done(err, f"found the document's cache in the store, loaded in {prepared.load_seconds:.2f} s")
    elif prepared.prefix_tokens:
        saved = f"; saved in {prepared.save_seconds:.2f} s" if prepared.path else ""
        done(err, f"reused the first {prepared.prefix_tokens} of {prepared.tokens} tokens from a saved cache "
                  f"(loaded in {prepared.load_seconds:.2f} s), prefilled the other "
                  f"{prepared.tokens - prepared.prefix_tokens} in {prepared.prefill_seconds:.1f} s{saved}")
    else:
        scoring = f" ({prepared.tier_seconds:.1f} s of it choosing the stored tier)" if prepared.tier_seconds >= 0.05 else ""
        saved = f"; saved in {prepared.save_seconds:.2f} s" if prepared.path else ""
        done(err, f"prefilled {prepared.tokens} tokens in {prepared.prefill_seconds:.1f} s{scoring}{saved}")
    return prepared


def load_file_with_status(err: Console, session: Session, path: str,
                          explicit: frozenset[str] = frozenset()) -> PreparedDocument:
    """A saved .snapkv cache, answered as the file says or as `explicit` settings ask; warnings shown."""
    with working(err, "Loading saved cache..."):
        prepared = session.load_file(path, explicit=explicit)
    for note in prepared.notes:
        warn(err, note)
    done(err, f"loaded the saved cache in {prepared.load_seconds:.2f} s")
    return prepared


def report(loaded: LoadedModel, prepared: PreparedDocument, answers: list[AnswerResult], timings: dict) -> dict:
    """The --json object (and what the stats panel shows)."""
    cache, cut = prepared.cache, prepared.per_question or prepared.tier.cut
    truncation = prepared.tier.truncation
    return {
        "schema_version": SCHEMA_VERSION,
        "answers": [
            {"question": a.question, "answer": a.text, "new_tokens": a.new_tokens, "finish_reason": a.finish_reason,
             "ttft_seconds": round(a.ttft_seconds, 4), "decode_tokens_per_second": round(a.decode_tokens_per_second, 2),
             "kv_read_bytes": a.kv_bytes,  # the keys and values each of its tokens read: the cut, the turns
             "engine": a.engine.as_json(),
             **({} if a.citations is None else {"citations": [c.to_dict() for c in a.citations],
                                                "cite_seconds": round(a.cite_seconds, 4)})}
            for a in answers
        ],
        # what ran the last answer: the engine of its steps (snapkv.engine.engines) and the C kernels' variant
        "engine": answers[-1].engine.as_json() if answers else None,
        "document": {"tokens": prepared.tokens - prepared.turn_tokens,
                     "truncated_tokens": truncation.tokens if truncation else 0,
                     "sources": [asdict(s) for s in prepared.document.sources]},
        # the earlier turns of a conversation the answers saw, appended after the document (not in its tokens)
        "conversation": {"turns": prepared.turns, "tokens": prepared.turn_tokens},
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
            "stored_kv_bytes": prepared.stored_kv_bytes,       # the document's, as its file holds them
            "kv_bytes_full": cache.full_kv_bytes(),            # in the compute dtype, as kv_bytes
            # the document's full cache (its turns left out) as a 16-bit file would hold it
            "kv_bytes_full_16bit": cache.full_kv_bytes(2) * (prepared.tokens - prepared.turn_tokens) // prepared.tokens,
            "kv_dtype": str(cache.compute_dtype).replace("torch.", ""),
        },
        "cache": {"path": os.path.abspath(prepared.path) if prepared.path else None, "hit": prepared.hit,
                  "reused_tokens": prepared.reused_tokens,  # all on a hit, a saved cache's shared prefix, or 0
                  "bytes": prepared.file_bytes, "load_seconds": round(prepared.load_seconds, 4),
                  "save_seconds": round(prepared.save_seconds, 4)},
        "timings": {k: round(v, 4) for k, v in {**timings, "prefill_seconds": prepared.prefill_seconds}.items()},
        "memory": {"peak_bytes": process_peak_bytes(loaded.device), "device": str(loaded.device),
                   # per phase: CUDA max allocated (weights included) / CPU RSS growth during the phase
                   "prefill_peak_bytes": prepared.prefill_peak_bytes,
                   "answer_peak_bytes": max((a.peak_bytes for a in answers), default=0)},
        "model": {"name": loaded.name, "context_length": loaded.context_length,
                  "precision": loaded.precision,  # "float32", or "float32 weights, bfloat16 prefill"
                  "weights": loaded.weights},  # how decoding reads them: 4/8-bit blocks, bf16-held, as loaded
    }


DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"


def stats_table(data: dict) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column(overflow="fold")
    comp, cache = data["compression"], data["cache"]
    sources = [source["name"] for source in data["document"]["sources"]]
    table.add_row("document", f"{data['document']['tokens']} tokens"
                              + (f" from {source_names(sources)}" if sources else ""))
    document_tokens = data["document"]["tokens"]
    conversation = data.get("conversation") or {"turns": 0, "tokens": 0}
    held = document_tokens + conversation["tokens"]  # what an answer may read: the document, then the turns
    of_what = (f"the document's {document_tokens} tokens and the conversation's {conversation['turns']} turns "
               f"({conversation['tokens']} tokens)" if conversation["turns"] else f"the document's {document_tokens}")
    if comp["mode"] == "full":
        table.add_row("kept", f"everything (full cache): {of_what}")
    elif comp["kept_tokens"] >= held:
        table.add_row("kept", f"everything: {of_what} fit the budget ({comp['mode']})")
    else:
        table.add_row("kept", f"{comp['kept_tokens']} per head per layer, {held / comp['kept_tokens']:.1f}x fewer than "
                              f"{of_what} ({comp['mode']})")
    dtype = DTYPE_NAMES.get(comp["kv_dtype"], comp["kv_dtype"])
    read = [answer["kv_read_bytes"] for answer in data["answers"] if answer.get("kv_read_bytes")]
    if read:
        table.add_row("KV read", f"{_mib(read[-1])} per answer token ({dtype}), what the last answer decoded against")
    bits = comp["stored_tier"].get("bits", 16)
    table.add_row("stored", f"{_mib(comp['stored_kv_bytes'])} of keys and values ({bits}-bit) for the document; its "
                            f"full cache {_mib(comp['kv_bytes_full_16bit'])} at 16 bits")
    if cache["hit"]:
        table.add_row("cache", f"hit, loaded in {cache['load_seconds']:.2f} s: {cache['path']} ({_mib(cache['bytes'])})")
    else:
        reused = cache.get("reused_tokens") or 0
        table.add_row("prefill", f"{data['timings']['prefill_seconds']:.2f} s" + (
            f", of the {document_tokens - reused} tokens after the first {reused}, reused from a saved cache"
            if reused else ""))
        if cache["path"]:
            table.add_row("cache", f"saved in {cache['save_seconds']:.2f} s: {cache['path']} ({_mib(cache['bytes'])})")
    for answer in data["answers"]:
        ended = {"stop": "", "length": ", stopped at the token limit", "interrupted": ", interrupted"}
        cited = f", sources found in {answer['cite_seconds']:.2f} s" if "cite_seconds" in answer else ""
        table.add_row("answer", f"first token {answer['ttft_seconds']:.2f} s, "
                                f"{answer['decode_tokens_per_second']:.1f} tokens/s, {answer['new_tokens']} tokens"
                                f"{ended.get(answer['finish_reason'], '')}{cited}")
    if data.get("engine"):
        engine = data["engine"]
        kernels = f", {engine['kernels']} kernels" if engine["kernels"] else ", no C kernels"
        table.add_row("engine", f"{engine['name']}{kernels}")
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


CITED_CHARACTERS = 160  # of a cited passage shown on the terminal (--json has it whole)


def print_citations(out: Console, citations: list) -> None:
    """The passages an answer drew on, one line each: where, then the passage's start."""
    if not citations:
        out.print("Sources: none found (the answer is empty or the document has no text to cite)", style="dim",
                  markup=False)
        return
    out.print("Sources:", style="dim", markup=False)
    for number, citation in enumerate(citations, 1):
        text = citation.text if len(citation.text) <= CITED_CHARACTERS else citation.text[:CITED_CHARACTERS - 3] + "..."
        out.print(f"  [{number}] {citation.where()}: \"{text}\" ({citation.score:.0%} of the answer's attention)",
                  markup=False, highlight=False, soft_wrap=True)


def stream_answer(session: Session, prepared: PreparedDocument, question: str, *, answer_prefix: str,
                  max_new_tokens: int, sampling: Sampling, out: Console, err: Console, show: bool,
                  results: list[AnswerResult], cite: bool = False) -> AnswerResult:
    """Generate one answer, printing it as it comes when `show` (a spinner on stderr until its first token);
    its numbers are appended to `results`, an interrupted answer's too, before the interrupt goes on.
    cite: find the passages a finished answer drew on (its result's citations), printed after it when `show`."""
    stream = session.ask(prepared, question, answer_prefix=answer_prefix,
                         max_new_tokens=max_new_tokens, sampling=sampling)
    spinner = err.status("Thinking...") if show and err.is_terminal else None
    if spinner:
        spinner.start()
    started = False  # the answer's first piece was shown, after the prefix
    try:
        for piece in stream:
            if show and not started:
                if spinner:
                    spinner.stop()
                    spinner = None
                out.print(inert(answer_prefix), end="")
                started = True
            if show:
                out.print(inert(piece), end="")
                out.file.flush()
        if spinner:
            spinner.stop()
            spinner = None
        if show and not started:  # an answer with no text at all
            out.print(inert(answer_prefix), end="")
        if show:
            out.print()
        if cite:
            with err.status("Finding the passages it drew on...") if show and err.is_terminal else nullcontext():
                citations = session.cite(prepared, stream)
            if show:
                print_citations(out, citations)
    finally:
        if spinner:
            spinner.stop()
        if stream.result is not None:
            results.append(stream.result)
    return stream.result


def log_answers(err: Console, command: str, data: dict) -> None:
    """Append the answers of a report to the log (`snapkv logs`), unless SNAPKV_NOLOG is set; a log that cannot
    be written is a warning, never a failure."""
    import sqlite3

    from snapkv.logbook import Logbook, logging_disabled

    if logging_disabled() or not data["answers"]:
        return
    try:
        Logbook().record(command, data)
    except (OSError, sqlite3.Error) as error:
        warn(err, f"the answer was not logged ({error}); SNAPKV_NOLOG=1 turns the log off")
