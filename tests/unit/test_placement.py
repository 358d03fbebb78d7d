"""plan_placement: where a model goes and which idle models make way, on 1-16 simulated GPUs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from supervisor.gpus import Gpu
from supervisor.leases import LeaseMap
from supervisor.placement import Holder, Request, can_ever_fit, plan_placement


def holder(
    key: str, mib_by_gpu: dict[int, int], priority: int = 0, last_used: float = 0.0, evictable: bool = True
) -> Holder:
    return Holder(key, mib_by_gpu, priority, last_used, evictable)


def test_a_model_that_fits_goes_to_the_fullest_gpu_that_holds_it_and_evicts_nothing() -> None:
    plan = plan_placement(Request(1000), {0: 8000, 1: 1500, 2: 900}, [holder("a", {1: 500})])
    assert plan is not None
    assert (plan.mib_by_gpu, plan.victims) == ({1: 1000}, [])


def test_tensor_parallel_splits_evenly_over_that_many_gpus() -> None:
    plan = plan_placement(Request(3001, tensor_parallel=3), {0: 2000, 1: 1001, 2: 5000, 3: 999}, [])
    assert plan is not None
    assert plan.mib_by_gpu == {0: 1001, 1: 1001, 2: 1001}  # ceil(3001 / 3) on each of the three that fit


def test_allowed_gpus_restrict_placement() -> None:
    free = {0: 8000, 1: 8000, 2: 100}
    plan = plan_placement(Request(1000, allowed_gpus=[1, 2]), free, [])
    assert plan is not None
    assert plan.mib_by_gpu == {1: 1000}
    assert plan_placement(Request(1000, allowed_gpus=[2]), free, []) is None
    assert plan_placement(Request(1000, allowed_gpus=[7]), free, []) is None  # no such GPU


def test_can_ever_fit_looks_at_empty_gpus() -> None:
    capacity = {0: 8000, 1: 4000}
    assert can_ever_fit(Request(8000), capacity)
    assert not can_ever_fit(Request(8001), capacity)
    assert can_ever_fit(Request(8000, tensor_parallel=2), capacity)
    assert not can_ever_fit(Request(8002, tensor_parallel=2), capacity)  # 4001 each: GPU 1 is too small
    assert not can_ever_fit(Request(100, tensor_parallel=2, allowed_gpus=[0]), capacity)


def test_eviction_takes_the_lowest_priority_then_the_least_recently_used() -> None:
    holders = [
        holder("important", {0: 4000}, priority=5, last_used=1.0),
        holder("old", {0: 4000}, priority=0, last_used=2.0),
        holder("new", {0: 4000}, priority=0, last_used=3.0),
    ]
    plan = plan_placement(Request(4000, priority=5), {0: 0}, holders)
    assert plan is not None
    assert plan.victims == ["old"]
    plan = plan_placement(Request(8000, priority=5), {0: 0}, holders)
    assert plan is not None
    assert plan.victims == ["old", "new"]


def test_never_evicts_a_busy_or_pinned_model_or_one_of_higher_priority() -> None:
    holders = [
        holder("busy", {0: 8000}, evictable=False),
        holder("vip", {1: 8000}, priority=9),
    ]
    assert plan_placement(Request(4000, priority=0), {0: 0, 1: 0}, holders) is None
    plan = plan_placement(Request(4000, priority=9), {0: 0, 1: 0}, holders)
    assert plan is not None
    assert (plan.mib_by_gpu, plan.victims) == ({1: 4000}, ["vip"])


def test_the_gpu_that_needs_fewer_victims_wins() -> None:
    holders = [
        holder("a1", {0: 2000}),
        holder("a2", {0: 2000}),
        holder("b", {1: 4000}, last_used=99.0),
    ]
    plan = plan_placement(Request(4000), {0: 0, 1: 0}, holders)
    assert plan is not None
    assert (plan.mib_by_gpu, plan.victims) == ({1: 4000}, ["b"])


def test_max_loaded_models_evicts_even_where_memory_is_plenty() -> None:
    holders = [holder("a", {0: 1000}, last_used=2.0), holder("b", {1: 1000}, last_used=1.0)]
    plan = plan_placement(Request(1000), {0: 7000, 1: 7000}, holders, max_loaded=2)
    assert plan is not None
    assert plan.victims == ["b"]
    busy = [replace(h, evictable=False) for h in holders]
    assert plan_placement(Request(1000), {0: 7000, 1: 7000}, busy, max_loaded=2) is None
    plan = plan_placement(Request(1000), {0: 7000, 1: 7000}, busy, max_loaded=3)
    assert plan is not None
    assert plan.victims == []


def test_memory_a_stopped_child_left_behind_is_not_a_loaded_model() -> None:
    """With max_loaded_models 1, a `leaked:` lease counted as a model that could never be evicted: no
    model loaded until the driver gave the memory back, for a stuck context never."""
    leaked = replace(holder("leaked:demo", {0: 700}), evictable=False, model=False)
    plan = plan_placement(Request(1000), {0: 3000}, [leaked], max_loaded=1)
    assert plan is not None
    assert plan.victims == []
    loaded = [leaked, holder("a", {0: 1000})]
    plan = plan_placement(Request(1000), {0: 2000}, loaded, max_loaded=1)
    assert plan is not None
    assert plan.victims == ["a"]


def test_max_loaded_models_counts_models_not_replicas() -> None:
    """A model's replicas are one loaded model, and a replica of the model loading adds none; a model is
    evicted for the limit with all its replicas, and not while one of them is busy."""
    demo = [replace(holder(f"demo#{i}", {i: 700}), name="demo") for i in range(2)]
    plan = plan_placement(Request(700, model="demo"), {0: 300, 1: 300, 2: 1000}, demo, max_loaded=1)
    assert plan is not None
    assert plan.victims == []
    plan = plan_placement(Request(700, model="other"), {0: 300, 1: 300, 2: 1000}, demo, max_loaded=1)
    assert plan is not None
    assert plan.victims == ["demo#0", "demo#1"]
    one_busy = [demo[0], replace(demo[1], evictable=False)]
    assert (
        plan_placement(Request(700, model="other"), {0: 300, 1: 300, 2: 1000}, one_busy, max_loaded=1) is None
    )


def test_a_tensor_parallel_plan_spares_a_model_whose_room_another_victim_frees() -> None:
    """A TP=2 load needs 2000 MiB on each of GPUs 0 and 1. Idle Z (itself spread) holds 3000 on GPU 0 and
    2000 on GPU 1; idle A holds 2000 on GPU 1 only. Victims were chosen GPU by GPU, so A went too, though
    Z's going frees enough on GPU 1."""
    holders = [holder("Z#1", {0: 3000, 1: 2000}, last_used=5.0), holder("A#2", {1: 2000}, last_used=1.0)]
    plan = plan_placement(Request(4000, tensor_parallel=2), {0: 1096, 1: 96}, holders)
    assert plan is not None
    assert plan.mib_by_gpu == {0: 2000, 1: 2000}
    assert plan.victims == ["Z#1"]


# --- random sequences: the scheduler's bookkeeping, driven by plan_placement -----------------------------


@dataclass
class Model:
    name: str
    need: int
    tensor_parallel: int
    priority: int
    pinned: bool


@dataclass
class Loaded:
    inflight: int = 0
    last_used: float = 0.0
    gpus: dict[int, int] = field(default_factory=dict)


class SchedulerModel(RuleBasedStateMachine):
    """load / finish / crash / unload / reload in any order on 1-4 simulated GPUs.

    What must hold whatever happens: no GPU is ever over-committed, a busy or pinned or more important
    model is never evicted, every crash gives back its whole lease, and a load that could be placed by
    evicting idle models is placed (progress).
    """

    def __init__(self) -> None:
        super().__init__()
        self.leases = LeaseMap([], margin_mib=0)
        self.models: dict[str, Model] = {}
        self.loaded: dict[str, Loaded] = {}
        self.clock = 0.0
        self.max_loaded: int | None = None

    @initialize(
        totals=st.lists(st.integers(min_value=1000, max_value=16_000), min_size=1, max_size=4),
        margin=st.sampled_from([0, 512]),
        max_loaded=st.one_of(st.none(), st.integers(min_value=1, max_value=4)),
        specs=st.lists(
            st.tuples(
                st.integers(min_value=100, max_value=12_000),
                st.sampled_from([1, 1, 1, 2]),
                st.integers(min_value=-1, max_value=2),
                st.booleans(),
            ),
            min_size=2,
            max_size=7,
        ),
    )
    def setup(
        self, totals: list[int], margin: int, max_loaded: int | None, specs: list[tuple[int, int, int, bool]]
    ) -> None:
        gpus = [Gpu(i, t, f"gpu{i}", None, True) for i, t in enumerate(totals)]
        self.leases = LeaseMap(gpus, margin_mib=margin)
        self.max_loaded = max_loaded
        self.models = {
            f"m{i}": Model(f"m{i}", need, tp, prio, pinned and i == 0)
            for i, (need, tp, prio, pinned) in enumerate(specs)
        }

    def holders(self) -> list[Holder]:
        return [
            Holder(
                name,
                self.leases.get(name).mib_by_gpu,  # type: ignore[union-attr]
                self.models[name].priority,
                state.last_used,
                evictable=state.inflight == 0 and not self.models[name].pinned,
            )
            for name, state in self.loaded.items()
        ]

    def free(self) -> dict[int, int]:
        return {g: self.leases.free_mib(g) for g in self.leases.capacity_mib}

    @rule(data=st.data(), request_priority=st.one_of(st.none(), st.integers(min_value=-1, max_value=3)))
    def request(self, data: st.DataObject, request_priority: int | None) -> None:
        model = self.models[data.draw(st.sampled_from(sorted(self.models)))]
        self.clock += 1
        if model.name in self.loaded:
            self.loaded[model.name].inflight += 1
            return
        priority = model.priority if request_priority is None else max(model.priority, request_priority)
        request = Request(model.need, model.tensor_parallel, None, priority)
        holders = self.holders()
        plan = plan_placement(request, self.free(), holders, self.max_loaded)
        if plan is None:
            self.assert_no_room_even_by_evicting(request, holders)
            return
        by_key = {h.key: h for h in holders}
        for victim in plan.victims:
            assert by_key[victim].evictable, f"evicted {victim}, which is busy or pinned"
            assert by_key[victim].priority <= priority, f"evicted {victim}, more important than the request"
            self.leases.release(victim)
            del self.loaded[victim]
        assert len(plan.mib_by_gpu) == model.tensor_parallel
        self.leases.take(model.name, plan.mib_by_gpu)  # raises if the plan over-commits a GPU
        self.loaded[model.name] = Loaded(inflight=1, last_used=self.clock, gpus=plan.mib_by_gpu)

    def assert_no_room_even_by_evicting(self, request: Request, holders: list[Holder]) -> None:
        """Progress: None only when evicting every idle, not-more-important model could not help."""
        evictable = [h for h in holders if h.evictable and h.priority <= request.priority]
        free = self.free()
        for h in evictable:
            for gpu, mib in h.mib_by_gpu.items():
                free[gpu] += mib
        fitting = sum(1 for mib in free.values() if mib >= request.per_gpu_mib)
        loaded_after = len(holders) - len(evictable) + 1
        assert fitting < request.tensor_parallel or (
            self.max_loaded is not None and loaded_after > self.max_loaded
        ), f"{request} could be placed by evicting {[h.key for h in evictable]} but was not"

    @precondition(lambda self: any(s.inflight for s in self.loaded.values()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, s in self.loaded.items() if s.inflight)))
        self.clock += 1
        self.loaded[name].inflight -= 1
        self.loaded[name].last_used = self.clock

    @precondition(lambda self: bool(self.loaded))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.loaded)))
        del self.loaded[name]  # in-flight requests fail with it
        released = self.leases.release(name)
        assert released is not None

    @precondition(lambda self: any(not s.inflight for s in self.loaded.values()))
    @rule(data=st.data())
    def unload_idle(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, s in self.loaded.items() if not s.inflight)))
        del self.loaded[name]
        assert self.leases.release(name) is not None

    @rule(data=st.data(), priority=st.integers(min_value=-1, max_value=2), pinned=st.booleans())
    def reload(self, data: st.DataObject, priority: int, pinned: bool) -> None:
        """A SIGHUP that changes only live fields: priority and pinned apply at once."""
        name = data.draw(st.sampled_from(sorted(self.models)))
        model = self.models[name]
        model.priority, model.pinned = priority, pinned

    @invariant()
    def no_gpu_is_overcommitted(self) -> None:
        for gpu, capacity in self.leases.capacity_mib.items():
            assert 0 <= self.leases.leased_mib(gpu) <= capacity

    @invariant()
    def leases_and_loaded_models_match(self) -> None:
        assert {lease.holder for lease in self.leases.holders()} == set(self.loaded)
        if self.max_loaded is not None:
            assert len(self.loaded) <= self.max_loaded


SchedulerModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_scheduler_bookkeeping = SchedulerModel.TestCase
