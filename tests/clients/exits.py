"""Run a client that owns the process group around the drop-in many times, and count
the runs that abort at exit ("terminate called without an active exception").

    .venv/bin/python -m tests.clients.exits --runs 200          # the drop-in
    .venv/bin/python -m tests.clients.exits --runs 200 --torch  # torch's DDP, to compare

The client is `tests/fixtures/client_owned_group.py` under torchrun, 2 Gloo ranks: it
swaps the drop-in in, makes the group itself, trains a few steps, drops the model and
destroys the group. About 3 s a run on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "fixtures" / "client_owned_group.py"
ABORT_SIGNS = ("terminate called", "Signal 6", "SIGABRT")


def run_once(torch_ddp: bool, timeout_s: float = 120) -> str:
    """'ok', 'abort' or 'failed' (with the reason) for one run of the client."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(CLIENT), *(["torch"] if torch_ddp else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env
        )
    except subprocess.TimeoutExpired:
        return "failed: timed out"
    output = done.stdout + done.stderr
    if any(sign in output for sign in ABORT_SIGNS):
        return "abort"
    return "ok" if done.returncode == 0 else f"failed: exit {done.returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.clients.exits", description=__doc__)
    parser.add_argument("--runs", type=int, default=200, help="how many runs (200)")
    parser.add_argument("--torch", action="store_true", help="torch's DDP instead")
    args = parser.parse_args(argv)
    counts: dict[str, int] = {}
    start = time.perf_counter()
    for i in range(args.runs):
        outcome = run_once(args.torch)
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome != "ok":
            print(f"run {i + 1}: {outcome}", flush=True)
    which = "torch's DDP" if args.torch else "the drop-in"
    minutes = (time.perf_counter() - start) / 60
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    print(f"{which}, {args.runs} runs in {minutes:.1f} min: {summary}")
    return 0 if counts.get("ok", 0) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
