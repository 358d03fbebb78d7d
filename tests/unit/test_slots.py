"""ModelSlot: the per-model state machine; every move is checked against one table."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from supervisor.manifests import LlamaServerManifest
from supervisor.slots import IllegalTransition, ModelSlot, SlotState

S = SlotState

ALLOWED = {
    (S.UNLOADED, S.LOADING),
    (S.LOADING, S.READY),
    (S.LOADING, S.FAILED),
    (S.LOADING, S.STOPPING),  # a load cancelled before the child was ready
    (S.READY, S.DRAINING),
    (S.READY, S.FAILED),
    (S.DRAINING, S.STOPPING),
    (S.DRAINING, S.FAILED),
    (S.STOPPING, S.UNLOADED),
    (S.STOPPING, S.FAILED),
    (S.FAILED, S.LOADING),
    (S.FAILED, S.UNLOADED),
}
FORBIDDEN = sorted(set(itertools.product(S, S)) - ALLOWED)


def make_slot() -> ModelSlot:
    manifest = LlamaServerManifest(name="m", engine="llama-server", model="/x.gguf")  # type: ignore[arg-type]
    return ModelSlot(manifest, key="m#1", keep_alive_s=300.0)


def force(slot: ModelSlot, state: SlotState) -> None:
    slot.state = state


async def test_a_new_slot_is_unloaded_and_idle_free() -> None:
    slot = make_slot()
    assert slot.state is S.UNLOADED
    assert slot.name == "m"
    assert slot.key == "m#1"
    assert slot.keep_alive_s == 300.0
    assert (slot.inflight, slot.waiters) == (0, 0)
    assert not slot.is_idle
    assert not slot.changed.is_set()


async def test_the_whole_lifecycle_is_allowed() -> None:
    slot = make_slot()
    path = [S.LOADING, S.READY, S.DRAINING, S.STOPPING, S.UNLOADED]
    for to in path:
        slot.transition(slot.state, to, "test")
        assert slot.state is to


async def test_a_failed_slot_can_retry_or_reset() -> None:
    slot = make_slot()
    slot.transition(S.UNLOADED, S.LOADING, "load")
    slot.transition(S.LOADING, S.FAILED, "exit 1")
    slot.transition(S.FAILED, S.LOADING, "retry")
    slot.transition(S.LOADING, S.READY, "healthy")
    slot.transition(S.READY, S.FAILED, "crash")
    slot.transition(S.FAILED, S.UNLOADED, "reset")
    assert slot.state is S.UNLOADED


@pytest.mark.parametrize(("start", "to"), sorted(ALLOWED))
async def test_every_edge_in_the_table_is_allowed(start: SlotState, to: SlotState) -> None:
    slot = make_slot()
    force(slot, start)
    slot.transition(start, to, "test")
    assert slot.state is to


@pytest.mark.parametrize(("start", "to"), FORBIDDEN)
async def test_every_other_edge_is_refused(start: SlotState, to: SlotState) -> None:
    slot = make_slot()
    force(slot, start)
    with pytest.raises(IllegalTransition):
        slot.transition(start, to, "test")
    assert slot.state is start


async def test_unloaded_cannot_jump_to_ready_and_ready_cannot_skip_draining() -> None:
    slot = make_slot()
    with pytest.raises(IllegalTransition, match=r"m: unloaded -> ready \(skip\)"):
        slot.transition(S.UNLOADED, S.READY, "skip")
    force(slot, S.READY)
    with pytest.raises(IllegalTransition, match="ready -> unloaded"):
        slot.transition(S.READY, S.UNLOADED, "skip")


async def test_a_transition_from_the_wrong_state_is_refused_even_if_the_edge_exists() -> None:
    slot = make_slot()
    force(slot, S.LOADING)
    with pytest.raises(IllegalTransition, match="expected"):
        slot.transition(S.UNLOADED, S.LOADING, "stale view")
    assert slot.state is S.LOADING
    with pytest.raises(IllegalTransition):
        slot.transition(S.READY, S.DRAINING, "stale view")
    assert slot.state is S.LOADING


async def test_several_expected_states_are_accepted() -> None:
    slot = make_slot()
    force(slot, S.DRAINING)
    slot.transition((S.READY, S.DRAINING), S.FAILED, "crash")
    assert slot.state is S.FAILED
    with pytest.raises(IllegalTransition):
        slot.transition((S.READY, S.DRAINING), S.LOADING, "not from failed")


async def test_a_refused_transition_keeps_the_event_and_entered_at() -> None:
    slot = make_slot()
    event, entered = slot.changed, slot.entered_at
    with pytest.raises(IllegalTransition):
        slot.transition(S.UNLOADED, S.READY, "skip")
    assert slot.changed is event
    assert not event.is_set()
    assert slot.entered_at == entered


async def test_a_transition_wakes_waiters_and_arms_a_fresh_event() -> None:
    slot = make_slot()
    old = slot.changed
    waiter = asyncio.create_task(old.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    slot.transition(S.UNLOADED, S.LOADING, "load")
    assert await asyncio.wait_for(waiter, timeout=1) is True
    assert old.is_set()
    assert slot.changed is not old
    assert not slot.changed.is_set()
    # The next waiter waits for the next change, not the one it missed.
    second = asyncio.create_task(slot.changed.wait())
    await asyncio.sleep(0)
    assert not second.done()
    slot.transition(S.LOADING, S.READY, "ready")
    await asyncio.wait_for(second, timeout=1)


async def test_a_transition_restarts_the_time_in_state() -> None:
    slot = make_slot()
    before = slot.entered_at
    await asyncio.sleep(0.01)
    slot.transition(S.UNLOADED, S.LOADING, "load")
    assert slot.entered_at > before


@pytest.mark.parametrize("state", [s for s in S if s is not S.READY])
async def test_only_a_ready_slot_can_be_idle(state: SlotState) -> None:
    slot = make_slot()
    force(slot, state)
    assert not slot.is_idle
    assert slot.idle_s(100.0) is None


async def test_a_ready_slot_is_idle_only_with_no_requests_and_no_waiters() -> None:
    slot = make_slot()
    force(slot, S.READY)
    slot.last_used = 40.0
    assert slot.is_idle
    assert slot.idle_s(100.0) == 60.0
    slot.inflight = 1
    assert not slot.is_idle
    slot.inflight, slot.waiters = 0, 1
    assert not slot.is_idle
    slot.waiters = 0
    assert slot.is_idle


async def test_describe_shows_state_inflight_and_idle_time() -> None:
    slot = make_slot()
    assert slot.describe(10.0) == {"state": "unloaded", "inflight": 0}
    force(slot, S.READY)
    slot.last_used = 4.0
    assert slot.describe(10.0) == {"state": "ready", "inflight": 0, "idle_s": 6.0}


async def test_requests_done_is_done_at_once_when_nothing_is_in_flight() -> None:
    slot = make_slot()
    assert slot.requests_done().done()


async def test_requests_done_waits_for_the_last_request_in_flight() -> None:
    slot = make_slot()
    slot.inflight = 2
    waiting, given_up = slot.requests_done(), slot.requests_done()
    given_up.cancel()  # a drain that stopped waiting
    slot.inflight = 1
    assert not waiting.done()
    slot.inflight = 0
    slot.requests_ended()  # what the scheduler calls as the last request leaves
    assert waiting.done()
    assert waiting.result() is None
    assert given_up.cancelled()


async def test_many_abandoned_waits_are_not_kept() -> None:
    slot = make_slot()
    slot.inflight = 1
    for _ in range(100):
        slot.requests_done().cancel()
    kept = slot.requests_done()
    slot.inflight = 0
    slot.requests_ended()
    assert kept.done()
    assert len(slot._done_waiters) == 0


async def test_the_inflight_limit_follows_the_manifest_then_the_launched_child() -> None:
    slot = make_slot()
    # llama-server's own --parallel -1 gives 4 slots, and half as many again wait in its queue
    assert slot.inflight_limit() == 6
    launched = LlamaServerManifest(name="m", engine="llama-server", model="/x.gguf", parallel=6)  # type: ignore[arg-type]
    slot.launched = launched  # started with an override of parallel
    assert slot.launched is launched
    assert slot.inflight_limit() == 9
    slot.manifest = LlamaServerManifest(name="m", engine="llama-server", model="/x.gguf", max_inflight=3)  # type: ignore[arg-type]
    assert slot.inflight_limit() == 3  # a reload's max_inflight applies live
    slot.manifest = launched.model_copy(update={"parallel": None})
    slot.launched = None
    assert slot.inflight_limit() == 6


@pytest.mark.parametrize(
    ("fields", "limit"),
    [
        ({"args": ["-np", "2"]}, 3),
        ({"parallel": 8, "args": ["--parallel", "2"]}, 3),  # args come last in argv: llama-server takes them
        ({"args": ["--n_parallel", "2"]}, 6),  # not a flag llama-server has: its default
        ({"env": {"LLAMA_ARG_N_PARALLEL": "2"}}, 3),
        ({"args": ["-np", "-1"]}, 6),  # auto: 4 slots
    ],
)
def test_the_inflight_limit_counts_the_slots_args_and_env_give(fields: dict[str, Any], limit: int) -> None:
    """The slots were read from the `parallel` field only: with `-np 2` in args, 6 requests went to a child
    of 2 slots."""
    manifest = LlamaServerManifest.model_validate(
        {"name": "m", "engine": "llama-server", "model": "/x.gguf", **fields}
    )
    assert manifest.inflight_limit() == limit
