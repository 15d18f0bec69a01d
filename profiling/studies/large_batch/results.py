"""The results: final validation error per (k, rule) over seeds, as a Markdown table
and as figures."""

from __future__ import annotations

import math
import platform
import statistics
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from profiling.common import report
from profiling.common.report import machine, markdown_table, produced_by
from profiling.studies.large_batch.experiment import Run
from profiling.studies.large_batch.lr import linear_scaled_lr
from profiling.studies.large_batch.settings import Settings


def summarise(s: Settings, runs: list[Run]) -> dict:
    """Per (k, variant): final validation error, mean and std over seeds."""
    table = {}
    for k in s.worker_list:
        for v in s.variant_list:
            errors = [r.final_val_error for r in runs if r.workers == k and r.variant == v]
            table[f"{k},{v}"] = {
                "workers": k,
                "global_batch": k * s.per_worker_batch,
                "variant": v,
                "mean": statistics.mean(errors),
                "std": statistics.stdev(errors) if len(errors) > 1 else 0.0,
                "diverged": sum(r.diverged for r in runs if r.workers == k and r.variant == v),
            }
    return table


def markdown(s: Settings, table: dict, runs: list[Run], wall_s: float, command: str) -> str:
    m = machine()
    host = f"{platform.node() or 'this machine'}, {m['cores']} cores, torch {m['torch']}"
    lines = [
        produced_by([command], f" in {wall_s / 60:.1f} min ({host})"),
        "",
        f"Final top-1 validation error (%), mean ± std over {s.seeds} "
        f"seed{'s' if s.seeds > 1 else ''}; "
        f"{s.epochs} epochs, per-worker batch n = {s.per_worker_batch}, "
        f"base lr {s.base_lr} at batch {s.reference_batch}, {s.warmup_epochs:g} warmup "
        f"epochs, {s.decay} decay.",
    ]
    header = ["k", "global batch k·n", "steps/epoch", "scaled lr", *s.variant_list]
    body = []
    for k in s.worker_list:
        first = next(r for r in runs if r.workers == k)
        scaled = linear_scaled_lr(s.base_lr, k, s.per_worker_batch, s.reference_batch)
        cells = []
        for v in s.variant_list:
            row = table[f"{k},{v}"]
            cell = f"{100 * row['mean']:.2f} ± {100 * row['std']:.2f}"
            if row["diverged"]:
                cell += f" ({row['diverged']} diverged)"
            cells.append(cell)
        body.append(
            [str(k), str(k * s.per_worker_batch), str(first.iters_per_epoch), f"{scaled:g}", *cells]
        )
    lines += ["", markdown_table(header, body, left=0)]
    return "\n".join(lines) + "\n"


def plot(s: Settings, table: dict, runs: list[Run], prefix: str) -> list[Path]:
    matplotlib.use("Agg")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    paths = [Path(f"{prefix}-error.png"), Path(f"{prefix}-curves.png")]

    font = report.FIGURE_FONT_PT
    fig, ax = plt.subplots(figsize=(report.FIGURE_WIDTH_IN, 4.6))
    batches = [k * s.per_worker_batch for k in s.worker_list]
    for v in s.variant_list:
        rows = [table[f"{k},{v}"] for k in s.worker_list]
        ax.errorbar(
            batches,
            [100 * r["mean"] for r in rows],
            yerr=[100 * r["std"] for r in rows],
            marker="o",
            capsize=3,
            label=v,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches], fontsize=font)
    ax.tick_params(labelsize=font)
    ax.set_xlabel("global batch k·n", fontsize=font)
    ax.set_ylabel("final validation error (%)", fontsize=font)
    ax.set_title(
        f"Validation error after {s.epochs} epochs (mean ± std, {s.seeds} seeds)", fontsize=font
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=font)
    fig.tight_layout()
    report.save_figure(fig, paths[0])
    plt.close(fig)

    variants = s.variant_list
    cols = 2 if len(variants) > 1 else 1
    rows_n = math.ceil(len(variants) / cols)
    fig, axes = plt.subplots(
        rows_n, cols, figsize=(report.FIGURE_WIDTH_IN, 3.2 * rows_n), sharex=True, sharey=True
    )
    axes = [axes] if len(variants) == 1 else list(getattr(axes, "flat", axes))
    colors = plt.cm.viridis([i / max(len(s.worker_list) - 1, 1) for i in range(len(s.worker_list))])
    for ax, v in zip(axes, variants, strict=False):
        for k, color in zip(s.worker_list, colors, strict=True):
            curves = [r.train_error for r in runs if r.workers == k and r.variant == v]
            length = min(len(c) for c in curves)
            mean = [100 * statistics.mean(c[e] for c in curves) for e in range(length)]
            ax.plot(
                range(1, length + 1), mean, color=color, label=f"k·n = {k * s.per_worker_batch}"
            )
        ax.set_title(v, fontsize=font)
        ax.tick_params(labelsize=font)
        ax.grid(alpha=0.3)
    for ax in axes[len(variants) :]:
        ax.axis("off")
    axes[0].legend(fontsize=font)
    for ax in axes:
        ax.set_ylim(0, 40)  # the interesting range; diverged runs (~90%) leave the top
    fig.supxlabel("epoch", fontsize=font)
    fig.supylabel("training error (%), mean over seeds, clipped at 40", fontsize=font)
    fig.tight_layout()
    report.save_figure(fig, paths[1])
    plt.close(fig)
    return paths
