"""Fleet membership: each node's record in Redis, and the cached view of every live node.

`NodePublisher` writes `llmsup:node:<node_id>` (JSON, below) every TTL/3 with an expiry of TTL, read from
the scheduler (read only: the scheduler stays the only writer of slots and leases). A node that stops
renewing drops out when its key expires. `FleetView` reads every node's record about once a second and
keeps the last good snapshot; routing (fleet/routing.py) asks it where a model is ready and where to load
one, through the pure functions `ready_elsewhere()` and `best_node_to_load()`.

A record: {node_id, url, healthy, last_seen (epoch s), version, weights_on_disk: [model],
gpus: [{index, capacity_mib, leased_mib, used_mib, free_mib, shared}],
models: {name: {state, replicas, inflight, queued, max_inflight, keep_alive_expires_at, priority,
pinned, evictable, leases: {gpu index: MiB}}}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from supervisor import __version__
from supervisor.fleet.redis_link import FleetUnavailable, RedisLink
from supervisor.slots import SlotState, aggregate_state

if TYPE_CHECKING:
    from supervisor.config import Settings
    from supervisor.scheduler import Scheduler

log = structlog.get_logger("fleet.nodes")

NODE_PREFIX = "llmsup:node:"
VIEW_REFRESH_S = 1.0
_RUNNING = (SlotState.LOADING, SlotState.READY, SlotState.DRAINING, SlotState.STOPPING)


def node_key(node_id: str) -> str:
    return NODE_PREFIX + node_id


def weights_on_disk(scheduler: Scheduler) -> list[str]:
    """Models whose weights are a file or folder on this machine (file checks: call in a thread)."""
    found = []
    for name, manifest in scheduler.registry.models.items():
        with contextlib.suppress(OSError):
            weights = manifest.local_weights()
            if weights is not None and weights.exists():
                found.append(name)
    return sorted(found)


def node_record(
    scheduler: Scheduler, settings: Settings, healthy: bool, on_disk: Sequence[str], now: float | None = None
) -> dict[str, Any]:
    """This node as the fleet sees it, read from the scheduler without changing anything."""
    shared = scheduler.shared
    gpus = []
    for gpu in scheduler.inventory.gpus:
        if gpu.index not in scheduler.leases.capacity_mib:
            continue
        leased = scheduler.leases.leased_mib(gpu.index)
        usage = scheduler.inventory.last_usage.get(gpu.index)
        gpus.append(
            {
                "index": gpu.index,
                "capacity_mib": scheduler.leases.capacity_mib[gpu.index],
                "leased_mib": leased,
                "used_mib": usage.used_mib if usage is not None else leased,
                "free_mib": scheduler.leases.free_mib(gpu.index),
                "shared": shared is not None and shared.is_shared(gpu.index),
            }
        )
    models: dict[str, Any] = {}
    for name in scheduler.slots:
        group = scheduler.group(name)
        running = [s for s in group if s.state in _RUNNING]
        leases: dict[str, int] = {}
        for s in running:
            lease = scheduler.leases.get(s.key)
            for g, mib in (lease.mib_by_gpu if lease is not None else {}).items():
                leases[str(g)] = leases.get(str(g), 0) + mib
        expiries = [scheduler.expires_at(s) for s in running]
        expires_at = None if not expiries or None in expiries else max(e for e in expiries if e is not None)
        models[name] = {
            "state": str(aggregate_state(group)),
            "replicas": len(running),
            "inflight": sum(s.inflight for s in group),
            "queued": sum(s.waiters + len(s.admission) for s in group),
            "max_inflight": sum(s.inflight_limit() for s in group if s.state == SlotState.READY),
            "keep_alive_expires_at": expires_at,
            "priority": group[0].manifest.priority,
            "pinned": any(s.pinned for s in group),
            "evictable": bool(running) and all(s.is_idle and not s.pinned for s in running),
            "leases": leases,
        }
    return {
        "node_id": settings.node_id,
        "url": settings.advertised_url(),
        "healthy": healthy,
        "last_seen": time.time() if now is None else now,
        "version": __version__,
        "weights_on_disk": list(on_disk),
        "gpus": gpus,
        "models": models,
    }


# Publish this node's record, unless a live record of another process (its `instance`) holds the id at
# another URL: two nodes given one node_id would overwrite each other's record every few seconds, each
# hidden from the other's view. The same URL is this node's own earlier run (restarted before its record
# expired): taken over. Returns nil when published, else the other record's URL.
_PUBLISH = """
local current = redis.call('GET', KEYS[1])
if current then
  local ok, record = pcall(cjson.decode, current)
  if ok and type(record) == 'table' and type(record.instance) == 'string'
      and record.instance ~= ARGV[2] and record.url ~= ARGV[3] then
    return tostring(record.url)
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
return nil
"""
# Delete this node's record if it is still this process's own (not a namesake's, see _PUBLISH).
_LEAVE = """
local current = redis.call('GET', KEYS[1])
if current then
  local ok, record = pcall(cjson.decode, current)
  if ok and type(record) == 'table' and record.instance == ARGV[1] then
    redis.call('DEL', KEYS[1])
  end
end
return nil
"""


class NodePublisher:
    """Publishes this node's record every TTL/3 (with expiry TTL) while the daemon runs."""

    def __init__(self, link: RedisLink, settings: Settings, scheduler: Scheduler) -> None:
        self.link = link
        self.settings = settings
        self.scheduler = scheduler
        self.ttl_s = settings.fleet_ttl_s
        self._task: asyncio.Task[None] | None = None
        self.instance = uuid.uuid4().hex  # this process, told apart from another given the same node_id
        self._publish = link.client.register_script(_PUBLISH)
        self._leave = link.client.register_script(_LEAVE)
        self._conflict: str | None = None  # the namesake's URL last logged, so that it is logged once
        # As of the last publish (found in a thread: it looks at files). The fleet view takes this node's
        # record from record() too, and without them this node lost every "weights on disk" tie-break to
        # the others: a first load went to another node for nothing.
        self._on_disk: Sequence[str] = ()

    def record(self) -> dict[str, Any]:
        record = node_record(self.scheduler, self.settings, self.scheduler.accepting, self._on_disk)
        record["instance"] = self.instance
        return record

    async def publish(self) -> None:
        self._on_disk = await asyncio.to_thread(weights_on_disk, self.scheduler)
        record = json.dumps(self.record())
        url = self.settings.advertised_url()
        key = node_key(self.settings.node_id)
        held_by = await self.link.call(
            self._publish(keys=[key], args=[record, self.instance, url, int(self.ttl_s * 1000)])
        )
        if held_by is None:
            self._conflict = None
        elif held_by != self._conflict:
            self._conflict = held_by
            log.error(
                "node_id_conflict",
                node_id=self.settings.node_id,
                other_url=held_by,
                url=url,
                effect="not published: the fleet does not see this node until one of them changes node_id",
            )

    def start(self) -> None:
        self.link.on_rejoin(self.publish)  # back in the view at once, not a third of a TTL later
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            if self.link.healthy:
                with contextlib.suppress(FleetUnavailable):
                    await self.publish()
            await asyncio.sleep(self.ttl_s / 3)

    async def close(self) -> None:
        """Stop publishing and leave the fleet at once (if Redis answers; else the TTL does it)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.link.healthy:
            with contextlib.suppress(FleetUnavailable):
                key = node_key(self.settings.node_id)
                await self.link.call(self._leave(keys=[key], args=[self.instance]))


# --- the view of the fleet ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuState:
    index: int
    capacity_mib: int
    leased_mib: int
    used_mib: int
    free_mib: int
    shared: bool


@dataclass(frozen=True)
class ModelState:
    state: str
    replicas: int
    inflight: int
    queued: int
    max_inflight: int
    priority: int
    evictable: bool
    leases: dict[int, int] = field(default_factory=dict)
    keep_alive_expires_at: float | None = None


@dataclass(frozen=True)
class Node:
    node_id: str
    url: str
    healthy: bool
    last_seen: float
    gpus: tuple[GpuState, ...]
    models: dict[str, ModelState]
    weights_on_disk: frozenset[str]
    version: str
    record: dict[str, Any]  # as published, for /v1/admin/nodes

    @classmethod
    def parse(cls, raw: str | dict[str, Any]) -> Node:
        """A record as published; ValueError naming the first field of the wrong shape (another version's
        layout, or a stray write: the view skips it, and must not stop on it)."""
        try:
            return cls._parse(raw)
        except (OverflowError, RecursionError) as exc:  # a number past a float's range, nesting past Python's
            raise ValueError(f"record unreadable: {type(exc).__name__}") from None

    @classmethod
    def _parse(cls, raw: str | dict[str, Any]) -> Node:
        d = _object(json.loads(raw) if isinstance(raw, str) else raw, "record")
        return cls(
            _text(d.get("node_id"), "node_id"),
            _text(d.get("url"), "url"),
            _flag(d.get("healthy", True), "healthy"),
            _number(d.get("last_seen", 0), "last_seen"),
            tuple(_gpu(g) for g in _array(d.get("gpus", []), "gpus")),
            {
                _text(name, "models"): _model(name, m)
                for name, m in _object(d.get("models") or {}, "models").items()
            },
            frozenset(
                _text(w, "weights_on_disk") for w in _array(d.get("weights_on_disk", []), "weights_on_disk")
            ),
            str(d.get("version", "")),
            d,
        )


def _gpu(g: Any) -> GpuState:
    g = _object(g, "gpus[]")
    leased = _whole(g.get("leased_mib"), "gpus[].leased_mib")
    return GpuState(
        _whole(g.get("index"), "gpus[].index"),
        _whole(g.get("capacity_mib"), "gpus[].capacity_mib"),
        leased,
        _whole(g.get("used_mib", leased), "gpus[].used_mib"),
        _whole(g.get("free_mib"), "gpus[].free_mib"),
        _flag(g.get("shared", False), "gpus[].shared"),
    )


def _model(name: str, m: Any) -> ModelState:
    where = f"models.{name}"
    m = _object(m, where)
    expires = m.get("keep_alive_expires_at")
    return ModelState(
        _text(m.get("state"), f"{where}.state"),
        _whole(m.get("replicas", 0), f"{where}.replicas"),
        _whole(m.get("inflight", 0), f"{where}.inflight"),
        _whole(m.get("queued", 0), f"{where}.queued"),
        _whole(m.get("max_inflight", 0), f"{where}.max_inflight"),
        _whole(m.get("priority", 0), f"{where}.priority"),
        _flag(m.get("evictable", False), f"{where}.evictable"),
        {
            _gpu_index(g, f"{where}.leases"): _whole(mib, f"{where}.leases")
            for g, mib in _object(m.get("leases") or {}, f"{where}.leases").items()
        },
        None if expires is None else _number(expires, f"{where}.keep_alive_expires_at"),
    )


# A record's fields, checked for their JSON type: int("12") or .items() on a list would let a wrong record
# through, or fail with an error the view does not expect.


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{field} is not an object")
    return value


def _array(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{field} is not an array")
    return value


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field} is not a string")
    return value


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{field} is not true or false")
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{field} is not a number")
    return float(value)


def _gpu_index(value: Any, field: str) -> int:
    """A GPU index as a key: a string in JSON, an int in this node's own record (not serialized)."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return _whole(value, field)


def _whole(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} is not an integer")
    return value


@dataclass(frozen=True)
class ReadyPlace:
    """A node where a model is READY: how busy it is there."""

    node: Node
    inflight: int
    queued: int
    free_places: int


def ready_elsewhere(nodes: Iterable[Node], model: str, exclude: str | None = None) -> list[ReadyPlace]:
    """Healthy nodes (but `exclude`) with `model` READY, fewest in flight first, then least queued, then
    most free places."""
    places = []
    for node in nodes:
        state = node.models.get(model)
        if node.node_id == exclude or not node.healthy or state is None or state.state != "ready":
            continue
        places.append(
            ReadyPlace(node, state.inflight, state.queued, max(0, state.max_inflight - state.inflight))
        )
    return sorted(places, key=lambda p: (p.inflight, p.queued, -p.free_places, p.node.node_id))


def best_node_to_load(
    nodes: Iterable[Node], model: str, need_mib: int, priority: int | None = None, here: str | None = None
) -> Node | None:
    """The healthy node that serves `model` and can place `need_mib` on one GPU with the least eviction:
    free VRAM first, then by unloading idle models of priority <= `priority` (default the model's own,
    fewest victims first); a node with the weights on disk wins a tie, then the most free VRAM, then the
    node `here` (no hop); None if no node can."""
    best: tuple[tuple[int, int, bool, int, bool, str], Node] | None = None
    for node in nodes:
        state = node.models.get(model)
        if not node.healthy or state is None:
            continue
        limit = state.priority if priority is None else priority
        for gpu in node.gpus:
            cost: tuple[int, int] | None = None
            if gpu.free_mib >= need_mib:
                cost = (0, 0)
            else:
                idle = sorted(
                    (
                        m.leases[gpu.index]
                        for name, m in node.models.items()
                        if name != model and m.evictable and m.priority <= limit and gpu.index in m.leases
                    ),
                    reverse=True,
                )
                freed, victims = gpu.free_mib, 0
                for mib in idle:
                    if freed >= need_mib:
                        break
                    freed, victims = freed + mib, victims + 1
                if freed >= need_mib:
                    cost = (1, victims)
            if cost is None:
                continue
            elsewhere = node.node_id != here
            rank = (*cost, model not in node.weights_on_disk, -gpu.free_mib, elsewhere, node.node_id)
            if best is None or rank < best[0]:
                best = (rank, node)
    return None if best is None else best[1]


class FleetView:
    """Every live node's record, refreshed about once a second. While Redis is away the view is this node
    alone: a single host, as the node then serves (other nodes' records would only go stale)."""

    def __init__(
        self, link: RedisLink, local: Callable[[], dict[str, Any]], refresh_s: float = VIEW_REFRESH_S
    ):
        self.link = link
        self.local = local  # this node's record, fresh: it is always in the view
        self.refresh_s = refresh_s
        self._nodes: dict[str, Node] = {}
        self._invalid: dict[str, str] = {}  # key -> why, of the records skipped at the last refresh
        self.refreshed_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    def nodes(self) -> list[Node]:
        """Every node: the others as last read from Redis, this one as it is now; by node id."""
        mine = Node.parse(self.local())
        if not self.link.healthy:
            return [mine]
        others = [n for n in self._nodes.values() if n.node_id != mine.node_id]
        return sorted([mine, *others], key=lambda n: n.node_id)

    def has(self, node_id: str) -> bool:
        """Whether another node is in the view as last read from Redis (no record of this one is built)."""
        return node_id in self._nodes

    async def refresh(self) -> None:
        keys: list[str] = []
        async for key in self.link.client.scan_iter(match=NODE_PREFIX + "*", count=500):
            keys.append(key)
        raws = await self.link.client.mget(keys) if keys else []
        nodes = {}
        invalid: dict[str, str] = {}
        for key, raw in zip(keys, raws, strict=True):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                node = Node.parse(raw if isinstance(raw, str) else raw.decode())
            except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
                invalid[key] = str(exc)
                if self._invalid.get(key) != invalid[key]:  # once per record, not every second
                    log.warning("fleet_record_invalid", key=key, error=str(exc))
                continue
            nodes[node.node_id] = node
        self._nodes = nodes
        self._invalid = invalid
        self.refreshed_at = time.time()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        failed: str | None = None
        while True:
            if self.link.healthy:
                try:
                    await self.link.call(self.refresh())
                    failed = None
                except FleetUnavailable:
                    pass
                except Exception as exc:  # a bug: the view must go on, or it freezes for every route
                    if repr(exc) != failed:  # once until it changes or a refresh succeeds
                        log.error("fleet_view_refresh_failed", error=repr(exc), exc_info=exc)
                    failed = repr(exc)
            await asyncio.sleep(self.refresh_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
