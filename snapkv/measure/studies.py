"""The subcommands of a script under benchmarks/: each script holds several studies, each a function of its command
line's remaining arguments."""

import sys
from typing import Callable

Study = Callable[[list[str]], "int | None"]  # the study's arguments -> None, or its exit code


def run_study(studies: dict[str, Study], usage: str, argv: list[str] | None = None) -> None:
    """Run the study named first in `argv` (default: the command line) with the rest of it; `usage` (the script's
    docstring, listing them) on stderr and exit code 2 when none is named or the name is unknown."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in studies:
        print(usage, file=sys.stderr)
        raise SystemExit(2)
    sys.argv[0] = f"{argv[0]} {argv[1]}"  # what argparse names in the study's usage line
    result = studies[argv[1]](argv[2:])
    if isinstance(result, int):
        raise SystemExit(result)
