"""The validation's checks with one run's measurement as the prediction of another's.

    python -m profiling.simulate repeat RUN1.json RUN2.json [...] \\
        --json docs/results/simulate-repeat.json --markdown docs/results/simulate-repeat.md
    python -m profiling.simulate repeat --render docs/results/simulate-repeat.json \\
        --markdown docs/results/simulate-repeat.md      # the tables again, nothing read

Each RUN is the JSON of a `validate` run of the same grid. For every ordered pair of
runs (A, B), A's measured medians stand in for the model's predictions and B's
measurement is what they are checked against, with the validation's own `analyse`: the
median and worst error, the best bucket within one grid step, the stages ranked as
measured. This is what one earlier measurement of the same code on the same machine
scores as a prediction of another. It is not a bound on what a model can score (A's
medians carry A's noise as well as B's, and a model of the expected step need not),
but a target that one run's measurement seldom meets against another's is set by the
machine as much as by the model.

The last line sums up the pairs:

    measurement as prediction over P pairs of R runs: median error <= 10% in M, worst
    <= 20% in W (lowest-highest%); best bucket within one grid step everywhere in G,
    within the noise in N; ranked as measured in K

`--json` keeps each run's measured medians and round medians (not its raw steps), which
is all `--render` needs, and each run's CPU as its `machine` record names it: runs whose
CPUs differ are refused, as another machine's measurement predicts a different thing.
"""

from __future__ import annotations

import argparse
import statistics
from itertools import permutations

from profiling.report import read_json
from profiling.simulate.validate import (
    CAPS_MB,
    Measured,
    Run,
    analyse,
    bucketed_caps,
    measurements,
)

COMMAND = "profiling.simulate repeat"
# The validation's targets (docs/simulator.md, "Against the targets").
MEDIAN_BAR_PCT, WORST_BAR_PCT = 10.0, 20.0


def load(path: str) -> dict:
    """One validate JSON -> what this command keeps of it: when it ran, what the model
    predicted then (its own analysis) and each run's measurement."""
    data = read_json(path, COMMAND)
    if "bench" not in data:
        raise SystemExit(f"profiling.simulate repeat: {path} is not a validate run's JSON")
    if "analysis" not in data:  # written as the run goes: a run that stopped has none
        raise SystemExit(
            f"profiling.simulate repeat: {path} has no 'analysis': a validate run that "
            "did not finish?"
        )
    a = data["analysis"]
    measured = measurements(data["bench"])
    machine = data.get("machine", {})
    return {
        "source": path,
        "date_utc": machine.get("date_utc", ""),
        "cpu": machine.get("cpu", ""),
        "model": {
            "median_error_pct": a["median_error_pct"],
            "worst_error_pct": a["worst_error_pct"],
            "best_bucket_ok": a["best_bucket_ok"],
            "ranking_ok": a["ranking_ok"],
        },
        "measured": [
            # To the microsecond: a step is timed no finer than that, and the file stays small.
            {
                **r.to_json(),
                "median_ms": round(m.median_ms, 3),
                "round_ms": {k: round(v, 3) for k, v in m.round_ms.items()},
            }
            for r, m in sorted(measured.items(), key=lambda rm: rm[0].table_order)
        ],
    }


def measured_of(run: dict) -> dict[Run, Measured]:
    """The measurement kept by `load`, back as `validate.measurements` gives it (JSON
    turns the rounds' keys into strings)."""
    return {
        Run.from_json(m): Measured(m["median_ms"], {int(k): v for k, v in m["round_ms"].items()})
        for m in run["measured"]
    }


def pair(a: dict[Run, Measured], b: dict[Run, Measured]) -> dict:
    """a's measured medians as the prediction of b's measurement, checked as `validate`
    checks the model: over the runs both measured."""
    predicted = {r: m.median_ms for r, m in a.items() if r in b}
    checked = analyse(predicted, {r: b[r] for r in predicted})
    errors = [r["error_pct"] for r in checked["rows"] if r["counted"]]
    buckets, ranks = checked["best_bucket"], checked["ranking"]
    return {
        "runs": checked["runs"],
        "median_error_pct": checked["median_error_pct"],
        "worst_error_pct": checked["worst_error_pct"],
        "over_worst_bar": sum(e > WORST_BAR_PCT for e in errors),
        "best_bucket_ok": sum(x["ok"] for x in buckets),
        # The cap a picked measures, in b, within b's noise of b's fastest.
        "best_bucket_within_noise": sum(not x["beyond_noise"] for x in buckets),
        "best_bucket_checked": len(buckets),
        "ranking_ok": sum(x["ok"] for x in ranks),
        "ranking_checked": len(ranks),
    }


def analyse_runs(runs: list[dict]) -> dict:
    """Every ordered pair of runs, and per (model, cluster, stage) the cap measured
    fastest in each run."""
    measured = [measured_of(r) for r in runs]
    pairs = [
        {"predictor": i, "measured": j, **pair(measured[i], measured[j])}
        for i, j in permutations(range(len(runs)), 2)
    ]
    fastest: dict[tuple, list[float]] = {}
    for m in measured:
        for (group, stage), caps in bucketed_caps(m).items():
            best = min(caps, key=lambda c: m[Run(*group, stage, c)].median_ms)
            fastest.setdefault((*group, stage), []).append(best)
    return {
        "pairs": pairs,
        "fastest": [
            {"slice": f"{k[0]} {k[1]} x{k[2]} {k[3]}", "caps_mb": v, "model": k[0]}
            for k, v in sorted(fastest.items())
        ],
    }


def summary_line(data: dict) -> str:
    """The last line the command prints."""
    pairs = data["analysis"]["pairs"]
    n = len(pairs)
    if not n:
        return "measurement as prediction: fewer than two runs, no pair"
    worst = [p["worst_error_pct"] for p in pairs]
    return (
        f"measurement as prediction over {n} pairs of {len(data['runs'])} runs: "
        f"median error <= {MEDIAN_BAR_PCT:g}% in "
        f"{sum(p['median_error_pct'] <= MEDIAN_BAR_PCT for p in pairs)}, "
        f"worst <= {WORST_BAR_PCT:g}% in {sum(w <= WORST_BAR_PCT for w in worst)} "
        f"({min(worst):.1f}-{max(worst):.1f}%); best bucket within one grid step "
        f"everywhere in {sum(_all_buckets(p) for p in pairs)}, within the noise in "
        f"{sum(p['best_bucket_within_noise'] == p['best_bucket_checked'] for p in pairs)}; "
        f"ranked as measured in {sum(p['ranking_ok'] == p['ranking_checked'] for p in pairs)}"
    )


def _all_buckets(p: dict) -> bool:
    """As `validate.analyse`: met where there was a cap to check and every one was."""
    return 0 < p["best_bucket_checked"] == p["best_bucket_ok"]


def _grid_steps(model: str, caps: list[float]) -> int:
    """How many grid positions the caps measured fastest span."""
    positions = [CAPS_MB[model].index(c) for c in caps]
    return max(positions) - min(positions)


def text(data: dict) -> str:
    runs, a = data["runs"], data["analysis"]
    lines = [
        f"{'A predicts B':<14} {'runs':>4} {'median %':>9} {'worst %':>8} {'>20%':>5} "
        f"{'best bucket':>12} {'in noise':>9} {'ranked':>8}"
    ]
    for p in a["pairs"]:
        lines.append(
            f"{p['predictor'] + 1:>4} -> {p['measured'] + 1:<6} {p['runs']:>4} "
            f"{p['median_error_pct']:>9.1f} {p['worst_error_pct']:>8.1f} "
            f"{p['over_worst_bar']:>5} "
            f"{p['best_bucket_ok']:>5} of {p['best_bucket_checked']:<3} "
            f"{p['best_bucket_within_noise']:>3} of {p['best_bucket_checked']:<3} "
            f"{p['ranking_ok']:>3} of {p['ranking_checked']}"
        )
    lines.append("")
    lines.append("cap measured fastest in each run (MiB):")
    for f in a["fastest"]:
        caps = " ".join(f"{c:g}" for c in f["caps_mb"])
        lines.append(f"  {f['slice']:<28} {caps}  ({_grid_steps(f['model'], f['caps_mb'])} apart)")
    lines.append("")
    for i, r in enumerate(runs):
        when = f"{r['date_utc']} UTC" if r["date_utc"] else ""
        cpu = r.get("cpu", "")  # absent where kept before this command recorded it
        lines.append(f"run {i + 1}: {r['source']} ({', '.join(filter(None, [when, cpu]))})")
    return "\n".join(lines)


def markdown(data: dict) -> str:
    """The fragment the simulator's page includes."""
    from profiling.report import markdown_table, produced_by

    runs, a = data["runs"], data["analysis"]
    parts = [produced_by([data["command"]], ", from the repository root"), ""]
    cpus = sorted({r.get("cpu", "") for r in runs} - {""})
    if cpus:  # one, unless a --render'd file was put together by hand
        parts += [f"Machine: {', '.join(cpus)}.", ""]
    parts.append(
        markdown_table(
            ["run", "measured (UTC)", "the model's prediction then: median / worst error"],
            [
                [
                    f"{i + 1}",
                    r["date_utc"],
                    f"{r['model']['median_error_pct']:.1f}% / {r['model']['worst_error_pct']:.1f}%",
                ]
                for i, r in enumerate(runs)
            ],
        )
    )
    parts += ["", "**One run's measurement as the prediction of another's:**", ""]
    parts.append(
        markdown_table(
            [
                "A predicts B",
                "median error",
                "worst error",
                "runs over 20%",
                "best bucket within one grid step",
                "the cap A picks within B's noise of B's fastest",
                "pairs ranked as B measured",
            ],
            [
                [
                    f"{p['predictor'] + 1} → {p['measured'] + 1}",
                    f"{p['median_error_pct']:.1f}%",
                    f"{p['worst_error_pct']:.1f}%",
                    f"{p['over_worst_bar']}",
                    f"{p['best_bucket_ok']} of {p['best_bucket_checked']}",
                    f"{p['best_bucket_within_noise']} of {p['best_bucket_checked']}",
                    f"{p['ranking_ok']} of {p['ranking_checked']}",
                ]
                for p in a["pairs"]
            ],
            left=1,
        )
    )
    parts += ["", "**The cap measured fastest**, run by run:", ""]
    parts.append(
        markdown_table(
            ["model, cluster, stage", "MiB, runs 1 to " + str(len(runs)), "grid steps spanned"],
            [
                [
                    f["slice"],
                    ", ".join(f"{c:g}" for c in f["caps_mb"]),
                    f"{_grid_steps(f['model'], f['caps_mb'])}",
                ]
                for f in a["fastest"]
            ],
            left=2,
        )
    )
    parts += ["", "`" + summary_line(data) + "`", ""]
    return "\n".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="*", metavar="RUN.json", help="validate runs' JSON")
    parser.add_argument("--json", help="write each run's measured medians and the pairs here")
    parser.add_argument("--markdown", help="write the tables as a fragment for the docs")
    parser.add_argument(
        "--render", metavar="JSON", help="read nothing else: the tables from this --json"
    )


def run(args: argparse.Namespace) -> None:
    from profiling.report import command_line, write_json

    if args.render:
        if args.runs or args.json:
            raise SystemExit(
                "profiling.simulate repeat: --render reads its JSON; give no runs or --json"
            )
        data = read_json(args.render, COMMAND)
        if "runs" not in data or "analysis" not in data:
            raise SystemExit(
                f"profiling.simulate repeat: {args.render} is not this command's --json"
            )
    else:
        if len(args.runs) < 2:
            raise SystemExit(
                "profiling.simulate repeat: needs at least two validate runs' JSON, "
                f"got {len(args.runs)}"
            )
        runs = [load(p) for p in args.runs]
        grids = {tuple(sorted(Run.from_json(m).label for m in r["measured"])) for r in runs}
        if len(grids) > 1:
            raise SystemExit(
                "profiling.simulate repeat: the runs measured different grids; "
                "compare runs of the same validate command"
            )
        # Another machine's measurement predicts a different thing: on a 2-core AMD
        # EPYC the same grid's steps took 1.06 to 2.1 times as long as in one run on a
        # 2-core Intel Xeon, grid point by grid point. A run with no CPU recorded
        # passes: nothing says it differs.
        cpus = {r["cpu"] for r in runs if r["cpu"]}
        if len(cpus) > 1:
            where = "; ".join(f"{r['source']}: {r['cpu'] or '(unknown)'}" for r in runs)
            raise SystemExit(
                "profiling.simulate repeat: the runs were measured on different CPUs "
                f"({where}); compare runs of one machine"
            )
        argv = ["repeat", *args.runs]
        argv += ["--json", args.json] if args.json else []
        argv += ["--markdown", args.markdown] if args.markdown else []
        data = {"command": command_line("profiling.simulate", argv), "runs": runs}
        data["analysis"] = analyse_runs(runs)
        if any(p["runs"] == 0 for p in data["analysis"]["pairs"]):
            raise SystemExit(
                "profiling.simulate repeat: a run measured nothing to compare (an empty 'bench')"
            )
        if args.json:
            write_json(args.json, data)
    print(text(data))
    if args.markdown:
        open(args.markdown, "w").write(markdown(data))
    worst = [p["worst_error_pct"] for p in data["analysis"]["pairs"]]
    if worst:
        print(f"worst error over the pairs: median {statistics.median(worst):.1f}%")
    print(summary_line(data))
