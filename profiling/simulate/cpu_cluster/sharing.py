"""What two shared cores add to the step model: a `Sharing` for the virtual CPU cluster.

On a GPU a collective runs on its own engine and NIC; on the virtual cluster backward,
Gloo's threads and the kernel's TCP share the same two cores, and the stage's own
Python runs there too. The calibration (`calibration`, `contention`) measures each
effect; this is how the model (`profiling.simulate.schedule`) takes them:

- `slowdown`, `comm_slowdown`: how much longer backward takes while a collective is on
  the wire, and a collective on the wire while backward computes (0.3: 30% longer);
- `latency_slowdown`, `comm_latency_slowdown`: the same two while a collective is in
  its latency rather than on the wire. A large all-reduce mostly waits for the link, a
  small one for the cores (each message round wakes a thread), so the two share the
  cores differently; not given, they are `slowdown` and `comm_slowdown`. With one
  collective in each phase, backward slows by the larger;
- `busy_launch_s`: a collective launched while another is in flight or waiting pays
  this much more latency (on two shared cores, small all-reduces launched all at once
  can cost more per call than the same issued one after the other);
- `copy_in_s_per_byte`, `copy_out_s_per_byte`: the stage's own passes over a gradient,
  on the compute lane: into its bucket before the all-reduce, the average back out
  after it. After backward (bucketed), each bucket's copy in, all-reduce and copy out
  follow one another; overlapped, the copy in runs in backward's hook, so each
  gradient is ready that much later, and the copies out run after backward, bucket by
  bucket, each once its all-reduce has ended;
- `own_s_per_grad`: the rest of what the stage's step takes beyond the compute with no
  communication (its hooks' and bookkeeping's Python), per gradient: overlapped, in
  backward's hook, like the copy in; after backward, all of it before the first
  collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from profiling.simulate.schedule import Grad, Sharing, Workload


@dataclass(frozen=True)
class SharedCores(Sharing):
    comm_slowdown: float = 0.0
    latency_slowdown: float | None = None
    comm_latency_slowdown: float | None = None
    busy_launch_s: float = 0.0
    copy_in_s_per_byte: float = 0.0
    copy_out_s_per_byte: float = 0.0
    own_s_per_grad: float = 0.0

    def compute_rate(self, on_wire: bool, in_latency: bool) -> float:
        latency = self.slowdown if self.latency_slowdown is None else self.latency_slowdown
        phases = [self.slowdown] * on_wire + [latency] * in_latency
        return 1.0 / (1.0 + max(phases)) if phases else 1.0

    def comm_rates(self, computing: bool) -> tuple[float, float]:
        if not computing:
            return 1.0, 1.0
        latency = self.comm_slowdown
        if self.comm_latency_slowdown is not None:
            latency = self.comm_latency_slowdown
        return 1.0 / (1.0 + self.comm_slowdown), 1.0 / (1.0 + latency)

    def launch_s(self, busy: bool) -> float:
        return self.busy_launch_s if busy else 0.0

    def hook_s(self, grad: Grad) -> float:
        return grad.nbytes * self.copy_in_s_per_byte + self.own_s_per_grad

    def after_backward_s(self, workload: Workload) -> float:
        return len(workload.grads) * self.own_s_per_grad

    def copy_in_s(self, nbytes: int) -> float:
        return nbytes * self.copy_in_s_per_byte

    def copy_out_s(self, nbytes: int) -> float:
        return nbytes * self.copy_out_s_per_byte
