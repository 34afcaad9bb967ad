"""Writing a file so that a crash, Ctrl-C, a full disk or a second writer never leaves a partial one.

The file is written to a temp name in the same folder, fsynced and renamed over the final name under
an exclusive lock on its folder; temps left by writers that died are swept before each write.
"""

import contextlib
import errno
import fcntl
import os
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from snapkv.base.errors import StorageError

STALE_TEMP_SECONDS = 3600


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the folder of `path`, so two writers of one file never interleave; no lock file is
    made (none beside the user's files, none left behind), and it ends with the process that held it."""
    folder = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the lock


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_temps(folder: Path) -> int:
    """Remove temp files left by writers that died (their process is gone, or they are an hour old)."""
    removed = 0
    for temp in folder.glob(".*.tmp"):
        parts = temp.name.split(".")
        try:
            pid = int(parts[-3])
        except (ValueError, IndexError):
            continue
        try:
            old = time.time() - temp.stat().st_mtime > STALE_TEMP_SECONDS
        except FileNotFoundError:
            continue
        if old or not _pid_alive(pid):
            temp.unlink(missing_ok=True)
            removed += 1
    return removed


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, write: Callable[[Path], None], what: str = "the file") -> int:
    """Call write(temp) and rename the temp over `path`; returns the file's size in bytes.

    A crash at any point leaves the old file or the new one, never a mix. An OSError becomes a
    StorageError that says what to do (`what` names the file for the user).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            sweep_stale_temps(path.parent)
            temp = _temp_name(path)
            try:
                write(temp)
                with open(temp, "rb+") as written:
                    os.fsync(written.fileno())
                os.replace(temp, path)
                _fsync_folder(path.parent)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
        return path.stat().st_size
    except OSError as error:
        raise StorageError(_write_failure(path, error, what)) from error


def _write_failure(path: Path, error: OSError, what: str) -> str:
    """What a failed write means for the user; the previous file, if any, is untouched either way."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "the disk is full; free some space"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = "the folder cannot be written; check its permissions or set SNAPKV_HOME to a writable folder"
    elif error.errno in (errno.ENOTDIR, errno.EEXIST):
        reason = "a file stands where a folder is needed; move it or set SNAPKV_HOME elsewhere"
    else:
        reason = error.strerror or str(error)
    return f"cannot save {what} to {path}: {reason}. Any earlier file there is intact."
