"""choose_victims: the idle models to unload so that `need_mib` fits on one GPU."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.eviction import Candidate, choose_victims


def c(key: str, gpu: int = 0, mib: int = 1000, priority: int = 0, last_used: float = 0.0) -> Candidate:
    return Candidate(key=key, gpu=gpu, mib=mib, priority=priority, last_used=last_used)


def keys(victims: list[Candidate] | None) -> list[str] | None:
    return None if victims is None else [v.key for v in victims]


def test_least_recently_used_goes_first_within_equal_priority() -> None:
    pool = [c("new", last_used=30.0), c("old", last_used=10.0), c("mid", last_used=20.0)]
    assert keys(choose_victims(1000, {0: 0}, pool, max_priority=0)) == ["old"]
    assert keys(choose_victims(2000, {0: 0}, pool, max_priority=0)) == ["old", "mid"]
    assert keys(choose_victims(3000, {0: 0}, pool, max_priority=0)) == ["old", "mid", "new"]


def test_lower_priority_is_evicted_before_a_less_recently_used_higher_one() -> None:
    pool = [c("important-old", priority=5, last_used=1.0), c("cheap-new", priority=-1, last_used=99.0)]
    assert keys(choose_victims(1000, {0: 0}, pool, max_priority=10)) == ["cheap-new"]
    assert keys(choose_victims(2000, {0: 0}, pool, max_priority=10)) == ["cheap-new", "important-old"]


def test_never_evicts_above_the_requesters_priority() -> None:
    pool = [c("high", priority=2, mib=8000), c("low", priority=1, mib=500)]
    assert choose_victims(1000, {0: 0}, pool, max_priority=1) is None
    assert keys(choose_victims(500, {0: 0}, pool, max_priority=1)) == ["low"]
    # "high" alone frees enough, so "low" is spared.
    assert keys(choose_victims(1000, {0: 0}, pool, max_priority=2)) == ["high"]


def test_an_old_small_model_is_spared_when_a_newer_big_one_frees_enough_alone() -> None:
    pool = [c("old-small", mib=2000, last_used=1.0), c("new-big", mib=10000, last_used=9.0)]
    assert keys(choose_victims(10000, {0: 0}, pool, max_priority=0)) == ["new-big"]
    assert keys(choose_victims(11000, {0: 0}, pool, max_priority=0)) == ["old-small", "new-big"]


def test_equal_priority_may_be_evicted() -> None:
    assert keys(choose_victims(100, {0: 0}, [c("peer", priority=3)], max_priority=3)) == ["peer"]


def test_free_memory_counts_towards_the_need() -> None:
    pool = [c("a", mib=300, last_used=1.0), c("b", mib=300, last_used=2.0)]
    assert keys(choose_victims(1000, {0: 400}, pool, max_priority=0)) == ["a", "b"]
    assert keys(choose_victims(1000, {0: 700}, pool, max_priority=0)) == ["a"]
    assert choose_victims(1000, {0: 300}, pool, max_priority=0) is None


def test_picks_the_gpu_needing_the_fewest_victims() -> None:
    pool = [
        c("g0-a", gpu=0, mib=500, last_used=1.0),
        c("g0-b", gpu=0, mib=500, last_used=2.0),
        c("g1-big", gpu=1, mib=1000, last_used=50.0),
    ]
    assert keys(choose_victims(1000, {0: 0, 1: 0}, pool, max_priority=0)) == ["g1-big"]


def test_equal_counts_prefer_the_gpu_whose_victims_were_used_least_recently() -> None:
    pool = [c("g0", gpu=0, last_used=20.0), c("g1", gpu=1, last_used=10.0)]
    assert keys(choose_victims(1000, {0: 0, 1: 0}, pool, max_priority=0)) == ["g1"]
    pool = [c("g0", gpu=0, last_used=10.0), c("g1", gpu=1, last_used=20.0)]
    assert keys(choose_victims(1000, {0: 0, 1: 0}, pool, max_priority=0)) == ["g0"]


def test_a_full_tie_goes_to_the_lowest_gpu_index() -> None:
    pool = [c("g1", gpu=1), c("g0", gpu=0)]
    assert keys(choose_victims(1000, {1: 0, 0: 0}, pool, max_priority=0)) == ["g0"]


def test_victims_never_span_two_gpus() -> None:
    pool = [c("g0", gpu=0, mib=600), c("g1", gpu=1, mib=600)]
    assert choose_victims(1000, {0: 0, 1: 0}, pool, max_priority=0) is None


def test_returns_none_when_nothing_suffices() -> None:
    assert choose_victims(1000, {0: 0}, [], max_priority=0) is None
    assert choose_victims(10_000, {0: 100}, [c("a"), c("b")], max_priority=0) is None


def test_candidates_on_an_unknown_gpu_are_ignored() -> None:
    assert choose_victims(1000, {0: 0}, [c("elsewhere", gpu=7)], max_priority=0) is None


def test_returns_none_when_free_space_already_suffices() -> None:
    """Nothing needs unloading: no victims is not a victim set, so the caller gets None (it places first)."""
    assert choose_victims(1000, {0: 1000}, [c("a")], max_priority=0) is None
    assert choose_victims(0, {0: 0}, [c("a")], max_priority=0) is None


def test_a_gpu_with_room_is_skipped_and_another_may_still_be_chosen() -> None:
    pool = [c("g0", gpu=0), c("g1", gpu=1)]
    assert keys(choose_victims(1000, {0: 5000, 1: 0}, pool, max_priority=0)) == ["g1"]


def test_input_order_does_not_matter() -> None:
    pool = [c(f"m{i}", mib=100 * (i + 1), priority=i % 3, last_used=float(i * 7 % 5)) for i in range(8)]
    forward = choose_victims(1500, {0: 0}, pool, max_priority=2)
    backward = choose_victims(1500, {0: 0}, list(reversed(pool)), max_priority=2)
    assert forward is not None
    assert keys(forward) == keys(backward)


# --- properties --------------------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, dict[int, int], list[Candidate], int]:
    n_gpus = draw(st.integers(min_value=1, max_value=4))
    free = {g: draw(st.integers(min_value=0, max_value=4000)) for g in range(n_gpus)}
    candidates = [
        Candidate(
            key=f"m{i}",
            gpu=draw(st.integers(min_value=0, max_value=n_gpus - 1)),
            mib=draw(st.integers(min_value=1, max_value=4000)),
            priority=draw(st.integers(min_value=-2, max_value=2)),
            last_used=draw(st.floats(min_value=0, max_value=100, allow_nan=False)),
        )
        for i in range(draw(st.integers(min_value=0, max_value=10)))
    ]
    need = draw(st.integers(min_value=1, max_value=12000))
    max_priority = draw(st.integers(min_value=-2, max_value=2))
    return need, free, candidates, max_priority


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_any_victim_set_is_on_one_gpu_frees_enough_and_is_minimal(
    scenario: tuple[int, dict[int, int], list[Candidate], int],
) -> None:
    need, free, candidates, max_priority = scenario
    victims = choose_victims(need, free, candidates, max_priority)
    eligible = [x for x in candidates if x.priority <= max_priority]
    if victims is None:
        # No GPU could make room by unloading (or it already had room and nothing needs to go).
        for gpu, room in free.items():
            pool_mib = sum(x.mib for x in eligible if x.gpu == gpu)
            assert room >= need or room + pool_mib < need
        return
    assert victims, "a victim set is never empty"
    assert len({v.key for v in victims}) == len(victims)
    assert all(v in candidates for v in victims)
    (gpu,) = {v.gpu for v in victims}
    assert free[gpu] < need
    assert free[gpu] + sum(v.mib for v in victims) >= need
    assert all(v.priority <= max_priority for v in victims)
    # Minimal: every victim is needed; sparing any one of them would leave too little room.
    freed = free[gpu] + sum(v.mib for v in victims)
    assert all(freed - v.mib < need for v in victims)
    # Victims are listed lowest priority first, then least recently used.
    order = [(v.priority, v.last_used) for v in victims]
    assert order == sorted(order)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_no_other_gpu_could_make_room_with_fewer_victims(
    scenario: tuple[int, dict[int, int], list[Candidate], int],
) -> None:
    need, free, candidates, max_priority = scenario
    victims = choose_victims(need, free, candidates, max_priority)
    for gpu, room in free.items():
        if room >= need:
            continue
        pool = sorted(
            (x for x in candidates if x.gpu == gpu and x.priority <= max_priority),
            key=lambda x: (x.priority, x.last_used),
        )
        freed, count = room, 0
        for x in pool:
            if freed >= need:
                break
            freed, count = freed + x.mib, count + 1
        if freed >= need:
            assert victims is not None
            assert len(victims) <= count
