"""snapkv repl: an interactive session over one loaded cache; each line is a question or a /command."""

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import typer

from snapkv.base.errors import SnapKVError
from snapkv.base.paths import CACHE_SUFFIX as SUFFIX

from .options import (DeviceMapOption, DeviceOption, DtypeOption, EngineOption, MaxTokensOption, ModelOption,
                      PasswordOption, SETTINGS_OPTIONS, SkipDigestOption, SystemOption, TruncateOption,
                      explicit_settings, settings_from, settings_options)

HELP = """Type a question and press Enter (end a line with \\ to continue it on the next line). Each question
sees the earlier questions and answers of the conversation; /clear starts a new one.
  /help                 this text
  /show                 the settings in use
  /set NAME VALUE       change one: budget, temperature, top-p, seed, max-tokens
  /budget N             the same as /set budget N (turns query-aware on)
  /query-aware on|off   cut the cache per question with the question as the window, or answer from all of it
  /cite on|off          after each answer, list the passages of the document it drew on (file, page, line)
  /stats                document, cache and speed figures of the last answer
  /save NAME            save the document's cache to NAME (.snapkv is added when missing; not the conversation)
  /load SOURCE          answer from another document, folder or saved .snapkv cache
  /clear                forget the conversation (later questions no longer see earlier answers), clear the screen
  /exit                 leave (Ctrl-D too). Ctrl-C stops an answer and keeps the session.
Tab completes the commands; each answer is logged as it is given (`snapkv logs`), with the input history."""
COMMANDS = ("/help", "/show", "/set", "/budget", "/query-aware", "/cite", "/stats", "/save", "/load", "/clear", "/exit",
            "/quit")
SETTABLE = ("budget", "temperature", "top-p", "seed", "max-tokens")


class ReplError(Exception):
    """A /command that cannot be done, told in a friendly line."""


def _history():
    """prompt_toolkit history kept in the log's SQLite file (nothing kept with SNAPKV_NOLOG)."""
    from prompt_toolkit.history import History, InMemoryHistory

    from snapkv.logbook import Logbook, logging_disabled

    if logging_disabled():
        return InMemoryHistory()

    class LogbookHistory(History):
        def load_history_strings(self):
            return reversed(Logbook().history())  # newest first, as prompt_toolkit wants them

        def store_string(self, string: str) -> None:
            Logbook().add_history(string)

    return LogbookHistory()


def _terminal_lines() -> Iterator[str]:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.completion import WordCompleter

    completer = WordCompleter([*COMMANDS, *SETTABLE, "on", "off"], sentence=True)
    prompt = PromptSession(history=_history(), completer=completer, complete_while_typing=False)
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


def _number(name: str, value: str, kind=float, low: float | None = None, high: float | None = None):
    try:
        number = kind(value)
    except ValueError:
        raise ReplError(f"{name} takes {'a whole number' if kind is int else 'a number'}, not {value!r}") from None
    if (low is not None and number < low) or (high is not None and number > high):
        bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ReplError(f"{name} must be {bounds}, not {value}")
    return number


@dataclasses.dataclass
class _State:
    """What the session's answers are made with; /set and /budget change it."""

    prepared: object         # the document's cache with the conversation's finished turns appended
    last_cut: object
    sampling: object
    max_new_tokens: int
    document: object = None  # the document's cache alone: what /clear goes back to, what /save saves
    cite: bool = False       # each answer's passages listed after it (/cite, --cite)

    def __post_init__(self) -> None:
        self.document = self.document or self.prepared

    def without_conversation(self):
        """The document's cache answered as the conversation's is (the same per-question cut)."""
        return self.document.answering_with(self.prepared.per_question)

    def set(self, name: str, value: str) -> str:
        if name == "budget":
            from snapkv.base.sizes import parse_size

            try:
                budget = parse_size(value, name="budget")
                self.last_cut = dataclasses.replace(self.last_cut, budget=budget)
            except SnapKVError as error:
                raise ReplError(str(error)) from None
            self.prepared = self.prepared.answering_with(self.last_cut)
            return f"budget {self.last_cut.budget} (query-aware on)"
        if name == "temperature":
            self.sampling = dataclasses.replace(self.sampling, temperature=_number(name, value, low=0.0))
        elif name == "top-p":
            self.sampling = dataclasses.replace(self.sampling, top_p=_number(name, value, low=0.0, high=1.0))
        elif name == "seed":
            self.sampling = dataclasses.replace(self.sampling, seed=None if value == "none" else
                                                _number(name, value, int, low=0))
        elif name == "max-tokens":
            self.max_new_tokens = _number(name, value, int, low=1)
        else:
            raise ReplError(f"/set knows {', '.join(SETTABLE)}; not {name!r}")
        return f"{name} {value}"

    def show(self) -> str:
        prepared, sampling = self.prepared, self.sampling
        cut = prepared.per_question
        return "\n".join([
            f"mode         {prepared.mode}",
            f"holds        {prepared.tier.describe()} ({prepared.cache.kept_tokens} positions per head)",
            f"per question {cut.describe() if cut else 'none: answers use all it holds'}",
            f"sampling     {'greedy' if sampling.temperature <= 0 else f'temperature {sampling.temperature}'}, "
            f"top-p {sampling.top_p}, seed {sampling.seed}",
            f"max-tokens   {self.max_new_tokens}",
            f"cite         {'on: the passages each answer drew on are listed' if self.cite else 'off'}",
            f"conversation {prepared.turns} earlier turn{'s' if prepared.turns != 1 else ''} "
            f"({prepared.turn_tokens} tokens; /clear forgets them)",
        ])


@settings_options(*(name for name in SETTINGS_OPTIONS if name != "no_compress"))
def repl(
    ctx: typer.Context,
    source: str = typer.Argument(..., metavar="SOURCE", help="A document, a folder of them, or a saved .snapkv cache."),
    model: ModelOption = None,
    settings_given: dict = None,  # the settings options (snapkv_cli.options.settings_options)
    engine: EngineOption = None,
    no_store: bool = typer.Option(False, "--no-store", help="Neither look up nor save the document's cache."),
    skip_digest: SkipDigestOption = False,
    truncate: TruncateOption = None,
    max_new_tokens: MaxTokensOption = 256,
    temperature: float = typer.Option(0.0, min=0.0, help="0 for greedy decoding."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling threshold when temperature > 0."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    answer_prefix: str = typer.Option("", help="Text that starts each answer."),
    device: DeviceOption = "auto",
    device_map: DeviceMapOption = None,
    dtype: DtypeOption = "auto",
    password: PasswordOption = None,
    system: SystemOption = None,
    cite: bool = typer.Option(False, "--cite", help="After each answer, list the passages of the document it "
                                                    "drew on (/cite on|off changes it)."),
    as_json: bool = typer.Option(False, "--json", help="Print each answer as one JSON line on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No greeting and no stats at the end."),
    no_log: bool = typer.Option(False, "--no-log", help="Keep this session's answers out of the log."),
) -> None:
    """Ask question after question about one document, from one loaded cache.

    With stdin not a terminal, each line of stdin is a question (or a /command), so scripts can drive it;
    the exit code is then 2 if any /command failed.
    """
    from snapkv.storage.cachemeta import read_metadata
    from snapkv.io.documents import read_sources

    from .consoles import stderr_console, stdout_console, warn

    err, out = stderr_console(), stdout_console()
    settings = settings_from(**settings_given)

    def open_source(spec: str, explicit: frozenset[str] = frozenset(), document=None):
        """A document's cache (from the store or a prefill) or a saved file's, warnings shown; `document`: the
        source already read."""
        if spec.endswith(SUFFIX):
            return load_file_with_status(err, session, spec, explicit)
        document = document or read_sources(spec, password)
        for note in document.notes:
            warn(err, note)
        return prepare_with_progress(err, session, document)

    from_file = source.endswith(SUFFIX)
    document = None  # a missing or unreadable input is reported before torch and the model load
    if from_file:
        read_metadata(source)
    else:
        document = read_sources(source, password)

    from snapkv.engine.generation import Sampling
    from snapkv.session import Session
    from snapkv.storage.remote import open_store

    from .render import (load_file_with_status, load_with_status, log_answers, prepare_with_progress, report,
                         stats_table, stream_answer)

    loaded, model_load_seconds = load_with_status(err, model, device, dtype, device_map)
    session = Session(loaded, settings, store=None if no_store else open_store(), verify=not skip_digest,
                      truncate=truncate, engine=engine, system=system)
    prepared = open_source(source, explicit_settings(ctx) if from_file else frozenset(), document)
    state = _State(prepared, prepared.per_question or settings.cut,
                   Sampling(temperature=temperature, top_p=top_p, seed=seed), max_new_tokens, cite=cite)
    timings = {"model_load_seconds": model_load_seconds}
    answers, failures = [], 0
    last = None  # the report of the last answer (what /stats shows)
    interactive = sys.stdin.isatty()
    if not quiet:
        err.print(f"{prepared.tokens} tokens ready ({'loaded' if prepared.hit or from_file else 'prefilled'}). "
                  "/help for commands.", markup=False)
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
                elif command == "/show":
                    err.print(state.show(), markup=False)
                elif command == "/stats":
                    err.print(stats_table(last or report(loaded, state.prepared, [], timings)))
                elif command == "/set":
                    name, _, value = argument.partition(" ")
                    if not value.strip():
                        raise ReplError(f"say /set NAME VALUE, NAME one of {', '.join(SETTABLE)}")
                    err.print(state.set(name, value.strip()), markup=False)
                elif command == "/budget":
                    err.print(state.set("budget", argument), markup=False)
                elif command == "/query-aware":
                    if argument not in ("on", "off"):
                        raise ReplError("say /query-aware on or /query-aware off")
                    state.prepared = state.prepared.answering_with(state.last_cut if argument == "on" else None)
                    err.print(f"query-aware {argument}", markup=False)
                elif command == "/cite":
                    if argument not in ("on", "off"):
                        raise ReplError("say /cite on or /cite off")
                    state.cite = argument == "on"
                    err.print(f"cite {argument}", markup=False)
                elif command == "/save":
                    if not argument:
                        raise ReplError("say /save NAME")
                    path = Path(argument if argument.endswith(SUFFIX) else argument + SUFFIX)
                    saved = state.without_conversation()  # a copy: how this cache was obtained stays as it was
                    session.save(saved, path)
                    err.print(f"saved {path} ({saved.file_bytes / 2**20:.1f} MiB)", markup=False)
                elif command == "/load":
                    if not argument:
                        raise ReplError("say /load SOURCE: a document, a folder or a .snapkv file")
                    opened = open_source(argument)
                    state = _State(opened, opened.per_question or settings.cut, state.sampling, state.max_new_tokens,
                                   cite=state.cite)
                    err.print(f"{opened.tokens} tokens ready from {argument}", markup=False)
                elif command == "/clear":
                    state.prepared = state.without_conversation()
                    answers.clear()
                    last = None
                    if err.is_terminal:
                        err.clear()
                    err.print("cleared: a new conversation starts; earlier answers are forgotten", markup=False)
                else:
                    raise ReplError(f"unknown command {command}; /help lists them")
            except (ReplError, SnapKVError) as error:
                failures += 1
                err.print(f"error: {error}", markup=False)
            continue
        started = time.perf_counter()
        count = len(answers)
        try:
            stream_answer(session, state.prepared, line, answer_prefix=answer_prefix,
                          max_new_tokens=state.max_new_tokens, sampling=state.sampling, out=out, err=err,
                          show=not as_json, results=answers, cite=state.cite)
        except KeyboardInterrupt:
            out.print()
            err.print(f"[answer stopped after {time.perf_counter() - started:.1f} s; the cache is unchanged]",
                      markup=False)
        except SnapKVError as error:  # a question the conversation has no room left for, ...
            err.print(f"error: {error}" + ("; /clear starts a new conversation" if state.prepared.turns else ""),
                      markup=False)
        if len(answers) > count:
            last = report(loaded, state.prepared, answers[count:], timings)
            if not no_log:  # logged as given: a session that ends badly loses none
                log_answers(err, "repl", last)
            if as_json:
                out.file.write(json.dumps(last) + "\n")
                out.file.flush()
            if answers[-1].finish_reason != "interrupted":  # the next question sees this turn
                try:
                    state.prepared = session.with_turn(state.prepared, line, answer_prefix + answers[-1].text)
                except (SnapKVError, KeyboardInterrupt) as error:
                    why = str(error) if isinstance(error, SnapKVError) else "stopped"
                    err.print(f"note: {why}; this answer is left out of the conversation", markup=False)
    if not interactive and answers and not quiet and not as_json:
        err.print(stats_table(report(loaded, state.prepared, answers, timings)))
    if not interactive and failures:
        raise typer.Exit(2)
