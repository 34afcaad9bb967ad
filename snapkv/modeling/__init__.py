"""How snapkv reaches into a transformers model: its attention layers and MLPs, attention for a few rows on CPU,
weights found back as 4/8-bit blocks, a cache written in place."""
