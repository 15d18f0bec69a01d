"""What a run shows and writes: one line of settings, the bound, the table on stdout,
the markdown fragment, and the --json, --markdown and --plot files."""

from __future__ import annotations

from pathlib import Path

from profiling.bench.options import COMM, FLOOR, BenchOptions
from profiling.bench.plot import plot
from profiling.bench.records import network_label
from profiling.common.report import markdown_table, produced_by, read_json, write_json


def describe(record: dict) -> str:
    """One line: the machine and the settings the numbers only hold for."""
    m, s = record["machine"], record["settings"]
    shape = f" width {s['width']} depth {s['depth']}" if "width" in s else ""
    sweep = s.get("sweep")
    swept = "" if sweep is None else sweep["field"]
    batch = (
        "per-rank batch swept"
        if swept in ("batch_size", "global_batch_size")
        else f"per-rank batch {s['per_rank_batch']} (global {s['global_batch']})"
    )
    micro = (
        "micro-batches per step swept"
        if swept == "accumulation_steps"
        else f"{s['accumulation_steps']} micro-batch(es) per step"
    )
    cap = "" if swept == "bucket_cap_mb" else f"; bucket_cap_mb {s['bucket_cap_mb']:g}"
    swept_text = (
        ""
        if sweep is None
        else f"; {swept} swept over {', '.join(f'{v:g}' for v in sweep['values'])}, "
        "every value's variants interleaved in the same rounds"
    )
    return (
        f"{s['model']}{shape}, {s['parameters']:,} parameters; {batch}, {micro}{cap}"
        f"{swept_text}; {s['world_size']} ranks "
        f"on {s['backend']} over {describe_network(s.get('network'))}; "
        f"{m['usable_cores']} of {m['cores']} cores ({m['cpu']}), "
        f"{m['threads_per_rank']} thread(s) per rank; torch {m['torch']}; "
        f"{s['rounds']} rounds x {s['steps_per_round']} timed steps per variant "
        f"(+{s['round_warmup']} untimed per round, {s['warmup_steps']} warm-up); "
        f"1/5/15-min load average {m.get('load_average_before')} before, "
        f"{m['load_average_end']} at the end (this run's ranks add about "
        f"{s['world_size']}); {s.get('elapsed_s', '?')} s of rounds; {m['date_utc']} UTC"
    )


def describe_network(net: dict | None) -> str:
    if net is None or net["rate"] == "loopback":
        return "loopback"
    if net.get("probe") is None:
        return net["rate"]
    p = net["probe"]
    return (
        f"one network namespace per rank, links shaped to {net['rate']} each way (tbf), "
        f"Gloo all-reduce of {p['bytes'] / 1e6:g} MB measured at {p['MBps']:.0f} MB/s "
        f"(tensor bytes / time; {p['expected_MBps']:.0f} expected)"
    )


def describe_bound(bound: dict, swept: str = "") -> str:
    """`bound = max(compute_only C, forward F + communication alone A + optimizer O)`."""
    value = "" if not swept else f"{swept} {bound['sweep_value']:g}: "
    k = bound.get("accumulation_steps", 1)
    # With k micro-batches, F runs from the start to the end of the last forward.
    head = "forward" if k == 1 else f"{k - 1} micro-batch{'es' if k > 2 else ''} + the last forward"
    text = (
        f"{value}perfect-overlap bound = max(compute_only {bound['compute_only_ms']:.1f}, "
        f"{head} {bound['forward_ms']:.1f} + communication alone "
        f"{bound['communication_alone_ms']:.1f} + optimizer {bound['optimizer_ms']:.1f}) "
        f"= {bound['bound_ms']:.1f} ms ({bound['bound_by']}-bound)"
    )
    if "achievable_ms" not in bound:
        return text
    return (
        f"{text}; achievable bound = max(compute_only {bound['compute_only_ms']:.1f}, "
        f"last all-reduce's end {bound['last_allreduce_end_ms']:.1f} + optimizer "
        f"{bound['optimizer_ms']:.1f}) = {bound['achievable_ms']:.1f} ms "
        f"({bound['achievable_by']}-bound; {_buckets(len(bound['allreduce_ms']))}, each "
        "started once its last gradient was ready and the one before had ended)"
    )


def columns(record: dict) -> list[str]:
    """The table's columns: a first one for the swept value, per micro-batch time where
    a step has several."""
    sweep = record["settings"].get("sweep")
    several = any(v.get("accumulation_steps", 1) > 1 for v in record["variants"])
    return [
        *([sweep["field"]] if sweep else []),
        "variant",
        "median ms",
        *(["ms per micro-batch"] if several else []),
        "min-max ms",
        "vs torch_ddp",
        "per round vs torch_ddp",
        "vs compute_only",
        *(["vs bound", "per round vs bound"] if record.get("bounds") else []),
        *(["vs achievable"] if _has_achievable(record) else []),
        "exposed comm ms",
        "all-reduces/step",
        "steps (rounds)",
        "replicas identical",
    ]


def _buckets(n: int) -> str:
    return f"{n} bucket" if n == 1 else f"{n} buckets"


def _has_achievable(record: dict) -> bool:
    """Whether the record has the achievable bound (records before it have not)."""
    return any("achievable_ms" in b for b in record.get("bounds", []))


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _fmt_paired(paired: dict | None) -> str:
    if paired is None:
        return "n/a"
    return f"{paired['median']:.2f}x ({paired['min']:.2f}-{paired['max']:.2f})"


def rows(record: dict) -> list[list[str]]:
    names = columns(record)
    out = []
    for v in record["variants"]:
        identical = v["replicas_identical"]
        cells = {
            "variant": v["name"],
            "median ms": f"{v['median_ms']:.1f}",
            "ms per micro-batch": _fmt(v.get("per_micro_batch_ms"), ".1f"),
            "min-max ms": f"{v['min_ms']:.1f}-{v['max_ms']:.1f}",
            "vs torch_ddp": _fmt(v["vs_torch_ddp"], ".2f", "x"),
            "per round vs torch_ddp": _fmt_paired(v["round_vs_torch_ddp"]),
            "vs compute_only": _fmt(v["vs_compute_only"], ".2f", "x"),
            "vs bound": _fmt(None if v["name"] == COMM else v.get("vs_bound"), ".2f", "x"),
            "per round vs bound": _fmt_paired(
                None if v["name"] == COMM else v.get("round_vs_bound")
            ),
            "vs achievable": _fmt(
                None if v["name"] == COMM else v.get("vs_achievable"), ".2f", "x"
            ),
            "exposed comm ms": _fmt(v["exposed_comm_ms"], ".1f"),
            "all-reduces/step": _fmt(v["allreduces_per_step"], "d"),
            "steps (rounds)": f"{v['steps']} ({v['rounds']})",
            "replicas identical": "n/a (no sync)"
            if v["name"] == FLOOR
            else "n/a"
            if identical is None
            else str(identical),
        }
        if names[0] not in cells:  # the swept field; None: one run serves every value
            cells[names[0]] = "all" if v["sweep_value"] is None else f"{v['sweep_value']:g}"
        out.append([cells[name] for name in names])
    return out


def sweep_summary(record: dict) -> tuple[list[str], list[list[str]]] | None:
    """One row per swept value: the bound's parts, then each training variant's time
    and its ratio to the bound (per micro-batch when accumulation_steps is swept)."""
    sweep = record["settings"].get("sweep")
    if sweep is None:
        return None
    per_micro = sweep["field"] == "accumulation_steps"
    key = "per_micro_batch_ms" if per_micro else "median_ms"
    unit = "ms per micro-batch" if per_micro else "ms"
    trained = []
    for v in record["variants"]:
        if v["name"] not in (FLOOR, COMM) and v["name"] not in trained:
            trained.append(v["name"])
    bounds = {b["sweep_value"]: b for b in record.get("bounds", [])}
    achievable = _has_achievable(record)
    header = [
        sweep["field"],
        f"compute_only {unit}",
        "communication alone ms",
        f"bound {unit}",
        *([f"achievable {unit}"] if achievable else []),
        *[f"{name} {unit} (vs bound)" for name in trained],
    ]
    out = []
    for value in sweep["values"]:
        mine = {v["name"]: v for v in record["variants"] if v["sweep_value"] in (value, None)}
        bound = bounds.get(value)
        k = value if per_micro else 1
        row = [
            f"{value:g}",
            _fmt(mine[FLOOR][key] if FLOOR in mine else None, ".1f"),
            _fmt(mine[COMM]["median_ms"] if COMM in mine else None, ".1f"),
            _fmt(None if bound is None else bound["bound_ms"] / k, ".1f"),
        ]
        if achievable:
            ms = None if bound is None else bound.get("achievable_ms")
            row.append(_fmt(None if ms is None else ms / k, ".1f"))
        for name in trained:
            v = mine.get(name)
            row.append(
                "n/a" if v is None else f"{v[key]:.1f} ({_fmt(v.get('vs_bound'), '.2f', 'x')})"
            )
        out.append(row)
    return header, out


def print_table(record: dict) -> None:
    print(f"\n{describe(record)}\nmedian of the slowest rank per step")
    swept = record["settings"].get("sweep", {}).get("field", "")
    for bound in record.get("bounds", []):
        print(describe_bound(bound, swept))
    tables = [(columns(record), rows(record))]
    summary = sweep_summary(record)
    if summary is not None:
        tables.append(summary)
    for header, body in reversed(tables):
        table = [header, *body]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        print()
        for row in table:
            print(
                "  ".join(
                    cell.rjust(w) if i else cell.ljust(w)
                    for i, (cell, w) in enumerate(zip(row, widths, strict=True))
                )
            )


def markdown(records: list[dict]) -> str:
    """A fragment for the docs: first line the commands, then one table per workload."""
    parts = [
        produced_by([r["command"] for r in records], ", from the repository root"),
        "",
        "Step time is the median over all timed steps of the slowest rank's time. "
        "*per round vs torch_ddp* is the median (and range) over rounds of the ratio "
        "within one round, where both sides share the machine's noise. *exposed comm* "
        "is step time minus compute-only time. The *bound* is the perfect-overlap bound "
        "max(compute_only, forward + communication alone + optimizer), its parts "
        "measured in the same rounds. The *achievable* bound, where shown, replays the "
        "overlapped schedule with no contention: each bucket of communication alone, "
        "taking its share by bytes of the time communication alone took, starts once its "
        "last gradient was ready in the compute_only steps and the bucket before it has "
        "ended; max(compute_only, that end + optimizer).",
    ]
    for r in records:
        s = r["settings"]
        title = f"{s['model']}, {s['parameters'] / 1e6:.1f}M parameters"
        if "sweep" in s:
            title += f", {s['sweep']['field']} swept"
        title += f", {s['world_size']} ranks, {network_label(s)}"
        parts += ["", f"### {title}", "", describe(r) + "."]
        swept = s.get("sweep", {}).get("field", "")
        if r.get("bounds"):
            parts += ["", *[f"- {describe_bound(b, swept)}" for b in r["bounds"]]]
        summary = sweep_summary(r)
        if summary is not None:
            parts += ["", markdown_table(*summary), "", "Every variant:"]
        parts += ["", markdown_table(columns(r), rows(r))]
    return "\n".join(parts) + "\n"


def write_outputs(record: dict, opts: BenchOptions, records: list[dict] | None = None) -> None:
    """Write --json (merged into what is there with --merge), then --markdown and --plot
    of every record written (or of `records`, when given: --render)."""
    records = records or [record]
    if opts.merge and opts.json and Path(opts.json).exists():
        kept = read_json(opts.json, "profiling.bench", "workloads")["workloads"]
        # Replace this workload in place (keeps the order), append it if new.
        keys = [r["workload"] for r in kept]
        if record["workload"] in keys:
            kept[keys.index(record["workload"])] = record
            records = kept
        else:
            records = [*kept, record]
    if opts.json:
        write_json(opts.json, {"workloads": records})
        print(f"wrote {opts.json}")
    if opts.markdown:
        Path(opts.markdown).write_text(markdown(records))
        print(f"wrote {opts.markdown}")
    if opts.plot:
        plot(records, opts.plot)
        print(f"wrote {opts.plot}")
