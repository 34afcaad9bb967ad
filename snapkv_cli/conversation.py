"""The last conversation `snapkv ask` had, so that `ask --continue` (-c) goes on with it: its document and its
turns (question, answer), in conversation.json in the snapkv home, written whole or not at all.

Each `ask` without --continue starts a new conversation (its questions and answers are its turns); `ask -c Q` asks
about the same document with those turns before Q, each appended to a working copy of the document's cache
(snapkv.session.Session.with_turn), and adds its own. The file is read with bounds: a size, a version, types.
"""

import json
from pathlib import Path

from snapkv.base.atomic import write_atomically
from snapkv.base.errors import ConfigError, StorageError
from snapkv.base.paths import snapkv_home

FILE_NAME = "conversation.json"
VERSION = 1
MAX_BYTES = 16 << 20   # a long conversation's text; more is not a file ask wrote
MAX_TURNS = 1000


def _path() -> Path:
    return snapkv_home() / FILE_NAME


def last_conversation() -> tuple[str, list[tuple[str, str]]]:
    """(the document's SOURCE as ask took it, the turns); ConfigError where there is none to continue."""
    path = _path()
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ConfigError(f"{path} is over {MAX_BYTES >> 20} MB: not a conversation snapkv wrote; delete it")
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("there is no conversation to continue: ask about a document first (snapkv ask SOURCE "
                          "QUESTION), then continue with snapkv ask -c QUESTION") from None
    except (OSError, ValueError, RecursionError) as error:
        raise ConfigError(f"the last conversation ({path}) cannot be read ({error}); ask about a document again "
                          "to start a new one") from None
    turns = data.get("turns") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("source"), str)
            or not isinstance(turns, list) or len(turns) > MAX_TURNS
            or not all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in turns)):
        raise ConfigError(f"the last conversation ({path}) is not one this snapkv wrote; ask about a document again "
                          "to start a new one")
    return data["source"], [tuple(turn) for turn in turns]


def remember(source: str, turns: list[tuple[str, str]]) -> None:
    """Make (source, turns) the conversation `ask -c` continues; a source read from stdin cannot be, and is
    remembered as none."""
    path = _path()
    if source == "-":
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            raise StorageError(f"cannot remove {path}: {error.strerror or error}") from None
        return
    if not source.startswith(("~", "/")):
        source = str(Path(source).resolve())
    text = json.dumps({"version": VERSION, "source": source, "turns": [list(turn) for turn in turns[-MAX_TURNS:]]})
    write_atomically(path, lambda temp: temp.write_text(text, encoding="utf-8"), what="the conversation")
