"""The scaling sweep's sanity: efficiency 1 at the reference and never rising with more
GPUs; a bucket-size curve with its minimum strictly inside where it must have one;
the commands' outputs."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from profiling.simulate import clusters, presets, scale
from profiling.simulate.published import paper
from profiling.simulate.schedule import Grad, Workload
from profiling.simulate.topology import Topology, halving_doubling, ring

MiB = 2**20


@pytest.mark.parametrize(
    "algorithm", ["ring", "halving_doubling", "hierarchical_ring", "hierarchical_halving_doubling"]
)
@pytest.mark.parametrize(
    "model,network", [("resnet50", "li2020"), ("bert_large", "li2020"), ("resnet50", "goyal2017")]
)
def test_efficiency_is_one_at_the_reference_and_never_rises(model, network, algorithm):
    net = clusters.cluster(network)
    w = presets.workload(model, net.gpu)
    result = scale.sweep(w, net.topology, algorithm, scale.DEFAULT_GPUS, 25, [])
    e = [r["efficiency"] for r in result["scaling"]]
    assert e[0] == 1.0
    assert all(later <= earlier + 1e-12 for earlier, later in zip(e, e[1:], strict=False))
    assert [r["nodes"] for r in result["scaling"]] == [1, 2, 4, 8, 16, 32]


# 100 gradients of 1 MiB, the last parameter's ready 10 ms into a 1 s backward, the
# first's at 1 s. Two GPUs on one link: a ring of 2 is 2 steps of 10 ms and 1 MiB sent
# per MiB reduced, at 200 MiB/s: an all-reduce of k MiB takes 20 + 5k ms.
HUNDRED = Workload(tuple(Grad(f"w{i}", MiB, (100 - i) / 100) for i in range(100)), 0, 1.0, 0)
LINK = Topology(
    nodes=1,
    gpus_per_node=2,
    intra_bytes_per_s=200 * MiB,
    inter_bytes_per_s=200 * MiB,
    intra_latency_s=0.01,
    inter_latency_s=0.01,
)


def test_bucket_curve_has_its_minimum_inside():
    result = scale.sweep(HUNDRED, LINK, "ring", [2], 10, [10])
    step = {r["layout"]: r["step_s"] for r in result["bucket_curve"]}
    # One per parameter: 25 ms each, one every 10 ms: the queue grows, 100 x 25 ms from
    # 10 ms: 2.51 s. 10 MiB buckets: one full every 100 ms, 70 ms each: the last goes
    # at 1 s, ends 1.07 s. One bucket: at 1 s, 20 + 500 ms: 1.52 s.
    assert step == pytest.approx({"per parameter": 2.51, "10": 1.07, "one bucket": 1.52})
    assert scale.bucket_curve_is_u(result, 2)
    assert scale.best_caps(result) == [(2, "10 MiB", pytest.approx(1.07))]


def test_bucket_curve_without_latency_has_no_u():
    # No latency: an all-reduce of k MiB takes 5k ms. One per parameter keeps up (5 ms
    # every 10 ms): the last ends at 1.005 s; 10 MiB buckets: 1.05 s; one bucket: 1.5 s.
    result = scale.sweep(HUNDRED, replace(LINK, intra_latency_s=0.0), "ring", [2], 10, [10])
    step = {r["layout"]: r["step_s"] for r in result["bucket_curve"]}
    assert step == pytest.approx({"per parameter": 1.005, "10": 1.05, "one bucket": 1.5})
    assert not scale.bucket_curve_is_u(result, 2)
    assert scale.best_caps(result)[0][1] == "per parameter"


def test_goyal_latency_for_3x_gives_3x():
    # The latency paper mode solves for, put back into the ring and halving-doubling
    # between 32 servers, gives the ratio it was solved for.
    net = clusters.cluster("goyal2017")
    w = presets.workload("resnet50", net.gpu)
    found = paper.goyal_halving_doubling(w, net.topology)["alpha_for_3x_at_4mib_s"]
    servers = Topology(
        nodes=32,
        gpus_per_node=1,
        intra_bytes_per_s=1e12,
        inter_bytes_per_s=50e9 / 8,
        intra_latency_s=0,
        inter_latency_s=found,
    )
    n = 4 * MiB
    assert ring(servers, n).seconds / halving_doubling(servers, n).seconds == pytest.approx(3.0)


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_scale_command_writes_its_results(tmp_path, capsys, monkeypatch):
    from tests.figures import assert_legible, record_font_sizes

    sizes = record_font_sizes(monkeypatch)
    out = tmp_path / "s.json"
    scale.run(
        _args(
            scale,
            [
                "--model",
                "resnet50",
                "--gpus",
                "8,16,32",
                "--bucket-caps",
                "5,25",
                "--inter-gbps",
                "25",
                "--json",
                str(out),
                "--out",
                str(tmp_path),
                "--plot",
                str(tmp_path / "s.png"),
            ],
        )
    )
    printed = capsys.readouterr().out
    assert "E(p)" in printed and "fastest layout" in printed
    data = json.loads(out.read_text())
    assert [r["gpus"] for r in data["scaling"]] == [8, 16, 32]
    assert data["settings"]["topology"]["inter_bytes_per_s"] == pytest.approx(25e9 / 8)
    assert data["settings"]["network"] == "li2020 (modified)"
    # Under --out, named by the model and the cluster, which the flags changed.
    assert "| 32 | 4 |" in (tmp_path / "scale-resnet50-li2020-custom.md").read_text()
    assert json.loads((tmp_path / "scale-resnet50-li2020-custom.json").read_text()) == data
    assert_legible(tmp_path / "s.png", sizes)


def test_paper_command_writes_every_fragment(tmp_path, monkeypatch):
    from tests.figures import assert_legible, record_font_sizes

    sizes = record_font_sizes(monkeypatch)
    paper.run(_args(paper, ["--out", str(tmp_path)]))
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {
        "paper.png",
        "paper.json",
        "paper-summary.md",
        "paper-li-scaling.md",
        "paper-li-overlap.md",
        "paper-li-buckets.md",
        "paper-goyal-efficiency.md",
        "paper-goyal-halving-doubling.md",
    }
    summary = (tmp_path / "paper-summary.md").read_text()
    assert summary.count("\n| ") == 9  # header and the eight figures
    assert_legible(tmp_path / "paper.png", sizes)
