"""snapkv: ask questions of long documents with a SnapKV-compressed KV cache saved to disk."""

__version__ = "0.1.0"
