"""The discrete-event model of one DDP step: when each gradient is ready, when each
collective starts and ends, and so how long the step takes.

It knows nothing of torch. What it is given:

- a `Workload`: each gradient's size in bytes and the time it becomes ready in an
  uncontended backward (seconds after backward starts), in parameter order; forward,
  backward and optimizer times, all measured on one process with no communication;
- a collective cost: bytes -> `Cost(latency_s, wire_s)`, the part of an all-reduce no
  other collective slows (message rounds, reduction) and the part that holds the link;
- the stage's `StageSchedule`:
    - `overlap=False` (naive, bucketed): backward runs alone, then one blocking
      collective per gradient (naive) or per bucket (bucketed), one after the other;
    - `overlap=True` (overlapped, skip_sync, drop_in): a bucket is launched once all
      its gradients are ready and every earlier bucket was launched (buckets go out in
      bucket order on every rank), into a queue served one collective at a time; the
      step waits for the last collective, then runs the optimizer;
    - `lanes` > 1 (round_robin): bucket i goes to lane i mod lanes; lanes run at once,
      and collectives in their wire phase at the same time share the link equally;
    - `accumulation_steps` k (no_sync): k - 1 micro-batches of forward and backward
      with no communication, then one synchronised;
- a `Sharing`: how compute and communication slow each other on the hardware, and
  what the stage does besides its all-reduces. Here only `slowdown`: how much longer
  backward takes while a collective is in flight (0.3: 30% longer; on a GPU its
  kernels share the SMs). The virtual CPU cluster's calibration extends it
  (`profiling.simulate.cpu_cluster.sharing`) with what two shared cores add.

Everything is in seconds. The schedule is exact for the model: tests check it against
schedules worked out by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ddp.bucket_cuts import LinearCost


@dataclass(frozen=True)
class Grad:
    """One parameter's gradient."""

    name: str
    nbytes: int
    ready_s: float  # after backward starts, with nothing else running


@dataclass(frozen=True)
class Workload:
    """One micro-batch's compute, measured on one process."""

    grads: tuple[Grad, ...]  # in parameter order (model.parameters())
    forward_s: float
    backward_s: float  # from backward's start to its last gradient and its end
    optimizer_s: float

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


@dataclass(frozen=True)
class Cost:
    """One all-reduce: `latency_s` that nothing shares, then `wire_s` on the link."""

    latency_s: float
    wire_s: float

    @property
    def seconds(self) -> float:
        return self.latency_s + self.wire_s


CostModel = Callable[[int], Cost]  # bytes -> the cost of one all-reduce of that many


def linear_cost(latency_s: float, s_per_byte: float) -> CostModel:
    """The simplest cost model, the automatic bucket size's (`ddp.bucket_cuts`): a fixed
    latency, then bytes at one rate on the wire."""
    line = LinearCost(latency_s, s_per_byte)
    return lambda nbytes: Cost(line.latency_s, line.wire_s(nbytes))


@dataclass(frozen=True)
class Segment:
    """A bar in the Gantt chart."""

    lane: str  # "compute", "comm" or "comm <k>" with several lanes
    label: str  # forward, backward, optimizer, or the collective's bucket
    start_s: float
    end_s: float


@dataclass
class Step:
    """The simulated step: its segments and what they add up to."""

    segments: list[Segment] = field(default_factory=list)
    step_s: float = 0.0
    compute_s: float = 0.0  # the same step with no communication at all

    @property
    def exposed_comm_s(self) -> float:
        """What synchronising adds over compute alone."""
        return self.step_s - self.compute_s

    def lane(self, lane: str) -> list[Segment]:
        return [s for s in self.segments if s.lane == lane]


@dataclass(frozen=True)
class StageSchedule:
    """How a stage communicates: the features of the stages the model tells apart."""

    overlap: bool  # launch buckets during backward (overlapped and later) or after it
    lanes: int = 1  # round-robin process groups
    accumulation_steps: int = 1  # micro-batches per step, all but the last under no_sync


@dataclass(frozen=True)
class Sharing:
    """What the hardware and the stage add to the bare schedule; each method says how.
    Here: backward `slowdown` times slower while a collective is in flight, nothing
    else. An extension overrides the methods (`profiling.simulate.cpu_cluster.sharing`)."""

    slowdown: float = 0.0  # backward's extra time while a collective is in flight

    def compute_rate(self, on_wire: bool, in_latency: bool) -> float:
        """Backward's speed (1: alone) while collectives are on the wire or in their
        latency (message rounds, reduction)."""
        return 1.0 / (1.0 + self.slowdown) if on_wire or in_latency else 1.0

    def comm_rates(self, computing: bool) -> tuple[float, float]:
        """A collective's speed on the wire and in its latency (1: alone), while
        backward computes or not."""
        return 1.0, 1.0

    def launch_s(self, busy: bool) -> float:
        """The latency a collective adds, launched while another is in flight or queued."""
        return 0.0

    def hook_s(self, grad: Grad) -> float:
        """The stage's own work in a gradient's hook, on the compute lane (overlapped)."""
        return 0.0

    def after_backward_s(self, workload: Workload) -> float:
        """The stage's own work after backward, before its first collective (after
        backward)."""
        return 0.0

    def copy_in_s(self, nbytes: int) -> float:
        """A bucket's pass into its buffer before its all-reduce (after backward)."""
        return 0.0

    def copy_out_s(self, nbytes: int) -> float:
        """A bucket's pass of its average back out, once its all-reduce has ended."""
        return 0.0


NO_SHARING = Sharing()  # a GPU whose collectives run on their own engine and NIC


# --8<-- [start:simulate]
def simulate(
    workload: Workload,
    buckets: Sequence[Sequence[int]],
    cost: CostModel,
    schedule: StageSchedule,
    sharing: Sharing = NO_SHARING,
) -> Step:
    """One step of a stage whose buckets (lists of indices into workload.grads, in the
    order they are all-reduced) are `buckets`. Naive is one bucket per gradient, in
    parameter order, with `overlap=False`."""
    step = Step(compute_s=schedule.accumulation_steps * (workload.forward_s + workload.backward_s)
                + workload.optimizer_s)  # fmt: skip
    t = 0.0
    for k in range(schedule.accumulation_steps - 1):  # under no_sync: compute only
        t = _compute(step, t, "forward", workload.forward_s)
        t = _compute(step, t, "backward", workload.backward_s, note=f" (no_sync {k + 1})")
    t = _compute(step, t, "forward", workload.forward_s)
    if schedule.overlap:
        in_hooks = _in_hooks(workload, sharing)
        t = _overlapped_backward(step, t, in_hooks, buckets, cost, schedule.lanes, sharing)
    else:
        t = _compute(step, t, "backward", workload.backward_s)
        if own_s := sharing.after_backward_s(workload):
            t = _compute(step, t, "stage", own_s)
        for index, members in enumerate(buckets):  # blocking, one after the other
            nbytes = sum(workload.grads[i].nbytes for i in members)
            if copy_s := sharing.copy_in_s(nbytes):
                t = _compute(step, t, "copy in", copy_s)
            c = cost(nbytes)
            step.segments.append(
                Segment("comm", _label(workload, members, index), t, t + c.seconds)
            )
            t += c.seconds
            if copy_s := sharing.copy_out_s(nbytes):
                t = _compute(step, t, "copy out", copy_s)
    t = _compute(step, t, "optimizer", workload.optimizer_s)
    step.step_s = t
    return step


# --8<-- [end:simulate]


def _compute(step: Step, t: float, label: str, seconds: float, note: str = "") -> float:
    step.segments.append(Segment("compute", label + note, t, t + seconds))
    return t + seconds


def _in_hooks(workload: Workload, sharing: Sharing) -> Workload:
    """The workload as an overlapped stage's backward sees it when its hooks work
    (`Sharing.hook_s`): every gradient later by the hooks of all ready by then, its own
    included, and backward longer by all of them."""
    hooks_s = [sharing.hook_s(g) for g in workload.grads]
    if not any(hooks_s):
        return workload
    order = sorted(range(len(workload.grads)), key=lambda i: workload.grads[i].ready_s)
    later, copied = {}, 0.0
    for i in order:
        copied += hooks_s[i]
        later[i] = copied
    grads = tuple(
        Grad(g.name, g.nbytes, g.ready_s + later[i]) for i, g in enumerate(workload.grads)
    )
    return Workload(grads, workload.forward_s, workload.backward_s + copied, workload.optimizer_s)


def _label(workload: Workload, members: Sequence[int], index: int) -> str:
    if len(members) == 1:
        return workload.grads[members[0]].name
    return f"bucket {index}"


@dataclass
class _InFlight:
    index: int
    lane: int
    start_s: float
    latency_left_s: float
    wire_left_s: float  # at the full link; slower while it shares the link


# --8<-- [start:overlap]
def _overlapped_backward(
    step: Step,
    start_s: float,
    workload: Workload,
    buckets: Sequence[Sequence[int]],
    cost: CostModel,
    lanes: int,
    sharing: Sharing,
) -> float:
    """Backward with buckets launched as they fill; returns when the last collective
    ends (or backward, if later). An event loop: at each turn, find the next thing to
    happen (a gradient ready, backward's end, a collective's latency or wire done),
    move every clock to it, and act on it."""
    grads = workload.grads
    bucket_of = {i: b for b, members in enumerate(buckets) for i in members}
    pending = [len(members) for members in buckets]  # gradients still to come, per bucket
    by_ready = sorted(range(len(grads)), key=lambda i: grads[i].ready_s)
    next_ready = 0  # into by_ready
    next_launch = 0  # buckets go out in bucket order
    queues: list[list[int]] = [[] for _ in range(lanes)]  # launched, waiting for the lane
    flying: list[_InFlight] = []
    busy_launched: set[int] = set()  # buckets launched while another was in flight
    t, done_s = start_s, 0.0  # wall clock; backward's compute done, in uncontended seconds
    backward_end = None
    ends: dict[int, float] = {}  # bucket -> when its all-reduce ended
    while True:
        # Launch every bucket that is full and next in order; start idle lanes.
        while next_launch < len(buckets) and pending[next_launch] == 0:
            if flying or any(queues):
                busy_launched.add(next_launch)
            queues[next_launch % lanes].append(next_launch)
            next_launch += 1
        for lane, queue in enumerate(queues):
            if queue and not any(f.lane == lane for f in flying):
                index = queue.pop(0)
                c = cost(sum(grads[i].nbytes for i in buckets[index]))
                latency_s = c.latency_s + sharing.launch_s(index in busy_launched)
                flying.append(_InFlight(index, lane, t, latency_s, c.wire_s))
        if backward_end is not None and not flying and next_launch == len(buckets):
            return _copies_out(step, backward_end, ends, workload, buckets, sharing)
        # Rates: backward as the sharing says while anything is in flight, communication
        # while backward runs; wires share the link.
        on_wire = [f for f in flying if f.latency_left_s <= 0]
        compute_rate = sharing.compute_rate(bool(on_wire), len(on_wire) < len(flying))
        comm_rate, latency_rate = sharing.comm_rates(backward_end is None)
        wire_rate = comm_rate / len(on_wire) if on_wire else comm_rate
        candidates = []
        if backward_end is None:
            target = grads[by_ready[next_ready]].ready_s if next_ready < len(grads) else None
            target = workload.backward_s if target is None else target
            candidates.append((target - done_s) / compute_rate)
        for f in flying:
            left = (
                f.latency_left_s / latency_rate
                if f.latency_left_s > 0
                else f.wire_left_s / wire_rate
            )
            candidates.append(left)
        dt = max(0.0, min(candidates))
        # Move every clock by dt.
        t += dt
        if backward_end is None:
            done_s += dt * compute_rate
        for f in flying:
            if f.latency_left_s > 0:
                f.latency_left_s -= dt * latency_rate
            else:
                f.wire_left_s -= dt * wire_rate
        # Act: gradients that are now ready, backward's end, collectives that ended.
        while next_ready < len(grads) and grads[by_ready[next_ready]].ready_s <= done_s + 1e-15:
            i = by_ready[next_ready]
            if i in bucket_of:  # frozen parameters have no bucket
                pending[bucket_of[i]] -= 1
            next_ready += 1
        if (
            backward_end is None
            and next_ready == len(grads)
            and done_s >= workload.backward_s - 1e-15
        ):
            backward_end = t
            step.segments.append(Segment("compute", "backward", start_s, t))
        for f in [f for f in flying if f.latency_left_s <= 1e-15 and f.wire_left_s <= 1e-15]:
            flying.remove(f)
            ends[f.index] = t
            lane = "comm" if lanes == 1 else f"comm {f.lane}"
            label = _label(workload, buckets[f.index], f.index)
            step.segments.append(Segment(lane, label, f.start_s, t))


# --8<-- [end:overlap]


def _copies_out(
    step: Step,
    backward_end: float,
    ends: dict[int, float],
    workload: Workload,
    buckets: Sequence[Sequence[int]],
    sharing: Sharing,
) -> float:
    """After backward, bucket by bucket in launch order: wait for its all-reduce, then
    copy its average out. Returns when the last copy is done (with no copies: when the
    last all-reduce or backward ended)."""
    t = backward_end
    for index, members in enumerate(buckets):
        t = max(t, ends.get(index, t))
        if seconds := sharing.copy_out_s(sum(workload.grads[i].nbytes for i in members)):
            t = _compute(step, t, "copy out", seconds)
    return t
