"""The GPU inventory: NVML (nvidia-ml-py) when an NVIDIA driver is present, else GPUs declared in config.

A declared GPU is simulated: its memory is only what the lease map says, which is what lets the
scheduler's budget logic run, and be tested, on machines with no GPU at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from supervisor.config import DeclaredGpu

log = structlog.get_logger("gpus")

DEFAULT_SIMULATED_MIB = 24576


@dataclass(frozen=True)
class Gpu:
    index: int
    total_mib: int  # the budget: the device's memory, or what the config declares
    name: str
    uuid: str | None
    simulated: bool
    physical_total_mib: int | None = None  # the device's own memory, when NVML can see it

    @property
    def device_total_mib(self) -> int:
        """What an engine sizing itself by a fraction of the GPU (vLLM) takes that fraction of."""
        return self.physical_total_mib or self.total_mib


class GpuInventory:
    """What GPUs there are and, with NVML, what is really in use on them."""

    def __init__(self, gpus: Sequence[Gpu], nvml: Any | None = None, assumed: bool = False) -> None:
        self.gpus = tuple(gpus)
        self._nvml = nvml
        self.assumed = assumed  # neither NVML nor a declaration: one simulated GPU stands in

    @property
    def source(self) -> str:
        return "nvml" if self._nvml is not None else "assumed" if self.assumed else "declared"

    @property
    def has_nvml(self) -> bool:
        return self._nvml is not None

    @classmethod
    def detect(cls, declared: Iterable[DeclaredGpu] | None) -> GpuInventory:
        """Declared GPUs win (a config can carve a budget out of real ones); else NVML; else one simulated."""
        nvml = _init_nvml()
        if declared is not None:
            physical = _physical_totals(nvml) if nvml is not None else {}
            if nvml is not None:
                nvml.nvmlShutdown()
            return cls(
                [Gpu(g.index, g.total_mib, g.name, None, True, physical.get(g.index)) for g in declared]
            )
        if nvml is not None:
            gpus = []
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(
                    Gpu(
                        i,
                        int(memory.total) // 2**20,
                        str(nvml.nvmlDeviceGetName(handle)),
                        str(nvml.nvmlDeviceGetUUID(handle)),
                        False,
                        int(memory.total) // 2**20,
                    )
                )
            return cls(gpus, nvml)
        log.warning(
            "gpus_simulated",
            reason="NVML not available and no gpus declared",
            total_mib=DEFAULT_SIMULATED_MIB,
        )
        return cls([Gpu(0, DEFAULT_SIMULATED_MIB, "simulated GPU", None, True)], assumed=True)

    def memory_held_by(self, pids: Iterable[int]) -> dict[int, int]:
        """MiB that these processes hold per GPU index (always empty for simulated GPUs). Blocking."""
        wanted = set(pids)
        held = {g: sum(m for p, m in procs.items() if p in wanted) for g, (_, procs) in self.usage().items()}
        return {g: mib for g, mib in held.items() if mib}

    def usage(self) -> dict[int, tuple[int, dict[int, int]]]:
        """Per GPU index, with NVML: (MiB used in all, {pid: MiB} of the compute processes); else empty.

        Blocking NVML calls: run it in a thread.
        """
        if self._nvml is None:
            return {}
        usage: dict[int, tuple[int, dict[int, int]]] = {}
        for gpu in self.gpus:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            used = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used) // 2**20
            procs = {
                int(p.pid): int(p.usedGpuMemory or 0) // 2**20
                for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            }
            usage[gpu.index] = (used, procs)
        return usage

    async def foreign_used_mib(self, our_pids: Iterable[int]) -> dict[int, int]:
        """MiB per GPU used by processes that are not ours (other tenants); zero for simulated GPUs."""
        if self._nvml is None:
            return {}
        ours = set(our_pids)
        usage = await asyncio.to_thread(self.usage)
        return {
            g: max(0, used - sum(m for p, m in procs.items() if p in ours))
            for g, (used, procs) in usage.items()
        }

    async def wait_memory_released(self, pids: Iterable[int], timeout_s: float) -> dict[int, int]:
        """Poll until the processes hold no GPU memory or the deadline passes; returns what is still held."""
        pid_list = list(pids)
        deadline = time.monotonic() + timeout_s
        while True:
            held = await asyncio.to_thread(self.memory_held_by, pid_list)
            if not held or time.monotonic() >= deadline:
                return held
            await asyncio.sleep(0.2)

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()


def _physical_totals(nvml: Any) -> dict[int, int]:
    """MiB of each device NVML sees, by index: a budget declared on a real GPU is still a share of it."""
    totals = {}
    for i in range(nvml.nvmlDeviceGetCount()):
        totals[i] = int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).total) // 2**20
    return totals


def _init_nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no driver, no library, no device: all mean "no NVML here"
        return None
