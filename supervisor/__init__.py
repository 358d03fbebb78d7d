"""llm-supervisor: serve many local LLMs from a fixed pool of GPUs."""

from supervisor.native import refuse_stale

__version__ = "0.1.0"

refuse_stale()  # before any module of the request path is imported: none may be older than its source
