"""ModelSlot: one model's state machine, the only place its state changes.

    UNLOADED -> LOADING -> READY -> DRAINING -> STOPPING -> UNLOADED
                  |          |         |
                  +----------+---------+--> FAILED -> LOADING (retry) | UNLOADED (reset)

Every transition is checked against the table below and logged as one `slot_transition` event.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import Counter
from dataclasses import dataclass

import structlog

from supervisor.admission import AdmissionQueue
from supervisor.estimates import VramEstimate
from supervisor.events import EventBus
from supervisor.manifests import Manifest
from workers.process import ChildProcess

log = structlog.get_logger("slots")


class SlotState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    FAILED = "failed"


_ALLOWED: dict[SlotState, frozenset[SlotState]] = {
    SlotState.UNLOADED: frozenset({SlotState.LOADING}),
    SlotState.LOADING: frozenset({SlotState.READY, SlotState.FAILED, SlotState.STOPPING}),
    SlotState.READY: frozenset({SlotState.DRAINING, SlotState.FAILED}),
    SlotState.DRAINING: frozenset({SlotState.STOPPING, SlotState.FAILED}),
    SlotState.STOPPING: frozenset({SlotState.UNLOADED, SlotState.FAILED}),
    SlotState.FAILED: frozenset({SlotState.LOADING, SlotState.UNLOADED}),
}


class IllegalTransition(Exception):
    pass


@dataclass
class FailureReport:
    """Why a slot is FAILED: what a client and an operator need to act on it."""

    reason: str
    exit_code: int | None
    stderr_tail: list[str]
    at: float

    def as_dict(self) -> dict[str, object]:
        return {"reason": self.reason, "exit_code": self.exit_code, "stderr_tail": self.stderr_tail}


class ModelSlot:
    """Runtime state of one replica of a configured model (one child). Only the scheduler mutates it.

    Replica 0 is the model's own slot, which routes read; replicas 1.. exist while a manifest asks for
    them (`replicas`) or queue pressure started them (`max_replicas`).
    """

    def __init__(
        self,
        manifest: Manifest,
        key: str,
        keep_alive_s: float,
        events: EventBus | None = None,
        replica: int = 0,
    ) -> None:
        self.manifest = manifest
        # The model's name, which a reload's new manifest for the slot keeps (the slots are by name). An
        # attribute, not manifest.name, which costs a pydantic attribute lookup on every read.
        self.name = manifest.name
        self.key = key  # unique per slot object: names can return in a reload while the old one stops
        self.replica = replica
        self.state = SlotState.UNLOADED
        self.entered_at = time.monotonic()
        self.entered_wall = time.time()  # the same moment in epoch seconds, for answers
        self.process: ChildProcess | None = None
        # The child stopped last (a crash, a failed start, an unload): its output stays readable in
        # /v1/admin/models/{name}/logs until the next child starts.
        self.last_child: ChildProcess | None = None
        self.inflight = 0
        self.last_used = 0.0  # monotonic time the last request finished
        self.keep_alive_s = keep_alive_s
        self.waiters = 0  # requests waiting for this slot to become READY; they protect it from eviction
        self.operator_waiters = 0  # of those, an operator's load, a pin's or a keeper's: not requests
        self.waiter_priorities: Counter[int] = Counter()  # a load may evict up to its best waiter's priority
        self.waiter_deadlines: Counter[float] = Counter()  # a load waits for room until its last waiter's
        self.admission = AdmissionQueue()  # requests over max_inflight, waiting for a READY slot's turn
        self.queued = 0  # requests waiting for this slot, to load or for a turn (scheduler.acquire)
        self.queue_emptied = asyncio.Event()  # set whenever `queued` drops to 0
        # An operator's pin or unpin (/v1/admin/models/{name}/pin); None: the manifest's `pinned`.
        self.pin_override: bool | None = None
        # An operator's unload with queued: cancel is under way: waiting requests get model_unloading.
        self.refusing = 0
        # A more urgent load waits for its room: it takes no new request (they queue), so that it drains.
        self.yielding = False
        self.estimate: VramEstimate | None = None  # what the lease was sized by, for the admin document
        # The manifest its child was started from (`launched`), and how many requests at once that child
        # takes, kept with it: every request reads it, and it would cost a Python call to ask the manifest.
        self._launched: Manifest | None = None
        self._launched_limit = 0
        self.last_error: FailureReport | None = None
        self.consecutive_load_failures = 0
        self.retry_at = 0.0  # monotonic time before which a failed load is not retried
        self.stale = False  # launch config changed by a reload: restart on next use
        # Ollama's keep_alive 0 with nothing to generate: unload once the work in hand is done, whatever
        # keep_alive the requests already waiting bring with them.
        self.unload_requested = False
        self.unload_requested_at = 0.0  # monotonic(): requests that arrive later call it off
        self.load_on_demand = False  # load_task was started by requests, which may call it off
        # Waiters on a state change share these instead of starting work of their own.
        self.changed = asyncio.Event()
        # Those waiting for its requests to end (a drain): see requests_done. Futures, not an Event that
        # every request would clear and set (two Python calls each).
        self._done_waiters: list[asyncio.Future[None]] = []
        self.load_task: asyncio.Task[None] | None = None
        self.stop_task: asyncio.Task[None] | None = None
        self.unload_timer: asyncio.TimerHandle | None = None
        self.events = events if events is not None else EventBus()
        self.log = log.bind(model=manifest.name, replica=replica)

    @property
    def replica_id(self) -> str:
        return f"{self.name}#{self.replica}"

    @property
    def pinned(self) -> bool:
        """Never evicted or idled out: the operator's runtime pin, else the manifest's `pinned`. A replica
        beyond the manifest's `replicas` (started under load) never is: it idles out by keep-alive."""
        if self.replica >= self.manifest.replicas:
            return False
        return self.manifest.pinned if self.pin_override is None else self.pin_override

    @property
    def launched(self) -> Manifest | None:
        """The manifest its child was started from: the manifest with the load's overrides in effect."""
        return self._launched

    @launched.setter
    def launched(self, manifest: Manifest | None) -> None:
        self._launched = manifest
        self._launched_limit = 0 if manifest is None else manifest.inflight_limit()

    def launch_in_effect(self) -> Manifest:
        """What a request sent now is served by: the loading or running child's launch, its load's
        overrides included; else (unloaded, or to be restarted for a reload) the manifest, which the
        next load starts from."""
        launched = self._launched
        if launched is not None and not self.stale and self.state in (SlotState.LOADING, SlotState.READY):
            return launched
        return self.manifest

    def inflight_limit(self) -> int:
        """Requests at once: max_inflight as the manifest says now (a reload may change it live), else
        what the running child was started with (parallel or max_num_seqs, overrides included)."""
        limit = self.manifest.max_inflight
        if limit is not None:
            return limit
        return self._launched_limit or self.manifest.inflight_limit()

    def add_waiter(self, priority: int, deadline: float | None = None) -> None:
        self.waiters += 1
        self.waiter_priorities[priority] += 1
        if deadline is not None:
            self.waiter_deadlines[deadline] += 1

    def remove_waiter(self, priority: int, deadline: float | None = None) -> None:
        self.waiters -= 1
        self.waiter_priorities[priority] -= 1
        if not self.waiter_priorities[priority]:
            del self.waiter_priorities[priority]
        if deadline is not None:
            self.waiter_deadlines[deadline] -= 1
            if not self.waiter_deadlines[deadline]:
                del self.waiter_deadlines[deadline]

    @property
    def last_waiter_deadline(self) -> float | None:
        """The latest loop time by which a request waiting for this slot must be served, if any waits."""
        return max(self.waiter_deadlines) if self.waiter_deadlines else None

    @property
    def load_priority(self) -> int:
        """What a load of this model may evict: up to its own priority or its most urgent waiter's."""
        return (
            max(self.manifest.priority, *self.waiter_priorities)
            if self.waiter_priorities
            else self.manifest.priority
        )

    @property
    def api_key(self) -> str | None:
        """The key the child demands on every request; the proxy sends it, nobody else has it."""
        assert self.process is not None, "only a slot with a child has a key"
        return self.process.api_key

    def transition(
        self, expected: SlotState | tuple[SlotState, ...], to: SlotState, reason: str, **context: object
    ) -> None:
        """Move from `expected` (one state or several) to `to`; refuse a move the table does not allow."""
        allowed_from = expected if isinstance(expected, tuple) else (expected,)
        if self.state not in allowed_from or to not in _ALLOWED[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state} -> {to} ({reason}); expected {allowed_from}")
        now = time.monotonic()
        self.log.info(
            "slot_transition",
            **{"from": str(self.state)},
            to=str(to),
            reason=reason,
            in_state_s=round(now - self.entered_at, 3),
            **context,
        )
        if self.state == SlotState.READY:
            self.admission.wake_all()  # queued requests look again: wait for a reload, or fail
        previous, self.state = self.state, to
        self.entered_at = now
        self.entered_wall = time.time()
        if to in (SlotState.DRAINING, SlotState.FAILED, SlotState.UNLOADED):
            self.unload_requested = False  # done, or moot
        self.events.publish(
            "slot_transition",
            model=self.name,
            replica=self.replica,
            **{"from": str(previous)},
            to=str(to),
            reason=reason,
        )
        self.wake()

    def wake(self) -> None:
        """Wake everyone waiting on this slot, then arm a fresh event for the next change."""
        self.changed.set()
        self.changed = asyncio.Event()

    def requests_done(self) -> asyncio.Future[None]:
        """A future that is done once no request is in flight (at once when none is); cancel it to stop
        waiting."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.inflight == 0:
            future.set_result(None)
        else:
            self._done_waiters = [waiter for waiter in self._done_waiters if not waiter.done()]
            self._done_waiters.append(future)
        return future

    def requests_ended(self) -> None:
        """Its last request in flight has ended: those waiting for that go on."""
        if self._done_waiters:
            waiters, self._done_waiters = self._done_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def cancel_unload_timer(self) -> None:
        if self.unload_timer is not None:
            self.unload_timer.cancel()
            self.unload_timer = None

    @property
    def is_idle(self) -> bool:
        """READY with nobody using it or waiting for it: the only kind of slot that may be unloaded."""
        return self.state == SlotState.READY and self.inflight == 0 and self.waiters == 0

    @property
    def in_use(self) -> bool:
        """A child is starting, running or stopping (or a load is about to start): its weights are open."""
        return (
            self.state not in (SlotState.UNLOADED, SlotState.FAILED)
            or self.load_task is not None
            or self.stop_task is not None  # a failed child is still being stopped
        )

    def idle_s(self, now: float) -> float | None:
        return now - self.last_used if self.is_idle else None

    @property
    def requests_waiting(self) -> int:
        """Requests waiting for this slot: to load, or for a turn (an operator's load is no request)."""
        return self.waiters - self.operator_waiters + len(self.admission)

    def describe(self, now: float) -> dict[str, object]:
        """The slot as /health and /v1/models show it."""
        info: dict[str, object] = {"state": str(self.state), "inflight": self.inflight}
        if queued := self.requests_waiting:
            info["queued"] = queued
        if self.process is not None and self.state in (
            SlotState.LOADING,
            SlotState.READY,
            SlotState.DRAINING,
        ):
            info["pid"] = self.process.pid
            endpoint = self.process.endpoint
            if endpoint.socket is not None:
                info["socket"] = str(endpoint.socket)
            else:
                info["port"] = endpoint.port
        idle = self.idle_s(now)
        if idle is not None:
            info["idle_s"] = round(idle, 1)
        if self.last_error is not None:
            info["last_error"] = self.last_error.as_dict()
        return info


def aggregate_state(group: list[ModelSlot]) -> SlotState:
    """One state for a model's replicas: the most useful one any of them is in (ready first)."""
    states = {s.state for s in group}
    for state in (
        SlotState.READY,
        SlotState.LOADING,
        SlotState.DRAINING,
        SlotState.STOPPING,
        SlotState.FAILED,
    ):
        if state in states:
            return state
    return SlotState.UNLOADED
