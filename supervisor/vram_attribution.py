"""Whose GPU memory is whose: the daemon's children, what stopped children left, or other tenants.

NVML reports each device's used memory and the pids of its compute processes. On a host (or a container
that shares the host's pid namespace) those pids are ours, and a child's memory is what its pids hold:
method `pid`. In a container with its own pid namespace NVML reports host pids that match none of ours;
then a child's memory is the rise in the device's used memory from just before its spawn to its
readiness, measured with no other load on that GPU: method `device_delta`.

Every holder of a lease is attributed at most its lease on each GPU; all other used memory is foreign,
so the scheduler never leases it. Pure bookkeeping over NVML snapshots; GpuInventory feeds it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

import structlog

log = structlog.get_logger("vram_attribution")

Method = Literal["pid", "device_delta"]


@dataclass(frozen=True)
class GpuUsage:
    used_mib: int  # the device's used memory, whoever uses it
    processes: Mapping[int, int]  # pid (in NVML's pid namespace) -> MiB, for compute processes


@dataclass(frozen=True)
class Attribution:
    method: Method
    mib_by_gpu: dict[int, int]
    trusted: bool  # False: memory was freed on its GPUs while it was measured; not a figure to learn from


@dataclass
class Holding:
    """One lease holder's memory as far as NVML lets us tell: a child, or what a stopped child left."""

    lease_mib: dict[int, int]
    pids: frozenset[int] = frozenset()
    before: dict[int, int] | None = None  # device used MiB just before its spawn (measured loads only)
    after: dict[int, int] | None = None  # ... and once it was ready
    disturbed: bool = False  # memory came or went on one of its GPUs while it was measured
    method: Method | None = None
    mib_by_gpu: dict[int, int] = field(default_factory=dict)  # what it took, once attributed
    stop_used: dict[int, int] | None = None  # device used MiB when its stop began
    stop_others: dict[int, int] | None = None  # what our other holders were attributed then


def release_slack_mib(mib: int) -> int:
    """How much of a device delta may stay "used" after a stop and still count as given back (noise)."""
    return max(64, mib // 20)


class VramAttribution:
    def __init__(self) -> None:
        self.holdings: dict[str, Holding] = {}
        # None until a load tells: True once NVML showed a child's pids, False once it showed only others.
        self.pids_visible: bool | None = None

    # --- the life of a holding ------------------------------------------------------------------

    def begin(self, holder: str, lease_mib: Mapping[int, int]) -> None:
        self.holdings[holder] = Holding(dict(lease_mib))

    def measured_before(self, holder: str, usage: Mapping[int, GpuUsage]) -> None:
        holding = self.holdings.get(holder)
        if holding is not None and all(g in usage for g in holding.lease_mib):
            holding.before = {g: usage[g].used_mib for g in holding.lease_mib}
            # Memory a stopped child is still giving back would make the rise look smaller than it is.
            holding.disturbed = any(
                other.stop_used is not None and other.lease_mib.keys() & holding.lease_mib
                for other in self.holdings.values()
            )

    def disturb(self, gpus: Collection[int]) -> None:
        """A load starts unmeasured on these GPUs: the loads being measured there will count it too."""
        for holding in self.holdings.values():
            if holding.before is not None and holding.after is None and holding.lease_mib.keys() & gpus:
                holding.disturbed = True

    def measured_after(self, holder: str, usage: Mapping[int, GpuUsage]) -> None:
        holding = self.holdings.get(holder)
        if holding is not None and holding.before is not None and all(g in usage for g in holding.lease_mib):
            holding.after = {g: usage[g].used_mib for g in holding.lease_mib}

    def attribute(
        self, holder: str, lease_mib: Mapping[int, int], pids: Collection[int], usage: Mapping[int, GpuUsage]
    ) -> Attribution | None:
        """Decide how much a ready child took: by its pids if NVML lists them, else by the device delta
        of its measured load (None when neither tells)."""
        holding = self.holdings.setdefault(holder, Holding(dict(lease_mib)))
        holding.pids = frozenset(pids)
        by_pid = _pid_mib(holding.pids, usage)
        if any(by_pid.values()):
            self.pids_visible = True
            holding.method, holding.mib_by_gpu = "pid", {g: m for g, m in by_pid.items() if m}
            return Attribution("pid", holding.mib_by_gpu, trusted=True)
        if holding.before is None or holding.after is None:
            return None
        delta = {g: max(0, holding.after[g] - holding.before[g]) for g in holding.lease_mib}
        if not any(delta.values()):
            return None
        if any(u.processes for g, u in usage.items() if g in holding.lease_mib):
            self.pids_visible = False  # NVML lists processes there, none of them ours: another namespace
        holding.method, holding.mib_by_gpu = "device_delta", delta
        return Attribution("device_delta", delta, trusted=not holding.disturbed)

    def begin_release(self, holder: str, pids: Collection[int], usage: Mapping[int, GpuUsage]) -> None:
        """Note the baseline a stop is checked against, and spoil the measurement of loads it overlaps."""
        holding = self.holdings.get(holder)
        if holding is None:
            return
        holding.pids = holding.pids | frozenset(pids)
        for other in self.holdings.values():
            if other is not holding and other.method is None and other.lease_mib.keys() & holding.lease_mib:
                other.disturbed = True
        if holding.method is None and holding.before is not None and not self.pids_visible:
            # Stopped before it was attributed (a failed or cancelled load): what it had taken so far.
            holding.method = "device_delta"
            holding.mib_by_gpu = {
                g: _clamp(usage[g].used_mib - holding.before[g], holding.lease_mib[g])
                for g in holding.lease_mib
                if g in usage
            }
        if all(g in usage for g in holding.lease_mib):
            holding.stop_used = {g: usage[g].used_mib for g in holding.lease_mib}
            holding.stop_others = self._ours(usage, exclude=holder)

    def still_held(self, holder: str, usage: Mapping[int, GpuUsage]) -> dict[int, int]:
        """MiB per GPU that a stopped holder has not given back yet (all its lease where NVML is silent)."""
        holding = self.holdings.get(holder)
        if holding is None:
            return {}
        unknown = {g: m for g, m in holding.lease_mib.items() if g not in usage}
        if holding.method == "device_delta":
            if holding.stop_used is None or holding.stop_others is None:
                return unknown or dict(holding.lease_mib)  # no baseline: only a full lease is safe
            others = self._ours(usage, exclude=holder)
            held = {}
            for gpu, took in holding.mib_by_gpu.items():
                if gpu not in usage:
                    continue
                # What the device uses beyond the baseline without it, net of our other holders' changes.
                moved = others.get(gpu, 0) - holding.stop_others.get(gpu, 0)
                baseline = holding.stop_used[gpu] - took + moved
                left = _clamp(usage[gpu].used_mib - baseline, took)
                if left > release_slack_mib(took):
                    held[gpu] = left
            return {**held, **unknown}
        by_pid = {g: m for g, m in _pid_mib(holding.pids, usage).items() if m}
        return {**by_pid, **unknown}

    def rename(self, holder: str, new_holder: str, lease_mib: Mapping[int, int]) -> None:
        holding = self.holdings.pop(holder, None)
        if holding is not None:
            holding.lease_mib = dict(lease_mib)
            self.holdings[new_holder] = holding

    def forget(self, holder: str) -> None:
        self.holdings.pop(holder, None)

    def sync(self, leases: Mapping[str, Mapping[int, int]], pids: Mapping[str, Collection[int]]) -> None:
        """Follow the lease map (the truth about who holds what) and each running child's current tree."""
        for holder in self.holdings.keys() - leases.keys():
            del self.holdings[holder]
        for holder, lease_mib in leases.items():
            holding = self.holdings.setdefault(holder, Holding(dict(lease_mib)))
            if holder in pids:
                holding.pids = frozenset(pids[holder])

    # --- what is not ours -----------------------------------------------------------------------

    def foreign_mib(self, usage: Mapping[int, GpuUsage]) -> dict[int, int]:
        """Used MiB per GPU beyond what our holders are attributed (each at most its lease there)."""
        ours = self._ours(usage)
        return {g: max(0, u.used_mib - ours.get(g, 0)) for g, u in usage.items()}

    def attributed_mib(self, holder: str, usage: Mapping[int, GpuUsage]) -> dict[int, int]:
        holding = self.holdings.get(holder)
        return {} if holding is None else self._holding_mib(holding, usage)

    def _ours(self, usage: Mapping[int, GpuUsage], exclude: str | None = None) -> dict[int, int]:
        ours: dict[int, int] = {}
        for holder, holding in self.holdings.items():
            if holder != exclude:
                for gpu, mib in self._holding_mib(holding, usage).items():
                    ours[gpu] = ours.get(gpu, 0) + mib
        return ours

    def _holding_mib(self, holding: Holding, usage: Mapping[int, GpuUsage]) -> dict[int, int]:
        by_pid = _pid_mib(holding.pids, usage)
        found: dict[int, int] = {}
        for gpu, lease in holding.lease_mib.items():
            if gpu not in usage:
                continue
            if holding.method == "device_delta":
                mib = holding.mib_by_gpu.get(gpu, 0)
            elif holding.method is None and holding.before is not None and not self.pids_visible:
                # Still loading in another pid namespace: the rise since its spawn is its, up to its lease.
                mib = max(by_pid.get(gpu, 0), usage[gpu].used_mib - holding.before[gpu])
            else:
                mib = by_pid.get(gpu, 0)
            found[gpu] = _clamp(mib, lease)
        return found


def _pid_mib(pids: Collection[int], usage: Mapping[int, GpuUsage]) -> dict[int, int]:
    return {g: sum(m for p, m in u.processes.items() if p in pids) for g, u in usage.items()}


def _clamp(mib: int, most: int) -> int:
    return max(0, min(mib, most))
