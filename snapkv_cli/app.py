"""The snapkv command: one Typer app, one module per command, every failure turned into a message and an exit code."""

import errno
import os
import sys
import traceback

import typer

from snapkv.errors import EXIT_CODES, OutOfMemoryError, SnapKVError, StorageError
from snapkv.memory import is_out_of_memory

from . import ask, bench, cache, compress, evaluate, info, repl

EXIT_CODE_HELP = "Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) + "."

app = typer.Typer(
    name="snapkv",
    help="Ask questions of long documents with a local LLM, using a SnapKV-compressed KV cache.",
    epilog=EXIT_CODE_HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command(name="ask")(ask.ask)
app.command(name="compress")(compress.compress)
app.command(name="repl")(repl.repl)
app.command(name="info")(info.info)
app.command(name="bench")(bench.bench)
app.add_typer(cache.app, name="cache")
app.add_typer(evaluate.app, name="eval")

_debug = {"on": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", envvar="SNAPKV_DEBUG",
                                     help="On an error, also print the Python traceback.")) -> None:
    """Ask questions of long documents with a local LLM, using a SnapKV-compressed KV cache."""
    _debug["on"] = debug


def _as_known_error(error: BaseException) -> SnapKVError | None:
    """Failures of the machine rather than of snapkv, told the way a user can act on them."""
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


def _fail(message: str, code: int) -> None:
    if _debug["on"]:
        traceback.print_exc()
    print(f"snapkv: error: {message}", file=sys.stderr)
    sys.exit(code)


def _usage_error(error: Exception) -> None:
    """Typer's own rendering of a usage error (missing argument, bad option value): exit code 2."""
    from typer import rich_utils

    rich_utils.rich_format_error(error)
    sys.exit(error.exit_code)


def main() -> None:
    """Console entry point: every error becomes a one-paragraph message and a documented exit code."""
    from typer import Abort
    from typer._click.exceptions import ClickException  # usage errors; typer exports no public name for it

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        code = app(standalone_mode=False)  # returns Typer's exit code, 130 for Ctrl-C
    except ClickException as error:
        _usage_error(error)
    except SnapKVError as error:
        _fail(str(error), error.exit_code)
    except (KeyboardInterrupt, Abort):
        code = 130
    except Exception as error:
        known = _as_known_error(error)
        if known is not None:
            _fail(str(known), known.exit_code)
        _fail(f"internal error: {type(error).__name__}: {error}. This is a bug in snapkv; run again with "
              "--debug to see the traceback, and report it.", 1)
    if code == 130:
        print("snapkv: interrupted; nothing half-written was left behind", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)
