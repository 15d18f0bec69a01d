"""What the course's pages quote, and how: each figure about the course's MLP
(`QUANTITIES`) and each command whose time a page gives (`COMMANDS`), rendered from the
measurements `python -m profiling.course.numbers` writes (docs/results/course-numbers.json)
the same way on every page.

A page writes `{{ number("overlapped_step_ms") }}` or `{{ duration("check_skip_sync") }}`;
the docs build (docs/hooks.py) calls `render` and `render_duration`, which fail on a name
not defined here, and tests/test_docs_numbers.py finds a figure a page writes by hand with
each quantity's `patterns`. This module imports no torch: a build and its tests print a
figure without one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "docs" / "results" / "course-numbers.json"
MLP = {"model": "mlp", "width": 2048, "depth": 7, "batch_size": 128}
RATE = "1gbit"
GBIT_S = 1.0  # the simulated figures' link, as RATE
CAP = "25"  # the simulated figures' layout: the stages' default bucket_cap_mb
ACCUMULATION_STEPS = 4  # skip_sync's micro-batches per synchronisation, as the traced one
PY = ".venv/bin/python"
WRITER = "sudo .venv/bin/python -m profiling.course.numbers --out FILE writes it"
TORCHRUN = ".venv/bin/torchrun --standalone --nproc-per-node 2"


@dataclass(frozen=True)
class Quantity:
    """One figure the pages quote: what it is, its unit, and how a page words it (the
    regular expressions tests/test_docs_numbers.py looks for, `v` the figure)."""

    what: str
    unit: str  # ms, µs or MB/s
    patterns: tuple[str, ...] = ()


FIGURE = r"(?P<v>\d[\d,]*(?:\.\d+)?)"
# Words between a quantity's name and its figure: no figure, no sentence's end, and no
# other quantity's name ("compute-only + communication alone / k, with compute-only 190").
GAP = r"(?:(?!compute|communication|\bstep\b|\. )[^\d;:()|\n]){0,60}?"

QUANTITIES = {
    "compute_ms": Quantity(
        "the course MLP's compute per step (forward, backward, optimizer), untraced, one "
        "process", "ms",
        (rf"\b[Cc]ompute(?:-only| alone)?(?:'s)?\b(?: \()?{GAP}{FIGURE} ms",),
    ),
    "backward_ms": Quantity("its backward, untraced, one process", "ms",
                            (rf"\bbackward \(about {FIGURE} ms",)),
    "traced_compute_ms": Quantity(
        "the compute lane of the traced steps (naive, bucketed, overlapped; both ranks): "
        "min-max", "ms",
        (rf"\b(?:traces?|traced|profiler)\b[^\d;:()|\n]{{0,80}}?\bcomput\w*"
         rf"[^\d;:()|\n]{{0,40}}?{FIGURE}–\d[\d,]* ms",),
    ),
    "allreduce_call_us": Quantity(
        "one call: a 4 KB Gloo all-reduce on the 2-rank cluster, the slowest rank's", "µs",
        (rf"α ≈ {FIGURE} ?(?:ms|µs)", rf"{FIGURE} ?(?:ms|µs) per (?:call|all-reduce)\b",
         rf"\bsteps? of about {FIGURE} ?µs"),
    ),
    "link_MBps": Quantity("a 25 MB Gloo all-reduce on the 2-rank cluster, MB/s", "MB/s",
                          (rf"β ≈ {FIGURE} MB/s",)),
    "communication_alone_ms": Quantity(
        "the 6 buckets (96 MiB) all-reduced back to back with no compute, 1 Gbit/s", "ms",
        (rf"\bcommunication alone\b(?: \()?{GAP}{FIGURE} ms",),
    ),
    "naive_step_ms": Quantity("naive's step at 1 Gbit/s", "ms",
                              (rf"\bnaive(?:'s)? step\b{GAP}{FIGURE} ms",)),
    "bucketed_step_ms": Quantity("bucketed's step at 1 Gbit/s", "ms",
                                 (rf"\bbucketed(?:'s)? step\b{GAP}{FIGURE} ms",)),
    "overlapped_step_ms": Quantity("overlapped's step at 1 Gbit/s", "ms",
                                   (rf"\boverlapped(?:'s)? step\b{GAP}{FIGURE} ms",)),
    "skip_sync_step_ms": Quantity(
        f"skip_sync's step at 1 Gbit/s, {ACCUMULATION_STEPS} micro-batches, per micro-batch",
        "ms", (rf"\bskip_sync(?:'s)? step\b{GAP}{FIGURE} ms",),
    ),
    # The sliders' figures: the step model on the measured compute (stored with it by
    # numbers.simulated), for the 14-gradient MLP at 1 Gbit/s, no latency, 25 MiB, one
    # micro-batch unless the name says.
    "sim_naive_ms": Quantity("the sliders' naive step", "ms"),
    "sim_bucketed_ms": Quantity("the sliders' bucketed step", "ms"),
    "sim_overlapped_ms": Quantity("the sliders' overlapped step", "ms"),
    "sim_bound_ms": Quantity("the sliders' bound for overlapped", "ms"),
    "sim_hidden_ms": Quantity("what overlapped hides on the sliders (bucketed - overlapped)",
                              "ms"),
    "sim_skip_sync_16_ms": Quantity("the sliders' skip_sync at 16 micro-batches, per micro-batch",
                                    "ms"),
}  # fmt: skip


@dataclass(frozen=True)
class Command:
    """A command a page gives, with the time it takes: `{{ duration(name) }}`."""

    line: str  # as the page gives it, from the repository root (and as it is timed)
    root: bool = False  # needs root (network namespaces)
    core: bool = True  # on the core path (the home page's estimate adds these up)
    # JUnit files every run of the command writes: their times, summed, are its time, read
    # instead of running it again (for a run too long to repeat for a figure).
    junit: tuple[str, ...] = ()
    # The command as the page writes it, where that differs from `line` (shell variables
    # the page defines; `line` then writes into a scratch folder, not the docs' results).
    shown: str = ""


BENCH = f"{PY} -m profiling.bench --nproc 2 --network 1gbit"
SCRATCH = "runs/course-numbers-timing"  # where a timed command writes, if not the docs
COLLECTIVES_OUT = " ".join(
    f"--{kind} {SCRATCH}/collectives.{ext}"
    for kind, ext in (("json", "json"), ("markdown", "md"), ("plot", "png"))
)
COMMANDS = {
    # all_reduce's exercise, the tests it breaks (unbroken, as it is timed).
    "exercise_ring": Command(
        f"{PY} -m pytest -q -p no:xdist tests/test_collectives.py -k equals_torchs"),
    # Each stage page's "How to run it" (torchrun, from .venv).
    "run_naive": Command(f"{TORCHRUN} -m stages.naive --model mlp --steps 20"),
    "run_bucketed": Command(f"{TORCHRUN} -m stages.bucketed --model cnn --bucket-cap-mb 25"),
    "run_overlapped": Command(f"{TORCHRUN} -m stages.overlapped --model cnn"),
    "run_skip_sync": Command(f"{TORCHRUN} -m stages.skip_sync --model mlp --accumulation-steps 4"),
    "check_naive": Command(f"{BENCH} --model cnn --rounds 3 --steps 5 "
                           "--variants compute_only,communication_alone,naive,bucketed", True),
    "check_bucketed": Command(
        f"{BENCH} --model mlp --width 2048 --depth 7 --batch-size 256 "
        "--sweep bucket_cap_mb=1e-6,25 --variants compute_only,communication_alone,bucketed "
        "--rounds 3 --steps 2", True),
    "check_overlapped": Command(f"{PY} -m pytest tests/test_suite.py -q -x -k overlapped"),
    "check_skip_sync": Command(
        f"{BENCH} --model mlp --width 2048 --depth 7 --batch-size 128 "
        "--sweep accumulation_steps=8,16 --variants compute_only,communication_alone,skip_sync "
        "--rounds 3 --steps 2 --warmup-steps 2", True),
    "test_skip_sync": Command(f"{PY} -m pytest -q tests/test_skip_sync.py"),
    "check_auto_bucket": Command(
        f"{BENCH} --model mlp --width 2048 --depth 7 --batch-size 256 --rounds 4 --steps 3 "
        "--variants compute_only,communication_alone,drop_in,drop_in_auto,torch_ddp_default "
        "--json runs/auto.json --markdown runs/auto.md", True, core=False),
    "anatomy_docs": Command(f"{PY} -m profiling.course.anatomy --docs", core=False),
    "demo": Command("make demo"),
    "hierarchical": Command(f"{PY} -m profiling.cluster hierarchical", True, core=False),
    **{
        f"collectives_{name}": Command(
            f"{PY} -m profiling.collectives {args} {COLLECTIVES_OUT}{merge}",
            True, core=False, shown=f"$C {args} $OUT{merge}",
        )
        for name, args, merge in (
            ("2_4", "--world-sizes 2,3,4 --network 1gbit", ""),
            ("8", "--world-sizes 8 --network 1gbit --max-size 64MiB", " --merge"),
            ("delay", "--world-sizes 4,6,8 --network 1gbit --delay-ms 1 --max-size 16MiB",
             " --merge"),
        )
    },
    "conformance": Command("make conformance", core=False,
                           junit=("runs/conformance/torch.xml", "runs/conformance/ours.xml")),
    "pairs": Command(f"{PY} -m profiling.course.pairs", True, core=False),
    "numbers": Command(f"{PY} -m profiling.course.numbers", True, core=False),  # timed by itself
}  # fmt: skip


def load(path: Path = DATA, key: str = "measured") -> dict:
    """The numbers file at `path`; a missing one, or one without `key`, stops with a
    message that names it and the command that writes it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read the course's numbers ({e}); {WRITER}") from None
    if key not in data:
        raise SystemExit(f"{path}: has no {key!r}, so it is not the course's numbers; {WRITER}")
    return data


def value(name: str, data: dict) -> float | tuple[float, float]:
    """The figure a page quotes: a measured median, a traced range (min, max), or the step
    model's figure on the measured compute."""
    if name not in QUANTITIES:
        raise KeyError(f"no quantity {name!r}; profiling/course/numbers.py has {list(QUANTITIES)}")
    if name.startswith("sim_"):
        return data["simulated"][name]
    figure = data["measured"][name]
    if name.startswith("traced_"):
        return figure["min"], figure["max"]
    return figure["median"]


def render(name: str, data: dict, bare: bool = False) -> str:
    """`name`'s figure as every page prints it: `1,008 ms`, `4.6 ms`, `440–470 ms`,
    `210 µs` (`3.1 ms` from 1,000 µs), `119 MB/s`; `bare` leaves the unit out (for sums
    written out)."""
    figure = value(name, data)  # first: it names a quantity that does not exist
    unit = QUANTITIES[name].unit
    if unit == "µs" and not isinstance(figure, tuple) and figure >= 1000:
        figure, unit = figure / 1000, "ms"  # 3.1 ms, not 3,070 µs
    if isinstance(figure, tuple):
        text = "–".join(_digits(f, unit) for f in figure)
    else:
        text = _digits(figure, unit)
    return text if bare else f"{text} {unit}"


def _digits(x: float, unit: str) -> str:
    if unit == "µs":
        return f"{round(x, -1 if x >= 100 else 0):,.0f}"
    return f"{x:,.1f}" if x < 10 else f"{x:,.0f}"


def render_duration(name: str, data: dict) -> str:
    """`about 30 seconds`, `about 4 minutes`: the measured wall time, rounded (to 1 s up
    to 10 s, 5 s up to 90 s, then half a minute), so always within 1.5x of it."""
    if name == "core_path":
        return core_path(data)
    if name == "bench_rounds":
        return "about " + _duration(bench_rounds_seconds())
    if name not in COMMANDS:
        raise KeyError(f"no command {name!r}; profiling/course/numbers.py has {list(COMMANDS)}")
    timed = data.get("durations", {}).get(name)
    if timed is None:
        raise KeyError(f"{name!r} was never timed: run `profiling.course.numbers --time {name}`")
    return "about " + _duration(timed["seconds"])


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{max(1, round(seconds))} seconds"
    if seconds < 90:
        return f"{max(5, 5 * round(seconds / 5)):.0f} seconds"
    minutes = round(seconds / 30) / 2
    return f"{minutes:g} minutes"


READING_MIN, EXERCISES_MIN = 80, 30  # the core path's pages read and worked: estimates


def core_path(data: dict) -> str:
    """The home page's estimate of the core path: reading and exercises (estimated), and
    the commands its pages give (every core command, timed), without root and with it."""
    timed = data.get("durations", {})
    missing = [n for n, c in COMMANDS.items() if c.core and n not in timed]
    if missing:
        raise KeyError(f"core-path commands never timed: {missing}")
    plain = sum(timed[n]["seconds"] for n, c in COMMANDS.items() if c.core and not c.root)
    root = sum(timed[n]["seconds"] for n, c in COMMANDS.items() if c.core and c.root)
    hours = round(((READING_MIN + EXERCISES_MIN) / 60 + (plain + root) / 3600) * 4) / 4
    whole, quarter = int(hours), ("", "¼", "½", "¾")[int(hours * 4) % 4]
    return (
        f"about {whole}{quarter} hours: some {READING_MIN} minutes of reading, "
        f"{EXERCISES_MIN} of exercises, and the commands its pages give, about "
        f"{_duration(plain)} (`make demo`, the four stages' runs, the tests) and "
        f"{_duration(root)} more as root (the three shaped-network checks), as timed on "
        "this project's 2-core machine, not counting the first install of torch"
    )


def bench_rounds_seconds() -> float:
    """The rounds of every benchmark table in docs/results, as each run recorded them
    (`elapsed_s`: rounds only, not the warm-up nor the cluster's setup)."""
    return sum(
        w["settings"]["elapsed_s"]
        for path in sorted(DATA.parent.glob("bench-*.json"))
        for w in json.loads(path.read_text())["workloads"]
    )


def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
