"""Consoles and safe text for every command, free of torch: the commands that run no model start at once."""

import re
import sys

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
