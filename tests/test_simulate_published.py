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
    rows = published.rows()
    assert len(rows) == 4 * 5 + 2 + 1 + 2  # the benchmark, its caps, Goyal, Li
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
    assert "| measurement | published | predicted | error |" in text
    assert "resnext101_32x8d, 16 GPUs" in text and "Goyal et al." in text
