"""A stand-in for nvidia-ml-py's `pynvml` (the NVIDIA driver's NVML library), for machines with no GPU.

It exposes only what the daemon calls: nvmlInit, nvmlShutdown, nvmlDeviceGetCount,
nvmlDeviceGetHandleByIndex, nvmlDeviceGetMemoryInfo, nvmlDeviceGetName, nvmlDeviceGetUUID,
nvmlDeviceGetComputeRunningProcesses (and _v3), NVMLError and the NVML_ERROR_* codes it raises.
A daemon started with PYTHONPATH=tests/fake_nvml first imports this module instead of the real one.

Behaviour comes from the JSON file named by env FAKE_NVML_STATE, re-read on every call, so a test (or
any other process) can change the "driver" while the daemon runs:

    {
      "init_error": false,        # nvmlInit raises NVMLError(init_error_code), as a driver/library
      "init_error_code": 18,      #   mismatch does (18: NVML_ERROR_LIB_RM_VERSION_MISMATCH)
      "runtime_error": false,     # every query after init raises NVMLError(NVML_ERROR_UNKNOWN)
      "devices": [{"index": 0, "name": "Fake GPU", "total_mib": 8192, "used_mib": 300}],
      "processes": [
        {"gpu": 0, "pid": 4242, "used_mib": 1000},       # a fixed pid: another tenant's process
        {"gpu": 0, "argv_has": ["--alias", "a"],         # each live descendant of this process whose
         "used_mib": 700,                                #   argv holds this run of arguments
         "namespace": "own",                             # "other": listed under a pid this namespace
                                                         #   does not have (NVML in a container)
         "linger_s": 0,                                  # still listed this long after it exits
         "hold": false}                                  # still listed after it exits, until set false
      ]
    }

A device's used memory is its `used_mib` plus every process listed on it, as NVML's would be.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999

OTHER_NAMESPACE_OFFSET = 10_000_000  # above any pid_max: no process here has such a pid
_MIB = 1 << 20


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


@dataclass
class _Memory:
    total: int
    used: int
    free: int


@dataclass
class _Process:
    pid: int
    usedGpuMemory: int | None


_initialised = 0
# (rule key, pid) -> monotonic time the process was last seen alive; lingering memory is timed from it.
_seen: dict[tuple[str, int], float] = {}


def _state() -> dict[str, Any]:
    path = os.environ.get("FAKE_NVML_STATE")
    if not path:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    data: dict[str, Any] = json.loads(open(path, encoding="utf-8").read())  # noqa: SIM115
    return data


def _query() -> dict[str, Any]:
    state = _state()
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if state.get("runtime_error"):
        raise NVMLError(NVML_ERROR_UNKNOWN)
    return state


def nvmlInit() -> None:
    global _initialised
    state = _state()
    if state.get("init_error"):
        raise NVMLError(int(state.get("init_error_code", NVML_ERROR_LIB_RM_VERSION_MISMATCH)))
    _initialised += 1


def nvmlShutdown() -> None:
    global _initialised
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _initialised -= 1


def nvmlDeviceGetCount() -> int:
    return len(_query().get("devices", []))


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return index


def _device(state: dict[str, Any], handle: int) -> dict[str, Any]:
    for device in state.get("devices", []):
        if int(device.get("index", -1)) == handle:
            return dict(device)
    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceGetName(handle: int) -> str:
    return str(_device(_query(), handle).get("name", "Fake GPU"))


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_device(_query(), handle).get("uuid", f"GPU-fake-{handle}"))


def nvmlDeviceGetMemoryInfo(handle: int, version: int | None = None) -> _Memory:
    state = _query()
    device = _device(state, handle)
    total = int(device.get("total_mib", 8192)) * _MIB
    used = int(device.get("used_mib", 0)) * _MIB
    used += sum(p.usedGpuMemory or 0 for p in _processes(state, handle))
    used = min(used, total)
    return _Memory(total=total, used=used, free=total - used)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[_Process]:
    state = _query()
    _device(state, handle)
    return _processes(state, handle)


nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses


def _processes(state: dict[str, Any], gpu: int) -> list[_Process]:
    found: list[_Process] = []
    descendants: list[psutil.Process] | None = None
    now = time.monotonic()
    for rule in state.get("processes", []):
        if int(rule.get("gpu", 0)) != gpu:
            continue
        mib = int(rule.get("used_mib", 0)) * _MIB
        if "pid" in rule:
            found.append(_Process(int(rule["pid"]), mib))
            continue
        wanted = [str(a) for a in rule.get("argv_has", [])]
        key = json.dumps([gpu, wanted])
        if descendants is None:
            try:
                descendants = psutil.Process().children(recursive=True)
            except psutil.Error:
                descendants = []
        alive: set[int] = set()
        for proc in descendants:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE or not _has_run(proc.cmdline(), wanted):
                    continue
            except psutil.Error:
                continue
            alive.add(proc.pid)
            _seen[(key, proc.pid)] = now
        offset = OTHER_NAMESPACE_OFFSET if rule.get("namespace") == "other" else 0
        for (seen_key, pid), last_alive in list(_seen.items()):
            if seen_key != key:
                continue
            lingering = rule.get("hold") or now - last_alive < float(rule.get("linger_s", 0))
            if pid in alive or lingering:
                found.append(_Process(pid + offset, mib))
            else:
                del _seen[(seen_key, pid)]
    return found


def _has_run(argv: list[str], wanted: list[str]) -> bool:
    """Whether `wanted` appears in `argv` as consecutive arguments."""
    n = len(wanted)
    return any(argv[i : i + n] == wanted for i in range(len(argv) - n + 1))
