"""The VRAM lease map: how many MiB each model holds on which GPU.

Invariant: on every GPU the leases add up to at most its total minus the safety margin. The scheduler
is the only caller; it takes a lease before a child starts and releases it after the child is gone. With
NVML, memory a stopped child has not given back stays leased under a `leaked:<model>#<n>` holder until
NVML shows it free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from supervisor.gpus import Gpu

LEAKED_PREFIX = "leaked:"  # holder of memory a stopped child still held when its release was checked


@dataclass(frozen=True)
class Lease:
    holder: str
    mib_by_gpu: Mapping[int, int]

    @property
    def gpu_indices(self) -> list[int]:
        return sorted(self.mib_by_gpu)


class LeaseError(Exception):
    pass


class LeaseMap:
    def __init__(self, gpus: Iterable[Gpu], margin_mib: int) -> None:
        self.capacity_mib = {g.index: max(0, g.total_mib - margin_mib) for g in gpus}
        self._leases: dict[str, Lease] = {}

    def leased_mib(self, gpu: int) -> int:
        return sum(lease.mib_by_gpu.get(gpu, 0) for lease in self._leases.values())

    def leaked_mib(self, gpu: int) -> int:
        return sum(
            lease.mib_by_gpu.get(gpu, 0)
            for lease in self._leases.values()
            if lease.holder.startswith(LEAKED_PREFIX)
        )

    def free_mib(self, gpu: int) -> int:
        return self.capacity_mib[gpu] - self.leased_mib(gpu)

    def largest_capacity_mib(self) -> int:
        return max(self.capacity_mib.values(), default=0)

    def take(self, holder: str, mib_by_gpu: Mapping[int, int]) -> Lease:
        """Lease MiB on one or more GPUs, all or nothing: a refused lease holds nothing anywhere.

        GPUs are checked in index order, the order every multi-GPU lease uses, so that two loads could
        never each hold part of what the other needs even if leasing ever became incremental.
        """
        if holder in self._leases:
            raise LeaseError(f"{holder} already holds a lease")
        if not mib_by_gpu:
            raise LeaseError(f"{holder} asked for a lease on no GPU")
        for gpu in sorted(mib_by_gpu):
            mib = mib_by_gpu[gpu]
            if gpu not in self.capacity_mib:
                raise LeaseError(f"there is no GPU {gpu}")
            if mib < 0:
                raise LeaseError(f"{holder} asked for {mib} MiB; a lease cannot be negative")
            if self.free_mib(gpu) < mib:
                raise LeaseError(f"GPU {gpu} has {self.free_mib(gpu)} MiB free, {holder} needs {mib}")
        lease = Lease(holder, dict(sorted(mib_by_gpu.items())))
        self._leases[holder] = lease
        return lease

    def release(self, holder: str) -> Lease | None:
        return self._leases.pop(holder, None)

    def get(self, holder: str) -> Lease | None:
        return self._leases.get(holder)

    def holders(self) -> list[Lease]:
        return list(self._leases.values())

    def snapshot(self) -> list[dict[str, object]]:
        """Per GPU: capacity, leased, free and who holds what; for /health and logs."""
        return [
            {
                "gpu": g,
                "capacity_mib": cap,
                "leased_mib": self.leased_mib(g),
                "leaked_mib": self.leaked_mib(g),
                "free_mib": self.free_mib(g),
                "leases": {
                    lease.holder: lease.mib_by_gpu[g]
                    for lease in self._leases.values()
                    if g in lease.mib_by_gpu
                },
            }
            for g, cap in sorted(self.capacity_mib.items())
        ]
