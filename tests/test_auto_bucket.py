"""bucket_cap_mb="auto" against torch's DDP (runs compared as tests.compare describes):
every rank picks the same layout and trains as torch's DDP does, the model's own cut
included; the choice between the cut and the uniform caps against cases worked out by
hand; bad options raise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import stages.auto_bucket
from stages import STAGES
from stages.auto_bucket import CANDIDATES_MB, TRIAL_ROUNDS, Layout, choose_layout, trial_layouts
from tests.adapters import build_wrapper, stages_from
from tests.compare import assert_same_steps, ours_and_torchs, run_checked, sgd_steps, tolerance
from tests.models import Layers, Wide

# Two steps before the choice, then two per layout on trial per round (at most 5
# layouts), then one with the layout decided.
AUTO_STEPS = 2 + 2 * TRIAL_ROUNDS * 5 + 1


def train_auto(rank: int, group: dist.ProcessGroup, wrapper: str) -> tuple:
    """([(gradients, parameters)] per step, [choice after each step], bucket layout)."""
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
        nbytes = sum(params[n.removeprefix("module.")].numel() * 4 for n in names)
        assert nbytes <= cap_bytes or len(names) == 1, (names, choice["bucket_cap_mb"])
    # The record's bucket sizes are those of the buckets built.
    built = [sum(params[n.removeprefix("module.")].numel() * 4 for n in names) for names in layout0]
    assert choice["bucket_sizes_bytes"] == built, (choice, layout0)
    assert choice["layout"] in ("cut", "uniform"), choice
    # The layout built is the one measured fastest on trial (the slowest rank's median).
    trials = choice["trials"]
    assert 3 <= len(trials) <= 5, trials
    fastest = min(trials, key=lambda t: t["measured_step_s"])["layout"]
    assert fastest in ("cut", f"uniform {choice['bucket_cap_mb']:g}"), (fastest, choice)
    assert (fastest == "cut") == (choice["layout"] == "cut"), (fastest, choice)
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


SLOW, FAST = 1.0, 0.25  # seconds a trial step takes by the fake clock


def train_fast_layout(rank: int, group: dist.ProcessGroup, stage: str) -> tuple:
    """The stage, with a clock by which the layout on trial third in line (here the
    best uniform cap's smaller neighbour) takes FAST seconds a step and every other
    SLOW, on rank 1 only: the slowest rank's medians must decide, on both ranks."""
    base = STAGES[stage]
    fast = {}

    class FakeClock(base):
        def _build(self, layout):
            self._now_on = layout.name
            fast.setdefault("name", self._trials[2].name)
            super()._build(layout)

        def _trial_clock(self) -> float:
            on = getattr(self, "_now_on", None)
            self._fake = getattr(self, "_fake", 0.0) + (
                FAST if on == fast.get("name") or rank == 0 else SLOW
            )
            return self._fake

    torch.manual_seed(1000 * rank + 1)
    model = Wide()
    wrapped = FakeClock(model, process_group=group, bucket_cap_mb="auto")
    sgd_steps(wrapped, model, rank, AUTO_STEPS, (2, 256))
    return fast["name"], wrapped.auto_bucket_choice


@pytest.mark.parametrize("stage", stages_from("auto_bucket"))
def test_auto_bucket_builds_the_layout_measured_fastest(pool, stage: str) -> None:
    for rank, (fast, choice) in enumerate(run_checked(pool, 2, train_fast_layout, stage)):
        measured = {t["layout"]: t["measured_step_s"] for t in choice["trials"]}
        assert measured[fast] == FAST and max(measured.values()) == SLOW, (rank, measured)
        built = (
            choice["layout"]
            if choice["layout"] == "cut"
            else f"uniform {choice['bucket_cap_mb']:g}"
        )
        assert built == fast, f"rank {rank} built {built}, measured fastest {fast}: {measured}"
