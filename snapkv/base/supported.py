"""The model families whose attention snapkv knows (snapkv.modeling.architectures), named without importing torch."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
