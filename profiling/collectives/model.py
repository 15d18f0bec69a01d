"""The alpha-beta-gamma cost model of each algorithm, fitted to the measured times.

One all-reduce of n bytes over p ranks takes, along its critical path,

    T(n, p) = steps(p) * alpha + sent(n, p) * beta + added(n, p) * gamma

alpha: seconds per step (one round of messages: software, the round trip, and the
emulated delay when there is one); beta: seconds per byte through one rank's link;
gamma: seconds per byte of local reduction. The counts come from each algorithm's
description (docs: "What all_reduce does"), for the rank on the critical path:

    algorithm          steps           bytes sent (x n)        bytes added (x n)
    naive              2               2(p-1)                  p-1
    ring, gloo         2(p-1)          2(p-1)/p                (p-1)/p
    halving_doubling   2 lg q (+2)     2(q-1)/q (+2)           (q-1)/q (+1)
    tree               2 lg p (*)      2 ceil(lg p)            ceil(lg p)
    hierarchical_X     the tree's steps and bytes over the g ranks of a node, plus X's
                       over the N = p/g nodes' leaders (`three_phases`)

with q the largest power of two <= p, and (+...) only when p is not one. (*) fewer
when p is not a power of two: `tree_steps`. Gloo's all-reduce on CPU is a ring, so it
gets the ring's counts. "Bytes sent" counts what the critical rank's link carries one
after the other: for the ring, what it sends (it receives as much at the same time,
full duplex); for naive, what rank 0 receives and then what it sends.

Two things the plain model leaves out, and how they are handled here:

- gamma cannot be fitted. Every algorithm adds each byte it receives once, so bytes
  added are half the bytes sent in every row: from all-reduce times alone only
  beta + gamma/2 can be told apart. gamma is measured on its own (the workers time
  `tensor += other` at every size) and alpha and beta are fitted with it fixed.
- The shaped link is a token bucket (tbf), not a wire: after an idle moment, up to
  the bucket's depth (256 KiB at 1 Gbit/s) leaves at memory speed. So each phase of
  a call, a stretch in which one direction of the critical link carries data (the
  ring: one; naive and the tree: one in, then one out), gets its first `free_bytes`
  for nothing: the bytes term is sum over phases of max(0, phase bytes - free_bytes)
  times beta. free_bytes is fitted too (the best of a grid); a real switch port has no
  such bucket, so predictions for other clusters set it to 0.

The fit: least squares on relative error (4 KiB counts as much as 256 MiB), over
every world size measured without emulated delay, on every other size from the
smallest; the sizes in between are held out to test it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

GAMMA_MIN_BYTES = 2**20  # gamma from adds of at least 1 MiB: out of cache, as in a call
FREE_BYTES_GRID = [0] + [2**k for k in range(12, 23)]  # 4 KiB .. 4 MiB, and none


@dataclass(frozen=True)
class Counts:
    """What one all-reduce costs on its critical path, before alpha, beta, gamma."""

    steps: float  # rounds of messages, each paying alpha
    phases: tuple[float, ...]  # bytes through the critical link, phase after phase
    added: float  # bytes of local reduction

    @property
    def sent(self) -> float:
        return sum(self.phases)


def counts(algorithm: str, p: int, size_bytes: float, ranks_per_node: int = 1) -> Counts:
    """Steps, bytes and bytes added on the critical path of one all-reduce.
    `ranks_per_node`: the nodes the hierarchical algorithms' phases run over."""
    n = size_bytes
    if p % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} does not cut {p} ranks into whole nodes")
    if p == 1:
        return Counts(0, (), 0)
    if algorithm.startswith("hierarchical_"):
        between = algorithm.removeprefix("hierarchical_")
        return three_phases(between, p // ranks_per_node, ranks_per_node, n).total
    if algorithm == "naive":  # rank 0 receives everyone's, then sends to everyone
        return Counts(2, ((p - 1) * n, (p - 1) * n), (p - 1) * n)
    if algorithm in ("ring", "gloo"):
        return Counts(2 * (p - 1), (2 * (p - 1) / p * n,), (p - 1) / p * n)
    if algorithm == "halving_doubling":
        q = 1 << (p.bit_length() - 1)
        core = 2 * (q - 1) / q * n
        if q == p:
            return Counts(2 * math.log2(q), (core,), (q - 1) / q * n)
        # An extra rank's n in, the core's exchanges, then n back out to it.
        return Counts(2 * math.log2(q) + 2, (n, core, n), ((q - 1) / q + 1) * n)
    if algorithm == "tree":  # rank 0 receives from ceil(lg p) children, then sends
        depth = math.ceil(math.log2(p))
        return Counts(tree_steps(p), (depth * n, depth * n), depth * n)
    raise ValueError(f"no cost model for algorithm {algorithm!r}")


@dataclass(frozen=True)
class ThreePhases:
    """A hierarchical all-reduce on its critical path, phase by phase: inside each
    node, between the nodes, inside again."""

    inside_before: Counts  # phase 1: each node's sum made inside it
    between: Counts  # phase 2: what one rank that crosses between nodes does
    inside_after: Counts  # phase 3: the result spread inside each node
    ranks_between: int  # ranks of a node in phase 2 at once: they share its link out

    @property
    def total(self) -> Counts:
        """The three one after the other, on one rank's link: what ddp.collectives
        runs, where every link is alike."""
        parts = (self.inside_before, self.between, self.inside_after)
        return Counts(
            sum(c.steps for c in parts),
            tuple(b for c in parts for b in c.phases),
            sum(c.added for c in parts),
        )


def three_phases(
    between_algorithm: str,
    nodes: int,
    ranks_per_node: int,
    size_bytes: float,
    *,
    sharded: bool = False,
) -> ThreePhases:
    """The phases of a hierarchical all-reduce of n = `size_bytes` over N = `nodes`
    nodes of g = `ranks_per_node` ranks, with `between_algorithm` (ring or
    halving_doubling) between nodes. Two forms:

    - sharded=False: Goyal et al.'s, as `ddp.collectives` builds it
      (hierarchical_ring, hierarchical_halving_doubling). The binomial tree's upward
      half sums the node's n on its first rank, the leader (the tree's steps to the
      root, ceil(lg g) n received and added); the N leaders all-reduce all n
      (c(between, N, n)), one rank per node; the tree's downward half sends the result
      back (the rest of the tree's steps, ceil(lg g) n sent).
    - sharded=True: NCCL's, as `profiling.simulate.topology` prices it. A ring
      reduce-scatter leaves each rank of a node one shard n/g of the node's sum (g-1
      steps, (g-1)/g n sent and added); all g ranks all-reduce their shard with their
      peers on the other nodes at once (c(between, N, n/g) each, through the node's one
      link); a ring all-gather inside finishes (g-1 steps, (g-1)/g n sent).

    Between nodes the two put the same bytes through a node's link, 2(N-1)/N n for the
    ring, in the same steps; inside a node the tree takes 2 ceil(lg g) steps of all n,
    the ring 2(g-1) steps of n/g."""
    n, g = size_bytes, ranks_per_node
    if sharded:
        between = counts(between_algorithm, nodes, n / g)
        shard = (g - 1) / g * n  # the ring's bytes each way, and the reduce-scatter's adds
        before = Counts(g - 1, (shard,) if g > 1 else (), shard)
        after = Counts(g - 1, (shard,) if g > 1 else (), 0.0)
        return ThreePhases(before, between, after, ranks_between=g)
    between = counts(between_algorithm, nodes, n)
    up_steps, all_steps = _tree_schedule(g)
    depth = math.ceil(math.log2(g))  # the leader's children in the tree
    whole = (depth * n,) if g > 1 else ()
    before = Counts(up_steps, whole, depth * n)
    after = Counts(all_steps - up_steps, whole, 0.0)
    return ThreePhases(before, between, after, ranks_between=1)


def tree_steps(p: int) -> int:
    """Latencies on the binomial tree's critical path: 2 lg p for a power of two,
    fewer otherwise (a rank with no children sends at once; 3 for p = 3, 5 for p = 6)."""
    return _tree_schedule(p)[1]


def _tree_schedule(p: int) -> tuple[int, int]:
    """(latencies until rank 0 holds the sum, until every rank holds it) on the
    binomial tree. Worked out by running the tree's schedule with one unit per message
    and instant transfers: a rank sends up once it has received from all its children,
    and sends down to its children one after the other, farthest first."""

    def lowest_bit(r: int) -> int:  # the distance to r's parent; the root's is beyond p
        return r & -r if r else 1 << p.bit_length()

    def children(r: int) -> list[int]:  # farthest first, as ddp.collectives sends them
        distances = (1 << k for k in reversed(range(p.bit_length())))
        return [r + d for d in distances if d < lowest_bit(r) and r + d < p]

    leaves_first = sorted(range(p), key=lowest_bit)  # a child's distance < its parent's
    up: dict[int, int] = {}  # rank -> when it holds its subtree's sum
    for r in leaves_first:
        up[r] = max((up[c] + 1 for c in children(r)), default=0)
    down = {0: up[0]}  # rank -> when it holds the result
    for r in reversed(leaves_first):
        for k, c in enumerate(children(r), start=1):
            down[c] = down[r] + k
    return up[0], max(down.values())


def predict(
    fit: dict,
    algorithm: str,
    p: int,
    size_bytes: float,
    delay_s: float = 0,
    free_bytes: float | None = None,
    ranks_per_node: int = 1,
) -> float:
    """Seconds for one all-reduce. `delay_s` adds the emulated delay to every step;
    `free_bytes` (default: the fitted one) is what each phase gets through for free;
    `ranks_per_node`: the hierarchical algorithms' nodes."""
    c = counts(algorithm, p, size_bytes, ranks_per_node)
    free = fit["free_bytes"] if free_bytes is None else free_bytes
    wire = sum(max(0.0, phase - free) for phase in c.phases)
    return (
        c.steps * (fit["alpha_s"] + delay_s)
        + wire * fit["beta_s_per_byte"]
        + (c.added * fit["gamma"])
    )


def measure_gamma(runs: list[dict]) -> float:
    """Seconds per byte of `tensor += other`, the median over every run's adds of at
    least GAMMA_MIN_BYTES (or of the largest size, in a sweep that stops below it)."""
    adds = [a for run in runs for a in run["add"]]
    floor = min(GAMMA_MIN_BYTES, max(a["size_bytes"] for a in adds))
    return statistics.median(
        statistics.median(a["seconds"]) / a["size_bytes"] for a in adds if a["size_bytes"] >= floor
    )


def medians(runs: list[dict]) -> list[dict]:
    """One row per (delay, world size, algorithm, size): the median and range of its
    calls."""
    rows = []
    for run in runs:
        for cell in run["cells"]:
            s = cell["seconds"]
            rows.append({
                "delay_ms": run["delay_ms"], "world_size": run["world_size"],
                "ranks_per_node": run.get("ranks_per_node", 1),
                "algorithm": cell["algorithm"], "size_bytes": cell["size_bytes"],
                "median_s": statistics.median(s), "min_s": min(s), "max_s": max(s),
                "calls": len(s), "network": run["network"]["rate"],
            })  # fmt: skip
    return rows


def split_sizes(sizes: list[int]) -> tuple[set[int], set[int]]:
    """(fitted, held out): every other size from the smallest, so both span the range."""
    ordered = sorted(set(sizes))
    return set(ordered[::2]), set(ordered[1::2])


def fit(
    rows: list[dict],
    gamma: float,
    key: str = "median_s",
    max_free_bytes: float | None = None,
    min_beta_s_per_byte: float = 0.0,
) -> dict[str, dict]:
    """Per algorithm, alpha, beta and free_bytes fitted on the no-delay rows of the
    fitted sizes (all world sizes at once), with the relative error on both sets of
    sizes. `key`: the rows' seconds fitted ("median_s", or "min_s" for each size's
    fastest call); `max_free_bytes`: the most free_bytes may be (a token bucket's
    depth), and `min_beta_s_per_byte` the least beta (the shaped link's seconds per
    byte: past the bucket, no byte crosses faster), where known."""
    plain = [r for r in rows if r["delay_ms"] == 0]
    fitted_sizes, held_out = split_sizes([r["size_bytes"] for r in plain])
    fits = {}
    for algorithm in dict.fromkeys(r["algorithm"] for r in plain):
        mine = [r for r in plain if r["algorithm"] == algorithm and r["world_size"] > 1]
        train = [r for r in mine if r["size_bytes"] in fitted_sizes]
        if len(train) < 3:
            continue
        grid = [f for f in FREE_BYTES_GRID if max_free_bytes is None or f <= max_free_bytes]
        best = min(
            (
                _fit_alpha_beta(algorithm, train, gamma, free, key, min_beta_s_per_byte)
                for free in grid
            ),
            key=lambda f: f["squared_error"],
        )
        best["fitted"] = errors(best, algorithm, train, key=key)
        held = [r for r in mine if r["size_bytes"] in held_out]
        best["held_out"] = errors(best, algorithm, held, key=key)
        fits[algorithm] = best
    return fits


def _fit_alpha_beta(
    algorithm: str,
    rows: list[dict],
    gamma: float,
    free: float,
    key: str = "median_s",
    min_beta: float = 0.0,
) -> dict:
    """alpha >= 0 and beta >= min_beta minimising the squared relative error of the
    rows' `key` seconds, gamma and free_bytes given."""
    a, b = [], []
    for r in rows:
        c = counts(algorithm, r["world_size"], r["size_bytes"], r.get("ranks_per_node", 1))
        t = r[key]
        wire = sum(max(0.0, phase - free) for phase in c.phases)
        a.append([c.steps / t, wire / t])  # each row divided by t: relative error
        b.append((t - c.added * gamma - wire * min_beta) / t)  # beta's part above min_beta
    a, b = np.array(a), np.array(b)
    candidates = [np.linalg.lstsq(a, b, rcond=None)[0]]
    # With a parameter below zero, the best non-negative fit has it at zero.
    for keep in (0, 1):
        column = a[:, keep]
        if column @ column > 0:
            theta = np.zeros(2)
            theta[keep] = max(0.0, float(column @ b / (column @ column)))
            candidates.append(theta)
    feasible = [t for t in candidates if (t >= 0).all()] or [np.zeros(2)]
    alpha, above = min(feasible, key=lambda t: float(((a @ t - b) ** 2).sum()))
    return {
        "alpha_s": float(alpha), "beta_s_per_byte": float(above + min_beta), "gamma": gamma,
        "free_bytes": free, "squared_error": float(((a @ np.array([alpha, above]) - b) ** 2).sum()),
    }  # fmt: skip


def errors(
    fit: dict, algorithm: str, rows: list[dict], delay_s: float = 0, key: str = "median_s"
) -> dict:
    """Relative error |predicted - measured| / measured (the rows' `key` seconds):
    median, worst, and where."""
    if not rows:
        return {"median_pct": None, "worst_pct": None, "worst_at": None, "rows": 0}
    errors = [
        (abs(predict(fit, algorithm, r["world_size"], r["size_bytes"], delay_s,
                     ranks_per_node=r.get("ranks_per_node", 1)) / r[key] - 1) * 100, r)
        for r in rows
    ]  # fmt: skip
    worst, at = max(errors, key=lambda e: e[0])
    return {
        "median_pct": statistics.median(e for e, _ in errors),
        "worst_pct": worst,
        "worst_at": f"{at['world_size']} ranks, {at['size_bytes']} B",
        "rows": len(rows),
    }


def delay_check(rows: list[dict], fits: dict[str, dict]) -> list[dict]:
    """The no-delay fit, plus the emulated delay on every step, against the runs with
    the delay: a test of the model on data it was not fitted to; and alpha refitted on
    those runs alone (beta kept), which should exceed the plain alpha by the delay."""
    out = []
    for delay_ms in sorted({r["delay_ms"] for r in rows} - {0}):
        for algorithm, f in fits.items():
            mine = [
                r for r in rows
                if r["delay_ms"] == delay_ms and r["algorithm"] == algorithm and r["world_size"] > 1
            ]  # fmt: skip
            if not mine:
                continue
            # alpha alone, least squares on relative error, beta and gamma as fitted.
            num = den = 0.0
            for r in mine:
                per_node = r.get("ranks_per_node", 1)
                c = counts(algorithm, r["world_size"], r["size_bytes"], per_node)
                t = r["median_s"]
                rest = (
                    predict(f, algorithm, r["world_size"], r["size_bytes"], ranks_per_node=per_node)
                    - c.steps * (f["alpha_s"])
                )
                num += c.steps / t * (t - rest) / t
                den += (c.steps / t) ** 2
            out.append({
                "delay_ms": delay_ms, "algorithm": algorithm,
                "alpha_plain_s": f["alpha_s"], "alpha_refitted_s": num / den,
                "error": errors(f, algorithm, mine, delay_ms / 1e3),
            })  # fmt: skip
    return out


CLEAR_RATIO = 1.1  # one of two algorithms is "faster" at a size only by this much


def crossovers(rows: list[dict], baseline: str = "ring") -> list[dict]:
    """Where each algorithm's measured median time crosses the baseline's as the size
    grows, per delay and world size. Only sizes where one of the two is at least
    CLEAR_RATIO faster count; between two such sizes that disagree, the crossover is
    interpolated on log-log axes. Curves that run together (halving-doubling and the
    ring on 2 ranks are the same exchange) cross by noise alone: not counted."""
    out = []
    keys = {(r["delay_ms"], r["world_size"]) for r in rows}
    clear = math.log(CLEAR_RATIO)
    for delay_ms, p in sorted(keys):
        here = {(r["algorithm"], r["size_bytes"]): r["median_s"] for r in rows
                if r["delay_ms"] == delay_ms and r["world_size"] == p}  # fmt: skip
        for algorithm in sorted({a for a, _ in here} - {baseline, "gloo"}):
            sizes = sorted(s for a, s in here if a == algorithm and (baseline, s) in here)
            ratios = [(s, math.log(here[algorithm, s] / here[baseline, s])) for s in sizes]
            decided = [(s, r) for s, r in ratios if abs(r) >= clear]
            for (s0, r0), (s1, r1) in pairwise(decided):
                if (r0 < 0) != (r1 < 0):
                    frac = r0 / (r0 - r1)
                    size = math.exp(math.log(s0) + frac * (math.log(s1) - math.log(s0)))
                    out.append({
                        "delay_ms": delay_ms, "world_size": p, "algorithm": algorithm,
                        "baseline": baseline, "size_bytes": size,
                        "faster_below": r0 < 0,  # the algorithm beats the baseline below it
                    })  # fmt: skip
    return out


def model_crossover(
    fits: dict[str, dict], a: str, b: str, p: int, delay_s: float = 0
) -> float | None:
    """The smallest size in bytes (between 1 KiB and 16 GiB, on a fine grid) where
    the fitted models of a and b swap order, or None."""
    grid = [2**10 * 2 ** (k / 16) for k in range(16 * 24 + 1)]
    diff = [predict(fits[a], a, p, s, delay_s) - predict(fits[b], b, p, s, delay_s) for s in grid]
    for (s0, d0), (s1, d1) in pairwise(zip(grid, diff, strict=True)):
        if (d0 < 0) != (d1 < 0):
            return s0 + (s1 - s0) * d0 / (d0 - d1)
    return None
