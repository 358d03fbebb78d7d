"""Where a model goes, and which idle models must make way: one pure function, cheap to test hard.

The scheduler describes the world (free MiB per GPU, the models holding leases) and asks for a Plan: the
MiB to lease on each GPU, and the idle models to unload first. It never sees a half-made decision, and
the property tests can replay thousands of load / finish / crash / unload sequences through it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from supervisor.eviction import Candidate, choose_victims


@dataclass(frozen=True)
class Holder:
    """A model that holds a lease now."""

    key: str
    mib_by_gpu: Mapping[int, int]
    priority: int
    last_used: float
    evictable: bool  # READY, nobody using or waiting for it, not pinned
    model: bool = True  # a model's; not memory a stopped child left behind (a `leaked:` lease)
    name: str = ""  # the model's (its replicas share it); "": the key's own

    @property
    def model_name(self) -> str:
        return self.name or self.key


@dataclass(frozen=True)
class Request:
    """What a load needs: `need_mib` in all, split evenly over `tensor_parallel` GPUs."""

    need_mib: int
    tensor_parallel: int = 1
    allowed_gpus: Collection[int] | None = None  # None: any
    priority: int = 0  # may evict holders of this priority or lower
    model: str = ""  # the model loading: its own replicas count as one loaded model with it

    @property
    def per_gpu_mib(self) -> int:
        return math.ceil(self.need_mib / self.tensor_parallel)


@dataclass(frozen=True)
class Plan:
    mib_by_gpu: dict[int, int]
    victims: list[str] = field(default_factory=list)  # holder keys to unload before leasing


def eligible_gpus(request: Request, capacity_mib: Mapping[int, int]) -> list[int]:
    """The GPUs the request may use at all, in index order."""
    allowed = capacity_mib.keys() if request.allowed_gpus is None else request.allowed_gpus
    return sorted(g for g in allowed if g in capacity_mib)


def can_ever_fit(request: Request, capacity_mib: Mapping[int, int]) -> bool:
    """Whether the request fits on empty GPUs; if not, no amount of waiting or evicting helps."""
    sizes = [capacity_mib[g] for g in eligible_gpus(request, capacity_mib)]
    return sum(1 for s in sizes if s >= request.per_gpu_mib) >= request.tensor_parallel


def plan_placement(
    request: Request,
    free_mib: Mapping[int, int],
    holders: Sequence[Holder],
    max_loaded: int | None = None,
) -> Plan | None:
    """The cheapest way to place `request` now, or None if it must wait (or can never fit).

    Without evictions: the `tensor_parallel` GPUs with the least free memory that still fit (best fit keeps
    big gaps for big models). Otherwise, per GPU, the fewest idle victims of priority <= the request's,
    lowest priority then least recently used first (see eviction.choose_victims), and the GPUs whose
    victims cost least. `max_loaded` (models loaded at once) may add victims wherever they are.
    """
    per_gpu = request.per_gpu_mib
    gpus = eligible_gpus(request, free_mib)
    if len(gpus) < request.tensor_parallel:
        return None
    # Never a replica of the model loading: it would be evicted for its sibling, for nothing.
    evictable = [
        h
        for h in holders
        if h.evictable
        and h.priority <= request.priority
        and not (request.model and h.model_name == request.model)
    ]

    # Per GPU: the victims it takes to make room there ([] when it fits already), cheapest GPUs first.
    options: list[tuple[tuple[int, int, float, int, int], int, list[str]]] = []
    for gpu in gpus:
        if free_mib[gpu] >= per_gpu:
            options.append(((0, 0, 0.0, free_mib[gpu], gpu), gpu, []))
            continue
        pool = [
            Candidate(h.key, gpu, h.mib_by_gpu[gpu], h.priority, h.last_used)
            for h in evictable
            if gpu in h.mib_by_gpu
        ]
        chosen = choose_victims(per_gpu, {gpu: free_mib[gpu]}, pool, request.priority)
        if chosen is None:
            continue
        cost = (len(chosen), max(c.priority for c in chosen), max(c.last_used for c in chosen), 0, gpu)
        options.append((cost, gpu, [c.key for c in chosen]))
    if len(options) < request.tensor_parallel:
        return None
    options.sort(key=lambda option: option[0])
    picked = options[: request.tensor_parallel]
    victims = list(dict.fromkeys(key for _, _, keys in picked for key in keys))
    if request.tensor_parallel > 1 and len(victims) > 1:
        victims = _spare_unneeded(victims, [gpu for _, gpu, _ in picked], per_gpu, free_mib, holders)

    if max_loaded is not None:
        extra = _over_max_loaded(request, holders, evictable, victims, max_loaded)
        if extra is None:
            return None
        victims += extra
    return Plan({gpu: per_gpu for _, gpu, _ in sorted(picked, key=lambda option: option[1])}, victims)


def _spare_unneeded(
    victims: list[str], gpus: list[int], per_gpu: int, free_mib: Mapping[int, int], holders: Sequence[Holder]
) -> list[str]:
    """Victims chosen GPU by GPU, less those not needed on any of `gpus` once the others are gone: a
    model spread over two of them frees room on both, and the one chosen for the second GPU alone was
    unloaded for nothing. The most valuable are tried first (last in eviction order), as in
    eviction._drop_unneeded."""
    held = {h.key: h for h in holders}

    def room(keys: list[str]) -> bool:
        return all(free_mib[g] + sum(held[k].mib_by_gpu.get(g, 0) for k in keys) >= per_gpu for g in gpus)

    for key in sorted(victims, key=lambda k: (held[k].priority, held[k].last_used), reverse=True):
        rest = [k for k in victims if k != key]
        if room(rest):
            victims = rest
    return victims


def _over_max_loaded(
    request: Request,
    holders: Sequence[Holder],
    evictable: Sequence[Holder],
    victims: list[str],
    max_loaded: int,
) -> list[str] | None:
    """The victims on other GPUs too, if that many models may not be loaded at once (None: they are not
    there). Models are counted, as OLLAMA_MAX_LOADED_MODELS counts them: a model's replicas are one, and
    a replica of the model loading adds none (counted as one each, replicas evicted each other). A model
    is a victim only with all its replicas. Memory a stopped child left behind is room lost, not a model
    loaded: counted as one, it could never be evicted, and no model could load until the driver gave it
    back."""
    loaded = {h.model_name for h in holders if h.model and h.key not in victims}
    adds = 0 if request.model and request.model in loaded else 1  # a replica of a loaded model: none
    excess = len(loaded) + adds - max_loaded
    if excess <= 0:
        return []
    by_model: dict[str, list[Holder]] = {}
    for holder in holders:
        if holder.model and holder.key not in victims:
            by_model.setdefault(holder.model_name, []).append(holder)
    allowed = {h.key for h in evictable}
    spare = sorted(
        (
            (max(h.priority for h in held), max(h.last_used for h in held), name)
            for name, held in by_model.items()
            if name != request.model and all(h.key in allowed for h in held)
        )
    )
    if len(spare) < excess:
        return None
    return [h.key for _, _, name in spare[:excess] for h in by_model[name]]
