"""Engine workers: one module per inference engine, each turning a manifest into a child process."""

from __future__ import annotations

from workers.base import Worker
from workers.llama_server import LlamaServerWorker
from workers.vllm_serve import VllmWorker

WORKERS: dict[str, Worker] = {"llama-server": LlamaServerWorker(), "vllm": VllmWorker()}


def worker_for(engine: str) -> Worker:
    return WORKERS[engine]
