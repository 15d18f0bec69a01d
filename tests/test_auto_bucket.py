"""bucket_cap_mb="auto" against torch's DDP (runs compared as tests.compare describes):
every rank picks the same cap and trains as torch's DDP does; bad options raise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stages import STAGES
from stages.auto_bucket import CANDIDATES_MB
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
