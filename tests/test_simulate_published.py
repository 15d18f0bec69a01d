"""profiling.simulate.published: the published measurements as their sources give them,
and the command that sets the model's predictions beside them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from profiling.simulate.published import measurements as published
from profiling.simulate.published import torch_bench


def test_torchs_benchmark_efficiencies_are_its_readme_figures():
    # E(p) = t(no DDP) / t(p), from the README's p50 seconds per iteration.
    p50 = published.TORCH_BENCH_P50_S
    assert p50["resnet50"][0] / p50["resnet50"][8] == pytest.approx(0.933, abs=5e-4)
    assert p50["resnet101"][0] / p50["resnet101"][16] == pytest.approx(0.905, abs=5e-4)
    assert p50["resnext101_32x8d"][0] / p50["resnext101_32x8d"][16] == pytest.approx(
        0.922, abs=5e-4
    )


def test_every_row_is_published_predicted_and_sourced():
    rows = published.rows()  # the bare model
    assert len(rows) == 4 * 5 + 2 + 1 + 2  # the benchmark, its caps, Goyal, Li
    assert all(r.with_passes is None and r.with_terms is None for r in rows)
    for r in rows:
        assert r.source and r.unit in ("E", "%")
        if r.unit == "E":
            assert 0 < r.published <= 1 and 0 < r.predicted <= 1 + 1e-9, r
    one_gpu = next(r for r in rows if r.what.startswith("resnet50, 1 GPU:"))
    # One GPU under DDP communicates nothing in the model: it predicts no loss at all.
    assert one_gpu.predicted == pytest.approx(1.0)
    assert one_gpu.error == pytest.approx(1.0 - 0.097 / 0.100)


def test_published_writes_its_table_and_figure_under_out(tmp_path, monkeypatch):
    from profiling.simulate.cli import main
    from tests.figures import assert_legible, record_font_sizes

    sizes = record_font_sizes(monkeypatch)
    main(["published", "--out", str(tmp_path)])
    assert_legible(tmp_path / "published.png", sizes)
    text = (tmp_path / "published.md").read_text()
    assert "| measurement | published | model | + DDP's passes | + beside NCCL | error |" in text
    assert "resnext101_32x8d, 16 GPUs" in text and "Goyal et al." in text


def kernel(name: str, ts: float, dur: float, grid=(1, 1, 1)) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"grid": list(grid), "block": [256, 1, 1]}}  # fmt: skip


def test_compute_beside_nccl_by_hand():
    from profiling.simulate.published import terms

    events = [
        kernel("ncclKernel_AllReduce_RING_LL_Sum_float", 100, 100),  # NCCL from 100 to 200
        kernel("gemm", 0, 10),
        kernel("gemm", 20, 12),  # alone: median 11
        kernel("gemm", 120, 15),
        kernel("gemm", 150, 18),  # beside NCCL: 33 for 2 x 11
        kernel("gemm", 195, 10),  # half beside: neither
        kernel("gemm", 300, 10, grid=(2, 1, 1)),  # another shape, alone only: not weighed
        kernel("relu", 130, 5),  # beside only: not weighed
    ]
    measured = terms.beside_nccl(events)
    assert measured.ratio == pytest.approx(33 / 22)
    assert measured.shapes == 1 and measured.kernel_s == pytest.approx(33e-6)


def traced_passes() -> list[dict]:
    """One profiler step of two gradients, each scaled into its bucket by an elementwise
    kernel (2 us + 1 us per 1000 bytes) and copied back (1 us + 1 us per 2000 bytes);
    and a copy that no reducer op launched (a buffer's), which must not count."""
    from profiling.simulate.published import terms

    events = [{"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 1e4}]

    def launched(op: str, ts: float, gpu: dict, correlation: int) -> None:
        events.append({"ph": "X", "cat": "cpu_op", "name": op, "ts": ts, "dur": 10, "tid": 1})
        runtime = {"correlation": correlation}
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                       "ts": ts + 2, "dur": 3, "tid": 1, "args": runtime})  # fmt: skip
        gpu["args"]["correlation"] = correlation
        events.append(gpu)

    for i, blocks in enumerate((2, 6)):  # 2 x 128 x 4 float32: 4096 and 12288 bytes
        nbytes = blocks * 128 * 4 * 4
        launched(terms.SCALE_OP, 100 * i, {
            "ph": "X", "cat": "kernel", "name": "elementwise", "ts": 1000 + 100 * i,
            "dur": 2 + nbytes / 1000, "args": {"grid": [blocks, 1, 1], "block": [128, 1, 1]}},
            correlation=10 + i)  # fmt: skip
        launched(terms.COPY_OP, 5000 + 100 * i, {
            "ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)",
            "ts": 6000 + 100 * i, "dur": 1 + nbytes / 2000, "args": {"bytes": nbytes}},
            correlation=20 + i)  # fmt: skip
    # Copies the reducer's ops did not launch, each 500 us for 10 bytes: one with no
    # runtime call, one launched on the op's thread after the op, one launched during
    # the op on another thread.
    for correlation, ts, tid in ((97, 5000 + 50, 1), (98, 5000 + 3, 2), (99, None, None)):
        args = {"correlation": correlation}
        if ts is not None:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync",
                           "ts": ts, "dur": 1, "tid": tid, "args": args})  # fmt: skip
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)",
                       "ts": 8000, "dur": 500, "args": {"bytes": 10, **args}})  # fmt: skip
    return events


def test_reducer_passes_fit_a_fixed_time_and_a_bandwidth_by_hand():
    from profiling.simulate.published import terms

    work = terms.reducer_work(traced_passes(), memory_bytes_per_s=1e9)
    assert work.scale.launches_per_step == 2 and work.scale.bytes_per_step == 4096 + 12288
    assert work.scale.fixed_s == pytest.approx(2e-6)
    assert work.scale.share_of_memory_bandwidth == pytest.approx(1.0)  # 1000 bytes per us
    assert work.copy.launches_per_step == 2  # the stray copies are not the reducer's
    assert work.copy.fixed_s == pytest.approx(1e-6)
    assert work.copy.share_of_memory_bandwidth == pytest.approx(2.0)


def hand_sharing():
    """Passes of 1 us + 1 us per 1000 bytes (a copy) and 2 us + 1 us per 2000 bytes (a
    scale), on a GPU of 2e9 bytes/s; backward 1.25x as long beside NCCL."""
    from profiling.simulate.published import terms
    from profiling.simulate.schedule import Grad, Workload

    copy = terms.Pass(2, 0, fixed_s=1e-6, share_of_memory_bandwidth=0.5)
    scale = terms.Pass(2, 0, fixed_s=2e-6, share_of_memory_bandwidth=1.0)
    beside = terms.BesideNccl(ratio=1.25, kernel_s=1e-3, shapes=3)
    a, b = Grad("a", 10**6, 1e-3), Grad("b", 2 * 10**6, 2e-3)
    w = Workload((a, b), forward_s=1e-3, backward_s=2e-3, optimizer_s=1e-3)
    return terms.sharing(terms.ReducerWork(scale, copy), beside, 2e9), w


def test_gpu_sharing_puts_torch_1_4s_passes_where_its_reducer_does():
    sharing, w = hand_sharing()
    a, b = w.grads
    assert sharing.slowdown == pytest.approx(0.25)
    one_bucket = sharing.for_buckets(w, [[0, 1]])
    # At a's hook: copy_ (1 us + 1 ms for 1e6 bytes) and div_'s pass over its bytes at
    # the copy's bandwidth (1 ms); at b's, which fills the bucket, div_'s launch (2 us).
    assert one_bucket.hook_s(a) == pytest.approx(1e-6 + 1e-3 + 1e-3)
    assert one_bucket.hook_s(b) == pytest.approx(1e-6 + 2e-3 + 2e-3 + 2e-6)
    assert sharing.for_buckets(w, [[0], [1]]).hook_s(a) == pytest.approx(1e-6 + 2e-3 + 2e-6)
    # Not overlapped: all of them after backward.
    assert one_bucket.after_backward_s(w) == pytest.approx(2e-6 + 6e-3 + 2e-6)
    # The copy back, a bucket at a time: one copy a gradient.
    assert one_bucket.copy_out_s(3 * 10**6) == pytest.approx(2e-6 + 3e-3)
    with pytest.raises(ValueError, match="no bucket of 5 bytes"):
        one_bucket.copy_out_s(5)
    with pytest.raises(ValueError, match="for_buckets first"):
        sharing.hook_s(a)
    # torch 2.x: one mul_out a gradient, launched each time, at the scale's bandwidth.
    modern = replace(sharing, copy_then_divide=False)
    assert modern.hook_s(a) == pytest.approx(2e-6 + 0.5e-3)
    off = replace(sharing, work=None)
    assert off.hook_s(a) == 0 and off.copy_out_s(5) == 0


def test_gpu_sharing_in_the_whole_schedule_by_hand():
    from profiling.simulate.published.torch_bench import step_s
    from profiling.simulate.schedule import Cost

    sharing, w = hand_sharing()
    sharing = replace(sharing, slowdown=0.0)

    def cost(nbytes: int) -> Cost:  # 1 ms per 1e6 bytes, no latency
        return Cost(0.0, nbytes / 1e9)

    # One bucket, overlapped: forward 1 ms; backward 2 ms plus the hooks' 6.004 ms of
    # passes; the all-reduce 3 ms; the copy back 3.002 ms; the optimizer 1 ms.
    overlapped = 1e-3 + (2e-3 + 6.004e-3) + 3e-3 + 3.002e-3 + 1e-3
    assert step_s(w, [[0, 1]], cost, sharing) == pytest.approx(overlapped)
    # Not overlapped: the same work, the passes all after backward.
    assert step_s(w, [[0, 1]], cost, sharing, overlap=False) == pytest.approx(overlapped)
    # Two buckets, overlapped: b's (ready first) all-reduces while a's hook runs.
    assert step_s(w, [[1], [0]], cost, sharing) < overlapped


def test_the_terms_measured_on_the_docs_trace():
    # A real trace recorded by others: torch's DDP, ResNet-50, 2 A100s, NCCL 2.17.1.
    from profiling.simulate.published import terms

    events = terms.load(terms.DOCS_TRACE)
    work = terms.reducer_work(events, terms.A100_MEMORY_BYTES_PER_S)
    # One pass of each kind per gradient (ResNet-50 has 161), over its 102.2 MB.
    assert work.scale.launches_per_step == work.copy.launches_per_step == 161
    assert work.copy.bytes_per_step == pytest.approx(102.2e6, rel=0.001)
    assert work.scale.bytes_per_step == pytest.approx(102.2e6, rel=0.002)  # from the grids
    assert 1.5e-6 < work.copy.fixed_s < 2.5e-6 and 0.3 < work.copy.share_of_memory_bandwidth < 0.45
    # The scale kernels ran at the A100's whole memory bandwidth in gradient bytes: the
    # gradients backward had just written were still in its 40 MB L2.
    assert 0.95 < work.scale.share_of_memory_bandwidth < 1.15
    assert 1.05 < terms.beside_nccl(events).ratio < 1.15


def test_nvlink_rings_by_hand_and_on_the_benchmarks_dgx1():
    # Three GPUs in a triangle of single links: one ring each way round.
    triangle = [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    assert torch_bench.nvlink_rings(triangle, 3) == 2
    # A path 0-1-2 with no link 2-0 closes no ring; two GPUs make one ring per link.
    assert torch_bench.nvlink_rings([[0, 1, 0], [1, 0, 1], [0, 1, 0]], 3) == 0
    assert torch_bench.nvlink_rings([[0, 2], [2, 0]], 2) == 2
    # Four GPUs whose links allow 3 rings by every GPU's count, but whose only two
    # Hamiltonian cycles (0-1-2-3 and its reverse) each use 0-3's single link one way.
    square = [[0, 2, 0, 1], [2, 0, 1, 0], [0, 1, 0, 2], [1, 0, 2, 0]]
    assert torch_bench.nvlink_rings(square, 4) == 2
    rings = {g: torch_bench.nvlink_rings(torch_bench.DGX1_NVLINKS, g) for g in (2, 4, 8)}
    assert rings == {2: 1, 4: 4, 8: 6}  # GPU 0's links among the first g: 1, 4 and 6
    assert torch_bench.torch_bench_topology(2).intra_bytes_per_s == 25e9
    assert torch_bench.torch_bench_topology(16).intra_bytes_per_s == 150e9
    with pytest.raises(ValueError, match="GPUs 0 to 4 of a DGX-1 close no NVLink ring"):
        torch_bench.torch_bench_topology(5)


def test_torch_1_4s_layout_launches_the_first_defined_parameters_last():
    from profiling.simulate.schedule import Grad, Workload

    mib = 2**20  # five gradients defined in this order, of 0.5, 0.75, 2, 3 and 1 MiB
    sizes = (mib // 2, 3 * mib // 4, 2 * mib, 3 * mib, mib)
    w = Workload(tuple(Grad(f"g{i}", n, 0.0) for i, n in enumerate(sizes)), 0, 0, 0)
    # In definition order: [g0, g1] passes 1 MiB and closes; then at a 4 MiB cap
    # [g2, g3] passes 4 MiB; [g4] is left. Reversed, the first-defined go last.
    assert torch_bench.torch14_buckets(w, 4.0) == [[4], [2, 3], [0, 1]]


def test_li_overlap_speedup_moves_with_its_unknown_settings():
    # Less bandwidth hides more (ResNet-50 at batch 32 stays below the peak, where
    # communication is as long as backward); a longer iteration has less to hide.
    slow = published.li_speedup("resnet50", 32, 6e9)
    fast = published.li_speedup("resnet50", 32, 12.5e9)
    assert slow > fast > published.li_speedup("resnet50", 112, 12.5e9) > 0
    with pytest.raises(ValueError, match="no published V100 time for resnet50 at batch 64"):
        published.li_speedup("resnet50", 64)
    table = published.li_sensitivity()
    assert len(table) == 4 and all(len(row) == 5 for row in table)


def test_each_term_lowers_the_benchmarks_efficiencies():
    from profiling.simulate.published import terms

    rows = [r for r in published.rows(terms.DOCS_TRACE) if r.what.endswith("without DDP")]
    for r in rows:
        assert r.with_terms <= r.with_passes + 1e-9 and r.with_passes < r.predicted, r
    one_gpu = [r for r in rows if ", 1 GPU:" in r.what]
    # On one GPU nothing is sent: only the passes cost anything, and both columns agree.
    assert all(r.with_terms == pytest.approx(r.with_passes) for r in one_gpu)


def test_stragglers_by_hand():
    import math

    from profiling.simulate.published import terms

    # The largest of 2 and of 3 standard normal draws: 1/sqrt(pi) and 3/(2 sqrt(pi)).
    assert terms.expected_max_normal(1) == pytest.approx(0.0, abs=1e-9)
    assert terms.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert terms.expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    # A spread of 10%: 8 GPUs wait 1 + 0.1 m(8) on average, 256 wait 1 + 0.1 m(256).
    m8, m256 = terms.expected_max_normal(8), terms.expected_max_normal(256)
    assert 1.42 < m8 < 1.43 and 2.82 < m256 < 2.83  # the tabled 1.4236 and 2.8269
    expected = (1 + 0.1 * m8) / (1 + 0.1 * m256)
    assert terms.straggler_efficiency(0.1, 256, 8) == pytest.approx(expected)
    sigma = terms.straggler_sigma_for(0.9, 256, 8)
    assert sigma == pytest.approx(0.1 / (0.9 * 2.8268633 - 1.4236003), rel=1e-6)
    assert terms.straggler_efficiency(sigma, 256, 8) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="stays above 0.504"):  # m(8) / m(256)
        terms.straggler_sigma_for(0.5, 256, 8)
    with pytest.raises(ValueError, match="p = 0"):
        terms.expected_max_normal(0)


def test_cost_per_bucket_and_the_straggler_bound_from_the_readme():
    per_bucket = {b["gpus"]: b for b in torch_bench.cost_per_bucket()}
    # ResNet-50 in torch's layout: 35 buckets at 1 MiB, 5 at 25 MiB after the first 1 MiB.
    assert per_bucket[8]["extra_buckets"] == 30
    assert per_bucket[8]["per_bucket_s"] == pytest.approx(92.7e-6, abs=0.05e-6)
    # NCCL's latency at 8 GPUs of one server: 8.4 us a call and 14 ring steps of 3.4 us.
    assert per_bucket[8]["nccl_latency_s"] == pytest.approx(8.4e-6 + 14 * 3.4e-6)
    bound = torch_bench.straggler_bound()
    assert bound["sigma"] == pytest.approx(0.006267, abs=1e-6)
    assert 0.98 < bound["e16"] < 1 and 0.99 < bound["e256"] < 1
