import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pool import GlooPool

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def pool():
    workers = GlooPool()
    yield workers
    workers.close()


@pytest.fixture(scope="session")
def profile_logdir(tmp_path_factory) -> Path:
    """A log directory freshly produced by the main job with --profile-dir: one
    TensorBoard run per variant (compute_only, each stage, torch_ddp), one gzip'd
    trace per rank in each, and scalars beside them. 2 ranks, the small CNN."""
    logdir = tmp_path_factory.mktemp("runs")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "stages", "--model", "cnn", "--batch-size", "8", "--steps", "3",
        "--warmup-steps", "2", "--profile-steps", "2", "--profile-dir", str(logdir),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return logdir


# The main job's traces, read and analysed (tests/test_analysis.py, tests/test_compare.py).
@pytest.fixture(scope="module")
def traces(profile_logdir):
    from profiling.analysis import read_logdir

    return read_logdir(profile_logdir)


@pytest.fixture(scope="module")
def results(traces):
    from profiling.analysis import analyse_runs

    return {(r.run, r.rank): r for r in analyse_runs(traces)}
