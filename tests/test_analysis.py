"""The trace analysis (profiling/analysis/); the compare command's tests are in
tests/test_compare.py.

Hand-built traces check the interval arithmetic against numbers worked out by hand; the
main job's own traces (the `profile_logdir` fixture: CNN, 2 ranks, 2 traced steps) are
checked against what the stages promise (collectives per step from the model and the
bucket layout, bytes from the parameters) and against a second, brute-force
implementation of the same definitions on a 0.1 µs grid.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp.buckets import assign_buckets
from ddp.config import Config
from ddp.models import build_model
from profiling.analysis import (
    COMMUNICATION_SPAN_PREFIXES,
    COMPUTE_SPANS,
    analyse_runs,
    analyse_trace,
    intersect,
    length,
    median_step,
    merge,
    rank_average,
    step_timeline,
    subtract,
)
from stages import STAGES

MAIN, GLOO_A, GLOO_B = 1, 2, 3  # thread ids in the hand-built traces


def event(name, start_ms, end_ms, tid=MAIN, cat="user_annotation", **args):
    """A complete event; times in ms (traces use µs)."""
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1,
        "tid": tid,
        "ts": start_ms * 1e3,
        "dur": (end_ms - start_ms) * 1e3,
        "args": args,
    }


def op(name, start_ms, end_ms):
    return event(name, start_ms, end_ms, cat="cpu_op")


def gloo(start_ms, end_ms, tid=GLOO_A, dims=((10,),), dtype="float"):
    """A Gloo collective on a worker thread; dims=None: recorded without shapes."""
    if dims is None:
        return event("gloo:all_reduce", start_ms, end_ms, tid=tid)
    args = {"Input Dims": [list(d) for d in dims], "Input type": [dtype] * len(dims)}
    return event("gloo:all_reduce", start_ms, end_ms, tid=tid, **args)


def trace(*events):
    return {"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1}, *events]}


def only_step(t):
    (step,) = analyse_trace(t)
    return step


# ---------------------------------------------------------------------------------------
# Interval arithmetic.


def test_interval_helpers_by_hand():
    assert merge([(5, 7), (1, 3), (2, 4), (7, 8), (9, 9)]) == [(1, 4), (5, 8)]
    assert intersect([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
    assert subtract([(0, 10), (20, 30)], [(2, 3), (5, 22), (29, 40)]) == [(0, 2), (3, 5), (22, 29)]
    assert length(merge([(0, 2), (1, 3), (10, 11)])) == 4


intervals = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 40)).map(sorted).map(tuple), max_size=8
)


def cells(merged):
    return {c for s, e in merged for c in range(s, e)}


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_interval_helpers_match_sets_of_unit_cells(a, b):
    a, b = merge(a), merge(b)
    assert all(x[1] < y[0] for x, y in zip(a, a[1:], strict=False))  # disjoint, sorted
    assert cells(intersect(a, b)) == cells(a) & cells(b)
    assert cells(subtract(a, b)) == cells(a) - cells(b)
    assert length(merge(a + b)) == len(cells(a) | cells(b))


# ---------------------------------------------------------------------------------------
# Hand-built traces.


def test_communication_half_covered_by_compute_is_50_percent_overlap():
    step = only_step(
        trace(
            event("ProfilerStep#7", 0, 100),
            event("forward", 0, 50),
            op("aten::conv2d", 0, 50),
            gloo(25, 75),
        )
    )
    assert step.step == 7
    assert (step.step_ms, step.compute_ms, step.communication_ms) == (100, 50, 50)
    assert (step.hidden_ms, step.not_hidden_ms, step.other_ms) == (25, 25, 25)
    assert step.overlap == 0.5


def test_waits_and_launches_are_not_compute():
    # overlapped: a launch inside an autograd node, then the wait at the end of backward
    step = only_step(
        trace(
            event("ProfilerStep#1", 0, 100),
            event("backward", 0, 100),
            op("autograd::engine::evaluate_function: AccumulateGrad", 0, 60),
            event("allreduce bucket 0 (40 B)", 50, 58),
            op("c10d::allreduce_", 51, 57),
            event("wait for communication", 60, 100),
            gloo(57, 95),
        )
    )
    # compute: [0, 50] and [58, 60]; communication [57, 95]; hidden [58, 60]
    assert step.compute_ms == pytest.approx(52)
    assert step.communication_ms == pytest.approx(38)
    assert step.hidden_ms == pytest.approx(2)


def test_only_operators_inside_forward_backward_optimizer_are_compute():
    # naive: gradients are averaged (div_) inside "finish gradient synchronization"; an
    # unlabelled gap in backward (torch DDP waiting for its bucket) is no compute either
    step = only_step(
        trace(
            event("ProfilerStep#1", 0, 100),
            op("aten::randn", 0, 5),  # making the batch, outside every span
            event("forward", 5, 30),
            op("aten::linear", 6, 29),
            event("backward", 30, 60),
            op("autograd::engine::evaluate_function: AddmmBackward0", 30, 40),
            op("autograd::engine::evaluate_function: AccumulateGrad", 50, 60),
            event("finish gradient synchronization", 60, 90),
            op("aten::div_", 80, 90),
            event("optimizer", 90, 100),
            op("aten::_foreach_add_", 92, 98),
        )
    )
    assert step.compute_ms == pytest.approx(23 + 10 + 10 + 6)


def test_concurrent_collectives_count_once_in_time_and_each_in_counts():
    step = only_step(
        trace(
            event("ProfilerStep#3", 0, 100),
            gloo(-10, 5, dims=((1,),)),  # started in the step before: time clipped, not counted
            gloo(10, 30, tid=GLOO_A, dims=((10,),)),
            gloo(20, 40, tid=GLOO_B, dims=((2, 3),), dtype="long int"),
        )
    )
    assert step.communication_ms == pytest.approx(5 + 30)
    assert step.collectives == 2
    assert (step.bytes, step.bytes_source) == (10 * 4 + 6 * 8, "collective args")
    assert step.collectives_by_name == {"gloo:all_reduce": 2}


def test_bytes_fall_back_to_span_labels_without_shapes():
    step = only_step(
        trace(
            event("ProfilerStep#3", 0, 100),
            event("allreduce bucket 0 (1000 B)", 10, 20),
            event("allreduce bucket 1 (24 B)", 20, 30),
            gloo(10, 20, dims=None),
            gloo(20, 30, dims=None),
        )
    )
    assert (step.collectives, step.bytes, step.bytes_source) == (2, 1024, "span labels")


def test_gpu_trace_uses_kernels_nccl_for_communication():
    # each kernel shares a correlation id with the CPU-side call that launched it
    step = only_step(
        trace(
            event("ProfilerStep#0", 0, 100),
            event("backward", 0, 100),
            op("aten::convolution_backward", 0, 100),  # a launch on the CPU: not compute here
            event("cudaLaunchKernel", 0, 0.5, cat="cuda_runtime", correlation=1),
            event("void cudnn::wgrad_kernel", 0, 40, tid=7, cat="kernel", correlation=1),
            event("nccl:all_reduce", 19, 20, cat="user_annotation"),  # CPU side: a launch
            event("cudaLaunchKernel", 19.2, 19.5, cat="cuda_runtime", correlation=2),
            event(
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                20,
                60,
                tid=8,
                cat="kernel",
                correlation=2,
            ),
        )
    )
    assert (step.compute_ms, step.communication_ms, step.hidden_ms) == (40, 40, 20)
    assert step.collectives == 1


def test_median_step_exposed_and_rank_average():
    def steps(*step_ms):
        events, t = [], 0
        for i, ms in enumerate(step_ms):
            events += [event(f"ProfilerStep#{i}", t, t + ms), gloo(t, t + 1)]
            t += ms
        return trace(*events)

    traces = {
        "compute_only": {0: steps(100, 120, 110), 1: steps(90, 90, 90)},
        "naive": {0: steps(150, 130, 140), 1: steps(100, 130, 125, 200)},
    }
    results = analyse_runs(traces)
    assert median_step(results[2].steps).step_ms == 140
    assert median_step(results[3].steps).step == 2  # 125 ms: the lower of 125 and 130
    assert [r.exposed_ms for r in results] == [0, 0, 30, 35]
    rows = rank_average(results)
    assert [r.run for r in rows] == ["compute_only", "naive"]
    assert rows[1].step_ms == pytest.approx((140 + 125) / 2)
    assert rows[1].exposed_ms == pytest.approx(32.5)
    assert rows[1].overlap_pct == 0  # gloo in flight with no compute at all


def test_a_trace_without_profiler_steps_is_refused():
    with pytest.raises(ValueError, match="ProfilerStep"):
        analyse_trace(trace(event("forward", 0, 1)))


# ---------------------------------------------------------------------------------------
# The main job's traces (CNN, 2 ranks, steps 2 and 3 traced, default bucket cap).


@pytest.fixture(scope="module")
def cnn():
    trainable = [(n, p) for n, p in build_model("cnn").named_parameters() if p.requires_grad]
    return {
        "params": len(trainable),
        "bytes": sum(p.numel() * p.element_size() for _, p in trainable),
        "buckets": len(assign_buckets(trainable, Config().bucket_cap_mb)),
    }


def test_every_run_and_rank_is_traced(traces, results):
    assert list(traces) == ["compute_only", *STAGES, "torch_ddp"]
    for r in results.values():
        assert r.rank in (0, 1)
        assert [s.step for s in r.steps] == [2, 3], "--warmup-steps 2 --profile-steps 2"


def test_compute_only_communicates_nothing(results):
    for rank in (0, 1):
        r = results["compute_only", rank]
        for s in r.steps:
            assert (s.communication_ms, s.hidden_ms, s.collectives, s.bytes) == (0, 0, 0, 0)
            assert s.compute_ms > 0
        assert r.exposed_ms == 0


def test_collectives_and_bytes_per_step_are_what_each_stage_promises(results, cnn):
    for rank in (0, 1):
        for s in results["naive", rank].steps:
            assert s.collectives == cnn["params"]  # one all-reduce per parameter
            assert s.bytes == cnn["bytes"]
        for stage in ("bucketed", "overlapped", "skip_sync"):
            for s in results[stage, rank].steps:
                assert s.collectives_by_name == {"gloo:all_reduce": cnn["buckets"]}, stage
                assert s.bytes == cnn["bytes"], stage
        for s in results["torch_ddp", rank].steps:  # also broadcasts BatchNorm buffers
            assert s.bytes_by_name["gloo:all_reduce"] == cnn["bytes"]


def test_bytes_from_gloo_agree_with_the_span_labels(traces):
    for rank in (0, 1):
        for run in ("naive", "bucketed"):
            labelled = [
                int(e["name"].rsplit("(", 1)[1].split()[0])
                for e in traces[run][rank]["traceEvents"]
                if e.get("name", "").startswith("allreduce ")
            ]
            steps = analyse_trace(traces[run][rank])
            assert sum(labelled) == sum(s.bytes for s in steps), run


def test_blocking_stages_hide_no_communication(results):
    # naive and bucketed all-reduce only after backward, with the main thread blocked
    for rank in (0, 1):
        for run in ("naive", "bucketed"):
            for s in results[run, rank].steps:
                assert s.communication_ms > 0
                assert s.hidden_ms == 0, (run, rank, s.step)


def test_the_step_splits_into_its_parts(results):
    for r in results.values():
        for s in r.steps:
            assert 0 <= s.hidden_ms <= min(s.compute_ms, s.communication_ms) + 1e-9
            assert s.communication_ms <= s.step_ms
            assert s.other_ms >= -1e-9, "compute ∪ communication fits in the step"


def brute_force(trace, step):
    """The module docstring's definitions on a 0.1 µs grid, with boolean masks."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    (window,) = [e for e in events if e["name"] == f"ProfilerStep#{step}"]
    main = (window["pid"], window["tid"])
    lo, n = window["ts"], round(window["dur"] * 10)

    def mask(selected):
        m = np.zeros(n, dtype=bool)
        for e in selected:
            a, b = round((e["ts"] - lo) * 10), round((e["ts"] + e["dur"] - lo) * 10)
            m[max(a, 0) : max(min(b, n), 0)] = True
        return m

    on_main = [e for e in events if (e["pid"], e["tid"]) == main]
    compute = (
        mask(e for e in on_main if e.get("cat") == "cpu_op")
        & mask(e for e in on_main if e["name"] in COMPUTE_SPANS)
        & ~mask(e for e in on_main if e["name"].startswith(COMMUNICATION_SPAN_PREFIXES))
    )
    communication = mask(e for e in events if e["name"].startswith("gloo:"))
    return {
        "compute_ms": compute.sum() / 1e4,
        "communication_ms": communication.sum() / 1e4,
        "hidden_ms": (compute & communication).sum() / 1e4,
    }


def test_interval_arithmetic_agrees_with_a_brute_force_grid(traces, results):
    for (run, rank), r in results.items():
        for s in r.steps:
            expected = brute_force(traces[run][rank], s.step)
            for key, value in expected.items():
                assert getattr(s, key) == pytest.approx(value, abs=0.005), (run, rank, key)


def test_timeline_shows_the_same_compute_and_communication(traces, results):
    for run in traces:
        s = results[run, 0].median
        t = step_timeline(traces[run][0], s.step)
        assert sum(length(v) for v in t["compute"].values()) == pytest.approx(s.compute_ms)
        assert length(t["communication"]) == pytest.approx(s.communication_ms)


def test_the_timeline_keeps_each_collective_and_each_launch():
    """A figure draws each all-reduce as its own bar and marks each launch: two buckets
    launched during backward, the second while the first runs (two rows, as Gloo runs
    two at once), then a third after the first ended (back in the first row)."""
    t = trace(
        event("ProfilerStep#1", 0, 100),
        event("backward", 0, 60),
        event("allreduce bucket 0 (40 B)", 10, 11),
        gloo(10, 40),
        event("allreduce bucket 1 (40 B)", 20, 21),
        gloo(20, 50, tid=GLOO_B),
        event("allreduce bucket 2 (40 B)", 30, 31),
        gloo(45, 70),  # queued until a thread was free
    )
    timeline = step_timeline(t, 1)
    assert timeline["launches"] == [10, 20, 30]
    assert timeline["collective_rows"] == [[(10, 40), (45, 70)], [(20, 50)]]
    assert timeline["communication"] == [(10, 70)]  # merged, for the time in flight
