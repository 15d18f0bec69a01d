"""Real multi-GPU NCCL traces read by profiling.analysis and `profiling.compare --analyse-only`.

The traces (tests/fixtures/gpu-traces/, one folder per job; tests/fixtures/README.md says
where each comes from) were recorded by others on A100 GPUs. The expected answers come
from `reference` below, a separate small sweep written for these tests and sharing no
code with profiling.analysis: it ties each GPU event to the CPU-side call that launched
it by their correlation id, the call to a step by its time, measures each union with a
boundary sweep (not interval merging), and reads bytes from the kernel's args or the
nccl:* span around the launch. Where a figure can be worked out by hand, it is pinned too.
"""

from __future__ import annotations

import copy
import gzip
import json
import shutil
from pathlib import Path

import pytest

from profiling import compare
from profiling.analysis import (
    TraceFormatError,
    analyse_runs,
    analyse_trace,
    load_trace,
    read_logdir,
    step_timeline,
)
from profiling.common import charts

FIXTURES = Path(__file__).parent / "fixtures" / "gpu-traces"
DDP = FIXTURES / "a100-ddp-resnet50" / "a100-ddp-resnet50-rank0.json.gz"
LAG = FIXTURES / "a100-16w-gpu-lag" / "a100-16w-gpu-lag-rank0.json.gz"
SAMPLED = [FIXTURES / "sampled-128w" / f"sampled-128w-rank{r}.json.gz" for r in (0, 1)]
ALL = [DDP, LAG, *SAMPLED]


@pytest.fixture(scope="module")
def traces() -> dict[Path, dict]:
    return {path: load_trace(path) for path in ALL}


# ---------------------------------------------------------------------------------------
# The reference: the definitions, computed another way.

# Every dtype name these traces use, with its size in bytes.
SIZES = {
    "float": 4,
    "Float": 4,
    "long": 8,
    "Long": 8,
    "int": 4,
    "unsigned char": 1,
    "signed char": 1,
}


def sweep(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(|∪a|, |∪b|, |∪a ∩ ∪b|) by walking the sorted boundaries with a counter per set."""
    edges = sorted(
        [(s, 0, +1) for s, _ in a]
        + [(e, 0, -1) for _, e in a]
        + [(s, 1, +1) for s, _ in b]
        + [(e, 1, -1) for _, e in b]
    )
    count, total, last = [0, 0], [0.0, 0.0, 0.0], None
    for t, which, step in edges:
        if last is not None:
            total[0] += (t - last) * (count[0] > 0)
            total[1] += (t - last) * (count[1] > 0)
            total[2] += (t - last) * (count[0] > 0 and count[1] > 0)
        count[which] += step
        last = t
    return total[0], total[1], total[2]


def reference(trace: dict) -> dict[int, dict]:
    """Per step N of ProfilerStep#N: compute, communication and hidden ms of the GPU work
    it launched, its NCCL kernels and their payload bytes, and when its GPU work ended."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = {
        int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["name"].startswith("ProfilerStep#") and e["cat"] == "user_annotation"
    }
    calls = {e["args"]["correlation"]: e for e in events if e["cat"] == "cuda_runtime"}
    spans = [e for e in events if e["name"].startswith("nccl:") and e["cat"] == "user_annotation"]
    out = {}
    for number, (lo, hi) in steps.items():
        compute, nccl, payload = [], [], 0
        for e in events:
            call = calls.get(e["args"].get("correlation"))
            if e["cat"] not in ("kernel", "gpu_memcpy", "gpu_memset") or call is None:
                continue
            if not lo <= call["ts"] < hi:
                continue
            interval = (e["ts"], e["ts"] + e["dur"])
            if not e["name"].startswith(("ncclKernel_", "ncclDevKernel_")):
                compute.append(interval)
                continue
            nccl.append(interval)
            if "In msg nelems" in e["args"]:
                payload += e["args"]["In msg nelems"] * SIZES[e["args"]["dtype"]]
            else:
                (span,) = [
                    s
                    for s in spans
                    if (s["pid"], s["tid"]) == (call["pid"], call["tid"])
                    and s["ts"] <= call["ts"] <= s["ts"] + s["dur"]
                ]
                for shape, dtype in zip(
                    span["args"]["Input Dims"], span["args"]["Input type"], strict=True
                ):
                    n = SIZES[dtype]
                    for size in shape:
                        n *= size
                    payload += n
        computing, communicating, hidden = sweep(compute, nccl)
        out[number] = {
            "compute_ms": computing / 1e3,
            "communication_ms": communicating / 1e3,
            "hidden_ms": hidden / 1e3,
            "collectives": len(nccl),
            "bytes": payload,
            "gpu_end_ms": (max(e for _, e in compute + nccl) - lo) / 1e3,
        }
    return out


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_every_step_of_every_trace_matches_the_reference(traces, path):
    expected = reference(traces[path])
    steps = analyse_trace(traces[path])
    assert [s.step for s in steps] == sorted(expected)
    for s in steps:
        want = expected[s.step]
        for key in ("compute_ms", "communication_ms", "hidden_ms", "gpu_end_ms"):
            assert getattr(s, key) == pytest.approx(want[key], abs=1e-6), (s.step, key)
        assert (s.collectives, s.bytes) == (want["collectives"], want["bytes"]), s.step
        assert s.bytes_source == "collective args"


# ---------------------------------------------------------------------------------------
# 1. Traces are found by what they hold, whatever their file names.


def test_traces_are_found_whatever_their_names(traces, tmp_path, capsys):
    # torch's tensorboard_trace_handler's default name, another tool's, a plain .json, and
    # the two sampled ranks under each other's names: the rank is the trace's own
    logdir = tmp_path / "logdir"
    (logdir / "ddp").mkdir(parents=True)
    (logdir / "sampled").mkdir()
    shutil.copy(DDP, logdir / "ddp" / "gpu-host-3_2910249.1716390922123.pt.trace.json.gz")
    shutil.copy(SAMPLED[1], logdir / "sampled" / "rank-0.json.gz")
    with gzip.open(SAMPLED[0], "rt") as f:
        (logdir / "sampled" / "worker1.json").write_text(f.read())
    (logdir / "sampled" / "profile.json").write_text('{"runs": []}')  # JSON, not a trace
    found = read_logdir(logdir)
    assert {run: sorted(ranks) for run, ranks in found.items()} == {"sampled": [0, 1], "ddp": [0]}
    for rank in (0, 1):  # sampled (recorded 2023) before ddp (2024): the order they were traced
        assert found["sampled"][rank]["distributedInfo"]["rank"] == rank

    out = tmp_path / "out"
    compare.main(["--analyse-only", str(logdir), "--out", str(out), "--no-scalars"])
    data = json.loads((out / "profile.json").read_text())
    assert [r["run"] for r in data["runs"]] == ["sampled", "ddp"]
    ddp = data["runs"][1]
    assert (ddp["collectives_per_step"], ddp["bytes_per_step"]) == (7, 102_441_032)
    expected = {SAMPLED[0]: 0, SAMPLED[1]: 1}
    for path, rank in expected.items():
        (r,) = [r for r in data["ranks"] if (r["run"], r["rank"]) == ("sampled", rank)]
        assert r["device"] == "gpu"
        want = reference(traces[path])
        for s in r["steps"]:
            assert s["collectives"] == want[s["step"]]["collectives"]
            assert s["communication_ms"] == pytest.approx(want[s["step"]]["communication_ms"])
            assert s["bytes"] == want[s["step"]]["bytes"]


def test_a_folder_of_one_jobs_traces_is_one_run(tmp_path):
    for path in SAMPLED:
        shutil.copy(path, tmp_path / path.name)
    found = read_logdir(tmp_path)
    assert list(found) == [tmp_path.name] and sorted(found[tmp_path.name]) == [0, 1]


def test_traces_of_different_jobs_in_one_folder_are_refused(tmp_path):
    shutil.copy(DDP, tmp_path / DDP.name)  # 2 ranks
    shutil.copy(SAMPLED[1], tmp_path / SAMPLED[1].name)  # 128 ranks
    with pytest.raises(SystemExit, match="different world sizes.*folder of its own") as caught:
        compare.main(["--analyse-only", str(tmp_path), "--no-scalars"])
    assert f"{tmp_path} holds traces" in str(caught.value)


# ---------------------------------------------------------------------------------------
# 2. Bytes per step, from NCCL kernels' args or the nccl:* span around their launch.


def test_ddp_resnet50_moves_its_gradients_and_buffers_every_step(traces):
    # Worked out by hand: ResNet-50's 25,557,032 float32 parameters are all-reduced once
    # (5 buckets), and DDP broadcasts its 53 BatchNorm layers' buffers: running mean and
    # variance (26,560 channels each, float32) and num_batches_tracked (int64).
    gradients = 25_557_032 * 4
    buffers = 2 * 26_560 * 4 + 53 * 8
    for s in analyse_trace(traces[DDP]):
        assert s.bytes_by_name == {"nccl:all_reduce": gradients, "nccl:broadcast": buffers}
        assert s.collectives_by_name == {"nccl:all_reduce": 5, "nccl:broadcast": 2}
        assert s.bytes == 102_441_032


def test_bytes_without_kernel_args_come_from_the_nccl_spans(traces):
    # sampled rank 0, step 551: the nccl:* spans' shapes, added up by hand
    all_reduce = 19_618_307 * 4 + 26_955_536 * 4  # float32
    all_to_all = 384 * 8 + 419_430_400 * 1  # int64, then uint8
    all_gather = 16_777_216 * 1  # int8
    by_hand = all_reduce + all_to_all + all_gather
    steps = {s.step: s for s in analyse_trace(traces[SAMPLED[0]])}
    assert steps[551].bytes == by_hand == 622_506_060


# ---------------------------------------------------------------------------------------
# 3. GPU work belongs to the step that launched it.


def kernel(name, start_ms, end_ms, correlation, stream=7):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": stream,
        "ts": start_ms * 1e3,
        "dur": (end_ms - start_ms) * 1e3,
        "args": {"device": 0, "stream": stream, "correlation": correlation},
    }


def cpu(name, start_ms, end_ms, cat="user_annotation", **args):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1,
        "tid": 1,
        "ts": start_ms * 1e3,
        "dur": (end_ms - start_ms) * 1e3,
        "args": args,
    }


def test_a_kernel_counts_in_the_step_that_launched_it_not_the_one_it_ran_in():
    trace = {
        "traceEvents": [
            cpu("ProfilerStep#1", 0, 100),
            cpu("ProfilerStep#2", 100, 200),
            cpu("cudaLaunchKernel", 10, 11, cat="cuda_runtime", correlation=1),
            cpu("cudaLaunchKernel", 90, 91, cat="cuda_runtime", correlation=2),
            kernel("void gemm", 20, 150, 1),  # launched in step 1, runs on into step 2
            kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 160, 190, 2, stream=40),
            kernel("void elementwise", 0, 5, 99),  # launched before the trace began
        ]
    }
    one, two = analyse_trace(trace)
    assert (one.compute_ms, one.communication_ms, one.collectives) == (130, 30, 1)
    assert one.gpu_end_ms == 190  # 90 ms past its 100 ms step
    assert (two.compute_ms, two.communication_ms, two.collectives) == (0, 0, 0)


def test_gloo_on_cuda_tensors_is_communication_on_cpu_threads():
    # Gloo copies CUDA tensors to the host and reduces them on its own CPU threads
    gloo = cpu("gloo:all_reduce", 40, 80, **{"Input Dims": [[256]], "Input type": ["float"]})
    trace = {
        "traceEvents": [
            cpu("ProfilerStep#3", 0, 100),
            cpu("cudaLaunchKernel", 1, 2, cat="cuda_runtime", correlation=1),
            kernel("void gemm", 10, 60, 1),
            {**gloo, "tid": 9},
        ]
    }
    (step,) = analyse_trace(trace)
    assert (step.compute_ms, step.communication_ms, step.hidden_ms) == (50, 40, 20)
    assert (step.collectives, step.bytes, step.gpu_end_ms) == (1, 1024, 60)
    lanes = charts.timeline_lanes({"gloo": {0: trace}}, analyse_runs({"gloo": {0: trace}}), None)
    assert [lane.label for lane in lanes] == [
        "gloo, rank 0, step 3: stream 7 (compute)",
        "gloo, rank 0, step 3: Gloo threads (CPU)",
    ]


def test_the_lagging_gpu_trace_runs_each_steps_kernels_after_it(traces):
    # 16 ranks, A100: the GPU finishes each step's work ~160 ms after the CPU's 216 ms step
    steps = analyse_trace(traces[LAG])
    expected = reference(traces[LAG])
    assert [s.collectives for s in steps] == [15] * 5
    for s in steps:
        lag = s.gpu_end_ms - s.step_ms
        assert lag == pytest.approx(expected[s.step]["gpu_end_ms"] - s.step_ms)
        assert 155 < lag < 165, s.step
    # Cut at the CPU's step boundaries instead, the last step would lose the kernels that
    # run after it (and the first would gain 5 NCCL kernels launched before tracing began)
    assert steps[-1].communication_ms == pytest.approx(26.648, abs=5e-4)


# ---------------------------------------------------------------------------------------
# 4. Kineto's older format is read; what is not understood is refused, saying what it is.


def in_2021_format(trace: dict) -> dict:
    """The trace as kineto wrote it in 2021 (torch 1.8-1.9, as in torch-tb-profiler's test
    data): capitalised categories, string thread ids, GPU lanes named "stream N"."""
    names = {
        "cpu_op": "Operator",
        "user_annotation": "Operator",
        "cuda_runtime": "Runtime",
        "kernel": "Kernel",
        "gpu_memcpy": "Memcpy",
        "gpu_memset": "Memset",
    }
    old = copy.deepcopy(trace)
    for e in old["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") not in names:
            continue
        gpu = e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")
        e["cat"] = names[e["cat"]]
        e["tid"] = f"stream {e['tid']}" if gpu else str(e["tid"])
        if "External id" in e["args"]:
            e["args"]["external id"] = e["args"].pop("External id")
    return old


def test_kinetos_older_category_names_give_the_same_figures(traces):
    old = in_2021_format(traces[DDP])
    assert {e.get("cat") for e in old["traceEvents"]} >= {"Kernel", "Memcpy", "Runtime"}
    assert analyse_trace(old) == analyse_trace(traces[DDP])


def refused(trace: dict) -> str:
    with pytest.raises(TraceFormatError) as caught:
        analyse_trace(trace)
    return str(caught.value)


def test_traces_in_a_format_not_read_here_are_refused_saying_what_was_found():
    step = cpu("ProfilerStep#1", 0, 100)
    launch = cpu("cudaLaunchKernel", 10, 11, cat="cuda_runtime", correlation=1)
    unknown = {**kernel("ncclKernel_AllReduce", 20, 30, 1), "cat": "cuda_kernel"}
    message = refused({"traceEvents": [step, launch, unknown]})
    assert "cuda_kernel" in message and "Kernel" in message
    message = refused({"traceEvents": [step, kernel("void gemm", 20, 30, 1)]})
    assert "no CPU-side launch" in message and "'kernel': 1" in message
    message = refused({"traceEvents": [step, cpu("nccl:all_reduce", 10, 11)]})
    assert "without CUDA activity" in message
    message = refused({"events": []})
    assert "no traceEvents" in message and "events" in message
    message = refused({"traceEvents": [launch, kernel("void gemm", 20, 30, 1)]})
    assert "ProfilerStep" in message and "'cuda_runtime': 1" in message


# ---------------------------------------------------------------------------------------
# 5. Charts name what they show: CUDA streams, compute and NCCL, and where traces came from.


def test_the_timeline_shows_each_ranks_compute_and_nccl_streams(traces):
    found = {"ddp": {0: traces[DDP]}, "lag": {0: traces[LAG]}}
    results = analyse_runs(found)
    lanes = charts.timeline_lanes(found, results, ranks=None)
    labels = [lane.label for lane in lanes]
    assert labels == [
        "ddp, rank 0, step 4: stream 7 (compute)",
        "ddp, rank 0, step 4: stream 40 (NCCL)",
        *(f"lag, rank 0, step 552: stream {s} (compute)" for s in (7, 25, 27)),
        *(f"lag, rank 0, step 552: stream {s} (NCCL)" for s in (84, 285, 363)),
    ]
    for r in results:  # the NCCL lanes hold the step's communication, past the CPU's step
        nccl = [
            iv
            for lane in lanes
            if lane.label.startswith(r.run)
            for kind, ivs in lane.bars
            if kind == "nccl"
            for iv in ivs
        ]
        expected = reference(found[r.run][0])[r.median.step]
        assert sweep(nccl, [])[0] == pytest.approx(expected["communication_ms"])
    legend = charts.timeline_legend(lanes)
    assert legend == [
        "compute kernels, copies, memsets (GPU)",
        "NCCL kernels (GPU)",
        "the step on the CPU",
    ]


def test_the_breakdown_title_says_where_the_traces_came_from(traces, tmp_path):
    results = analyse_runs({"ddp": {0: traces[DDP]}})
    heading = compare.describe(tmp_path, results, command=None)
    assert charts.breakdown_title(heading) == f"traces in {tmp_path}, command unknown"
    assert "GPU runs (ddp)" in heading


# ---------------------------------------------------------------------------------------
# 6. All-to-all and send/recv kernels are communication.


def test_send_recv_kernels_are_communication(traces):
    for path in SAMPLED:
        kernels = {
            e["name"].split("(")[0]
            for e in traces[path]["traceEvents"]
            if e.get("cat") == "kernel" and "nccl" in e["name"].lower()
        }
        assert kernels == {"ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t"}
        expected = reference(traces[path])
        for s in analyse_trace(traces[path]):
            assert s.collectives_by_name == {
                "nccl:all_to_all": 2,
                "nccl:all_reduce": 2,
                "nccl:_all_gather_base": 1,
            }
            assert s.communication_ms == pytest.approx(expected[s.step]["communication_ms"])
            assert s.communication_ms > 150


# ---------------------------------------------------------------------------------------
# TensorBoard's profiler plugin on the same trace: it counts NCCL kernels as compute.


def plugin_costs(trace: dict) -> dict:
    """torch-tb-profiler's Distributed view per profiled step, as its server computes it."""
    from torch_tb_profiler.profiler.data import RunProfileData

    plugin = RunProfileData.from_json("rank0", "1", copy.deepcopy(trace))
    return dict(zip(map(int, plugin.steps_names), plugin.comm_overlap_costs, strict=True))


def in_step(events, lo: float, hi: float) -> list[tuple[float, float]]:
    return [
        (max(e["ts"], lo), min(e["ts"] + e["dur"], hi))
        for e in events
        if min(e["ts"] + e["dur"], hi) > max(e["ts"], lo)
    ]


def test_tensorboard_plugin_overlap_against_ours_on_the_ddp_trace(traces):
    """The figures docs/tensorboard.md shows side by side. If this fails after a plugin
    upgrade, update that page."""
    costs = plugin_costs(traces[DDP])[4]
    # The plugin's Distributed view, step 4: "Overlapping" and "Communication" (only), µs
    assert costs.overlap == pytest.approx(12_084.9, abs=0.05)
    assert costs.communication - costs.overlap == pytest.approx(356.0, abs=0.05)
    # Ours, the median step (4), checked against the reference above
    ours = {s.step: s for s in analyse_trace(traces[DDP])}[4]
    assert (ours.hidden_ms, ours.communication_ms) == pytest.approx((1.942, 11.989), abs=5e-4)
    assert 100 * ours.overlap == pytest.approx(16.2, abs=0.05)
    assert ours.hidden_ms == pytest.approx(reference(traces[DDP])[4]["hidden_ms"])

    # Why. The plugin ties a kernel to a collective by its External id, which points at
    # record_param_comms, not at the nccl:* op, so it files NCCL kernels under computation
    events = [e for e in traces[DDP]["traceEvents"] if e.get("ph") == "X"]
    ops = {e["args"].get("External id"): e["name"] for e in events if e["cat"] == "cpu_op"}
    nccl = [e for e in events if e["cat"] == "kernel" and e["name"].startswith("ncclKernel_")]
    assert {ops[e["args"]["External id"]] for e in nccl} == {"record_param_comms"}
    # and times communication by the nccl:* spans (the CPU's, and their GPU-side copies),
    # within which those same kernels run: its "overlap" is largely NCCL with itself
    (step,) = [e for e in events if e["name"] == "ProfilerStep#4"]
    lo, hi = step["ts"], step["ts"] + step["dur"]
    kernels = in_step((e for e in events if e["cat"] == "kernel"), lo, hi)
    spans = in_step((e for e in events if e["name"].startswith("nccl:")), lo, hi)
    computation, communication, overlap = sweep(kernels, spans)
    assert (costs.computation, costs.communication, costs.overlap) == pytest.approx(
        (computation, communication, overlap)
    )
    assert sweep(in_step(nccl, lo, hi), spans)[2] == pytest.approx(ours.communication_ms * 1e3)


def test_tensorboard_plugin_misses_send_recv_traffic(traces):
    # sampled-128w rank 0, step 551: the plugin knows no nccl:all_to_all or
    # nccl:_all_gather_base, and counts their SendRecv kernels as computation
    costs = plugin_costs(traces[SAMPLED[0]])[551]
    assert costs.communication == pytest.approx(218.0)  # µs
    ours = {s.step: s for s in analyse_trace(traces[SAMPLED[0]])}[551]
    assert ours.communication_ms == pytest.approx(195.327, abs=5e-4)


def test_the_step_timeline_of_a_gpu_trace_is_its_launched_work(traces):
    t = step_timeline(traces[LAG], 552)
    expected = reference(traces[LAG])[552]
    end = max(iv[1] for compute, nccl in t["streams"].values() for iv in compute + nccl)
    assert end == pytest.approx(expected["gpu_end_ms"])
    assert t["gpu"] and end > t["step_ms"] + 150
