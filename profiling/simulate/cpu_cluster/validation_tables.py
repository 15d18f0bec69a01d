"""The validation's tables: the text table the command prints, and the markdown fragment
the simulator's page includes (how it was made, the calibration, each stage's own time,
the predictions against the measurements, the two checks and the summary line).
"""

from __future__ import annotations

from profiling.common.report import markdown_table, produced_by
from profiling.simulate.cpu_cluster.analyse import (
    BENCH_ROUNDS,
    BENCH_STEPS,
    ranking_line,
    summary_line,
)
from profiling.simulate.cpu_cluster.predict import CAPS_MB, STAGES


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
                    f"{b['grid_steps']}",
                    "yes (missed)" if b["beyond_noise"] else "no",
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


def _own_steps_table(calibrations: list[dict]) -> list[str]:
    """The markdown lines of each stage's own time as the calibrations timed it (none
    for calibrations made before it was): ms beyond the compute, by cap."""
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
        f"(`measure.own_steps`), at each cap in turn (MiB: {caps}); the model adds what "
        "the copies leave of it:",
        "",
        markdown_table(["cluster", "model", "compute alone ms", *STAGES], rows, left=2),
    ]
