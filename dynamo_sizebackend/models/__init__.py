"""Built-in models for tests and the benchmark; nothing here downloads weights."""

from .llama import PRESETS, LlamaConfig, SizeLlama, build_model, config

__all__ = ["PRESETS", "LlamaConfig", "SizeLlama", "build_model", "config"]
