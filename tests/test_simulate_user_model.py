"""The simulator on a user's model and cluster: gradient sizes equal the module's, ready
times in the order a real backward makes them, every cluster flag replaces its preset's
value and says so, and the stable command line works from another directory without
touching the checkout."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from profiling.simulate import clusters, model_args, scale, usermodel
from profiling.simulate.topology import GB, GBIT
from tests.fixtures import user_models

ROOT = Path(__file__).resolve().parents[1]
CNN = "tests.fixtures.user_models:small_cnn"
LM = "tests.fixtures.user_models:TinyLM"


def real_backward_order(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """The order a plain backward on the CPU accumulates each gradient: the reference."""
    order: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    out = model(x)
    sum(t.float().sum() for t in (out if isinstance(out, tuple) else (out,))).backward()
    return order


@pytest.mark.parametrize("spec,input_shape", [(CNN, (3, 32, 32)), (LM, (16,))])
@pytest.mark.parametrize("method", usermodel.READY_METHODS)
def test_gradients_are_the_modules_and_ready_in_backwards_order(spec, input_shape, method):
    factory = usermodel.load_factory(spec)
    model = factory()
    profile = usermodel.profile(spec, input_shape, method)
    trainable = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    assert list(zip(profile.names, profile.elements, strict=True)) == trainable  # tied: once
    w = usermodel.workload(profile, 0.1, 0.001, "bf16")
    assert [g.nbytes for g in w.grads] == [2 * n for _, n in trainable]
    assert sum(g.nbytes for g in usermodel.workload(profile, 0.1, 0.001).grads) == sum(
        p.numel() * p.element_size() for p in model.parameters()
    )
    torch.manual_seed(0)
    order = real_backward_order(model, usermodel.example_input(model, input_shape, 2, "cpu"))
    ready = [profile.ready_fraction[n] for n in order]
    assert ready == sorted(ready), f"{method}: {list(zip(order, ready, strict=True))}"
    assert all(0 <= f <= 1 for f in ready)


def test_workload_splits_the_iteration_by_hand():
    p = usermodel.Profile(("a", "b"), (10, 30), 0.25, {"a": 1.0, "b": 0.5}, "flops")
    w = usermodel.workload(p, iteration_s=0.5, optimizer_s=0.1, dtype="fp16")
    # 0.4 s left: a quarter forward, the rest backward; b ready half way through it.
    assert (w.forward_s, w.backward_s, w.optimizer_s) == pytest.approx((0.1, 0.3, 0.1))
    assert [(g.nbytes, g.ready_s) for g in w.grads] == [(20, pytest.approx(0.3)),
                                                       (60, pytest.approx(0.15))]  # fmt: skip
    with pytest.raises(ValueError, match="--iteration-ms 50 is not more than"):
        usermodel.workload(p, iteration_s=0.05, optimizer_s=0.1)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("resnet", "give a preset or MODULE:FACTORY"),
        ("no_such_module_here:build", "cannot import 'no_such_module_here'"),
        ("tests.fixtures.user_models:missing", "has no callable 'missing'"),
        ("tests.fixtures.user_models:not_a_module", "returned int, not an nn.Module"),
    ],
)
def test_a_bad_model_is_named(spec, match):
    with pytest.raises(ValueError, match=match):
        usermodel.profile(spec, (3, 32, 32))


def test_bad_input_shapes_are_named():
    with pytest.raises(ValueError, match="--input-shape '3,x'"):
        usermodel.parse_input_shape("3,x")
    with pytest.raises(ValueError, match="has no nn.Embedding"):
        usermodel.profile(CNN, (16,))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_each_cluster_flag_replaces_the_presets_value_and_is_its_source():
    args = parse("--cluster", "dgx_h100", "--gpus-per-node", "4", "--intra-gbps", "800",
                 "--inter-gbps", "400", "--intra-latency-us", "2", "--inter-latency-us", "20",
                 "--call-latency-us", "5", "--memory-gbytes-per-s", "1000")  # fmt: skip
    c, custom = clusters.from_args(args)
    t = c.topology
    assert custom and t.gpus_per_node == 4
    assert (t.intra_bytes_per_s, t.inter_bytes_per_s) == (800 * GBIT, 400 * GBIT)
    assert (t.intra_latency_s, t.inter_latency_s, t.call_latency_s) == pytest.approx(
        (2e-6, 20e-6, 5e-6)
    )
    assert c.memory_bytes_per_s == 1000 * GB
    text = "\n".join(clusters.describe(c, "dgx_h100 (modified)", "ring"))
    for flag in ("--gpus-per-node", "--intra-gbps", "--inter-gbps", "--call-latency-us",
                 "--memory-gbytes-per-s"):  # fmt: skip
        assert flag in text
    assert "100 GB/s (800 Gbit/s) inside a server" in text  # both units, the flag's in Gbit/s
    assert "NCCL 2.20.3" not in text  # every number replaced, none left from the preset
    # Not given, the cluster is the preset model's paper's, or a DGX A100 for yours.
    assert clusters.from_args(parse("--model", "resnet50"))[0].gpu == "V100"
    assert clusters.from_args(parse("--model", CNN))[0].gpu == "A100"
    preset, custom = clusters.from_args(parse("--network", "dgx_a100"))
    assert not custom and preset.topology.intra_bytes_per_s == 231 * GB
    with pytest.raises(ValueError, match="--inter-gbps must be > 0"):
        clusters.from_args(parse("--inter-gbps", "0"))


def test_every_preset_number_has_a_source():
    for name in clusters.NAMES:
        c = clusters.cluster(name)
        assert set(c.sources) >= {to for to, _ in clusters.FLAGS.values()}


def run_simulate(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # tests.fixtures is not installed
    return subprocess.run(
        [sys.executable, "-m", "profiling.simulate", *argv],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def git_status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True
    ).stdout


def test_the_stable_command_from_another_directory(tmp_path):
    before = git_status()
    out = run_simulate(
        tmp_path, "scale", "--model", CNN, "--input-shape", "3,32,32", "--batch-size", "8",
        "--iteration-ms", "10", "--gpus-per-node", "4", "--intra-gbps", "400",
        "--inter-gbps", "100", "--gpus", "1,4,8,16", "--json", "mine.json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "mine.json").read_text())
    assert [r["gpus"] for r in data["scaling"]] == [1, 4, 8, 16]
    assert data["scaling"][0]["efficiency"] == 1.0
    assert all(0 < r["efficiency"] <= 1 for r in data["scaling"])
    model = user_models.small_cnn()
    assert data["settings"]["workload"]["gradient_bytes"] == sum(
        p.numel() * 4 for p in model.parameters()
    )
    # The assumptions come first, each number with its source.
    head = out.stdout.splitlines()
    assert head[0].startswith(f"model {CNN}: 6 gradients")
    assert "4 GPUs per server  [1]" in out.stdout and "  [1] --gpus-per-node" in out.stdout
    assert "[NCCL 2.20.3" in out.stdout.replace("] NCCL", "[NCCL")  # the rest: dgx_a100's
    assert sorted(p.name for p in (tmp_path / "runs" / "simulate").iterdir()) == [
        "scale-tests_fixtures_user_models-small_cnn-dgx_a100-custom.json",
        "scale-tests_fixtures_user_models-small_cnn-dgx_a100-custom.md",
        "scale-tests_fixtures_user_models-small_cnn-dgx_a100-custom.png",
    ]
    assert git_status() == before  # the checkout is untouched


def test_a_resnet101_sized_model_runs_in_seconds(tmp_path):
    out = run_simulate(
        tmp_path, "scale", "--model", "profiling.simulate.presets:resnet101",
        "--input-shape", "3,224,224", "--batch-size", "32", "--iteration-ms", "150",
        "--cluster", "dgx_a100", "--gpus", "1,8,64,256", "--no-files",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "314 gradients, 44,549,160 parameters" in out.stdout


def test_a_user_model_without_its_iteration_is_refused(tmp_path):
    out = run_simulate(tmp_path, "scale", "--model", CNN, "--no-files")
    assert out.returncode != 0
    assert f"--model {CNN}: give --input-shape, --batch-size, --iteration-ms" in out.stderr
    out = run_simulate(tmp_path, "scale", "--model", "resnet50", "--cluster", "dgx_a100")
    assert "no published iteration of resnet50 on the A100 here; give --batch-size" in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "command,gpus,printed,written",
    [
        ("buckets", "8,16", "| 16 | 10.0 |", "buckets-{stem}.md"),
        ("gantt", "16", "16 GPUs, bucket_cap_mb 25 (1 buckets), overlapped: step",
         "gantt-{stem}-16gpus.svg"),
    ],
)  # fmt: skip
def test_buckets_and_gantt_on_a_user_model(tmp_path, command, gpus, printed, written):
    out = run_simulate(tmp_path, command, "--model", CNN, "--input-shape", "3,32,32",
                       "--batch-size", "8", "--iteration-ms", "10", "--cluster", "cloud_100gbe",
                       "--gpus", gpus, "--out", "o")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert printed in out.stdout
    stem = "tests_fixtures_user_models-small_cnn-cloud_100gbe"
    assert (tmp_path / "o" / written.format(stem=stem)).is_file()


def test_caps_on_a_cluster_pick_the_fastest_and_measure_the_gain():
    from profiling.simulate.bucket_caps import caps_on_cluster
    from profiling.simulate.schedule import Grad, Workload
    from profiling.simulate.topology import Topology

    # 100 gradients of 1 MiB over a 1 s backward, on a slow link with a large latency.
    w = Workload(tuple(Grad(f"w{i}", 2**20, (100 - i) / 100) for i in range(100)), 0, 1.0, 0)
    topo = Topology(1, 2, 200 * 2**20, 200 * 2**20, 0.01, 0.01)
    (row,) = caps_on_cluster(w, topo, "ring", [2], [0.5, 10, 1e6])
    assert row["best_s"] == min(row["caps_s"].values()) == row["caps_s"][row["best_cap_mb"]]
    assert row["best_cap_mb"] == 10  # one per gradient queues up; one bucket waits for the end
    assert row["gain_pct"] == pytest.approx((1 - row["best_s"] / row["default_s"]) * 100)


@pytest.mark.parametrize(
    "argv",
    [
        ["profiling.simulate", "paper"],
        ["profiling.simulate.cpu_cluster", "buckets", "--shapes", "64x3x16", "--repeats", "1"],
    ],
)
def test_the_other_commands_write_where_they_are_run(tmp_path, argv):
    before = git_status()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert any((tmp_path / "runs" / "simulate").iterdir())
    assert git_status() == before


def workload_of(*argv: str):
    args = parse(*argv)
    cluster, _ = clusters.from_args(args)
    return model_args.from_args(args, cluster.gpu, cluster.memory_bytes_per_s)


def test_a_presets_optimizer_and_input_are_its_own_unless_given():
    from profiling.simulate import presets

    # BERT-large's published timing is with Adam: 7 float32 passes per parameter.
    w, lines, _ = workload_of("--model", "bert_large")
    params = presets.profile("bert_large").parameters
    assert w.optimizer_s == pytest.approx(params * 28 / (900 * GB))
    assert "[adam: 28 B per parameter" in lines[2]
    w, _, _ = workload_of("--model", "bert_large", "--optimizer", "sgd")
    assert w.optimizer_s == pytest.approx(params * 20 / (900 * GB))
    # Another input than the published one's, or another batch: the published time no
    # longer holds, so the iteration must be given.
    with pytest.raises(ValueError, match="give --iteration-ms"):
        workload_of("--model", "bert_large", "--input-shape", "512", "--batch-size", "8")
    with pytest.raises(ValueError, match="published iteration is at batch 8"):
        workload_of("--model", "bert_large", "--batch-size", "16")
    w, _, _ = workload_of("--model", "resnet50", "--input-shape", "3,64,64",
                          "--batch-size", "32", "--iteration-ms", "50")  # fmt: skip
    assert w.compute_s == pytest.approx(0.05)


def test_a_model_that_fails_on_its_input_is_named():
    with pytest.raises(ValueError, match="failed on a batch of 2 of --input-shape 1,32,32"):
        usermodel.profile(CNN, (1, 32, 32))
