"""snapkv: ask questions of long documents with a SnapKV-compressed KV cache saved to disk.

What a program needs is here: `from snapkv import Session, SnapKVConfig, load_model, read_sources`. Each name is
imported when first used, so that importing snapkv stays light (the commands that run no model never load torch).
"""

import importlib

from snapkv.base.spinning import bound_the_spinning

bound_the_spinning()  # before torch loads OpenMP: idle threads sleep sooner, so processes share cores (its docstring)

__version__ = "0.1.0"

_ENTRY_POINTS = {  # name -> the module that defines it
    "Session": "snapkv.session",
    "SnapKVConfig": "snapkv.compression.config",
    "load_model": "snapkv.engine.models",
    "read_sources": "snapkv.io.documents",
    "SnapKVError": "snapkv.base.errors",
}
__all__ = ["__version__", *_ENTRY_POINTS]


def __getattr__(name: str):
    if name in _ENTRY_POINTS:
        return getattr(importlib.import_module(_ENTRY_POINTS[name]), name)
    raise AttributeError(f"module 'snapkv' has no attribute {name!r}")
