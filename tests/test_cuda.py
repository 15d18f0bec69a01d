"""The stages on CUDA with NCCL: every stage trains with replicas identical, a killed
worker resumes bit for bit, `join()` and bucket_cap_mb="auto" run their own collectives,
and the traces of a GPU run are read back. Skipped where torch sees no GPU, as in CI.

One rank per GPU (NCCL refuses two ranks on one GPU), so on a one-GPU machine the world
size is 1, and some checks hold by construction there: one replica is identical to
itself, the ranks never finish apart under `join()`, and NCCL sends nothing (no kernel
in the traces). What one GPU does check: that every collective the stages issue is one
NCCL takes (CUDA tensors), that --deterministic runs, and the resume's digest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from profiling.studies.fault_trials import free_port
from stages import STAGES
from tests.test_torchrun import ROOT, torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize(
    "deterministic", [[], ["--deterministic"]], ids=["default", "deterministic"]
)
@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer", "frozen"])
def test_every_stage_trains_on_nccl_with_identical_replicas(
    model: str, deterministic: list[str]
) -> None:
    out = torchrun(
        GPUS, "-m", "stages", "--backend", "nccl", "--model", model, "--steps", "4", *deterministic
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    for name in [*STAGES, "torch_ddp"]:
        assert rows[name][-1] == "True", f"{name}: {rows[name]}"


def params_sha256(stdout: str) -> str:
    found = re.findall(r"params sha256: ([0-9a-f]{64})", stdout)
    assert len(found) == 1, stdout[-2000:]
    return found[0]


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_killed_worker_resumes_bit_for_bit_on_cuda(model: str, tmp_path) -> None:
    # --deterministic: without it cuDNN's convolutions end two runs of the CNN apart.
    stage = ["-m", "stages.drop_in", "--backend", "nccl", "--model", model, "--steps", "20",
             "--deterministic"]  # fmt: skip
    reference = torchrun(GPUS, *stage)
    assert reference.returncode == 0, reference.stderr[-3000:]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(GPUS), "--max-restarts", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *stage,
        "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "5",
    ]  # fmt: skip
    env = {**os.environ, "DDP_STAGES_FAULT": "0:12:backward"}  # rank 0, step 12
    faulted = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert faulted.returncode == 0, faulted.stderr[-3000:]
    assert "resuming from" in faulted.stdout + faulted.stderr
    assert params_sha256(faulted.stdout) == params_sha256(reference.stdout)


def test_join_and_auto_buckets_run_their_collectives_on_nccl() -> None:
    out = torchrun(GPUS, "-m", "tests.cuda_worker", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "; identical True" in out.stdout, out.stdout


def test_traces_of_a_gpu_run_are_read_back(tmp_path) -> None:
    out_dir = tmp_path / "out"
    command = [
        sys.executable, "-m", "profiling.compare", "--nproc", str(GPUS), "--model", "cnn",
        "--logdir", str(tmp_path / "runs"), "--out", str(out_dir), "--backend", "nccl",
        "--steps", "4", "--no-scalars",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {r["run"]: r for r in json.loads((out_dir / "profile.json").read_text())["runs"]}
    assert set(runs) == {"compute_only", *STAGES, "torch_ddp"}
    for name, run in runs.items():
        assert run["device"] == "gpu", (name, run)
        assert run["compute_ms"] > 0, (name, run)
        # compute_only communicates nothing; every other run all-reduces its gradients.
        # On one GPU NCCL's all-reduce has no one to send to and launches no kernel.
        sends = GPUS > 1 and name != "compute_only"
        assert (run["collectives_per_step"] > 0) == sends, (name, run)


def test_mixed_precision_equals_torchs_on_cuda() -> None:
    """torch's `mixed_precision` argument, the same script with torch's DDP and the
    drop-in: gradients and parameters of every step equal (torch's own cannot run on
    CPU, so this is the only comparison with it)."""
    out = torchrun(GPUS, str(ROOT / "tests" / "fixtures" / "mixed_precision_cuda.py"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert mixed_precision_problems(out.stdout, GPUS) == [], out.stdout


def mixed_precision_problems(stdout: str, gpus: int) -> list[str]:
    """What is wrong in the output of mixed_precision_cuda.py on `gpus` ranks (also read
    by `tests.gpu_check`)."""
    found = re.findall(r"max difference (\S+), dtypes (.*)$", stdout, re.M)
    if len(found) != 2 * gpus:
        return [f"{len(found)} results where {gpus} ranks print {2 * gpus}"]
    # torch divides the sum by the world size, the drop-in each gradient before it: the
    # same numbers where the world size is a power of two (and so the division exact).
    bound = 1e-6 if gpus & (gpus - 1) == 0 else 1e-2
    problems = [f"max difference {d} over {bound:g}" for d, _ in found if float(d) > bound]
    # full precision after each step
    return problems + [f"dtypes {t} after the steps" for _, t in found if t != "['torch.float32']"]
