"""The commands users run: every stage under torchrun, end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stages import STAGES

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ROOT = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """torchrun's run of `args` on `nproc` CPU ranks; `timeout` is for a hang only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*TORCHRUN, "--nproc-per-node", str(nproc), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_main_job_reports_identical_replicas() -> None:
    out = torchrun(
        2, "-m", "stages", "--model", "transformer", "--steps", "2", "--warmup-steps", "1"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    for name in [*STAGES, "torch_ddp"]:
        assert rows[name][-1] == "True", f"{name}: {rows[name]}"


def test_global_batch_that_does_not_split_fails_fast(group_log) -> None:
    out = torchrun(2, "-m", "stages.bucketed", "--global-batch-size", "5", timeout=300)
    assert out.returncode != 0
    assert "global batch 5 does not split over 2 ranks; pick a multiple of 2" in out.stderr
    made = group_log.made(ranks=2)  # fast: before any rank made a group, or met at a store
    assert made == [], f"refused only after: {made}"


@pytest.mark.parametrize("stage", ["skip_sync"])
def test_stage_with_accumulation(stage: str) -> None:
    out = torchrun(
        3, "-m", f"stages.{stage}", "--steps", "2", "--accumulation-steps", "3", "--model", "frozen"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # The table's row, then the final parameters' digest on the last line.
    row, digest = out.stdout.strip().splitlines()[-2:]
    assert row.split()[0] == stage and row.split()[-1] == "True"
    assert re.fullmatch(r"params sha256: [0-9a-f]{64}", digest)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc/self/task")
@pytest.mark.parametrize("stage", ["skip_sync", "drop_in"])
def test_no_gloo_thread_outlives_teardown(stage: str) -> None:
    """A process group that outlives teardown keeps Gloo's threads running into
    interpreter shutdown, where they can abort the process at exit."""
    script = str(ROOT / "tests" / "fixtures" / "threads_after_teardown.py")
    args = ["--steps", "2", "--accumulation-steps", "3", "--model", "frozen"]
    out = torchrun(3, script, stage, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    threads = dict(re.findall(r"^rank (\d+) threads after teardown: (.*)$", out.stdout, re.M))
    assert sorted(threads) == ["0", "1", "2"], out.stdout
    for rank, names in threads.items():
        assert "gloo" not in names, f"rank {rank}: {names}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc/self/task")
def test_no_gloo_thread_outlives_a_group_the_client_destroys() -> None:
    """A framework makes and destroys the group itself, around the drop-in swapped in
    for torch's class: once it drops the model and destroys the group, no Gloo thread
    is left to run into interpreter shutdown. (torch's own DDP leaves them: it imports
    torch._dynamo in its constructor, after the group exists, which then holds it.)"""
    out = torchrun(2, str(ROOT / "tests" / "fixtures" / "client_owned_group.py"))
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.findall(r"^rank (\d+) \((.*)\) threads after teardown: (.*)$", out.stdout, re.M)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], out.stdout
    for rank, which, names in found:
        assert which == "stages.drop_in", f"rank {rank} built {which}"
        assert "gloo" not in names, f"rank {rank}: {names}"
