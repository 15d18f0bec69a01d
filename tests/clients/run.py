"""Real frameworks on CPU Gloo, 2 ranks, once with torch's DDP and once with the drop-in.

    python -m tests.clients.run [--only NAME ...] [--repeat N] [--timeout SECONDS]
    make clients        # installs the `clients` extra (accelerate, lightning) first

Each flow runs under `torchrun --standalone --nproc-per-node 2`: plainly (torch's DDP),
then under `-m stages.swap` (the drop-in, with CLIENTS_EXPECT_DROP_IN=1 so the flow checks
that the class it wrapped the model in is the drop-in). The table gives per flow each
side's outcome (pass, fail, abort: SIGABRT or "terminate called" at exit, timeout), exit
code and wall seconds, and where the flow saves its final parameters, how torch's and the
drop-in's compare. Below it: each failure's last error line, and for a drop-in failure the
tail of its traceback. Exits 1 if the drop-in fails a flow that torch's DDP passes, or ends
with parameters more than TOLERANCE away from torch's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOLERANCE = 1e-5  # max abs difference allowed between torch's final parameters and ours
ABORT_TEXT = "terminate called without an active exception"
ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Failure)\b|^terminate called")
NOT_THE_ERROR = re.compile(r"ChildFailedError|SignalException")  # torchrun's, about its ranks
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")


def accelerate_script(name: str) -> str:
    """The path of one of the test scripts shipped in accelerate's wheel."""
    spec = importlib.util.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("accelerate is not installed: pip install -e '.[clients]'")
    return str(Path(spec.submodule_search_locations[0], "test_utils", "scripts", name))


@dataclass
class Flow:
    """One client: a script and its arguments, as torchrun takes them."""

    script: str
    args: list[str] = field(default_factory=list)
    accelerate: bool = False  # one of accelerate's own scripts: checked by accelerate_check.py

    def command(self, drop_in: bool) -> list[str]:
        """torchrun's arguments after the launcher's own options."""
        script = accelerate_script(self.script) if self.accelerate else str(HERE / self.script)
        if not drop_in:
            return [script, *self.args]
        if self.accelerate:
            return ["-m", "stages.swap", str(HERE / "accelerate_check.py"), script, *self.args]
        return ["-m", "stages.swap", script, *self.args]


# accelerate's scripts left out: test_ddp_comm_hook.py fails with torch's DDP on CPU (it
# builds its reference DDP with device_ids=[rank] for a CPU module: ValueError);
# test_distributed_data_loop.py hangs with torch's DDP on CPU (join_uneven_inputs does
# nothing on MULTI_CPU, so the uneven-inputs test deadlocks); test_ops.py builds no DDP
# (PartialState's collectives only), so it has nothing to compare.
FLOWS = {
    "plain": Flow("plain_flow.py"),
    "accelerate-sync": Flow("test_sync.py", accelerate=True),
    "accelerate-script": Flow("test_script.py", accelerate=True),
    "lightning-auto": Flow("lightning_flow.py", ["auto"]),
    "lightning-manual": Flow("lightning_flow.py", ["manual"]),
    "lightning-static-manual": Flow("lightning_flow.py", ["static"]),
    "lightning-unused": Flow("lightning_flow.py", ["unused"]),
    "fabric": Flow("fabric_flow.py"),
}


@dataclass
class Result:
    """One torchrun of one flow."""

    status: str  # pass | fail | abort | timeout
    returncode: int | None
    seconds: float
    output: str
    params: torch.Tensor | None = None

    def error(self) -> str:
        """The last error line in the output (rank prefixes stripped), else its last line."""
        lines = [RANK_PREFIX.sub("", line).strip() for line in self.output.splitlines()]
        errors = [x for x in lines if ERROR_LINE.match(x) and not NOT_THE_ERROR.search(x)]
        if self.status == "timeout":
            return "timed out"
        return (errors or [x for x in lines if x] or [""])[-1]

    def traceback_tail(self, lines: int = 40) -> str:
        """The last lines of the lowest failing rank's output, else of the output before
        torchrun's own report of the failure."""
        tagged = [(RANK_PREFIX.match(x), x) for x in self.output.splitlines()]
        ranks = sorted({int(m.group(1)) for m, _ in tagged if m})
        chosen = [x for m, x in tagged if m and int(m.group(1)) == ranks[0]] if ranks else []
        if not chosen:
            chosen = self.output.split("failed (exitcode:")[0].splitlines()[:-1]
        return "\n".join((chosen or self.output.splitlines())[-lines:])


def kill_leftovers(token: str) -> int:
    """SIGKILL every process whose environment holds CLIENTS_RUN=token: ranks that torchrun
    left behind (they run in sessions of their own). Returns how many there were."""
    killed = 0
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"CLIENTS_RUN={token}\0".encode() in environ.read_bytes():
                os.kill(int(environ.parent.name), signal.SIGKILL)
                killed += 1
        except OSError:  # gone already, or not ours to read
            continue
    return killed


def run_flow(name: str, drop_in: bool, timeout: float = 300) -> Result:
    """Run flow `name` once under torchrun with 2 ranks, with torch's DDP or the drop-in."""
    with tempfile.TemporaryDirectory() as tmp:
        params, log, token = Path(tmp, "params.pt"), Path(tmp, "output.log"), uuid.uuid4().hex
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "ACCELERATE_USE_CPU": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "CLIENTS_EXPECT_DROP_IN": "1" if drop_in else "0",
            "CLIENTS_PARAMS_OUT": str(params),
            "CLIENTS_RUN": token,
        }
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", "2", *FLOWS[name].command(drop_in)]
        start = time.perf_counter()
        # Output to a file, not a pipe: a rank left behind would hold a pipe open.
        with log.open("w") as out:
            proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                rc, status = proc.wait(timeout=timeout), None
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                rc, status = proc.wait(), "timeout"
        seconds = time.perf_counter() - start
        leftovers = kill_leftovers(token)
        output = log.read_text(errors="replace")
        if leftovers:
            output += f"\nrun.py: killed {leftovers} process(es) left running after torchrun\n"
        if status is None:
            aborted = rc in (-6, 134) or ABORT_TEXT in output
            status = "abort" if aborted else "pass" if rc == 0 and not leftovers else "fail"
        saved = torch.load(params) if status == "pass" and params.exists() else None
        return Result(status, rc, seconds, output, saved)


def first_pass(results: list[Result]) -> Result | None:
    """The first run that passed, if any."""
    return next((r for r in results if r.status == "pass"), None)


def compare_params(ours: Result | None, theirs: Result | None) -> tuple[str, bool]:
    """(what the table says, whether the drop-in's parameters are within TOLERANCE)."""
    if ours is None or theirs is None or ours.params is None or theirs.params is None:
        return "-", True
    if ours.params.shape != theirs.params.shape:
        return "shapes differ", False
    if torch.equal(ours.params, theirs.params):
        return "identical", True
    diff = (ours.params - theirs.params).abs().max().item()
    return f"max |diff| {diff:.2g}", diff <= TOLERANCE


def cell(results: list[Result]) -> str:
    """One side of one flow: its worst outcome, exit code and mean wall seconds."""
    worst = next((r for r in results if r.status != "pass"), results[0])
    seconds = sum(r.seconds for r in results) / len(results)
    text = f"{worst.status} rc={worst.returncode} {seconds:.1f}s"
    passed = sum(r.status == "pass" for r in results)
    return text + (f" ({passed}/{len(results)} passed)" if len(results) > 1 else "")


def markdown_table(rows: list[tuple[str, str, str, str]], repeat: int) -> str:
    """The table for the docs: per flow, how each side did and whether the final
    parameters agree (no timings: they are one run's, on a shared machine)."""

    def outcome(text: str) -> str:  # `cell`: the worst run's status first, then counts
        counted = re.search(r"\((\d+)/\d+ passed\)", text)
        passed = int(counted.group(1)) if counted else repeat * text.startswith("pass ")
        if passed == repeat:
            return f"passed ({repeat} of {repeat})"
        return f"{passed} of {repeat} passed; {repeat - passed} {text.split()[0]}"

    lines = [
        f"| flow ({repeat} run{'s' if repeat > 1 else ''} a side) | torch's DDP | drop-in "
        "| final parameters, drop-in vs torch |",
        "|---|---|---|---|",
    ]
    for name, theirs, ours, params in rows:
        lines.append(f"| {name} | {outcome(theirs)} | {outcome(ours)} | {params} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the flows, print the table, and return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.clients.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--only", nargs="+", choices=list(FLOWS), default=list(FLOWS), metavar="NAME",
        help=f"these flows only, of: {', '.join(FLOWS)}",
    )  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="runs per side (1)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run (300)")
    parser.add_argument(
        "--markdown", type=Path, metavar="FILE", help="also write the table as markdown to FILE"
    )
    args = parser.parse_args(argv)
    rows, notes, failed = [], [], []
    for name in args.only:
        sides = {}
        for drop_in in (False, True):
            sides[drop_in] = [run_flow(name, drop_in, args.timeout) for _ in range(args.repeat)]
            label = "drop-in" if drop_in else "torch"
            print(f"{name} [{label}]: {cell(sides[drop_in])}", flush=True)
        theirs, ours = sides[False], sides[True]
        params, close = compare_params(first_pass(ours), first_pass(theirs))
        rows.append((name, cell(theirs), cell(ours), params))
        for label, results in (("torch", theirs), ("drop-in", ours)):
            for r in results:
                if r.status != "pass":
                    notes.append(f"{name} [{label}] {r.status}: {r.error()}")
        torch_passes = all(r.status == "pass" for r in theirs)
        ours_fails = next((r for r in ours if r.status != "pass"), None)
        if torch_passes and (ours_fails or not close):
            failed.append(name)
            if ours_fails:
                notes.append(f"--- {name} [drop-in] traceback tail:\n{ours_fails.traceback_tail()}")
            else:
                notes.append(f"--- {name}: parameters differ from torch's: {params}")
    header = ("flow", "torch", "drop-in", "params (drop-in vs torch)")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(text.ljust(w) for text, w in zip(row, widths, strict=True)).rstrip())
    if args.markdown:
        args.markdown.write_text(markdown_table(rows, args.repeat))
    if notes:
        print("\n" + "\n".join(notes))
    if failed:
        print(f"\nthe drop-in fails where torch's DDP passes: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
