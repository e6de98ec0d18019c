"""deltaserve: a serving engine for Qwen3.5-family models."""

__version__ = "0.1.0"
