"""Consoles and safe text for every command, free of torch: the commands that run no model start at once."""

import os
import re
import sys
import time
from contextlib import contextmanager

from rich.console import Console

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
SCHEMA_VERSION = 1  # of every JSON object the commands print; raised when a key changes meaning or goes


def inert(text: str) -> str:
    """Text safe to show on a terminal: control characters (escape sequences included) removed.

    Always print it with markup off, so "[bold]" in a document or an answer stays text.
    """
    return _CONTROL.sub("", text)


UNBOUNDED = 100_000  # columns when the output is not a terminal: nothing wrapped, nothing padded to a width


def _width(stream) -> int | None:
    """A terminal's own width; for a pipe or a file none, so that paths and keys stay whole on one line."""
    try:
        return None if stream.isatty() else UNBOUNDED
    except (AttributeError, ValueError):
        return UNBOUNDED


class _Console(Console):
    """A console that, writing to a pipe or a file, ends no line in the spaces a table pads its rows with."""

    def print(self, *objects, **kwargs) -> None:
        if self.is_terminal:
            return super().print(*objects, **kwargs)
        with self.capture() as captured:
            super().print(*objects, **kwargs)
        *lines, rest = captured.get().split("\n")  # `rest`: text not ended by a newline (a streamed piece) as is
        self.file.write("".join(line.rstrip() + "\n" for line in lines) + rest)
        self.file.flush()


def stderr_console() -> Console:
    return _Console(stderr=True, highlight=False, width=_width(sys.stderr))


def stdout_console() -> Console:
    return _Console(highlight=False, markup=False, emoji=False, width=_width(sys.stdout))


def warn(err: Console, message: str) -> None:
    err.print("warning: " + inert(message), markup=False, soft_wrap=True)  # not cut into lines: paths stay whole


@contextmanager
def working(err: Console, text: str):
    """A spinner saying what is being done, on a terminal; nothing elsewhere, where `done` says it instead. Yields
    an update(text) that changes the spinner's text, or off a terminal prints it as a line with the time so far."""
    if err.is_terminal:
        with err.status(text) as status:
            yield status.update
        return
    started = time.perf_counter()
    yield lambda update: done(err, f"{update.rstrip('.')} ({time.perf_counter() - started:.1f} s)")


def done(err: Console, text: str) -> None:
    """A plain progress line for stderr that is not a terminal (scripts, CI logs): one per stage, with its time.
    A terminal shows spinners and bars instead."""
    if not err.is_terminal:
        err.print(f"snapkv: {text}", markup=False, highlight=False, soft_wrap=True)


def source_names(names: list[str], limit: int = 10) -> str:
    """The files a document was read from, as a user would type them (relative to the current folder where
    they are under it), the first `limit` of them."""
    def shown(name: str) -> str:
        relative = os.path.relpath(name) if os.path.isabs(name) else name
        return name if relative.startswith("..") else relative

    names = [shown(name) for name in names]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(inert(name) for name in names[:limit]) + more
