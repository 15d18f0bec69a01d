"""The simulator's arithmetic against schedules worked out by hand on small cases: the
core model (`Sharing`: backward's slowdown only), and what the virtual CPU cluster's
extension (`SharedCores`) adds."""

from __future__ import annotations

import pytest

from profiling.simulate.cpu_cluster.sharing import SharedCores
from profiling.simulate.layouts import per_parameter, uniform_buckets
from profiling.simulate.schedule import (
    Cost,
    Grad,
    Sharing,
    StageSchedule,
    Workload,
    linear_cost,
    simulate,
)

MiB = 2**20
# Two gradients of 100 bytes: the last layer's ready 1 s into backward, the first's at 3 s.
TWO = Workload(
    grads=(Grad("first", 100, 3.0), Grad("last", 100, 1.0)),
    forward_s=2.0,
    backward_s=4.0,
    optimizer_s=1.0,
)
COST = linear_cost(latency_s=1.0, s_per_byte=0.01)  # 100 bytes: 1 + 1 = 2 s


def bars(step, lane):
    return [(s.label, pytest.approx(s.start_s), pytest.approx(s.end_s)) for s in step.lane(lane)]


def test_two_buckets_overlapped():
    # forward 0-2; backward 2-6; "last" ready at 3: bucket 0 on the wire 3-5; "first"
    # ready at 5: bucket 1 5-7; the optimizer waits for it: 7-8.
    step = simulate(TWO, [[1], [0]], COST, StageSchedule(overlap=True))
    assert bars(step, "comm") == [("last", 3, 5), ("first", 5, 7)]
    assert ("backward", 2, 6) in bars(step, "compute")
    assert step.step_s == pytest.approx(8.0)
    assert step.compute_s == pytest.approx(7.0)
    assert step.exposed_comm_s == pytest.approx(1.0)


def test_two_buckets_overlapped_with_contention():
    # Backward runs at 1/1.5 of its speed while a collective flies. 2-3: 1 s of backward
    # done, "last" ready. 3-5: bucket 0 flies, backward does 2 x 2/3 = 4/3 (7/3 in all).
    # 5-5.667: alone again, 2/3 more: "first" ready at 17/3; bucket 1 17/3-23/3.
    # Backward's last second, under bucket 1: 1.5 s, ends at 43/6. Optimizer 23/3-26/3.
    step = simulate(TWO, [[1], [0]], COST, StageSchedule(overlap=True), Sharing(slowdown=0.5))
    assert bars(step, "comm") == [("last", 3, 5), ("first", 17 / 3, 23 / 3)]
    assert ("backward", 2, 43 / 6) in bars(step, "compute")
    assert step.step_s == pytest.approx(26 / 3)


def test_communication_slowed_while_backward_runs():
    # Communication at half speed while backward runs (comm_slowdown 1), backward at
    # full speed. "last" launches at 3: its 1 s of latency takes 3-5, half its 1 s of
    # wire 5-6, when backward ends; the other half 6-6.5. "first" (ready at 5, queued)
    # 6.5-8.5, alone. Optimizer 8.5-9.5.
    step = simulate(
        TWO, [[1], [0]], COST, StageSchedule(overlap=True), SharedCores(comm_slowdown=1.0)
    )
    assert bars(step, "comm") == [("last", 3, 6.5), ("first", 6.5, 8.5)]
    assert ("backward", 2, 6) in bars(step, "compute")
    assert step.step_s == pytest.approx(9.5)
    # After backward, as naive and bucketed communicate, nothing is slowed.
    after = simulate(
        TWO, [[1], [0]], COST, StageSchedule(overlap=False), SharedCores(comm_slowdown=1.0)
    )
    assert after.step_s == pytest.approx(2 + 4 + 2 + 2 + 1)


def test_latency_bound_collectives_slowed_apart_from_the_wire_by_hand():
    # Small all-reduces wait for the cores, large ones for the link: here only a
    # collective's latency slows backward (to half speed) and is slowed by it (to a
    # third); its wire phase neither. "last" ready at 3: latency 3-6 (1 s at a third),
    # backward 1.5 s of work in it (2.5 in all); wire 6-7, backward at full speed:
    # "first" ready at 6.5, queued; backward 3.5 at 7. "first"'s latency from 7, with
    # backward at half speed: backward done at 8, a third of the latency by then, the
    # rest at full speed to 8 2/3; its wire to 9 2/3. Optimizer to 10 2/3.
    step = simulate(
        TWO, [[1], [0]], COST, StageSchedule(overlap=True),
        SharedCores(latency_slowdown=1.0, comm_latency_slowdown=2.0),
    )  # fmt: skip
    assert bars(step, "comm") == [("last", 3, 7), ("first", 7, 29 / 3)]
    assert ("backward", 2, 8) in bars(step, "compute")
    assert step.step_s == pytest.approx(32 / 3)
    # Not given, they are the slowdowns of the whole collective: here none, as in
    # test_two_buckets_overlapped.
    plain = simulate(TWO, [[1], [0]], COST, StageSchedule(overlap=True))
    assert plain.step_s == pytest.approx(8.0)


def test_one_bucket_waits_for_the_whole_backward():
    step = simulate(TWO, [[1, 0]], COST, StageSchedule(overlap=True))
    # Both ready at 5 (backward's 3 s), 200 bytes: 1 + 2 = 3 s, 5-8; optimizer 8-9.
    assert bars(step, "comm") == [("bucket 0", 5, 8)]
    assert step.step_s == pytest.approx(9.0)


def test_buckets_go_out_in_bucket_order():
    # Bucket 0 holds "first" (ready last): bucket 1 is full at 3 but must wait for it.
    step = simulate(TWO, [[0], [1]], COST, StageSchedule(overlap=True))
    assert bars(step, "comm") == [("first", 5, 7), ("last", 7, 9)]


def test_naive_after_backward_one_per_parameter_in_parameter_order():
    step = simulate(TWO, per_parameter(TWO), COST, StageSchedule(overlap=False))
    # backward 2-6, then "first" 6-8, "last" 8-10, optimizer 10-11.
    assert bars(step, "comm") == [("first", 6, 8), ("last", 8, 10)]
    assert step.step_s == pytest.approx(11.0)


def test_no_sync_accumulation_communicates_once():
    step = simulate(TWO, [[1], [0]], COST, StageSchedule(overlap=True, accumulation_steps=3))
    # Two micro-batches of 6 s with no communication, then the synced one as above: 12 + 8.
    assert len(step.lane("comm")) == 2
    assert [s.label for s in step.lane("compute")].count("forward") == 3
    assert step.step_s == pytest.approx(20.0)
    assert step.compute_s == pytest.approx(19.0)


def test_lanes_overlap_latency_and_share_the_wire():
    both_at_once = Workload((Grad("a", 100, 1.0), Grad("b", 100, 1.0)), 0.0, 1.0, 0.0)
    latency_only = lambda nbytes: Cost(1.0, 0.0)  # noqa: E731
    wire_only = lambda nbytes: Cost(0.0, 1.0)  # noqa: E731
    one, two = StageSchedule(overlap=True), StageSchedule(overlap=True, lanes=2)
    # Latency: one lane 1-2-3, two lanes both 1-2.
    assert simulate(both_at_once, [[0], [1]], latency_only, one).step_s == pytest.approx(3.0)
    assert simulate(both_at_once, [[0], [1]], latency_only, two).step_s == pytest.approx(2.0)
    # The wire: two lanes at half speed each end together, no sooner than one lane.
    step = simulate(both_at_once, [[0], [1]], wire_only, two)
    assert bars(step, "comm 0") == [("a", 1, 3)] and bars(step, "comm 1") == [("b", 1, 3)]


def test_bucket_larger_than_the_cap_gets_its_own():
    big = Workload(
        (Grad("w0", 3 * MiB, 2.0), Grad("w1", MiB // 2, 1.0), Grad("w2", MiB // 2, 0.5)),
        0.0, 2.0, 0.0,
    )  # fmt: skip
    # Reverse parameter order: w2 and w1 fill 1 MiB exactly; w0 is over the cap, alone.
    assert uniform_buckets(big, 1.0) == [[2, 1], [0]]
    # A first bucket capped at 0.5 MiB holds w2 alone.
    assert uniform_buckets(big, 1.0, first_bucket_cap_mb=0.5) == [[2], [1], [0]]
    # bucketed: after backward, w2+w1 (1 MiB) then w0 (3 MiB) at 1 s + 1 s/MiB.
    cost = linear_cost(1.0, 1.0 / MiB)
    step = simulate(big, [[2, 1], [0]], cost, StageSchedule(overlap=False))
    assert bars(step, "comm") == [("bucket 0", 2, 4), ("w0", 4, 8)]


def test_ready_order_layout_follows_measured_readiness():
    w = Workload((Grad("a", 8, 0.2), Grad("b", 8, 0.1), Grad("c", 8, 0.3)), 0, 1, 0)
    assert uniform_buckets(w, 16 / MiB, ready_order=True) == [[1, 0], [2]]


def test_a_collective_launched_while_another_flies_pays_the_busy_launch():
    both_at_once = Workload((Grad("a", 100, 1.0), Grad("b", 100, 1.0)), 0.0, 1.0, 0.0)
    latency_only = lambda nbytes: Cost(1.0, 0.0)  # noqa: E731
    # One lane: "a" 1-2; "b", launched at 1 while "a" flies, waits, then 1 + 0.5 s: 2-3.5.
    busy = SharedCores(busy_launch_s=0.5)
    step = simulate(both_at_once, [[0], [1]], latency_only, StageSchedule(True), busy)
    assert bars(step, "comm") == [("a", 1, 2), ("b", 2, 3.5)]
    # Ready apart, nothing flies at "b"'s launch: no extra.
    apart = Workload((Grad("a", 100, 1.0), Grad("b", 100, 3.0)), 0.0, 3.0, 0.0)
    assert bars(simulate(apart, [[0], [1]], latency_only, StageSchedule(True), busy), "comm") == [
        ("a", 1, 2), ("b", 3, 4),
    ]  # fmt: skip


def test_stage_copies_in_and_out_by_hand():
    # Two 100-byte gradients ready 10 and 20 ms into a 20 ms backward, one bucket each;
    # every all-reduce 5 ms; a copy 0.01 ms per byte (1 ms a gradient).
    # overlapped: the hook's copy in makes them ready at 11 and 22 (backward ends at
    # 22); all-reduces 11-16 and 22-27; copies out after backward, each once its
    # all-reduce is done: 22-23, then 27-28.
    # bucketed: backward to 20, then copy in, all-reduce, copy out per bucket:
    # 20-21-26-27, 27-28-33-34. naive copies out only (its in-place divide): 32.
    work = Workload((Grad("a", 100, 0.010), Grad("b", 100, 0.020)), 0.0, 0.020, 0.0)
    cost = linear_cost(0.005, 0.0)
    copies = SharedCores(copy_in_s_per_byte=1e-5, copy_out_s_per_byte=1e-5)
    overlapped = simulate(work, [[0], [1]], cost, StageSchedule(overlap=True), copies)
    assert overlapped.step_s == pytest.approx(0.028)
    comm = [t for s in overlapped.lane("comm") for t in (s.start_s, s.end_s)]
    assert comm == pytest.approx([0.011, 0.016, 0.022, 0.027])
    bucketed = simulate(work, [[0], [1]], cost, StageSchedule(overlap=False), copies)
    assert bucketed.step_s == pytest.approx(0.034)
    naive = simulate(
        work, [[0], [1]], cost, StageSchedule(False), SharedCores(copy_out_s_per_byte=1e-5)
    )
    assert naive.step_s == pytest.approx(0.032)


def test_stage_own_time_per_gradient_by_hand():
    # The same two gradients and all-reduces, no copies, and the stage's own 2 ms a
    # gradient (its Python, timed with no communication).
    # overlapped: in the hook, like a copy in: ready at 12 and 24 (backward ends at 24);
    # all-reduces 12-17 and 24-29: the step is 29.
    # bucketed: backward to 20, then all of it at once (4 ms), then the all-reduces
    # one after the other: 24-29-34.
    work = Workload((Grad("a", 100, 0.010), Grad("b", 100, 0.020)), 0.0, 0.020, 0.0)
    cost = linear_cost(0.005, 0.0)
    own = SharedCores(own_s_per_grad=0.002)
    overlapped = simulate(work, [[0], [1]], cost, StageSchedule(True), own)
    assert overlapped.step_s == pytest.approx(0.029)
    comm = [t for s in overlapped.lane("comm") for t in (s.start_s, s.end_s)]
    assert comm == pytest.approx([0.012, 0.017, 0.024, 0.029])
    bucketed = simulate(work, [[0], [1]], cost, StageSchedule(False), own)
    assert bucketed.step_s == pytest.approx(0.034)
    assert ("stage", 0.020, 0.024) in [
        (s.label, round(s.start_s, 6), round(s.end_s, 6)) for s in bucketed.lane("compute")
    ]
    # Its time is the stage's, not the compute's: exposed, as the benchmark counts it.
    assert bucketed.compute_s == pytest.approx(0.020)


def test_the_simulator_reads_in_one_sitting():
    # The model and its commands, without the virtual CPU cluster's extension: at most
    # 3,000 lines, none of its files over 500.
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "profiling" / "simulate"
    lines = {p.name: len(p.read_text().splitlines()) for p in package.glob("*.py")}
    assert sum(lines.values()) <= 3000, lines
    assert max(lines.values()) <= 500, lines


def test_every_package_is_installed():
    # A non-editable install holds only the packages pyproject.toml's find includes.
    from pathlib import Path

    import tomllib
    from setuptools import find_packages

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(find_packages(where=root, include=config["packages"]["find"]["include"]))
    found = {
        ".".join(p.parent.relative_to(root).parts)
        for top in ("ddp", "stages", "profiling")
        for p in (root / top).rglob("__init__.py")
    }
    assert found <= listed, sorted(found - listed)
