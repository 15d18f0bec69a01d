"""What the simulator's commands refuse, each in one line naming the flag (SystemExit,
no traceback), and outputs that agree with themselves: the reference of E(p) is the
smallest GPU count, `buckets` recommends no cap its own table shows no faster than
torch's default, and each output says which bucket layout its rows use."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from profiling.simulate import bucket_caps, scale
from profiling.simulate.bucket_caps import TIE_PCT, caps_on_cluster
from profiling.simulate.schedule import Grad, Workload
from profiling.simulate.topology import Topology

MiB = 2**20
FAST = ["--model", "resnet50", "--network", "li2020", "--no-files"]


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def refusal(module, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as refused:
        module.run(_args(module, argv))
    message = str(refused.value.code)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("value", ["-0.5", "-1", "nan", "inf"])
def test_scale_refuses_a_negative_or_nonsensical_slowdown(value):
    message = refusal(scale, [*FAST, "--slowdown", value])
    assert message.startswith("scale: --slowdown ") and ">= 0" in message


def test_scale_takes_a_slowdown_of_zero_and_more(capsys):
    scale.run(_args(scale, [*FAST, "--gpus", "8,16", "--bucket-caps", "25",
                            "--slowdown", "0.5"]))  # fmt: skip
    assert "E(p)" in capsys.readouterr().out


@pytest.mark.parametrize("module,name", [(scale, "scale"), (bucket_caps, "buckets")])
def test_an_algorithm_that_does_not_fit_the_servers_is_refused(module, name):
    message = refusal(module, [*FAST, "--algorithm", "halving_doubling", "--gpus", "8,24,48"])
    assert message.startswith(f"{name}: --algorithm halving_doubling does not fit --gpus 24,48")
    assert "hierarchical_halving_doubling" in message


@pytest.mark.parametrize("module,name", [(scale, "scale"), (bucket_caps, "buckets")])
def test_gpus_that_do_not_fill_servers_are_refused_naming_the_count(module, name):
    assert refusal(module, [*FAST, "--gpus", "8,12"]).startswith(f"{name}: --gpus 12: ")


def test_scale_refuses_no_servers_and_caps_that_are_not_numbers():
    assert refusal(scale, [*FAST, "--nodes", "0"]).startswith("scale: --nodes 0")
    assert "--bucket-caps" in refusal(scale, [*FAST, "--bucket-caps", "5,nan"])


def test_the_reference_is_the_smallest_count_whatever_the_order(capsys, tmp_path):
    out = tmp_path / "s.json"
    scale.run(_args(scale, [*FAST, "--gpus", "64,8,1,8", "--bucket-caps", "25",
                            "--json", str(out)]))  # fmt: skip
    assert "E(p) against 1 GPU, the smallest of --gpus (sorted)" in capsys.readouterr().out
    rows = json.loads(out.read_text())["scaling"]
    assert [r["gpus"] for r in rows] == [1, 8, 64]
    e = [r["efficiency"] for r in rows]
    assert e[0] == 1.0 and e[1] <= 1.0 and e[2] <= e[1]


def test_scale_says_its_rows_use_uniform_caps_not_torchs_layout(capsys):
    scale.run(_args(scale, [*FAST, "--gpus", "8,16", "--bucket-caps", "25"]))
    header = next(line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("resnet50 on li2020"))  # fmt: skip
    assert "uniform caps by the stages' rule, not torch's default layout" in header
    assert "E(p) against 8 GPUs" in header


def test_scale_help_says_the_reference_is_the_smallest_and_the_default():
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "E(p) is against the smallest" in text
    assert "by default from 8 (one full server) to 256; start at 1" in text
    assert "the first of --gpus" not in text
    assert scale.__doc__.splitlines()[0].startswith(
        "Scaling efficiency against the smallest of --gpus (default 8 to 256)"
    )


# 100 gradients of 1 MiB over a 1 s backward on one slow link of 2 GPUs.
HUNDRED = Workload(tuple(Grad(f"w{i}", MiB, (100 - i) / 100) for i in range(100)), 0, 1.0, 0)


def test_buckets_recommends_no_cap_no_faster_than_the_default_beyond_the_tie():
    slow = Topology(1, 2, 200 * MiB, 200 * MiB, 0.01, 0.01)
    # One bucket for all waits for the end of backward: slower than torch's default.
    (row,) = caps_on_cluster(HUNDRED, slow, "ring", [2], [1e6])
    assert row["gain_pct"] < 0 and row["recommended_mb"] is None
    # 10 MiB buckets beat the default by far more than the tie.
    (row,) = caps_on_cluster(HUNDRED, slow, "ring", [2], [0.5, 10, 1e6])
    assert row["gain_pct"] > TIE_PCT and row["recommended_mb"] == 10
    # An instant link: every layout's step is the compute, a tie.
    instant = Topology(1, 2, 1e15, 1e15, 0.0, 0.0)
    (row,) = caps_on_cluster(HUNDRED, instant, "ring", [2], [0.5, 10, 1e6])
    assert abs(row["gain_pct"]) <= TIE_PCT and row["recommended_mb"] is None


def test_buckets_table_leaves_one_gpu_out_and_names_both_layouts(capsys):
    bucket_caps.run(_args(bucket_caps, [*FAST, "--network", "li2020", "--gpus", "1,16,8"]))
    printed = capsys.readouterr().out
    assert "1 GPU left out" in printed
    assert "torch's default layout (a 1 MiB first bucket, then 25 MiB" in printed
    assert "against uniform caps by the stages' rule" in printed
    table = [line.strip("|").split("|") for line in printed.splitlines()
             if line.startswith("| ") and line[2].isdigit()]  # fmt: skip
    assert [int(r[0]) for r in table] == [8, 16]  # sorted, no 1
    for cells in table:
        gain, use = float(cells[4].strip().rstrip("%")), cells[5].strip()
        if gain <= TIE_PCT:
            assert use == f"torch's default: no cap beats it by more than {TIE_PCT:g}%"
        else:
            assert use.startswith("bucket_cap_mb=")
    assert math.isfinite(TIE_PCT) and TIE_PCT > 0


def test_buckets_refuses_only_one_gpu():
    assert "GPU counts of 2 or more" in refusal(bucket_caps, [*FAST, "--gpus", "1"])
