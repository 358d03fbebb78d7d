"""The scheduler: the only writer of slot states and leases.

Routes call `acquire()` and get a Ticket for a READY slot; everything that makes that possible (starting
a child, making room by unloading idle models, waiting in a bounded queue, keep-alive timers, reloads and
shutdown) happens here. A load runs in a task of its own that every request for the model awaits, so a
client that goes away does not cancel a load that others are waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Coroutine
from dataclasses import replace
from time import monotonic
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog

from supervisor import cpus, errors
from supervisor import overrides as load_overrides
from supervisor.config import Settings
from supervisor.estimates import ObservedVram, VramEstimate, VramUnknown, estimate_vram, fingerprint
from supervisor.events import EventBus, vram_source
from supervisor.eviction import Candidate, choose_victims
from supervisor.gpus import GpuInventory
from supervisor.leases import LEAKED_PREFIX, LeaseMap
from supervisor.manifests import Manifest, Registry, diff
from supervisor.metrics import Metrics
from supervisor.overrides import Overrides
from supervisor.placement import Holder, Plan, Request, can_ever_fit, plan_placement
from supervisor.slots import FailureReport, ModelSlot, SlotState
from workers import worker_for
from workers.base import ChildKey, Endpoint, GpuPlacement, LaunchError, LaunchSpec
from workers.process import ChildProcess, ChildStartError, describe_exit

if TYPE_CHECKING:
    from supervisor.fleet.shared_gpus import SharedGpus

log = structlog.get_logger("scheduler")

_QUEUE_FULL_RETRY_S = 5.0
_NVML_RETRY_S = 1.0  # a load waiting on a GPU NVML cannot report on looks again this often
_LEAK_RECHECK_MAX_S = 2.0  # a leaked lease is re-checked at least this often
# A load waiting for room looks again this often even unwoken: with NVML, another process may free memory.
_ROOM_RECHECK_S = 1.0
# How long a request whose child refused it waits for the exit to be seen before it asks again.
_EXIT_NOTICE_S = 5.0
# A serving child is looked at this often for a hang: a sixth of hang_timeout_s, within these bounds.
_HANG_POLL_MIN_S = 0.5
_HANG_POLL_MAX_S = 10.0
_HANG_CPU_SHARE = 0.01  # less CPU than this share of hang_timeout_s over it counts as none
_QUEUE_EVENT_S = 0.5  # `queue` events: at most one per model this often (the latest count always comes)
_SESSIONS_KEPT = 10_000  # sticky sessions remembered (least recently used forgotten first)


def _expire(turn: asyncio.Future[bool]) -> None:
    """A queued request's deadline has come: its wait for a turn ends in TimeoutError."""
    if not turn.done():
        turn.set_exception(TimeoutError())


class Claim:
    """What a request asked for, kept on its ticket so that it can ask once more (Scheduler.reacquire).
    A class of its own rather than a NamedTuple: compiled, it is built without a Python call."""

    __slots__ = ("arrived", "client_id", "deadline", "keep_alive", "priority", "requested", "session")

    def __init__(
        self,
        requested: str,
        keep_alive: float | None,
        priority: int | None,
        client_id: str | None,
        deadline: float,  # loop time by which it must hold a ticket: queue_timeout_s after it arrived
        session: str | None = None,  # requests of one session go to one replica, whose prompt cache has it
        arrived: float = 0.0,  # monotonic()
    ) -> None:
        self.arrived = arrived
        self.requested = requested
        self.keep_alive = keep_alive
        self.priority = priority
        self.client_id = client_id
        self.deadline = deadline
        self.session = session


class Ticket:
    """One request's claim on a READY slot. Release it exactly once, when the response has ended.

    `process` is the child the ticket was issued for: a child that dies later never leaves it without an
    endpoint, and a request that finds it gone can tell the scheduler which child that was.
    `load_s` and `queue_s` are the seconds `acquire()` waited for the model to load and then for a turn.
    """

    __slots__ = ("_released", "_scheduler", "claim", "load_s", "process", "queue_s", "slot")

    def __init__(self, scheduler: Scheduler, slot: ModelSlot, process: ChildProcess, claim: Claim) -> None:
        self.slot = slot
        self.process = process
        self.claim = claim
        self._scheduler = scheduler
        self._released = False
        self.load_s = 0.0
        self.queue_s = 0.0

    def _waited_since(self, started: float) -> None:
        """Split the wait since `started` (monotonic): until the slot became READY, if it did meanwhile,
        the model was loading (or starting again); the rest was waiting for a turn."""
        waited = monotonic() - started
        ready_at = self.slot.entered_at
        self.load_s = min(waited, ready_at - started) if ready_at > started else 0.0
        self.queue_s = waited - self.load_s

    @property
    def endpoint(self) -> Endpoint:
        return self.process.endpoint

    @property
    def api_key(self) -> str | None:
        """The key the child demands on every request; the proxy sends it, nobody else has it."""
        return self.process.api_key

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._scheduler._release(self.slot)


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        inventory: GpuInventory,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        events: EventBus | None = None,
        shared: SharedGpus | None = None,
    ) -> None:
        self.settings = settings
        # GPUs whose leases live in Redis (supervisor/fleet/shared_gpus.py); None: no fleet.
        self.shared = shared
        self.events = events if events is not None else EventBus()
        self.registry = registry
        self.inventory = inventory
        self.leases = LeaseMap(inventory.gpus, settings.gpu_margin_mib)
        self.metrics = metrics
        self._session = session
        self._keys = itertools.count(1)
        # Replica 0 of each model, by name: what routes read. Replicas 1.. live in `replicas`.
        self.slots: dict[str, ModelSlot] = {name: self._new_slot(m) for name, m in registry.models.items()}
        self.replicas: dict[str, list[ModelSlot]] = {}
        self._sessions: OrderedDict[tuple[str, str], int] = OrderedDict()  # (model, session) -> replica
        self._scaling: set[str] = set()  # models with a scale-up under way
        # Runtime load overrides by model, until it unloads (POST /v1/admin/models/{name}/load).
        self.overrides: dict[str, Overrides] = {}
        self._override_loads: Counter[str] = Counter()  # load() calls under way, by model
        self.queued = 0
        self.accepting = True
        self._room = asyncio.Event()  # set (and replaced) whenever memory may have become available
        self._placing: dict[
            str, tuple[int, int, Request]
        ] = {}  # loads waiting for room: key -> (prio, seq, req)
        self._placing_order = itertools.count()
        # Loads waiting for room that busy models of lower priority hold: key -> the keys of those models,
        # which take no new request until the load is placed (see _yield_for).
        self._yields: dict[str, set[str]] = {}
        self.observed = ObservedVram(settings.state_dir / "observed_vram.json")
        self._tasks: set[asyncio.Task[Any]] = set()
        self._keepers: dict[str, asyncio.Task[None]] = {}  # slot key -> the task keeping it loaded (pinned)
        self._closing_future: asyncio.Future[None] | None = None
        self._abandoned_future: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # see _running_loop
        self._drain_deadline: float | None = None  # loop time the shutdown's drain ends
        # Per model of several replicas: set when one of them comes up (see _wake_siblings).
        self._replica_up: dict[str, asyncio.Future[None]] = {}

    # --- requests ---------------------------------------------------------------------------------

    async def acquire(
        self,
        requested: str,
        keep_alive: float | None = None,
        priority: int | None = None,
        client_id: str | None = None,
        session: str | None = None,
    ) -> Ticket:
        """A ticket for a READY replica of the model `requested` names, loading it first if need be.

        The replica: the one a `session` used last while it is up, else the one with the fewest requests
        in flight; a request that waits longer than the model's scale_up_wait_s may start another.

        A request waits (in one bounded queue, up to queue_timeout_s from its arrival, a cold load included)
        while the model loads or while it already serves `max_inflight` requests; waiters go by priority
        (default: the model's), then arrival. Raises SupervisorError: model_not_found, queue_full,
        queue_timeout, insufficient_vram, vram_unknown, model_failed, shutting_down.
        """
        started = monotonic()
        deadline = self._running_loop().time() + self.settings.queue_timeout_s
        ticket = await self._acquire(
            Claim(requested, keep_alive, priority, client_id, deadline, session, started)
        )
        ticket._waited_since(started)
        return ticket

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop, looked up once for the request path's steps (a ticket's deadline, an idle
        model's unload timer): on Python 3.11 each get_running_loop() is a getpid() system call."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    async def reacquire(self, ticket: Ticket) -> Ticket:
        """A new ticket for a request whose child was gone before it read the request (proxy.Unreachable).

        Releases `ticket`, gives the scheduler a moment to see the child's exit (its watcher then marks
        the slot FAILED and the next load starts it again), then acquires as `acquire()` does, under the
        first acquire's deadline. Call it once per request: a second refusal is the client's error.
        """
        ticket.release()
        process, slot = ticket.process, ticket.slot
        slot.log.warning("child_unreachable", pid=process.pid, exited=process.returncode is not None)
        if not process.exited.done() and not await self._answers(slot.manifest, process):
            remaining = ticket.claim.deadline - asyncio.get_running_loop().time()
            if remaining > 0:
                await asyncio.wait({process.exited}, timeout=min(remaining, _EXIT_NOTICE_S))
            if (
                not process.exited.done()
                and slot.process is process
                and not process.unreachable.done()
                and not await self._answers(slot.manifest, process)
            ):
                # Running, and refusing connections for good (its socket file deleted, its HTTP listener
                # dead): every request waited here and got a 502 while /health said ready. Its watcher
                # takes it as failed (_until_exit_or_hang), and the request below loads it again.
                changed = slot.changed
                process.unreachable.set_result("stopped accepting connections while running")
                await self._until_changed(changed, _EXIT_NOTICE_S)
        return await self._acquire(ticket.claim)

    async def _answers(self, manifest: Manifest, process: ChildProcess) -> bool:
        """Whether the child answers its readiness probe (a connection refused a moment ago may not be
        refused now)."""
        endpoint, key = process.endpoint, process.api_key or ""
        return await worker_for(manifest.engine).is_ready(self._session, manifest, endpoint, key)

    async def _acquire(self, claim: Claim) -> Ticket:
        if not self.accepting:
            raise errors.shutting_down()
        manifest = self._manifest(claim.requested)
        while True:
            if manifest is None:
                raise errors.model_not_found(claim.requested)
            try:
                return await self._acquire_of(manifest, claim)
            except errors.SupervisorError as exc:
                # A reload removed the model while the request waited. Renamed with the name asked for
                # kept as an alias, that name now finds the new model: the request waits for it, by the
                # same deadline (it was a 404 while a request sent a moment later was served).
                found = self._manifest(claim.requested)
                if exc.code != "model_not_found" or found is None or found.name == manifest.name:
                    raise
                manifest = found

    async def _acquire_of(self, manifest: Manifest, claim: Claim) -> Ticket:
        model = self.slots[manifest.name]  # replica 0: the model's queue count and load lives here
        if (ticket := self._take_place(manifest.name, claim)) is not None:  # the fast path
            return ticket
        if self.queued >= self.settings.max_queue:
            raise errors.queue_full(_QUEUE_FULL_RETRY_S)
        prio = manifest.priority if claim.priority is None else claim.priority
        self.queued += 1
        self._queue_changed(model, +1)
        busy_with: int | None = None  # what the wait was for: the model to load (None), or a turn
        target = model
        try:
            while True:
                if self.slots.get(manifest.name) is not model:
                    raise errors.model_not_found(claim.requested)  # a reload removed it meanwhile
                target = self._queue_target(manifest.name, claim.session)
                # Under load the model serves and the wait is for a turn: straight to it. A wait for the
                # model (and every wait but the turn's, which has its own) is bounded by the deadline here.
                if not self._ready_now(target):
                    busy_with = None
                    async with asyncio.timeout_at(claim.deadline):
                        await self._until_ready(target, prio, claim.deadline)
                    if any(p > prio for p in target.waiter_priorities):
                        # Waiters for a load wake in the order they came; one of higher priority woken
                        # with this one runs next: it takes the place first, this one then its turn.
                        await asyncio.sleep(0)
                        continue
                    if (ticket := self._take_place(manifest.name, claim)) is not None:
                        return ticket
                    target = self._queue_target(manifest.name, claim.session)
                    if not self._serving(target):
                        if target.state == SlotState.READY:
                            # Its child exited and the watcher has not marked it FAILED yet: wait for
                            # that (looping at once would spin the event loop, and the watcher never runs).
                            async with asyncio.timeout_at(claim.deadline):
                                await self._until_changed(target.changed, _EXIT_NOTICE_S)
                        continue  # it went down meanwhile: wait for it (or another) to be up again
                # A place may be free (this one woke after a waiter of higher priority took its own).
                if (ticket := self._take_place(manifest.name, claim)) is not None:
                    return ticket
                busy_with = target.inflight
                if await self._wait_for_turn(target, prio, claim):
                    if self._serving(target):
                        return self._ticket(target, claim)  # the place was handed over, already counted
                    # Handed a place just as the child died: give it back and wait for the restart.
                    self._leave(target)
                if (ticket := self._take_place(manifest.name, claim)) is not None:  # told to look again
                    return ticket
        except TimeoutError:
            if busy_with is not None:
                waited_for = f"it was busy with {busy_with} requests (max_inflight)"
            elif target.key in self._placing:  # its load never found room
                waited_for = (
                    "room on its GPUs: the models that would have to make room are busy, pinned or of "
                    "higher priority"
                )
            else:
                waited_for = "the model to load"
            raise errors.queue_timeout(
                manifest.name, self.settings.queue_timeout_s, f"waited for {waited_for}", _QUEUE_FULL_RETRY_S
            ) from None
        finally:
            self.queued -= 1
            self._queue_changed(model, -1)

    def _take_place(self, name: str, claim: Claim) -> Ticket | None:
        """A ticket for a replica that takes the request at once (no await between the check and the
        claim), or None."""
        slot = self._pick(name, claim.session)
        if slot is None:
            return None
        slot.inflight += 1
        return self._ticket(slot, claim)

    def _ready_now(self, slot: ModelSlot) -> bool:
        """Whether _until_ready would return at once for `slot` (one _queue_target just chose, so one of
        the model's current replicas): new requests are taken and it serves."""
        return self.accepting and not slot.refusing and self._serving(slot)

    # --- replicas ---------------------------------------------------------------------------------

    def group(self, name: str) -> list[ModelSlot]:
        """Every replica slot of the model, replica 0 first; [] for a model not configured."""
        model = self.slots.get(name)
        if model is None:
            return []
        extra = self.replicas.get(name)
        return [model, *extra] if extra else [model]

    def all_slots(self) -> list[ModelSlot]:
        """Every configured model's replica slots (not those a reload removed that are still stopping)."""
        return [slot for name in self.slots for slot in self.group(name)]

    def _current(self, slot: ModelSlot) -> bool:
        """Still one of the model's replicas: not removed by a reload, nor pruned after it went down."""
        return any(s is slot for s in self.group(slot.name))

    def _pick(self, name: str, session: str | None) -> ModelSlot | None:
        """The replica that may take a request at once: the session's own (if up; None while it is busy,
        so the request waits for it), else the admissible one with the fewest requests in flight."""
        group = self.group(name)
        sticky = self._session_replica(group, session)
        if sticky is not None:
            return sticky if self._admissible(sticky) else None
        best: ModelSlot | None = None
        for slot in group:
            if self._admissible(slot) and (best is None or slot.inflight < best.inflight):
                best = slot
        if best is not None and session is not None:
            self._remember_session(best, session)
        return best

    def _queue_target(self, name: str, session: str | None) -> ModelSlot:
        """The replica a request that cannot go in at once waits for: the session's own, else the serving
        one with the least work in hand, else one that is loading, else replica 0 (which a wait loads);
        a model with `replicas` > 1 starts the ones that are down (a crashed one starts again so)."""
        group = self._start_replicas(name) if self.slots[name].manifest.replicas > 1 else self.group(name)
        sticky = self._session_replica(group, session)
        if sticky is not None:
            return sticky
        serving = [s for s in group if self._serving(s)]
        if serving:
            chosen = min(serving, key=lambda s: (s.inflight + len(s.admission), s.replica))
            if session is not None:
                self._remember_session(chosen, session)
            return chosen
        if self._startable(group[0]):
            # Its wait loads it. Else only the siblings started above were loading, and a request waited
            # on one of them: replica 0 was never loaded, and the model ran one child of its `replicas`.
            return group[0]
        # A scale-up's load gives up rather than wait for room: a request waits on one of the model's own.
        loading = (s for s in group if s.load_task is not None and s.replica < s.manifest.replicas)
        return next(loading, group[0])

    def _session_replica(self, group: list[ModelSlot], session: str | None) -> ModelSlot | None:
        if session is None or len(group) == 1:
            return None
        index = self._sessions.get((group[0].name, session))
        slot = next((s for s in group if s.replica == index), None)
        if slot is None or not self._serving(slot):
            return None
        self._sessions.move_to_end((group[0].name, session))
        return slot

    def _remember_session(self, slot: ModelSlot, session: str) -> None:
        if len(self.group(slot.name)) == 1:
            return  # one replica: nothing to choose, nothing to remember
        self._sessions[(slot.name, session)] = slot.replica
        self._sessions.move_to_end((slot.name, session))
        while len(self._sessions) > _SESSIONS_KEPT:
            self._sessions.popitem(last=False)

    def _replica_slot(self, name: str, index: int) -> ModelSlot:
        """Replica `index` (>= 1) of the model, made if it does not exist; it shares the model's pin."""
        extra = self.replicas.setdefault(name, [])
        for slot in extra:
            if slot.replica == index:
                return slot
        model = self.slots[name]
        slot = self._new_slot(model.manifest, index)
        slot.pin_override = model.pin_override
        slot.keep_alive_s = model.keep_alive_s
        extra.append(slot)
        extra.sort(key=lambda s: s.replica)
        return slot

    def _start_replicas(self, name: str, count: int | None = None) -> list[ModelSlot]:
        """Start replicas 1..count-1 (default: the manifest's `replicas`) that are down, each a load task
        of its own that nobody waits on; returns the model's group."""
        model = self.slots[name]
        wanted = count if count is not None else model.manifest.replicas
        for index in range(1, wanted):
            slot = self._replica_slot(name, index)
            # Never past the model's limit: a scale-up may have started another replica while this one
            # waited out its back-off.
            if self._startable(slot) and self._in_use(name) < model.manifest.replica_limit:
                slot.load_task = self._spawn(self._load_replica(slot))
        return self.group(name)

    def _in_use(self, name: str) -> int:
        return sum(1 for s in self.group(name) if s.in_use)

    def _startable(self, slot: ModelSlot) -> bool:
        return (
            self.accepting
            and not slot.refusing
            and slot.load_task is None
            and slot.stop_task is None
            and (
                slot.state == SlotState.UNLOADED
                or (slot.state == SlotState.FAILED and slot.retry_at <= monotonic())
            )
        )

    async def _load_replica(self, slot: ModelSlot, patient: bool = True) -> None:
        """Load a replica nobody waits on; a failure is logged (and, after a start, is its last_error)."""
        try:
            await self._load(slot, patient)
        except errors.SupervisorError as exc:
            slot.log.warning("replica_load_failed", code=exc.code, error=exc.message)
            self._prune(slot.name)
            raise

    def _scale_up(self, name: str) -> None:
        """Start one more replica of a model whose requests queue, if it may have one and one fits without
        evicting a busy model or one of higher priority (the load does not wait for room)."""
        model = self.slots.get(name)
        if model is None or name in self._scaling or not self.accepting:
            return
        self._prune(name)
        group = self.group(name)
        # A replica of the manifest's count that is down counts too: it is started again when its
        # back-off ends (_start_replicas), and a new one beside it would take the model past its limit.
        held = sum(
            1 for s in group if s.in_use or (s.replica < model.manifest.replicas and not self._startable(s))
        )
        if held >= model.manifest.replica_limit:
            return
        idle = [s for s in group if self._startable(s)]
        used = {s.replica for s in group}
        slot = (
            idle[0] if idle else self._replica_slot(name, next(i for i in itertools.count() if i not in used))
        )
        self._scaling.add(name)
        slot.log.info("scale_up", queued=model.queued, replicas=len([s for s in group if s.in_use]) + 1)
        slot.load_task = self._spawn(self._load_replica(slot, patient=False))
        self._spawn(self._after_scale_up(slot, slot.load_task))

    async def _after_scale_up(self, slot: ModelSlot, load: asyncio.Task[None]) -> None:
        try:
            await self._until(load)
        finally:
            self._scaling.discard(slot.name)
        if load.done() and not load.cancelled() and load.exception() is None:
            pid = slot.process.pid if slot.process is not None else None
            self.events.publish("scale_up", model=slot.name, replica=slot.replica, pid=pid)

    def _wake_siblings(self, slot: ModelSlot) -> None:
        """A replica is up: the requests queued for a turn on its busy siblings choose again (it may be
        free). Only a scale-up did that: one started again for a busy model (or any other load) left them
        queued behind the busy replica until their queue_timeout_s."""
        for sibling in self.group(slot.name):
            if sibling is not slot:
                sibling.admission.wake_all()
        up = self._replica_up.pop(slot.name, None)
        if up is not None and not up.done():
            up.set_result(None)  # and those waiting for a sibling's load choose again

    def _prune(self, name: str) -> None:
        """Forget replicas above the manifest's `replicas` that are down and unused (started by scale-up)."""
        extra = self.replicas.get(name)
        model = self.slots.get(name)
        if not extra or model is None:
            return
        keep = [
            s
            for s in extra
            if s.replica < model.manifest.replicas or s.in_use or s.waiters or len(s.admission)
        ]
        if len(keep) != len(extra):
            self.replicas[name] = keep

    def resolve(self, requested: str) -> ModelSlot | None:
        """The slot a client's model name (or alias) points at, for read-only use by routes."""
        manifest = self._manifest(requested)
        return None if manifest is None else self.slots.get(manifest.name)

    def _manifest(self, requested: str) -> Manifest | None:
        """registry.resolve, without its Python call for the usual request: one naming a model as it is
        named, never also an alias (manifests._register and with_stored refuse a name that is taken)."""
        found = self.registry.models.get(requested)
        return found if found is not None else self.registry.resolve(requested)

    def unload(self, requested: str) -> ModelSlot | None:
        """Ollama's `keep_alive: 0` with nothing to generate: unload now, or as soon as in-flight work ends.

        A model that is not running stays so. Returns the slot, or None for an unknown model.
        """
        model = self.resolve(requested)
        if model is None:
            return None
        _refuse_pinned(model)  # answered "unload" while the model stayed up, it would mislead
        for slot in self.group(model.name):
            if slot.state in (SlotState.LOADING, SlotState.READY) and not slot.pinned:
                slot.unload_requested = True
                slot.unload_requested_at = monotonic()
                if slot.state == SlotState.READY:
                    self._arm_keep_alive(slot)  # idle: unloads now; busy: when its last request ends
        return model

    def expires_at(self, slot: ModelSlot) -> float | None:
        """Wall-clock time the slot's keep-alive will unload it: None when it never will (or is not up)."""
        if slot.state not in (SlotState.LOADING, SlotState.READY) or slot.pinned:
            return None
        if slot.unload_requested:
            return time.time()  # as soon as the requests in hand are done
        if math.isinf(slot.keep_alive_s):
            return None
        if slot.unload_timer is not None:
            return time.time() + max(0.0, slot.unload_timer.when() - asyncio.get_running_loop().time())
        return time.time() + slot.keep_alive_s  # busy or loading: the timer starts when it goes idle

    # --- operator actions (/v1/admin/models/{name}/...) --------------------------------------------

    def slot_for(self, requested: str) -> ModelSlot:
        """The slot `requested` names (or aliases); raises model_not_found."""
        slot = self.resolve(requested)
        if slot is None:
            raise errors.model_not_found(requested)
        return slot

    async def load(
        self,
        requested: str,
        keep_alive: float | None = None,
        wait: bool = True,
        replicas: int | None = None,
        overrides: Overrides | None = None,
        restart: bool = False,
        scale_down: bool = False,
    ) -> ModelSlot:
        """Load the model now, as a request without a prompt would: concurrent calls and requests share
        one load. With `wait`, returns once READY (raising the load's SupervisorError); without, returns
        at once and a failure shows as the slot's last_error. `keep_alive` then counts from now.
        `replicas`: how many replicas to have up (default: the manifest's), at most its max_replicas;
        with `scale_down` (an operator's count), those beyond it drain and stop.
        `overrides` (None: whatever it runs with) last until it unloads; a model running with others is
        refused 409 load_conflict, unless `restart`: then it drains and starts again with these."""
        if not self.accepting:
            raise errors.shutting_down()
        model = self.slot_for(requested)
        limit = model.manifest.replica_limit
        if replicas is not None and replicas > limit:
            raise errors.SupervisorError(
                "invalid_load_request",
                f"replicas: model '{model.name}' may run at most {limit} (its manifest's max_replicas)",
                400,
            )
        count = replicas if replicas is not None else model.manifest.replicas
        if scale_down and count < model.manifest.replicas:
            # Its keepers hold each of the manifest's replicas up: one stopped here was started again.
            _refuse_pinned(model, f"with {model.manifest.replicas} replicas")
        group = [model, *(self._replica_slot(model.name, i) for i in range(1, count))]
        for slot in group:
            # Asked for by name, it is tried now, as `systemctl restart` ignores a unit's restart delay:
            # refused with the last failure, an operator who had just fixed its cause saw the same error
            # and took it for the fix's. The back-off is for requests, which would retry in a loop.
            slot.retry_at = 0.0
        try:
            if overrides is not None:
                self._set_overrides(model, overrides, restart)
        except errors.SupervisorError:
            self._prune(model.name)  # the replicas made for this load: refused, none of them starts
            raise
        loading = self._override_loads
        loading[model.name] += 1  # until it ends, another load with other overrides is a conflict
        # `replicas` given is a target, as `kubectl scale` takes one: replicas beyond it drain and stop.
        # A replica still loading goes too, once up (its load joined): an unload of it alone did nothing,
        # and asked for 1 while 3 loaded, 3 ran.
        extra = [s for s in self.group(model.name) if scale_down and s.replica >= count and s.in_use]
        lowered = f"replicas lowered to {count} by the operator"
        try:
            loads = [self._load_and_keep(slot, keep_alive) for slot in group]
            loads += [self._down(slot, serve_queue=True, reason=lowered) for slot in extra]
            if wait:
                await asyncio.gather(*loads)
            else:  # a SupervisorError is the slot's last_error now; _task_done logs only bugs
                done = asyncio.gather(*(self._spawn(load) for load in loads), return_exceptions=True)
                loading[model.name] += 1
                done.add_done_callback(lambda _: self._override_load_ended(model))
        except BaseException:
            self._override_load_ended(model)
            raise
        self._override_load_ended(model, failed=False)
        return model

    def _override_load_ended(self, model: ModelSlot, failed: bool = True) -> None:
        """A load call has ended; overrides of a load that left nothing running are dropped, so a failed
        load with overrides never leaves them behind for the requests that come after it."""
        self._override_loads[model.name] -= 1
        if self._override_loads[model.name] <= 0:
            del self._override_loads[model.name]
            if failed and not any(s.in_use for s in self.group(model.name)):
                self._drop_overrides(model, "load failed")

    def _drop_overrides(self, model: ModelSlot, reason: str) -> None:
        if model.name in self.overrides:
            override = load_overrides.describe(self.overrides.pop(model.name))
            model.log.info("load_override_dropped", override=override, reason=reason)

    def _set_overrides(self, model: ModelSlot, overrides: Overrides, restart: bool) -> None:
        asked = overrides if overrides.given() else None
        current = self.overrides.get(model.name)
        if asked == current:
            return
        running = [s for s in self.group(model.name) if s.in_use]
        if (running or self._override_loads.get(model.name)) and not restart:
            raise errors.SupervisorError(
                "load_conflict",
                f"model '{model.name}' runs with overrides {load_overrides.describe(current) or 'none'}; "
                'send "restart": true to drain it and start it with '
                f"{load_overrides.describe(asked) or 'none'}",
                409,
            )
        if asked is None:
            del self.overrides[model.name]
        else:
            self.overrides[model.name] = asked
        model.log.info("load_override", override=load_overrides.describe(asked), restart=bool(running))
        for slot in running:
            self._restart_on_next_use(slot, "load overrides changed")

    async def _load_and_keep(self, slot: ModelSlot, keep_alive: float | None) -> None:
        # A waiter (nobody evicts it meanwhile), and the operator's: its load is not called off if the
        # caller leaves (an admin client that disconnects, as `curl` cut short would).
        await self._until_ready(slot, slot.manifest.priority, operator=True)
        slot.unload_requested = False
        slot.keep_alive_s = keep_alive if keep_alive is not None else self._default_keep_alive(slot.manifest)
        self._arm_keep_alive(slot)  # nobody holds a ticket to start the timer when it ends

    async def unload_model(self, requested: str, cancel_queued: bool) -> ModelSlot:
        """Unload the model and return once it is down (at once if it is not up). In-flight requests
        finish, for up to drain_timeout_s. Queued ones are served first, or with `cancel_queued` answered
        503 model_unloading (as is any request that comes while it unloads). A pinned model is refused
        409. While the daemon shuts down, 503 shutting_down: its drain stops every model, and an unload
        that then returned at once said 200 of a model still serving."""
        if not self.accepting:
            raise errors.shutting_down()
        slot = self.slot_for(requested)
        _refuse_pinned(slot)
        group = self.group(slot.name)
        if cancel_queued:
            await self._down_refusing(group)
        else:
            await asyncio.gather(*(self._down(s, serve_queue=True) for s in group))
        if not self.accepting:  # began meanwhile: `_down` stopped waiting
            raise errors.shutting_down()
        self._prune(slot.name)
        self._drop_overrides(slot, "unloaded")  # also those of a load that never got a child
        return slot

    async def _down_refusing(self, group: list[ModelSlot]) -> None:
        """Unload the replicas, answering their queued requests (and those that come meanwhile) 503."""
        for replica in group:
            replica.refusing += 1
        try:
            for replica in group:
                replica.admission.wake_all()  # queued requests look again, and are refused
                replica.wake()
                if replica.load_task is not None:
                    replica.load_task.cancel()  # its waiters are refused; a started child is stopped
            await asyncio.gather(*(self._down(s, serve_queue=False) for s in group))
        finally:
            for replica in group:
                replica.refusing -= 1

    async def _load_waiting_for_room_or_off(self, slot: ModelSlot, load: asyncio.Task[None]) -> None:
        """An unload that serves the queue first, of a model whose load waits for room: waited for up to
        drain_timeout_s, as a drain is, then called off as `cancel` calls it off (its waiters answered
        model_unloading). Each request arriving meanwhile moved that wait on: the unload did not return
        while traffic came, and once room came it loaded the model only to stop it."""
        await asyncio.wait({load}, timeout=self.settings.drain_timeout_s)
        if load.done() or slot.load_task is not load or slot.key not in self._placing:
            return  # it loaded (its queue is served next), failed, or has a lease by now
        slot.log.info("load_called_off", reason="unloaded by the operator while it waited for room")
        slot.refusing += 1
        try:
            slot.admission.wake_all()
            slot.wake()
            load.cancel()
            await self._until(load)
        finally:
            slot.refusing -= 1

    async def _down(
        self, slot: ModelSlot, serve_queue: bool, reason: str = "unloaded by the operator"
    ) -> None:
        """Drive the slot to UNLOADED (or FAILED), joining whatever load or stop is under way."""
        served = not serve_queue
        while self.accepting and self._current(slot):
            if slot.state == SlotState.READY and not served:
                served = True  # once: requests arriving meanwhile must not hold the unload off for ever
                await self._queue_answered(slot)
            elif slot.state == SlotState.READY:
                await self._unload(slot, reason, counted_as="operator")
            elif slot.load_task is not None and serve_queue and slot.key in self._placing:
                await self._load_waiting_for_room_or_off(slot, slot.load_task)
            elif slot.load_task is not None:
                await self._until(slot.load_task)
            elif slot.stop_task is not None:
                await self._until(slot.stop_task)
            elif slot.state in (SlotState.DRAINING, SlotState.STOPPING):
                await self._until_changed(slot.changed, None)
            else:
                return  # UNLOADED or FAILED

    async def _queue_answered(self, slot: ModelSlot) -> None:
        """Wait (up to drain_timeout_s) until no request waits for the slot, or it is no longer READY."""
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout_s
        while slot.queued and slot.state == SlotState.READY:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                slot.log.warning("unload_queue_timeout", queued=slot.queued)
                return
            woken: list[asyncio.Future[Any]] = [
                asyncio.ensure_future(e.wait()) for e in (slot.queue_emptied, slot.changed)
            ]
            try:
                await asyncio.wait(
                    (*woken, self._closing()), timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for waiting in woken:
                    waiting.cancel()

    def pin(self, requested: str) -> ModelSlot:
        """Pin the model until unpin() or a restart: loaded now and kept up, never evicted or idled out."""
        model = self.slot_for(requested)
        for slot in self.group(model.name):
            slot.pin_override = None if slot.manifest.pinned else True
            slot.unload_requested = False
            slot.cancel_unload_timer()
        self.load_pinned()  # its keepers load it, and restart it after a crash
        return model

    def unpin(self, requested: str) -> ModelSlot:
        """Undo a pin (the manifest's too, until a restart): keep-alive and eviction apply again."""
        model = self.slot_for(requested)
        for slot in self.group(model.name):
            slot.pin_override = False if slot.manifest.pinned else None
            slot.wake()  # its keeper sees it is unpinned and ends
            self._arm_keep_alive(slot)
        return model

    def _queue_changed(self, slot: ModelSlot, by: int) -> None:
        before = slot.queued
        slot.queued = before + by
        if not slot.queued:
            slot.queue_emptied.set()
        elif not before:  # only when a queue forms: under load the count moves twice per request
            slot.queue_emptied.clear()
        self.events.publish_throttled(
            "queue", f"queue:{slot.name}", _QUEUE_EVENT_S, model=slot.name, queued=slot.queued
        )

    @staticmethod
    def _serving(slot: ModelSlot) -> bool:
        """READY, current, and its child still running: the only slot a ticket may be issued for."""
        process = slot.process
        return (
            slot.state == SlotState.READY
            and not slot.stale
            and process is not None
            and process.returncode is None  # exited, though its watcher may not have seen it yet
            and not process.exited.done()
        )

    def has_room(self, name: str) -> bool:
        """A replica of the model serves and would take a request now, without a wait."""
        return any(self._admissible(slot) for slot in self.group(name))

    def _admissible(self, slot: ModelSlot) -> bool:
        """Serving, under max_inflight, nobody queued ahead (newcomers do not jump the queue), and not
        making way for a more urgent load."""
        return (
            self._serving(slot)
            and slot.inflight < slot.inflight_limit()
            and not len(slot.admission)
            and not slot.yielding
        )

    def _ticket(self, slot: ModelSlot, claim: Claim) -> Ticket:
        assert slot.process is not None  # _serving() was checked with no await since
        slot.cancel_unload_timer()
        keep_alive = claim.keep_alive
        slot.keep_alive_s = keep_alive if keep_alive is not None else self._default_keep_alive(slot.manifest)
        if slot.unload_requested and claim.arrived > slot.unload_requested_at:
            # As Ollama: the keep-alive of the last request to arrive wins, so a request sent after an
            # unload asks the model to stay (those that were waiting already do not call it off).
            slot.unload_requested = False
        return Ticket(self, slot, slot.process, claim)

    async def _wait_for_turn(self, slot: ModelSlot, priority: int, claim: Claim) -> bool:
        """Queue for a busy model; True once a finished request handed us its place, False to look again.
        TimeoutError at the claim's deadline, from a timer on the turn itself: every queued request waits
        here, and an asyncio.timeout around the wait costs several times as much."""
        turn = slot.admission.push(priority, claim.arrived)
        slot.log.debug("queued", priority=priority, client_id=claim.client_id, queued=len(slot.admission))
        expiry = turn.get_loop().call_at(claim.deadline, _expire, turn)
        try:
            if slot.manifest.replica_limit > 1:
                await asyncio.wait({turn}, timeout=slot.manifest.scale_up_wait_s)
                if not turn.done():
                    self._scale_up(slot.name)
            return await turn
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None and turn.result():
                self._release(slot)  # let in just as we gave up: pass the place on
            else:
                slot.admission.forget(turn)
            raise
        finally:
            expiry.cancel()

    async def _until_ready(
        self, slot: ModelSlot, priority: int, deadline: float | None = None, operator: bool = False
    ) -> None:
        """Wait until the slot is READY with its current manifest, loading it if nobody else is (a
        request's wait also ends once another replica of the model is up: it chooses again).
        `deadline` (loop time): when the caller gives up; the load waits for room until its last waiter's.
        An `operator`'s load (Scheduler.load) is not the requests': none of them leaving calls it off."""
        slot.add_waiter(priority, deadline)
        slot.operator_waiters += operator  # counted apart from the requests' (metrics, /health)
        try:
            await self._wait_ready(slot, operator)
        except BaseException:
            slot.remove_waiter(priority, deadline)
            slot.operator_waiters -= operator
            self._arm_keep_alive(slot)  # the last waiter gave up: the model may idle out again
            self._call_off_unwanted_load(slot)
            raise
        slot.remove_waiter(priority, deadline)
        slot.operator_waiters -= operator

    def _call_off_unwanted_load(self, slot: ModelSlot) -> None:
        """A load that requests started, still waiting for room, is called off once every one of them has
        given up, as Ollama skips a pending load whose request is gone: else, once room came, it evicted
        a model for nobody. Nothing is leased or started yet. Loads of the operator, a pin or a replica
        are not the requests' to call off."""
        # In _placing only while its load task runs _place: before the lease, so UNLOADED or FAILED.
        if slot.load_on_demand and slot.waiters == 0 and not slot.pinned and slot.key in self._placing:
            assert slot.load_task is not None
            slot.log.info("load_called_off", reason="every request waiting for it gave up")
            slot.load_task.cancel()

    async def _wait_ready(self, slot: ModelSlot, operator: bool = False) -> None:
        while True:
            if not self.accepting:
                raise errors.shutting_down()
            if not self._current(slot):
                if slot.replica and slot.name in self.slots:
                    return  # a replica pruned while we waited: the caller chooses again
                raise errors.model_not_found(slot.name)  # removed by a reload while we waited
            if slot.refusing:
                raise _model_unloading(slot.name)
            state = slot.state
            if state == SlotState.READY and not slot.stale:
                return
            if state == SlotState.READY:
                self._spawn(self._unload(slot, "manifest changed"))
                await slot.changed.wait()
            elif state in (SlotState.DRAINING, SlotState.STOPPING):
                await slot.changed.wait()  # shutdown sets it too
            elif slot.stop_task is not None:  # a crash or unload is still cleaning up
                await self._until(slot.stop_task)
            else:  # UNLOADED, LOADING or FAILED: wait on the one load every waiter shares
                if state == SlotState.FAILED and slot.load_task is None:
                    wait_s = slot.retry_at - monotonic()
                    if wait_s > 0:
                        assert slot.last_error is not None
                        raise errors.model_failed(slot.name, slot.last_error.reason, wait_s)
                if slot.load_task is None:
                    slot.load_task = self._spawn(self._load(slot))
                    slot.load_on_demand = True
                    if slot.replica == 0 and slot.manifest.replicas > 1:
                        self._start_replicas(slot.name)  # the model's other replicas start beside it
                if operator:
                    slot.load_on_demand = False  # (also one that requests began: the operator wants it)
                load = slot.load_task
                if operator or len(self.group(slot.name)) == 1:
                    await self._until(load)
                elif await self._until_load_or_sibling(slot, load):
                    return  # another replica came up first: the caller chooses again (it may take it)
                if not load.done() or load.cancelled():
                    continue  # shutdown began, or the load was called off (reload, shutdown): look again
                exc = load.exception()
                if isinstance(exc, errors.SupervisorError):
                    # Each waiter raises its own copy: one exception object must not unwind many tasks.
                    raise errors.SupervisorError(exc.code, exc.message, exc.status, exc.retry_after)
                if exc is not None:  # logged by _task_done; the client gets an answer it can act on
                    raise errors.model_failed(slot.name, f"internal error: {exc!r}")

    async def _until_load_or_sibling(self, slot: ModelSlot, load: asyncio.Task[None]) -> bool:
        """Wait for `load` like _until, or until another replica of the model comes up first (True): a
        request waiting on one that waits for room was left waiting while its sibling came up idle."""
        up = self._replica_up.get(slot.name)
        if up is None or up.done():
            up = self._replica_up[slot.name] = self._running_loop().create_future()
        await asyncio.wait((load, self._closing(), up), return_when=asyncio.FIRST_COMPLETED)
        return up.done() and not load.done()

    async def _until(self, future: asyncio.Future[Any]) -> None:
        """Wait for `future` without ever cancelling it, or until shutdown begins, whichever is first."""
        if not future.done():
            await asyncio.wait((future, self._closing()), return_when=asyncio.FIRST_COMPLETED)

    def _release(self, slot: ModelSlot) -> None:
        slot.last_used = monotonic()
        # Whether the place may go on to another request is only asked when one could take it: nobody
        # queued and no sibling replica (the usual case) costs nothing more. Shutting down, places are
        # not handed on, so the drain ends. (_leave changes the count, and nothing else _serving reads.)
        if len(slot.admission) and self._may_hand_on(slot, 0) and slot.admission.admit_next():
            return  # the place went straight to the best queued request, still counted in inflight
        self._leave(slot)
        self._nudge_sibling(slot)

    def _may_hand_on(self, slot: ModelSlot, free: int) -> bool:
        """The slot serves, and has room for `free` more requests than it holds now."""
        return (
            self.accepting
            and self._serving(slot)
            and slot.inflight + free <= slot.inflight_limit()
            and not slot.yielding
        )

    def _nudge_sibling(self, slot: ModelSlot) -> None:
        """A replica that serves has a free place and nobody waits for it: the best waiter of the replica
        with the longest queue chooses again (and finds it). With one replica, nothing to ask."""
        if not self.replicas.get(slot.name) or not self._may_hand_on(slot, 1):
            return
        busiest = max(self.group(slot.name), key=lambda s: len(s.admission))
        if busiest is not slot and len(busiest.admission):
            busiest.admission.nudge_best()

    def _leave(self, slot: ModelSlot) -> None:
        """A request no longer counts against the slot (it ended, or gave back a place it could not use)."""
        slot.inflight -= 1
        if slot.inflight == 0:
            slot.requests_ended()
            self._arm_keep_alive(slot)
            if slot.yielding:
                self._notify_room()  # idle now: the load it makes way for may evict it

    # --- loading ----------------------------------------------------------------------------------

    async def _load(self, slot: ModelSlot, patient: bool = True) -> None:
        """Place, lease, spawn and wait for readiness. Every way out leaves the slot READY, UNLOADED or
        FAILED, and a lease only with a running child; a failure reaches the waiters as SupervisorError.
        Not `patient` (a scale-up): no waiting for room, and a model busy or more important stays."""
        manifest = configured = slot.manifest
        started = monotonic()
        try:
            try:
                override = self.overrides.get(slot.name)
                if override is not None:
                    manifest = await asyncio.to_thread(load_overrides.apply, manifest, override)
                estimate = await self.vram_estimate(slot.manifest, override)
                mib_by_gpu = await self._place(slot, estimate, patient)
            except (errors.SupervisorError, asyncio.CancelledError):
                raise
            except Exception as exc:  # nothing is leased or started yet: only the waiters need an answer
                slot.log.error("load_error", stage="placement", error=repr(exc), exc_info=exc)
                raise errors.model_failed(
                    slot.name, f"internal error while placing it: {exc!r}", self.settings.failure_backoff_s
                ) from None
            if not self._current(slot):  # a reload removed it while it waited for room
                if self.shared is not None:
                    self.shared.release(slot.key)  # taken by _place: else renewed for nobody, for ever
                raise errors.model_not_found(slot.name)
            lease = self.leases.take(slot.key, mib_by_gpu)  # no await since the plan: nothing changed
            slot.estimate = estimate
            slot.launched = manifest
            if slot.manifest is configured:
                # Launched as configured now: a restart a reload asked for is done (its drain may have
                # ended in a crash, which left the mark). A reload from here on marks it again.
                slot.stale = False
            slot.transition(
                (SlotState.UNLOADED, SlotState.FAILED),
                SlotState.LOADING,
                "requested",
                gpus=lease.gpu_indices,
                vram_mib=estimate.mib,
                vram_source=estimate.source,
                placed_in_s=round(monotonic() - started, 3),
            )
            try:
                worker = worker_for(manifest.engine)
                endpoint = worker.endpoint(manifest)
                totals = {g.index: g.device_total_mib for g in self.inventory.gpus}
                key = ChildKey.new(self.settings.state_dir)
                spec = worker.launch_spec(manifest, endpoint, GpuPlacement(lease.mib_by_gpu, totals), key)
                spec = replace(spec, cpus=cpus.for_engine(manifest.cpus, self.settings.cpus is not None))
                spawned = monotonic()
                # In another pid namespace a child's memory is the device's rise over spawn and start-up.
                async with self.inventory.measured_load(slot.key, lease.mib_by_gpu, manifest.start_timeout_s):
                    process = await self._spawn_child(slot, spec, endpoint)
                    await process.wait_ready(
                        lambda: worker.is_ready(self._session, manifest, endpoint, key.value),
                        manifest.start_timeout_s,
                    )
            except asyncio.CancelledError:
                slot.transition(SlotState.LOADING, SlotState.STOPPING, "load cancelled")
                await self._stop_child(slot, "load cancelled", settle=True)
                raise
            except Exception as exc:
                if isinstance(exc, (LaunchError, ChildStartError, OSError)):
                    reason = str(exc)
                else:  # a bug, not the engine's doing; still, the slot must not stay LOADING with a lease
                    slot.log.error("load_error", stage="start", error=repr(exc), exc_info=exc)
                    reason = f"internal error while starting it: {exc!r}"
                report = FailureReport(
                    reason=reason,
                    at=time.time(),
                    exit_code=exc.exit_code if isinstance(exc, ChildStartError) else None,
                    stderr_tail=exc.stderr_tail if isinstance(exc, ChildStartError) else [],
                )
                await self._fail(slot, report, load_failed=True)
                self.metrics.loads.labels(manifest.name, "failed").inc()
                raise errors.model_failed(slot.name, report.reason, slot.retry_at - monotonic()) from None
            load_s = monotonic() - started
            slot.transition(
                SlotState.LOADING,
                SlotState.READY,
                "healthy",
                load_s=round(load_s, 3),
                engine_s=round(monotonic() - spawned, 3),  # the engine's own start, without our part
                listen=str(endpoint),
                pid=process.pid,
            )
            slot.consecutive_load_failures = 0
            slot.last_used = monotonic()
            self.events.publish(
                "load",
                model=slot.name,
                vram_mib=estimate.mib,
                vram_source=vram_source(estimate.source),
                gpus=lease.gpu_indices,
                load_s=round(load_s, 3),
                pid=process.pid,
            )
            self.metrics.loads.labels(manifest.name, "ok").inc()
            self.metrics.load_seconds.labels(manifest.name).observe(load_s)
            self._spawn(self._watch(slot, process))
            self._spawn(self._observe_vram(slot, process, estimate))
            self._arm_keep_alive(slot)  # in case every waiter went away meanwhile
            self._wake_siblings(slot)
        finally:
            slot.load_task = None
            slot.load_on_demand = False

    async def _spawn_child(self, slot: ModelSlot, spec: LaunchSpec, endpoint: Endpoint) -> ChildProcess:
        """Spawn into slot.process, which keeps the child even if we are cancelled mid-spawn."""
        spawn = asyncio.ensure_future(ChildProcess.spawn(slot.name, spec, endpoint, self.settings.state_dir))
        try:
            slot.process = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                slot.process = await spawn
            raise
        return slot.process

    async def vram_estimate(self, manifest: Manifest, override: Overrides | None = None) -> VramEstimate:
        """Declared, else observed last time, else from the weights on disk, with the load's overrides in
        effect; refuse if none applies."""
        try:
            # Reading a GGUF header or a snapshot's config.json is file I/O: keep it off the event loop.
            if override is not None:
                return await asyncio.to_thread(load_overrides.estimate, manifest, override, self.observed)
            return await asyncio.to_thread(estimate_vram, manifest, self.observed)
        except VramUnknown as exc:
            raise errors.vram_unknown(manifest.name, str(exc)) from None

    async def _observe_vram(self, slot: ModelSlot, process: ChildProcess, estimate: VramEstimate) -> None:
        """With NVML: attribute what the child really took (by its pids, or by the device's rise during a
        measured load when NVML's pids are another namespace's) and remember it as the next estimate."""
        if not self.inventory.has_nvml:
            return
        pids = [process.pid, *await process.tree_pids()]
        lease = self.leases.get(slot.key)
        if lease is None:
            return  # stopped meanwhile
        found = await self.inventory.attribute_load(slot.key, lease.mib_by_gpu, pids)
        if found is None:
            slot.log.warning("vram_unattributed", pids=pids, reason="NVML showed neither its pids nor a rise")
            return
        total = sum(found.mib_by_gpu.values())
        if found.trusted:  # memory freed by a stop during the measurement would make the figure too small
            await asyncio.to_thread(self.observed.record, fingerprint(slot.launched or slot.manifest), total)
        leased = sum(lease.mib_by_gpu.values())
        log_event = slot.log.warning if total > leased or not found.trusted else slot.log.info
        log_event(
            "vram_observed",
            observed_mib=total,
            leased_mib=leased,
            by_gpu=found.mib_by_gpu,
            method=found.method,
            recorded=found.trusted,
            estimate=estimate.source,
        )

    def _placement_request(self, slot: ModelSlot, need_mib: int) -> Request:
        manifest = slot.manifest
        return Request(need_mib, manifest.tensor_parallel_size, manifest.gpus, slot.load_priority, slot.name)

    async def _place(self, slot: ModelSlot, estimate: VramEstimate, patient: bool = True) -> dict[int, int]:
        """MiB per GPU for the slot, unloading idle models to make room, or waiting for it: for
        queue_timeout_s, or until the last request waiting for the slot gives up (a request that joined
        the load later keeps its own deadline).

        Loads waiting for room go by priority, then arrival: a load does not take room that a more urgent
        waiting load could use now.
        """
        request = self._placement_request(slot, estimate.mib)
        if not can_ever_fit(request, self.leases.capacity_mib):
            raise errors.insufficient_vram(slot.name, self._why_never_fits(request, estimate))
        loop = self._running_loop()
        own_deadline = loop.time() + self.settings.queue_timeout_s
        order = next(self._placing_order)
        said_waiting = False
        try:
            while True:
                request = self._placement_request(slot, estimate.mib)  # waiters may have raised the priority
                self._placing[slot.key] = (request.priority, -order, request)
                plan = await self._plan(request, slot)
                if plan is not None and not plan.victims:
                    if await self._take_shared(slot, plan, request.priority):
                        return plan.mib_by_gpu
                    plan = None  # a shared GPU's room went since the snapshot: wait a moment, plan again
                if plan is None and not patient:
                    raise errors.insufficient_vram(slot.name, "no room for another replica without waiting")
                if plan is not None:
                    slot.log.info("evicting", victims=plan.victims, for_gpus=sorted(plan.mib_by_gpu))
                    by_key = {s.key: s for s in self.all_slots()}
                    for victim in plan.victims:
                        name = by_key[victim].name if victim in by_key else victim.partition("#")[0]
                        self.events.publish("eviction", model=name, reason="room", **{"for": slot.name})
                        self.metrics.evicted(name, "room")
                    stops = [
                        self._begin_unload(by_key[k], f"evicted for {slot.name}")
                        for k in plan.victims
                        if k in by_key
                    ]
                    await asyncio.gather(*(asyncio.shield(stop) for stop in stops if stop is not None))
                    continue
                remaining = max(own_deadline, slot.last_waiter_deadline or own_deadline) - loop.time()
                if remaining <= 0:
                    raise errors.queue_timeout(
                        slot.name,
                        self.settings.queue_timeout_s,
                        "no room on its GPUs: the models that would have to make room are busy, pinned or "
                        "of higher priority",
                        _QUEUE_FULL_RETRY_S,
                    )
                if not said_waiting:
                    slot.log.info("placement_waiting", need_mib=estimate.mib, gpus=self.leases.snapshot())
                    said_waiting = True
                if patient:
                    await self._yield_for(slot, request)
                room = self._room
                with contextlib.suppress(TimeoutError):
                    # Woken when one of ours frees room; a foreign process freeing memory wakes nobody.
                    await asyncio.wait_for(room.wait(), min(remaining, _ROOM_RECHECK_S))
        finally:
            del self._placing[slot.key]
            if self._yields.pop(slot.key, None):
                self._mark_yielding()
            self._notify_room()  # the next waiting load may go now

    async def _yield_for(self, slot: ModelSlot, request: Request) -> None:
        """While `slot`'s load waits for room that busy models of lower priority hold, those models take
        no new request, so that they drain and it can evict them. Else a model with a steady queue was
        never idle, each ending request handing its place to the next, and the load waited out its
        queue_timeout_s, every time (Ollama and llama-swap send nothing more to a model being swapped
        out). Only a model this load would evict: found as its plan would be were they idle."""
        holders = self._holders(drainable_below=request.priority)
        plan = plan_placement(request, await self._free_mib(), holders, self.settings.max_loaded_models)
        victims = set(plan.victims) if plan is not None else set()
        if victims != self._yields.get(slot.key, set()):
            self._yields[slot.key] = victims
            if victims:
                names = sorted({s.name for s in self.all_slots() if s.key in victims})
                slot.log.info("draining_for_load", models=names, priority=request.priority)
            self._mark_yielding()

    def _mark_yielding(self) -> None:
        """Each slot's `yielding` from the loads waiting now; one that stops yielding lets its queue in."""
        held: set[str] = set().union(*self._yields.values()) if self._yields else set()
        for other in self.all_slots():
            was, other.yielding = other.yielding, other.key in held
            if was and not other.yielding:
                other.admission.wake_all()  # its queued requests look again (and find places)

    async def _plan(self, request: Request, slot: ModelSlot) -> Plan | None:
        """A plan for this load, unless a more urgent waiting load could be placed with the same room.

        A replica goes to a GPU that holds no other replica of its model when one has room as it is.
        """
        free = await self._free_mib()
        holders = self._holders()
        limit = self.settings.max_loaded_models
        mine = self._placing[slot.key][:2]
        outranked_by = (
            other for k, (p, o, other) in self._placing.items() if k != slot.key and (p, o) > mine
        )
        if any(plan_placement(other, free, holders, limit) is not None for other in outranked_by):
            return None
        spread = self._spread(slot, request)
        if spread is not None:
            plan = plan_placement(spread, free, holders, limit)
            if plan is not None and not plan.victims:
                return plan
        return plan_placement(request, free, holders, limit)

    async def _take_shared(self, slot: ModelSlot, plan: Plan, priority: int) -> bool:
        """Take the plan's shared GPUs in Redis, atomically; True with no await when it has none.

        After an await the local map may have changed too: the plan must still fit it, else the Redis
        leases go back and the caller plans again.
        """
        if self.shared is None or not any(self.shared.is_shared(g) for g in plan.mib_by_gpu):
            return True
        if not await self.shared.take(slot.key, plan.mib_by_gpu, priority):
            return False
        if all(self.leases.free_mib(g) >= mib for g, mib in plan.mib_by_gpu.items()):
            return True
        self.shared.release(slot.key)
        return False

    def lease_lost(self, key: str, why: str) -> None:
        """The shared lease of the slot `key` went to others (it was renewed too late): unload the model,
        whose memory they may use now."""
        slot = next((s for s in self.all_slots() if s.key == key), None)
        if slot is None:
            return
        slot.log.error("unloading", reason="shared lease lost", detail=why)
        self.events.publish("eviction", model=slot.name, reason="lease_lost", **{"for": "others"})
        self.metrics.evicted(slot.name, "lease_lost")
        self._spawn(self._unload(slot, f"shared lease lost: {why}"))

    def evict_for_external(self, gpu: int, need_mib: int, priority: int, owner: str) -> list[str]:
        """Unload idle models of lower priority than an external lease request on a shared GPU, enough
        to free `need_mib` there (what our models already stopping will free counts). The slot keys."""
        leaving = sum(
            lease.mib_by_gpu.get(gpu, 0)
            for s in self.all_slots()
            if s.state in (SlotState.DRAINING, SlotState.STOPPING) and (lease := self.leases.get(s.key))
        )
        if need_mib - leaving <= 0:
            return []
        pool = [
            Candidate(h.key, gpu, h.mib_by_gpu[gpu], h.priority, h.last_used)
            for h in self._holders()
            if h.evictable and gpu in h.mib_by_gpu and h.priority < priority
        ]
        chosen = choose_victims(need_mib - leaving, {gpu: 0}, pool, priority - 1) or []
        by_key = {s.key: s for s in self.all_slots()}
        for victim in chosen:
            slot = by_key[victim.key]
            slot.log.info("evicting", reason="external", gpu=gpu, for_owner=owner, for_priority=priority)
            self.events.publish("eviction", model=slot.name, reason="external", **{"for": owner})
            self.metrics.evicted(slot.name, "external")
            self._spawn(self._unload(slot, f"evicted for external lease {owner}"))
        return [victim.key for victim in chosen]

    def _spread(self, slot: ModelSlot, request: Request) -> Request | None:
        """The request kept off the GPUs the model's other replicas hold; None if that leaves too few."""
        taken = {
            gpu
            for other in self.group(slot.name)
            if other is not slot and (lease := self.leases.get(other.key)) is not None
            for gpu in lease.mib_by_gpu
        }
        if not taken:
            return None
        allowed = request.allowed_gpus if request.allowed_gpus is not None else self.leases.capacity_mib
        others = {gpu for gpu in allowed if gpu not in taken}
        return replace(request, allowed_gpus=others) if len(others) >= request.tensor_parallel else None

    async def _free_mib(self) -> dict[int, int]:
        """Leasable MiB per GPU; with NVML, used memory that no lease accounts for is not leasable either.

        A GPU that NVML cannot report on now is left out (nothing new is leased on it, nothing evicted for
        it), and the waiting loads look again shortly, since nothing else would announce its recovery.
        """
        foreign = None
        if self.inventory.has_nvml:
            leases = {lease.holder: lease.mib_by_gpu for lease in self.leases.holders()}
            foreign = await self.inventory.foreign_used_mib(leases, await self._child_pids())
        # Shared GPUs: what other supervisors and services lease in Redis; None while Redis is away.
        others = await self.shared.others_mib() if self.shared is not None else {}
        # Read after the awaits: another load may have taken a lease meanwhile, and the caller plans and
        # takes its own lease from this figure with no await in between.
        free = {g: self.leases.free_mib(g) for g in self.leases.capacity_mib}
        for gpu in list(free):
            taken = 0  # by what no lease of ours accounts for
            if foreign is not None:
                if gpu not in foreign:
                    del free[gpu]
                    asyncio.get_running_loop().call_later(_NVML_RETRY_S, self._notify_room)
                    continue
                taken = foreign[gpu]
            if self.shared is not None and self.shared.is_shared(gpu):
                if others is None:
                    del free[gpu]  # unknown what others hold there: lease nothing new on it
                    continue
                # Once in use, what others lease on a shared GPU is the same memory NVML shows as used
                # by none of ours: counted once, as whichever is more.
                taken = max(taken, others.get(gpu, 0))
            free[gpu] = max(0, free[gpu] - taken)
        return free

    async def _child_pids(self) -> dict[str, list[int]]:
        """Each running child's process tree by slot key, found in a thread (it scans every process)."""
        children = {s.key: s.process for s in self.all_slots() if s.process is not None}
        if not children:
            return {}
        return await asyncio.to_thread(
            lambda: {key: [p.pid, *p.descendant_pids()] for key, p in children.items()}
        )

    def _holders(self, drainable_below: int | None = None) -> list[Holder]:
        """The models holding leases. `drainable_below`: a busy one of a lower priority counts as
        evictable too (what _yield_for asks)."""
        by_key = {s.key: s for s in self.all_slots()}
        holders = []
        for lease in self.leases.holders():
            slot = by_key.get(lease.holder)  # None: removed by a reload, still stopping
            if slot is None:
                leaked = lease.holder.startswith(LEAKED_PREFIX)
                holders.append(Holder(lease.holder, lease.mib_by_gpu, 0, 0.0, False, model=not leaked))
            else:
                evictable = slot.is_idle and not slot.pinned
                if drainable_below is not None and not evictable:
                    queued = slot.admission.top_priority()  # its queue counts, as a load's waiters do
                    evictable = (
                        slot.state == SlotState.READY
                        and not slot.pinned
                        and slot.waiters == 0
                        and slot.manifest.priority < drainable_below
                        and (queued is None or queued < drainable_below)
                    )
                holders.append(
                    Holder(
                        slot.key,
                        lease.mib_by_gpu,
                        slot.manifest.priority,
                        slot.last_used,
                        evictable,
                        name=slot.name,
                    )
                )
        return holders

    def _why_never_fits(self, request: Request, estimate: VramEstimate) -> str:
        gpus = sorted(request.allowed_gpus) if request.allowed_gpus is not None else "any"
        return (
            f"it needs {estimate.mib} MiB ({estimate.source}: {estimate.detail}) as "
            f"{request.tensor_parallel} x {request.per_gpu_mib} MiB on GPUs {gpus}, and the GPUs can lease "
            f"{dict(sorted(self.leases.capacity_mib.items()))} MiB (total minus gpu_margin_mib)"
        )

    # --- unloading, failures, crashes -------------------------------------------------------------

    async def _unload(self, slot: ModelSlot, reason: str, counted_as: str | None = None) -> None:
        """Drain (wait for in-flight requests) and stop the slot's child; joins an unload under way.
        `counted_as`: the eviction reason to count and publish, once, if this call starts the unload."""
        stop = self._begin_unload(slot, reason, counted_as)
        if stop is not None:
            await asyncio.shield(stop)

    def _begin_unload(
        self, slot: ModelSlot, reason: str, counted_as: str | None = None
    ) -> asyncio.Task[None] | None:
        """Start draining now, in the caller's own step, and return the stop. An unload decided on an
        idle slot (keep-alive, eviction) and begun a step later let requests take the slot in between:
        they were served, and the model stopped under them, though they had asked to keep it."""
        if slot.state == SlotState.READY:
            if counted_as is not None:
                self.metrics.evicted(slot.name, counted_as)
                self.events.publish("eviction", model=slot.name, reason=counted_as)
            slot.cancel_unload_timer()
            slot.transition(SlotState.READY, SlotState.DRAINING, reason, inflight=slot.inflight)
        if slot.state == SlotState.DRAINING and slot.stop_task is None:
            slot.stop_task = self._spawn(self._drain_and_stop(slot, reason))
        return slot.stop_task

    async def _drain_and_stop(self, slot: ModelSlot, reason: str) -> None:
        try:
            if slot.inflight and not await self._requests_done(slot):
                slot.log.warning(
                    "drain_timeout", inflight=slot.inflight, drain_timeout_s=self.settings.drain_timeout_s
                )
            if slot.state != SlotState.DRAINING:
                return  # it crashed while draining; the crash handler cleaned up
            slot.transition(SlotState.DRAINING, SlotState.STOPPING, reason)
            if slot.process is not None:
                slot.process.stopped_for = reason
            await self._stop_child(slot, reason, settle=True)
            slot.stale = False
        finally:
            if slot.stop_task is asyncio.current_task():
                slot.stop_task = None
            self._prune(slot.name)  # a replica that scale-up started, now down, is forgotten

    async def _requests_done(self, slot: ModelSlot) -> bool:
        """Wait for the slot's in-flight requests to end: True if they did, False at the drain's deadline.

        The deadline is drain_timeout_s, or during shutdown what is left of the shutdown's one drain;
        abandon_drain() ends the wait at once.
        """
        limit_s = self.settings.drain_timeout_s
        if self._drain_deadline is not None:
            limit_s = min(limit_s, self._drain_deadline - asyncio.get_running_loop().time())
        done = slot.requests_done()
        try:
            await asyncio.wait(
                (done, self._abandoned()), timeout=max(0.0, limit_s), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            done.cancel()
        return slot.inflight == 0

    async def _stop_child(self, slot: ModelSlot, reason: str, settle: bool = False) -> None:
        """Stop the child's whole tree, confirm its GPU memory came back, then release the lease; with
        `settle`, then move the slot STOPPING -> UNLOADED.

        Never raises but for our own cancellation, and even then the stop runs to its end in a task of its
        own: the lease is released only after the tree is gone, and the slot never stays STOPPING.
        """
        process, slot.process = slot.process, None
        if process is not None:
            slot.last_child = process
        stop = self._spawn(self._stop_and_release(slot, process, reason, settle))
        if slot.stop_task is None:
            # The stop of a failed or cancelled load: whoever waits for the slot's clean-up (an unload,
            # a request, a restart) waits for this one too, even once the load's task has been cancelled.
            slot.stop_task = stop
            stop.add_done_callback(functools.partial(_forget_stop, slot))
        await asyncio.shield(stop)

    async def _stop_and_release(
        self, slot: ModelSlot, process: ChildProcess | None, reason: str, settle: bool
    ) -> None:
        try:
            if process is not None:
                await self._stop_tree(slot, process, reason)
        finally:
            if self.leases.release(slot.key) is not None:
                self._notify_room()
            if self.shared is not None:
                self.shared.release(slot.key)
            if settle and slot.state == SlotState.STOPPING:
                slot.transition(SlotState.STOPPING, SlotState.UNLOADED, reason)
                # The next child's comes from whoever loads it: a load whose client left kept an earlier
                # child's (a `keep_alive: -1` kept it up for good).
                slot.keep_alive_s = self._default_keep_alive(slot.manifest)
                if not slot.stale:  # unloaded, not restarted: the load's overrides end with it
                    self._end_overrides(slot)

    async def _stop_tree(self, slot: ModelSlot, process: ChildProcess, reason: str) -> None:
        """process.stop(); if that raises (psutil, a file), SIGKILL what is left. Errors are logged."""
        pids = [process.pid]
        try:
            pids = [process.pid, *await process.tree_pids()]
            await self.inventory.begin_release(slot.key, pids)  # the baseline the memory check compares with
            await process.stop(self.settings.stop_grace_s)
        except Exception as exc:
            slot.log.error("child_stop_failed", pid=process.pid, reason=reason, error=repr(exc), exc_info=exc)
            await self._kill_tree(slot, process, pids)
        try:
            await self._await_memory_released(slot, pids, reason)
        except Exception as exc:  # NVML can fail too; the tree is gone, which is what the lease waits for
            slot.log.error("vram_check_failed", pids=pids, reason=reason, error=repr(exc), exc_info=exc)

    async def _kill_tree(self, slot: ModelSlot, process: ChildProcess, pids: list[int]) -> None:
        """The fallback when a stop failed half-way: SIGKILL the tree as last seen, wait for the exit."""
        with contextlib.suppress(OSError):
            process.kill_all()
        await asyncio.wait({process.exited}, timeout=self.settings.stop_grace_s + 5)
        if not process.exited.done():
            slot.log.error("child_unkillable", pids=pids)
            return  # its files stay with it; the pid file names them for the reaper
        process.remove_files()

    async def _await_memory_released(self, slot: ModelSlot, pids: list[int], reason: str) -> None:
        """Wait (vram_release_timeout_s) for a stopped child's GPU memory to be seen free. What is still
        held then stays leased as `leaked:<slot key>` until NVML shows it free, so it is never leased twice.
        """
        held = await self.inventory.wait_memory_released(slot.key, self.settings.vram_release_timeout_s)
        if not held or not self._keep_leaked(slot, held, pids, reason):
            self.inventory.forget(slot.key)

    def _keep_leaked(self, slot: ModelSlot, held: dict[int, int], pids: list[int], reason: str) -> bool:
        """Move what a stopped child still holds (at most its lease) to a `leaked:` lease; True if kept."""
        lease = self.leases.release(slot.key)
        leased = lease.mib_by_gpu if lease is not None else {}
        kept = {g: min(mib, leased[g]) for g, mib in held.items() if g in leased and min(mib, leased[g]) > 0}
        holder = f"{LEAKED_PREFIX}{slot.key}"
        if self.leases.get(holder) is not None:  # an earlier child of this slot's leak is still held
            holder = next(
                named
                for n in itertools.count(2)
                if self.leases.get(named := f"{LEAKED_PREFIX}{slot.key}~{n}") is None
            )
        slot.log.error(
            "vram_leak",
            pids=pids,
            held_mib=held,
            reason=reason,
            timeout_s=self.settings.vram_release_timeout_s,
            kept_as=holder if kept else None,
        )
        if lease is not None:
            self._notify_room()  # the leaked lease may be smaller than the child's was
        if not kept:
            return False
        self.leases.take(holder, kept)  # no await since the release: the room is still there
        self.inventory.rename(slot.key, holder, kept)
        if self.shared is not None:
            self.shared.rename(slot.key, holder)  # still held: the Redis lease stays until it is freed
        self._spawn(self._watch_leak(holder, slot))
        return True

    async def _watch_leak(self, holder: str, slot: ModelSlot) -> None:
        """Re-check a leaked lease until NVML shows the memory free, then release it; ends at shutdown."""
        started = monotonic()
        interval = 0.5
        while self.accepting:
            await asyncio.sleep(interval)
            if not await self.inventory.memory_still_held(holder):
                self.leases.release(holder)
                if self.shared is not None:
                    self.shared.release(holder)
                self.inventory.forget(holder)
                self._notify_room()
                slot.log.info("vram_leak_freed", holder=holder, after_s=round(monotonic() - started, 3))
                return
            interval = min(interval * 2, _LEAK_RECHECK_MAX_S)

    def _end_overrides(self, slot: ModelSlot) -> None:
        """Drop the model's load overrides once the last of its replicas is down."""
        if not any(s.in_use for s in self.group(slot.name) if s is not slot):
            self._drop_overrides(slot, "unloaded")

    def _backoff_s(self, failures: int) -> float:
        """The wait before the next start after `failures` failed ones in a row."""
        return min(
            self.settings.failure_backoff_s * 2.0 ** max(0, failures - 1), self.settings.failure_backoff_max_s
        )

    async def _fail(self, slot: ModelSlot, report: FailureReport, load_failed: bool) -> None:
        """Hold the slot FAILED with the report, then stop what is left of the child and release its lease.

        FAILED comes first so that no request is handed a dying child while the tree is being stopped.
        """
        slot.last_error = report
        if load_failed:
            slot.consecutive_load_failures += 1
            backoff = self._backoff_s(slot.consecutive_load_failures)
        else:
            backoff = 0.0  # a crash after serving: the next request may start it again at once
        slot.retry_at = monotonic() + backoff
        slot.transition(
            (SlotState.LOADING, SlotState.READY, SlotState.DRAINING, SlotState.STOPPING),
            SlotState.FAILED,
            report.reason,
            exit_code=report.exit_code,
            stderr_tail=report.stderr_tail,
            retry_in_s=round(backoff, 3),
        )
        # A line of its own at warning: the transition's is info, which production logs often leave out.
        slot.log.warning(
            "load_failed" if load_failed else "child_crashed",
            reason=report.reason,
            exit_code=report.exit_code,
            stderr_tail=report.stderr_tail,
            retry_in_s=round(backoff, 3),
        )
        self.events.publish(
            "crash",
            model=slot.name,
            reason=report.reason,
            exit_code=report.exit_code,
            stderr_tail=report.stderr_tail,
            stage="load" if load_failed else "serving",
        )
        await self._stop_child(slot, report.reason)

    async def _watch(self, slot: ModelSlot, process: ChildProcess) -> None:
        """Turn an exit we did not ask for, or a hang (`_until_exit_or_hang`), into FAILED, with the
        reason and the child's last words."""
        hang = await self._until_exit_or_hang(slot, process)
        code: int | None = None
        if hang is None:
            code = await process.exited
            last_words = await process.final_tail()
        else:
            last_words = process.tail()
        if slot.process is not process or slot.state not in (SlotState.READY, SlotState.DRAINING):
            return  # we are stopping it ourselves
        slot.cancel_unload_timer()
        report = FailureReport(
            reason=hang or f"{describe_exit(code)} while serving",
            exit_code=code,
            stderr_tail=last_words,
            at=time.time(),
        )
        self.metrics.crashes.labels(slot.name).inc()
        slot.stop_task = asyncio.current_task()  # requests wait for the clean-up before a restart
        try:
            await self._fail(slot, report, load_failed=False)
        finally:
            if slot.stop_task is asyncio.current_task():
                slot.stop_task = None
            self._prune(slot.name)

    async def _until_exit_or_hang(self, slot: ModelSlot, process: ChildProcess) -> str | None:
        """None once the child exits; or, while it serves, why it is taken as hung: requests have been in
        flight on it for hang_timeout_s, and its processes used next to no CPU meanwhile; or why it is
        taken as unreachable (`ChildProcess.unreachable`).

        A stopped (SIGSTOP) or deadlocked child, or one stuck in its GPU driver, looks like that. A busy
        one does not, whether it computes on the CPU or drives a GPU: its CPU time moves. Nor does one
        whose only request waits for a client that stopped reading, unless that client stops for the
        whole timeout after the kernel's buffers (megabytes of answer) have filled.
        """
        quiet_since: float | None = None
        cpu_then = 0.0
        while not process.exited.done():
            if process.unreachable.done():
                return process.unreachable.result()
            limit = self.settings.hang_timeout_s  # a reload may change it
            ends: set[asyncio.Future[Any]] = {process.exited, process.unreachable}
            await asyncio.wait(ends, timeout=_hang_poll_s(limit), return_when=asyncio.FIRST_COMPLETED)
            if not self._may_hang(slot, process, limit):
                quiet_since = None
                continue
            cpu, state = await process.activity()
            now = monotonic()
            if quiet_since is None or cpu - cpu_then > limit * _HANG_CPU_SHARE:
                quiet_since, cpu_then = now, cpu
            elif now - quiet_since >= limit and self._may_hang(slot, process, limit):
                return (
                    f"stopped responding: {slot.inflight} request(s) in flight and no CPU used for "
                    f"{now - quiet_since:.0f}s (process {state})"
                )
        return None

    @staticmethod
    def _may_hang(slot: ModelSlot, process: ChildProcess, limit: float) -> bool:
        """Whether the hang check applies now: it is on, and the child serves requests."""
        return (
            limit > 0
            and not process.exited.done()
            and slot.process is process
            and slot.state in (SlotState.READY, SlotState.DRAINING)
            and slot.inflight > 0
        )

    # --- keep-alive -------------------------------------------------------------------------------

    def _default_keep_alive(self, manifest: Manifest) -> float:
        return manifest.keep_alive if manifest.keep_alive is not None else self.settings.default_keep_alive

    def _arm_keep_alive(self, slot: ModelSlot) -> None:
        """Called whenever a slot may have become idle: start its keep-alive timer."""
        slot.cancel_unload_timer()
        if not slot.is_idle:
            return
        self._notify_room()  # an idle model can be evicted: a load waiting for room may go now
        if slot.pinned:
            return
        if slot.unload_requested or slot.keep_alive_s <= 0:
            self._begin_unload(slot, "keep_alive 0", counted_as="keep_alive_0")
        elif not math.isinf(slot.keep_alive_s):
            slot.unload_timer = self._running_loop().call_later(
                slot.keep_alive_s, self._keep_alive_expired, slot
            )

    def _keep_alive_expired(self, slot: ModelSlot) -> None:
        slot.unload_timer = None
        if slot.replica < slot.manifest.replicas and any(
            s.state == SlotState.READY and not s.is_idle for s in self.group(slot.name)
        ):
            self._arm_keep_alive(slot)  # the model's own replicas idle out together, when all are idle
            return
        if slot.is_idle and self._current(slot):
            self._begin_unload(slot, f"idle for keep_alive {slot.keep_alive_s:g}s", counted_as="keep_alive")

    # --- start-up, reload, shutdown ---------------------------------------------------------------

    def load_pinned(self) -> None:
        """Pinned models are loaded at start-up (and after a reload adds one), not on first request, and
        kept up: a failed load is logged and retried after the back-off, a crash restarted after it.
        Each of the model's `replicas` has a keeper of its own."""
        for model in list(self.slots.values()):
            if not model.pinned:
                continue
            base = [model, *(self._replica_slot(model.name, i) for i in range(1, model.manifest.replicas))]
            for slot in base:
                if slot.key not in self._keepers and self.accepting:
                    self._keepers[slot.key] = self._spawn(self._keep_pinned(slot))

    async def _keep_pinned(self, slot: ModelSlot) -> None:
        """Keep one pinned slot loaded until it is unpinned, removed, or the daemon shuts down."""
        failures = 0  # failed starts (or crashes) in a row: the back-off grows with them
        not_before = 0.0  # monotonic time of the next start this keeper may make
        was_ready = False
        manifest = slot.manifest
        try:
            while self.accepting and slot.pinned and self._current(slot):
                changed = slot.changed
                if slot.manifest is not manifest:  # a reload changed it: a fixed manifest is tried at once
                    manifest, failures, not_before = slot.manifest, 0, 0.0
                if slot.state == SlotState.READY:
                    was_ready, failures = True, 0
                    if slot.stale and slot.stop_task is None:
                        # Loaded with the manifest a reload replaced meanwhile (it changed while loading):
                        # restarted now, as a pinned model changed when ready is, not on the next request.
                        self._restart_on_next_use(slot, "manifest changed")
                elif slot.state == SlotState.FAILED and was_ready:  # it crashed while serving
                    was_ready, failures = False, failures + 1
                    not_before = monotonic() + self._backoff_s(failures)
                    slot.log.warning("pinned_restart_scheduled", retry_in_s=self._backoff_s(failures))
                if slot.load_task is not None:
                    load = slot.load_task
                    await self._until(load)
                    if load.done() and not load.cancelled() and (exc := load.exception()) is not None:
                        failures += 1
                        code = exc.code if isinstance(exc, errors.SupervisorError) else "internal_error"
                        delay = max(self._backoff_s(failures), slot.retry_at - monotonic())
                        not_before = monotonic() + delay
                        slot.log.error(
                            "pinned_load_failed", reason=code, error=str(exc), retry_in_s=round(delay, 3)
                        )
                elif slot.stop_task is not None:
                    await self._until(slot.stop_task)
                elif slot.state in (SlotState.UNLOADED, SlotState.FAILED):
                    wait_s = max(not_before, slot.retry_at) - monotonic()
                    if wait_s > 0:
                        await self._until_changed(changed, wait_s)
                    else:
                        slot.load_task = self._spawn(self._load(slot))
                else:
                    await self._until_changed(changed, None)
        finally:
            if self._keepers.get(slot.key) is asyncio.current_task():
                del self._keepers[slot.key]

    async def _until_changed(self, changed: asyncio.Event, timeout_s: float | None) -> None:
        """Wait for a slot's next change, the timeout, or shutdown, whichever is first."""
        waiting = asyncio.ensure_future(changed.wait())
        try:
            await asyncio.wait(
                (waiting, self._closing()), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiting.cancel()

    def reload(self, registry: Registry, settings: Settings) -> dict[str, list[str]]:
        """Apply a new registry and settings: add, drain and remove, restart on next use, or update."""
        changes = diff(self.registry, registry)
        kept_restart_only = {k: getattr(self.settings, k) for k in Settings.RESTART_ONLY}
        ignored = [k for k, v in kept_restart_only.items() if getattr(settings, k) != v]
        if ignored:
            log.warning("reload_needs_restart", settings=ignored)
        self.settings = settings.model_copy(update=kept_restart_only)
        self.registry = registry
        for name in changes.added:
            self.slots[name] = self._new_slot(registry.models[name])
        for name in changes.removed:
            retired = self.group(name)
            for slot in retired:
                self._retire(slot, "removed from manifests")
            self.slots.pop(name)
            self.replicas.pop(name, None)
            self._spawn(self._forget_when_stopped(name, retired))
        for name in changes.restarted:
            if self.overrides.pop(name, None) is not None:
                log.info("load_override_dropped", model=name, reason="manifest changed")
        for name in (*changes.updated, *changes.restarted):
            for slot in self.group(name):
                self._apply_manifest(slot, registry.models[name], restart=name in changes.restarted)
            self._prune(name)  # `replicas` may have shrunk
        self.load_pinned()
        summary = {
            "added": list(changes.added),
            "removed": list(changes.removed),
            "restarted": list(changes.restarted),
            "updated": list(changes.updated),
        }
        log.info("reload_applied", **summary)
        self.events.publish("reload", **summary)
        return summary

    async def _forget_when_stopped(self, name: str, retired: list[ModelSlot]) -> None:
        """A removed model's metric series go once its replicas have stopped, their last requests counted
        (unless a later reload added the model again)."""
        for slot in retired:
            # Its load or stop is waited for; otherwise its next change. `_retire` leaves `changed` set
            # (so that late waiters see the slot gone), and waiting on it alone never yielded: a model
            # removed while loading spun the event loop for ever, its load never finishing.
            while not self._closing().done():
                pending = next((t for t in (slot.stop_task, slot.load_task) if t and not t.done()), None)
                if pending is not None:
                    await self._until(pending)
                elif slot.state in (SlotState.UNLOADED, SlotState.FAILED) and slot.stop_task is None:
                    break
                else:
                    await self._until_changed(slot.changed, _EXIT_NOTICE_S)
        if name not in self.slots:
            self.metrics.forget(name)

    def _apply_manifest(self, slot: ModelSlot, manifest: Manifest, restart: bool) -> None:
        """A reload changed the slot's manifest: restart its child on next use, or apply the change live."""
        slot.manifest = manifest
        # A fixed manifest deserves a prompt retry (a pinned model's keeper is woken to make it).
        slot.retry_at = 0.0
        slot.consecutive_load_failures = 0
        slot.wake()
        if restart:
            self._restart_on_next_use(slot, "manifest changed")
        else:
            slot.admission.wake_all()  # max_inflight may have changed: queued requests look again
            if slot.is_idle:
                slot.keep_alive_s = self._default_keep_alive(slot.manifest)
                self._arm_keep_alive(slot)

    def _restart_on_next_use(self, slot: ModelSlot, reason: str) -> None:
        """The child's launch is out of date: drain and stop it; the next request (or waiting load)
        starts it again as it should be."""
        slot.stale = slot.load_task is not None or slot.state in (
            SlotState.LOADING,
            SlotState.READY,
            SlotState.DRAINING,
        )
        if slot.state == SlotState.READY:
            self._spawn(self._unload(slot, reason))

    def _retire(self, slot: ModelSlot, reason: str) -> None:
        slot.changed.set()  # waiters wake, see the slot is gone, and answer model_not_found
        if slot.load_task is not None and slot.state in (
            SlotState.LOADING,
            SlotState.UNLOADED,
            SlotState.FAILED,
        ):
            # Still waiting for room (a crashed model's restart too), or starting: called off, the child
            # stopped and its lease freed now (as at shutdown), not after a start of minutes that nobody
            # will use, with other models waiting for that room meanwhile.
            slot.load_task.cancel()
            if slot.state == SlotState.LOADING:
                return  # the cancelled load stops the child itself
        if slot.state == SlotState.FAILED:
            slot.transition(SlotState.FAILED, SlotState.UNLOADED, reason)
        elif slot.state != SlotState.UNLOADED:
            self._spawn(self._unload(slot, reason))

    async def shutdown(self) -> None:
        """Refuse new requests, let in-flight ones finish (up to drain_timeout_s), then stop every child.

        Queued requests are answered `shutting_down` at once; abandon_drain() cuts the drain short.
        """
        self.accepting = False  # first, before any await: /health and new requests see it at once
        loop = asyncio.get_running_loop()
        self._drain_deadline = loop.time() + self.settings.drain_timeout_s
        closing = self._closing()
        if not closing.done():
            closing.set_result(None)  # every waiter (load, clean-up, turn) wakes and answers shutting_down
        for slot in self.all_slots():
            slot.changed.set()
            slot.admission.wake_all()
            if slot.load_task is not None:
                slot.load_task.cancel()  # nobody waits for it any more
        busy = [s for s in self.all_slots() if s.inflight]
        if busy:
            log.info("shutdown_draining", inflight=sum(s.inflight for s in busy))
            drained = await asyncio.gather(*(self._requests_done(s) for s in busy))
            if not all(drained):
                left = sum(s.inflight for s in self.all_slots())
                if self._abandoned().done():
                    log.warning("shutdown_drain_abandoned", inflight=left)
                else:
                    log.warning(
                        "shutdown_drain_timeout", drain_timeout_s=self.settings.drain_timeout_s, inflight=left
                    )
        for slot in self.all_slots():
            slot.cancel_unload_timer()
        await asyncio.gather(
            *(
                self._unload(s, "shutdown")
                for s in self.all_slots()
                if s.state in (SlotState.READY, SlotState.DRAINING)
            ),
            return_exceptions=True,
        )
        # Whatever is still running (loads being cancelled, crash handlers) finishes before we return.
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.settings.stop_grace_s + 10)
        for slot in self.all_slots():
            if slot.process is not None:  # belt and braces: nothing outlives the daemon
                await self._stop_child(slot, "shutdown")

    def abandon_drain(self) -> None:
        """Stop waiting for in-flight requests (a second SIGTERM/SIGINT): a running shutdown() goes straight
        on to stopping the children, whose requests then end with an error."""
        abandoned = self._abandoned()
        if not abandoned.done():
            log.warning("drain_abandoned", inflight=sum(s.inflight for s in self.all_slots()))
            abandoned.set_result(None)

    # --- helpers ----------------------------------------------------------------------------------

    def _new_slot(self, manifest: Manifest, replica: int = 0) -> ModelSlot:
        if replica == 0:  # a model served from now on (start-up, or a reload that adds it)
            self.metrics.register(manifest.name)
        key = f"{manifest.name}#{next(self._keys)}"
        return ModelSlot(manifest, key, self._default_keep_alive(manifest), self.events, replica)

    def _closing(self) -> asyncio.Future[None]:
        """Done once shutdown() has begun: every wait of a request or a keeper ends on it."""
        if self._closing_future is None:
            self._closing_future = asyncio.get_running_loop().create_future()
        return self._closing_future

    def _abandoned(self) -> asyncio.Future[None]:
        """Done once abandon_drain() was called: drains stop waiting for in-flight requests."""
        if self._abandoned_future is None:
            self._abandoned_future = asyncio.get_running_loop().create_future()
        return self._abandoned_future

    def _notify_room(self) -> None:
        """Wake the loads waiting for room (_place); with none, nothing to do (a slot idles after every
        request at low load, and this is called each time)."""
        if self._placing:
            self._room.set()
            self._room = asyncio.Event()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a background task that is kept referenced, logged if it fails, and awaited at shutdown."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        # A SupervisorError already reached the requests that waited on the task.
        if exc is not None and not isinstance(exc, errors.SupervisorError):
            log.error("background_task_failed", task=task.get_name(), error=repr(exc), exc_info=exc)

    async def gpu_memory(self) -> dict[str, Any]:
        """The inventory and the leases, per GPU, for /v1/admin/gpu-memory.

        With NVML, `used_mib` is what the driver reports, `foreign_mib` what no lease accounts for and
        `processes` every compute process; a GPU NVML cannot report on has `nvml_error` and no figures. A
        simulated GPU counts as used what the leases of running children hold, as a real one would show.
        A `leaked:<model>` lease is memory a stopped child has not given back yet.
        """
        usage = await asyncio.to_thread(self.inventory.usage)
        pids = await self._child_pids()
        by_key = {s.key: s for s in self.all_slots()}
        ours = {pid: by_key[key].name for key, tree in pids.items() for pid in tree}
        self.inventory.attribution.sync({x.holder: x.mib_by_gpu for x in self.leases.holders()}, pids)
        foreign = self.inventory.attribution.foreign_mib(usage)
        report = []
        for gpu in self.inventory.gpus:
            leases: list[dict[str, Any]] = []
            running_mib = 0
            for lease in self.leases.holders():
                if gpu.index not in lease.mib_by_gpu:
                    continue
                slot = by_key.get(lease.holder)
                process = slot.process if slot is not None else None
                running = process is not None and not process.exited.done()
                running_mib += lease.mib_by_gpu[gpu.index] if running else 0
                leaked = lease.holder.startswith(LEAKED_PREFIX)
                holding = self.inventory.attribution.holdings.get(lease.holder)
                method = holding.method if holding is not None else None
                leases.append(
                    {
                        "model": lease.holder.partition("#")[0],
                        "holder": lease.holder,
                        "mib": lease.mib_by_gpu[gpu.index],
                        "state": str(slot.state) if slot is not None else "leaked" if leaked else "retiring",
                        "pid": process.pid if process is not None and running else None,
                        "measured_mib": holding.mib_by_gpu.get(gpu.index) if holding and method else None,
                        "method": method,
                    }
                )
            entry: dict[str, Any] = {
                "index": gpu.index,
                "name": gpu.name,
                "uuid": gpu.uuid,
                "simulated": gpu.simulated,
                "total_mib": gpu.total_mib,
                "margin_mib": self.settings.gpu_margin_mib,
                "leased_mib": self.leases.leased_mib(gpu.index),
                "leaked_mib": self.leases.leaked_mib(gpu.index),
                "leasable_mib": self.leases.free_mib(gpu.index),
                "leases": leases,
            }
            used: int | None = running_mib
            if gpu.index in usage:
                used = usage[gpu.index].used_mib
                entry["foreign_mib"] = foreign[gpu.index]
                entry["processes"] = [
                    {"pid": pid, "used_mib": mib, "model": ours.get(pid)}
                    for pid, mib in sorted(usage[gpu.index].processes.items())
                ]
            elif self.inventory.has_nvml:
                used = None  # unknown, not zero
                entry["nvml_error"] = self.inventory.query_error(gpu.index)
                entry["processes"] = []
            entry["used_mib"] = used
            entry["free_mib"] = None if used is None else gpu.total_mib - used
            report.append(entry)
        return {"source": self.inventory.source, "gpus": report}

    def describe(self) -> dict[str, dict[str, object]]:
        now = monotonic()
        described = {}
        for name, model in self.slots.items():
            info = model.describe(now)
            group = self.group(name)
            if len(group) > 1:
                info["replicas"] = [{"replica": s.replica, **s.describe(now)} for s in group]
                info["inflight"] = sum(s.inflight for s in group)
            described[name] = info
        return described


def _refuse_pinned(slot: ModelSlot, how: str = "") -> None:
    """409 model_pinned for an unload (or a scale-down) of a pinned model: a pin means it stays until
    unpinned. `how`: what the pin holds up, when not the model itself."""
    if slot.pinned:
        where = "by the operator" if slot.pin_override else "by its manifest"
        raise errors.SupervisorError(
            "model_pinned",
            f"model '{slot.name}' is pinned {where}{f' {how}' if how else ''}; "
            f"POST /v1/admin/models/{slot.name}/unpin first",
            409,
        )


def _forget_stop(slot: ModelSlot, stop: asyncio.Task[None]) -> None:
    if slot.stop_task is stop:
        slot.stop_task = None


def _model_unloading(name: str) -> errors.SupervisorError:
    return errors.SupervisorError(
        "model_unloading", f"model '{name}' is being unloaded by the operator; try again shortly", 503, 5
    )


def _hang_poll_s(limit: float) -> float:
    """How often a serving child is looked at for a hang (limit 0: only for a change of the setting)."""
    return _HANG_POLL_MAX_S if limit <= 0 else min(max(limit / 6, _HANG_POLL_MIN_S), _HANG_POLL_MAX_S)
