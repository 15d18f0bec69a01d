"""The per-step overhead command (`python -m profiling.overhead`): its paired arithmetic
(`profiling.overhead.tables`) on hand-made timings, and one tiny run end to end on 1 and
2 Gloo ranks. Nothing here depends on how fast anything ran."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from profiling.overhead.cli import variant_order
from profiling.overhead.tables import BARE, REFERENCE, format_table, paired_summary, world_result

ROOT = Path(__file__).resolve().parent.parent


def test_added_time_and_ratios_are_paired_within_each_round():
    # Seconds per step in three rounds. Added over bare, in µs: torch_ddp 500, 300, 100;
    # drop_in 2000, 900, 500; so drop_in's ratios per round are 4, 3 and 5.
    per_round = {
        BARE: [1.0e-3, 1.2e-3, 1.1e-3],
        "drop_in": [3.0e-3, 2.1e-3, 1.6e-3],
        REFERENCE: [1.5e-3, 1.5e-3, 1.2e-3],
    }
    out = paired_summary(per_round, parameters=10)
    assert out[BARE]["step_us"] == pytest.approx({"median": 1100, "min": 1000, "max": 1200})
    assert out[BARE]["added_us"] is None and out[BARE]["ratio"] is None
    drop_in = out["drop_in"]
    assert drop_in["step_us"]["median"] == pytest.approx(2100)
    assert drop_in["added_us"] == pytest.approx({"median": 900, "min": 500, "max": 2000})
    assert drop_in["added_us_per_param"] == pytest.approx(90)
    # The median of the per-round ratios (4), not the ratio of the medians (900 / 300).
    assert drop_in["ratio"] == pytest.approx({"median": 4, "min": 3, "max": 5, "rounds": 3})
    assert out[REFERENCE]["ratio"] == pytest.approx({"median": 1, "min": 1, "max": 1, "rounds": 3})


def test_rounds_where_the_reference_added_nothing_have_no_ratio():
    # torch_ddp added 100, -100 and 200 µs: round 1 is left out of every ratio.
    per_round = {
        BARE: [1.0e-3, 1.0e-3, 1.0e-3],
        "naive": [1.3e-3, 1.5e-3, 1.4e-3],
        REFERENCE: [1.1e-3, 0.9e-3, 1.2e-3],
    }
    out = paired_summary(per_round, parameters=1)
    assert out["naive"]["added_us"]["median"] == pytest.approx(400)
    assert out["naive"]["ratio"] == pytest.approx({"median": 2.5, "min": 2, "max": 3, "rounds": 2})
    # Without the reference there is nothing to compare with.
    del per_round[REFERENCE]
    assert paired_summary(per_round, parameters=1)["naive"]["ratio"] is None


def test_the_sentence_says_when_the_reference_added_nothing():
    # On a busy machine torch_ddp can add nothing measurable in every round: the table
    # still ends with a sentence on the last stage (no ratio), then its step's ratio.
    seconds = {BARE: [1.0e-3, 1.0e-3], "drop_in": [1.2e-3, 1.3e-3], REFERENCE: [0.9e-3, 1.0e-3]}
    record = {"parameters": 1, "wall_s": seconds, "cpu_s": seconds,
              "replicas_identical": {"drop_in": True, REFERENCE: True}}  # fmt: skip
    text = format_table(world_result(2, record, elapsed_s=1.0), rounds=2, last="drop_in")
    assert "drop_in: no ratio at 2 ranks" in text
    assert "drop_in's step is 1.317x" in text  # (1.2/0.9 + 1.3/1.0) / 2


def test_bare_and_the_reference_always_run_in_stage_order():
    stages = ["naive", "bucketed", "drop_in"]
    assert variant_order(["drop_in", "naive"], stages) == [BARE, "naive", "drop_in", REFERENCE]
    assert variant_order([REFERENCE], stages) == [BARE, REFERENCE]


def test_a_tiny_run_on_one_and_two_ranks(tmp_path: Path):
    out = tmp_path / "overhead.json"
    command = [sys.executable, "-m", "profiling.overhead", "--nproc", "1,2", "--rounds", "2",
               "--steps", "2", "--warmup", "1", "--variants", "naive,drop_in", "--blocks", "4",
               "--json", str(out), "--markdown", str(tmp_path / "overhead.md")]  # fmt: skip
    # From another directory: the command must not depend on being run from the checkout.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Nothing else written, and the docs' table has a row per variant but bare.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overhead.json", "overhead.md"]
    table = (tmp_path / "overhead.md").read_text()
    assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `")] == [
        "| `naive`", "| `drop_in`", f"| `{REFERENCE}`"
    ]  # fmt: skip
    data = json.loads(out.read_text())
    assert data["settings"]["parameters"] == 4 * 4 + 2
    names = [BARE, "naive", "drop_in", REFERENCE]
    assert sorted(data["results"]) == ["1", "2"]
    for world, result in data["results"].items():
        assert result["world_size"] == int(world)
        assert list(result["variants"]) == names
        for name in names:
            v = result["variants"][name]
            assert len(result["wall_s"][name]) == len(result["cpu_s"][name]) == 2  # rounds
            assert v["step_us"]["median"] > 0
            if name == BARE:
                assert v["added_us"] is None and v["ratio"] is None
                continue
            assert set(v["added_us"]) == {"median", "min", "max"}
            assert v["added_us"]["min"] <= v["added_us"]["median"] <= v["added_us"]["max"]
            assert v["replicas_identical"] is True
            ratio = v["ratio"]  # None only if torch_ddp added nothing in both rounds
            if ratio is not None:
                assert ratio["min"] <= ratio["median"] <= ratio["max"]
                assert 1 <= ratio["rounds"] <= 2
    lines = done.stdout.splitlines()
    for name in names:  # one row per variant in each world size's table: name, µs/step, ...
        assert sum(re.match(rf"{name} +\d", line) is not None for line in lines) == 2
    # The last stage's ratio in a sentence (or why there is none), per world size.
    last = [line for line in lines if line.startswith(("drop_in adds", "drop_in: no ratio"))]
    assert len(last) == 2 and "at 1 rank " in last[0] and "at 2 ranks " in last[1]
