"""The two papers' scaling figures against the model.

    python -m profiling.simulate paper

Li et al., "PyTorch Distributed" (VLDB 2020): per-iteration time of ResNet-50 and BERT
from 8 to 256 GPUs (near-linear), the speed-up of overlapping communication with
backward on NCCL (38.0% for ResNet-50, 35.2% for BERT), and the bucket-size curve (a U,
with the default 25 MB near its bottom). Goyal et al., "Accurate, Large Minibatch SGD"
(arXiv 1706.02677): ~90% scaling efficiency from 8 to 256 GPUs on 50 Gbit/s Ethernet,
and recursive halving-doubling 3x faster than the ring between 32 servers.

Each comparison runs `schedule.simulate` on a preset (`presets`: published model sizes
and iteration times, the papers' clusters, NCCL's latencies) and, where the model misses
the paper's figure, asks what the cluster would have had to be for the model to meet it.
Writes paper.json, one Markdown fragment per comparison (paper-*.md) and paper.png
under runs/simulate/ (or --out); --docs refreshes the docs' own fragments and figure.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

import matplotlib
import matplotlib.pyplot as plt

from profiling.common import report
from profiling.common.report import markdown_table, produced_by
from profiling.simulate import outputs, presets, shape
from profiling.simulate.clusters import cluster
from profiling.simulate.layouts import uniform_buckets
from profiling.simulate.published.sources import (
    GOYAL_E256,
    GOYAL_SERVERS,
    GOYAL_SPEEDUP,
    LI_GPUS,
    LI_OVERLAP,
)
from profiling.simulate.scale import (
    PER_PARAMETER,
    bucket_curve_is_u,
    cap_ticks,
    step_seconds,
    sweep,
)
from profiling.simulate.shape import Shape, split
from profiling.simulate.topology import GBIT, cost_model, halving_doubling, ring

GPUS = [8, 16, 32, 64, 128, 256]
BUCKET_CAPS_MB = [1, 2, 5, 10, 25, 50, 100, 200]  # Li et al.'s sweep went 0 to 200 MB
BUCKET_GPUS = [16, 32]
SIZES = [2**12, 2**16, 2**20, 4 * 2**20, 16 * 2**20, 100 * 2**20]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    outputs.add_arguments(parser)
    parser.add_argument(
        "--shape",
        action="append",
        metavar="JSON",
        help="a backward measured on a GPU (`shape --json`); repeat for each model and "
        "batch: the comparisons are made again with the measured split beside the assumed",
    )


def run(args: argparse.Namespace) -> None:
    shapes = [shape.load(path) for path in args.shape or []]  # a bad file: before any work
    have = {(m, c.batch) for (m, _), c in presets.COMPUTE.items()}
    for s in shapes:
        if (s.model, s.batch) not in have:
            known = ", ".join(f"{m} at batch {b}" for m, b in sorted(have))
            raise SystemExit(f"--shape: {s.model} at batch {s.batch} matches no preset ({known})")
    result = compare()
    if shapes:
        result["measured_split"] = compare(shapes)
    result["command"] = report.command_line("profiling.simulate")
    fragments = markdown(result)
    print(fragments["summary"])
    if args.no_files:
        return
    results, images = outputs.folders(args)
    if not args.docs:  # the docs include the fragments and the figure, never the JSON
        report.write_json(results / "paper.json", result)
        print(f"wrote {results}/paper.json")
    for name, text in fragments.items():
        (results / f"paper-{name}.md").write_text(text)
    plot(result, images / "paper.png")
    print(f"wrote {results}/paper-*.md, {images}/paper.png")


# ---------------------------------------------------------------------------------------
# The comparisons.


def compare(shapes: Sequence[Shape] = ()) -> dict:
    """Every comparison; a preset whose model and batch one of `shapes` measured is
    split as measured (`presets.workload`), the others by FLOPs."""
    li, goyal = cluster("li2020"), cluster("goyal2017")

    def workload(model: str, gpu: str):
        measured = _shape_for(shapes, model, gpu)
        return presets.workload(model, gpu, measured and split(measured, model))

    models = {m: workload(m, li.gpu) for m in ("resnet50", "bert_large")}
    resnet_p100 = workload("resnet50", goyal.gpu)
    return {
        "li_scaling": li_scaling(models, li.topology),
        "li_overlap": li_overlap(models, li.topology),
        "li_buckets": li_buckets(models, li.topology),
        "goyal_efficiency": goyal_efficiency(resnet_p100, goyal.topology),
        "goyal_halving_doubling": goyal_halving_doubling(resnet_p100, goyal.topology),
        "sources": {
            "li2020": li.sources,
            "goyal2017": goyal.sources,
            **{f"{m} on {g}": c.source for (m, g), c in presets.COMPUTE.items()},
        },
    }


def _shape_for(shapes: Sequence[Shape], model: str, gpu: str) -> Shape | None:
    """The measurement of `model` at the batch of its preset on `gpu`, if any."""
    batch = presets.COMPUTE[model, gpu].batch
    return next((s for s in shapes if s.model == model and s.batch == batch), None)


def li_scaling(models: dict, topo) -> dict:
    """T(p) and E(p) of both models, NCCL's flat ring, 25 MB buckets, overlapped; the
    hierarchical all-reduce beside it."""
    out = {}
    for name, w in models.items():
        for algorithm in ("ring", "hierarchical_ring"):
            out[f"{name} {algorithm}"] = sweep(w, topo, algorithm, GPUS, 25, [])["scaling"]
    return out


def li_overlap(models: dict, topo) -> dict:
    """At 32 GPUs, 25 MB buckets: all-reduce after backward against during it; and the
    server bandwidth at which the model's speed-up would be the paper's."""
    here = topo.with_gpus(LI_GPUS)
    out = {}
    for name, w in models.items():
        buckets = uniform_buckets(w, 25)
        after, during = _overlap_pair(w, buckets, here)
        # Above the peak of the speed-up (communication as long as backward), less
        # bandwidth means more to hide, and a larger speed-up.
        needed = _bandwidth_for(
            lambda t, w=w, buckets=buckets: _speedup(*_overlap_pair(w, buckets, t)),
            LI_OVERLAP[name],
            here,
            rises_with_bandwidth=False,
        )
        out[name] = {
            "after_s": after,
            "overlapped_s": during,
            "speedup": after / during - 1,
            "paper_speedup": LI_OVERLAP[name],
            "inter_gbit_for_paper": needed,
        }
    return out


def _overlap_pair(w, buckets, topo) -> tuple[float, float]:
    cost = cost_model(topo, "ring")
    return (step_seconds(w, buckets, cost, overlap=False), step_seconds(w, buckets, cost))


def _speedup(after: float, during: float) -> float:
    return after / during - 1


def _bandwidth_for(measure, target: float, topo, rises_with_bandwidth: bool) -> float | None:
    """The server bandwidth (Gbit/s) nearest the preset's at which `measure` of the
    cluster equals `target`: walk from the preset's rate by factors of two in the
    direction that moves `measure` toward `target`, then bisect (on a log scale) the
    step that crossed it. None if no rate from 0.001 to 10^6 Gbit/s crosses it."""
    def below(gbit: float) -> bool:
        return measure(replace(topo, inter_bytes_per_s=gbit * GBIT)) < target

    start = topo.inter_bytes_per_s / GBIT
    side = below(start)
    factor = 2.0 if side == rises_with_bandwidth else 0.5
    near, far = start, start * factor
    while below(far) == side:
        near, far = far, far * factor
        if not 1e-3 < far < 1e6:
            return None
    for _ in range(50):
        mid = (near * far) ** 0.5
        near, far = (mid, far) if below(mid) == side else (near, mid)
    return (near * far) ** 0.5


def li_buckets(models: dict, topo) -> dict:
    """The bucket-size curve of both models at 16 and 32 GPUs, NCCL's ring."""
    out = {}
    for name, w in models.items():
        result = sweep(w, topo, "ring", BUCKET_GPUS, 25, BUCKET_CAPS_MB)
        out[name] = {
            "curve": result["bucket_curve"],
            "u_shaped": {str(p): bucket_curve_is_u(result, p) for p in BUCKET_GPUS},
        }
    return out


def goyal_efficiency(w, topo) -> dict:
    """ResNet-50 on P100, 32 images per GPU, one all-reduce per gradient as soon as it is
    ready (Goyal et al. aggregate each layer's gradient as backward produces it): E(p)
    for their hierarchical scheme and the flat algorithms; and the server bandwidth at
    which E(256) would be their 90%."""
    out = {}
    for algorithm in ("hierarchical_halving_doubling", "hierarchical_ring", "ring"):
        result = sweep(w, topo, algorithm, GPUS, 25, [])
        per_param = sweep_per_parameter(w, topo, algorithm)
        out[algorithm] = {"bucketed_25mb": result["scaling"], PER_PARAMETER: per_param}
    at_256 = topo.with_gpus(256)
    ref = _per_param_step(w, topo.with_gpus(8), "hierarchical_halving_doubling")
    out["inter_gbit_for_paper"] = _bandwidth_for(
        lambda t: ref / _per_param_step(w, t, "hierarchical_halving_doubling"),
        GOYAL_E256,
        at_256,
        rises_with_bandwidth=True,
    )
    return out


def sweep_per_parameter(w, topo, algorithm: str) -> list[dict]:
    steps = [(p, _per_param_step(w, topo.with_gpus(p), algorithm)) for p in GPUS]
    return [{"gpus": p, "step_s": s, "efficiency": steps[0][1] / s} for p, s in steps]


def _per_param_step(w, topo, algorithm: str) -> float:
    buckets = [[i] for i in reversed(range(len(w.grads)))]
    return step_seconds(w, buckets, cost_model(topo, algorithm))


def goyal_halving_doubling(w, topo) -> dict:
    """Between 32 servers (one rank each, 50 Gbit/s): the ring's time over
    halving-doubling's, for single buffers and for ResNet-50's gradients one all-reduce
    each; and the per-step latency at which a 4 MiB buffer (a million float32, their
    threshold) would show their 3x."""
    servers = replace(topo, nodes=GOYAL_SERVERS, gpus_per_node=1, call_latency_s=0.0)
    sizes = [
        {
            "bytes": n,
            "ring_s": ring(servers, n).seconds,
            "halving_doubling_s": halving_doubling(servers, n).seconds,
        }
        for n in SIZES
    ]
    ring_total = sum(ring(servers, g.nbytes).seconds for g in w.grads)
    hd_total = sum(halving_doubling(servers, g.nbytes).seconds for g in w.grads)
    # ring / h-d = (62 a + W) / (10 a + W) with W the bytes' time: 3 when a = W / 16.
    p, n = GOYAL_SERVERS, 4 * 2**20
    wire = 2 * (p - 1) / p * n / servers.inter_bytes_per_s
    steps_ring, steps_hd = 2 * (p - 1), 2 * (p.bit_length() - 1)
    alpha_for_3x = (GOYAL_SPEEDUP - 1) * wire / (steps_ring - GOYAL_SPEEDUP * steps_hd)
    return {
        "servers": GOYAL_SERVERS,
        "inter_latency_s": servers.inter_latency_s,
        "sizes": sizes,
        "resnet50_per_gradient": {"ring_s": ring_total, "halving_doubling_s": hd_total},
        "alpha_for_3x_at_4mib_s": alpha_for_3x,
    }


# ---------------------------------------------------------------------------------------
# What the comparisons say, as Markdown fragments for docs/scaling.md.


def markdown(result: dict) -> dict[str, str]:
    made = produced_by([result["command"]]) + "\n\n"
    frag = {}
    rows, header = summary_rows(result), ["figure", "paper", "model", "setting"]
    if "measured_split" in result:  # the model again, split as measured on a GPU
        again = summary_rows(result["measured_split"])
        rows = [[*row[:3], new[2], row[3]] for row, new in zip(rows, again, strict=True)]
        header = ["figure", "paper", "model", "model, split measured", "setting"]
    frag["summary"] = made + markdown_table(header, rows, left=len(header)) + "\n"
    ls, lo, lb = result["li_scaling"], result["li_overlap"], result["li_buckets"]
    ge, gh = result["goyal_efficiency"], result["goyal_halving_doubling"]
    per_grad = gh["resnet50_per_gradient"]

    body = []
    for i, p in enumerate(GPUS):
        row = [str(p)]
        for key in ("resnet50 ring", "resnet50 hierarchical_ring", "bert_large ring",
                    "bert_large hierarchical_ring"):  # fmt: skip
            r = ls[key][i]
            row += [f"{r['step_s'] * 1e3:.1f}", f"{r['efficiency']:.3f}"]
        body.append(row)
    header = ["GPUs", "ResNet-50 ring ms", "E", "ResNet-50 hier. ms", "E", "BERT ring ms",
              "E", "BERT hier. ms", "E"]  # fmt: skip
    frag["li-scaling"] = made + markdown_table(header, body) + "\n"

    body = []
    for name, label in (("resnet50", "ResNet-50"), ("bert_large", "BERT-large")):
        o = lo[name]
        need = o["inter_gbit_for_paper"]
        body.append([label, f"{o['after_s'] * 1e3:.1f}", f"{o['overlapped_s'] * 1e3:.1f}",
                     f"{o['speedup']:.1%}", f"{o['paper_speedup']:.0%}",
                     "none" if need is None else f"{need:.1f}"])  # fmt: skip
    header = ["model", "after backward ms", "overlapped ms", "speed-up (model)", "paper",
              "Gbit/s per server giving the paper's"]  # fmt: skip
    frag["li-overlap"] = made + markdown_table(header, body) + "\n"

    labels = list(dict.fromkeys(r["layout"] for r in lb["resnet50"]["curve"]))
    body = []
    for lab in labels:
        row = [_layout(lab)]
        for name in ("resnet50", "bert_large"):
            for p in BUCKET_GPUS:
                r = next(r for r in lb[name]["curve"] if r["gpus"] == p and r["layout"] == lab)
                row.append(f"{r['step_s'] * 1e3:.1f}")
        body.append(row)
    header = ["bucket_cap_mb", *[f"{m} {p} GPUs ms" for m in ("ResNet-50", "BERT")
                                 for p in BUCKET_GPUS]]  # fmt: skip
    frag["li-buckets"] = made + markdown_table(header, body) + "\n"

    body = []
    for i, p in enumerate(GPUS):
        row = [str(p)]
        for algorithm in ("hierarchical_halving_doubling", "hierarchical_ring", "ring"):
            row.append(f"{ge[algorithm]['per parameter'][i]['efficiency']:.3f}")
            row.append(f"{ge[algorithm]['bucketed_25mb'][i]['efficiency']:.3f}")
        body.append(row)
    header = ["GPUs", "hier. h-d, per gradient", "25 MB", "hier. ring, per gradient", "25 MB",
              "flat ring, per gradient", "25 MB"]  # fmt: skip
    need = ge["inter_gbit_for_paper"]
    frag["goyal-efficiency"] = made + markdown_table(header, body) + (
        f"\n\nServer bandwidth at which hierarchical halving-doubling, one all-reduce per "
        f"gradient, would give E(256) = {GOYAL_E256:.0%}: "
        + ("none from 0.001 Gbit/s up" if need is None else f"{need:.2f} Gbit/s") + ".\n"
    )  # fmt: skip

    body = [[_size(s["bytes"]), f"{s['ring_s'] * 1e3:.3f}", f"{s['halving_doubling_s'] * 1e3:.3f}",
             f"{s['ring_s'] / s['halving_doubling_s']:.2f}×"] for s in gh["sizes"]]  # fmt: skip
    body.append(["ResNet-50, one per gradient (161)", f"{per_grad['ring_s'] * 1e3:.1f}",
                 f"{per_grad['halving_doubling_s'] * 1e3:.1f}",
                 f"{per_grad['ring_s'] / per_grad['halving_doubling_s']:.2f}×"])  # fmt: skip
    header = ["buffer", "ring ms", "halving-doubling ms", "ring / h-d"]
    frag["goyal-halving-doubling"] = made + markdown_table(header, body) + (
        f"\n\n{GOYAL_SERVERS} servers, one rank each, 50 Gbit/s, "
        f"{gh['inter_latency_s'] * 1e6:g} us per step. A 4 MiB buffer shows the paper's "
        f"{GOYAL_SPEEDUP:g}× when a step costs {gh['alpha_for_3x_at_4mib_s'] * 1e6:.0f} us.\n"
    )  # fmt: skip
    return frag


def summary_rows(result: dict) -> list[list[str]]:
    """One row per paper figure: figure, paper, model, setting."""
    ls, lo, lb = result["li_scaling"], result["li_overlap"], result["li_buckets"]
    ge, gh = result["goyal_efficiency"], result["goyal_halving_doubling"]
    e256 = {k: v[-1]["efficiency"] for k, v in ls.items()}
    hd = ge["hierarchical_halving_doubling"]["per parameter"][-1]["efficiency"]
    per_grad = gh["resnet50_per_gradient"]
    four_mib = next(s for s in gh["sizes"] if s["bytes"] == 4 * 2**20)

    def best(name: str, p: int) -> str:
        mine = [r for r in lb[name]["curve"] if r["gpus"] == p]
        b = min(mine, key=lambda r: r["step_s"])
        return _layout(b["layout"])

    def curve(name: str) -> str:
        u = lb[name]["u_shaped"]
        return "; ".join(f"{p} GPUs: best {best(name, p)}, {'U' if u[str(p)] else 'no U'}"
                         for p in BUCKET_GPUS)  # fmt: skip

    ring_hd = per_grad["ring_s"] / per_grad["halving_doubling_s"]
    one = four_mib["ring_s"] / four_mib["halving_doubling_s"]
    li, after = "Li et al.: ", f"{LI_GPUS} GPUs, after backward vs during"
    return [
        [li + "ResNet-50, 8 → 256 GPUs", "near-linear", f"E(256) = {e256['resnet50 ring']:.3f}",
         "NCCL ring, 25 MB buckets, batch 112"],
        [li + "BERT-large, 8 → 256 GPUs", "near-linear", f"E(256) = {e256['bert_large ring']:.3f}",
         "NCCL ring, 25 MB buckets, batch 8"],
        [li + "overlap speed-up, ResNet-50", f"{LI_OVERLAP['resnet50']:.0%}",
         f"{lo['resnet50']['speedup']:.1%}", after],
        [li + "overlap speed-up, BERT", f"{LI_OVERLAP['bert_large']:.0%}",
         f"{lo['bert_large']['speedup']:.1%}", after],
        [li + "bucket size, ResNet-50", "U, 25 MB near the bottom", curve("resnet50"), "NCCL ring"],
        [li + "bucket size, BERT", "U, 25 MB near the bottom", curve("bert_large"), "NCCL ring"],
        ["Goyal et al.: efficiency 8 → 256 GPUs", f"E(256) ≈ {GOYAL_E256:g}", f"E(256) = {hd:.3f}",
         "hierarchical, halving-doubling between servers, one all-reduce per gradient"],
        [f"Goyal et al.: halving-doubling vs ring, {GOYAL_SERVERS} servers",
         f"{GOYAL_SPEEDUP:g}×",
         f"{ring_hd:.2f}× (ResNet-50's gradients); {one:.2f}× (one 4 MiB buffer)",
         f"{gh['inter_latency_s'] * 1e6:g} us per step"],
    ]  # fmt: skip


def _layout(label: str) -> str:
    return label if not label[0].isdigit() else f"{label} MiB"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def plot(result: dict, path) -> None:
    """Four panels: Li et al.'s scaling (E against GPUs, both models and Goyal et al.'s
    ResNet-50), the overlap's speed-up against the paper's, the bucket-size curves at 32
    GPUs, and the ring over halving-doubling against buffer size on 32 servers."""
    matplotlib.use("Agg")
    plt.rcParams.update({"font.size": report.FIGURE_FONT_PT})
    fig, axes = plt.subplots(2, 2, figsize=(report.FIGURE_WIDTH_IN, 6.8))
    (a, b), (c, d) = axes

    ls, ge = result["li_scaling"], result["goyal_efficiency"]
    for key, label in (("resnet50 ring", "ResNet-50 (Li)"), ("bert_large ring", "BERT-large (Li)")):
        a.plot(GPUS, [r["efficiency"] for r in ls[key]], marker="o", label=label)
    goyal = ge["hierarchical_halving_doubling"]["per parameter"]
    a.plot(GPUS, [r["efficiency"] for r in goyal], marker="s", label="ResNet-50 (Goyal)")
    a.axhline(GOYAL_E256, color="0.5", ls="--", lw=0.8)
    a.text(GPUS[0], GOYAL_E256 - 0.045, f"Goyal et al.: ~{GOYAL_E256:.0%} at 256", color="0.4")
    a.set_xscale("log", base=2)
    a.set_xticks(GPUS, [str(p) for p in GPUS])
    a.set_ylim(0.4, 1.03)
    a.set_xlabel("GPUs")
    a.set_ylabel("E(p) = T(8) / T(p)")
    a.set_title("scaling efficiency (model)")
    a.legend()
    a.grid(alpha=0.3)

    lo = result["li_overlap"]
    names = [("resnet50", "ResNet-50"), ("bert_large", "BERT-large")]
    xs = range(len(names))
    for dx, key, label, colour in (
        (-0.2, "paper_speedup", "paper", "0.6"),
        (0.2, "speedup", "model", "tab:blue"),
    ):
        b.bar([x + dx for x in xs], [lo[n][key] * 100 for n, _ in names], 0.4, label=label,
              color=colour)  # fmt: skip
    b.set_xticks(list(xs), [label for _, label in names])
    b.set_ylabel("speed-up of overlapping, %")
    b.set_title(f"overlap on NCCL, {LI_GPUS} GPUs")
    b.set_ylim(0, 55)
    b.legend(loc="upper center", ncols=2)
    b.grid(alpha=0.3, axis="y")

    lb = result["li_buckets"]
    labels = list(dict.fromkeys(r["layout"] for r in lb["resnet50"]["curve"]))
    caps = [float(lab) for lab in labels if lab[0].isdigit()]
    x = {lab: float(lab) for lab in labels if lab[0].isdigit()}
    x["per parameter"], x["one bucket"] = min(caps) / 4, max(caps) * 4
    for name, label in names:
        mine = {r["layout"]: r["step_s"] for r in lb[name]["curve"] if r["gpus"] == 32}
        low = min(mine.values())
        c.plot([x[lab] for lab in labels], [mine[lab] / low for lab in labels], marker="o",
               ms=3, label=label)  # fmt: skip
    c.axvline(25, color="0.5", ls="--", lw=0.8)
    c.set_xscale("log")
    c.set_xticks(*cap_ticks(caps, x["per parameter"], x["one bucket"]))
    c.minorticks_off()
    c.set_xlabel("bucket_cap_mb (MiB); dashed: 25")
    c.set_ylabel("step time / fastest")
    c.set_title("bucket size, 32 GPUs (model)")
    c.legend()
    c.grid(alpha=0.3)

    gh = result["goyal_halving_doubling"]
    sizes = [s["bytes"] for s in gh["sizes"]]
    d.plot(sizes, [s["ring_s"] / s["halving_doubling_s"] for s in gh["sizes"]], marker="o",
           label="one buffer")  # fmt: skip
    per = gh["resnet50_per_gradient"]
    d.axhline(per["ring_s"] / per["halving_doubling_s"], color="tab:orange", lw=1,
              label="ResNet-50, one per gradient")  # fmt: skip
    d.axhline(GOYAL_SPEEDUP, color="0.5", ls="--", lw=0.8,
              label=f"Goyal et al.: {GOYAL_SPEEDUP:g}×")  # fmt: skip
    d.set_xscale("log", base=2)
    d.set_xticks(sizes, [_size(s).replace(" ", "") for s in sizes])
    d.set_xlabel("buffer")
    d.set_ylabel("ring time / halving-doubling time")
    d.set_title(f"{GOYAL_SERVERS} servers, 50 Gbit/s (model)")
    d.legend(loc="upper right")
    d.grid(alpha=0.3)
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)
