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
