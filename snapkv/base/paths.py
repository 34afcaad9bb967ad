"""Where snapkv keeps its files: the user cache dir, or $SNAPKV_HOME when set."""

import os
from pathlib import Path

import platformdirs

CACHE_SUFFIX = ".snapkv"  # the saved-cache file's suffix


def snapkv_home() -> Path:
    """The root folder for converted models and saved caches."""
    override = os.environ.get("SNAPKV_HOME")
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("snapkv"))


def models_dir() -> Path:
    return snapkv_home() / "models"
