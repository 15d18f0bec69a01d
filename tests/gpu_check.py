"""Every check that needs a CUDA GPU, behind one command, with its figures in one file.

    make gpu-check                                    # = the line below, after set-up
    python -m tests.gpu_check --out runs/gpu-check    # writes runs/gpu-check/results.md

The checks: `tests/test_cuda.py` (every stage on NCCL, a resume after a killed worker,
join and "auto" buckets, the traces of a GPU run), in four groups; torch's
`mixed_precision` against the drop-in's (`tests/fixtures/mixed_precision_cuda.py`);
what the drop-in adds to a step against torch's DDP on ResNet-50 and GPT-2 sized
models (`profiling.overhead`); and the simulator's iteration measured on this GPU
(`profiling.simulate scale` without --iteration-ms). One rank per GPU, all of them;
the overhead on one GPU.

The timed checks (overhead, simulator) run alone, one after another; then the others
all at once: one GPU and its host's cores run five small jobs side by side. Each check
has a time limit, and the whole run BUDGET_S, so it ends within 8 minutes. The sizes
are for one H200, where about 6 minutes are expected (estimated from CPU runs, not yet
measured there: a check that runs out of time says so in results.md). results.md holds
each check's status, seconds and figures, and the end of a failed one's output; logs/
every check's whole output. Exit status 1 if any check failed; where torch sees no GPU,
2 at once, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from profiling.common.report import machine

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 450  # the whole run, 7.5 minutes: a check still running then is stopped
PYTHON = sys.executable


@dataclass(frozen=True)
class Check:
    name: str
    command: list[str]
    limit_s: int  # stopped after this long, and failed
    alone: bool  # timed: nothing else runs beside it
    # (figures, problems) from the output and --out; no problems and exit 0: passed
    read: Callable[[str, Path], tuple[str, list[str]]]


def pytest_summary(output: str, out: Path) -> tuple[str, list[str]]:
    """pytest's last line ("4 passed, 12 deselected in 95.20s"); a skip is a problem here."""
    counts = re.compile(r"\b\d+ (passed|failed|errors?|skipped)\b")
    lines = [line.strip("= ") for line in output.splitlines() if counts.search(line)]
    summary = lines[-1] if lines else "no summary from pytest"
    skipped = ["a test skipped: on a GPU every one must run"] if "skipped" in summary else []
    return summary, skipped


def mixed_precision_figures(output: str, out: Path) -> tuple[str, list[str]]:
    """Per rank and reduce dtype, the largest difference from torch's DDP."""
    from tests.test_cuda import mixed_precision_problems  # a test module: import it only here

    found = re.findall(r"^rank (\d+) reduce (\S+): max difference ([^,\s]+)", output, re.M)
    figures = "; ".join(f"rank {r}, reduce {dtype}: max difference {d}" for r, dtype, d in found)
    return figures, mixed_precision_problems(output, gpus())


def overhead_figures(model: str) -> Callable[[str, Path], tuple[str, list[str]]]:
    def read(output: str, out: Path) -> tuple[str, list[str]]:
        variants = json.loads((out / f"overhead-{model}.json").read_text())["results"]["1"][
            "variants"
        ]
        step = {name: v["step_us"]["median"] / 1e3 for name, v in variants.items()}
        ratio = variants["drop_in"]["step_ratio"]
        figures = (
            f"step ms: bare {step['bare']:.2f}, torch_ddp {step['torch_ddp']:.2f}, "
            f"drop_in {step['drop_in']:.2f}; drop_in step x torch_ddp's {ratio['median']:.3f} "
            f"[{ratio['min']:.3f}-{ratio['max']:.3f}] over rounds"
        )
        apart = [n for n, v in variants.items() if v.get("replicas_identical") is False]
        return figures, [f"replicas differ after the run: {apart}"] if apart else []

    return read


def simulator_figures(output: str, out: Path) -> tuple[str, list[str]]:
    result = json.loads((out / "simulate-scale.json").read_text())
    settings, work = result["settings"], result["settings"]["workload"]
    efficiency = ", ".join(f"{r['gpus']}: {r['efficiency']:.3f}" for r in result["scaling"])
    figures = (
        f"iteration at batch {settings['batch_per_gpu']}: forward {work['forward_s'] * 1e3:.1f} "
        f"ms, backward {work['backward_s'] * 1e3:.1f} ms, optimizer "
        f"{work['optimizer_s'] * 1e3:.2f} ms; E(p) on dgx_a100 {efficiency}"
    )
    measured = settings["iteration_source"].startswith("measured on this machine's")
    return figures, [] if measured else [f"not measured here: {settings['iteration_source']}"]


def gpus() -> int:
    return torch.cuda.device_count()


def checks(out: Path) -> list[Check]:
    """The timed checks first, each alone; sizes for one H200."""
    overhead = [
        PYTHON, "-m", "profiling.overhead", "--backend", "nccl", "--nproc", "1",
        "--variants", "drop_in", "--rounds", "7", "--steps", "10", "--warmup", "2",
    ]  # fmt: skip
    simulator = [
        PYTHON, "-m", "profiling.simulate", "scale", "--model",
        "profiling.simulate.presets:resnet50", "--input-shape", "3,224,224", "--batch-size",
        "32", "--gpus", "1,8,64", "--no-files", "--json", str(out / "simulate-scale.json"),
    ]  # fmt: skip
    test_cuda = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    groups = {  # -k expressions; the last takes any test the file gains
        "every stage on NCCL, default": "every_stage_trains and default",
        "every stage on NCCL, --deterministic": "every_stage_trains and deterministic",
        "resume after a killed worker": "resumes_bit_for_bit",
        "join, auto buckets, GPU traces": "not every_stage_trains and not resumes_bit_for_bit "
        "and not mixed_precision",
    }
    mixed_precision = [
        PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus()),
        "tests/fixtures/mixed_precision_cuda.py",
    ]  # fmt: skip
    return [
        *(
            Check(
                f"overhead, {model}",
                [*overhead, "--model", model, "--json", str(out / f"overhead-{model}.json")],
                limit_s=limit,
                alone=True,
                read=overhead_figures(model),
            )
            for model, limit in (("resnet50", 120), ("gpt2_small", 150))
        ),
        Check("simulator's measured iteration", simulator, 90, True, simulator_figures),
        *(
            Check(f"test_cuda: {name}", [*test_cuda, "-k", expression], 240, False, pytest_summary)
            for name, expression in groups.items()
        ),
        Check(
            "mixed_precision, torch's and the drop-in's",
            mixed_precision,
            120,
            False,
            mixed_precision_figures,
        ),
    ]


@dataclass
class Outcome:
    check: Check
    status: str  # passed, failed, timed out
    seconds: float
    figures: str
    problems: list[str]
    tail: str


class Running:
    """One check's process (a session of its own, so a timeout stops its children too),
    its output in a log file."""

    def __init__(self, check: Check, logs: Path, deadline: float):
        self.check = check
        self.log = logs / (check.name.translate(str.maketrans(" ,:'", "----")) + ".log")
        self.started = time.monotonic()
        self.deadline = min(self.started + check.limit_s, deadline)
        with open(self.log, "w") as sink:
            self.process = subprocess.Popen(
                check.command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        print(f"gpu-check: started {check.name}", file=sys.stderr, flush=True)

    def outcome(self, out: Path) -> Outcome | None:
        """None while it runs; its outcome once it ended or ran out of time."""
        code = self.process.poll()
        timed_out = code is None and time.monotonic() > self.deadline
        if code is None and not timed_out:
            return None
        if timed_out:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
            self.process.wait()
        seconds = time.monotonic() - self.started
        output = self.log.read_text(errors="replace")
        problems = [f"exit status {code}"] if code else []
        figures = ""
        try:
            figures, found = self.check.read(output, out)
            problems += found
        except (OSError, KeyError, ValueError, IndexError) as error:  # no results written
            problems.append(f"no figures: {type(error).__name__}: {error}")
        status = "timed out" if timed_out else "failed" if problems else "passed"
        if timed_out:
            problems.insert(0, f"stopped after {seconds:.0f} s")
        tail = "\n".join(output.splitlines()[-40:])
        print(f"gpu-check: {status}: {self.check.name} ({seconds:.0f} s)", file=sys.stderr)
        return Outcome(self.check, status, seconds, figures, problems, tail)


def run_all(all_checks: list[Check], out: Path) -> list[Outcome]:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + BUDGET_S
    outcomes = []
    alone = [c for c in all_checks if c.alone]
    together = [c for c in all_checks if not c.alone]
    for batch in [[c] for c in alone] + [together]:
        running = [Running(c, logs, deadline) for c in batch]
        while running:
            time.sleep(0.5)
            for r in list(running):
                outcome = r.outcome(out)
                if outcome is not None:
                    outcomes.append(outcome)
                    running.remove(r)
    order = {c.name: i for i, c in enumerate(all_checks)}
    return sorted(outcomes, key=lambda o: order[o.check.name])


def markdown(outcomes: list[Outcome], seconds: float) -> str:
    host = machine()
    names = [torch.cuda.get_device_name(i) for i in range(gpus())]
    failed = sum(o.status != "passed" for o in outcomes)
    lines = [
        f"# make gpu-check, {host['date_utc']} UTC",
        "",
        f"{len(names)} GPU(s): {', '.join(sorted(set(names)))}; torch {host['torch']} "
        f"(CUDA {torch.version.cuda}); {host['cpu']}, {host['usable_cores']} cores usable",
        f"{len(outcomes) - failed} of {len(outcomes)} checks passed, in {seconds:.0f} s",
        "",
        "| check | status | seconds | figures |",
        "|---|---|---|---|",
    ]
    for o in outcomes:
        figures = "; ".join([o.figures, *o.problems] if o.figures else o.problems)
        lines.append(f"| {o.check.name} | {o.status} | {o.seconds:.0f} | {figures} |")
    for o in outcomes:
        if o.status != "passed":
            command = shlex.join(["python", *o.check.command[1:]])
            lines += ["", f"## {o.check.name}: {o.status}", "", f"`{command}`", "", "```",
                      o.tail, "```"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/gpu-check"),
        help="folder for results.md, logs/ and the tools' JSON (default: %(default)s)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(f"gpu-check needs a CUDA GPU: torch sees none (torch {torch.__version__}, {build})",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    out = args.out.resolve()
    for stale in [*out.glob("*.json"), out / "results.md"]:  # a check's figures are its own
        stale.unlink(missing_ok=True)
    started = time.monotonic()
    outcomes = run_all(checks(out), out)
    results = out / "results.md"
    results.write_text(markdown(outcomes, time.monotonic() - started))
    print(results.read_text())
    print(f"wrote {results}", file=sys.stderr)
    raise SystemExit(1 if any(o.status != "passed" for o in outcomes) else 0)


if __name__ == "__main__":
    main()
