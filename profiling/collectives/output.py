"""What a sweep's results say, written out: the fit printed, the Markdown fragment the
docs include, and the figure (time against size per algorithm, crossovers marked)."""

from __future__ import annotations

import math
from itertools import pairwise

import matplotlib
import matplotlib.pyplot as plt

from profiling.cluster.network import parse_rate
from profiling.collectives import model
from profiling.common import report
from profiling.common.report import markdown_table, produced_by

ORDER = ["naive", "ring", "halving_doubling", "tree", "gloo"]
COLORS = {"naive": "tab:red", "ring": "tab:blue", "halving_doubling": "tab:green",
          "tree": "tab:purple", "gloo": "0.3"}  # fmt: skip
LABEL_BOX = {"facecolor": "white", "edgecolor": "none", "pad": 1}
PREDICT_RANKS = (32, 256)  # Goyal et al.'s 32 servers; their 256 GPUs as 256 ranks


def analyse(runs: list[dict]) -> dict:
    """Everything the outputs show, from the runs alone (so --render redraws it)."""
    rows = model.medians(runs)
    gamma = model.measure_gamma(runs)
    fits = model.fit(rows, gamma)
    return {
        "rows": rows,
        "gamma_s_per_byte": gamma,
        "fits": fits,
        "delay_check": model.delay_check(rows, fits),
        "crossovers": model.crossovers(rows),
    }


def size_label(size_bytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= scale:
            value = size_bytes / scale
            return (
                f"{value:.0f} {unit}"
                if value >= 10 or value == int(value)
                else f"{value:.1f} {unit}"
            )
    return f"{size_bytes:.0f} B"


def _algorithms(items) -> list[str]:
    present = set(items)
    return [a for a in ORDER if a in present] + sorted(present - set(ORDER))


def _mbps(beta_s_per_byte: float) -> str:
    """1/beta in MB/s; a beta fitted to 0 (no size large enough to see the link) is
    an unbounded rate."""
    return f"{1e-6 / beta_s_per_byte:.0f}" if beta_s_per_byte > 0 else "inf"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}%" if value >= 10 else f"{value:.1f}%"


def summary(analysis: dict) -> str:
    """The fit as printed at the end of a run."""
    lines = [f"gamma (local add, measured): {analysis['gamma_s_per_byte'] * 1e9:.3f} ns/B"]
    for algorithm in _algorithms(analysis["fits"]):
        f = analysis["fits"][algorithm]
        held = f["held_out"]
        lines.append(
            f"{algorithm:>16}: alpha {f['alpha_s'] * 1e6:7.1f} us, beta "
            f"{f['beta_s_per_byte'] * 1e9:6.3f} ns/B ({_mbps(f['beta_s_per_byte'])} MB/s), "
            f"free {f['free_bytes'] // 1024} KiB; "
            f"held-out sizes: median error {_pct(held['median_pct'])}, worst "
            f"{_pct(held['worst_pct'])} ({held['worst_at']}), {held['rows']} points"
        )
    for d in analysis["delay_check"]:
        lines.append(
            f"{d['algorithm']:>16} with {d['delay_ms']:g} ms emulated delay per step: "
            f"alpha refitted {d['alpha_refitted_s'] * 1e6:.0f} us (plain "
            f"{d['alpha_plain_s'] * 1e6:.0f} us + {d['delay_ms'] * 1e3:.0f} us expected); "
            "plain fit + delay: median error "
            f"{_pct(d['error']['median_pct'])}, worst {_pct(d['error']['worst_pct'])}"
        )
    return "\n".join(lines)


def markdown(runs: list[dict], analysis: dict, plot_path: str | None = None) -> str:
    commands = list(dict.fromkeys(run["command"] for run in runs))
    out = [produced_by(commands, ", from the repository root, as root (namespaces)"), ""]
    out += [_settings(runs), ""]
    out += ["### The fitted model", "", _fit_table(analysis), ""]
    if analysis["delay_check"]:
        out += ["### The model against the emulated delay", "", _delay_table(analysis), ""]
    out += ["### Crossovers with the ring", "", _crossover_table(analysis), ""]
    out += [f"### What the model predicts for {' and '.join(map(str, PREDICT_RANKS))} ranks", ""]
    out += [_prediction_table(analysis), ""]
    out += ["### Measured times", "", _measured_tables(analysis)]
    return "\n".join(out).rstrip() + "\n"


def _settings(runs: list[dict]) -> str:
    parts = []
    for run in runs:
        net = run["network"]
        probe = net.get("probe")
        link = f"links shaped to {net['rate']}" if net["rate"] != "loopback" else "loopback"
        if probe:
            link += f" (Gloo all-reduce of 25 MB measured at {probe['MBps']:.0f} MB/s)"
        delay = (f"emulated delay {run['delay_ms']:g} ms per step (in ddp.collectives, not on "
                 "the link)") if run["delay_ms"] else "no emulated delay"  # fmt: skip
        m = run["machine"]
        nodes = run.get("ranks_per_node", 1)
        layout = f" ({nodes} per node)" if nodes > 1 else ""
        parts.append(
            f"- {run['world_size']} ranks{layout}, {link}, {delay}; sizes "
            f"{size_label(run['settings']['sizes_bytes'][0])} to "
            f"{size_label(run['settings']['sizes_bytes'][-1])} of float32; "
            f"{run['settings']['min_repeats']}-{run['settings']['max_repeats']} calls per "
            f"algorithm and size (as many as fit in {run['settings']['seconds_per_size']:g} s "
            f"per size), {run['seconds_of_rounds']:.0f} s of calls; {m['usable_cores']} cores "
            f"({m['cpu']}), {run['threads_per_rank']} thread(s) per rank, torch {m['torch']}; "
            f"load average {run['load_average_before']} before, {m['load_average_end']} after; "
            f"{m['date_utc']} UTC"
        )
    return "\n".join(parts)


def _fit_table(analysis: dict) -> str:
    gamma = analysis["gamma_s_per_byte"]
    rows = [r for r in analysis["rows"] if r["delay_ms"] == 0]
    _, held_sizes = model.split_sizes([r["size_bytes"] for r in rows])
    body = []
    for algorithm in _algorithms(analysis["fits"]):
        f = analysis["fits"][algorithm]
        fitted, held = f["fitted"], f["held_out"]
        by_world = []
        for p in sorted({r["world_size"] for r in rows}):
            mine = [r for r in rows if r["algorithm"] == algorithm and r["world_size"] == p
                    and r["size_bytes"] in held_sizes]  # fmt: skip
            by_world.append(f"{p}: {_pct(model.errors(f, algorithm, mine)['median_pct'])}")
        body.append([
            algorithm, f"{f['alpha_s'] * 1e6:.0f}", f"{f['beta_s_per_byte'] * 1e9:.2f}",
            _mbps(f["beta_s_per_byte"]), f"{gamma * 1e9:.3f}",
            size_label(f["free_bytes"]) if f["free_bytes"] else "0",
            f"{_pct(fitted['median_pct'])} / {_pct(fitted['worst_pct'])}",
            f"{_pct(held['median_pct'])} / {_pct(held['worst_pct'])} ({held['worst_at']})",
            ", ".join(by_world),
        ])  # fmt: skip
    header = ["algorithm", "alpha us/step", "beta ns/B", "1/beta MB/s", "gamma ns/B",
              "free bytes per phase", "fitted sizes: median / worst error",
              "held-out sizes: median / worst error",
              "held-out median error by ranks"]  # fmt: skip
    note = (
        "alpha, beta and the free bytes are least-squares fits (on relative error) over "
        "every world size without emulated delay, on every other size from the smallest; "
        "the sizes in between are held out. gamma is measured (`tensor += other` on every "
        f"rank at once, sizes from {size_label(model.GAMMA_MIN_BYTES)}): all-reduce times "
        "alone cannot tell it from beta. The free bytes stand for the shaped link's token "
        "bucket (see `profiling/collectives/model.py`)."
    )
    return markdown_table(header, body) + "\n\n" + note


def _delay_table(analysis: dict) -> str:
    body = []
    for d in analysis["delay_check"]:
        e = d["error"]
        body.append([
            d["algorithm"], f"{d['delay_ms']:g}", f"{d['alpha_plain_s'] * 1e6:.0f}",
            f"{(d['alpha_plain_s'] + d['delay_ms'] / 1e3) * 1e6:.0f}",
            f"{d['alpha_refitted_s'] * 1e6:.0f}",
            f"{_pct(e['median_pct'])} / {_pct(e['worst_pct'])} ({e['worst_at']})",
        ])  # fmt: skip
    header = ["algorithm", "delay ms/step", "alpha us (no delay)", "alpha + delay us",
              "alpha refitted on the delay runs us",
              "no-delay fit + delay: median / worst error"]  # fmt: skip
    return markdown_table(header, body) + (
        "\n\nThe runs with the emulated delay were not used in the fit: predicting them from "
        "the no-delay fit plus the delay on each step tests the model's step counts."
    )


def _crossover_table(analysis: dict) -> str:
    fits = analysis["fits"]
    measured = {(c["delay_ms"], c["world_size"], c["algorithm"]): c for c in analysis["crossovers"]}
    keys = sorted({(r["delay_ms"], r["world_size"]) for r in analysis["rows"]})
    body = []
    for delay_ms, p in keys:
        present = {r["algorithm"] for r in analysis["rows"]
                   if r["delay_ms"] == delay_ms and r["world_size"] == p}  # fmt: skip
        for algorithm in _algorithms(present - {"ring", "gloo"}):
            if "ring" not in present:
                continue
            seen = [c for k, c in measured.items() if k == (delay_ms, p, algorithm)]
            seen_text = "; ".join(
                f"{size_label(c['size_bytes'])} "
                f"({'faster' if c['faster_below'] else 'slower'} below)"
                for c in seen
            ) or "none in the range"  # fmt: skip
            predicted = None
            if algorithm in fits and "ring" in fits:
                predicted = model.model_crossover(fits, algorithm, "ring", p, delay_ms / 1e3)
            body.append([f"{delay_ms:g}", str(p), algorithm, seen_text,
                         size_label(predicted) if predicted else "none"])  # fmt: skip
    header = ["delay ms/step", "ranks", "algorithm", "measured crossover with the ring",
              "model's crossover"]  # fmt: skip
    return markdown_table(header, body, left=3) + (
        "\n\nMeasured: where the algorithm's median time crosses the ring's, interpolated "
        "on log-log axes between the nearest sizes on either side at which one of the two "
        f"is at least {model.CLEAR_RATIO:g}x faster (closer curves cross by noise). Model: "
        "the smallest size where the fitted models swap order."
    )


GOYAL_LINK_GBIT = 50  # Goyal et al.'s servers: 50 Gbit/s Ethernet


def _prediction_table(analysis: dict) -> str:
    fits = analysis["fits"]
    if not {"ring", "halving_doubling"} <= set(fits):
        return "(needs the ring and halving_doubling fitted)"
    algorithms = [a for a in ("ring", "halving_doubling", "tree") if a in fits]
    speedup = _link_gbit(analysis) / GOYAL_LINK_GBIT  # beta's factor on their links
    body = []
    for p in PREDICT_RANKS:
        for size in [4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 256 * 2**20]:
            # No token bucket on a real switch port: free_bytes 0.
            times = {a: model.predict(fits[a], a, p, size, free_bytes=0) for a in algorithms}
            fast = {}
            for a in ("ring", "halving_doubling"):
                faster_link = {**fits[a], "beta_s_per_byte": fits[a]["beta_s_per_byte"] * speedup}
                fast[a] = model.predict(faster_link, a, p, size, free_bytes=0)
            body.append(
                [str(p), size_label(size)]
                + [_ms(times[a]) for a in algorithms]
                + [f"{times['ring'] / times['halving_doubling']:.2f}x",
                   f"{fast['ring'] / fast['halving_doubling']:.2f}x"]
            )  # fmt: skip
    header = ["ranks", "size", *[f"{a} ms" for a in algorithms], "ring / h-d",
              f"ring / h-d, beta scaled to {GOYAL_LINK_GBIT} Gbit/s"]  # fmt: skip
    return markdown_table(header, body, left=2) + (
        "\n\nEach algorithm's own fitted alpha, beta and the measured gamma, with no "
        "token bucket (free_bytes 0), extrapolated to ranks that were not measured. The "
        f"last column scales beta to {GOYAL_LINK_GBIT} Gbit/s links, alpha kept: Goyal et "
        "al.'s Ethernet with this machine's per-step cost."
    )


def _link_gbit(analysis: dict) -> float:
    """The measured runs' link rate in Gbit/s (1 for 1gbit)."""
    rates = {r["network"] for r in analysis["rows"]} - {"loopback"}
    return parse_rate(rates.pop()) / 1e9 if len(rates) == 1 else 1.0


def _measured_tables(analysis: dict) -> str:
    parts = []
    keys = sorted({(r["delay_ms"], r["world_size"]) for r in analysis["rows"]})
    for delay_ms, p in keys:
        here = [r for r in analysis["rows"] if r["delay_ms"] == delay_ms and r["world_size"] == p]
        algorithms = _algorithms(r["algorithm"] for r in here)
        by = {(r["algorithm"], r["size_bytes"]): r for r in here}
        body = []
        for size in sorted({r["size_bytes"] for r in here}):
            row = [size_label(size)]
            for a in algorithms:
                r = by.get((a, size))
                spread = "" if r is None else f"({_ms(r['min_s'])}-{_ms(r['max_s'])})"
                row.append("" if r is None else f"{_ms(r['median_s'])} {spread}")
            row.append(str(max(r["calls"] for r in here if r["size_bytes"] == size)))
            body.append(row)
        delay = f", emulated delay {delay_ms:g} ms per step" if delay_ms else ""
        parts.append(f"**{p} ranks{delay}**: median ms of the slowest rank (min-max)\n")
        parts.append(markdown_table(["size", *algorithms, "calls each"], body) + "\n")
    return "\n".join(parts)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def plot(analysis: dict, path: str) -> None:
    """One panel per (delay, world size): each algorithm's median time against size on
    log-log axes (band: min to max), the fitted model dashed, each measured crossover
    with the ring marked."""
    matplotlib.use("Agg")
    rows, fits = analysis["rows"], analysis["fits"]
    keys = sorted({(r["delay_ms"], r["world_size"]) for r in rows})
    font = report.FIGURE_FONT_PT
    # Two panels abreast at the docs' width, so 10 pt text shows at 10 pt.
    ncols = min(len(keys), 2)
    nrows = -(-len(keys) // ncols)
    width_in = report.FIGURE_WIDTH_IN / ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(width_in * ncols, 4.6 * nrows), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    for ax, (delay_ms, p) in zip(axes.flat, keys, strict=False):
        here = [r for r in rows if r["delay_ms"] == delay_ms and r["world_size"] == p]
        # The model line takes the first run's nodes: runs merged at one world size and
        # delay with another --ranks-per-node share the panel.
        per_node = here[0].get("ranks_per_node", 1)
        for algorithm in _algorithms(r["algorithm"] for r in here):
            mine = sorted((r for r in here if r["algorithm"] == algorithm),
                          key=lambda r: r["size_bytes"])  # fmt: skip
            x = [r["size_bytes"] for r in mine]
            color = COLORS.get(algorithm)
            ax.plot(x, [r["median_s"] * 1e3 for r in mine], marker="o", ms=3, color=color,
                    label=algorithm)  # fmt: skip
            ax.fill_between(x, [r["min_s"] * 1e3 for r in mine],
                            [r["max_s"] * 1e3 for r in mine], color=color, alpha=0.08)  # fmt: skip
            if algorithm in fits:
                grid = [x[0] * (x[-1] / x[0]) ** (k / 60) for k in range(61)]
                ax.plot(grid, [model.predict(fits[algorithm], algorithm, p, s, delay_ms / 1e3,
                                             ranks_per_node=per_node) * 1e3
                               for s in grid], ls="--", lw=0.8, color=color)  # fmt: skip
        # Crossovers often lie close together: their labels stacked down the right margin
        # of the panel, in the algorithm's colour, rather than beside each mark.
        mine = [
            c for c in analysis["crossovers"] if (c["delay_ms"], c["world_size"]) == (delay_ms, p)
        ]
        for i, c in enumerate(sorted(mine, key=lambda c: c["size_bytes"])):
            ring = {r["size_bytes"]: r["median_s"] for r in here if r["algorithm"] == "ring"}
            y = _log_interp(ring, c["size_bytes"]) * 1e3
            ax.plot([c["size_bytes"]], [y], marker="X", ms=9, color=COLORS.get(c["algorithm"]),
                    markeredgecolor="k", zorder=5)  # fmt: skip
            ax.text(0.97, 0.04 + 0.08 * i, f"X {c['algorithm']}: {size_label(c['size_bytes'])}",
                    transform=ax.transAxes, ha="right", fontsize=font,
                    color=COLORS.get(c["algorithm"]), bbox=LABEL_BOX)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r["size_bytes"] for r in here})
        # Every other size labelled: ten labels at 10 pt do not fit half the width.
        labels = [size_label(t).replace(" ", "") if i % 2 == 0 else "" for i, t in enumerate(ticks)]
        ax.set_xticks(ticks, labels, fontsize=font)
        rate = here[0]["network"]
        title = f"{p} ranks, " + ("loopback" if rate == "loopback" else f"links shaped to {rate}")
        if delay_ms:
            title += (
                f"\nEMULATED delay {delay_ms:g} ms per step\n(in ddp.collectives, not the link)"
            )
        ax.set_title(title, fontsize=font)
        ax.set_xlabel("tensor size (float32)", fontsize=font)
        ax.set_ylabel("all-reduce time, ms (slowest rank)", fontsize=font)
        ax.tick_params(axis="y", labelsize=font)
        ax.grid(alpha=0.3, which="both")
    # One legend for every panel, above them, where a reader of the first panel sees it:
    # the algorithms' colours are the same in each.
    legend = {}
    for ax in axes.flat[: len(keys)]:
        legend.update(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    labels = _algorithms(legend)
    fig.legend([legend[a] for a in labels], labels, fontsize=font, loc="upper center",
               ncols=len(labels), title="dashed: fitted model; X: crosses the ring",
               title_fontsize=font)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.9 / fig.get_figheight()))
    report.save_figure(fig, path)
    plt.close(fig)


def _log_interp(points: dict[float, float], x: float) -> float:
    xs = sorted(points)
    for x0, x1 in pairwise(xs):
        if x0 <= x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(
                math.log(points[x0]) + f * (math.log(points[x1]) - math.log(points[x0]))
            )
    return points[min(xs, key=lambda v: abs(math.log(v / x)))]
