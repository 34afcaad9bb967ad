"""A log of every question, answer, document, cache and timing, like `llm logs`: one SQLite file.

It lives in the user data dir (or $SNAPKV_HOME when set); `--no-log` or SNAPKV_NOLOG=1 keep a command out
of it. The REPL's input history is kept here too. Logging never stops an answer: a log that cannot be
written is reported by the caller as a warning.
"""

import json
import os
import sqlite3
import time
from pathlib import Path

import platformdirs

SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    id INTEGER PRIMARY KEY,
    created REAL NOT NULL,
    command TEXT NOT NULL,
    model TEXT,
    sources TEXT,              -- JSON list of the documents' names
    document_tokens INTEGER,
    cache_path TEXT,
    cache_hit INTEGER,
    mode TEXT,
    question TEXT NOT NULL,
    answer TEXT NOT NULL,
    finish_reason TEXT,
    new_tokens INTEGER,
    ttft_seconds REAL,
    decode_tokens_per_second REAL,
    prefill_seconds REAL,
    report TEXT                -- the command's whole JSON report
);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY,
    created REAL NOT NULL,
    line TEXT NOT NULL
);
"""
COLUMNS = ("id", "created", "command", "model", "sources", "document_tokens", "cache_path", "cache_hit", "mode",
           "question", "answer", "finish_reason", "new_tokens", "ttft_seconds", "decode_tokens_per_second",
           "prefill_seconds", "report")


def logging_disabled() -> bool:
    return os.environ.get("SNAPKV_NOLOG", "") not in ("", "0")


def log_path() -> Path:
    override = os.environ.get("SNAPKV_HOME")
    folder = Path(override).expanduser() if override else Path(platformdirs.user_data_dir("snapkv"))
    return folder / "logs.db"


class Logbook:
    """The answers and REPL input kept in one SQLite file (created on first use)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else log_path()

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=10)
        connection.executescript(SCHEMA)
        return connection

    def record(self, command: str, report: dict) -> list[int]:
        """One row per answer of a command's JSON report (snapkv_cli.render.report); their ids."""
        ids = []
        with self._connect() as connection:
            for answer in report["answers"]:
                row = (time.time(), command, report["model"]["name"],
                       json.dumps([source["name"] for source in report["document"]["sources"]]),
                       report["document"]["tokens"], report["cache"]["path"], int(report["cache"]["hit"]),
                       report["compression"]["mode"], answer["question"], answer["answer"], answer["finish_reason"],
                       answer["new_tokens"], answer["ttft_seconds"], answer["decode_tokens_per_second"],
                       report["timings"]["prefill_seconds"], json.dumps({**report, "answers": [answer]}))
                cursor = connection.execute(f"INSERT INTO answers ({', '.join(COLUMNS[1:])}) VALUES "
                                            f"({', '.join('?' * (len(COLUMNS) - 1))})", row)
                ids.append(cursor.lastrowid)
        return ids

    def entries(self, limit: int = 20, search: str | None = None) -> list[dict]:
        """The latest answers, newest first (optionally those whose question or answer holds `search`)."""
        if not self.path.is_file():
            return []
        query, arguments = f"SELECT {', '.join(COLUMNS)} FROM answers", []
        if search:
            query += " WHERE question LIKE ? OR answer LIKE ?"
            arguments += [f"%{search}%", f"%{search}%"]
        query += " ORDER BY id DESC LIMIT ?"
        with self._connect() as connection:
            rows = connection.execute(query, [*arguments, limit]).fetchall()
        return [self._entry(row) for row in rows]

    def entry(self, entry_id: int) -> dict | None:
        if not self.path.is_file():
            return None
        with self._connect() as connection:
            row = connection.execute(f"SELECT {', '.join(COLUMNS)} FROM answers WHERE id = ?", (entry_id,)).fetchone()
        return self._entry(row) if row else None

    @staticmethod
    def _entry(row) -> dict:
        entry = dict(zip(COLUMNS, row))
        entry["sources"] = json.loads(entry["sources"] or "[]")
        entry["report"] = json.loads(entry["report"] or "{}")
        entry["cache_hit"] = bool(entry["cache_hit"])
        return entry

    def add_history(self, line: str) -> None:
        with self._connect() as connection:
            connection.execute("INSERT INTO history (created, line) VALUES (?, ?)", (time.time(), line))

    def history(self, limit: int = 1000) -> list[str]:
        """REPL input lines, oldest first."""
        if not self.path.is_file():
            return []
        with self._connect() as connection:
            rows = connection.execute("SELECT line FROM history ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [line for (line,) in reversed(rows)]
