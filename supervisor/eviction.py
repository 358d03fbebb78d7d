"""Which idle models to unload so that a new one fits: a pure function, so it is cheap to test hard."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A loaded model that could be unloaded: the caller passes only idle, unpinned ones."""

    key: str
    gpu: int
    mib: int
    priority: int
    last_used: float


def choose_victims(
    need_mib: int, free_mib: Mapping[int, int], candidates: Iterable[Candidate], max_priority: int
) -> list[Candidate] | None:
    """The fewest candidates, on one GPU, whose unloading frees `need_mib` there; None if no GPU can.

    On each GPU, candidates go lowest priority first, then least recently used, and never one above
    `max_priority` (the requester's). Among GPUs that can make room, the one with the fewest victims wins,
    then the one whose victims were used least recently.
    """
    by_gpu: dict[int, list[Candidate]] = {}
    for c in candidates:
        if c.priority <= max_priority and c.gpu in free_mib:
            by_gpu.setdefault(c.gpu, []).append(c)
    best: tuple[int, float, int] | None = None
    best_victims: list[Candidate] | None = None
    for gpu, pool in by_gpu.items():
        freed = free_mib[gpu]
        victims: list[Candidate] = []
        for c in sorted(pool, key=lambda c: (c.priority, c.last_used)):
            if freed >= need_mib:
                break
            victims.append(c)
            freed += c.mib
        if freed < need_mib or not victims:
            continue
        victims = _drop_unneeded(victims, freed - need_mib)
        rank = (len(victims), max(v.last_used for v in victims), gpu)
        if best is None or rank < best:
            best, best_victims = rank, victims
    return best_victims


def _drop_unneeded(victims: list[Candidate], surplus_mib: int) -> list[Candidate]:
    """Spare victims whose memory is not needed after all (an old small model picked before a big one).

    The most valuable victims (last in eviction order) are tried first, so what is spared is what we
    would most like to keep.
    """
    kept: list[Candidate] = []
    for victim in reversed(victims):
        if victim.mib <= surplus_mib:
            surplus_mib -= victim.mib
        else:
            kept.append(victim)
    kept.reverse()
    return kept
