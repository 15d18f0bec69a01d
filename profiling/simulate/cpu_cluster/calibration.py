"""Calibration: everything a prediction needs, measured on the virtual cluster at one
rate and world size, before any run it predicts is measured (the validation calibrates
each model on its own, just before that model's benchmark).

    calibration = calibrate("1gbit", 2, {"mlp": Config(model="mlp", ...)})

`calibrate` starts one cluster (`profiling.cluster.VirtualCluster`), one torchrun node
per rank, each running the worker (`worker`, which lists what it measures and in what
order); rank 0 writes the measurements as JSON. On the driver's side `fitted` fits the
collective cost to the sweep (`profiling.collectives.model.fit`, each size's fastest
call, free_bytes no deeper than the link's token bucket and beta no faster than its
rate), what a call costs in a sequence beyond it (`call_s`), the lanes, the busy launch
and the slowdowns (`contention`), and returns plain data (what the validation's JSON
keeps), which `Calibration.from_json` turns into model inputs.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ddp.config import Config
from ddp.models import build_model
from profiling.cluster.network import available, parse_rate, tbf_burst_bytes
from profiling.cluster.virtual_cluster import VirtualCluster
from profiling.collectives.model import counts, fit, measure_gamma, medians
from profiling.common.report import load_average
from profiling.simulate.cpu_cluster.contention import LATENCY_KEYS, comm_slowdown, latency_slowdowns
from profiling.simulate.cpu_cluster.inputs import workload_from_json
from profiling.simulate.cpu_cluster.worker import ENV
from profiling.simulate.schedule import Cost, CostModel, Workload

ALGORITHM = "gloo"  # the stages call torch's all-reduce: Gloo's ring, on CPU
# The sweep: 4 KiB to 16 MiB by factors of 4 (7 sizes: 4 fitted, 3 held out), as many
# rounds as fit in half a second per size, 3 to 10. About 10 s on 4 ranks at 1 Gbit/s.
SWEEP = {
    "sizes_bytes": [4 * 2**10 * 4**k for k in range(7)],
    "algorithms": [ALGORITHM],
    "delay_ms": 0.0,
    "min_repeats": 3,
    "max_repeats": 10,
    "seconds_per_size": 0.5,
}
# The sweep's figure per size: its fastest call. Gloo's small all-reduce on shared cores
# runs at one of two paces from one call to the next, and a median on the slow side lets
# the fit trade wire for latency. A call's latency comes from the sequence's slope
# (`call_s`), not from here, so the sweep sets only the wire (beta and free_bytes), which
# its fastest calls show best; and free_bytes is capped at the bucket's depth
# (`tbf_burst_bytes`), all a link shaped by it can pass at once, and beta at the link's
# rate: past the bucket, no byte crosses faster. The measurements:
# docs/appendix/simulator-runs.md, "Calibration".
SWEEP_SECONDS = "min_s"
TWO_LANES_BELOW = 1.5  # two small all-reduces at once take < 1.5x one: they overlap


# --8<-- [start:cost]
def cost_model(
    fit: dict, world_size: int, algorithm: str = ALGORITHM, call_s: float = 0.0
) -> CostModel:
    """The fitted alpha-beta-gamma model as a `Cost` per size: latency = call_s + steps *
    alpha + bytes added * gamma (what a call costs in a sequence beyond or short of the
    sweep's figure, message rounds, the reduction: what no other collective slows), never
    below 0; wire = sum over phases of max(0, phase bytes - free_bytes) * beta (what
    holds the link)."""

    def cost(nbytes: int) -> Cost:
        c = counts(algorithm, world_size, nbytes)
        wire = sum(max(0.0, phase - fit["free_bytes"]) for phase in c.phases)
        return Cost(
            latency_s=max(0.0, call_s + c.steps * fit["alpha_s"] + c.added * fit["gamma"]),
            wire_s=wire * fit["beta_s_per_byte"],
        )

    return cost


# --8<-- [end:cost]


@dataclass(frozen=True)
class Calibration:
    """One (rate, world size)'s model inputs."""

    rate: str
    world_size: int
    cost: CostModel
    workloads: dict[str, Workload]  # model key -> its compute
    slowdowns: dict[str, float]  # model key -> backward's slowdown under communication
    # model key -> communication's slowdown under backward (0 where not calibrated)
    comm_slowdowns: dict[str, float] = field(default_factory=dict)
    # The same two while small all-reduces fly, in their latency, for the whole cluster
    # (None where not calibrated: the model's slowdowns above stand in)
    latency_slowdown: float | None = None
    comm_latency_slowdown: float | None = None
    busy_launch_s: float = 0.0  # what a collective launched while another flies adds
    copy_s_per_byte: float = 0.0  # a pass over one 4 MiB gradient (into or out of a bucket)
    buffer_bytes: dict[str, list[int]] = field(default_factory=dict)  # per buffer dtype
    # model key -> the same pass over that model's gradients, timed right after its
    # backward (absent in calibrations made before it was measured)
    model_copy_s_per_byte: dict[str, float] = field(default_factory=dict)
    # model key -> the cost with that model's own call_s, from the sequence timed right
    # after its backward (absent in calibrations made before it was measured)
    model_costs: dict[str, CostModel] = field(default_factory=dict)
    # model key -> the two slowdowns of small all-reduces under compute, the trickle's
    # fitted again with that model's cost (`model_fits`); where it has one
    model_latency_slowdowns: dict[str, dict[str, float]] = field(default_factory=dict)
    # model key -> seconds of its buffers' broadcast before forward, as a step makes it
    # (`measure.broadcast_buffers`; absent in calibrations made before it was measured)
    broadcast_buffers_s: dict[str, float] = field(default_factory=dict)
    # model key -> (stage, cap_mb) -> seconds its step took beyond the compute alone with no
    # communication (`measure.own_steps`; absent in calibrations made before it was timed)
    own_steps_s: dict[str, dict[tuple[str, float | None], float]] = field(default_factory=dict)

    def own_s(self, model: str, stage: str, cap_mb: float | None) -> float:
        """What `stage` at `cap_mb` took beyond `model`'s compute with no communication,
        where the calibration timed it; else 0."""
        return self.own_steps_s.get(model, {}).get((stage, cap_mb), 0.0)

    def for_model(self, model: str) -> Calibration:
        """This calibration with `model`'s own figures where they were measured: its pass
        over its gradients as the copy, as a pass just after backward costs more per
        byte than one 4 MiB gradient divided over and over (`measure.copy_after_backward`);
        its cost of a call in a sequence right after its backward
        (`measure.calls_after_backward`),
        for every stage; and the trickle's two slowdowns fitted with that cost, so that
        a stage launching its calls through backward counts a call's cost once: in the
        cost, not again in slowdowns fitted with the cluster's."""
        mine: dict = {}
        if model in self.model_copy_s_per_byte:
            mine["copy_s_per_byte"] = self.model_copy_s_per_byte[model]
        if model in self.model_costs:
            mine["cost"] = self.model_costs[model]
            mine.update(self.model_latency_slowdowns.get(model, {}))
        return dataclasses.replace(self, **mine) if mine else self

    def contention(self, model: str) -> dict[str, float | None]:
        """The four slowdowns of `model`'s step, as `sharing.SharedCores` fields."""
        return {
            "slowdown": self.slowdowns.get(model, 0.0),
            "comm_slowdown": self.comm_slowdowns.get(model, 0.0),
            "latency_slowdown": self.latency_slowdown,
            "comm_latency_slowdown": self.comm_latency_slowdown,
        }

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        model_costs = {
            k: cost_model(data["fit"], data["world_size"], call_s=m["call_s"])
            for k, m in data["models"].items()
            if "call_s" in m
        }
        return cls(
            rate=data["rate"],
            world_size=data["world_size"],
            cost=cost_model(data["fit"], data["world_size"], call_s=data.get("call_s", 0.0)),
            workloads={k: workload_from_json(m["workload"]) for k, m in data["models"].items()},
            slowdowns={k: m["slowdown"] for k, m in data["models"].items()},
            comm_slowdowns={k: m.get("comm_slowdown", 0.0) for k, m in data["models"].items()},
            latency_slowdown=data.get("latency_slowdown"),
            comm_latency_slowdown=data.get("comm_latency_slowdown"),
            busy_launch_s=data.get("busy_launch_s", 0.0),
            copy_s_per_byte=data.get("copy_s_per_byte", 0.0),
            buffer_bytes={k: m.get("buffer_bytes", []) for k, m in data["models"].items()},
            model_copy_s_per_byte={
                k: m["copy_s_per_byte"] for k, m in data["models"].items() if "copy_s_per_byte" in m
            },
            model_costs=model_costs,
            model_latency_slowdowns={
                k: {key: data["models"][k][key] for key in LATENCY_KEYS}
                for k in model_costs
                if all(key in data["models"][k] for key in LATENCY_KEYS)
            },
            broadcast_buffers_s={
                k: m["broadcast_buffers_s"]
                for k, m in data["models"].items()
                if "broadcast_buffers_s" in m
            },
            own_steps_s={
                k: {(stage, cap): extra_s for stage, cap, _, extra_s in m["own_steps"]["layouts"]}
                for k, m in data["models"].items()
                if "own_steps" in m
            },
        )


def lanes(concurrency: list[dict]) -> int:
    """2 if two latency-bound all-reduces launched together overlap, else 1."""
    small = min(concurrency, key=lambda c: c["size_bytes"])
    return 2 if small["two_s"] < TWO_LANES_BELOW * small["one_s"] else 1


def busy_launch_s(sequence: dict) -> float:
    """What a small all-reduce launched while others fly or wait costs
    beyond one issued after the last has ended (what the model charges with `call_s`):
    the per-call slope of the sequences launched all at once (each extra call of a
    burst is queued behind the others), less that of the sequences waited for call by
    call. A slope over many calls, as a single pair launched together varies several
    times over from one calibration to the next (docs/appendix/simulator-runs.md)."""
    return max(0.0, slope_s(sequence, "async_seconds") - slope_s(sequence))


def slope_s(sequence: dict, key: str = "seconds") -> float:
    """Seconds per extra call: (the longer sequence - the shorter) / the calls between
    them, from the medians of `sequence[key]` (one list of repeats per length)."""
    (n_short, short), (n_long, long) = sorted(
        zip(sequence["lengths"], map(statistics.median, sequence[key]), strict=True)
    )
    return (long - short) / (n_long - n_short)


def call_s(sequence: dict, cost: CostModel) -> float:
    """What a collective costs in a sequence beyond the cost model's figure for it: the
    sequence's slope per call, less `cost` of its size, so that a small call costs the
    slope. Negative where the fit's small call costs more than the slope (on 4 ranks it
    can): held at 0 there, every small call would be overcharged
    (docs/appendix/simulator-runs.md)."""
    return slope_s(sequence) - cost(sequence["size_bytes"]).seconds


def buffer_bytes(cfg: Config) -> list[int]:
    """Bytes of the model's buffers, one entry per dtype: what a stage with
    broadcast_buffers (buffers and later, torch's default) broadcasts before each
    synchronised forward, one broadcast per dtype (`ddp.dist.broadcast_buffers`)."""
    model = build_model(cfg.model, width=cfg.width, depth=cfg.depth)
    by_dtype: dict = {}
    for b in model.buffers():
        by_dtype[b.dtype] = by_dtype.get(b.dtype, 0) + b.numel() * b.element_size()
    return list(by_dtype.values())


# - the driver ------------------------------------------------------------------------


def calibrate(
    rate: str,
    world_size: int,
    configs: dict[str, Config],
    timeout: float = 900,
    *,
    layouts: dict[str, list[tuple[str, float | None]]] | None = None,
) -> dict:
    """Run the worker (`worker`) on a fresh cluster of `world_size` ranks linked at
    `rate`; return its measurements with the cost fit and the lanes (plain data;
    `Calibration.from_json`). `layouts`: per model key, the (stage, cap_mb) whose steps
    with no communication to time (`measure.own_steps`; none if not given)."""
    ok, why = available()
    if not ok:
        raise SystemExit(f"profiling.simulate: no shaped network ({why}); run as root")
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "calibration.json"
        settings = {
            "out": str(out),
            "sweep": SWEEP,
            "configs": {k: dataclasses.asdict(c) for k, c in configs.items()},
            "layouts": {k: [list(v) for v in vs] for k, vs in (layouts or {}).items()},
        }
        with VirtualCluster(ranks=world_size, rate=rate) as cluster:
            code = cluster.run(
                ["-m", "profiling.simulate.cpu_cluster.worker"],
                env={ENV: json.dumps(settings)},
                timeout=timeout,
            ).returncode
        if code != 0:
            raise SystemExit(
                f"profiling.simulate: calibration on {world_size} ranks at {rate} failed "
                f"(exit {code}); its output is above"
            )
        result = json.loads(out.read_text())
    return fitted(
        result,
        rate,
        world_size,
        {key: buffer_bytes(cfg) for key, cfg in configs.items()},
        load_before=load_before,
        load_after=load_average(),
    )


def fitted(
    result: dict,
    rate: str,
    world_size: int,
    buffers: dict[str, list[int]],
    load_before: float | None = None,
    load_after: float | None = None,
) -> dict:
    """The driver's side of `calibrate`: the workers' measurements `result` with the cost
    fitted and everything fitted from it (plain data)."""
    sweep = {**result["sweep"], "network": {"rate": rate}}
    # --8<-- [start:sweep]
    fits = fit(
        medians([sweep]),
        measure_gamma([sweep]),
        key=SWEEP_SECONDS,  # each size's fastest call
        max_free_bytes=tbf_burst_bytes(parse_rate(rate)),  # the token bucket's depth
        min_beta_s_per_byte=8 / parse_rate(rate),  # and its rate
    )
    # --8<-- [end:sweep]
    if ALGORITHM not in fits:
        raise SystemExit(f"profiling.simulate: too few sizes to fit {ALGORITHM}: {SWEEP}")
    sweep_cost = cost_model(fits[ALGORITHM], world_size)  # before any call_s
    extra_s = call_s(result["sequence"], sweep_cost)
    cost = cost_model(fits[ALGORITHM], world_size, call_s=extra_s)
    busy_s = busy_launch_s(result["sequence"])
    return {
        **result,  # the workers' measurements, as they made them
        "rate": rate,
        "world_size": world_size,
        "fit": fits[ALGORITHM],
        "call_s": extra_s,
        "lanes": lanes(result["concurrency"]),
        "busy_launch_s": busy_s,
        **latency_slowdowns(result["sequence"], cost, busy_s),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "models": {
            key: {
                **m,
                "buffer_bytes": buffers[key],
                **model_fits(m, fits[ALGORITHM], world_size, result["sequence"], busy_s),
            }
            for key, m in result["models"].items()
        },
    }


# --8<-- [start:own]
def model_fits(m: dict, fit: dict, world_size: int, sequence: dict, busy_s: float) -> dict:
    """One model's figures fitted on the driver's side from its measurements `m`: how
    much communication slows under its backward, its call after backward (`call_s`
    of its own sequence, against the cluster's `fit`), and the trickle's two slowdowns
    fitted again with that call's cost (`Calibration.for_model`)."""
    model_call_s = call_s(m["calls_after_backward"], cost_model(fit, world_size))
    model_cost = cost_model(fit, world_size, call_s=model_call_s)
    return {
        "comm_slowdown": comm_slowdown(m["comm_with_backward_s"], m["comm_alone_s"]),
        "call_s": model_call_s,
        **latency_slowdowns(sequence, model_cost, busy_s),
    }


# --8<-- [end:own]


def calibration_path(given: Path | None) -> Path:
    """A CPU-cluster calibration: the one given, or the docs' own in this checkout."""
    path = given or Path(__file__).resolve().parents[3] / "docs/results/simulate-validate.json"
    if not path.is_file():
        raise SystemExit(
            f"no calibration file {path}; run `python -m profiling.simulate validate --json "
            "FILE` and pass --calibration FILE"
        )
    return path
