"""The snapkv command: one Typer app, one module per command, every failure turned into a message and an exit code."""

import errno
import os
import sys
import traceback

import typer

from snapkv.compression.config import check_runtime_settings
from snapkv.base.errors import EXIT_CODES, OutOfMemoryError, SnapKVError, StorageError

from . import ask, bench, cache, compress, evaluate, info, local_client, local_server, logs, models, pull, repl, serve
from .serve_ray import ray_address_optional
from .usage import PlainCommand

MODEL_COMMANDS = ("ask", "compress", "repl", "serve", "bench", "eval")  # the commands that run a model

EXIT_CODE_HELP = "Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) + "."

app = typer.Typer(
    name="snapkv",
    help="Ask questions of long documents with a local LLM, using a SnapKV-compressed KV cache.",
    epilog=EXIT_CODE_HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    rich_markup_mode=None,  # plain help, readable at 80 columns
    context_settings={"help_option_names": ["-h", "--help"]},  # every command inherits -h
)
app.command(name="ask", cls=PlainCommand)(ask.ask)
app.command(name="compress", cls=PlainCommand)(compress.compress)
app.command(name="repl", cls=PlainCommand)(repl.repl)
app.command(name="info", cls=PlainCommand)(info.info)
app.command(name="bench", cls=PlainCommand)(bench.bench)
app.command(name="serve", cls=PlainCommand)(serve.serve)
app.command(name="models", cls=PlainCommand)(models.models)
app.command(name="pull", cls=PlainCommand)(pull.pull)
app.add_typer(cache.app, name="cache")
app.add_typer(logs.app, name="logs")
app.add_typer(evaluate.app, name="eval")

_debug = {"on": False}


def _show_version(value: bool) -> None:
    if value:
        from snapkv import __version__

        print(f"snapkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", envvar="SNAPKV_DEBUG",
                                     help="On an error, also print the Python traceback (also after the command)."),
          version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                       help="Print snapkv's version and exit.")) -> None:
    """Ask questions of long documents with a local LLM, using a SnapKV-compressed KV cache."""
    _debug["on"] = _debug["on"] or debug


def _as_known_error(error: BaseException) -> SnapKVError | None:
    """Failures of the machine rather than of snapkv, told the way a user can act on them."""
    from snapkv.engine.memory import is_out_of_memory

    if is_out_of_memory(error):
        return OutOfMemoryError(
            f"out of memory ({type(error).__name__}). Use a shorter document (--truncate), a smaller --budget, "
            "another --device, or close other programs; nothing was saved."
        )
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(f"the disk is full ({error.filename or error}); free some space and run again. "
                            "Nothing half-written was left behind.")
    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return StorageError(f"cannot write {error.filename or ''} ({error.strerror}); check the folder's "
                            "permissions, or point SNAPKV_HOME at a writable folder.")
    return None


def _fail(message: str, code: int) -> int:
    if _debug["on"]:
        traceback.print_exc()
    print(f"snapkv: error: {message}", file=sys.stderr)
    return code


def _is_usage_error(error: BaseException) -> bool:
    """Typer's own usage errors (missing argument, bad option value): they know their exit code and show
    themselves. Told by what they do, as typer exports no public name for them."""
    return hasattr(error, "exit_code") and hasattr(error, "format_message") and hasattr(error, "show")


def _usage_error(error: Exception) -> int:
    """A usage error in the style of every other error (`snapkv: error: ...`, exit code 2); a command or group
    given no arguments shows its help instead (exit code 0)."""
    context = getattr(error, "ctx", None)
    if type(error).__name__ == "NoArgsIsHelpError" and context is not None:
        print(context.get_help())
        return 0
    command = context.command_path if context is not None else "snapkv"
    message = error.format_message()
    if (context is not None and context.command.name == "ask" and context.params.get("continue_")
            and getattr(getattr(error, "param", None), "name", None) == "source"):  # `ask -c` alone: no question
        message = "Missing a question: snapkv ask -c QUESTION continues the last conversation."
    print(f"snapkv: error: {message} (see {command} --help)", file=sys.stderr)
    return error.exit_code


def _debug_flag(argv: list[str]) -> list[str]:
    """--debug is accepted anywhere before a lone "--": taken out of the arguments here."""
    cut = argv.index("--") if "--" in argv else len(argv)
    if "--debug" in argv[:cut]:
        _debug["on"] = True
        return [arg for index, arg in enumerate(argv) if not (arg == "--debug" and index < cut)]
    return argv


def _runs_on_server(argv: list[str]) -> bool:
    """`ask` goes to a running server, unless told not to, asked for help, or reading stdin (which stays here)."""
    if not argv or argv[0] != "ask" or local_client.disabled_by_environment():
        return False
    if local_server.IN_SERVER:
        return False
    return not {"--no-server", "--help", "-h", "-"} & set(argv)


def _stdin_as_source(argv: list[str]) -> list[str]:
    """`cat report.md | snapkv ask "Q"`: an ask with questions but no SOURCE, and a document piped or redirected
    in, reads the document from stdin, as if `-` had been given (which also keeps it off the server)."""
    import stat

    if not argv or argv[0] != "ask" or "-" in argv or sys.stdin is None:
        return argv
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError):
        return argv
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode)):  # a terminal, /dev/null: nothing was piped in
        return argv
    from typer.main import get_command

    try:
        context = get_command(app).commands["ask"].make_context("ask", list(argv[1:]), resilient_parsing=True)
    except Exception:  # the command reports what is wrong with its arguments itself
        return argv
    source, questions = context.params.get("source"), context.params.get("questions")
    if not source or questions or context.params.get("continue_"):  # -c: every argument is a question
        return argv
    position = len(argv) - 1 - argv[::-1].index(source)
    return [*argv[:position], "-", *argv[position:]]


def run(argv: list[str]) -> int:
    """Run one snapkv command line; every error becomes a one-paragraph message and a documented exit code."""
    from typer import Abort

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # snapkv never downloads: models come from disk
    _debug["on"] = os.environ.get("SNAPKV_DEBUG", "") not in ("", "0")
    argv = _stdin_as_source(list(argv))
    if argv and argv[0] in MODEL_COMMANDS:  # a bad SNAPKV_ENGINE or SNAPKV_KERNELS is said before anything loads
        try:
            check_runtime_settings()
        except SnapKVError as error:
            return _fail(str(error), error.exit_code)
    if _runs_on_server(argv) and (code := local_client.run_remotely(list(argv))) is not None:
        return code
    local_client.COMMAND_LINE.set(list(argv))  # the first ask hands it to the server it starts
    argv = _debug_flag(list(argv))
    argv = ray_address_optional(argv)  # serve --ray with no address: a Ray started here
    try:
        # Typer's exit code, 130 for Ctrl-C; obj: how `serve` runs the command lines sent to it (this function)
        code = app(args=argv, prog_name="snapkv", standalone_mode=False, obj=run)
    except SnapKVError as error:
        return _fail(str(error), error.exit_code)
    except (KeyboardInterrupt, Abort):
        code = 130
    except Exception as error:
        if _is_usage_error(error):
            return _usage_error(error)
        known = _as_known_error(error)
        if known is not None:
            return _fail(str(known), known.exit_code)
        return _fail(f"internal error: {type(error).__name__}: {error}. This is a bug in snapkv; run again with "
                     "--debug to see the traceback, and report it.", 1)
    if code == 130:
        print("snapkv: interrupted; nothing half-written was left behind", file=sys.stderr)
    return code if isinstance(code, int) else 0


def main() -> None:
    """Console entry point."""
    sys.exit(run(sys.argv[1:]))
