"""The snapkv command: one Typer app, one module per command, domain errors turned into exit codes."""

import os
import sys

import typer

from snapkv.errors import SnapKVError

from . import ask, bench, cache, compress, evaluate, info, repl

app = typer.Typer(
    name="snapkv",
    help="Ask questions of long documents with a local LLM, using a SnapKV-compressed KV cache.",
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


@app.callback()
def _root() -> None:
    """Ask questions of long documents with a local LLM, using a SnapKV-compressed KV cache."""


def main() -> None:
    """Console entry point: library errors become a one-paragraph message and an exit code."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        app()  # Typer reports usage errors itself, with exit code 2
    except SnapKVError as error:
        print(f"snapkv: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print("snapkv: interrupted", file=sys.stderr)
        sys.exit(130)
