"""Predictions against the virtual cluster: predict a grid of runs, then measure them.

    python -m profiling.simulate validate --quick      # 13 runs, about 3 minutes
    python -m profiling.simulate validate --json docs/results/simulate-validate.json \\
        --markdown docs/results/simulate-validate.md     # the whole grid
    python -m profiling.simulate validate --render docs/results/simulate-validate.json \\
        --markdown docs/results/simulate-validate.md     # the table again, nothing run
    python -m profiling.simulate validate --render docs/results/simulate-validate.json \\
        --known-compute     # and each run again with the compute measured (after the fact)

In order, for every (rate, world size) of the grid and every model: calibrate that
model on a fresh cluster (`calibrate`: the all-reduce cost, whether two collectives
overlap, the model's compute and its slowdown under communication, and what each stage
of its runs takes beyond the compute with nothing communicated); then predict its
runs there and print the predictions; only then measure them, with one
`profiling.bench` invocation: every stage at every bucket cap interleaved in the same
rounds (`--variants compute_only,naive,bucketed,overlapped,drop_in --sweep
bucket_cap_mb=...`). Each model is calibrated just before its own runs are measured,
not every cluster first, nor both models of a cluster together: on a shared machine
the compute's pace drifts over minutes (a first calibration on an idle machine once
timed the CNN's compute 15% faster than every measurement after), and a model
benchmarked second would be predicted from a compute timed minutes before.
The table compares each run's predicted step with its measured median; the last line
sums it up:

    prediction error: median M%, worst W% over N runs; best bucket within one grid step: yes|no

A run is a (model, rate, world size, stage, bucket cap). naive has no buckets: the
benchmark builds it once per cap anyway, and its copies, the same run interleaved in the
same rounds, are pooled into one. compute_only is shown against the calibrated compute,
as a check of the compute input, and is not counted.

What each stage is, for the model (see `layout`): naive, one blocking all-reduce per
parameter after backward, in parameter order; bucketed, one blocking all-reduce per
bucket after backward, buckets in reverse parameter order; overlapped, the same buckets
launched asynchronously from backward as they fill, in bucket order; drop_in, buckets
rebuilt in the order gradients became ready (after the benchmark's warm-up steps) and,
with an explicit bucket_cap_mb as here, no smaller first bucket.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import combinations
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for the hints: the command's parser imports this module
    from profiling.simulate.calibrate import Calibration
    from profiling.simulate.schedule import StageSchedule, Workload

# What the grid measures. The MLP is sized so that communication (16 MiB of gradients,
# about 140 ms at 1 Gbit/s on 2 ranks) outweighs its compute at 1 Gbit/s and not at
# 4 Gbit/s; the CNN's 0.5 MiB of gradients in 17 small tensors leaves it compute-bound
# everywhere. Caps run from one parameter per bucket to one bucket; for the MLP, whose
# weights are 4 MiB each, 5 and 10 MiB make 4 and 2 buckets, for the CNN 0.1 and 0.3
# MiB make 8 and 3.
MODELS = {
    "mlp": {"model": "mlp", "width": 1024, "depth": 5, "batch_size": 256},
    "cnn": {"model": "cnn", "batch_size": 8},
}
CAPS_MB = {"mlp": (1e-6, 5.0, 10.0, 1e6), "cnn": (1e-6, 0.1, 0.3, 1e6)}
RATES = ("1gbit", "4gbit")
WORLD_SIZES = (2, 4)
QUICK = {"models": ("mlp",), "rates": ("1gbit",), "world_sizes": (2,)}
STAGES = ("naive", "bucketed", "overlapped", "drop_in")
BUCKETED_STAGES = STAGES[1:]
FLOOR = "compute_only"
BENCH_ROUNDS, BENCH_STEPS, BENCH_WARMUP = 7, 3, 2
TIE_PCT = 1.0  # two predicted steps this close: the model does not tell them apart


@dataclass(frozen=True, order=True)
class Run:
    model: str
    rate: str
    world_size: int
    stage: str
    cap_mb: float | None  # None: naive (no buckets) and compute_only

    @property
    def group(self) -> tuple[str, str, int]:
        return self.model, self.rate, self.world_size

    @property
    def label(self) -> str:
        cap = "" if self.cap_mb is None else f" cap {self.cap_mb:g}"
        return f"{self.model} {self.rate} x{self.world_size} {self.stage}{cap}"

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "rate": self.rate,
            "world_size": self.world_size,
            "stage": self.stage,
            "cap_mb": self.cap_mb,
        }

    @classmethod
    def from_json(cls, p: dict) -> Run:
        """A run from its fields in a dict that may hold more (a prediction, a step)."""
        return cls(p["model"], p["rate"], p["world_size"], p["stage"], p["cap_mb"])

    @property
    def table_order(self) -> tuple:
        """Where the run goes in the tables: by model, cluster, stage, then cap."""
        return (
            self.model,
            self.rate,
            self.world_size,
            (FLOOR, *STAGES).index(self.stage),
            (self.cap_mb or 0.0),
        )


def grid(models: Sequence[str], rates: Sequence[str], world_sizes: Sequence[int]) -> list[Run]:
    """Every run, grouped by (model, rate, world size) as the benchmark measures them."""
    runs = []
    for model in models:
        for rate in rates:
            for world in world_sizes:
                runs.append(Run(model, rate, world, "naive", None))
                runs += [
                    Run(model, rate, world, stage, cap)
                    for stage in BUCKETED_STAGES
                    for cap in CAPS_MB[model]
                ]
    return runs


# - prediction --------------------------------------------------------------------------


# --8<-- [start:layout]
def asynchronous_schedule(calibration: Calibration) -> StageSchedule:
    """The schedule of a stage that launches its buckets as they fill (overlapped,
    drop_in, and torch's DDP alike): one lane, the calibration's busy launch, and each
    gradient copied into its bucket and the average back (the benchmark leaves
    gradient_as_bucket_view off)."""
    from profiling.simulate.schedule import StageSchedule

    copy = calibration.copy_s_per_byte
    return StageSchedule(
        overlap=True,
        busy_launch_s=calibration.busy_launch_s,
        copy_in_s_per_byte=copy,
        copy_out_s_per_byte=copy,
    )


def layout(
    stage: str,
    workload: Workload,
    cap_mb: float | None,
    calibration: Calibration,
    own_s: float = 0.0,
) -> tuple[list[list[int]], StageSchedule]:
    """(buckets, StageSchedule) of `stage` at `cap_mb` for this workload, with the
    calibration's busy launch and copies, on one lane: the stages use one process
    group, and the calibration's trickle, run on one, holds what Gloo's second thread
    overlaps in its slowdowns. `own_s`: what the stage's step took beyond the compute
    with no communication (`Calibration.own_s`); what its copies do not account for
    goes to each gradient's hook."""
    buckets, schedule = _layout(stage, workload, cap_mb, calibration)
    # Never below nothing: a stage timed faster than its copies is the machine's noise.
    nbytes = sum(g.nbytes for g in workload.grads)
    copies_s = nbytes * (schedule.copy_in_s_per_byte + schedule.copy_out_s_per_byte)
    own_s_per_grad = max(0.0, own_s - copies_s) / len(workload.grads)
    return buckets, replace(schedule, own_s_per_grad=own_s_per_grad)


def _layout(
    stage: str, workload: Workload, cap_mb: float | None, calibration: Calibration
) -> tuple[list[list[int]], StageSchedule]:
    """`layout` before the stage's own time: its buckets, and its copies as it makes them."""
    from profiling.simulate.layouts import per_parameter, uniform_buckets
    from profiling.simulate.schedule import StageSchedule

    # Every stage with buckets divides each gradient into its bucket and copies the
    # average back (drop_in too: the benchmark leaves gradient_as_bucket_view off);
    # naive all-reduces the gradient itself, then divides it in place.
    copy = calibration.copy_s_per_byte
    copies = {"copy_in_s_per_byte": copy, "copy_out_s_per_byte": copy}
    asynchronous = asynchronous_schedule(calibration)
    if stage == "naive":
        schedule = StageSchedule(overlap=False, copy_out_s_per_byte=copy)
        return per_parameter(workload), schedule
    if stage == "bucketed":
        return uniform_buckets(workload, cap_mb), StageSchedule(overlap=False, **copies)
    if stage == "overlapped":
        return uniform_buckets(workload, cap_mb), asynchronous
    if stage == "drop_in":
        # Rebuilt in ready order; an explicit cap means no smaller first bucket.
        buckets = uniform_buckets(workload, cap_mb, first_bucket_cap_mb=None, ready_order=True)
        return buckets, asynchronous
    raise ValueError(f"no model of stage {stage!r}; pick one of {STAGES}")


# --8<-- [end:layout]


def buffer_broadcast_s(calibration: Calibration, model: str) -> float:
    """broadcast_buffers (torch's default, the drop-in's too): rank 0's buffers before
    each forward, one broadcast per dtype (the CNN's BatchNorm has two; the MLP none).
    As the calibration timed it (`calibrate._broadcast_buffers`), or, in a calibration
    made before it did, costed as an all-reduce of as many bytes: on 4 ranks about ten
    times what the broadcast took, which needs fewer message rounds than the ring
    all-reduce's 2(p - 1)."""
    if model in calibration.broadcast_buffers_s:
        return calibration.broadcast_buffers_s[model]
    return sum(calibration.cost(n).seconds for n in calibration.buffer_bytes[model])


def predict(run: Run, calibration: Calibration) -> dict:
    """The simulated step of `run` under its (rate, world size)'s calibration."""
    import dataclasses

    from profiling.simulate.schedule import simulate

    calibration = calibration.for_model(run.model)
    workload = calibration.workloads[run.model]
    if run.stage == FLOOR:
        return {"predicted_ms": workload.compute_s * 1e3, "buckets": 0}
    if run.stage == "drop_in":
        broadcast_s = buffer_broadcast_s(calibration, run.model)
        # After the last bucket, one blocking all-reduce of the status rows (every rank's
        # row of one int32 per gradient, `stages/missing_grads.py`), before the optimizer.
        status_s = calibration.cost(4 * calibration.world_size * len(workload.grads)).seconds
        workload = dataclasses.replace(
            workload,
            forward_s=workload.forward_s + broadcast_s,
            optimizer_s=workload.optimizer_s + status_s,
        )
    own_s = calibration.own_s(run.model, run.stage, run.cap_mb)
    buckets, schedule = layout(run.stage, workload, run.cap_mb, calibration, own_s)
    step = simulate(
        workload, buckets, calibration.cost, schedule, **calibration.contention(run.model)
    )
    return {
        "predicted_ms": step.step_s * 1e3,
        "compute_ms": step.compute_s * 1e3,
        "exposed_comm_ms": step.exposed_comm_s * 1e3,
        "buckets": len(buckets),
    }


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
    step against the cap with the lowest measured one, as positions in the grid's caps;
    within one grid step if they are at most one position apart."""
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
                "ok": steps <= 1,
                # Whether the measured steps at the two caps differ by more than the noise:
                # a miss between two caps the rounds cannot tell apart is a miss of the noise.
                "beyond_noise": _beyond_noise(at_p, at_m),
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


def summary_line(analysis: dict) -> str:
    """The last line the command prints (its format is an interface: see the docs)."""
    if not analysis["runs"]:
        return "prediction error: no run measured; best bucket within one grid step: no"
    return (
        f"prediction error: median {analysis['median_error_pct']:.1f}%, "
        f"worst {analysis['worst_error_pct']:.1f}% over {analysis['runs']} runs; "
        f"best bucket within one grid step: {'yes' if analysis['best_bucket_ok'] else 'no'}"
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


def with_compute_ms(calibration: Calibration, model: str, compute_ms: float) -> Calibration:
    """`calibration` with `model`'s compute scaled to take `compute_ms` a step: forward,
    backward, the optimizer and every gradient's ready time, all by one ratio."""
    w = calibration.workloads[model]
    k = compute_ms / (w.compute_s * 1e3)
    scaled = replace(
        w,
        grads=tuple(replace(g, ready_s=g.ready_s * k) for g in w.grads),
        forward_s=w.forward_s * k,
        backward_s=w.backward_s * k,
        optimizer_s=w.optimizer_s * k,
    )
    return replace(calibration, workloads={**calibration.workloads, model: scaled})


def known_compute(data: dict, measured: dict[Run, Measured]) -> dict[Run, float]:
    """Every measured run predicted again, after its measurement, by the same model from
    the same calibration, but with the compute that compute_only measured in the same
    rounds: a diagnostic, not a prediction. What error is left is not the compute's
    input (calibrated minutes before the benchmark) but the rest: communication, and how
    the two mix."""
    from profiling.simulate.calibrate import Calibration

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


def calibration_for(calibrations: list[dict], rate: str, world_size: int, model: str) -> dict:
    """The calibration that `model`'s runs at (rate, world size) were predicted from: one
    per cluster and model (each made just before that model's benchmark), or, in runs
    kept from before, one per cluster holding every model. KeyError if there is none."""
    for c in calibrations:
        if (c["rate"], c["world_size"]) == (rate, world_size) and model in c["models"]:
            return c
    have = sorted(
        {f"{m} {c['rate']} x{c['world_size']}" for c in calibrations for m in c["models"]}
    )
    raise KeyError(f"no calibration of {model} at {rate} on {world_size} ranks (there are {have})")


def refitted(data: dict) -> dict:
    """`data` (a kept validation) with every calibration fitted again from its own
    measurements by the code as it is now (`calibrate.refit`), and every kept run
    predicted again from it; the measurements as they were. Predicted after the fact:
    a check of a change to the fit against runs already measured, not a validation."""
    from profiling.simulate.calibrate import Calibration, refit

    calibrations = [refit(c) for c in data["calibrations"]]
    built = {id(c): Calibration.from_json(c) for c in calibrations}  # once each
    predictions = []
    for p in data["predictions"]:
        run = Run.from_json(p)
        c = calibration_for(calibrations, run.rate, run.world_size, run.model)
        predictions.append({**run.to_json(), **predict(run, built[id(c)])})
    return {**data, "calibrations": calibrations, "predictions": predictions}


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


# - output ------------------------------------------------------------------------------


def text_table(analysis: dict) -> str:
    lines = [f"{'run':<40} {'predicted ms':>12} {'measured ms':>12} {'noise %':>8} {'error %':>8}"]
    for r in analysis["rows"]:
        measured = "-" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}"
        noise = "-" if r["noise_pct"] is None else f"{r['noise_pct']:.0f}"
        error = "-" if r["error_pct"] is None else f"{r['error_pct']:.1f}"
        note = "" if r["counted"] or r["measured_ms"] is None else "  (not counted)"
        lines.append(
            f"{r['run']:<40} {r['predicted_ms']:>12.1f} {measured:>12} {noise:>8} {error:>8}{note}"
        )
    return "\n".join(lines)


def markdown(data: dict) -> str:
    """The fragment the simulator's page includes: how it was made, the calibration,
    the table, the two checks and the summary line."""
    from profiling.report import markdown_table, produced_by

    a = data["analysis"]
    parts = [
        produced_by([data["command"]], ", from the repository root, as root (namespaces)"),
        "",
        f"{a['runs']} runs; {data['machine']['usable_cores']} cores "
        f"({data['machine']['cpu']}), torch {data['machine']['torch']}; benchmark "
        f"{BENCH_ROUNDS} rounds x {BENCH_STEPS} timed steps per variant; "
        f"{data['elapsed_s']['total']:.0f} s in all ({data['elapsed_s']['calibration']:.0f} s "
        f"calibrating, {data['elapsed_s']['benchmark']:.0f} s measuring); "
        f"{data['machine']['date_utc']} UTC.",
        "",
        "**Calibration**, measured on each cluster just before its runs:"
        if any(len(c["models"]) > 1 for c in data["calibrations"])
        else "**Calibration**, measured for each model on each cluster just before its runs:",
        "",
    ]
    cal_rows = []
    for c in data["calibrations"]:
        f = c["fit"]
        small = min(c["concurrency"], key=lambda x: x["size_bytes"])
        for key, m in c["models"].items():
            w = m["workload"]
            cal_rows.append(
                [
                    f"{c['rate']} x{c['world_size']}",
                    key,
                    f"{f['alpha_s'] * 1e6:.0f} / {1 / f['beta_s_per_byte'] / 1e6:.0f} / "
                    f"{f['gamma'] * 1e9:.2f} / {f['free_bytes'] // 1024}",
                    f"{f['held_out']['median_pct']:.0f}%",
                    f"{small['one_s'] * 1e3:.2f} / {small['two_s'] * 1e3:.2f} → "
                    f"{c['lanes']} / {c.get('busy_launch_s', 0) * 1e3:.2f}",
                    f"{c.get('call_s', 0) * 1e3:.2f}"
                    + (f"; after backward {m['call_s'] * 1e3:.2f}" if "call_s" in m else ""),
                    f"{w['forward_s'] * 1e3:.1f} / {w['backward_s'] * 1e3:.1f} / "
                    f"{w['optimizer_s'] * 1e3:.1f}"
                    + (
                        f"; {m['broadcast_buffers_s'] * 1e3:.2f}"
                        if m.get("broadcast_buffers_s")
                        else ""
                    ),
                    f"{m['slowdown']:+.2f} / {m.get('comm_slowdown', 0):+.2f}"
                    + (
                        f"; {c['latency_slowdown']:+.2f} / {c['comm_latency_slowdown']:+.2f}"
                        if "latency_slowdown" in c
                        else ""
                    )
                    + (
                        f"; the model's own {m['latency_slowdown']:+.2f} / "
                        f"{m['comm_latency_slowdown']:+.2f}"
                        if "latency_slowdown" in m
                        else ""
                    ),
                    f"{c.get('copy_s_per_byte', 0) * 2**20 * 1e3:.2f}"
                    + (
                        f"; after backward {m['copy_s_per_byte'] * 2**20 * 1e3:.2f}"
                        if "copy_s_per_byte" in m
                        else ""
                    ),
                    f"{c['load_average_before'][0]:.1f}",
                ]
            )
    parts.append(
        markdown_table(
            [
                "cluster",
                "model",
                "α µs / 1/β MB/s / γ ns/B / free KiB",
                "held-out error",
                "one / two 4 KiB all-reduces ms → lanes / busy launch ms",
                "in a sequence, per call +ms; the model's own",
                "forward / backward / optimizer ms; buffers' broadcast",
                "slowdown of compute / of communication; with small all-reduces; the model's own",
                "copy ms/MiB, 4 MiB in cache; the model's own",
                "load",
            ],
            cal_rows,
            left=2,
        )
    )
    parts += _own_steps_table(data["calibrations"])
    parts += ["", "**Predicted against measured** (noise: the spread of the round medians):", ""]
    body = []
    for r in a["rows"]:
        body.append(
            [
                r["run"] + ("" if r["counted"] else " (not counted)"),
                f"{r['predicted_ms']:.1f}",
                "-" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}",
                "-" if r["noise_pct"] is None else f"{r['noise_pct']:.0f}%",
                "-" if r["error_pct"] is None else f"{r['error_pct']:.1f}%",
            ]
        )
    parts.append(markdown_table(["run", "predicted ms", "measured ms", "noise", "error"], body))
    parts += ["", "**Best bucket cap**, predicted against measured:", ""]
    parts.append(
        markdown_table(
            [
                "model, cluster",
                "stage",
                "predicted best MiB",
                "measured best MiB",
                "grid steps apart",
                "measured steps at the two differ beyond noise",
            ],
            [
                [
                    f"{b['model']} {b['rate']} x{b['world_size']}",
                    b["stage"],
                    f"{b['predicted_best_mb']:g}",
                    f"{b['measured_best_mb']:g}",
                    f"{b['grid_steps']}" + ("" if b["ok"] else " (missed)"),
                    "yes" if b["beyond_noise"] else "no",
                ]
                for b in a["best_bucket"]
            ],
            left=2,
        )
    )
    parts += ["", "**Stages that differ by more than the noise**, measured and predicted:", ""]
    if a["ranking"]:
        parts.append(
            markdown_table(
                ["pair", "measured ratio per round", "faster, measured", "faster, predicted"],
                [
                    [
                        f"{r['a']} / {r['b']}",
                        f"{r['ratio_min']:.2f}–{r['ratio_max']:.2f}",
                        r["measured_faster"],
                        r["predicted_faster"]
                        + ("" if r["ok"] else " (wrong)")
                        + (f", by {r['predicted_gap_pct']:.1f}%"),
                    ]
                    for r in a["ranking"]
                ],
            )
        )
    else:
        parts.append("None: every pair's per-round ratio straddles 1.")
    parts += ["", ranking_line(a), "", "`" + summary_line(a) + "`", ""]
    return "\n".join(parts)


# - the command -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the MLP at 1gbit on 2 ranks: 13 runs in about 3 minutes",
    )
    parser.add_argument("--json", help="write calibration, predictions, measurements here")
    parser.add_argument("--markdown", help="write the table as a fragment for the docs")
    parser.add_argument(
        "--render", metavar="JSON", help="run nothing: the table and --markdown from this JSON"
    )
    parser.add_argument(
        "--known-compute",
        action="store_true",
        help="also predict every run again with compute_only's measured step as the compute "
        "(after the fact): how much of the error is the compute's input",
    )
    parser.add_argument(
        "--refit",
        action="store_true",
        help="with --render: fit the kept calibrations' measurements again with the code as "
        "it is now, and predict the kept runs from them: what a change to the fit would have "
        "predicted",
    )


def run(args: argparse.Namespace) -> None:
    if args.render:
        from profiling.report import read_json

        data = read_json(args.render, "profiling.simulate validate", "predictions")
        return _report(refitted(data) if getattr(args, "refit", False) else data, args)
    if getattr(args, "refit", False):
        raise SystemExit("profiling.simulate validate: --refit needs --render JSON")
    import tempfile
    from pathlib import Path

    from ddp.config import Config
    from profiling.report import command_line, load_average, machine, write_json
    from profiling.simulate.calibrate import Calibration, calibrate

    spec = (
        QUICK
        if args.quick
        else {"models": tuple(MODELS), "rates": RATES, "world_sizes": WORLD_SIZES}
    )
    runs = grid(spec["models"], spec["rates"], spec["world_sizes"])
    started = time.perf_counter()
    data = {
        "command": command_line("profiling.simulate", sys.argv[1:]),
        "grid": {
            **spec,
            "caps_mb": {m: CAPS_MB[m] for m in spec["models"]},
            "models_config": {m: MODELS[m] for m in spec["models"]},
        },
        "load_average_before": load_average(),
    }

    data["calibrations"], data["predictions"], data["bench"] = [], [], []
    configs = {m: Config(**MODELS[m]) for m in spec["models"]}
    calibrating_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for rate in spec["rates"]:
            for world in spec["world_sizes"]:
                for model in sorted(spec["models"]):
                    # 1. Calibrate this cluster for this model, just before its runs.
                    print(f"calibrating {model} at {rate} on {world} ranks ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    t0 = time.perf_counter()
                    cfg = {model: configs[model]}
                    mine = [r for r in runs if r.group == (model, rate, world)]
                    # and every stage's step of its runs with no communication
                    layouts = {model: [(r.stage, r.cap_mb) for r in mine]}
                    calibrated = _twice(calibrate, rate, world, cfg, layouts=layouts)
                    data["calibrations"].append(calibrated)
                    calibrating_s += time.perf_counter() - t0
                    calibration = Calibration.from_json(data["calibrations"][-1])

                    # 2. Predict its runs, and show the predictions before any is measured.
                    predictions = [
                        {**r.to_json(), **predict(r, calibration)}
                        for r in sorted(
                            [Run(model, rate, world, FLOOR, None), *mine],
                            key=lambda r: r.table_order,
                        )
                    ]
                    print(f"predicted step times of {model} at {rate} on {world} ranks, "
                          "before measuring:")  # fmt: skip
                    for p in predictions:
                        print(f"  {Run.from_json(p).label:<40} {p['predicted_ms']:8.1f} ms")
                    sys.stdout.flush()
                    data["predictions"] += predictions
                    if args.json:  # kept as it grows: a later failure leaves what was done
                        write_json(args.json, data)

                    # 3. Measure: one benchmark, all its runs interleaved.
                    path = str(Path(tmp) / f"{model}-{rate}-{world}.json")
                    command = bench_command(model, rate, world, path)
                    print(f"measuring {model} at {rate} on {world} ranks ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    data["bench"] += _twice(_bench, command, path)
                    if args.json:
                        write_json(args.json, data)
    data["predictions"].sort(key=lambda p: Run.from_json(p).table_order)
    finished = time.perf_counter()
    data["machine"] = machine()
    data["elapsed_s"] = {
        "calibration": calibrating_s,
        "benchmark": finished - started - calibrating_s,
        "total": finished - started,
    }
    _report(data, args)


def _bench(command: list[str], path: str) -> list[dict]:
    import subprocess
    from pathlib import Path

    code = subprocess.run(command).returncode
    if code != 0:
        raise SystemExit(
            f"profiling.simulate: the benchmark failed (exit {code}): {' '.join(command)}"
        )
    return json.loads(Path(path).read_text())["workloads"]


def _own_steps_table(calibrations: list[dict]) -> list[str]:
    """The markdown lines of each stage's own time as the calibrations timed it (none
    for calibrations made before it was): ms beyond the compute, by cap."""
    from profiling.report import markdown_table

    rows = []
    for c in calibrations:
        for key, m in c["models"].items():
            if "own_steps" not in m:
                continue
            by_stage: dict[str, list[str]] = {}
            for stage, _cap, _, extra_s in m["own_steps"]["layouts"]:
                by_stage.setdefault(stage, []).append(f"{extra_s * 1e3:+.1f}")
            rows.append(
                [f"{c['rate']} x{c['world_size']}", key, f"{m['own_steps']['compute_s'] * 1e3:.1f}"]
                + [" / ".join(by_stage.get(stage, ["-"])) for stage in STAGES]
            )
    if not rows:
        return []
    caps = "; ".join(f"{model} {' / '.join(f'{c:g}' for c in CAPS_MB[model])}" for model in CAPS_MB)
    return [
        "",
        "**Each stage's own time**, ms beyond the compute alone with nothing communicated "
        f"(`calibrate._own_steps`), at each cap in turn (MiB: {caps}); the model adds what "
        "the copies leave of it:",
        "",
        markdown_table(["cluster", "model", "compute alone ms", *STAGES], rows, left=2),
    ]


def _twice(measure, *args, **kwargs):
    """`measure(*args, **kwargs)`, and once more if it fails: on a machine shared with
    others' jobs, a cluster's run now and then dies of something not its own (a node
    killed from outside). A second failure stops the command."""
    try:
        return measure(*args, **kwargs)
    except SystemExit as failure:
        print(f"{failure}; trying once more", file=sys.stderr, flush=True)
        return measure(*args, **kwargs)


def _report(data: dict, args: argparse.Namespace) -> None:
    """Analyse, print the table, write --json and --markdown; the summary line last."""
    from profiling.report import write_json

    predicted = {Run.from_json(p): p["predicted_ms"] for p in data["predictions"]}
    measured = measurements(data["bench"])
    data["analysis"] = analyse(predicted, measured)
    print(text_table(data["analysis"]))
    for b in data["analysis"]["best_bucket"]:
        same = b["predicted_best_mb"] == b["measured_best_mb"]
        print(
            f"best cap {b['model']} {b['rate']} x{b['world_size']} {b['stage']}: predicted "
            f"{b['predicted_best_mb']:g}, measured {b['measured_best_mb']:g} MiB"
            + ("" if b["ok"] else " (more than one grid step apart)")
            + ("" if same or b["beyond_noise"] else "; measured, the two are within the noise")
        )
    for r in data["analysis"]["ranking"]:
        if not r["ok"]:
            print(
                f"ranked differently: {r['a']} / {r['b']}, measured {r['ratio_min']:.2f}-"
                f"{r['ratio_max']:.2f} per round; predicted faster: {r['predicted_faster']}"
            )
    if "elapsed_s" in data:
        e = data["elapsed_s"]
        print(
            f"took {e['total']:.0f} s ({e['calibration']:.0f} s calibrating, "
            f"{e['benchmark']:.0f} s measuring)"
        )
    if args.json and not args.render:
        write_json(args.json, data)
    if args.markdown:
        open(args.markdown, "w").write(markdown(data))
    if getattr(args, "known_compute", False):  # a Namespace built by hand may lack it
        print("\n".join(known_compute_lines(data, measured)))
    print(ranking_line(data["analysis"]))
    print(summary_line(data["analysis"]))
