"""bucket_cap_mb="auto" against torch's DDP (runs compared as tests.against_torch describes):
every rank picks the same layout and trains as torch's DDP does, the model's own cut
included; the choice between the cut and the uniform caps against cases worked out by
hand; bad options raise."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

import stages.auto_bucket
from stages import STAGES
from stages.auto_bucket import (
    CANDIDATES_MB,
    MAX_TRIAL_ROUNDS,
    TRIAL_ROUNDS,
    Layout,
    choose_layout,
    pick_trial,
    trial_layouts,
    trial_rounds,
)
from tests.adapters import build_wrapper, stages_from
from tests.against_torch import (
    assert_same_steps,
    ours_and_torchs,
    run_checked,
    sgd_steps,
    tolerance,
)
from tests.nets import Layers, Wide

# Two steps before the choice, then two per layout on trial per round (at most 5
# layouts; the fewest rounds, under `fewest_rounds`), then one with the layout decided.
AUTO_STEPS = 2 + 2 * TRIAL_ROUNDS * 5 + 1


@contextmanager
def fewest_rounds():
    """No seconds of trial wanted: TRIAL_ROUNDS rounds, however short the steps (steps of
    a few ms would run for MAX_TRIAL_ROUNDS)."""
    seconds = stages.auto_bucket.TRIAL_SECONDS
    stages.auto_bucket.TRIAL_SECONDS = 0.0
    try:
        yield
    finally:
        stages.auto_bucket.TRIAL_SECONDS = seconds


def train_auto(rank: int, group: dist.ProcessGroup, wrapper: str) -> tuple:
    """([(gradients, parameters)] per step, [choice after each step], bucket layout), with
    the fewest rounds of trial."""
    with fewest_rounds():
        return _train_auto(rank, group, wrapper)


def _train_auto(rank: int, group: dist.ProcessGroup, wrapper: str) -> tuple:
    torch.manual_seed(1000 * rank + 1)
    model = Wide()
    cap_mb = None if wrapper == "torch_ddp" else "auto"  # torch's default cap
    wrapped = build_wrapper(wrapper, model, group, bucket_cap_mb=cap_mb)
    choices = []
    record = sgd_steps(
        wrapped,
        model,
        rank,
        AUTO_STEPS,
        (2, 256),
        after=lambda: choices.append(getattr(wrapped, "auto_bucket_choice", None)),
    )
    layout = [b.names for b in getattr(wrapped, "buckets", [])]
    return record, choices, layout


@pytest.mark.parametrize("stage", stages_from("auto_bucket"))
def test_auto_bucket_cap_agreed_and_as_torch(pool, stage: str) -> None:
    runs = run_checked(pool, 2, ours_and_torchs, train_auto, stage)
    (_, choices0, layout0), _ = runs[0]
    choice = choices0[-1]
    assert choice is not None, f"no auto_bucket_choice after {AUTO_STEPS} steps: {choices0}"
    assert choices0[2] is not None, "the cap is chosen at the third step's forward"
    assert choice["bucket_cap_mb"] in CANDIDATES_MB, choice
    cap_bytes = choice["bucket_cap_mb"] * 2**20
    params = dict(Wide().named_parameters())
    for names in layout0:  # one layer is just over 0.25 MiB: alone in its bucket then
        sizes = [params[n.removeprefix("module.")].numel() * 4 for n in names]
        if STAGES[stage].overfill_buckets:  # torch's rule: closed once it reaches the cap
            assert sum(sizes[:-1]) < cap_bytes, (names, choice["bucket_cap_mb"])
        else:
            assert sum(sizes) <= cap_bytes or len(names) == 1, (names, choice["bucket_cap_mb"])
    # The record's bucket sizes are those of the buckets built.
    built = [sum(params[n.removeprefix("module.")].numel() * 4 for n in names) for names in layout0]
    assert choice["bucket_sizes_bytes"] == built, (choice, layout0)
    assert choice["layout"] in ("cut", "uniform"), choice
    # The layout built is the one pick_trial takes from the trial's medians (the slowest
    # rank's): the fastest, or fewer buckets within TRIAL_TIE of it.
    trials = choice["trials"]
    assert 1 <= len(trials) <= 5, trials
    assert len({t["layout"] for t in trials}) == len(trials), trials
    # (The model's cut can be the one uniform layout: then one layout, built untimed.)
    rounds = TRIAL_ROUNDS if len(trials) > 1 else 0
    assert choice["trial_rounds"] == rounds, choice
    times, buckets = [t["measured_step_s"] for t in trials], [t["buckets"] for t in trials]
    picked = trials[pick_trial(times, buckets) if rounds else 0]
    assert picked["layout"] in ("cut", f"uniform {choice['bucket_cap_mb']:g}"), (picked, choice)
    assert (picked["layout"] == "cut") == (choice["layout"] == "cut"), (picked, choice)
    assert picked["buckets"] == len(layout0), (picked, layout0)
    for rank, ((ours, choices, layout), (torchs, _, _)) in enumerate(runs):
        # Every rank computes the choice from the same (all-reduced) timings, so the
        # whole record, measured figures included, is the same.
        assert choices == choices0, f"rank {rank} chose {choices[-1]}, rank 0 {choice}"
        assert layout == layout0, f"rank {rank}'s buckets {layout} differ from rank 0's {layout0}"
        assert_same_steps(ours, torchs, f"rank {rank}", tolerance(2))


def bad_auto_options(rank: int, group: dist.ProcessGroup, stage: str) -> list[str]:
    errors = []
    for options in (
        {"bucket_cap_mb": "big"},
        {"bucket_cap_mb": "auto", "find_unused_parameters": True},
    ):
        try:
            STAGES[stage](Layers(), process_group=group, **options)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.parametrize("stage", stages_from("auto_bucket"))
def test_auto_bucket_rejects_bad_options(pool, stage: str) -> None:
    (big, unused_auto), _ = run_checked(pool, 2, bad_auto_options, stage)
    assert "'big'" in big, f"bucket_cap_mb='big' gave {big!r}"
    assert "find_unused_parameters" in unused_auto, f"'auto' with unused: {unused_auto!r}"


MiB = 2**20


def one_mib_params(n: int) -> list[tuple[str, nn.Parameter]]:
    return [(f"p{i}", nn.Parameter(torch.empty(MiB // 4, device="meta"))) for i in range(n)]


def test_choice_cuts_where_no_uniform_cap_does() -> None:
    # Four 1 MiB gradients, three ready at once, the last 40 ms later; 5 ms + 10 ms per
    # MiB an all-reduce. With no smaller first bucket, the uniform caps give
    #   <= 1 MiB: one each: 0-15, -30, -45, then the last 45-60 ms     -> 60 ms
    #      2 MiB: [p0 p1] 0-25, [p2 p3] from 40 to 65                  -> 65 ms
    #   >= 5 MiB: one bucket from 40 ms, 45 ms long                    -> 85 ms
    # and the cut [p0 p1 p2] 0-35, [p3] 40-55 ends at 55 ms, in 2 buckets; no layout
    # ends earlier (p3 alone after 40 ms takes 15). bucket_cap_mb: the smallest
    # candidate its 3 MiB bucket fits under.
    choice, sizes = choose_layout(
        one_mib_params(4), [0.0, 0.0, 0.0, 0.040], 0.005, 0.010 / MiB, first_bucket_cap_mb=None
    )
    assert sizes == [3, 1]
    assert choice["layout"] == "cut"
    assert choice["predicted_s"] == pytest.approx(0.055)
    assert choice["uniform_bucket_cap_mb"] == 1.0
    assert choice["predicted_uniform_s"] == pytest.approx(0.060)
    assert choice["bucket_sizes_bytes"] == [3 * MiB, MiB]
    assert choice["bucket_cap_mb"] == 5.0


def test_choice_takes_the_cut_as_fast_with_fewer_buckets() -> None:
    # The same, but with a 1 MiB first bucket the 2 MiB cap gives [p0] 0-15, [p1 p2]
    # 15-40, [p3] 40-55: as early as the cut, in 3 buckets to its 2.
    choice, sizes = choose_layout(
        one_mib_params(4), [0.0, 0.0, 0.0, 0.040], 0.005, 0.010 / MiB, first_bucket_cap_mb=1.0
    )
    assert choice["uniform_bucket_cap_mb"] == 2.0
    assert choice["predicted_uniform_s"] == pytest.approx(0.055)
    assert (choice["layout"], sizes) == ("cut", [3, 1])


def test_choice_keeps_the_uniform_cap_when_the_cut_is_no_better() -> None:
    # One gradient: every layout is the same one bucket, ending at 0.5 + 5 + 10 ms.
    choice, sizes = choose_layout(
        one_mib_params(1), [0.5], 0.005, 0.010 / MiB, first_bucket_cap_mb=1.0
    )
    assert (choice["layout"], sizes) == ("uniform", None)
    assert choice["bucket_cap_mb"] == choice["uniform_bucket_cap_mb"] == 1e6  # ties: largest
    assert choice["predicted_s"] == choice["predicted_uniform_s"] == pytest.approx(0.515)
    assert choice["bucket_sizes_bytes"] == [MiB]


FORCED_CUT = [3, 5]  # Wide's 8 gradients, in ready order: a layout no uniform cap makes


def train_forced_cut(rank: int, group: dist.ProcessGroup, wrapper: str) -> tuple:
    """train_auto, with the layouts on trial replaced by FORCED_CUT alone: the rebuild
    must build it."""
    real = stages.auto_bucket.trial_layouts
    stages.auto_bucket.trial_layouts = lambda *_, **__: [Layout("cut", 1e6, None, FORCED_CUT)]
    try:
        return train_auto(rank, group, wrapper)
    finally:
        stages.auto_bucket.trial_layouts = real


@pytest.mark.parametrize("stage", stages_from("auto_bucket"))
def test_auto_bucket_builds_the_cut_and_trains_as_torch(pool, stage: str) -> None:
    runs = run_checked(pool, 2, ours_and_torchs, train_forced_cut, stage)
    for rank, ((ours, _, layout), (torchs, _, _)) in enumerate(runs):
        assert [len(names) for names in layout] == FORCED_CUT, f"rank {rank}: {layout}"
        # Runs of the ready order: backward makes the last layer's gradients first.
        layers = [int(n.split(".")[-2]) for names in layout for n in names]
        assert layers == sorted(layers, reverse=True), f"rank {rank}: {layout}"
        assert_same_steps(ours, torchs, f"rank {rank}", tolerance(2))


def test_trial_layouts_model_pick_first_then_the_others_once() -> None:
    # The model picked the uniform 1 MiB cap: then the cut, 1's neighbours 0.5 and 2,
    # and the default 25 MiB (with the 1 MiB first bucket).
    choice = {"layout": "uniform", "uniform_bucket_cap_mb": 1.0, "cut_sizes": [3, 1],
              "cut_bucket_cap_mb": 5.0}  # fmt: skip
    names = [t.name for t in trial_layouts(choice, first_bucket_cap_mb=1.0)]
    assert names == ["uniform 1", "cut", "uniform 0.5", "uniform 2", "uniform 25"]
    cut = trial_layouts(choice, first_bucket_cap_mb=1.0)[1]
    assert (cut.cut_sizes, cut.bucket_cap_mb, cut.kind) == ([3, 1], 5.0, "cut")
    # The cut picked, the best uniform cap the default: four, 25 once; one bucket (the
    # last candidate) has one neighbour.
    choice.update(layout="cut", uniform_bucket_cap_mb=25.0)
    names = [t.name for t in trial_layouts(choice, first_bucket_cap_mb=1.0)]
    assert names == ["cut", "uniform 25", "uniform 10", "uniform 50"]
    choice.update(uniform_bucket_cap_mb=1e6)
    names = [t.name for t in trial_layouts(choice, first_bucket_cap_mb=1.0)]
    assert names == ["cut", "uniform 1e+06", "uniform 100", "uniform 25"]


def test_trial_rounds_fill_the_trial_seconds_within_the_bounds() -> None:
    # TRIAL_SECONDS = 10 s of steps, two per layout a round: 5 layouts of 0.1 s steps
    # take 1 s a round, so 10 rounds; of 1 s steps, 1 round wanted, 5 at least; of 5 ms
    # steps, 200; of 1 ms steps, 1000 wanted, 200 at most.
    assert trial_rounds(0.1, 5) == 10
    assert trial_rounds(0.3, 2) == 9  # ceil(10 / 1.2)
    assert trial_rounds(1.0, 5) == TRIAL_ROUNDS == 5
    assert trial_rounds(0.005, 5) == 200
    assert trial_rounds(0.001, 5) == MAX_TRIAL_ROUNDS == 200
    assert trial_rounds(0.0, 3) == MAX_TRIAL_ROUNDS  # a step too short to time


def test_pick_trial_takes_fewer_buckets_within_the_tie() -> None:
    # 1.5% slower in 2 buckets beats the fastest in 5; 3% slower in 1 is past the 2% tie.
    assert pick_trial([1.00, 1.015, 1.03], [5, 2, 1]) == 1
    # Outside the tie, the fastest, whatever its buckets.
    assert pick_trial([1.00, 1.05], [9, 1]) == 0
    # Within it and with as many buckets, the faster.
    assert pick_trial([1.01, 1.00, 1.015], [3, 3, 3]) == 1


# A shortlist with repeats, for Wide (eight gradients, 1 MiB in all and just over it):
# with no smaller first bucket, one bucket at every cap from 2 MiB up, one per gradient
# at 0.25 MiB; with a 1 MiB first bucket, two (seven gradients, then one). Cut by
# torch's rule (`overfill_buckets`, the drop-in), a bucket takes gradients until it
# reaches its cap: a layer per bucket at 0.25 MiB, and one bucket with a 1 MiB first
# bucket, as without.
SHORTLIST = [
    Layout("uniform 1e+06", 1e6, None),  # 1 bucket
    Layout("cut", 1e6, None, [3, 5]),  # 2
    Layout("uniform 100", 100.0, None),  # as 1e6
    Layout("uniform 1e+06, first 1", 1e6, 1.0),  # 2, not the cut's
    Layout("uniform 0.25", 0.25, None),  # 8
    Layout("uniform 100, first 1", 100.0, 1.0),  # as 1e6 with the first at 1
    Layout("uniform 25", 25.0, None),  # as 1e6
]


@contextmanager
def shortlist(names: list[str]):
    """The model's shortlist replaced by the layouts of SHORTLIST named `names`, in
    SHORTLIST's order (the model's own depends on timings)."""
    real = stages.auto_bucket.trial_layouts
    stages.auto_bucket.trial_layouts = lambda *_, **__: [t for t in SHORTLIST if t.name in names]
    try:
        yield
    finally:
        stages.auto_bucket.trial_layouts = real


def with_shortlist(rank: int, group: dist.ProcessGroup, stage: str, names: list[str]) -> tuple:
    """The stage with bucket_cap_mb="auto" on Wide, with `shortlist(names)`, three steps
    in (the shortlist made, the trial begun if there is one): (pending, the layouts on
    trial's names, the record)."""
    with shortlist(names):
        torch.manual_seed(1000 * rank + 1)
        model = Wide()
        wrapped = STAGES[stage](model, process_group=group, bucket_cap_mb="auto")
        sgd_steps(wrapped, model, rank, 3, (2, 256))
        tried = [t.name for t in wrapped._trials]
        return wrapped.auto_bucket_pending, tried, wrapped.auto_bucket_choice


@pytest.mark.parametrize("stage", stages_from("auto_bucket"))
def test_each_distinct_layout_is_tried_once(pool, stage: str) -> None:
    # The first of each distinct layout, in the shortlist's order; a first bucket's cap
    # makes a layout of its own.
    names = [t.name for t in SHORTLIST]
    expected = ["uniform 1e+06", "cut", "uniform 1e+06, first 1", "uniform 0.25"]
    if STAGES[stage].overfill_buckets:  # one bucket with the 1 MiB first one too
        expected.remove("uniform 1e+06, first 1")
    for rank, (pending, tried, _) in enumerate(run_checked(pool, 2, with_shortlist, stage, names)):
        assert pending, f"rank {rank}: no trial"
        assert tried == expected, f"rank {rank}: {tried}"


@pytest.mark.parametrize("stage", stages_from("auto_bucket"))
def test_one_distinct_layout_is_built_without_a_trial(pool, stage: str) -> None:
    names = ["uniform 1e+06", "uniform 100", "uniform 25"]  # one bucket, thrice
    for rank, (pending, tried, choice) in enumerate(
        run_checked(pool, 2, with_shortlist, stage, names)
    ):
        assert not pending and tried == [], f"rank {rank}: on trial: {tried}"
        assert choice["trial_rounds"] == 0, (rank, choice)
        assert choice["trials"] == [
            {"layout": "uniform 1e+06", "buckets": 1, "measured_step_s": None}
        ], (rank, choice)
        assert len(choice["bucket_sizes_bytes"]) == 1, (rank, choice)


ON_TRIAL = ["uniform 1e+06", "cut", "uniform 0.25"]  # 1, 2 and 8 buckets of Wide
PRE = 0.05  # seconds a step takes by the fake clock before the trial: 34 rounds of 3
CLOCK_STEPS = 2 + 2 * trial_rounds(PRE, len(ON_TRIAL)) * len(ON_TRIAL) + 1


def train_with_clock(
    rank: int, group: dist.ProcessGroup, stage: str, seconds: list[dict[str, float]]
) -> dict:
    """The stage on the shortlist ON_TRIAL, with a clock by which a step on a layout
    takes seconds[rank][its name], and PRE before the trial: its record."""
    base = STAGES[stage]

    class FakeClock(base):
        def _build(self, layout):
            self._now_on = layout.name
            super()._build(layout)

        def _trial_clock(self) -> float:
            on = getattr(self, "_now_on", None)
            # From 100 s: a step before the choice timed from 0 would take 100 s.
            self._fake = getattr(self, "_fake", 100.0) + (PRE if on is None else seconds[rank][on])
            return self._fake

    torch.manual_seed(1000 * rank + 1)
    model = Wide()
    with shortlist(ON_TRIAL):
        wrapped = FakeClock(model, process_group=group, bucket_cap_mb="auto")
        sgd_steps(wrapped, model, rank, CLOCK_STEPS, (2, 256))
    return wrapped.auto_bucket_choice


def built_name(choice: dict) -> str:
    return "cut" if choice["layout"] == "cut" else f"uniform {choice['bucket_cap_mb']:g}"


SLOW, FAST = 1.0, 0.25


@pytest.mark.parametrize("stage", stages_from("auto_bucket"))
def test_auto_bucket_builds_the_layout_measured_fastest(pool, stage: str) -> None:
    # On rank 1 only the layout with the most buckets is fast, on rank 0 every one: the
    # slowest rank's medians must decide, on both ranks.
    seconds = [dict.fromkeys(ON_TRIAL, FAST), {**dict.fromkeys(ON_TRIAL, SLOW), ON_TRIAL[-1]: FAST}]
    for rank, choice in enumerate(run_checked(pool, 2, train_with_clock, stage, seconds)):
        measured = {t["layout"]: t["measured_step_s"] for t in choice["trials"]}
        assert measured == seconds[1], (rank, measured)
        # The step before the trial took PRE: rounds for TRIAL_SECONDS of such steps.
        assert choice["trial_rounds"] == trial_rounds(PRE, 3) == 34, (rank, choice)
        assert built_name(choice) == ON_TRIAL[-1], (rank, built_name(choice), measured)


@pytest.mark.parametrize("stage", stages_from("auto_bucket"))
@pytest.mark.parametrize(("one_bucket_s", "built"), [(1.01, "uniform 1e+06"), (1.05, "cut")])
def test_auto_bucket_builds_fewer_buckets_within_the_tie(
    pool, stage: str, one_bucket_s: float, built: str
) -> None:
    # The cut (2 buckets) fastest; one bucket 1% slower is within the 2% tie and built,
    # 5% slower is not.
    times = {"uniform 1e+06": one_bucket_s, "cut": 1.0, "uniform 0.25": 1.5}
    for rank, choice in enumerate(run_checked(pool, 2, train_with_clock, stage, [times] * 2)):
        assert built_name(choice) == built, (rank, choice["trials"])
