"""Fault injection: kill a random worker at a random phase, check that torchrun's restart
resumes from the last checkpoint to the same final parameters, and count what it cost.

    python -m profiling.studies.fault_trials --trials 200 --seed 1 --out docs/results/faults.md

Each trial runs the command below with one worker told (DDP_STAGES_FAULT, read by
`ddp/fault_injection.py`) to SIGKILL itself at a drawn step and phase: forward, backward with
buckets in flight (--bucket-cap-mb 1 makes several buckets), optimizer step, or halfway
through writing a checkpoint. Every trial's `params sha256:` must equal that of the same
command run once without a fault and without checkpoints, the reference. A trial that
runs past --hang-s is a hang, and is killed (its whole process group)."""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ddp.fault_injection import ENV, PHASES

ROOT = Path(__file__).resolve().parents[2]  # the checkout: profiling/studies/ is two down
HASH = re.compile(r"^params sha256: ([0-9a-f]{64})$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(args: argparse.Namespace, checkpoint_dir: str | None) -> list[str]:
    """The run every trial repeats: torchrun with restarts, c10d rendezvous on loopback."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(args.nproc), "--max-restarts", str(args.max_restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "-m", "stages.drop_in", "--model", "mlp", "--width", str(args.width),
        "--depth", str(args.depth), "--steps", str(args.steps),
        "--warmup-steps", str(args.warmup_steps), "--bucket-cap-mb", str(args.bucket_cap_mb),
    ]  # fmt: skip
    if checkpoint_dir is not None:
        command += ["--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(args.every)]
    return command


@dataclass
class Trial:
    rank: int
    step: int
    phase: str
    seconds: float = 0.0
    returncode: int | None = None  # None: a hang, killed
    sha256: str | None = None
    fired: bool = False  # the worker did kill itself
    resumed: bool = False  # a restarted worker said it resumed from a checkpoint

    @property
    def hang(self) -> bool:
        return self.returncode is None

    @property
    def recovered(self) -> bool:
        return self.fired and self.returncode == 0


def run(command: list[str], env: dict[str, str], hang_s: float) -> tuple[int | None, str, float]:
    """Run `command` in its own process group; kill the group if it runs past `hang_s`."""
    started = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=hang_s)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        returncode = None
    return returncode, output, time.perf_counter() - started


def draw(rng: random.Random, args: argparse.Namespace) -> Trial:
    """A random worker, phase and step; a checkpoint phase falls on a checkpoint's step."""
    total = args.warmup_steps + args.steps
    phase = rng.choice(PHASES)
    if phase == "checkpoint":
        step = rng.choice(range(args.every, total, args.every))  # not the final one
    else:
        step = rng.randrange(total)
    return Trial(rank=rng.randrange(args.nproc), step=step, phase=phase)


def run_trial(trial: Trial, args: argparse.Namespace) -> Trial:
    with tempfile.TemporaryDirectory(prefix="faults-") as checkpoint_dir:
        env = {ENV: f"{trial.rank}:{trial.step}:{trial.phase}"}
        code, output, trial.seconds = run(torchrun_command(args, checkpoint_dir), env, args.hang_s)
    trial.returncode = code
    found = HASH.findall(output)
    trial.sha256 = found[-1] if found else None
    trial.fired = f"{ENV} sends SIGKILL" in output
    trial.resumed = "resuming from" in output
    if code != 0 and args.verbose:
        print(output[-3000:], file=sys.stderr)
    return trial


def reference(args: argparse.Namespace) -> tuple[str, float]:
    """The hash and wall time of the same run without a fault and without checkpoints."""
    code, output, seconds = run(torchrun_command(args, None), {}, args.hang_s)
    found = HASH.findall(output)
    if code != 0 or not found:
        raise SystemExit(f"the reference run failed (exit {code}):\n{output[-3000:]}")
    return found[-1], seconds


def table(trials: list[Trial], want: str, reference_s: float) -> str:
    """One row over all trials, then one per phase: markdown."""
    lines = [
        "| phase | trials | recovered | equal hash | hangs | seconds lost per failure "
        "(median, range) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for phase in ("all", *PHASES):
        rows = [t for t in trials if phase in ("all", t.phase)]
        if not rows:
            continue
        lost = [t.seconds - reference_s for t in rows if not t.hang]
        spread = (
            f"{statistics.median(lost):.1f} ({min(lost):.1f} to {max(lost):.1f})" if lost else "-"
        )
        lines.append(
            f"| {phase} | {len(rows)} | {sum(t.recovered for t in rows)} | "
            f"{sum(t.sha256 == want for t in rows)} | {sum(t.hang for t in rows)} | {spread} |"
        )
    return "\n".join(lines)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """The harness's command line; its defaults are the run of docs/when-a-rank-dies.md."""
    parser = argparse.ArgumentParser(
        prog="python -m profiling.studies.fault_trials",
        description=__doc__.split("\n\n")[0]
        + " Trains the drop-in stage (stages.drop_in) on an MLP under torchrun; a trial "
        "takes about 10 s on two cores, so --trials 200 about 35 minutes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    # fmt: off
    add("--trials", type=int, default=20, help="trials, each one run with one killed worker")
    add("--seed", type=int, default=0, help="seed of the draws of rank, step and phase")
    add("--nproc", type=int, default=2, help="workers (torchrun --nproc-per-node)")
    add("--max-restarts", type=int, default=3, help="torchrun's restarts before it gives up")
    add("--width", type=int, default=512, help="MLP units per layer")
    add("--depth", type=int, default=4, help="MLP layers")
    add("--steps", type=int, default=120, help="optimizer steps of each run")
    add("--warmup-steps", type=int, default=3, help="untimed steps before the timed ones")
    add("--every", type=int, default=7, help="checkpoint every this many steps")
    add("--bucket-cap-mb", type=float, default=1.0,
        help="the stage's bucket cap, MiB (small: several buckets in flight to kill)")
    add("--hang-s", type=float, default=180.0, help="a trial running this long is a hang")
    add("--out", type=Path, help="also write the table and command here (Markdown)")
    add("--verbose", action="store_true", help="print failed trials' output")
    # fmt: on
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = options(argv)
    want, reference_s = reference(args)
    print(f"reference: {reference_s:.1f} s, params sha256: {want}", flush=True)
    rng = random.Random(args.seed)
    trials = []
    for i in range(args.trials):
        trial = run_trial(draw(rng, args), args)
        trials.append(trial)
        status = "hang" if trial.hang else f"exit {trial.returncode}"
        same = "equal" if trial.sha256 == want else "DIFFERENT"
        print(
            f"[{i + 1}/{args.trials}] rank {trial.rank} step {trial.step} {trial.phase}: "
            f"{status}, {same} hash, resumed {trial.resumed}, {trial.seconds:.1f} s",
            flush=True,
        )
    result = table(trials, want, reference_s)
    print(result)
    if args.out:
        arguments = " ".join(argv if argv else sys.argv[1:])
        command = f"python -m profiling.studies.fault_trials {arguments}"
        args.out.write_text(
            f"{result}\n\nReference run {reference_s:.1f} s; seconds lost = trial wall time "
            f"minus the reference's.\nMade with `{command}`.\n"
        )


if __name__ == "__main__":
    main()
