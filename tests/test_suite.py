"""The one suite: every stage and torch's own DDP, checked on real Gloo groups against
single-process training, with hypothesis drawing cases. The four properties it checks
on each case are `tests.suite.check_case`'s: replicas start identical; parameters are
bit-identical on all ranks after every step; gradients and parameters equal one
process's on the whole batch; the collectives are the ones the stage declares."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddp.train import keyword_options
from stages import STAGES
from tests.adapters import WRAPPERS
from tests.cases import (
    TORCH_OPTIONS,
    Case,
)
from tests.nets import NetSpec
from tests.pool import MAX_WORLD
from tests.suite import check_case

# Per stage per run: 100 in `make test` (about 11 s a stage on 2 cores); `make suite`
# draws 1000.
EXAMPLES = int(os.environ.get("DDP_STAGES_EXAMPLES", "100"))


@st.composite
def nets(draw) -> NetSpec:
    hidden = draw(st.integers(0, 3))
    return NetSpec(
        d_in=draw(st.integers(1, 6)),
        width=draw(st.integers(1, 8)),
        d_out=draw(st.integers(1, 4)),
        order=tuple(draw(st.permutations(range(hidden)))),
        dtypes=tuple(
            draw(
                st.lists(st.sampled_from(["float32", "float64"]), min_size=hidden, max_size=hidden)
            )
        ),
        frozen=tuple(draw(st.lists(st.booleans(), min_size=hidden, max_size=hidden))),
        tied=hidden > 0 and draw(st.booleans()),
        transposed=draw(st.booleans()),
    )


CAPS = st.one_of(st.just(1e-9), st.floats(1e-6, 1e-3), st.just(25.0))
DRAWN = {  # the keyword options a stage may take, each drawn where the stage takes it
    "find_unused_parameters": st.booleans(),
    "broadcast_buffers": st.booleans(),
    "gradient_as_bucket_view": st.booleans(),
    "first_bucket_cap_mb": st.one_of(st.none(), CAPS),
    "round_robin_groups": st.integers(1, 3),
    "static_graph": st.booleans(),
}


@st.composite
def options(draw, wrapper: str) -> tuple[tuple[str, object], ...]:
    """The keyword options the stage (or torch's DDP) takes, drawn."""
    takes = TORCH_OPTIONS if wrapper == "torch_ddp" else keyword_options(STAGES[wrapper])
    drawn = {name: draw(strategy) for name, strategy in DRAWN.items() if name in takes}
    if wrapper != "torch_ddp" and hasattr(STAGES[wrapper], "register_comm_hook"):
        drawn["comm_hook"] = draw(st.sampled_from([None, "allreduce", "torch_allreduce"]))
    return tuple(drawn.items())


def cases(wrapper: str) -> st.SearchStrategy[Case]:
    return st.builds(
        Case,
        wrapper=st.just(wrapper),
        net=nets(),
        world_size=st.integers(1, MAX_WORLD),
        per_rank_batch=st.integers(1, 4),
        steps=st.integers(1, 3),
        accumulation=st.integers(1, 3),
        optimizer=st.sampled_from(["sgd", "adam"]),
        # MiB; these parameters hold 4 B to 256 B, so 1e-9 puts one parameter in each
        # bucket and 25 puts all in one.
        bucket_cap_mb=CAPS,
        seed=st.integers(0, 2**16),
        options=options(wrapper),
        set_to_none=st.booleans(),
    )


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_equivalent_to_single_process(pool, wrapper: str) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(case=cases(wrapper))
    def check(case: Case) -> None:
        check_case(pool, case)

    check()
