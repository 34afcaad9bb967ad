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


class DocumentError(SnapKVError):
    """A document that cannot be read or turned into a prompt."""

    exit_code = 4


class CacheFileError(SnapKVError):
    """A saved cache that is damaged, not a snapkv cache, or written by a newer snapkv."""

    exit_code = 5


class IncompatibleCacheError(SnapKVError):
    """A valid saved cache made for another model, tokenizer or prompt template."""

    exit_code = 5
