"""LeaseMap: per-GPU MiB leases that never add up to more than a GPU's capacity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from supervisor.gpus import Gpu
from supervisor.leases import LEAKED_PREFIX, Lease, LeaseError, LeaseMap
from supervisor.placement import Request, plan_placement


def gpus(*totals: int) -> list[Gpu]:
    return [
        Gpu(index=i, total_mib=t, name=f"gpu{i}", uuid=None, simulated=True) for i, t in enumerate(totals)
    ]


def best_fit(leases: LeaseMap, mib: int) -> int | None:
    """Where placement puts a one-GPU model on these leases when nothing may be evicted."""
    plan = plan_placement(Request(mib), {g: leases.free_mib(g) for g in leases.capacity_mib}, [])
    return None if plan is None else next(iter(plan.mib_by_gpu))


def test_the_margin_is_never_leased() -> None:
    leases = LeaseMap(gpus(8192, 4096), margin_mib=512)
    assert leases.capacity_mib == {0: 7680, 1: 3584}
    assert leases.free_mib(0) == 7680
    assert leases.leased_mib(0) == 0
    assert leases.largest_capacity_mib() == 7680


def test_a_margin_larger_than_the_gpu_leaves_nothing_not_less() -> None:
    leases = LeaseMap(gpus(256), margin_mib=512)
    assert leases.capacity_mib == {0: 0}
    assert best_fit(leases, 1) is None
    assert best_fit(leases, 0) == 0


def test_no_gpus_means_no_capacity() -> None:
    leases = LeaseMap([], margin_mib=0)
    assert leases.largest_capacity_mib() == 0
    assert best_fit(leases, 1) is None
    assert leases.snapshot() == []


def test_best_fit_picks_the_fullest_gpu_that_fits() -> None:
    leases = LeaseMap(gpus(10_000, 10_000, 10_000), margin_mib=0)
    leases.take("a", {0: 2000})  # 8000 free
    leases.take("b", {1: 7000})  # 3000 free
    leases.take("c", {2: 9500})  # 500 free
    assert best_fit(leases, 400) == 2
    assert best_fit(leases, 500) == 2
    assert best_fit(leases, 501) == 1
    assert best_fit(leases, 3001) == 0
    assert best_fit(leases, 8001) is None


def test_best_fit_breaks_ties_by_lowest_index() -> None:
    leases = LeaseMap(gpus(4096, 4096), margin_mib=0)
    assert best_fit(leases, 1000) == 0


def test_take_records_the_lease_and_uses_the_memory() -> None:
    leases = LeaseMap(gpus(8192), margin_mib=192)
    lease = leases.take("m#1", {0: 3000})
    assert lease == Lease("m#1", {0: 3000})
    assert lease.gpu_indices == [0]
    assert leases.get("m#1") is lease
    assert leases.holders() == [lease]
    assert leases.leased_mib(0) == 3000
    assert leases.free_mib(0) == 5000


def test_take_fills_a_gpu_exactly_but_not_beyond() -> None:
    leases = LeaseMap(gpus(4096), margin_mib=96)
    leases.take("a", {0: 3000})
    with pytest.raises(LeaseError, match=r"GPU 0 has 1000 MiB free, b needs 1001"):
        leases.take("b", {0: 1001})
    assert leases.get("b") is None
    assert leases.leased_mib(0) == 3000
    leases.take("b", {0: 1000})
    assert leases.free_mib(0) == 0


def test_take_refuses_a_second_lease_for_the_same_holder() -> None:
    leases = LeaseMap(gpus(8192, 8192), margin_mib=0)
    first = leases.take("m#1", {0: 100})
    with pytest.raises(LeaseError, match="m#1 already holds a lease"):
        leases.take("m#1", {1: 100})
    assert leases.get("m#1") is first
    assert leases.leased_mib(1) == 0


def test_release_returns_the_lease_and_frees_its_memory() -> None:
    leases = LeaseMap(gpus(8192), margin_mib=0)
    lease = leases.take("m#1", {0: 6000})
    assert leases.release("m#1") is lease
    assert leases.free_mib(0) == 8192
    assert leases.get("m#1") is None
    assert leases.holders() == []
    assert leases.release("m#1") is None
    leases.take("m#1", {0: 8192})  # the holder may lease again


def test_a_lease_on_an_unknown_gpu_or_of_negative_size_is_refused() -> None:
    leases = LeaseMap(gpus(8192), margin_mib=0)
    with pytest.raises(LeaseError, match="no GPU 3"):
        leases.take("a", {3: 100})
    with pytest.raises(LeaseError, match="negative"):
        leases.take("a", {0: -1})
    assert leases.holders() == []


def test_release_of_an_unknown_holder_is_none() -> None:
    assert LeaseMap(gpus(1024), margin_mib=0).release("nobody") is None


def test_snapshot_shows_capacity_leased_free_and_holders_per_gpu() -> None:
    leases = LeaseMap(gpus(8192, 4096), margin_mib=512)
    leases.take("a#1", {1: 1000})
    leases.take("b#2", {1: 500})
    leases.take("c#3", {0: 7000})
    assert leases.snapshot() == [
        {
            "gpu": 0,
            "capacity_mib": 7680,
            "leased_mib": 7000,
            "leaked_mib": 0,
            "free_mib": 680,
            "leases": {"c#3": 7000},
        },
        {
            "gpu": 1,
            "capacity_mib": 3584,
            "leased_mib": 1500,
            "leaked_mib": 0,
            "free_mib": 2084,
            "leases": {"a#1": 1000, "b#2": 500},
        },
    ]


def test_snapshot_is_ordered_by_gpu_index() -> None:
    declared = [Gpu(index=i, total_mib=1024, name="x", uuid=None, simulated=True) for i in (3, 1, 2)]
    assert [row["gpu"] for row in LeaseMap(declared, margin_mib=0).snapshot()] == [1, 2, 3]


# --- properties --------------------------------------------------------------------------------------

Op = tuple[str, int, int, int]  # ("take" | "release", holder number, gpu, mib)


@settings(max_examples=200, deadline=None)
@given(
    totals=st.lists(st.integers(min_value=1, max_value=16_384), min_size=1, max_size=4),
    margin=st.integers(min_value=0, max_value=2048),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["take", "release"]),
            st.integers(min_value=0, max_value=7),
            st.integers(min_value=0, max_value=3),
            st.integers(min_value=0, max_value=16_384),
        ),
        max_size=40,
    ),
)
def test_random_take_and_release_never_overcommit_a_gpu(
    totals: list[int], margin: int, ops: list[Op]
) -> None:
    leases = LeaseMap(gpus(*totals), margin_mib=margin)
    held: dict[str, tuple[int, int]] = {}
    for action, number, gpu_number, mib in ops:
        holder, gpu = f"m#{number}", gpu_number % len(totals)
        if action == "take":
            fits = holder not in held and leases.free_mib(gpu) >= mib
            try:
                leases.take(holder, {gpu: mib})
            except LeaseError:
                assert not fits
            else:
                assert fits
                held[holder] = (gpu, mib)
        else:
            released = leases.release(holder)
            expected = held.pop(holder, None)
            assert (released is None) == (expected is None)
            if released is not None and expected is not None:
                assert dict(released.mib_by_gpu) == {expected[0]: expected[1]}
        for g, cap in leases.capacity_mib.items():
            assert 0 <= leases.leased_mib(g) <= cap
            assert leases.leased_mib(g) == sum(m for hg, m in held.values() if hg == g)
            assert leases.free_mib(g) == cap - leases.leased_mib(g)


class LeaseMachine(RuleBasedStateMachine):
    """Takes and releases in any order; best_fit's answer is always takeable."""

    def __init__(self) -> None:
        super().__init__()
        self.leases = LeaseMap([], margin_mib=0)
        self.held: set[str] = set()
        self.counter = 0

    @initialize(totals=st.lists(st.integers(min_value=0, max_value=8192), min_size=1, max_size=4))
    def make(self, totals: list[int]) -> None:
        self.leases = LeaseMap(gpus(*totals), margin_mib=256)

    @rule(mib=st.integers(min_value=0, max_value=9000))
    def place_with_best_fit(self, mib: int) -> None:
        gpu = best_fit(self.leases, mib)
        if gpu is None:
            assert all(self.leases.free_mib(g) < mib for g in self.leases.capacity_mib)
            return
        fitting = [
            self.leases.free_mib(g) for g in self.leases.capacity_mib if self.leases.free_mib(g) >= mib
        ]
        assert self.leases.free_mib(gpu) == min(fitting)
        self.counter += 1
        holder = f"m#{self.counter}"
        self.leases.take(holder, {gpu: mib})
        self.held.add(holder)

    @rule(gpu=st.integers(min_value=0, max_value=3), mib=st.integers(min_value=0, max_value=9000))
    def take_anywhere(self, gpu: int, mib: int) -> None:
        gpu %= len(self.leases.capacity_mib)
        self.counter += 1
        holder = f"m#{self.counter}"
        try:
            self.leases.take(holder, {gpu: mib})
        except LeaseError:
            assert self.leases.free_mib(gpu) < mib
        else:
            self.held.add(holder)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release_one(self, data: st.DataObject) -> None:
        holder = data.draw(st.sampled_from(sorted(self.held)))
        assert self.leases.release(holder) is not None
        self.held.discard(holder)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def double_take_is_refused(self, data: st.DataObject) -> None:
        holder = data.draw(st.sampled_from(sorted(self.held)))
        with pytest.raises(LeaseError):
            self.leases.take(holder, {0: 0})

    @invariant()
    def never_overcommitted(self) -> None:
        for g, cap in self.leases.capacity_mib.items():
            assert 0 <= self.leases.leased_mib(g) <= cap
        assert {lease.holder for lease in self.leases.holders()} == self.held


LeaseMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase


def test_a_leaked_lease_still_takes_room_and_is_counted_apart() -> None:
    leases = LeaseMap(gpus(4096), margin_mib=0)
    leases.take("a#1", {0: 1000})
    leases.take(f"{LEAKED_PREFIX}b#2", {0: 700})
    assert leases.leaked_mib(0) == 700
    assert leases.leased_mib(0) == 1700
    assert leases.free_mib(0) == 2396
