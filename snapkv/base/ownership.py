"""Trust only what this user owns: private folders, and files no one else could have written.

The server's socket and the compiled kernels live in folders snapkv makes; another user who made one first,
or could write into it, could listen in place of the server or plant a library that snapkv would run. So each
such folder is made 0700 and checked, and a file is used only when this user owns it and no one else may write it.
"""

import os
import stat
from pathlib import Path


class NotPrivate(OSError):
    """A path that another user owns or may write to."""


def private_folder(path: Path) -> Path:
    """`path` as a folder of this user's that no one else may read or write: made 0700 if missing, else checked
    (not a link, owned by this user, no group or other access; tightened to 0700 when it is only more open).
    NotPrivate when another user owns it or it is not a plain folder."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode):
        raise NotPrivate(f"{path} is not a folder (a link or a file stands there)")
    if found.st_uid != os.getuid():
        raise NotPrivate(f"{path} belongs to another user (uid {found.st_uid})")
    if found.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def written_only_by_me(path: Path) -> bool:
    """True when `path` is a plain file (not a link) of this user's that neither group nor others may write,
    in a folder of the same kind."""
    try:
        found, folder = os.lstat(path), os.lstat(Path(path).parent)
    except OSError:
        return False
    return (stat.S_ISREG(found.st_mode) and found.st_uid == os.getuid() and not found.st_mode & 0o022
            and folder.st_uid == os.getuid() and not folder.st_mode & 0o022)
