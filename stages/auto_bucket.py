"""Stage 13, auto_bucket: `bucket_cap_mb="auto"` picks the bucket size from measurements.

The best bucket size is a trade: small buckets start communicating early and overlap
more of backward, but each collective pays a fixed cost; large ones pay it rarely but
start late. The best cap depends on the model, the machine and the network, so torch
leaves it to you (25 MiB by default); Horovod autotunes its fusion buffer instead.
This stage measures and decides. In the second synchronised backward it records when
each gradient became ready; then, at the next forward, it times a few all-reduces
(a tiny one for the fixed cost, a large one for the bandwidth), takes the slowest
rank's figures so that every rank computes the same answer, and replays that backward
with those costs, for two kinds of layout: every candidate uniform cap, as torch would
cut, and the model's own cut, where each bucket gets the size that makes the last
all-reduce end first (a dynamic program over where to cut the ready order,
`ddp/bucket_cuts.py`; torch takes one cap for every bucket, and a list of caps per
bucket was proposed upstream but not merged).

The model proposes; a measurement decides. The model leaves out what costs most on a
machine whose cores both compute and communicate (each bucket's launch, and backward
slowed while an all-reduce runs), so its best is a short list, not an answer: the cut,
the best uniform cap and its two neighbours, and the default cap, each distinct layout
once. The next steps try each in turn (rounds enough for about `TRIAL_SECONDS` of
steps, `TRIAL_ROUNDS` to `MAX_TRIAL_ROUNDS`; in each, every layout for one step to
settle and one timed, from forward to the next synchronised forward), and the buckets
are rebuilt, for good, with the layout whose slowest rank's median step was shortest,
or one with fewer buckets measured within `TRIAL_TIE` of it. Horovod's autotuner also
measures rather than trusts a model.

    model = AutoBucketDDP(model, bucket_cap_mb="auto")
    ...  # after a few dozen steps: model.auto_bucket_choice["bucket_sizes_bytes"]

    python -m profiling.bench --variants drop_in_auto,torch_ddp_default --network 1gbit

The model is simple on purpose: a collective starts when its bucket is full and the
previous one is done, and takes `latency + bytes x seconds-per-byte`. Cost: a few
all-reduces once; the first steps run with the default cap, and up to
2 x MAX_TRIAL_ROUNDS x 5 steps (short steps) or 2 x TRIAL_ROUNDS x 5 (long ones) with
layouts on trial.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ddp.bucket_cuts import ROUNDING, bucket_bytes, linear_cost, plan_cut, served_in_order
from ddp.buckets import CANDIDATES_MB, Members, plan_buckets
from ddp.clock import DeviceClock, Mark
from stages.join import JoinDDP

# The candidate uniform caps (CANDIDATES_MB, imported above) live in `ddp.buckets`, beside
# the layout rule, so that the simulator's core can read them without importing a stage.
NEAR_TIE = 0.01  # layouts predicted within 1% of the best are ties: the fewest buckets win
TRIAL_ROUNDS = 5  # rounds of trial steps at least: every layout on trial, one timed step each
# Short steps are noisy and cheap: rounds are added until the trial's steps take about
# this many seconds (at the step time measured before it), up to MAX_TRIAL_ROUNDS: a
# median of a few short steps cannot tell layouts apart (the trials behind it:
# docs/stages/auto_bucket.md, "The trial: measured steps decide").
TRIAL_SECONDS = 10.0
MAX_TRIAL_ROUNDS = 200
# Layouts measured within this fraction of the fastest are ties the trial cannot split
# (a median of a few noisy steps); the fewest buckets win, as in the model's NEAR_TIE.
TRIAL_TIE = 0.02
DEFAULT_CAP_MB = 25.0  # torch's bucket_cap_mb=None


# --8<-- [start:construction]
class AutoBucketDDP(JoinDDP):
    """Stage 13: `bucket_cap_mb="auto"`: buckets cut where measured timings say
    communication ends first."""

    measures_bucket_cap = True  # takes bucket_cap_mb="auto" (ddp.train's --bucket-cap-mb auto)

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | str = 25.0, **options):
        auto = bucket_cap_mb == "auto"
        if isinstance(bucket_cap_mb, str) and not auto:
            raise ValueError(
                f"bucket_cap_mb must be a number of MiB or 'auto', got {bucket_cap_mb!r}"
            )
        if auto and options.get("find_unused_parameters"):
            raise ValueError(
                "bucket_cap_mb='auto' rebuilds buckets in the order gradients become ready, "
                "which find_unused_parameters=True allows to change every step"
            )
        super().__init__(module, bucket_cap_mb=DEFAULT_CAP_MB if auto else bucket_cap_mb, **options)
        self.auto_bucket = auto
        # position in named_trainable -> when its gradient was ready (a DeviceClock mark: on a
        # GPU, when the GPU finished it, not when the CPU queued it)
        self._ready_marks: dict[int, Mark] = {}
        self._timing_hooks: list = []  # their hooks' handles, in the one timed backward
        self.auto_bucket_choice: dict | None = None  # what was measured and chosen
        self._layout: Layout | None = None  # the layout built or on trial; None before
        self._order: list[int] = []  # the replayed ready order, the same on every rank
        self._trials: list[Layout] = []  # on trial, in turn; empty once decided
        self._trial_buckets: list[int] = []  # per layout on trial, how many buckets it has
        self._trial_rounds = TRIAL_ROUNDS  # decided with the shortlist, the same everywhere
        self._trial_step = 0  # synchronised forwards since the trials began
        self._trial_seconds: list[list[float]] = []  # per layout on trial, its timed steps
        self._step_start = 0.0  # _trial_clock() at this synchronised forward

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def _before_synced_forward(self) -> None:
        super()._before_synced_forward()
        for handle in self._timing_hooks:  # the timed backward is over
            handle.remove()
        self._timing_hooks = []
        if self.auto_bucket and self._synced_backwards == 1:  # time the second: warmed up
            self._time_gradients()
        # After the second synchronised backward (shadowed ones count: Join), on every rank.
        if self.auto_bucket and self._synced_backwards >= 2 and self.auto_bucket_choice is None:
            self._choose_bucket_cap()
        if self._trials:
            self._next_trial()
        elif self.auto_bucket and self.auto_bucket_choice is None:
            self._step_start = self._trial_clock()  # a step before the choice starts

    def _time_gradients(self) -> None:
        """Until the next synchronised forward, when each gradient is ready: a clock mark
        per position in `_ready_marks` (on a GPU, when the GPU has finished it), from
        hooks of this stage's own, run before those that launch buckets, so that no
        launch delays a mark."""
        clock, marks = self._clock, self._ready_marks

        def timing_hook(k: int):
            def mark(_) -> None:
                if k not in marks:  # the first backward's mark: the one timed
                    marks[k] = clock.mark()

            return mark

        self._timing_hooks = [
            p.register_post_accumulate_grad_hook(timing_hook(k))
            for k, (_, p) in enumerate(self.named_trainable)
        ]
        self._use_buckets(self.buckets, self.bucket_cap_mb)  # their hooks again, after these

    @property
    def auto_bucket_pending(self) -> bool:
        """Whether bucket_cap_mb="auto" has yet to settle on its layout."""
        return self.auto_bucket and (self.auto_bucket_choice is None or bool(self._trials))

    def _choose_bucket_cap(self) -> None:
        n = len(self.named_trainable)
        measured = torch.zeros(n + 3, dtype=torch.float64)
        measured[n + 2] = self._trial_clock() - self._step_start  # the step that just ended
        clock = self._clock
        clock.wait()
        first = next(iter(self._ready_marks.values()), None)
        for k, mark in self._ready_marks.items():  # seconds since the first gradient
            measured[k] = clock.seconds(first, mark)
        measured[n], measured[n + 1] = self._time_allreduce()
        measured = measured.to(self._collective_device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.process_group)
        ready_s, (latency_s, s_per_byte, step_s) = measured[:n].tolist(), measured[n:].tolist()
        order = sorted(range(n), key=lambda k: ready_s[k])
        named = [self.named_trainable[k] for k in order]
        self.auto_bucket_choice, _ = choose_layout(
            named,
            [ready_s[k] for k in order],
            latency_s,
            s_per_byte,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            sparse=self._sparse,
            overfill=self.overfill_buckets,
        )
        self._order = order  # the replayed order: the same everywhere
        # Each distinct layout once: on a small model several caps give the same buckets
        # (every cap above its size, one bucket), and a second try of one layout would
        # only take steps from the others.
        distinct: dict[tuple, tuple[Layout, int]] = {}
        for layout in trial_layouts(self.auto_bucket_choice, self.first_bucket_cap_mb):
            members = self._members(layout, named)
            key = tuple(tuple(id(p) for _, p in m) for m in members)
            distinct.setdefault(key, (layout, len(members)))
        self._trials = [layout for layout, _ in distinct.values()]
        self._trial_buckets = [buckets for _, buckets in distinct.values()]
        # One layout alone has nothing to be measured against: built at once.
        one = len(self._trials) == 1
        self._trial_rounds = 0 if one else trial_rounds(step_s, len(self._trials))
        self._trial_seconds = [[] for _ in self._trials]
        self._trial_step = 0

    def _members(self, layout: Layout, named: Members) -> list[Members]:
        """The buckets `layout` makes of `named` (the parameters in the replayed order), as
        `_build` would build them."""
        if layout.cut_sizes is not None:
            return _runs(named, layout.cut_sizes)
        return super()._rebuilt_layout(named, layout.bucket_cap_mb, layout.first_bucket_cap_mb)

    def _build(self, layout: Layout) -> None:
        """Rebuild the buckets as `layout`, in the replayed ready order (every rank):
        `_rebuilt_layout` makes them with `_members`, which the shortlist was told apart
        by."""
        self._layout = layout
        self._rebuild_buckets(self._order, layout.bucket_cap_mb, layout.first_bucket_cap_mb)

    def _next_trial(self) -> None:
        """At each synchronised forward while trials run: time the step that just ended
        if it was a timed one, then build the next layout on trial, or, after the last
        round, the one measured fastest."""
        now = self._trial_clock()
        k, step = divmod(self._trial_step, 2)  # step 0: settle after the rebuild; 1: timed
        if self._trial_step > 0 and step == 0:  # the step since the last forward was timed
            self._trial_seconds[(k - 1) % len(self._trials)].append(now - self._step_start)
        if k == self._trial_rounds * len(self._trials):
            self._decide()
            return
        if step == 0:
            self._build(self._trials[k % len(self._trials)])
        self._trial_step += 1
        self._step_start = self._trial_clock()

    def _trial_clock(self) -> float:
        """Seconds, for timing trial steps (a test replaces it to make one layout fast)."""
        return self._clock.now()

    @property
    def _clock(self) -> DeviceClock:
        return DeviceClock(self._collective_device)

    def _decide(self) -> None:
        if self._trial_rounds:
            # The slowest rank's median per layout, so that every rank decides alike.
            slowest = torch.tensor(
                [statistics.median(s) for s in self._trial_seconds],
                dtype=torch.float64,
                device=self._collective_device,
            )
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.process_group)
            timed = slowest.tolist()
            medians: list[float | None] = list(timed)
            best = pick_trial(timed, self._trial_buckets)
        else:  # one layout alone, not timed
            medians, best = [None], 0
        winner = self._trials[best]
        self._build(winner)
        self.auto_bucket_choice.update(
            layout=winner.kind,
            bucket_cap_mb=winner.bucket_cap_mb,
            bucket_sizes_bytes=[
                sum(p.numel() * p.element_size() for p in b.params) for b in self.buckets
            ],
            trial_rounds=self._trial_rounds,
            trials=[
                {"layout": t.name, "buckets": b, "measured_step_s": m}
                for t, b, m in zip(self._trials, self._trial_buckets, medians, strict=True)
            ],
        )
        self._trials = []

    def _rebuilt_layout(
        self, named: Members, bucket_cap_mb: float, first_bucket_cap_mb: float | None
    ) -> list[Members]:
        if self._layout is None:  # the first rebuild, before the choice
            return super()._rebuilt_layout(named, bucket_cap_mb, first_bucket_cap_mb)
        return self._members(self._layout, named)

    def _time_allreduce(self) -> tuple[float, float]:
        """(fixed seconds per all-reduce, seconds per byte), from this rank's view."""
        device = self._collective_device
        total = sum(b.buffer.numel() for b in self.buckets)
        small, large = torch.zeros(1, device=device), torch.zeros(min(total, 2**21), device=device)

        def seconds(t: torch.Tensor, repeats: int) -> float:
            times = []
            for _ in range(repeats):
                start = self._clock.now()
                dist.all_reduce(t, group=self.process_group)
                times.append(self._clock.now() - start)  # on a GPU: once it has run
            return statistics.median(times)

        seconds(small, 1)  # warm the connection
        latency = seconds(small, 5)
        per_byte = max(seconds(large, 3) - latency, 0.0) / (large.numel() * large.element_size())
        return latency, per_byte

    # --8<-- [end:forward]


def _runs(named: Members, sizes: list[int]) -> list[Members]:
    """The model's buckets: runs of `sizes` consecutive parameters of the ready order."""
    starts = [0, *itertools.accumulate(sizes)]
    return [named[a:b] for a, b in itertools.pairwise(starts)]


@dataclass(frozen=True)
class Layout:
    """A layout on trial: a uniform cap (and first-bucket cap), or the model's cut."""

    name: str  # what the record calls it: "cut" or "uniform <cap>"
    bucket_cap_mb: float
    first_bucket_cap_mb: float | None
    cut_sizes: list[int] | None = None  # the cut's bucket lengths, in parameters

    @property
    def kind(self) -> str:
        return "cut" if self.cut_sizes is not None else "uniform"


# --8<-- [start:trials]
def trial_layouts(choice: dict, first_bucket_cap_mb: float | None) -> list[Layout]:
    """What the steps after the model's choice try, in this order: the model's pick
    (`choose_layout`), the other of the cut and the best uniform cap, that cap's two
    neighbours in CANDIDATES_MB, and the default cap (torch's 25 MiB, with the first
    bucket's cap); each once."""
    uniform = lambda cap: Layout(f"uniform {cap:g}", cap, first_bucket_cap_mb)  # noqa: E731
    cut = Layout("cut", choice["cut_bucket_cap_mb"], None, choice["cut_sizes"])
    best = CANDIDATES_MB.index(choice["uniform_bucket_cap_mb"])
    picked, other = (cut, uniform(CANDIDATES_MB[best]))
    if choice["layout"] != "cut":
        picked, other = other, picked
    neighbours = [
        uniform(CANDIDATES_MB[k]) for k in (best - 1, best + 1) if 0 <= k < len(CANDIDATES_MB)
    ]
    layouts = [picked, other, *neighbours, uniform(DEFAULT_CAP_MB)]
    unique: dict[str, Layout] = {}
    for layout in layouts:
        unique.setdefault(layout.name, layout)
    return list(unique.values())


def trial_rounds(step_s: float, layouts: int) -> int:
    """How many rounds the trial runs, given the step time measured before it (the
    slowest rank's, so the same on every rank) and the layouts on trial: enough for
    about TRIAL_SECONDS of steps (two a layout a round), within TRIAL_ROUNDS and
    MAX_TRIAL_ROUNDS."""
    wanted = math.ceil(TRIAL_SECONDS / (2 * layouts * step_s)) if step_s > 0 else MAX_TRIAL_ROUNDS
    return min(MAX_TRIAL_ROUNDS, max(TRIAL_ROUNDS, wanted))


def pick_trial(medians_s: list[float], buckets: list[int]) -> int:
    """Which layout on trial to build, given each one's median step and bucket count:
    of those measured within TRIAL_TIE of the fastest, the one with the fewest buckets
    (the faster of equals). The trial's medians of a few steps cannot split layouts
    closer than that, and each bucket more costs the machine something every step."""
    fastest = min(medians_s)
    near = [k for k, m in enumerate(medians_s) if m <= fastest * (1 + TRIAL_TIE)]
    return min(near, key=lambda k: (buckets[k], medians_s[k]))


# --8<-- [end:trials]


# --8<-- [start:choice]
def choose_layout(
    named: Members,
    ready_s: list[float],
    latency_s: float,
    s_per_byte: float,
    *,
    first_bucket_cap_mb: float | None,
    sparse: frozenset[str] = frozenset(),
    overfill: bool = False,
) -> tuple[dict, list[int] | None]:
    """What `bucket_cap_mb="auto"` builds, given the parameters in the order their
    gradients became ready (`ready_s[i]`: parameter i's) and the cost of an all-reduce:
    the model's own cut where it is predicted to end first, else the best uniform cap.
    Returns the record `auto_bucket_choice` holds, and the cut's bucket lengths in
    parameters (None: the uniform cap's layout). `overfill`: how the stage cuts a uniform
    cap's buckets (`plan_buckets`)."""
    position = {id(p): i for i, (_, p) in enumerate(named)}
    first = lambda cap: min(cap, first_bucket_cap_mb or cap)  # noqa: E731
    uniform = {
        cap: plan_buckets(
            named,
            cap,
            first_bucket_cap_mb=first(cap),
            ready_order=True,
            sparse=sparse,
            overfill=overfill,  # as the stage cuts them (`overfill_buckets`)
        )
        for cap in CANDIDATES_MB
    }
    predicted = {
        cap: _replay(plan, ready_s, position, latency_s, s_per_byte)
        for cap, plan in uniform.items()
    }
    best = min(predicted.values())
    uniform_cap = max(c for c, t in predicted.items() if t <= best * (1 + NEAR_TIE))
    plan, cut = plan_cut(
        named, ready_s, linear_cost(latency_s, s_per_byte), sparse=sparse, slack=NEAR_TIE
    )
    # The cut if it ends first, or as early (to rounding) in fewer buckets.
    uniform_s, cut_s = predicted[uniform_cap], cut.end_s
    use_cut = cut_s < uniform_s * (1 - ROUNDING) or (
        cut_s <= uniform_s * (1 + ROUNDING) and len(cut.sizes) < len(uniform[uniform_cap])
    )
    # The smallest candidate cap that every bucket of several gradients fits under: what
    # bucket_cap_mb still promises of the cut.
    several = [b for b, m in zip(bucket_bytes(plan), plan, strict=True) if len(m) > 1]
    cut_cap = min(c for c in CANDIDATES_MB if all(b <= c * 2**20 for b in several))
    if use_cut:
        cap = cut_cap
    else:
        plan, cap = uniform[uniform_cap], uniform_cap
    record = {
        "layout": "cut" if use_cut else "uniform",
        "bucket_cap_mb": cap,
        "uniform_bucket_cap_mb": uniform_cap,
        "latency_s": latency_s,
        "bandwidth_MBps": 1e-6 / s_per_byte if s_per_byte > 0 else float("inf"),
        "backward_s": max(ready_s, default=0.0),
        "predicted_s": cut.end_s,  # the model's cut
        "predicted_uniform_s": predicted[uniform_cap],
        "predicted_by_cap_s": predicted,
        "bucket_sizes_bytes": bucket_bytes(plan),  # the layout built, in launch order
        "cut_sizes": cut.sizes,  # the model's cut, in parameters per bucket
        "cut_bucket_cap_mb": cut_cap,
    }
    return record, cut.sizes if use_cut else None


# --8<-- [end:choice]


def _replay(
    plan: list[Members],
    ready_s: list[float],
    position: dict[int, int],
    latency_s: float,
    s_per_byte: float,
) -> float:
    """When the last all-reduce would end, in seconds after the first gradient: each
    bucket served in order once its last gradient is ready (`served_in_order`), at the
    cost the cut is planned with."""
    cost = linear_cost(latency_s, s_per_byte)
    full = [max(ready_s[position[id(p)]] for _, p in members) for members in plan]
    took = [cost(sum(p.numel() * p.element_size() for _, p in members)) for members in plan]
    return max(0.0, served_in_order(full, took))


if __name__ == "__main__":
    from ddp.train import main

    main(AutoBucketDDP)
