"""The GPU inventory: NVML (nvidia-ml-py) when an NVIDIA driver is present, else GPUs declared in config.

A declared GPU is simulated: its memory is only what the lease map says, which is what lets the
scheduler's budget logic run, and be tested, on machines with no GPU at all.

With NVML the inventory also says whose memory is whose (see supervisor/vram_attribution.py): by pid
where NVML's pids are ours, else, in a container whose pid namespace NVML does not share, by the device's
used memory measured around each load, one measured load per GPU at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from supervisor.config import DeclaredGpu
from supervisor.vram_attribution import Attribution, GpuUsage, VramAttribution

log = structlog.get_logger("gpus")

DEFAULT_SIMULATED_MIB = 24576
_NVIDIA_PROC = Path("/proc/driver/nvidia")
_NVML_LIBRARY = "libnvidia-ml.so.1"  # the name pynvml loads on Linux
# NVML's init errors that mean "no NVIDIA driver here", not "a driver we cannot talk to".
_NO_DRIVER_CODES = frozenset({9, 12})  # NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND
_RELEASE_POLL_S = 0.2
_MEASURE_WAIT_S = 5.0  # how long a load waits for another on its GPU to finish being measured


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


class NvmlInitError(Exception):
    """The host has an NVIDIA driver but NVML would not start (often a driver/library version mismatch).

    Scheduling on a made-up GPU would hide it, so the daemon refuses to start unless `gpus:` is declared.
    """


class GpuInventory:
    """What GPUs there are and, with NVML, what is really in use on them and by whom."""

    def __init__(self, gpus: Sequence[Gpu], nvml: Any | None = None, assumed: bool = False) -> None:
        self.gpus = tuple(gpus)
        self._nvml = nvml
        self.assumed = assumed  # neither NVML nor a declaration: one simulated GPU stands in
        # The latest usage() reading: what /metrics shows without an NVML call on the event loop.
        self.last_usage: dict[int, GpuUsage] = {}
        self.attribution = VramAttribution()
        self._measuring: dict[int, asyncio.Lock] = {g.index: asyncio.Lock() for g in self.gpus}
        self._failing: dict[int, str] = {}  # GPU index -> the NVML error its last query raised

    @property
    def source(self) -> str:
        return "nvml" if self._nvml is not None else "assumed" if self.assumed else "declared"

    @property
    def has_nvml(self) -> bool:
        return self._nvml is not None

    @classmethod
    def detect(
        cls,
        declared: Iterable[DeclaredGpu] | None,
        nvml_module: Callable[[], Any] | None = None,
        driver_present: Callable[[], bool] | None = None,
    ) -> GpuInventory:
        """Declared GPUs win (a config can carve a budget out of real ones); else NVML; else one simulated.

        Raises NvmlInitError when NVML fails to start on a host with an NVIDIA driver and no GPUs are
        declared. `nvml_module` and `driver_present` stand in for `import pynvml` and the driver check.
        """
        nvml, failure = _init_nvml(nvml_module or _import_pynvml)
        if nvml is None and failure is not None:
            fatal = failure[1] or (driver_present or _NVIDIA_PROC.exists)()
            if fatal and declared is None:
                raise NvmlInitError(
                    f"NVML failed to start: {failure[0]}. The host has an NVIDIA driver, so the GPUs cannot "
                    "be guessed; fix the driver (a driver/library version mismatch needs a reboot or a "
                    "matching nvidia-ml library), or declare `gpus:` in the daemon config"
                )
            if fatal:
                log.warning("nvml_init_failed", error=failure[0], using="declared gpus")
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

    # --- reading NVML (blocking: these run in threads) ---------------------------------------------

    def usage(self) -> dict[int, GpuUsage]:
        """Per GPU index, with NVML: MiB used in all and {pid: MiB} of its compute processes; else empty.

        A GPU whose query raised NVMLError is left out (its use is unknown); the error is logged when it
        starts and when it clears. Blocking NVML calls: run it in a thread.
        """
        if self._nvml is None:
            return {}
        usage: dict[int, GpuUsage] = {}
        for gpu in self.gpus:
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu.index)
                used = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used) // 2**20
                procs = {
                    int(p.pid): int(p.usedGpuMemory or 0) // 2**20
                    for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                }
            except self._nvml.NVMLError as exc:
                if self._failing.get(gpu.index) != str(exc):
                    log.error("nvml_query_failed", gpu=gpu.index, error=str(exc))
                self._failing[gpu.index] = str(exc)
                continue
            if self._failing.pop(gpu.index, None) is not None:
                log.info("nvml_query_recovered", gpu=gpu.index)
            usage[gpu.index] = GpuUsage(used, procs)
        self.last_usage = usage
        return usage

    def query_error(self, gpu: int) -> str | None:
        """The NVMLError the GPU's last query raised, while it keeps failing."""
        return self._failing.get(gpu)

    def memory_held_by(self, pids: Iterable[int]) -> dict[int, int]:
        """MiB that these processes hold per GPU index (always empty for simulated GPUs). Blocking."""
        wanted = set(pids)
        held = {g: sum(m for p, m in u.processes.items() if p in wanted) for g, u in self.usage().items()}
        return {g: mib for g, mib in held.items() if mib}

    # --- whose memory is whose ----------------------------------------------------------------------

    async def foreign_used_mib(
        self, leases: Mapping[str, Mapping[int, int]], pids: Mapping[str, Collection[int]]
    ) -> dict[int, int]:
        """MiB per GPU that the leases do not account for (other tenants, or ours beyond a lease).

        `leases` are every holder's lease, `pids` each running child's process tree. Empty without NVML;
        a GPU that NVML could not be asked about is left out: its foreign use is unknown.
        """
        if self._nvml is None:
            return {}
        usage = await asyncio.to_thread(self.usage)
        self.attribution.sync(leases, pids)
        return self.attribution.foreign_mib(usage)

    @contextlib.asynccontextmanager
    async def measured_load(
        self, holder: str, lease_mib: Mapping[int, int], timeout_s: float
    ) -> AsyncIterator[None]:
        """Wrap a child's spawn and readiness: the device's used memory is read before and after.

        Unless NVML is known to show our pids, the measured part is exclusive per GPU (a lock, taken in
        index order), so one load's delta never holds another's. A lock not had within _MEASURE_WAIT_S (or
        `timeout_s`, the load's own start deadline, if shorter) leaves the load unmeasured rather than late:
        serving comes before measuring, and a start that hangs held the lock for its whole deadline
        (minutes for vLLM). The load measured meanwhile then counts this one's memory too: its figure is
        marked disturbed.
        """
        if self._nvml is None:
            yield
            return
        self.attribution.begin(holder, lease_mib)
        async with contextlib.AsyncExitStack() as stack:
            if self.attribution.pids_visible is not True:
                deadline = time.monotonic() + min(timeout_s, _MEASURE_WAIT_S)
                try:
                    for gpu in sorted(lease_mib):
                        if gpu in self._measuring:
                            lock = self._measuring[gpu]
                            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                                await lock.acquire()
                            stack.callback(lock.release)
                except TimeoutError:
                    log.warning("vram_measure_skipped", holder=holder, reason="another load kept its GPU")
                    self.attribution.disturb(lease_mib.keys())
                    await stack.aclose()
                    yield
                    return
            before = await asyncio.to_thread(self.usage)
            self.attribution.measured_before(holder, before)
            yield
            after = await asyncio.to_thread(self.usage)
            self.attribution.measured_after(holder, after)

    async def attribute_load(
        self, holder: str, lease_mib: Mapping[int, int], pids: Collection[int]
    ) -> Attribution | None:
        """What a ready child took, by pid when NVML shows its pids, else by the measured device delta."""
        if self._nvml is None:
            return None
        usage = await asyncio.to_thread(self.usage)
        return self.attribution.attribute(holder, lease_mib, pids, usage)

    async def begin_release(self, holder: str, pids: Collection[int]) -> None:
        """Just before a child is stopped: note its pids and the device's use, the baseline of the check."""
        if self._nvml is None:
            return
        usage = await asyncio.to_thread(self.usage)
        self.attribution.begin_release(holder, pids, usage)

    async def memory_still_held(self, holder: str) -> dict[int, int]:
        """MiB per GPU a stopped child still holds; while NVML cannot tell, its whole lease counts."""
        if self._nvml is None:
            return {}
        usage = await asyncio.to_thread(self.usage)
        return self.attribution.still_held(holder, usage)

    async def wait_memory_released(self, holder: str, timeout_s: float) -> dict[int, int]:
        """Poll until a stopped child's memory is seen free or the deadline passes; returns what is held."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = await self.memory_still_held(holder)
            if not held or time.monotonic() >= deadline:
                return held
            await asyncio.sleep(_RELEASE_POLL_S)

    def rename(self, holder: str, new_holder: str, lease_mib: Mapping[int, int]) -> None:
        """What `holder` left behind is now leased to `new_holder` (a `leaked:` lease)."""
        self.attribution.rename(holder, new_holder, lease_mib)

    def forget(self, holder: str) -> None:
        self.attribution.forget(holder)

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):  # a driver gone bad must not spoil the shutdown
                self._nvml.nvmlShutdown()


def _physical_totals(nvml: Any) -> dict[int, int]:
    """MiB of each device NVML sees, by index: a budget declared on a real GPU is still a share of it."""
    totals = {}
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            totals[i] = int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).total) // 2**20
    except nvml.NVMLError as exc:
        log.warning("nvml_query_failed", error=str(exc), using="declared gpus")
    return totals


def _import_pynvml() -> Any:
    # pynvml defines about 1 MiB of ctypes structures when imported, kept for the daemon's life. With
    # neither a driver nor NVIDIA's library on the host there is nothing for it to find, and the answer is
    # the same as its own "library not found": no NVML, GPUs declared or simulated.
    if not _NVIDIA_PROC.exists():
        try:
            ctypes.CDLL(_NVML_LIBRARY)
        except OSError:
            raise ImportError(f"{_NVML_LIBRARY} not found and no NVIDIA driver") from None
    import pynvml

    return pynvml


def _init_nvml(load: Callable[[], Any]) -> tuple[Any | None, tuple[str, bool] | None]:
    """(NVML, None) once initialised; else (None, (why, whether the library itself said a driver is here))
    or (None, None) when there is no NVML library at all."""
    try:
        nvml = load()
    except ImportError:
        return None, None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        if code in _NO_DRIVER_CODES:
            return None, (f"{exc} (NVML error {code})", False)
        return None, (f"{exc} (NVML error {code})", True)
    return nvml, None
