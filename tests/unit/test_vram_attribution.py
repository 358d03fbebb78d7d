"""Whose memory is whose: by pid on a host, by the device's rise in a container; never counted twice."""

from __future__ import annotations

from supervisor.vram_attribution import GpuUsage, VramAttribution


def used(mib: int, **processes: int) -> dict[int, GpuUsage]:
    """GPU 0 using `mib` in all, with processes given as p<pid>=MiB."""
    return {0: GpuUsage(mib, {int(k[1:]): v for k, v in processes.items()})}


def loaded_in_a_container(ledger: VramAttribution, holder: str, before: int, after: int, lease: int) -> None:
    ledger.begin(holder, {0: lease})
    ledger.measured_before(holder, used(before, p900001=before))
    ledger.measured_after(holder, used(after, p900001=after))


def test_a_child_whose_pids_nvml_lists_is_attributed_by_pid() -> None:
    ledger = VramAttribution()
    ledger.begin("a#1", {0: 1000})
    found = ledger.attribute("a#1", {0: 1000}, [41, 42], used(1000, p42=700, p7=300))
    assert found is not None
    assert (found.method, found.mib_by_gpu, found.trusted) == ("pid", {0: 700}, True)
    assert ledger.pids_visible is True
    assert ledger.foreign_mib(used(1000, p42=700, p7=300)) == {0: 300}


def test_in_another_pid_namespace_the_device_delta_is_attributed_and_not_counted_as_foreign() -> None:
    ledger = VramAttribution()
    loaded_in_a_container(ledger, "a#1", before=300, after=1000, lease=900)
    found = ledger.attribute("a#1", {0: 900}, [41], used(1000, p900001=1000))
    assert found is not None
    assert (found.method, found.mib_by_gpu) == ("device_delta", {0: 700})
    assert ledger.pids_visible is False
    assert ledger.foreign_mib(used(1000)) == {0: 300}


def test_a_second_container_load_does_not_double_count_the_first() -> None:
    ledger = VramAttribution()
    loaded_in_a_container(ledger, "a#1", before=300, after=1000, lease=900)
    ledger.attribute("a#1", {0: 900}, [41], used(1000))
    loaded_in_a_container(ledger, "b#2", before=1000, after=1700, lease=900)
    found = ledger.attribute("b#2", {0: 900}, [51], used(1700))
    assert found is not None
    assert found.mib_by_gpu == {0: 700}
    assert ledger.foreign_mib(used(1700)) == {0: 300}


def test_a_loading_child_counts_as_ours_up_to_its_lease() -> None:
    ledger = VramAttribution()
    ledger.begin("a#1", {0: 500})
    ledger.measured_before("a#1", used(300))
    assert ledger.foreign_mib(used(600)) == {0: 300}  # 300 taken so far, all its own
    assert ledger.foreign_mib(used(1000)) == {0: 500}  # beyond its lease is nobody's we know


def test_memory_beyond_a_lease_counts_as_foreign() -> None:
    ledger = VramAttribution()
    ledger.begin("a#1", {0: 500})
    ledger.attribute("a#1", {0: 500}, [42], used(1000, p42=800))
    assert ledger.foreign_mib(used(1000, p42=800)) == {0: 500}


def test_a_stop_is_released_once_the_device_gives_the_delta_back() -> None:
    ledger = VramAttribution()
    loaded_in_a_container(ledger, "a#1", before=300, after=1000, lease=900)
    ledger.attribute("a#1", {0: 900}, [41], used(1000))
    ledger.begin_release("a#1", [41], used(1000))
    assert ledger.still_held("a#1", used(1000)) == {0: 700}
    assert ledger.still_held("a#1", used(650)) == {0: 350}
    assert ledger.still_held("a#1", used(320)) == {}  # within the slack: given back


def test_a_load_measured_while_a_stopped_child_gives_memory_back_is_not_learned_from() -> None:
    ledger = VramAttribution()
    loaded_in_a_container(ledger, "a#1", before=300, after=1000, lease=900)
    ledger.attribute("a#1", {0: 900}, [41], used(1000))
    ledger.begin_release("a#1", [41], used(1000))
    loaded_in_a_container(ledger, "b#2", before=1000, after=1500, lease=900)  # a gave 200 back meanwhile
    found = ledger.attribute("b#2", {0: 900}, [51], used(1500))
    assert found is not None
    assert (found.mib_by_gpu, found.trusted) == ({0: 500}, False)
    # Told too little about b, the check keeps a's lease rather than over-commit (released once b stops).
    assert ledger.still_held("a#1", used(1500)) == {0: 700}


def test_a_load_measured_across_a_stop_is_not_learned_from() -> None:
    ledger = VramAttribution()
    loaded_in_a_container(ledger, "a#1", before=300, after=1000, lease=900)
    ledger.attribute("a#1", {0: 900}, [41], used(1000))
    ledger.begin("b#2", {0: 900})
    ledger.measured_before("b#2", used(1000))
    ledger.begin_release("a#1", [41], used(1000))
    ledger.measured_after("b#2", used(1100))  # b took 800 while a gave back 700
    found = ledger.attribute("b#2", {0: 900}, [51], used(1100))
    assert found is not None
    assert (found.mib_by_gpu, found.trusted) == ({0: 100}, False)


def test_pid_release_waits_for_the_pids_to_leave_nvml() -> None:
    ledger = VramAttribution()
    ledger.begin("a#1", {0: 1000})
    ledger.attribute("a#1", {0: 1000}, [42], used(1000, p42=700))
    ledger.begin_release("a#1", [42, 43], used(1000, p42=700))
    assert ledger.still_held("a#1", used(1000, p42=700)) == {0: 700}
    assert ledger.still_held("a#1", used(300)) == {}


def test_a_renamed_holding_keeps_its_baseline_under_the_leaked_name() -> None:
    ledger = VramAttribution()
    ledger.begin("a#1", {0: 1000})
    ledger.attribute("a#1", {0: 1000}, [42], used(1000, p42=700))
    ledger.begin_release("a#1", [42], used(1000, p42=700))
    ledger.rename("a#1", "leaked:a#1", {0: 700})
    assert ledger.still_held("leaked:a#1", used(1000, p42=700)) == {0: 700}
    assert ledger.foreign_mib(used(1000, p42=700)) == {0: 300}  # the leaked lease covers it


def test_sync_follows_the_lease_map() -> None:
    ledger = VramAttribution()
    ledger.begin("gone#1", {0: 100})
    ledger.sync({"a#2": {0: 500}}, {"a#2": [42]})
    assert set(ledger.holdings) == {"a#2"}
    assert ledger.foreign_mib(used(1000, p42=400)) == {0: 600}
