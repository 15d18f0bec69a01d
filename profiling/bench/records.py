"""The record of a run, as --json writes it: per variant its times, ratios and layout,
the perfect-overlap and achievable bounds per sweep value, the settings, the machine
and the network."""

from __future__ import annotations

import json
import os
import statistics

import torch.distributed as dist

from ddp.bucket_cuts import served_in_order
from ddp.config import Config
from profiling.bench.options import COMM, FLOOR, REFERENCE, BenchOptions
from profiling.bench.variants import global_batch
from profiling.common.report import command_line, machine


def make_record(
    opts: BenchOptions,
    cfg: Config,
    results: list[dict],
    parameters: int,
    elapsed_s: float,
    swept: str = "",
    configs: list | None = None,
) -> dict:
    """The JSON-able description of one run: command, machine, settings, per variant."""
    # In a sweep, a variant with no sweep value ran once for every value (DEPENDS_ON).
    shared = [r for r in results if swept and r.get("sweep_value") is None]
    groups: dict = {}  # sweep value -> its own results, in table order
    for r in results:
        if not (swept and r.get("sweep_value") is None):
            groups.setdefault(r.get("sweep_value"), []).append(r)
    # A shared variant's bound and reference would have to pick one value's: it has
    # none, but it has ratios to the other shared ones (compute_only in a cap sweep).
    shared_by_name = {r["name"]: r for r in shared}
    variants = [variant_entry(r, shared_by_name, None) for r in shared]
    bounds = []
    for value, group in groups.items():
        by_name = {r["name"]: r for r in shared + group}
        bound = perfect_overlap_bound(by_name.get(FLOOR), by_name.get(COMM))
        if bound is not None:
            bound |= achievable_bound(by_name[FLOOR], by_name[COMM]) or {}
            k = group[0].get("accumulation_steps", 1)
            bounds.append({"sweep_value": value, "accumulation_steps": k, **bound})
        variants += [variant_entry(r, by_name, bound) for r in group]
    return {
        "workload": workload_key(cfg, swept),
        "command": os.environ.get("BENCH_COMMAND") or _torchrun_command(),
        "machine": machine(),
        "settings": {
            "model": cfg.model,
            **({"width": cfg.width, "depth": cfg.depth} if cfg.model in ("mlp", "frozen") else {}),
            "parameters": parameters,
            "per_rank_batch": global_batch(cfg) // dist.get_world_size(),
            "global_batch": global_batch(cfg),
            "accumulation_steps": cfg.accumulation_steps,
            "bucket_cap_mb": cfg.bucket_cap_mb,
            **({"sweep": {"field": swept, "values": [v for v, _ in configs]}} if swept else {}),
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "rounds": opts.rounds,
            "steps_per_round": cfg.steps,
            "warmup_steps": cfg.warmup_steps,
            "round_warmup": opts.round_warmup,
            "optimizer": f"SGD(lr={cfg.lr}, momentum=0.9)",
            "seed": cfg.seed,
            "network": network(),
            "elapsed_s": round(elapsed_s, 1),
        },
        "bounds": bounds,
        "variants": variants,
    }


def variant_entry(r: dict, by_name: dict[str, dict], bound: dict | None) -> dict:
    """One variant's figures, against the others of its group (its sweep value)."""
    times = r["step_times_s"]
    median = statistics.median(times)
    floor, reference = by_name.get(FLOOR), by_name.get(REFERENCE)
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [median] * 3
    floor_median = statistics.median(floor["step_times_s"]) if floor else None
    k = r.get("accumulation_steps", 1)
    return {
        "name": r["name"],
        "sweep_value": r.get("sweep_value"),
        "accumulation_steps": k,
        "median_ms": median * 1e3,
        "per_micro_batch_ms": median * 1e3 / k,
        "min_ms": min(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "p25_ms": quartiles[0] * 1e3,
        "p75_ms": quartiles[2] * 1e3,
        "vs_torch_ddp": _ratio(
            median, statistics.median(reference["step_times_s"]) if reference else None
        ),
        "vs_compute_only": _ratio(median, floor_median),
        "vs_bound": None if bound is None else median * 1e3 / bound["bound_ms"],
        "round_vs_torch_ddp": None
        if reference is None
        else _paired(r, _round_medians(reference["step_times_s"], reference["step_rounds"])),
        "round_vs_bound": None
        if bound is None
        else _paired(r, {int(rnd): ms / 1e3 for rnd, ms in bound["per_round_ms"].items()}),
        **(
            {
                "vs_achievable": median * 1e3 / bound["achievable_ms"],
                "round_vs_achievable": _paired(
                    r,
                    {int(k): ms / 1e3 for k, ms in bound["achievable_per_round_ms"].items()},
                ),
            }
            if bound is not None and "achievable_ms" in bound
            else {}
        ),
        # Communication alone has no compute to expose anything behind.
        "exposed_comm_ms": (median - floor_median) * 1e3
        if floor_median is not None and r["name"] != COMM
        else None,
        "allreduces_per_step": None
        if r["allreduce_mib"] is None
        else len(r["allreduce_mib"]) * r["syncs_per_step"],
        "allreduce_mib": r["allreduce_mib"],
        "rounds": len(set(r["step_rounds"])),
        "step_rounds": r["step_rounds"],  # the round of each of step_times_ms
        "steps": len(times),
        "replicas_identical": r["replicas_identical"],
        **({"auto_bucket_choice": r["auto_bucket_choice"]} if r.get("auto_bucket_choice") else {}),
        **({"settle_steps": r["settle_steps"]} if r.get("settle_steps") else {}),
        "step_times_ms": [t * 1e3 for t in times],
        **(
            {
                "forward_ms": [t * 1e3 for t in r["forward_s"]],
                "optimizer_ms": [t * 1e3 for t in r["optimizer_s"]],
            }
            if "forward_s" in r
            else {}
        ),
    }


def perfect_overlap_bound(floor: dict | None, comm: dict | None) -> dict | None:
    """max(compute_only, F + A + O) from the medians of one run's parts (see the module's
    docstring), overall and per round; None without both compute_only and
    communication_alone. `floor` holds step_times_s, forward_s, optimizer_s and
    step_rounds; `comm` step_times_s and step_rounds."""
    if floor is None or comm is None or "forward_s" not in floor:
        return None

    def bound(c: float, f: float, a: float, o: float) -> float:
        return max(c, f + a + o)

    c = statistics.median(floor["step_times_s"])
    f = statistics.median(floor["forward_s"])
    o = statistics.median(floor["optimizer_s"])
    a = statistics.median(comm["step_times_s"])
    rounds = floor["step_rounds"]
    c_r = _round_medians(floor["step_times_s"], rounds)
    f_r = _round_medians(floor["forward_s"], rounds)
    o_r = _round_medians(floor["optimizer_s"], rounds)
    a_r = _round_medians(comm["step_times_s"], comm["step_rounds"])
    per_round = {  # str keys, as JSON has them
        str(k): bound(c_r[k], f_r[k], a_r[k], o_r[k]) * 1e3 for k in c_r if k in a_r
    }
    return {
        "compute_only_ms": c * 1e3,
        "forward_ms": f * 1e3,
        "communication_alone_ms": a * 1e3,
        "optimizer_ms": o * 1e3,
        "bound_ms": bound(c, f, a, o) * 1e3,
        "bound_by": "compute" if c >= f + a + o else "communication",
        "per_round_ms": per_round,
    }


def achievable_bound(floor: dict, comm: dict) -> dict | None:
    """max(compute_only, E + O), where E is when the last all-reduce ends in the
    overlapped schedule replayed with no contention: bucket i's all-reduce starts once
    its last gradient is ready (as measured in the compute_only steps) and bucket i - 1's
    has ended, and takes its share, by bytes, of the time communication_alone took to
    end its last bucket. A share, not its own end minus the one before: Gloo runs two
    collectives of a group at once (two threads per group), so the end times of
    consecutive buckets come in pairs and do not tell one bucket's time from the next.
    Tighter than the perfect-overlap bound, which lets communication start before any
    gradient exists; the layout is communication_alone's. Medians, overall and per
    round; None without the ready times and bucket ends (older records)."""
    if "ready_s" not in floor or "bucket_end_s" not in comm:
        return None
    nbytes = [mib * 2**20 for mib in comm["allreduce_mib"]]
    share = [b / sum(nbytes) if sum(nbytes) else 1 / len(nbytes) for b in nbytes]

    def replay(ready_steps: list, end_steps: list, c: float, o: float) -> tuple:
        ready = dict(zip(floor["grad_names"], _column_medians(ready_steps), strict=True))
        stream_s = statistics.median(ends[-1] for ends in end_steps)  # the last bucket's end
        took = [stream_s * f for f in share]
        full = [
            max((ready.get(n, 0.0) for n in names), default=0.0) for names in comm["bucket_names"]
        ]
        last_end = served_in_order(full, took)
        return max(c, last_end + o), last_end, full, took

    def in_round(rows: list, rounds: list[int], k: int) -> list:
        return [row for row, rnd in zip(rows, rounds, strict=True) if rnd == k]

    c = statistics.median(floor["step_times_s"])
    o = statistics.median(floor["optimizer_s"])
    achievable, last_end, full, took = replay(floor["ready_s"], comm["bucket_end_s"], c, o)
    floor_rounds, comm_rounds = floor["step_rounds"], comm["step_rounds"]
    per_round = {}
    for k in sorted(set(floor_rounds) & set(comm_rounds)):
        per_round[str(k)] = (
            replay(
                in_round(floor["ready_s"], floor_rounds, k),
                in_round(comm["bucket_end_s"], comm_rounds, k),
                statistics.median(in_round(floor["step_times_s"], floor_rounds, k)),
                statistics.median(in_round(floor["optimizer_s"], floor_rounds, k)),
            )[0]
            * 1e3
        )
    return {
        "achievable_ms": achievable * 1e3,
        "achievable_by": "compute" if c >= last_end + o else "communication",
        "last_allreduce_end_ms": last_end * 1e3,
        "bucket_ready_ms": [t * 1e3 for t in full],
        "allreduce_ms": [t * 1e3 for t in took],
        # As measured in communication_alone, for the record: see above.
        "bucket_end_ms": [t * 1e3 for t in _column_medians(comm["bucket_end_s"])],
        "achievable_per_round_ms": per_round,
    }


def _column_medians(rows: list[list[float]]) -> list[float]:
    """The median of each column of a table given as rows (one per step)."""
    return [statistics.median(column) for column in zip(*rows, strict=True)]


def _ratio(value: float, base: float | None) -> float | None:
    return value / base if base else None


def _round_medians(times: list[float], rounds: list[int]) -> dict[int, float]:
    """Round -> the median of the times taken in it."""
    by_round: dict[int, list[float]] = {}
    for t, k in zip(times, rounds, strict=True):
        by_round.setdefault(k, []).append(t)
    return {k: statistics.median(ts) for k, ts in sorted(by_round.items())}


def _paired(result: dict, base_by_round: dict[int, float]) -> dict | None:
    """Median over rounds of (this variant's median / the base's in that round).

    Both come from the same round, minutes apart at most, so a slow spell of the shared
    machine cancels out of the ratio; its spread says how far a ratio can be trusted."""
    mine = _round_medians(result["step_times_s"], result["step_rounds"])
    ratios = [m / base_by_round[k] for k, m in mine.items() if base_by_round.get(k)]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def workload_key(cfg: Config, swept: str = "") -> str:
    """What --merge matches on: the same model, global batch, micro-batches per step,
    bucket cap, backend, world size and network (loopback keys name none, as before),
    and the field swept, if any."""
    shape = f"-w{cfg.width}-d{cfg.depth}" if cfg.model in ("mlp", "frozen") else ""
    rate = network()["rate"]
    return (
        f"{cfg.model}{shape}-b{global_batch(cfg)}-k{cfg.accumulation_steps}"
        f"-cap{cfg.bucket_cap_mb:g}-{dist.get_backend()}-x{dist.get_world_size()}"
        + ("" if rate == "loopback" else f"-{rate.split()[0]}")
        + (f"-sweep-{swept}" if swept else "")
    )


def network() -> dict:
    """The network the ranks talk over, as `launch` passed it on (BENCH_NETWORK); a
    launcher of the user's own says nothing, and the network is then unknown."""
    return json.loads(os.environ.get("BENCH_NETWORK", '{"rate": "unknown (own launcher)"}'))


def network_label(settings: dict) -> str:
    """'loopback', '1gbit', ...; records made before --network existed ran on loopback."""
    return settings.get("network", {"rate": "loopback"})["rate"].split()[0]


def _torchrun_command() -> str:
    """The command as best known when a launcher of the user's own started us."""
    world = os.environ.get("WORLD_SIZE", "?")
    return command_line("profiling.bench", python=f"torchrun --standalone --nproc-per-node {world}")
