"""The fitted loss (`profiling.simulate.accuracy`) validated on rows it was not fitted on.

    python -m profiling.simulate accuracy          # the tables, printed (under a minute)
    python -m profiling.simulate accuracy --docs   # and docs/results/accuracy.md

- **Leave one series out.** Each series of published efficiencies (each of the four
  models of torch's DDP benchmark at 2 to 16 GPUs; Goyal et al.'s E(256) against 8) is
  predicted by the loss fitted on the other series only, and its range comes from
  those others alone: each of them predicted by a fit on the rest of them, published
  minus prediction, least to most. Li et al.'s overlap speed-ups are shown with the
  loss fitted on every efficiency; they are speed-ups, not efficiencies, so the range
  does not apply and they are not counted.
- **Measure small, predict large**, as `scale --measured` does: each model of the
  benchmark fitted on its own 1 (without DDP), 2, 4 and 8 GPUs, then E(16) predicted;
  its margin from the other three models' misses. Goyal et al. publish one count's
  time only relative to another, so a user measuring 8 GPUs has nothing to fit: their
  row keeps the loss fitted without them.

Then the record the core holds (`accuracy.FITTED`, `RECORD`, `MEASURED_MARGIN`)
recomputed from the same rows; tests/test_simulate_accuracy.py checks they are equal.
The tables are printed and written to runs/simulate/accuracy.md (or --out; with --docs,
docs/results/accuracy.md) unless --no-files.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from functools import cache

from profiling.common.report import command_line, markdown_table, produced_by
from profiling.simulate import accuracy, outputs, presets
from profiling.simulate.accuracy import Loss, Point, Record, fit, residuals
from profiling.simulate.clusters import cluster
from profiling.simulate.published.measurements import li_cluster, li_workload
from profiling.simulate.published.sources import GOYAL_E256, LI_GPUS, LI_OVERLAP
from profiling.simulate.published.torch_bench import (
    NO_DDP,
    TORCH_BENCH_P50_S,
    step_s,
    torch14_buckets,
    torch_bench_step_s,
    torch_bench_workload,
)
from profiling.simulate.scale import step_seconds
from profiling.simulate.topology import cost_model

GOYAL = "Goyal et al."
SMALL, LARGE = (1, 2, 4, 8), 16  # measure small, predict large on torch's benchmark


@cache  # the bare model's steps: profiled and simulated once
def series() -> dict[str, list[Point]]:
    """The published efficiencies by series, each with the bare model's steps."""
    out = {}
    for model, p50 in TORCH_BENCH_P50_S.items():
        w = torch_bench_workload(model)
        out[model] = [Point(p, 1, torch_bench_step_s(w, p) / w.compute_s, 1.0,
                            p50[NO_DDP] / p50[p]) for p in p50 if p >= 2]  # fmt: skip
    out[GOYAL] = [goyal_point()]
    return out


def goyal_point() -> Point:
    """ResNet-50 on the goyal2017 preset, one all-reduce per gradient, hierarchical
    halving-doubling (as `paper.goyal_efficiency`): E(256) against 8."""
    w = presets.workload("resnet50", cluster("goyal2017").gpu)
    topo = cluster("goyal2017").topology
    per_param = [[i] for i in reversed(range(len(w.grads)))]

    def bare(p: int) -> float:
        cost = cost_model(topo.with_gpus(p), "hierarchical_halving_doubling")
        return step_seconds(w, per_param, cost) / w.compute_s

    return Point(256, 8, bare(256), bare(8), GOYAL_E256)


def held_out(data: dict[str, list[Point]], name: str) -> tuple[Loss, float, float]:
    """The loss fitted without series `name`, and its range from the other series only
    (each predicted by a fit on the rest of them)."""
    others = {k: v for k, v in data.items() if k != name}
    loss = fit([pt for v in others.values() for pt in v])
    inner = [r for k in others for r in residuals(others[k], fit(
        [pt for j, v in others.items() if j not in (k,) for pt in v]))]  # fmt: skip
    return loss, min(inner), max(inner)


@dataclass(frozen=True)
class Checked:
    what: str
    published: float
    bare: float
    central: float
    lo: float  # the range: [central + lo, central + hi]
    hi: float

    @property
    def covered(self) -> bool:
        return self.central + self.lo <= self.published <= self.central + self.hi

    @property
    def error(self) -> float:
        return self.central - self.published

    @property
    def width(self) -> float:
        return self.hi - self.lo


def label(name: str, pt: Point) -> str:
    if name == GOYAL:
        return f"{GOYAL}: resnet50, E({pt.gpus}) against {pt.ref} P100"
    return f"{name}, {pt.gpus} GPUs: E against 1 GPU without DDP"


def leave_one_series_out(data: dict[str, list[Point]] | None = None) -> list[Checked]:
    data = data or series()
    out = []
    for name, points in data.items():
        loss, lo, hi = held_out(data, name)
        out += [Checked(label(name, pt), pt.published, pt.central(accuracy.NO_LOSS),
                        pt.central(loss), lo, hi) for pt in points]  # fmt: skip
    return out


def fitted(data: dict[str, list[Point]] | None = None) -> Loss:
    data = data or series()
    return fit([pt for v in data.values() for pt in v])


def record(data: dict[str, list[Point]] | None = None) -> Record:
    """What `accuracy.RECORD` must hold, recomputed."""
    data = data or series()
    table = leave_one_series_out(data)
    bare = [c.bare - c.published for c in table]
    errors = [c.error for c in table]
    every = [r for name in data for r in residuals(data[name], held_out(data, name)[0])]
    return Record(
        count=len(table), positive=sum(e > 0 for e in bare),
        median_abs=_round(statistics.median(abs(e) for e in bare)),
        worst=_round(max(bare, key=abs)),
        central_median_abs=_round(statistics.median(abs(e) for e in errors)),
        lo=_round(min(every)), hi=_round(max(every)),
        covered=sum(c.covered for c in table),
        median_width=_round(statistics.median(c.width for c in table)),
    )  # fmt: skip


def _round(x: float) -> float:
    return round(x, 4)


def rounded(loss: Loss) -> Loss:
    return Loss(_round(loss.multi), _round(loss.per_doubling))


def li_rows(loss: Loss) -> list[list[str]]:
    """Li et al.'s overlap speed-ups at 32 GPUs: bare, and with `loss` on both steps."""
    topo = li_cluster().with_gpus(LI_GPUS)
    cost = cost_model(topo, "ring")
    out = []
    for model, published in LI_OVERLAP.items():
        w = li_workload(model)
        buckets = torch14_buckets(w, 25.0)
        after, during = (step_s(w, buckets, cost, overlap=o) for o in (False, True))
        extra = w.compute_s * loss.fraction(LI_GPUS)
        out.append([f"Li et al.: {model}, speed-up of overlapping, {LI_GPUS} GPUs",
                    f"{published:+.1%}", f"{after / during - 1:+.1%}",
                    f"{(after + extra) / (during + extra) - 1:+.1%}",
                    "n/a (not an E)"])  # fmt: skip
    return out


def measure_small_predict_large(data: dict[str, list[Point]] | None = None) -> list[Checked]:
    """Each model of torch's benchmark fitted on its own SMALL counts, E(LARGE) predicted,
    its margin the other models' largest miss (`accuracy.measured_range` with that
    margin); Goyal et al.'s with nothing to fit: the loss fitted without them."""
    data = data or series()
    predicted = {}
    for model in TORCH_BENCH_P50_S:
        pts = [pt for pt in data[model] if pt.gpus in SMALL]
        loss, _ = accuracy.fit_measured(pts, accuracy.FITTED)
        large = next(pt for pt in data[model] if pt.gpus == LARGE)
        predicted[model] = (pts, large, loss)
    out = []
    for model, (pts, large, loss) in predicted.items():
        margin = max(abs(o[1].central(o[2]) - o[1].published)
                     for m, o in predicted.items() if m != model)  # fmt: skip
        lo, hi = accuracy.measured_range(pts, loss, LARGE, margin=margin)  # 1 doubling
        out.append(Checked(f"{model}: fit on {', '.join(map(str, SMALL))} GPUs, E({LARGE})",
                           large.published, large.central(accuracy.NO_LOSS),
                           large.central(loss), lo, hi))  # fmt: skip
    goyal = data[GOYAL][0]
    loss, lo, hi = held_out(data, GOYAL)
    out.append(Checked(f"{GOYAL}: measured at 8 only (nothing to fit), E(256)",
                       goyal.published, goyal.central(accuracy.NO_LOSS),
                       goyal.central(loss), lo, hi))  # fmt: skip
    return out


def measured_margin(data: dict[str, list[Point]] | None = None) -> float:
    """What `accuracy.MEASURED_MARGIN` must hold: the benchmark's largest miss."""
    rows = measure_small_predict_large(data)[: len(TORCH_BENCH_P50_S)]
    return _round(max(abs(c.error) for c in rows))


def _table(rows: list[Checked]) -> str:
    body = [[c.what, f"{c.published:.3f}", f"{c.bare:.3f}", f"{c.central:.3f}",
             f"[{c.central + c.lo:.3f}, {c.central + c.hi:.3f}]",
             "yes" if c.covered else "**no**", f"{c.error:+.3f}"] for c in rows]  # fmt: skip
    header = ["measurement", "published", "bare model", "central", "range", "covered", "error"]
    return markdown_table(header, body, left=1)


def markdown() -> str:
    data = series()
    table, small = leave_one_series_out(data), measure_small_predict_large(data)
    loss, rec = rounded(fitted(data)), record(data)
    li = li_rows(loss)
    return "\n".join([
        produced_by([command_line("profiling.simulate")]), "",
        f"Fitted on every row: loss_multi {loss.multi:.4f}, loss_per_doubling "
        f"{loss.per_doubling:.4f} ({loss.describe()}).", "",
        "**Each series held out of the fit** (central: fitted on the other series; "
        "range: their held-out errors):", "",
        _table(table), "",
        f"Covered: {rec.covered} of {rec.count} ({rec.covered / rec.count:.0%}); median "
        f"width {rec.median_width:.3f}; central median |error| {rec.central_median_abs:.3f}"
        f" against the bare model's {rec.median_abs:.3f}.", "",
        markdown_table(["measurement", "published", "bare model", "central", "range"],
                       li, left=1), "",
        "**Measure small, predict large** (`scale --measured`): each model fitted on its "
        "own runs, the range its residuals and at least the other models' largest miss:",
        "",
        _table(small), "",
    ])  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    outputs.add_arguments(parser)


def run(args: argparse.Namespace) -> None:
    text = markdown()
    print(text)
    if args.no_files:
        return
    results, _ = outputs.folders(args)
    path = results / "accuracy.md"
    path.write_text(text)
    print(f"wrote {path}")
