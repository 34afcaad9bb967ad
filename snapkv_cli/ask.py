"""snapkv ask: answer questions about a document with one prefill, streaming each answer."""

import json
import sys
import time
from typing import Optional

import typer

from snapkv.cachefile import SUFFIX
from snapkv.config import DEFAULTS
from snapkv.documents import read_sources
from snapkv.generation import Sampling
from snapkv.session import AnswerResult, PreparedDocument, Session
from snapkv.store import CacheStore

from .options import (BudgetOption, DeviceMapOption, DeviceOption, DtypeOption, KernelOption, ModelOption,
                      NoCompressOption, PasswordOption, PoolingOption, QueryAwareOption, SkipDigestOption,
                      StoreBudgetOption, TruncateOption, WindowOption, explicit_settings, settings_from)
from .render import (inert, load_file_with_status, load_with_status, prepare_with_progress, report, stats_table,
                     stderr_console, stdout_console)


def stream_answer(session: Session, prepared: PreparedDocument, question: str, *, answer_prefix: str,
                  max_new_tokens: int, sampling: Sampling, out, show: bool) -> AnswerResult:
    """Generate one answer, printing it as it comes when `show`; returns its numbers."""
    stream = session.ask(prepared, question, answer_prefix=answer_prefix,
                         max_new_tokens=max_new_tokens, sampling=sampling)
    if show:
        out.print(inert(answer_prefix), end="")
    for piece in stream:
        if show:
            out.print(inert(piece), end="")
            out.file.flush()
    if show:
        out.print()
    return stream.result


def ask(
    ctx: typer.Context,
    source: str = typer.Argument(..., help="A document (.txt, .md, .pdf, .html), a folder of them, - for stdin, "
                                           "or a saved .snapkv cache."),
    questions: list[str] = typer.Argument(..., help="One or more questions, answered in turn against one cache."),
    model: ModelOption = None,
    budget: BudgetOption = DEFAULTS.budget,
    window: WindowOption = DEFAULTS.window,
    kernel: KernelOption = DEFAULTS.kernel,
    pooling: PoolingOption = DEFAULTS.pooling,
    query_aware: QueryAwareOption = DEFAULTS.query_aware,
    store_budget: StoreBudgetOption = DEFAULTS.store_budget,
    no_compress: NoCompressOption = False,
    no_store: bool = typer.Option(False, "--no-store",
                                  help="Neither look the document up in the cache store nor save it there."),
    skip_digest: SkipDigestOption = False,
    truncate: TruncateOption = None,
    max_new_tokens: int = typer.Option(256, min=1, help="Longest answer, in tokens."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 for greedy decoding."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling threshold when temperature > 0."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    answer_prefix: str = typer.Option("", help="Text that starts each answer (small models follow it well)."),
    device: DeviceOption = "auto",
    device_map: DeviceMapOption = None,
    dtype: DtypeOption = "auto",
    password: PasswordOption = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout; progress goes to stderr."),
) -> None:
    """Answer QUESTIONS about SOURCE, streaming each answer, then show speed and memory.

    The document's cache is looked up in the store (same model, settings and text: loaded, no prefill);
    otherwise it is prefilled, compressed with SnapKV and saved there for the next time. A saved .snapkv
    file is answered as it was made; settings given with it apply where the file can serve them (a smaller
    --budget) and are refused, saying what it holds, where it cannot.
    """
    settings = settings_from(budget, window, kernel, pooling, query_aware, no_compress, store_budget)
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
    err, out = stderr_console(), stdout_console()

    from_file = source.endswith(SUFFIX)
    started = time.perf_counter()
    with err.status("Reading documents..."):
        document = None if from_file else read_sources(source, password)
    ingest_seconds = time.perf_counter() - started
    loaded, model_load_seconds = load_with_status(err, model, device, dtype, device_map)
    session = Session(loaded, settings, store=None if no_store else CacheStore(), verify=not skip_digest,
                      truncate=truncate)
    if from_file:
        prepared = load_file_with_status(err, session, source, explicit_settings(ctx))
    else:
        prepared = prepare_with_progress(err, session, document)

    answers = []
    for question in questions:
        if not as_json:
            err.print("Q: " + inert(question), markup=False)
        answers.append(stream_answer(session, prepared, question, answer_prefix=answer_prefix,
                                     max_new_tokens=max_new_tokens, sampling=sampling, out=out, show=not as_json))
    data = report(loaded, prepared, answers, {"model_load_seconds": model_load_seconds,
                                              "ingest_seconds": ingest_seconds})
    if as_json:
        sys.stdout.write(json.dumps(data) + "\n")
    else:
        err.print(stats_table(data))
