"""The arithmetic and the tables of `python -m profiling.overhead`: what each variant
adds to a step over the bare model, paired within each round, and its ratio to what
torch's DDP adds; printed per world size, and as the docs' Markdown fragment."""

from __future__ import annotations

import statistics

from profiling.common.report import markdown_table, produced_by

BARE = "bare"  # the plain model: the baseline every "added" is measured from
REFERENCE = "torch_ddp"  # torch's DistributedDataParallel: every ratio's denominator


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_summary(
    per_round_s: dict[str, list[float]],
    parameters: int,
    bare: str = BARE,
    reference: str = REFERENCE,
) -> dict[str, dict]:
    """Per variant, from its seconds per step in each round (index = round):
    `step_us` (median, min, max over rounds), `added_us` (its time minus `bare`'s in the
    same round, median, min, max; None for bare itself), `added_us_per_param` (the
    median added over `parameters`), and `ratio` (its added over `reference`'s added in
    the same round: median, min, max over the rounds where the reference added more than
    nothing, and how many those were; None for bare, or when there are none)."""
    base = per_round_s[bare]
    ref_added = None
    if reference in per_round_s:
        ref_added = [t - b for t, b in zip(per_round_s[reference], base, strict=True)]
    out: dict[str, dict] = {}
    for name, times in per_round_s.items():
        entry: dict = {"step_us": spread([t * 1e6 for t in times])}
        if name == bare:
            out[name] = {**entry, "added_us": None, "added_us_per_param": None, "ratio": None}
            continue
        added = [t - b for t, b in zip(times, base, strict=True)]
        entry["added_us"] = spread([a * 1e6 for a in added])
        entry["added_us_per_param"] = entry["added_us"]["median"] / parameters
        # A round where the reference added nothing (noise can make its added time
        # negative) has no meaningful ratio: left out, and the count says so.
        ratios = [a / r for a, r in zip(added, ref_added or [], strict=False) if r > 0]
        entry["ratio"] = {**spread(ratios), "rounds": len(ratios)} if ratios else None
        # The whole step over the reference's, per round: what a user of the wrapper pays.
        steps = [t / r for t, r in zip(times, per_round_s.get(reference, []), strict=False)]
        entry["step_ratio"] = spread(steps) if steps else None
        out[name] = entry
    return out


def world_result(world: int, record: dict, elapsed_s: float) -> dict:
    """A world size's JSON entry: per variant the wall-time summary, with the CPU-time
    summary beside it, and the raw seconds per step per round."""
    wall = paired_summary(record["wall_s"], record["parameters"])
    cpu = paired_summary(record["cpu_s"], record["parameters"])
    identical = record["replicas_identical"]
    variants = {
        name: {**entry, "cpu": cpu[name], "replicas_identical": identical.get(name)}
        for name, entry in wall.items()
    }
    raw = {k: record[k] for k in ("wall_s", "cpu_s")}
    return {"world_size": world, "elapsed_s": round(elapsed_s, 1), "variants": variants, **raw}


def format_table(result: dict, rounds: int, last: str | None) -> str:
    """The table of one world size, the note on what its ratios are, and the last
    stage's ratio in a sentence."""
    world, variants = result["world_size"], result["variants"]
    header = ["variant", "µs/step", "added µs/step [min–max]", "added µs/param",
              f"× {REFERENCE}'s added [min–max]", "CPU added µs/step",
              f"step × {REFERENCE}'s"]  # fmt: skip
    rows = []
    for name, v in variants.items():
        added, ratio, cpu = v["added_us"], v["ratio"], v["cpu"]["added_us"]
        if added is None:
            rows.append([name, f"{v['step_us']['median']:.0f}", "baseline", "", "", "", ""])
            continue
        rows.append([
            name,
            f"{v['step_us']['median']:.0f}",
            f"{added['median']:.0f} {_range(added, '.0f')}",
            f"{v['added_us_per_param']:.2f}",
            "" if ratio is None else f"{ratio['median']:.2f}x {_range(ratio, '.2f', 'x')}",
            f"{cpu['median']:.0f}",
            "" if v["step_ratio"] is None else f"{v['step_ratio']['median']:.3f}x",
        ])  # fmt: skip
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = [f"\n{ranks(world)} ({result['elapsed_s']:.0f} s):"]
    for row in [header, *rows]:
        cells = [c.rjust(w) for c, w in zip(row, widths, strict=True)]
        cells[0] = row[0].ljust(widths[0])  # names left, numbers right
        lines.append("  ".join(cells).rstrip())
    lines.append(
        f"note: ratios from one interleaved run of {rounds} round(s) on a shared machine (added ="
        " variant - bare in the same round;\n      medians and min–max over rounds): another "
        "run will differ, by about the ranges shown."
    )
    v = variants.get(last or "")
    if v is not None and v["ratio"] is not None:
        lines.append(
            f"{last} adds {v['ratio']['median']:.1f}x what {REFERENCE} adds at "
            f"{ranks(world)} (rounds: {v['ratio']['rounds']})"
        )
        cpu = v["cpu"]["ratio"]
        if cpu is not None:  # steadier where the ranks wait on each other's scheduling
            lines.append(
                f"  in main-thread CPU time: {cpu['median']:.1f}x {_range(cpu, '.1f', 'x')} "
                f"(rounds: {cpu['rounds']})"
            )
    elif v is not None:  # on a busy machine the reference's addition can drown in noise
        lines.append(
            f"{last}: no ratio at {ranks(world)} ({REFERENCE} added nothing measurable "
            "in any round)"
        )
    if v is not None and v["step_ratio"] is not None:
        step = v["step_ratio"]
        lines.append(
            f"{last}'s step is {step['median']:.3f}x {REFERENCE}'s "
            f"{_range(step, '.3f', 'x')} at {ranks(world)}"
        )
    return "\n".join(lines)


def markdown(results: dict[str, dict], command: str, host: dict, rounds: int) -> str:
    """The docs' fragment: per variant and world size, the time it adds per step over
    the bare model and that over torch_ddp's (medians of the rounds, with the range)."""
    worlds = list(results)
    header = ["variant"]
    for w in worlds:
        header += [f"added µs/step, {ranks(int(w))}", f"× {REFERENCE}'s"]
    body = []
    for name in next(iter(results.values()))["variants"]:
        if name == BARE:
            continue
        row = [f"`{name}`"]
        for w in worlds:
            v = results[w]["variants"][name]
            ratio = v["ratio"]
            row += [
                f"{v['added_us']['median']:.0f}",
                "" if ratio is None else f"{ratio['median']:.2f} {_range(ratio, '.2f')}",
            ]
        body.append(row)
    bare = ", ".join(
        f"{results[w]['variants'][BARE]['step_us']['median']:.0f} µs at {ranks(int(w))}"
        for w in worlds
    )
    return (
        produced_by([command], f" on {host['cpu']} ({host['cores']} cores), torch {host['torch']}")
        + "\n\n"
        + markdown_table(header, body)
        + f"\n\nThe bare model's step: {bare}. Medians of {rounds} interleaved rounds, "
        "[min–max] over them; added = the variant's step minus the bare model's in the same "
        "round. One run on a shared machine: another differs by about the ranges shown.\n"
    )


def ranks(world: int) -> str:
    return f"{world} rank{'s' if world > 1 else ''}"


def _range(spread: dict, spec: str, unit: str = "") -> str:
    return f"[{spread['min']:{spec}}{unit}–{spread['max']:{spec}}{unit}]"
