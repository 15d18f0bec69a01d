"""Stage 11, round_robin: buckets take turns over several process groups.

One process group runs its collectives one after another. The paper (section 3.3)
notes that DDP can spread buckets over several groups in round-robin order, so that
several all-reduces are in flight at once, each on its own connections and threads:
this can use more of a fast network than one stream of collectives does.
`round_robin_groups=k` makes k - 1 more groups over the same ranks (or takes a list of
ready-made ones); bucket i goes over group i mod k. Every rank still issues bucket i
on the same group as every other rank, so collectives match.

    torchrun --standalone --nproc-per-node 2 -m stages.round_robin --model mlp

Whether it helps depends on where the time goes: on two shared CPU cores, more Gloo
threads compete with backward for the same cores (see the benchmarks page). Making a
group is collective over the default group, so every process must build the wrapper
(or pass groups it made); groups are kept for reuse by later wrappers over the same
ranks, until `ddp.dist.teardown_process_group`. A registered comm hook picks its own
group and is not spread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from ddp.dist import shared_groups
from stages.comm_hooks import CommHooksDDP


# --8<-- [start:construction]
class RoundRobinDDP(CommHooksDDP):
    """Stage 11: bucket i is all-reduced over process group i mod `round_robin_groups`."""

    def __init__(
        self,
        module: nn.Module,
        *,
        round_robin_groups: int | Sequence[dist.ProcessGroup] = 1,
        **options,
    ):
        super().__init__(module, **options)
        self.round_robin_groups = _round_robin(self.process_group, round_robin_groups)

    # --8<-- [end:construction]

    # --8<-- [start:backward]
    def _group_for(self, index: int) -> dist.ProcessGroup:
        # Asked once per bucket layout, not at every launch.
        return self.round_robin_groups[index % len(self.round_robin_groups)]

    # --8<-- [end:backward]


def _round_robin(
    group: dist.ProcessGroup, groups: int | Sequence[dist.ProcessGroup]
) -> list[dist.ProcessGroup]:
    """`group` and the others to take turns with: given, or k - 1 new ones."""
    ranks = dist.get_process_group_ranks(group)
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"round_robin_groups must be >= 1, got {groups}")
        # new_group is collective over the default group: every process calls it.
        extra = shared_groups(
            ("round_robin", tuple(ranks), groups),
            lambda: [dist.new_group(ranks) for _ in range(groups - 1)],
        )
        return [group, *extra]
    for other in groups:
        if dist.get_process_group_ranks(other) != ranks:
            raise ValueError(
                f"round_robin_groups must span the same ranks as process_group {ranks}, "
                f"got one over {dist.get_process_group_ranks(other)}"
            )
    return [group, *groups]


if __name__ == "__main__":
    from ddp.train import main

    main(RoundRobinDDP)
