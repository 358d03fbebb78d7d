"""llm-supervisor: serve many local LLMs from a fixed pool of GPUs."""

__version__ = "0.1.0"
