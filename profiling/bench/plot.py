"""The figure: one panel per workload, bars against the bound or a sweep's curves."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt

from profiling.bench.options import COMM, FLOOR, REFERENCE
from profiling.bench.records import network_label

COLORS = {FLOOR: "0.55", COMM: "0.8", REFERENCE: "tab:orange"}
# Legible at the docs' width (about 770 px): figures 8 in wide (bar panels one above the
# other, sweep panels two side by side), drawn at 160 dpi, so 10 pt text shows at 10 pt.
SWEEP_PANEL_IN = (4.0, 3.4)
BARS_PANEL_IN = (8.0, 3.6)
DPI = 160
FONT_PT = 10


def plot(records: list[dict], path: str) -> None:
    """One panel per workload: horizontal bars (median, whiskers min to max) against
    the bound, or for a sweep, each training variant's median against the swept value
    with its p25-p75 band, the bound and compute_only."""
    matplotlib.use("Agg")
    sweeps = all("sweep" in r["settings"] for r in records)
    ncols = min(len(records), 2) if sweeps else 1
    nrows = -(-len(records) // ncols)
    width, height = SWEEP_PANEL_IN if sweeps else BARS_PANEL_IN
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax in axes.flat[len(records) :]:
        ax.set_visible(False)
    for ax, record in zip(axes.flat, records, strict=False):
        s = record["settings"]
        title = f"{s['model']} {s['parameters'] / 1e6:.1f}M, per-rank batch {s['per_rank_batch']}"
        cores = record["machine"].get("usable_cores")
        title += f"\n{s['world_size']} ranks on {cores} cores, {network_label(s)}"
        if "sweep" in s:
            _plot_sweep(ax, record)
        else:
            title += f", bucket cap {s['bucket_cap_mb']:g} MiB"
            _plot_bars(ax, record)
        ax.set_title(title, fontsize=FONT_PT)
        ax.grid(axis="x" if "sweep" not in s else "y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _plot_bars(ax, record: dict) -> None:
    variants = record["variants"][::-1]  # first variant on top
    names = [v["name"] for v in variants]
    medians = [v["median_ms"] for v in variants]
    whiskers = [
        [v["median_ms"] - v["min_ms"] for v in variants],
        [v["max_ms"] - v["median_ms"] for v in variants],
    ]
    colors = [COLORS.get(n, "tab:blue") for n in names]
    ax.barh(names, medians, xerr=whiskers, color=colors, capsize=2, error_kw={"lw": 0.8})
    bounds = record.get("bounds")
    if bounds:
        b = bounds[0]["bound_ms"]
        ax.axvline(b, color="k", ls="--", lw=1)
        ax.text(b, len(variants) - 0.45, f" perfect-overlap bound {b:.0f} ms", fontsize=FONT_PT)
        ax.set_ylim(-0.6, len(variants))
        for y, v in enumerate(variants):
            if v["name"] not in (FLOOR, COMM):
                ax.text(
                    v["max_ms"], y, f" {v['vs_bound']:.2f}x bound", va="center", fontsize=FONT_PT
                )
    ax.set_xlim(0, max(v["max_ms"] for v in variants) * 1.3)  # room for the "x bound" labels
    ax.set_xlabel("step time, ms (median; whiskers min-max)", fontsize=FONT_PT)
    ax.tick_params(labelsize=FONT_PT)


def _plot_sweep(ax, record: dict) -> None:
    sweep = record["settings"]["sweep"]
    values = sweep["values"]
    per_micro = sweep["field"] == "accumulation_steps"
    key = "per_micro_batch_ms" if per_micro else "median_ms"
    x = range(len(values))  # evenly spaced: the values span up to 12 decades

    def series(name: str, field: str) -> list[float | None]:
        by_value = {v["sweep_value"]: v for v in record["variants"] if v["name"] == name}
        out = []
        for value in values:
            v = by_value.get(value, by_value.get(None))  # None: one run for every value
            k = value if per_micro else 1
            out.append(None if v is None else v[field] / (k if field != key else 1))
        return out

    names = []
    for v in record["variants"]:
        if v["name"] not in names:
            names.append(v["name"])
    for name in names:
        if name == COMM:
            continue
        y = series(name, key)
        style = {"color": COLORS.get(name)} if name in COLORS else {}
        if name == FLOOR:
            ax.plot(x, y, ls=":", marker=".", label=name, **style)
            continue
        ax.plot(x, y, marker="o", ms=4, label=name, **style)
        ax.fill_between(x, series(name, "p25_ms"), series(name, "p75_ms"), alpha=0.2, **style)
    bounds = {b["sweep_value"]: b["bound_ms"] for b in record.get("bounds", [])}
    if bounds:
        ax.plot(
            x,
            [bounds.get(v, float("nan")) / (v if per_micro else 1) for v in values],
            color="k",
            ls="--",
            lw=1,
            label="perfect-overlap bound",
        )
    ax.set_xticks(list(x), [f"{v:g}" for v in values], fontsize=FONT_PT)
    label = {"bucket_cap_mb": "bucket_cap_mb (MiB)", "accumulation_steps": "micro-batches per sync"}
    ax.set_xlabel(label.get(sweep["field"], sweep["field"]), fontsize=FONT_PT)
    ax.set_ylabel("ms per micro-batch" if per_micro else "step time, ms (median)", fontsize=FONT_PT)
    ax.set_ylim(bottom=0)
    # Below the axes: inside, it would cover the lowest line (compute_only).
    ax.legend(fontsize=FONT_PT, loc="upper center", bbox_to_anchor=(0.5, -0.26), ncols=2,
              frameon=False)  # fmt: skip
    ax.tick_params(labelsize=FONT_PT)
