"""GpuInventory against a stand-in NVML (tests/fake_nvml/pynvml.py): start-up errors and run-time errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from supervisor import gpus
from supervisor.config import DeclaredGpu
from supervisor.gpus import GpuInventory, NvmlInitError
from tests.fake_nvml import pynvml as fake

ONE_GPU: dict[str, Any] = {"devices": [{"index": 0, "name": "Fake H100", "total_mib": 8192, "used_mib": 300}]}


class Driver:
    """The fake driver's control file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def set(self, **state: Any) -> None:
        self.path.write_text(json.dumps(state))


@pytest.fixture
def driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Driver]:
    path = tmp_path / "nvml.json"
    monkeypatch.setenv("FAKE_NVML_STATE", str(path))
    control = Driver(path)
    control.set(**ONE_GPU)
    yield control
    fake._initialised = 0


def detect(declared: list[DeclaredGpu] | None = None, driver_present: bool = False) -> GpuInventory:
    def load() -> ModuleType:
        return fake

    return GpuInventory.detect(declared, nvml_module=load, driver_present=lambda: driver_present)


def test_nvml_gpus_are_found(driver: Driver) -> None:
    inventory = detect()
    assert inventory.source == "nvml"
    found = [(g.index, g.total_mib, g.name, g.simulated) for g in inventory.gpus]
    assert found == [(0, 8192, "Fake H100", False)]
    inventory.close()


def test_an_init_failure_with_a_driver_refuses_to_guess(driver: Driver) -> None:
    driver.set(**ONE_GPU, init_error=True, init_error_code=fake.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
    with pytest.raises(NvmlInitError, match="declare `gpus:`"):
        detect()


def test_library_not_found_on_a_host_with_the_driver_is_refused_too(driver: Driver) -> None:
    driver.set(**ONE_GPU, init_error=True, init_error_code=fake.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(NvmlInitError):
        detect(driver_present=True)


def test_no_library_and_no_driver_means_one_assumed_gpu(driver: Driver) -> None:
    driver.set(**ONE_GPU, init_error=True, init_error_code=fake.NVML_ERROR_LIBRARY_NOT_FOUND)
    inventory = detect(driver_present=False)
    assert inventory.assumed
    assert not inventory.has_nvml


def test_declared_gpus_start_even_when_nvml_fails(driver: Driver) -> None:
    driver.set(**ONE_GPU, init_error=True)
    inventory = detect([DeclaredGpu(index=0, total_mib=4096)], driver_present=True)
    assert inventory.source == "declared"
    assert [g.total_mib for g in inventory.gpus] == [4096]


async def test_a_runtime_error_leaves_the_gpu_out_and_recovers(driver: Driver) -> None:
    inventory = detect()
    assert (await inventory.foreign_used_mib({}, {})) == {0: 300}
    driver.set(**ONE_GPU, runtime_error=True)
    assert (await inventory.foreign_used_mib({}, {})) == {}  # unknown, not zero
    assert inventory.query_error(0) is not None
    driver.set(**ONE_GPU)
    assert (await inventory.foreign_used_mib({}, {})) == {0: 300}
    assert inventory.query_error(0) is None
    inventory.close()


async def test_a_stopped_child_whose_memory_nvml_cannot_see_holds_its_whole_lease(driver: Driver) -> None:
    inventory = detect()
    async with inventory.measured_load("m#1", {0: 1000}, timeout_s=5):
        pass
    await inventory.begin_release("m#1", [12345])
    driver.set(**ONE_GPU, runtime_error=True)
    assert await inventory.wait_memory_released("m#1", timeout_s=0) == {0: 1000}
    inventory.close()


async def test_measured_loads_on_one_gpu_take_turns(driver: Driver) -> None:
    inventory = detect()
    order: list[str] = []
    async with inventory.measured_load("a#1", {0: 100}, timeout_s=5):
        order.append("a in")
        with pytest.raises(TimeoutError):
            async with asyncio_timeout(0.05), inventory.measured_load("b#2", {0: 100}, timeout_s=5):
                order.append("b in")  # pragma: no cover
        order.append("a out")
    assert order == ["a in", "a out"]
    inventory.close()


async def test_a_lock_not_had_by_the_deadline_leaves_the_load_unmeasured(driver: Driver) -> None:
    inventory = detect()
    async with (
        inventory.measured_load("a#1", {0: 100}, timeout_s=5),
        inventory.measured_load("b#2", {0: 100}, timeout_s=0),
    ):
        assert inventory.attribution.holdings["b#2"].before is None
    inventory.close()


def asyncio_timeout(seconds: float) -> Any:
    import asyncio

    return asyncio.timeout(seconds)


def test_without_driver_or_library_pynvml_is_not_even_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real loader, not the stand-in: on a host with neither (this one, CI) pynvml's ~1 MiB of ctypes
    definitions is never loaded, and the answer is the one NVML's own "library not found" gives."""
    monkeypatch.setattr(gpus, "_NVIDIA_PROC", tmp_path / "no-driver")
    monkeypatch.setattr(gpus, "_NVML_LIBRARY", "libnvidia-ml-that-is-not-here.so.1")
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    inventory = GpuInventory.detect(None)
    assert inventory.assumed
    assert not inventory.has_nvml
    assert "pynvml" not in sys.modules
