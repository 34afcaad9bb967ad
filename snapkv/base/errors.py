"""Domain errors. The library raises these; the CLI turns them into messages and exit codes."""


class SnapKVError(Exception):
    """Base class of every error snapkv reports to a user."""

    exit_code = 1


class ConfigError(SnapKVError):
    """Settings that cannot work together (a budget smaller than the window, say)."""

    exit_code = 2


class ModelNotFoundError(SnapKVError):
    """The model asked for is not installed, cached or present on disk."""

    exit_code = 3


class UnsupportedModelError(SnapKVError):
    """A model whose attention layers snapkv does not know how to compress."""

    exit_code = 3


class ModelFileError(UnsupportedModelError):
    """A model file that is damaged, truncated, crafted, or holds what snapkv does not read (a GGUF's unknown type)."""


class DocumentError(SnapKVError):
    """A document that cannot be read or turned into a prompt."""

    exit_code = 4


class CacheFileError(SnapKVError):
    """A saved cache that is damaged, not a snapkv cache, or written by a newer snapkv."""

    exit_code = 5


class IncompatibleCacheError(SnapKVError):
    """A valid saved cache made for another model, tokenizer or prompt template."""

    exit_code = 5


class OutOfMemoryError(SnapKVError):
    """The prompt does not fit in memory: refused by the preflight estimate, or a real out-of-memory."""

    exit_code = 6


class StorageError(SnapKVError):
    """A cache could not be written: disk full, a folder that cannot be written, a file in the way."""

    exit_code = 7


# Exit codes, as documented in README.md and `snapkv --help`.
EXIT_CODES = {
    0: "success",
    1: "internal error (a bug: run again with --debug and report the traceback)",
    2: "bad usage or settings",
    3: "model not found or not supported",
    4: "unreadable or unusable document",
    5: "damaged, foreign or incompatible cache file",
    6: "out of memory",
    7: "cannot write (disk full, folder not writable)",
    8: "no snapkv server is running (serve --status), or one already is (serve)",
    130: "interrupted (Ctrl-C)",
}
