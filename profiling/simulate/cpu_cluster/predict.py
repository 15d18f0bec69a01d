"""The validation's grid, and each run's step as the model predicts it from a calibration.

A run is a (model, rate, world size, stage, bucket cap): naive has no buckets (its cap
is None, as compute_only's, whose prediction is the calibrated compute alone).

What each stage is, for the model (see `layout`): naive, one blocking all-reduce per
parameter after backward, in parameter order; bucketed, one blocking all-reduce per
bucket after backward, buckets in reverse parameter order; overlapped, the same buckets
launched asynchronously from backward as they fill, in bucket order; drop_in, buckets
rebuilt in the order gradients became ready (after the benchmark's warm-up steps) and,
with an explicit bucket_cap_mb as here, no smaller first bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, replace

from profiling.simulate.cpu_cluster.calibration import Calibration
from profiling.simulate.cpu_cluster.sharing import SharedCores
from profiling.simulate.layouts import per_parameter, uniform_buckets
from profiling.simulate.schedule import StageSchedule, Workload, simulate

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
def asynchronous_schedule(calibration: Calibration) -> tuple[StageSchedule, SharedCores]:
    """The schedule of a stage that launches its buckets as they fill (overlapped,
    drop_in, and torch's DDP alike): one lane, the calibration's busy launch, and each
    gradient copied into its bucket and the average back (the benchmark leaves
    gradient_as_bucket_view off)."""
    copy = calibration.copy_s_per_byte
    return StageSchedule(overlap=True), SharedCores(
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
) -> tuple[list[list[int]], StageSchedule, SharedCores]:
    """(buckets, StageSchedule, the stage's part of the sharing) of `stage` at `cap_mb`
    for this workload, with the calibration's busy launch and copies, on one lane: the
    stages use one process group, and the calibration's trickle, run on one, holds what
    Gloo's second thread overlaps in its slowdowns. `own_s`: what the stage's step took
    beyond the compute with no communication (`Calibration.own_s`); what its copies do
    not account for goes to each gradient's hook. The slowdowns are the model's
    (`Calibration.contention`), added by the caller."""
    buckets, schedule, work = _layout(stage, workload, cap_mb, calibration)
    # Never below nothing: a stage timed faster than its copies is the machine's noise.
    nbytes = sum(g.nbytes for g in workload.grads)
    copies_s = nbytes * (work.copy_in_s_per_byte + work.copy_out_s_per_byte)
    own_s_per_grad = max(0.0, own_s - copies_s) / len(workload.grads)
    return buckets, schedule, replace(work, own_s_per_grad=own_s_per_grad)


def _layout(
    stage: str, workload: Workload, cap_mb: float | None, calibration: Calibration
) -> tuple[list[list[int]], StageSchedule, SharedCores]:
    """`layout` before the stage's own time: its buckets, and its copies as it makes them."""
    # Every stage with buckets divides each gradient into its bucket and copies the
    # average back (drop_in too: the benchmark leaves gradient_as_bucket_view off);
    # naive all-reduces the gradient itself, then divides it in place.
    copy = calibration.copy_s_per_byte
    after = StageSchedule(overlap=False)
    asynchronous, copies = asynchronous_schedule(calibration)
    if stage == "naive":
        return per_parameter(workload), after, SharedCores(copy_out_s_per_byte=copy)
    if stage == "bucketed":
        both = SharedCores(copy_in_s_per_byte=copy, copy_out_s_per_byte=copy)
        return uniform_buckets(workload, cap_mb), after, both
    if stage == "overlapped":
        return uniform_buckets(workload, cap_mb), asynchronous, copies
    if stage == "drop_in":
        # Rebuilt in ready order; an explicit cap means no smaller first bucket. Cut by the
        # stages' rule, as the validation's runs measured it (the drop-in now cuts torch's).
        buckets = uniform_buckets(workload, cap_mb, first_bucket_cap_mb=None, ready_order=True)
        return buckets, asynchronous, copies
    raise ValueError(f"no model of stage {stage!r}; pick one of {STAGES}")


# --8<-- [end:layout]


def buffer_broadcast_s(calibration: Calibration, model: str) -> float:
    """broadcast_buffers (torch's default, the drop-in's too): rank 0's buffers before
    each forward, one broadcast per dtype (the CNN's BatchNorm has two; the MLP none).
    As the calibration timed it (`measure.broadcast_buffers_s`), or, in a calibration
    made before it did, costed as an all-reduce of as many bytes: on 4 ranks about ten
    times what the broadcast took, which needs fewer message rounds than the ring
    all-reduce's 2(p - 1)."""
    if model in calibration.broadcast_buffers_s:
        return calibration.broadcast_buffers_s[model]
    return sum(calibration.cost(n).seconds for n in calibration.buffer_bytes[model])


def predict(run: Run, calibration: Calibration) -> dict:
    """The simulated step of `run` under its (rate, world size)'s calibration."""
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
    buckets, schedule, work = layout(run.stage, workload, run.cap_mb, calibration, own_s)
    sharing = replace(work, **calibration.contention(run.model))
    step = simulate(workload, buckets, calibration.cost, schedule, sharing)
    return {
        "predicted_ms": step.step_s * 1e3,
        "compute_ms": step.compute_s * 1e3,
        "exposed_comm_ms": step.exposed_comm_s * 1e3,
        "buckets": len(buckets),
    }


# - the calibration of a run, and its compute as measured after the fact -------------


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
