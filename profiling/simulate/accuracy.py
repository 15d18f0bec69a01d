"""How far the step model's E(p) has been from published measurements, and the loss it
cannot derive, fitted on them: the central figure and the range `scale` prints.

The bare model (`schedule.simulate`) runs high: on torch's own DDP benchmark it loses
0.3 to 1.2 ms from 1 to 2 GPUs of one server where the benchmark loses 3 to 4% of
each model's compute, whatever the bytes (docs/scaling.md, "Against published
measurements"), and Goyal et al.'s E(256) against 8 GPUs is 0.10 under it. `Loss` adds
what is missing as a fraction of one GPU's compute:

    T(p) = T_bare(p) + compute x (multi + per_doubling x log2(p / 2))   for p >= 2
    T(1) = T_bare(1)                                                    (no DDP)

`multi` is what every step of two or more GPUs loses against one GPU without DDP;
`per_doubling` what each doubling of the GPUs beyond two adds. Both are fitted
(`fit`, least squares) on the published efficiencies, and the figures below are the
fit's and its record's. `profiling.simulate.published.crossval` recomputes every one
of them from the published rows (`python -m profiling.simulate accuracy`), and
tests/test_simulate_accuracy.py fails when they differ: change the model, then
regenerate them. This module imports nothing of `published` (the core never does).

The range [E + lo, E + hi] that `scale` prints beside each central E comes from held-out
errors: each series (one model of the benchmark, Goyal et al.) predicted by a fit on
the others, published minus that prediction; lo and hi are the least and the most.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Loss:
    """What a step of p GPUs loses besides the bare model's, in units of one GPU's
    compute: `multi` at 2 GPUs and more, plus `per_doubling` for each doubling beyond 2."""

    multi: float
    per_doubling: float = 0.0

    def fraction(self, gpus: int) -> float:
        return 0.0 if gpus < 2 else self.multi + self.per_doubling * math.log2(gpus / 2)

    def step_s(self, bare_step_s: float, compute_s: float, gpus: int) -> float:
        return bare_step_s + compute_s * self.fraction(gpus)

    def describe(self) -> str:
        more = f" plus {self.per_doubling:.1%} per doubling beyond 2" if self.per_doubling else ""
        return f"{self.multi:.1%} of compute at 2+ GPUs{more}"


NO_LOSS = Loss(0.0, 0.0)


@dataclass(frozen=True)
class Point:
    """One published efficiency E = T(ref) / T(gpus), with the bare model's two steps in
    units of one GPU's compute (T_bare / compute)."""

    gpus: int
    ref: int
    bare: float  # T_bare(gpus) / compute
    bare_ref: float  # T_bare(ref) / compute
    published: float

    def central(self, loss: Loss) -> float:
        return (self.bare_ref + loss.fraction(self.ref)) / (self.bare + loss.fraction(self.gpus))


def fit(points: Sequence[Point], free: tuple[str, ...] = ("multi", "per_doubling"),
        start: Loss = NO_LOSS) -> Loss:  # fmt: skip
    """The `free` parameters (the rest kept at `start`'s) that make the central E meet the
    published ones, in least squares on E x T(gpus) = T(ref), which is linear in them:
    a (E s - s_ref) + b (E d - d_ref) = bare_ref - E bare + (kept parameters' part), with
    s = 1 at 2+ GPUs and d = log2(p / 2)."""
    if not free:
        return start
    rows, rhs = [], []
    for pt in points:
        e = pt.published
        s, s_ref = float(pt.gpus >= 2), float(pt.ref >= 2)
        d = math.log2(pt.gpus / 2) if pt.gpus >= 2 else 0.0
        d_ref = math.log2(pt.ref / 2) if pt.ref >= 2 else 0.0
        coef = {"multi": e * s - s_ref, "per_doubling": e * d - d_ref}
        kept = sum(getattr(start, k) * coef[k] for k in coef if k not in free)
        rows.append([coef[k] for k in free])
        rhs.append(pt.bare_ref - e * pt.bare - kept)
    solved = _least_squares(rows, rhs)
    values = {"multi": start.multi, "per_doubling": start.per_doubling}
    values.update(zip(free, solved, strict=True))
    return Loss(**values)


def _least_squares(rows: list[list[float]], rhs: list[float]) -> list[float]:
    """x minimising |A x - y|^2 for one or two unknowns (the normal equations)."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * y for r, y in zip(rows, rhs, strict=True)) for i in range(n)]
    if n == 1:
        if ata[0][0] == 0:
            raise ValueError("nothing to fit: no efficiency depends on the parameter")
        return [aty[0] / ata[0][0]]
    det = ata[0][0] * ata[1][1] - ata[0][1] * ata[1][0]
    if abs(det) < 1e-12:
        raise ValueError("the efficiencies cannot tell the two parameters apart")
    return [(aty[0] * ata[1][1] - ata[0][1] * aty[1]) / det,
            (ata[0][0] * aty[1] - ata[1][0] * aty[0]) / det]  # fmt: skip


def residuals(points: Sequence[Point], loss: Loss) -> list[float]:
    """Published minus central, each point."""
    return [pt.published - pt.central(loss) for pt in points]


@dataclass(frozen=True)
class Record:
    """The model against the published efficiencies it has been checked on."""

    count: int  # published efficiencies
    positive: int  # of them, where the bare model is higher
    median_abs: float  # the bare model's median |error|
    worst: float  # its largest error by size, with its sign
    central_median_abs: float  # the central figure's, each series held out of its fit
    lo: float  # the range: central + lo to central + hi (held-out errors' least, most)
    hi: float
    covered: int  # of `count`, in the range their own held-out fit gave
    median_width: float  # of those ranges


# --8<-- [start:fitted]
# Fitted on the 16 efficiencies of torch's own DDP benchmark at 2 to 16 GPUs (4 ResNets
# on DGX-1 V100 servers, against 1 GPU without DDP) and Goyal et al.'s E(256) = 0.90
# against 8 GPUs: `python -m profiling.simulate accuracy` prints the fit and its record.
FITTED = Loss(multi=0.0492, per_doubling=0.0166)
FIT_ON = "torch's DDP benchmark at 2-16 GPUs and Goyal et al.'s E(256)"
REASONS = {
    "multi": "the benchmark loses 3-4% of compute from 1 to 2 GPUs of one server, "
    "independent of the bytes, and DDP on 1 GPU 1.4-5.6% more: neither is in the model",
    "per_doubling": "from 4 to 16 GPUs the benchmark loses 1-3% more and Goyal et al. 10% "
    "from 8 to 256, where the model hides nearly all communication",
}
RECORD = Record(count=17, positive=17, median_abs=0.0714, worst=0.0993,
                central_median_abs=0.0111, lo=-0.0633, hi=0.0288, covered=15,
                median_width=0.0855)  # fmt: skip
# Fitting on a user's own runs (`scale --measured`): the most any published series
# missed its next doubling by when fitted on its smaller counts (torch's benchmark, fit
# on 1-8 GPUs, E(16)); the range is at least this wide either side for each doubling
# beyond the largest count measured.
MEASURED_MARGIN = 0.0081
# --8<-- [end:fitted]


def header(record: Record = RECORD, loss: Loss | None = FITTED) -> str:
    """The line every output with a central E begins with; `loss` None: the record only."""
    sign = ("all" if record.positive == record.count else "most" if
            record.positive * 2 > record.count else "not most")  # fmt: skip
    bare = (f"checked against {record.count} published measurements: model error median "
            f"{record.median_abs:.3f}, worst {record.worst:+.3f}, {sign} positive "
            "(model high)")  # fmt: skip
    if loss is None:
        return bare
    return (
        f"{bare}; central figure includes a fitted loss of {loss.describe()} (fit on "
        f"{FIT_ON}); range [E {record.lo:+.3f}, E {record.hi:+.3f}] covers {record.covered} of "
        f"{record.count} held out (each series predicted by a fit on the others), "
        f"median width {record.median_width:.3f}"
    )


def measured_points(
    times_s: dict[int, float], bare_steps_s: dict[int, float], compute_s: float
) -> list[Point]:
    """A user's step times at some GPU counts as efficiencies against the smallest."""
    ref = min(times_s)
    return [Point(p, ref, bare_steps_s[p] / compute_s, bare_steps_s[ref] / compute_s,
                  times_s[ref] / t) for p, t in sorted(times_s.items()) if p != ref]  # fmt: skip


def fit_measured(points: Sequence[Point], start: Loss = FITTED) -> tuple[Loss, tuple[str, ...]]:
    """The parameters a user's runs can tell: `multi` when the smallest count is 1 GPU,
    `per_doubling` when two counts of 2 or more are measured; the others kept at
    `start`'s; one fitted below 0 (a step shorter than the bare one) held at 0, the other
    refitted. Returns the loss and the names fitted."""
    counts = {pt.gpus for pt in points} | {pt.ref for pt in points}
    free = []
    if min(counts, default=2) < 2 and max(counts) >= 2:  # no points: none free
        free.append("multi")
    if len({p for p in counts if p >= 2}) >= 2:
        free.append("per_doubling")
    if not free:
        raise ValueError("fewer than two GPU counts: nothing to fit against")
    loss = fit(points, tuple(free), start)
    below = [k for k in free if getattr(loss, k) < 0]
    if rest := below and tuple(k for k in free if k not in below):
        loss = fit(points, rest, replace(loss, **dict.fromkeys(below, 0.0)))
    return replace(loss, **{k: max(0.0, getattr(loss, k)) for k in free}), tuple(free)


def measured_range(points: Sequence[Point], loss: Loss, gpus: int, margin=MEASURED_MARGIN):
    """(lo, hi) at `gpus` for a fit on a user's runs: the fit's residuals, and at least
    `margin` either side for each doubling beyond the largest count measured (one at
    least)."""
    res = residuals(points, loss) or [0.0]
    largest = max(max(pt.gpus, pt.ref) for pt in points)
    margin = margin * max(1.0, math.log2(gpus / largest))
    return min(min(res), -margin), max(max(res), margin)
