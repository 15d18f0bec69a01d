"""Scaling efficiency against the smallest of --gpus (default 8 to 256), and bucket sizes.

    python -m profiling.simulate scale --model mypackage.models:build \\
        --input-shape 3,224,224 --batch-size 32 --iteration-ms 180 \\
        --cluster dgx_a100 --gpus 1,8,16,64,256 --json scaling.json
    python -m profiling.simulate scale --model resnet50 --network li2020
    python -m profiling.simulate scale --model bert_large --network li2020
    python -m profiling.simulate scale --model resnet50 --network goyal2017 \\
        --algorithm hierarchical_halving_doubling
    python -m profiling.simulate scale --model resnet50 --network li2020 --inter-gbps 25

Weak scaling, as both papers measure it: every GPU keeps its batch, so p GPUs process
p times the samples of one, and a step of p GPUs takes T(p) = one GPU's compute plus
whatever communication it cannot hide (`schedule.simulate` on the cluster's all-reduce
cost, `topology`). The scaling efficiency at p is the per-GPU throughput there over the
per-GPU throughput at the reference count p0, the smallest of --gpus (they are sorted,
in whatever order given): by default 8, one full server; --gpus 1,... measures against
one GPU without DDP, as Goyal et al. and Horovod report it:

    E(p) = (batch / T(p)) / (batch / T(p0)) = T(p0) / T(p)

E(p0) = 1; E(256) = 0.9 is Goyal et al.'s "~90% scaling efficiency from 8 to 256
GPUs". With bandwidths and latencies that do not improve with more servers, every
all-reduce costs at least as much on more GPUs, so in this model E never rises with p.

The bare model runs high against published measurements, so the E(p) printed is the
central figure: each step of 2 GPUs or more also loses the share of compute fitted on
them (`accuracy.FITTED`), with a range beside it from their held-out errors, the bare
model's E next to both. `--measured 1:T1,2:T2,8:T8` (your runs' ms per step) fits that
loss to your own runs instead.

The bucket-size curve is the step time at each bucket_cap_mb of --bucket-caps (MiB,
the stages' layout rule), plus one bucket per parameter and a single bucket for all.
Every layout here, E(p)'s at --bucket-cap-mb too, is uniform caps by the stages' rule in
reverse parameter order, not torch's default layout (a 1 MiB first bucket, then 25 MiB):
a "25" here is not torch's default; `buckets` sets the two side by side.
Every output begins with the model's and the cluster's numbers, each with its source.
Writes a results JSON, a Markdown fragment and a figure under runs/simulate/ (or
--out); --docs refreshes the docs' own table and figure; --json FILE writes the JSON.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict

import matplotlib
import matplotlib.pyplot as plt

from profiling.common import report
from profiling.common.report import markdown_table, produced_by
from profiling.simulate import accuracy, clusters, model_args, outputs
from profiling.simulate.layouts import uniform_buckets
from profiling.simulate.schedule import Sharing, StageSchedule, Workload, simulate
from profiling.simulate.topology import cost_model

DEFAULT_GPUS = [8, 16, 32, 64, 128, 256]
DEFAULT_CAPS_MB = [1, 2, 5, 10, 25, 50, 100, 200]
PER_PARAMETER, ONE_BUCKET = "per parameter", "one bucket"
PUBLISHED_SPREAD = (accuracy.RECORD.lo, accuracy.RECORD.hi)  # the range's, at every count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    model_args.add_arguments(parser)
    clusters.add_arguments(parser)
    add = parser.add_argument
    # fmt: off
    add("--nodes", type=int, help="sweep up to this many servers (drops larger --gpus)")
    add("--gpus", default=",".join(map(str, DEFAULT_GPUS)),
        help="GPU counts, comma-separated, in any order: sorted, and E(p) is against the "
        "smallest; by default from 8 (one full server) to 256; start at 1 for efficiency "
        "against one GPU (default: %(default)s)")
    add("--bucket-cap-mb", type=float, default=25.0,
        help="the bucket cap of the efficiency curve, MiB: uniform buckets by the stages' "
        "rule, not torch's default layout (default: %(default)s)")
    add("--bucket-caps", default=",".join(map(str, DEFAULT_CAPS_MB)),
        help="bucket caps of the bucket-size curve, MiB, comma-separated (default: %(default)s)")
    add("--slowdown", type=float, default=0.0,
        help="backward's slowdown while a collective runs, a finite number >= 0: 0.5 makes it "
        "1.5 times as long (default 0: none, as on a GPU whose communication has its own "
        "engine)")
    add("--after-backward", action="store_true",
        help="all-reduce after backward (bucketed) instead of during it")
    add("--measured", metavar="P:MS,...",
        help="ms per step of your own runs at 2+ GPU counts, in --gpus or not, the smallest "
        "the smallest of --gpus (batch per GPU as --batch-size), e.g. 1:180,2:190,8:197: the "
        "loss the model leaves out is fitted on them instead of on published measurements")
    # fmt: on
    outputs.add_arguments(parser)
    parser.add_argument("--json", help="write the results JSON here (besides --out's files)")
    parser.add_argument("--markdown", help="write the Markdown fragment here")
    parser.add_argument("--plot", help="write the figure here")


# --8<-- [start:sweep]
def layouts(workload: Workload, caps_mb: list[float]) -> dict[str, list[list[int]]]:
    """Bucket layouts by label: one per parameter, each cap's, one bucket; all in
    reverse parameter order, as the stages build them."""
    last_first = list(reversed(range(len(workload.grads))))
    out = {PER_PARAMETER: [[i] for i in last_first]}
    for cap in caps_mb:
        out[f"{cap:g}"] = uniform_buckets(workload, cap)
    out[ONE_BUCKET] = [last_first]
    return out


def step_seconds(
    workload: Workload, buckets, cost, *, overlap: bool = True, slowdown: float = 0.0
) -> float:
    schedule = StageSchedule(overlap=overlap)
    return simulate(workload, buckets, cost, schedule, Sharing(slowdown)).step_s


def sweep(
    workload: Workload,
    topo,
    algorithm: str,
    gpus: list[int],
    bucket_cap_mb: float,
    caps_mb: list[float],
    *,
    overlap: bool = True,
    slowdown: float = 0.0,
    loss: accuracy.Loss | None = None,
    spread=lambda _: PUBLISHED_SPREAD,
) -> dict:
    """E(p) at `bucket_cap_mb` and the bucket-size curve at every p in `gpus`. With
    `loss`, E(p) is the central figure (the bare steps plus the loss: `central_step_s`;
    the bare E `bare_efficiency`) and `range` is E + `spread(p)` (none at the reference),
    its top at most the bare E and 1 (the bare model is high on every published row)."""
    shapes = layouts(workload, sorted(set(caps_mb) | {bucket_cap_mb}))
    curve, scaling = [], []
    for p in gpus:
        here = topo.with_gpus(p)
        cost = cost_model(here, algorithm)
        for label, buckets in shapes.items():
            curve.append(
                {
                    "gpus": p,
                    "layout": label,
                    "buckets": len(buckets),
                    "step_s": step_seconds(
                        workload, buckets, cost, overlap=overlap, slowdown=slowdown
                    ),
                }
            )
        step = next(
            r["step_s"] for r in curve if r["gpus"] == p and r["layout"] == f"{bucket_cap_mb:g}"
        )
        scaling.append(
            {
                "gpus": p,
                "nodes": here.nodes,
                "step_s": step,
                # never below 0: a step equals its compute, to the last bit, or is longer
                "exposed_s": max(0.0, step - workload.compute_s),
            }
        )
    for row in scaling:
        row["efficiency"] = scaling[0]["step_s"] / row["step_s"]
    if loss is not None:
        central = [loss.step_s(r["step_s"], workload.compute_s, r["gpus"]) for r in scaling]
        for row, step in zip(scaling, central, strict=True):
            lo, hi = spread(row["gpus"]) if row is not scaling[0] else (0.0, 0.0)
            bare, e = row["efficiency"], central[0] / step
            row.update(bare_efficiency=bare, loss_s=step - row["step_s"], central_step_s=step,
                       efficiency=e, range=[e + lo, max(e, min(e + hi, bare, 1.0))])  # fmt: skip
    curve = [r for r in curve if r["layout"] in _curve_labels(caps_mb)]
    return {"scaling": scaling, "bucket_curve": curve}


# --8<-- [end:sweep]


def _curve_labels(caps_mb: list[float]) -> list[str]:
    return [PER_PARAMETER, *(f"{c:g}" for c in caps_mb), ONE_BUCKET]


def numbers(text: str, name: str, kind=float) -> list:
    """The numbers of a comma-separated flag, --`name`, or one line naming it."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name}: expected comma-separated numbers, got {text!r}") from None


def parse_measured(text: str, gpus: list[int]) -> dict[int, float]:
    """--measured P:MS,... as {GPUs: seconds per step}, the smallest count the smallest of
    `gpus` (the residuals are Es against it); one line naming --measured for anything else."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        times = [(int(p), float(ms)) for p, ms in pairs]
    except ValueError:
        raise SystemExit(f"scale: --measured {text!r}: expected GPUS:MS pairs, "
                         "e.g. 1:180,2:190,8:197") from None  # fmt: skip
    for p, ms in times:
        if not 0 < ms < float("inf"):
            raise SystemExit(f"scale: --measured: {ms:g} ms at {p} GPUs; times must be > 0")
    if len({p for p, _ in times}) != len(times) or len(times) < 2 or min(times)[0] != min(gpus):
        raise SystemExit(f"scale: --measured {text!r}: two or more GPU counts, each once, "
                         f"the smallest {min(gpus)} (the smallest of --gpus)")  # fmt: skip
    return {p: ms / 1e3 for p, ms in times}


def fitted_term(args, gpus, workload, topo, overlap: bool):
    """The loss the model leaves out and each count's range: the published fit's, or with
    --measured one fitted on the user's own runs; and the lines that say which."""
    if not getattr(args, "measured", None):
        return accuracy.FITTED, lambda _: PUBLISHED_SPREAD, [accuracy.header()]
    times = parse_measured(args.measured, gpus)
    buckets = uniform_buckets(workload, args.bucket_cap_mb)
    try:  # counts outside --gpus too: the cluster must take them
        clusters.check_gpus(topo, args.algorithm, sorted(times))
        bare = {p: step_seconds(workload, buckets, cost_model(topo.with_gpus(p), args.algorithm),
                                overlap=overlap, slowdown=args.slowdown)
                for p in times}  # fmt: skip
        points = accuracy.measured_points(times, bare, workload.compute_s)
        loss, free = accuracy.fit_measured(points)
    except ValueError as error:
        raise SystemExit(f"scale: --measured {args.measured}: "
                         + str(error).replace("--gpus", "GPU count")) from None  # fmt: skip
    held = ("held at 0: the fit put it below 0, your runs scaling better than the bare "
            "model; check --iteration-ms and --measured")  # fmt: skip
    said = {k: ("fitted" if getattr(loss, k) else held) if k in free else
            "kept at the published fit's" for k in ("multi", "per_doubling")}  # fmt: skip
    return loss, lambda p: accuracy.measured_range(points, loss, p), [
        f"bare model {accuracy.header(loss=None)}; central figure: "
        f"fitted on your runs at {', '.join(map(str, sorted(times)))} GPUs (--measured): "
        f"loss_multi {loss.multi:.4f} ({said['multi']}), loss_per_doubling "
        f"{loss.per_doubling:.4f} ({said['per_doubling']})",
        "your runs, E against " + f"{min(times)} GPU{'s' if min(times) > 1 else ''}: "
        + ", ".join(f"{pt.gpus}: {pt.published:.3f} (fit {pt.central(loss):.3f})"
                    for pt in points)
        + f"; range: the fit's residuals, at least +-{accuracy.MEASURED_MARGIN:.3f} for "
        f"each doubling beyond {max(times)} GPUs, its top at most the bare model's E and 1",
    ]  # fmt: skip


def run(args: argparse.Namespace) -> None:
    gpus = sorted(set(numbers(args.gpus, "gpus", int)))  # the smallest: the reference
    caps = numbers(args.bucket_caps, "bucket-caps")
    try:
        if not 0 <= args.slowdown < math.inf:  # also NaN; below 0 backward would speed up
            raise ValueError(f"--slowdown {args.slowdown:g}: backward's slowdown while a "
                             "collective runs must be a finite number >= 0 (0: none)")  # fmt: skip
        if args.nodes is not None and args.nodes < 1:
            raise ValueError(f"--nodes {args.nodes}: at least 1 server")
        cluster, custom = clusters.from_args(args)
        topo = cluster.topology
        if args.nodes:
            gpus = [p for p in gpus if p <= args.nodes * topo.gpus_per_node]
        if not gpus or min(gpus) < 1:
            raise ValueError(f"--gpus {args.gpus} (--nodes {args.nodes}): no GPU count of at "
                             "least 1 left to simulate")  # fmt: skip
        clusters.check_gpus(topo, args.algorithm, gpus)
        if not 0 < args.bucket_cap_mb < math.inf or any(not 0 < c < math.inf for c in caps):
            raise ValueError("--bucket-cap-mb and --bucket-caps must be > 0 (and finite)")
        workload, model_lines, model_settings = model_args.from_args(
            args, cluster.gpu, cluster.memory_bytes_per_s
        )
    except ValueError as error:
        raise SystemExit(f"scale: {error}") from None
    overlap = not args.after_backward
    loss, spread, accuracy_lines = fitted_term(args, gpus, workload, topo, overlap)
    result = sweep(
        workload, topo, args.algorithm, gpus, args.bucket_cap_mb, caps,
        overlap=overlap, slowdown=args.slowdown, loss=loss, spread=spread,
    )  # fmt: skip
    name = args.cluster + (" (modified)" if custom else "")
    result["settings"] = {
        "command": report.command_line("profiling.simulate"),
        **model_settings,
        "network": name,
        "sources": cluster.sources,
        "algorithm": args.algorithm,
        "bucket_cap_mb": args.bucket_cap_mb,
        "overlap": overlap,
        "slowdown": args.slowdown,
        "topology": asdict(topo),
        "workload": {
            "gradients": len(workload.grads),
            "gradient_bytes": sum(g.nbytes for g in workload.grads),
            "forward_s": workload.forward_s,
            "backward_s": workload.backward_s,
            "optimizer_s": workload.optimizer_s,
        },  # fmt: skip
        "assumptions": model_lines + clusters.describe(cluster, name, args.algorithm),
        "accuracy": accuracy_lines,
    }
    print(summary(result))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.no_files:
        return
    stem = f"scale-{outputs.stem(args.model)}-{args.cluster}" + ("-custom" if custom else "")
    results, images = outputs.folders(args)
    json_path = results / f"{stem}.json"
    md_path = args.markdown or results / f"{stem}.md"
    plot_path = args.plot or images / f"{stem}.png"
    written = [md_path, plot_path]
    if not args.docs:  # the docs include the table and the figure, never the JSON
        report.write_json(json_path, result)
        written.insert(0, json_path)
    with open(md_path, "w") as f:
        f.write(markdown(result))
    plot(result, plot_path)
    print("wrote " + ", ".join(map(str, written)))


# ---------------------------------------------------------------------------------------
# What a sweep says: printed, as Markdown, as a figure.


def summary(result: dict) -> str:
    s = result["settings"]
    lines = [
        *s.get("assumptions", []),
        "",
        f"{s['model']} on {s['network']}, {s['algorithm']}, "
        f"{'overlapped' if s['overlap'] else 'after backward'}, "
        f"bucket_cap_mb {s['bucket_cap_mb']:g}, batch {s['batch_per_gpu']} per GPU; "
        + _note(result),
        *s.get("accuracy", []),
        # With the range, the step is the bare model's; the central one adds `loss ms`.
        f"{'GPUs':>6} {'nodes':>6} {'bare step ms' if ranged(result) else 'step ms':>9} "
        f"{'exposed ms':>11} {'E(p)':>7}"
        + (f" {'range':>16} {'loss ms':>8} {'bare E':>7}" if ranged(result) else ""),
    ]
    for r in result["scaling"]:
        more = ""
        if "range" in r:
            more = f" {span(r):>16} {r['loss_s'] * 1e3:>8.1f} {r['bare_efficiency']:>7.3f}"
        lines.append(
            f"{r['gpus']:>6} {r['nodes']:>6} {r['step_s'] * 1e3:>9.1f} "
            f"{r['exposed_s'] * 1e3:>11.1f} {r['efficiency']:>7.3f}" + more
        )
    for p, best, step in (c for c in best_caps(result) if c[0] > 1):  # 1 GPU: no all-reduce
        lines.append(f"{p:>6} GPUs: fastest layout {best} ({step * 1e3:.1f} ms)")
    return "\n".join(lines)


def _note(result: dict) -> str:
    """What the rows are against and which buckets they use, for the header line."""
    ref = result["scaling"][0]["gpus"]
    return (
        f"E(p) against {ref} GPU{'s' if ref > 1 else ''}, the smallest of --gpus "
        "(sorted); every layout uniform caps by the stages' rule, not torch's default "
        "layout (`buckets` compares them)"
    )


def ranged(result: dict) -> bool:
    """Whether E(p) is the central figure with its range (`sweep`'s `loss`)."""
    return all("range" in r for r in result["scaling"])


def span(row: dict) -> str:
    lo, hi = row["range"]
    return f"[{lo:.3f}, {hi:.3f}]"


def best_caps(result: dict) -> list[tuple[int, str, float]]:
    """(GPUs, the fastest layout's label, its step time) at each GPU count."""
    out = []
    for p in dict.fromkeys(r["gpus"] for r in result["bucket_curve"]):
        mine = [r for r in result["bucket_curve"] if r["gpus"] == p]
        best = min(mine, key=lambda r: r["step_s"])
        out.append((p, _layout_label(best["layout"]), best["step_s"]))
    return out


def _layout_label(layout: str) -> str:
    return layout if layout in (PER_PARAMETER, ONE_BUCKET) else f"{layout} MiB"


def markdown(result: dict) -> str:
    s = result["settings"]
    out = [produced_by([s["command"]]), "", "```text", *s["assumptions"], "```", ""]
    out.append(
        f"Buckets {'launched during backward' if s['overlap'] else 'all-reduced after backward'};"
        f" backward's slowdown while a collective runs: {s['slowdown']:g}."
    )
    out += ["", f"**Scaling efficiency, bucket_cap_mb {s['bucket_cap_mb']:g}**", ""]
    extra = ranged(result)
    if extra:
        out += [*(f"{line}." for line in s.get("accuracy", [])), ""]
    body = [[str(r["gpus"]), str(r["nodes"]), f"{r['step_s'] * 1e3:.1f}",
             f"{r['exposed_s'] * 1e3:.1f}", f"{r['efficiency']:.3f}"]
            + ([span(r), f"{r['loss_s'] * 1e3:.1f}", f"{r['bare_efficiency']:.3f}"]
               if extra else [])
            for r in result["scaling"]]  # fmt: skip
    header = ["GPUs", "servers", "bare step ms" if extra else "step ms", "exposed comm ms", "E(p)"]
    header += ["range", "loss ms", "bare model's E"] if extra else []
    out.append(markdown_table(header, body))
    out += [
        "",
        "**Step time (ms) against the bucket layout; the fastest at each GPU count in bold**",
        "",
    ]
    gpus = list(dict.fromkeys(r["gpus"] for r in result["bucket_curve"]))
    labels = list(dict.fromkeys(r["layout"] for r in result["bucket_curve"]))
    step = {(r["gpus"], r["layout"]): r for r in result["bucket_curve"]}
    best = {p: min(step[p, lab]["step_s"] for lab in labels) for p in gpus}
    body = []
    for lab in labels:
        cells = []
        for p in gpus:
            v = step[p, lab]["step_s"]
            cells.append(f"**{v * 1e3:.1f}**" if v == best[p] else f"{v * 1e3:.1f}")
        body.append([_layout_label(lab), str(step[gpus[0], lab]["buckets"]), *cells])
    out.append(markdown_table(["bucket_cap_mb", "buckets", *[f"{p} GPUs" for p in gpus]], body))
    return "\n".join(out) + "\n"


def plot(result: dict, path: str) -> None:
    """Left: E(p) against GPUs. Right: step time against the bucket layout, one line per
    GPU count, one bucket per parameter at the left end and a single bucket at the right."""
    matplotlib.use("Agg")
    font = report.FIGURE_FONT_PT
    plt.rcParams.update({"font.size": font})
    s = result["settings"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(report.FIGURE_WIDTH_IN, 3.6))
    gpus = [r["gpus"] for r in result["scaling"]]
    left.plot(gpus, [r["efficiency"] for r in result["scaling"]], marker="o",
              label="central" if ranged(result) else None)  # fmt: skip
    low = min(r["efficiency"] for r in result["scaling"])
    if ranged(result):
        left.fill_between(gpus, [r["range"][0] for r in result["scaling"]],
                          [r["range"][1] for r in result["scaling"]], alpha=0.25,
                          label="range (published errors)")  # fmt: skip
        left.plot(gpus, [r["bare_efficiency"] for r in result["scaling"]], ls="--",
                  color="0.5", label="bare model")  # fmt: skip
        left.legend(loc="lower left")
        low = min(r["range"][0] for r in result["scaling"])
    left.set_xscale("log", base=2)
    left.set_xticks(gpus, [str(p) for p in gpus])
    left.set_ylim(min(0.5, low - 0.05), 1.05 if ranged(result) else 1.02)
    left.set_xlabel("GPUs")
    left.set_ylabel(f"E(p) = T({gpus[0]}) / T(p)")
    left.set_title(f"scaling, bucket_cap_mb {s['bucket_cap_mb']:g}")
    left.grid(alpha=0.3)
    labels = list(dict.fromkeys(r["layout"] for r in result["bucket_curve"]))
    caps = [float(lab) for lab in labels if lab not in (PER_PARAMETER, ONE_BUCKET)]
    # Positions on a log axis: the two extremes one decade beyond the smallest and
    # largest caps, labelled by name.
    x = {lab: float(lab) for lab in labels if lab not in (PER_PARAMETER, ONE_BUCKET)}
    x[PER_PARAMETER], x[ONE_BUCKET] = min(caps) / 4, max(caps) * 4
    colors = plt.cm.viridis([i / max(1, len(gpus) - 1) for i in range(len(gpus))])
    for p, color in zip(gpus, colors, strict=True):
        mine = {r["layout"]: r["step_s"] * 1e3 for r in result["bucket_curve"] if r["gpus"] == p}
        right.plot([x[lab] for lab in labels], [mine[lab] for lab in labels], marker="o",
                   ms=3, color=color, label=f"{p}")  # fmt: skip
    right.set_xscale("log")
    right.set_xticks(*cap_ticks(caps, x[PER_PARAMETER], x[ONE_BUCKET]))
    right.minorticks_off()
    right.set_xlabel("bucket_cap_mb (MiB)")
    right.set_ylabel("step time, ms")
    right.set_title(f"{s['model']}, {s['network']}, {s['algorithm']}", fontsize=font)
    right.legend(title="GPUs", ncols=2)
    right.grid(alpha=0.3)
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)


def cap_ticks(caps: list[float], per_parameter_x: float, one_bucket_x: float):
    """Tick positions and labels for a bucket-size axis: every cap gets a tick, but only
    caps at least 3x the last labelled one a label (10 pt labels collide otherwise)."""
    labels, last = [], 0.0
    for cap in caps:
        labels.append(f"{cap:g}" if cap >= 3 * last else "")
        last = cap if labels[-1] else last
    return [per_parameter_x, *caps, one_bucket_x], ["per\nparam", *labels, "one"]


def bucket_curve_is_u(result: dict, gpus: int) -> bool:
    """Whether the fastest layout at `gpus` lies strictly inside the curve: slower with
    more, smaller buckets (per parameter) and with fewer, larger ones (one bucket)."""
    mine = [r for r in result["bucket_curve"] if r["gpus"] == gpus]
    steps = [r["step_s"] for r in mine]
    best = min(range(len(steps)), key=steps.__getitem__)
    return 0 < best < len(steps) - 1 and steps[best] < min(steps[0], steps[-1]) - 1e-12
