"""snapkv repl: an interactive session over one loaded cache; each line is a question."""

import dataclasses
import sys
import time
from pathlib import Path
from typing import Iterator

import typer

from snapkv.cachefile import SUFFIX
from snapkv.config import DEFAULTS
from snapkv.documents import read_sources
from snapkv.errors import SnapKVError
from snapkv.generation import Sampling
from snapkv.paths import snapkv_home
from snapkv.session import Session
from snapkv.store import CacheStore

from .ask import stream_answer
from .options import (BudgetOption, DeviceMapOption, DeviceOption, DtypeOption, KernelOption, ModelOption,
                      PasswordOption, PoolingOption, QueryAwareOption, SkipDigestOption, TruncateOption, WindowOption,
                      explicit_settings, settings_from)
from .render import (load_file_with_status, load_with_status, prepare_with_progress, report, stats_table,
                     stderr_console, stdout_console)

HELP = """Type a question and press Enter (end a line with \\ to continue it on the next line).
  /help              this text
  /stats             document, cache and speed figures
  /budget N          positions kept per head from now on (query-aware mode)
  /query-aware on|off  compress per question with the question as the window, or not
  /save FILE         save the loaded cache to FILE (.snapkv)
  /exit              leave (Ctrl-D too). Ctrl-C stops an answer and keeps the session."""


def _terminal_lines() -> Iterator[str]:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    history = snapkv_home() / "repl_history"
    history.parent.mkdir(parents=True, exist_ok=True)
    prompt = PromptSession(history=FileHistory(str(history)))
    while True:
        try:
            yield prompt.prompt("? ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return


def _piped_lines() -> Iterator[str]:
    for line in sys.stdin:
        yield line.rstrip("\n")


def _questions(lines: Iterator[str]) -> Iterator[str]:
    """Join lines ending in a backslash with the next one."""
    pending = ""
    for line in lines:
        if line.endswith("\\"):
            pending += line[:-1] + "\n"
            continue
        yield pending + line
        pending = ""
    if pending:
        yield pending


def repl(
    ctx: typer.Context,
    source: str = typer.Argument(..., help="A document, a folder of them, or a saved .snapkv cache."),
    model: ModelOption = None,
    budget: BudgetOption = DEFAULTS.budget,
    window: WindowOption = DEFAULTS.window,
    kernel: KernelOption = DEFAULTS.kernel,
    pooling: PoolingOption = DEFAULTS.pooling,
    query_aware: QueryAwareOption = DEFAULTS.query_aware,
    no_store: bool = typer.Option(False, "--no-store", help="Neither look up nor save the document's cache."),
    skip_digest: SkipDigestOption = False,
    truncate: TruncateOption = None,
    max_new_tokens: int = typer.Option(256, min=1, help="Longest answer, in tokens."),
    answer_prefix: str = typer.Option("", help="Text that starts each answer."),
    device: DeviceOption = "auto",
    device_map: DeviceMapOption = None,
    dtype: DtypeOption = "auto",
    password: PasswordOption = None,
) -> None:
    """Ask question after question about one document, from one loaded cache.

    With stdin not a terminal, each line of stdin is a question (or a /command), so scripts can drive it.
    """
    err, out = stderr_console(), stdout_console()
    settings = settings_from(budget, window, kernel, pooling, query_aware)
    from_file = source.endswith(SUFFIX)
    document = None if from_file else read_sources(source, password)
    loaded, model_load_seconds = load_with_status(err, model, device, dtype, device_map)
    session = Session(loaded, settings, store=None if no_store else CacheStore(), verify=not skip_digest,
                      truncate=truncate)
    prepared = (load_file_with_status(err, session, source, explicit_settings(ctx)) if from_file
                else prepare_with_progress(err, session, document))
    last_cut = prepared.per_question or settings.cut  # what /query-aware on and /budget start from
    answers = []
    interactive = sys.stdin.isatty()
    err.print(f"{prepared.tokens} tokens ready ({'loaded' if prepared.hit else 'prefilled'}). /help for commands.",
              markup=False)
    for line in _questions(_terminal_lines() if interactive else _piped_lines()):
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command, _, argument = line.partition(" ")
            argument = argument.strip()
            try:
                if command in ("/exit", "/quit"):
                    break
                elif command == "/help":
                    err.print(HELP, markup=False)
                elif command == "/stats":
                    err.print(stats_table(report(loaded, prepared, answers, {"model_load_seconds": model_load_seconds})))
                elif command == "/budget":
                    last_cut = dataclasses.replace(last_cut, budget=int(argument))
                    prepared = prepared.answering_with(last_cut)
                    err.print(f"budget {last_cut.budget} (query-aware on)", markup=False)
                elif command == "/query-aware":
                    if argument not in ("on", "off"):
                        raise ValueError("say /query-aware on or /query-aware off")
                    prepared = prepared.answering_with(last_cut if argument == "on" else None)
                    err.print(f"query-aware {argument}", markup=False)
                elif command == "/save":
                    if not argument.endswith(SUFFIX):
                        raise ValueError(f"the file name must end in {SUFFIX}")
                    session.save(prepared, Path(argument))
                    err.print(f"saved {argument} ({prepared.file_bytes / 2**20:.1f} MiB)", markup=False)
                else:
                    err.print(f"unknown command {command}; /help lists them", markup=False)
            except (ValueError, SnapKVError) as error:
                err.print(f"error: {error}", markup=False)
            continue
        started = time.perf_counter()
        try:
            answers.append(stream_answer(session, prepared, line, answer_prefix=answer_prefix,
                                         max_new_tokens=max_new_tokens, sampling=Sampling(), out=out, show=True))
        except KeyboardInterrupt:
            out.print()
            err.print(f"[answer stopped after {time.perf_counter() - started:.1f} s; the cache is unchanged]",
                      markup=False)
    if not interactive and answers:
        err.print(stats_table(report(loaded, prepared, answers, {"model_load_seconds": model_load_seconds})))
