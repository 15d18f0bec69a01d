"""Stage 12, join: a rank that runs out of batches does not hang the others.

Each synchronised backward is a set of collectives every rank must join. If one rank
has fewer batches (an uneven last shard, a filtered dataset), it leaves the loop while
the others wait for it in an all-reduce for ever. torch solves this with its generic
`torch.distributed.algorithms.Join` context manager, and this stage plugs into that
same manager: it is a `Joinable`. While training, every forward tells the manager this
rank is still in (one small all-reduce). A rank that has left the loop then *shadows*
the others: for every step they still take, it joins the same collectives (the buffer
broadcast, one all-reduce of zeros per bucket, the status), contributing nothing.
When every rank is done, the model is broadcast from the last rank to finish, so the
replicas agree again.

    with model.join():  # or torch.distributed.algorithms.Join([model])
        for x, y in my_uneven_batches:
            loss_fn(model(x), y).backward()
            optimizer.step()

    torchrun --standalone --nproc-per-node 2 -m stages.join --model mlp

Gradients are divided by the initial world size (`divide_by_initial_world_size=True`,
as in torch), so a step in which a rank has joined averages over fewer samples but
keeps the same scale; `False` divides by the ranks still in. Cost: two small
all-reduces per forward inside the context manager (three when buffers are
broadcast: the ranks agree on a source that has not left), none outside it.

The shadow step keeps two counters of earlier stages as a real step would: stage
overlapped's `_synced_backwards` (a shadowed backward counts, so the ranks rebuild
together) and stage buffers' `require_forward_param_sync` (whether the next forward
broadcasts buffers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddp.dist import broadcast_module_states
from stages.round_robin import RoundRobinDDP


# --8<-- [start:construction]
class JoinDDP(RoundRobinDDP, Joinable):
    """Stage 12: a `Joinable`: ranks with fewer inputs shadow the others' collectives."""

    def __init__(self, module: nn.Module, **options):
        super().__init__(module, **options)
        Joinable.__init__(self)  # the manager's switch, off outside `with Join(...)`
        self._divide_by_initial_world_size = True
        self._ranks_in = self.world_size  # ranks still in the loop, at this forward

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """torch DDP's `join()`: a Join context manager over this model alone."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs) -> JoinHook:
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return _ShadowCollectives(self)

    @property
    def join_device(self) -> torch.device:
        return self._collective_device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        joining = self._join_config.enable
        still_in = Join.notify_join_context(self)  # all-reduce of 1 per rank still in
        self._ranks_in = self.world_size
        if joining and not self._divide_by_initial_world_size:
            still_in.wait()
            self._ranks_in = int(still_in.result()[0].item())
        if joining:  # tells the ranks that have left whether this backward synchronises
            syncs = torch.is_grad_enabled() and self.require_backward_grad_sync
            flag = torch.tensor([float(syncs)], device=self._collective_device)
            dist.all_reduce(flag, group=self.process_group)
        return super().forward(*inputs, **kwargs)

    def _grad_divisor(self) -> int:
        if self._comm_hook is not None:  # the hook divides by itself
            return super()._grad_divisor()
        return self._ranks_in  # the world size, unless asked to divide by the ranks still in

    def _broadcast_buffers(self, src: int = 0) -> None:
        if self._join_config.enable:  # rank 0 may have left with stale buffers
            src = self._common_rank(candidate=True)
        super()._broadcast_buffers(src)

    def _common_rank(self, candidate: bool) -> int:
        """The highest group rank among the candidates, agreed by all ranks."""
        rank = torch.tensor([self.rank if candidate else -1], device=self._collective_device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(rank.item())

    # --8<-- [end:forward]

    # --8<-- [start:shadow]
    def _shadow_step(self) -> None:
        """One step of the others, from a rank that has left: the same collectives, in
        the same order, through the same methods that issue them in a real step."""
        syncs = torch.zeros(1, device=self._collective_device)
        dist.all_reduce(syncs, group=self.process_group)  # matches forward's flag
        syncs = bool(syncs.item())
        if syncs:
            self._before_synced_forward()  # rebuilds, and whatever later stages add there
        if self._buffers_due():
            super()._broadcast_buffers(self._common_rank(candidate=False))
        self.require_forward_param_sync = syncs
        if syncs:
            self._shadow_backward()

    def _shadow_backward(self) -> None:
        """The backward the others run: every bucket, in order, with zeros from us; then
        the status of a rank that misses nothing and used nothing (and, if the others'
        says something went wrong, the row of such a rank)."""
        # As a rank whose forward reached nothing (so it used nothing: with
        # find_unused_parameters, every parameter is unreached) and whose every other
        # gradient came as expected: the state a forward makes, with those noted.
        self._prepare_for_backward()
        backward = self._backward
        self._note_unused(())
        unreached = set(backward.unreached)
        everything = [k for k in self._shadow_arrivals() if k not in unreached]
        backward.arrived.extend(everything)
        for bucket in self.buckets:  # the last, with the status
            bucket.buffer.zero_()
            backward.in_flight.append((bucket, getattr(self, backward.send)(bucket)))
        status = self._status  # the end of backward's protocol (stage missing_grads)
        if not status.rides:
            status.send(self, everything)
        for _, work in backward.in_flight:
            work.wait()
        status.settle(self)  # if the others raise, so does this rank, rather than wait on
        self._synced_backwards += 1

    def _shadow_arrivals(self) -> list[int]:
        """The gradients a rank that left reports as come: every one, once."""
        return list(range(len(self.named_trainable)))


class _ShadowCollectives(JoinHook):
    """What the Join manager runs on a rank that has left the loop."""

    def __init__(self, ddp: JoinDDP):
        self.ddp = ddp

    def main_hook(self) -> None:
        self.ddp._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to finish (the highest, on a tie)."""
        ddp = self.ddp
        src = ddp._common_rank(candidate=is_last_joiner)
        broadcast_module_states(ddp.module, ddp.process_group, src, buffers=ddp.broadcast_buffers)


# --8<-- [end:shadow]


if __name__ == "__main__":
    from ddp.train import main

    main(JoinDDP)
