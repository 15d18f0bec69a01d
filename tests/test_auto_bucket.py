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
from stages.auto_bucket import CANDIDATES_MB, choose_layout
from tests.adapters import build_wrapper, stages_from
from tests.compare import assert_same_steps, ours_and_torchs, run_checked, sgd_steps, tolerance
from tests.models import Layers, Wide

AUTO_STEPS = 5


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
    """train_auto, with the choice replaced by FORCED_CUT: the rebuild must build it."""
    real = stages.auto_bucket.choose_layout
    stages.auto_bucket.choose_layout = lambda *_, **__: (
        {"layout": "cut", "bucket_cap_mb": 1e6},
        FORCED_CUT,
    )
    try:
        return train_auto(rank, group, wrapper)
    finally:
        stages.auto_bucket.choose_layout = real


@pytest.mark.parametrize("stage", stages_from("auto_bucket"))
def test_auto_bucket_builds_the_cut_and_trains_as_torch(pool, stage: str) -> None:
    runs = run_checked(pool, 2, ours_and_torchs, train_forced_cut, stage)
    for rank, ((ours, _, layout), (torchs, _, _)) in enumerate(runs):
        assert [len(names) for names in layout] == FORCED_CUT, f"rank {rank}: {layout}"
        # Runs of the ready order: backward makes the last layer's gradients first.
        layers = [int(n.split(".")[-2]) for names in layout for n in names]
        assert layers == sorted(layers, reverse=True), f"rank {rank}: {layout}"
        assert_same_steps(ours, torchs, f"rank {rank}", tolerance(2))
