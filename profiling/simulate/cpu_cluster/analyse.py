"""The runs measured, and the predictions against them: the benchmark that measures one
cluster's runs, its records read back as each run's steps, the error of each
prediction, the two checks (the best bucket cap, the stages' ranking), the lines that
sum them up, and the runs predicted again with the compute measured.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass
from itertools import combinations

from profiling.simulate.cpu_cluster.calibration import Calibration
from profiling.simulate.cpu_cluster.predict import (
    BUCKETED_STAGES,
    CAPS_MB,
    FLOOR,
    MODELS,
    STAGES,
    Run,
    predict,
    with_compute_ms,
)

BENCH_ROUNDS, BENCH_STEPS, BENCH_WARMUP = 7, 3, 2
TIE_PCT = 1.0  # two predicted steps this close: the model does not tell them apart


# - measurement -------------------------------------------------------------------------


def bench_command(model: str, rate: str, world_size: int, json_path: str) -> list[str]:
    cfg = MODELS[model]
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]
    caps = ",".join(f"{c:g}" for c in CAPS_MB[model])
    return [
        sys.executable,
        "-m",
        "profiling.bench",
        "--nproc",
        str(world_size),
        "--network",
        rate,
        *shape,
        "--variants",
        ",".join((FLOOR, *STAGES)),
        "--sweep",
        f"bucket_cap_mb={caps}",
        "--rounds",
        str(BENCH_ROUNDS),
        "--steps",
        str(BENCH_STEPS),
        "--warmup-steps",
        str(BENCH_WARMUP),
        "--json",
        json_path,
    ]


@dataclass(frozen=True)
class Measured:
    median_ms: float  # over every timed step (the slowest rank's)
    round_ms: dict[int, float]  # round -> the median of its steps

    @property
    def noise_pct(self) -> float:
        """The spread of the round medians, as a share of the median: the bench's
        per-round range."""
        rounds = list(self.round_ms.values())
        return (max(rounds) - min(rounds)) / self.median_ms * 100


def measurements(records: list[dict]) -> dict[Run, Measured]:
    """Each run's steps from benchmark records (as `profiling.bench --json` writes them):
    round k holds timed steps k*S .. k*S + S - 1 of a variant (S steps per round)."""
    out: dict[Run, list[tuple[int, float]]] = {}
    for record in records:
        s = record["settings"]
        model = next(k for k, m in MODELS.items() if m["model"] == s["model"])
        rate = s["network"]["rate"].split()[0]
        for v in record["variants"]:
            if v["name"] not in (FLOOR, *STAGES):
                continue
            cap = None if v["name"] in ("naive", FLOOR) else _on_grid(model, v["sweep_value"])
            run = Run(model, rate, s["world_size"], v["name"], cap)
            steps = s["steps_per_round"]
            out.setdefault(run, []).extend(
                (i // steps, t) for i, t in enumerate(v["step_times_ms"])
            )  # naive's copies, one per cap, pool into one run
    return {run: _measured(steps) for run, steps in out.items()}


def _measured(steps: list[tuple[int, float]]) -> Measured:
    """(round, ms) of every timed step -> the median and each round's median."""
    rounds = sorted({k for k, _ in steps})
    return Measured(
        statistics.median(t for _, t in steps),
        {k: statistics.median(t for r, t in steps if r == k) for k in rounds},
    )


def _on_grid(model: str, cap: float) -> float:
    """The grid's cap that the benchmark's sweep value stands for."""
    return min(CAPS_MB[model], key=lambda c: abs(math.log(c / cap)))


# - analysis ----------------------------------------------------------------------------


def error_pct(predicted_ms: float, measured_ms: float) -> float:
    return abs(predicted_ms / measured_ms - 1) * 100


def bucketed_caps(measured: dict[Run, Measured]) -> dict[tuple, list[float]]:
    """Per ((model, rate, world size), stage with buckets): the caps measured, in the
    grid's order."""
    groups = sorted({(r.group, r.stage) for r in measured if r.cap_mb is not None})
    return {
        (group, stage): [c for c in CAPS_MB[group[0]] if Run(*group, stage, c) in measured]
        for group, stage in groups
    }


def best_bucket(predicted: dict[Run, float], measured: dict[Run, Measured]) -> list[dict]:
    """Per (model, rate, world size, bucketed stage): the cap with the lowest predicted
    step against the cap with the lowest measured one. The check: the cap the model
    picks measures within the noise of the fastest (`_beyond_noise`: not faster or
    slower in every round). Counting grid steps between the two is no check: caps a
    few steps apart often build layouts whose steps the rounds cannot tell apart."""
    out = []
    for (group, stage), caps in bucketed_caps(measured).items():
        if len(caps) < 2 or any(Run(*group, stage, c) not in predicted for c in caps):
            continue
        best_p = min(caps, key=lambda c: predicted[Run(*group, stage, c)])
        best_m = min(caps, key=lambda c: measured[Run(*group, stage, c)].median_ms)
        steps = abs(caps.index(best_p) - caps.index(best_m))
        at_p, at_m = measured[Run(*group, stage, best_p)], measured[Run(*group, stage, best_m)]
        out.append(
            {
                "model": group[0],
                "rate": group[1],
                "world_size": group[2],
                "stage": stage,
                "predicted_best_mb": best_p,
                "measured_best_mb": best_m,
                "grid_steps": steps,
                # The measured steps at the two caps differ by more than the noise: only
                # then did the model pick a cap that measured slower than the fastest.
                "beyond_noise": _beyond_noise(at_p, at_m),
                "ok": not _beyond_noise(at_p, at_m),
            }
        )
    return out


def ranking(predicted: dict[Run, float], measured: dict[Run, Measured]) -> list[dict]:
    """Every pair of stages at the same cap (naive with each) whose measured steps differ
    by more than the noise, with whether the prediction orders them alike. More than the
    noise: in every round that both ran, the same one was faster (the paired per-round
    ratio's whole range on one side of 1)."""
    out = []
    settings = sorted({(r.group, r.cap_mb) for r in measured if r.cap_mb is not None})
    for group, cap in settings:
        runs = [Run(*group, "naive", None)] + [Run(*group, s, cap) for s in BUCKETED_STAGES]
        runs = [r for r in runs if r in measured and r in predicted]
        for a, b in combinations(runs, 2):
            ratios = _round_ratios(measured[a], measured[b])
            if not _beyond_noise(measured[a], measured[b]):
                continue
            faster_measured = a if max(ratios) < 1 else b
            faster_predicted = a if predicted[a] < predicted[b] else b
            out.append(
                {
                    "a": a.label,
                    "b": b.label,
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "measured_faster": faster_measured.label,
                    "predicted_faster": faster_predicted.label,
                    # How far apart the model puts them: a pair it predicts within
                    # TIE_PCT is one it has nothing to tell apart (a term it leaves out).
                    "predicted_gap_pct": abs(predicted[a] / predicted[b] - 1) * 100,
                    "ok": faster_measured == faster_predicted,
                }
            )
    return out


def _round_ratios(a: Measured, b: Measured) -> list[float]:
    """a's round median over b's, in every round both ran: paired, so a slow spell of
    the machine falls on both sides."""
    return [a.round_ms[k] / b.round_ms[k] for k in sorted(a.round_ms.keys() & b.round_ms.keys())]


def _beyond_noise(a: Measured, b: Measured) -> bool:
    """In every round, the same one of the two was faster."""
    ratios = _round_ratios(a, b)
    return bool(ratios) and (max(ratios) < 1 or min(ratios) > 1)


def analyse(predicted: dict[Run, float], measured: dict[Run, Measured]) -> dict:
    """The table's rows, the error summary, the best-bucket and ranking checks."""
    rows = []
    for run in sorted(predicted, key=lambda r: r.table_order):
        m = measured.get(run)
        rows.append(
            {
                "run": run.label,
                "counted": run.stage != FLOOR and m is not None,
                "predicted_ms": predicted[run],
                "measured_ms": None if m is None else m.median_ms,
                "noise_pct": None if m is None else m.noise_pct,
                "error_pct": None if m is None else error_pct(predicted[run], m.median_ms),
            }
        )
    errors = [r["error_pct"] for r in rows if r["counted"]]
    buckets = best_bucket(predicted, measured)
    ranks = ranking(predicted, measured)
    return {
        "rows": rows,
        "runs": len(errors),
        "median_error_pct": statistics.median(errors) if errors else None,
        "worst_error_pct": max(errors) if errors else None,
        "best_bucket": buckets,
        "best_bucket_ok": bool(buckets) and all(b["ok"] for b in buckets),
        "ranking": ranks,
        "ranking_ok": all(r["ok"] for r in ranks),
    }


BEST_BUCKET = "best bucket within the noise of the fastest"


def summary_line(analysis: dict) -> str:
    """The last line the command prints (its format is an interface: see the docs)."""
    if not analysis["runs"]:
        return f"prediction error: no run measured; {BEST_BUCKET}: no"
    return (
        f"prediction error: median {analysis['median_error_pct']:.1f}%, "
        f"worst {analysis['worst_error_pct']:.1f}% over {analysis['runs']} runs; "
        f"{BEST_BUCKET}: {'yes' if analysis['best_bucket_ok'] else 'no'}"
    )


def ranking_line(analysis: dict) -> str:
    ranks = analysis["ranking"]
    agree = sum(r["ok"] for r in ranks)
    ties = sum(not r["ok"] and r["predicted_gap_pct"] < TIE_PCT for r in ranks)
    return (
        f"stages ranked as measured: {'yes' if analysis['ranking_ok'] else 'no'} "
        f"({agree} of {len(ranks)} pairs that differ by more than the noise"
        + (f"; {ties} of the others predicted within {TIE_PCT:g}% of each other" if ties else "")
        + ")"
    )


# - after the fact: the error with the compute known ------------------------------------


def known_compute(data: dict, measured: dict[Run, Measured]) -> dict[Run, float]:
    """Every measured run predicted again, after its measurement, by the same model from
    the same calibration, but with the compute that compute_only measured in the same
    rounds: a diagnostic, not a prediction. What error is left is not the compute's
    input (calibrated minutes before the benchmark) but the rest: communication, and how
    the two mix."""
    out = {}
    for c in data["calibrations"]:
        calibration = Calibration.from_json(c)
        for model in calibration.workloads:
            floor = Run(model, c["rate"], c["world_size"], FLOOR, None)
            if floor not in measured:
                continue
            known = with_compute_ms(calibration, model, measured[floor].median_ms)
            for p in data["predictions"]:
                run = Run.from_json(p)
                if run.group == floor.group and run.stage != FLOOR and run in measured:
                    out[run] = predict(run, known)["predicted_ms"]
    return out


def known_compute_lines(data: dict, measured: dict[Run, Measured], worst: int = 3) -> list[str]:
    """The summary of `known_compute`, per model, and its worst runs."""
    again = known_compute(data, measured)
    errors = {run: error_pct(p, measured[run].median_ms) for run, p in again.items()}
    if not errors:
        return ["with the compute measured in the same rounds: no run to predict again"]
    lines = []
    for model in sorted({r.model for r in errors}):
        mine = [e for r, e in errors.items() if r.model == model]
        lines.append(
            f"with the compute measured in the same rounds (after the fact), {model}: median "
            f"{statistics.median(mine):.1f}%, worst {max(mine):.1f}% over {len(mine)} runs"
        )
    for run in sorted(errors, key=errors.get, reverse=True)[:worst]:
        lines.append(
            f"  {run.label}: {again[run]:.1f} against {measured[run].median_ms:.1f} ms "
            f"({errors[run]:.1f}%)"
        )
    return lines
