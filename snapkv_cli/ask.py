"""snapkv ask: answer questions about a document with one prefill, streaming each answer."""

import json
import sys
import time
from typing import Optional

import typer

from snapkv.config import DEFAULTS
from snapkv.paths import CACHE_SUFFIX

from .options import (BudgetOption, CompileOption, DeviceMapOption, DeviceOption, DtypeOption, KernelOption,
                      MaxTokensOption, ModelOption, NoCompressOption, PasswordOption, PoolingOption, PrefillChunkOption,
                      QueryAwareOption, SkipDigestOption, StoreBitsOption, StoreBudgetOption, StoreKeepOption,
                      StoreMethodOption, TruncateOption, WindowOption, explicit_settings, settings_from)


def ask(
    ctx: typer.Context,
    source: str = typer.Argument(..., metavar="SOURCE", help="A document (.txt, .md, .pdf, .html), a folder of them, - for stdin, "
                                           "or a saved .snapkv cache."),
    questions: list[str] = typer.Argument(..., metavar="QUESTION", help="One or more questions, answered in turn against one cache."),
    model: ModelOption = None,
    budget: BudgetOption = DEFAULTS.budget,
    window: WindowOption = DEFAULTS.window,
    kernel: KernelOption = DEFAULTS.kernel,
    pooling: PoolingOption = DEFAULTS.pooling,
    query_aware: QueryAwareOption = DEFAULTS.query_aware,
    store_keep: StoreKeepOption = DEFAULTS.store_keep,
    store_method: StoreMethodOption = DEFAULTS.store_method,
    store_bits: StoreBitsOption = DEFAULTS.store_bits,
    prefill_chunk: PrefillChunkOption = None,
    compile: CompileOption = False,
    store_budget: StoreBudgetOption = DEFAULTS.store_budget,
    no_compress: NoCompressOption = False,
    no_store: bool = typer.Option(False, "--no-store",
                                  help="Neither look the document up in the cache store nor save it there."),
    skip_digest: SkipDigestOption = False,
    truncate: TruncateOption = None,
    max_new_tokens: MaxTokensOption = 256,
    temperature: float = typer.Option(0.0, min=0.0, help="0 for greedy decoding."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling threshold when temperature > 0."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    answer_prefix: str = typer.Option("", help="Text that starts each answer (small models follow it well)."),
    device: DeviceOption = "auto",
    device_map: DeviceMapOption = None,
    dtype: DtypeOption = "auto",
    password: PasswordOption = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout; progress goes to stderr."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the answers: no question line, no stats."),
    no_log: bool = typer.Option(False, "--no-log", help="Keep these answers out of the log (`snapkv logs`); "
                                                        "SNAPKV_NOLOG=1 does the same."),
    no_server: bool = typer.Option(False, "--no-server", help="Run here even when `snapkv serve` is running "
                                                              "(SNAPKV_NO_SERVER=1 does the same)."),
) -> None:
    """Answer QUESTIONS about SOURCE, streaming each answer, then show speed and memory.

    The document's cache is looked up in the store (same model, settings and text: loaded, no prefill);
    otherwise it is prefilled, compressed with SnapKV and saved there for the next time. A saved .snapkv
    file is answered as it was made; settings given with it apply where the file can serve them (a smaller
    --budget) and are refused, saying what it holds, where it cannot.
    """
    from snapkv.cachemeta import read_metadata
    from snapkv.documents import read_sources

    from .consoles import stderr_console, stdout_console

    settings = settings_from(budget, window, kernel, pooling, query_aware, no_compress, store_budget, store_keep,
                             store_method, store_bits, prefill_chunk)
    err, out = stderr_console(), stdout_console()

    # what can be wrong with the input is found before torch and the model are loaded (a missing file at once)
    from_file = source.endswith(CACHE_SUFFIX)
    started = time.perf_counter()
    with err.status("Reading documents..."):
        document = None if from_file else read_sources(source, password)
        if from_file:
            read_metadata(source)
    ingest_seconds = time.perf_counter() - started

    from snapkv.generation import Sampling
    from snapkv.session import Session
    from snapkv.store import CacheStore

    from .render import (inert, load_file_with_status, load_with_status, log_answers, prepare_with_progress,
                         report, stats_table, stream_answer)

    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
    loaded, model_load_seconds = load_with_status(err, model, device, dtype, device_map)
    session = Session(loaded, settings, store=None if no_store else CacheStore(), verify=not skip_digest,
                      truncate=truncate, compile=compile)
    if from_file:
        prepared = load_file_with_status(err, session, source, explicit_settings(ctx))
    else:
        prepared = prepare_with_progress(err, session, document)

    answers = []
    timings = {"model_load_seconds": model_load_seconds, "ingest_seconds": ingest_seconds}
    try:
        for question in questions:
            if not as_json and not quiet:
                err.print("Q: " + inert(question), markup=False)
            stream_answer(session, prepared, question, answer_prefix=answer_prefix, max_new_tokens=max_new_tokens,
                          sampling=sampling, out=out, err=err, show=not as_json, results=answers)
    finally:  # interrupted answers are logged too, as far as they got
        if not no_log:
            log_answers(err, "ask", report(loaded, prepared, answers, timings))
    data = report(loaded, prepared, answers, timings)
    if as_json:
        sys.stdout.write(json.dumps(data) + "\n")
    elif not quiet:
        err.print(stats_table(data))
