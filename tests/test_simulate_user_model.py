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
from torch.utils.flop_counter import FlopCounterMode

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


# --- FLOPs of grouped convolutions -----------------------------------------------------


def conv_flops(n: int, cin: int, cout: int, groups: int, k: int, positions: int) -> int:
    """By hand: a multiply and an add per weight element per position (output positions,
    or input ones for a transposed convolution), each output channel seeing Cin / groups."""
    return 2 * n * cout * positions * (cin // groups) * k * k


@pytest.mark.parametrize(
    "groups,cin,cout,transposed",
    [(32, 64, 64, False), (64, 64, 64, False), (32, 32, 64, False), (1, 64, 64, False),
     (32, 64, 64, True)],
    ids=["grouped", "depthwise", "depthwise-x2", "dense", "grouped-transposed"],
)  # fmt: skip
@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "no-input-grad"])
def test_a_convolutions_backward_is_its_forward_per_gradient(groups, cin, cout, transposed,
                                                             input_grad):  # fmt: skip
    # backward = the input's gradient + the weight's, each the forward's FLOPs; torch's
    # formula counts the weight's `groups` times over (33x the forward for groups=32).
    with torch.device("meta"):
        conv = (torch.nn.ConvTranspose2d if transposed else torch.nn.Conv2d)(
            cin, cout, 3, groups=groups, bias=False
        )
        x = torch.randn(2, cin, 56, 56, requires_grad=input_grad)
    mapping = {torch.ops.aten.convolution_backward: usermodel.conv_backward_flops}
    counter = FlopCounterMode(display=False, custom_mapping=mapping)
    with counter:
        y = conv(x)
        forward = counter.get_total_flops()
        y.sum().backward()
        backward = counter.get_total_flops() - forward
    if transposed:  # per input position, each input channel reaching Cout / groups
        hand = conv_flops(2, cout, cin, groups, 3, 56 * 56)
    else:
        hand = conv_flops(2, cin, cout, groups, 3, 54 * 54)
    assert forward == hand
    assert backward == (2 if input_grad else 1) * hand


def test_grouped_and_depthwise_ready_times_by_hand():
    # A grouped convolution first (its input needs no gradient), a depthwise one after.
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Conv2d(64, 64, 3, groups=32, bias=False),
            torch.nn.Conv2d(64, 64, 3, groups=64, bias=False),
        )
        x = torch.randn(2, 64, 16, 16)
    first, second = conv_flops(2, 64, 64, 32, 3, 14 * 14), conv_flops(2, 64, 64, 64, 3, 12 * 12)
    backward = first + 2 * second  # the first: its weight's gradient only
    p = usermodel.flops_profile(model, x)
    assert p.forward_fraction == pytest.approx((first + second) / (first + second + backward))
    assert p.ready_fraction == pytest.approx({"1.weight": 2 * second / backward, "0.weight": 1.0})


def test_resnext_forward_is_a_third_of_forward_and_backward():
    # ResNeXt-101 32x4d: with the weight's gradient counted 32 times on every 3x3
    # convolution, forward was 0.21 of forward and backward; a GPU's timed split is 0.41.
    from profiling.common.sized_models import resnet50

    model = resnet50("meta", depth=101, groups=32, width_per_group=4)
    p = usermodel.flops_profile(model, torch.randn(2, 3, 224, 224, device="meta"))
    assert 0.33 < p.forward_fraction < 0.34
    assert usermodel.FLOPS_METHOD.endswith("grouped convolutions counted per group")
    _, lines, settings = workload_of("--model", "resnet50", "--input-shape", "3,64,64",
                                     "--batch-size", "32", "--iteration-ms", "50")  # fmt: skip
    assert lines[3].endswith(f"[{usermodel.FLOPS_METHOD}]") and settings["ready"] == (
        usermodel.FLOPS_METHOD
    )


# --- a sequence longer than the model's positions ----------------------------------------

TINY_BERT = "tests.fixtures.user_models:tiny_bert"  # 16 positions


@pytest.mark.parametrize("method", usermodel.READY_METHODS)
def test_a_sequence_longer_than_the_positions_is_refused(method):
    # On the meta device, looking up position 16 of 16 runs; on a GPU it fails.
    with pytest.raises(ValueError) as refused:
        usermodel.profile(TINY_BERT, (17,), method)
    assert str(refused.value) == (
        "--input-shape 17: longer than the model's 16 positions (its position embedding "
        "bert.embeddings.position_embeddings); give a sequence length of at most 16"
    )
    assert usermodel.profile(TINY_BERT, (16,), "flops").forward_fraction > 0


def test_bert_large_at_1024_tokens_is_refused():
    with pytest.raises(ValueError, match=r"^--input-shape 1024: longer than the model's 512 "):
        workload_of("--model", "bert_large", "--input-shape", "1024", "--batch-size", "8",
                    "--iteration-ms", "100")  # fmt: skip


def test_position_tables_are_found_by_name():
    with torch.device("meta"):
        gpt2 = torch.nn.Module()
        gpt2.wte, gpt2.wpe = torch.nn.Embedding(50257, 8), torch.nn.Embedding(1024, 8)
        roberta = torch.nn.Module()  # positions numbered after the padding row, 1
        roberta.word_embeddings = torch.nn.Embedding(50265, 8)
        roberta.position_embeddings = torch.nn.Embedding(514, 8, padding_idx=1)
        tagger = torch.nn.Module()  # part-of-speech tags, not positions
        tagger.embed, tagger.pos_tags = torch.nn.Embedding(100, 8), torch.nn.Embedding(17, 8)
    assert usermodel.position_limit(gpt2) == ("wpe", 1024)
    assert usermodel.position_limit(roberta) == ("position_embeddings", 512)
    assert usermodel.position_limit(tagger) is None
    with torch.device("meta"):
        t5 = torch.nn.Module()  # bucketed relative distances, and a name that only contains it
        t5.embed = torch.nn.Embedding(100, 8)
        t5.relative_position_bias = torch.nn.Embedding(32, 8)
        t5.rel_pos_emb = torch.nn.Embedding(32, 8)
        t5.decomposition = torch.nn.Embedding(16, 8)
    assert usermodel.position_limit(t5) is None
    assert usermodel.example_input(tagger, (4096,), 2, "meta").shape == (2, 4096)


# --- progress while measuring ----------------------------------------------------------


def test_progress_says_where_and_how_long_every_few_seconds():
    now, lines = [100.0], []
    progress = usermodel.Heartbeat("measuring m", every_s=5, clock=lambda: now[0],
                                  write=lines.append)  # fmt: skip
    progress.update("step 1 of 4 (warm-up 1 of 1), forward")
    now[0] += 4
    progress.poll()  # 4 s since the last line: none
    ready = [3]
    progress.update(lambda: f"step 1 of 4 (warm-up 1 of 1), backward, {ready[0]} of 9 ready")
    ready[0], now[0] = 7, now[0] + 5
    progress.poll()
    assert lines == [
        "measuring m: step 1 of 4 (warm-up 1 of 1), forward; 0 s elapsed",
        "measuring m: step 1 of 4 (warm-up 1 of 1), backward, 3 of 9 ready; 4 s elapsed",
        "measuring m: step 1 of 4 (warm-up 1 of 1), backward, 7 of 9 ready; 9 s elapsed",
    ]


class SlowForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        import time

        time.sleep(0.6)  # a long forward, as a large model's is on a CPU
        return self.linear(x)


def test_a_long_step_is_reported_while_it_runs():
    lines: list[str] = []
    with usermodel.Heartbeat("measuring slow", every_s=0.1, write=lines.append) as progress:
        usermodel.measure(SlowForward(), torch.randn(2, 4), "cpu", repeats=1, warmup=0,
                          progress=progress)  # fmt: skip
    during = [line for line in lines if "step 1 of 1 (timed 1 of 1), forward;" in line]
    assert len(during) >= 3, lines  # the update, then the thread's while forward sleeps
    assert any("backward, " in line and "of 2 gradients ready" in line for line in lines)


def test_ready_measured_prints_its_progress_on_stderr(capsys):
    usermodel.profile(CNN, (3, 32, 32), "measured")
    err = capsys.readouterr().err.splitlines()
    what = f"measuring {CNN} at batch 2 of --input-shape 3,32,32 on cpu: "
    assert all(line.startswith(what) and line.endswith(" s elapsed") for line in err), err
    states = [line.removeprefix(what).rsplit(";", 1)[0] for line in err]
    assert states[0] == "building it on cpu" and states[-1] == "done"
    for step, kind in [(1, "warm-up 1 of 1"), (2, "timed 1 of 3"), (4, "timed 3 of 3")]:
        assert f"step {step} of 4 ({kind}), forward" in states
        assert f"step {step} of 4 ({kind}), backward, 0 of 6 gradients ready" in states
