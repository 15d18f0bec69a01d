import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from tests.pool import GlooPool

ROOT = Path(__file__).resolve().parent.parent
# The files that take longest (minutes each, on 2 cores), started first: `make test` hands
# whole files to its workers in collection order, and one started last ends the run last.
LONGEST_FIRST = (
    "test_suite.py", "test_conformance.py", "test_docs_site.py", "test_torchrun.py",
    "test_tensorboard.py", "test_simulate_user_model.py", "test_resume.py",
    "test_auto_bucket.py", "test_command_line.py", "test_cluster.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def pool():
    workers = GlooPool()
    yield workers
    workers.close()


@pytest.fixture(scope="session")
def profile_logdir(tmp_path_factory) -> Path:
    """A log directory freshly produced by the main job with --profile-dir: one
    TensorBoard run per variant (compute_only, each stage, torch_ddp), one gzip'd
    trace per rank in each, and scalars beside them. 2 ranks, the small CNN.

    Made once per `make test`, not once per worker: the test files that read it run on
    different workers, and the first to ask makes it under a lock in the run's shared
    temporary directory (the others wait for it). Tests copy it before writing."""
    shared = tmp_path_factory.getbasetemp()  # this session's; its parent is the run's
    if "PYTEST_XDIST_WORKER" in os.environ:  # under xdist (else the parent outlives the run)
        shared = shared.parent
    logdir, done = shared / "profile_logdir", shared / "profile_logdir.done"
    with FileLock(shared / "profile_logdir.lock"):
        if not done.exists():
            shutil.rmtree(logdir, ignore_errors=True)  # a worker that failed half-way
            logdir.mkdir()
            profile_into(logdir)
            done.touch()
    return logdir


def profile_into(logdir: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "stages", "--model", "cnn", "--batch-size", "8", "--steps", "3",
        "--warmup-steps", "2", "--profile-steps", "2", "--profile-dir", str(logdir),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


# The main job's traces, read and analysed (tests/test_analysis.py, tests/test_compare.py).
@pytest.fixture(scope="module")
def traces(profile_logdir):
    from profiling.analysis import read_logdir

    return read_logdir(profile_logdir)


@pytest.fixture(scope="module")
def results(traces):
    from profiling.analysis import analyse_runs

    return {(r.run, r.rank): r for r in analyse_runs(traces)}


# Loaded at start-up by every Python process whose PYTHONPATH starts with its folder
# (torchrun's agent and every worker it starts): records each call that would make a
# process group or the store its ranks meet at, by process and RANK, and that it loaded.
GROUP_HOOK = """
import os
import sys

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

def _note(what):
    with open(os.environ["DDP_TEST_GROUP_LOG"], "a") as log:
        log.write(f"pid {os.getpid()} rank {os.environ.get('RANK', '-')}: {what}\\n")

def _recorded(name, call):
    def recorded(*args, **kwargs):
        _note(name)
        return call(*args, **kwargs)
    return recorded

for _module, _name in [
    (dist, "init_process_group"), (c10d, "init_process_group"),
    (dist, "rendezvous"), (sys.modules["torch.distributed.rendezvous"], "rendezvous"),
]:
    setattr(_module, _name, _recorded(_name, getattr(_module, _name)))
_note("hook loaded")
"""


class GroupLog:
    """What GROUP_HOOK recorded in the processes of one test."""

    def __init__(self, path: Path):
        self.path = path

    def made(self, ranks: int) -> list[str]:
        """The calls that make a process group or its store, after checking that the hook
        was loaded in rank 0 (else an empty list would prove nothing). Rank 0 is enough:
        no group of `ranks` ranks forms without it, and torchrun may stop another rank,
        once rank 0 has failed, before that rank's interpreter has loaded the hook."""
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        loaded = {line.split(":")[0].split()[-1] for line in lines if line.endswith("hook loaded")}
        assert ranks >= 1 and "0" in loaded, f"the hook did not load in rank 0: {lines}"
        return [line for line in lines if not line.endswith("hook loaded")]


@pytest.fixture
def group_log(tmp_path: Path, monkeypatch) -> GroupLog:
    """Records, in the Python processes the test starts from now on (torchrun, its
    workers), every call that would make a process group or its rendezvous store."""
    hook = tmp_path / "group_hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(GROUP_HOOK)
    path = tmp_path / "groups.log"
    monkeypatch.setenv("DDP_TEST_GROUP_LOG", str(path))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    )
    return GroupLog(path)
