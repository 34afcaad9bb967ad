"""snapkv ask: answer questions about a document with one prefill, streaming each answer."""

import json
import sys
import time
from contextlib import nullcontext
from typing import Optional

import typer

from snapkv.base.paths import CACHE_SUFFIX

from .options import (DeviceMapOption, DeviceOption, DtypeOption, EngineOption, MaxTokensOption, ModelOption,
                      PasswordOption, SkipDigestOption, SystemOption, TruncateOption, explicit_settings, settings_from,
                      settings_options)


@settings_options()
def ask(
    ctx: typer.Context,
    source: str = typer.Argument(..., metavar="SOURCE", help="A document (.txt, .md, .pdf, .html), a folder of them, - for stdin, "
                                           "or a saved .snapkv cache."),
    questions: Optional[list[str]] = typer.Argument(None, metavar="QUESTION", show_default=False,
                                                    help="One or more questions, answered in turn against one cache."),
    model: ModelOption = None,
    settings_given: dict = None,  # the settings options (snapkv_cli.options.settings_options)
    engine: EngineOption = None,
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
    system: SystemOption = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout; progress goes to stderr."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the answers: no question line, no stats."),
    no_log: bool = typer.Option(False, "--no-log", help="Keep these answers out of `snapkv logs`."),
    no_server: bool = typer.Option(False, "--no-server", help="Run here: use no running server and start none "
                                                              "(SNAPKV_NO_SERVER=1 does the same)."),
    cite: bool = typer.Option(False, "--cite", help="List the passages each answer drew on."),
    continue_: bool = typer.Option(False, "--continue", "-c",
                                   help="Continue the last ask's conversation: every argument is a question."),
) -> None:
    """Answer QUESTIONS about SOURCE, streaming each answer, then show speed and memory.

    The document's cache is looked up in the store (same model, settings and text: loaded, no prefill);
    otherwise it is prefilled, compressed with SnapKV and saved there for the next time. A saved .snapkv
    file is answered as it was made. With no SOURCE, a document piped in is read from stdin.

    The first ask leaves a server that keeps the model loaded (for SNAPKV_KEEP_ALIVE seconds without a
    question, 300; 0 starts none), so that the next ask answers in about a second; `ask -c QUESTION`
    continues the last ask's conversation.
    """
    from . import conversation
    from snapkv.storage.cachemeta import read_metadata
    from snapkv.io.documents import read_sources

    from .consoles import done, inert, source_names, stderr_console, stdout_console, warn, working

    settings = settings_from(**settings_given)
    err, out = stderr_console(), stdout_console()
    earlier: list[tuple[str, str]] = []  # the conversation's turns before this ask's questions
    if continue_:
        questions = [source, *(questions or [])]
        source, earlier = conversation.last_conversation()
    elif not questions:  # as a usage error reads: the argument is optional only for -c
        print("snapkv: error: Missing argument 'QUESTION'. (see snapkv ask --help)", file=sys.stderr)
        raise typer.Exit(2)

    # what can be wrong with the input is found before torch and the model are loaded (a missing file at once)
    from_file = source.endswith(CACHE_SUFFIX)
    started = time.perf_counter()
    with working(err, "Reading documents..."):
        document = None if from_file else read_sources(source, password)
        if from_file:
            read_metadata(source)
    ingest_seconds = time.perf_counter() - started
    code = _run_on_new_server(source, no_server, model, device, dtype, quiet, err)
    if code is not None:  # the server it started read the documents again, and said so
        raise typer.Exit(code)
    if document is not None:
        for note in document.notes:
            warn(err, note)
        done(err, f"read {source_names([s.name for s in document.sources])} in {ingest_seconds:.2f} s")

    from snapkv.engine.generation import Sampling
    from snapkv.session import Session
    from snapkv.storage.remote import open_store

    from .render import (load_file_with_status, load_with_status, log_answers, prepare_with_progress,
                         report, stats_table, stream_answer)

    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
    loaded, model_load_seconds = load_with_status(err, model, device, dtype, device_map)
    session = Session(loaded, settings, store=None if no_store else open_store(), verify=not skip_digest,
                      truncate=truncate, engine=engine, system=system)
    if from_file:
        prepared = load_file_with_status(err, session, source, explicit_settings(ctx))
    else:
        prepared = prepare_with_progress(err, session, document)

    answers = []
    timings = {"model_load_seconds": model_load_seconds, "ingest_seconds": ingest_seconds}
    with working(err, f"Reading the conversation ({len(earlier)} earlier turns)...") if earlier else nullcontext():
        for turn_question, turn_answer in earlier:
            prepared = session.with_turn(prepared, turn_question, turn_answer)
    try:
        for number, question in enumerate(questions, 1):
            if not as_json and not quiet:
                err.print("Q: " + inert(question), markup=False)
            stream_answer(session, prepared, question, answer_prefix=answer_prefix, max_new_tokens=max_new_tokens,
                          sampling=sampling, out=out, err=err, show=not as_json, results=answers, cite=cite)
            if continue_ and number < len(questions) and answers[-1].finish_reason != "interrupted":  # the next sees it
                prepared = session.with_turn(prepared, question, answer_prefix + answers[-1].text)
    finally:  # interrupted answers are logged too, as far as they got
        if not no_log:
            log_answers(err, "ask", report(loaded, prepared, answers, timings))
        _remember(conversation, err, "-" if no_log else source,
                  earlier + [(a.question, answer_prefix + a.text) for a in answers if a.finish_reason != "interrupted"])
    data = report(loaded, prepared, answers, timings)
    if as_json:
        sys.stdout.write(json.dumps(data) + "\n")
    elif not quiet:
        err.print(stats_table(data))


def _remember(conversation, err, source: str, turns: list[tuple[str, str]]) -> None:
    """This conversation is the one `ask -c` continues (none for stdin or --no-log); a failure to write it is said,
    and the answers stand."""
    from snapkv.base.errors import SnapKVError
    from snapkv.logbook import logging_disabled

    from .consoles import warn

    try:
        conversation.remember("-" if logging_disabled() else source, turns)
    except SnapKVError as error:
        warn(err, f"this conversation was not kept for ask -c: {error}")


def _run_on_new_server(source: str, no_server: bool, model: Optional[str], device: str, dtype: str, quiet: bool,
                       err) -> int | None:
    """The first ask leaves a server keeping the model loaded (stopping after SNAPKV_KEEP_ALIVE seconds without
    a request) and runs there, so that the next ask as typed costs a socket round trip; its exit code, or None
    to run here (a server, --no-server, SNAPKV_NO_SERVER=1, SNAPKV_KEEP_ALIVE=0, stdin, or a server that did
    not start)."""
    from . import local_client, local_server
    from .consoles import working

    argv = local_client.COMMAND_LINE.get()
    if (argv is None or local_server.IN_SERVER or no_server or source == "-"
            or local_client.disabled_by_environment()):
        return None
    idle = local_client.keep_alive_seconds()
    if idle == 0:
        return None
    started = time.perf_counter()
    with working(err, "Starting a snapkv server that keeps the model loaded for follow-up questions..."):
        if not local_client.start_in_background(idle, model, device, dtype):
            return None
    if not quiet:
        lasting = f"{idle / 60:g} min" if idle >= 60 else f"{idle:g} s"
        err.print(f"snapkv: started a server in {time.perf_counter() - started:.1f} s; it keeps the model loaded for "
                  f"follow-up questions and stops after {lasting} without one (snapkv serve --stop ends it; "
                  "--no-server or SNAPKV_KEEP_ALIVE=0 runs without it)", markup=False, soft_wrap=True)
    return local_client.run_remotely(argv)
