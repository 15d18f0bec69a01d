"""profiling.simulate_published: the published measurements as their sources give them,
and the command that sets the model's predictions beside them."""

from __future__ import annotations

import pytest

from profiling.simulate_published import compare as published


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
    assert all(r.with_copies is None and r.with_terms is None for r in rows)
    for r in rows:
        assert r.source and r.unit in ("E", "%")
        if r.unit == "E":
            assert 0 < r.published <= 1 and 0 < r.predicted <= 1 + 1e-9, r
    one_gpu = next(r for r in rows if r.what.startswith("resnet50, 1 GPU:"))
    # One GPU under DDP communicates nothing in the model: it predicts no loss at all.
    assert one_gpu.predicted == pytest.approx(1.0)
    assert one_gpu.error == pytest.approx(1.0 - 0.097 / 0.100)


def test_published_writes_its_table_under_out(tmp_path):
    from profiling.simulate.cli import main

    main(["published", "--out", str(tmp_path)])
    text = (tmp_path / "published.md").read_text()
    assert "| measurement | published | model | + DDP's copies | + beside NCCL | error |" in text
    assert "resnext101_32x8d, 16 GPUs" in text and "Goyal et al." in text


def kernel(name: str, ts: float, dur: float, grid=(1, 1, 1)) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"grid": list(grid), "block": [256, 1, 1]}}  # fmt: skip


def test_compute_beside_nccl_by_hand():
    from profiling.simulate_published import terms

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


def test_copies_fit_a_fixed_time_and_a_bandwidth_by_hand():
    from profiling.simulate_published import terms

    def copy(ts: float, nbytes: int) -> dict:  # 2 us + 1 us per 1000 bytes
        return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)",
                "ts": ts, "dur": 2 + nbytes / 1000, "args": {"bytes": nbytes}}  # fmt: skip

    steps = [{"ph": "X", "name": f"ProfilerStep#{i}", "ts": i * 1e4, "dur": 1e4} for i in (1, 2)]
    events = steps + [copy(1e4 + i, n) for i, n in enumerate((1000, 3000, 5000, 7000))]
    measured = terms.copies(events, memory_bytes_per_s=1e9)
    assert measured.per_step == 2 and measured.bytes_per_step == 8000
    assert measured.fixed_s == pytest.approx(2e-6)
    assert measured.share_of_memory_bandwidth == pytest.approx(1.0)  # 1e9 bytes/s: all of it


def test_gpu_sharing_copies_each_gradient_on_the_compute_lane_by_hand():
    from profiling.simulate.schedule import Grad
    from profiling.simulate_published import terms

    copied = terms.Copies(per_step=4, bytes_per_step=0, fixed_s=1e-6,
                          share_of_memory_bandwidth=0.5)  # fmt: skip
    beside = terms.BesideNccl(ratio=1.25, kernel_s=1e-3, shapes=3)
    sharing = terms.sharing(copied, beside, grads_in_trace=2, memory_bytes_per_s=2e9)
    assert sharing.slowdown == pytest.approx(0.25)
    # 2 copies per gradient of 1 us, and 1e6 bytes at half of 2e9 bytes/s: 1 ms.
    assert sharing.hook_s(Grad("w", 10**6, 0.0)) == pytest.approx(2e-6 + 1e-3)
    off = terms.sharing(None, None, grads_in_trace=2, memory_bytes_per_s=2e9)
    assert off.slowdown == 0 and off.hook_s(Grad("w", 10**6, 0.0)) == 0


def test_the_terms_measured_on_the_docs_trace():
    # A real trace recorded by others: torch's DDP, ResNet-50, 2 A100s, NCCL 2.17.1.
    from profiling.simulate_published import terms

    events = terms.load(terms.DOCS_TRACE)
    copied = terms.copies(events, terms.A100_MEMORY_BYTES_PER_S)
    assert copied.per_step == 320  # about 2 per gradient: ResNet-50 has 161
    assert copied.bytes_per_step == pytest.approx(102.4e6, rel=0.01)  # its 102.2 MB, once
    assert 1.05 < terms.beside_nccl(events).ratio < 1.15


def test_each_term_lowers_the_benchmarks_efficiencies():
    from profiling.simulate_published import terms

    rows = [r for r in published.rows(terms.DOCS_TRACE) if r.what.endswith("without DDP")]
    for r in rows:
        assert r.with_terms <= r.with_copies + 1e-9 and r.with_copies < r.predicted, r
    one_gpu = [r for r in rows if ", 1 GPU:" in r.what]
    # On one GPU nothing is sent: only the copies cost anything, and both columns agree.
    assert all(r.with_terms == pytest.approx(r.with_copies) for r in one_gpu)
