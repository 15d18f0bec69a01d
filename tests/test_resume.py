"""A lost rank: checkpoints that resume bit for bit under torchrun's restarts, refusals of
a corrupt or partial checkpoint, a stopped rank named within --timeout, and Ctrl-C that
leaves no worker behind."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp import checkpoint
from profiling.studies import fault_trials

ROOT = Path(__file__).resolve().parent.parent


# -- bit-for-bit resume under torchrun --max-restarts ------------------------------------


# The harness calls a run that lasts past --hang-s a hang (180 s: ten times a run's 18 s
# on an idle 2-core machine). Beside two busy loops, one took 182 s and was still going:
# here only a hang may reach the limit.
HANG_S = 1800


def harness_options(**overrides: object) -> object:
    """The harness's defaults (its command runs 123 steps), shortened to 60 steps (3 of
    warm-up), which still hold both faults below and eight checkpoints; a hang is a run
    past HANG_S."""
    overrides = {"hang_s": HANG_S, "steps": 57, **overrides}
    parser_args = [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()]
    return fault_trials.options(parser_args)


@pytest.fixture(scope="module")
def reference_sha256() -> str:
    """The final parameters of the run with no fault and no checkpoint at all."""
    sha256, _ = fault_trials.reference(harness_options())
    return sha256


@pytest.mark.parametrize(
    "rank,step,phase",
    [(1, 40, "backward"), (0, 56, "checkpoint")],  # buckets in flight; a write cut in half
)
def test_killed_worker_resumes_to_the_same_parameters(
    reference_sha256: str, rank: int, step: int, phase: str
) -> None:
    trial = fault_trials.run_trial(fault_trials.Trial(rank, step, phase), harness_options())
    assert trial.fired and trial.resumed, f"exit {trial.returncode}"
    assert trial.returncode == 0
    assert trial.sha256 == reference_sha256


# -- refusals, in one process ------------------------------------------------------------


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def small_run() -> tuple[torch.nn.Module, torch.optim.Optimizer, checkpoint.RunSettings]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    settings = checkpoint.RunSettings("mlp", 4, 1, 8, 1, 0.1, 0, 1)
    return model, optimizer, settings


def test_resume_restores_model_optimizer_and_generator(group, tmp_path: Path) -> None:
    model, optimizer, settings = small_run()
    checkpoint.save(tmp_path, 5, model, optimizer, settings)
    expected_draw = torch.rand(3)  # what the generator gives next, after the save
    fresh, fresh_optimizer, _ = small_run()
    torch.manual_seed(123)
    assert checkpoint.resume(tmp_path, fresh, fresh_optimizer, settings) == 5
    assert torch.equal(torch.rand(3), expected_draw)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    loaded = [fresh_optimizer.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, loaded, strict=True))


def warmup_then_decay(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over 3 steps, then step decay at 5 (a Counter in its state)."""
    lr = torch.optim.lr_scheduler
    warmup = lr.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    return lr.SequentialLR(optimizer, [warmup, lr.MultiStepLR(optimizer, [2])], milestones=[3])


def test_restore_without_a_process_group_brings_back_scheduler_and_position(tmp_path) -> None:
    assert not dist.is_initialized()  # one process training alone: no collective at all
    model, optimizer, settings = small_run()
    scheduler = warmup_then_decay(optimizer)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    totals = torch.tensor([1.5, 2.0, 8.0], dtype=torch.float64)
    checkpoint.save(
        tmp_path, 2, model, optimizer, settings, scheduler=scheduler,
        position={"epoch": 1, "iteration": 0}, loop={"totals": totals, "val_error": [0.5]},
    )  # fmt: skip
    # What the original gives from here on: the learning rates, and the generator's draw.
    expected_lrs = []
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        expected_lrs.append(optimizer.param_groups[0]["lr"])
    expected_draw = torch.rand(3)
    fresh, fresh_optimizer, _ = small_run()
    fresh_scheduler = warmup_then_decay(fresh_optimizer)
    torch.manual_seed(123)
    state = checkpoint.restore(
        tmp_path, fresh, fresh_optimizer, settings, scheduler=fresh_scheduler
    )
    assert state["step"] == 2
    assert state["data"] == {"next_step": 2, "epoch": 1, "iteration": 0}
    assert torch.equal(state["loop"]["totals"], totals) and state["loop"]["val_error"] == [0.5]
    assert torch.equal(torch.rand(3), expected_draw)
    lrs = []
    for _ in range(5):
        fresh_optimizer.step()
        fresh_scheduler.step()
        lrs.append(fresh_optimizer.param_groups[0]["lr"])
    assert lrs == expected_lrs
    assert sorted(p.name for p in (tmp_path / "step-00000002").iterdir()) == [
        "COMMITTED", "rank-00000.pt"
    ]  # fmt: skip


def test_a_checkpoint_without_scheduler_is_refused_where_one_is_needed(group, tmp_path) -> None:
    model, optimizer, settings = small_run()
    checkpoint.save(tmp_path, 7, model, optimizer, settings)
    with pytest.raises(checkpoint.CheckpointError, match="no learning-rate scheduler state"):
        checkpoint.restore(
            tmp_path, model, optimizer, settings, scheduler=warmup_then_decay(optimizer)
        )


def test_corrupt_file_is_refused_naming_it(group, tmp_path: Path) -> None:
    model, optimizer, settings = small_run()
    step_dir = checkpoint.save(tmp_path, 7, model, optimizer, settings)
    rank_file = step_dir / "rank-00000.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    rank_file.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(rank_file))):
        checkpoint.resume(tmp_path, *small_run())


def test_uncommitted_checkpoint_is_skipped_for_the_one_before(group, tmp_path: Path, capsys):
    model, optimizer, settings = small_run()
    checkpoint.save(tmp_path, 7, model, optimizer, settings)
    partial = tmp_path / "step-00000014"
    partial.mkdir()
    (partial / "rank-00000.pt").write_bytes(b"half a file")  # a write killed midway
    assert checkpoint.resume(tmp_path, *small_run()) == 7
    assert f"skipping {partial}: no COMMITTED marker" in capsys.readouterr().err


def test_another_runs_checkpoint_is_refused(group, tmp_path: Path) -> None:
    model, optimizer, settings = small_run()
    checkpoint.save(tmp_path, 7, model, optimizer, settings)
    other = checkpoint.RunSettings(**{**settings.__dict__, "lr": 0.2})
    with pytest.raises(checkpoint.CheckpointError, match="lr 0.1 there, 0.2 here"):
        checkpoint.resume(tmp_path, model, optimizer, other)


def test_params_sha256_is_over_names_shapes_and_bytes_in_order() -> None:
    import hashlib

    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.fill_(0.5)
    # Hand-written: float32 little-endian bytes of 1.0, -2.0 and 0.5.
    expected = hashlib.sha256(
        b"weight torch.float32 [1, 2]\n" + bytes.fromhex("0000803f000000c0")
        + b"bias torch.float32 [1]\n" + bytes.fromhex("0000003f")
    ).hexdigest()  # fmt: skip
    assert checkpoint.params_sha256(model) == expected


# -- a stopped rank is named; Ctrl-C leaves nothing behind --------------------------------


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """torchrun in a session of its own (so a Ctrl-C reaches it and its workers alike)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *args]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def timed_lines(process: subprocess.Popen) -> queue.Queue:
    """(arrival time, line) of the process's output, read by a thread."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put((time.monotonic(), line))
        lines.put((time.monotonic(), None))

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for(lines: queue.Queue, pattern: str, timeout_s: float) -> tuple[float, re.Match]:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        try:
            at, line = lines.get(timeout=deadline - time.monotonic())
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if match := re.search(pattern, line):
            return at, match
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)[-3000:]}")


def test_stopped_rank_is_named_after_timeout() -> None:
    """The peer of a stopped rank names it once it has been silent for --timeout: not
    before (a slow step is not a stopped rank). How soon after is the machine's speed,
    which a busy machine stretches, so only a hang fails here."""
    timeout_s = 5.0
    process = launch(
        "--nproc-per-node", "2", "-m", "stages.drop_in", "--steps", "100000",
        "--timeout", str(timeout_s),
        env={fault_trials.ENV: "1:20:forward:STOP"},
    )  # fmt: skip
    lines = timed_lines(process)
    stopped_pid = None
    try:
        # As long as torchrun, two imports of torch and 20 steps take: only a hang reaches it.
        stopped_at, match = wait_for(lines, r"rank 1 \(pid (\d+)\): .* SIGSTOP", 600)
        stopped_pid = int(match.group(1))
        named_at, _ = wait_for(lines, r"rank 0: rank 1 has not answered", 300)
        # Not early. Half the timeout: this test reads the lines, late when the machine is busy.
        assert named_at - stopped_at >= timeout_s / 2
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGKILL)  # torchrun would wait 30 s to do it
        process.wait(timeout=300)
    assert process.returncode != 0


def test_a_rank_that_starts_after_the_timeout_still_joins() -> None:
    """--timeout bounds a collective, not the wait for every rank to start: rank 1 starts
    three timeouts after rank 0 (as on a busy or slow node), and the run trains."""
    timeout_s = 2.0
    rank_1_late = (
        f'[ "$RANK" = 1 ] && sleep {3 * timeout_s:g}; exec {sys.executable} -m stages.naive '
        f"--model mlp --steps 2 --timeout {timeout_s:g}"
    )
    process = launch("--nproc-per-node", "2", "--no-python", "sh", "-c", rank_1_late)
    out, _ = process.communicate(timeout=600)  # only a hang reaches it
    assert process.returncode == 0, out[-3000:]


def worker_pids(torchrun_pid: int) -> list[int]:
    """The children of torchrun's process: its workers."""
    children = []
    for task in Path(f"/proc/{torchrun_pid}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    return children


def gloo_in_use(pid: int) -> bool:
    """Whether the process has run a collective over Gloo: its run-loop threads start then."""
    try:
        return any(
            (task / "comm").read_text().strip() == "pt_gloo_runloop"
            for task in Path(f"/proc/{pid}/task").iterdir()
        )
    except FileNotFoundError:  # the process, or a thread of it, is gone
        return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left


def test_ctrl_c_leaves_no_worker_alive() -> None:
    process = launch("--nproc-per-node", "2", "-m", "stages.drop_in", "--steps", "100000")
    try:
        deadline = time.monotonic() + 600  # only a hang reaches these
        while len(workers := worker_pids(process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) == 2, "torchrun started no workers"
        # Into training: each rank has made its group and communicated over it.
        while not all(gloo_in_use(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(gloo_in_use(pid) for pid in workers), "the workers never communicated"
        os.killpg(process.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
        deadline = time.monotonic() + 35
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in workers if alive(pid)]
        assert not left, f"workers {left} still alive 35 s after Ctrl-C"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=300)
