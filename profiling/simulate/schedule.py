"""The discrete-event model of one DDP step: when each gradient is ready, when each
collective starts and ends, and so how long the step takes.

It knows nothing of torch. What it is given:

- a `Workload`: each gradient's size in bytes and the time it becomes ready in an
  uncontended backward (seconds after backward starts), in parameter order; forward,
  backward and optimizer times, all measured on one process with no communication;
- a collective cost: bytes -> `Cost(latency_s, wire_s)`, the part of an all-reduce no
  other collective slows (message rounds, reduction) and the part that holds the link;
- `slowdown`: how much longer backward's compute takes while communication runs on the
  same cores (0.3: 30% longer). On a laptop's two cores it is large; on a GPU, whose
  communication runs on its own engine and NIC, it is small;
- `comm_slowdown`: the other way round, how much longer communication takes while
  backward computes on the same cores. Over a virtual network the kernel's TCP and
  Gloo's threads move every byte on the CPU, so the link is only as fast as the cores
  left to it.
- `latency_slowdown`, `comm_latency_slowdown`: the same two while a collective is in
  its latency rather than on the wire. A large all-reduce mostly waits for the link, a
  small one for the cores (each message round wakes a thread), so the two share the
  cores differently; not given, they are `slowdown` and `comm_slowdown`.

What a stage does with them (`StageSchedule`):

- `after_backward` (naive, bucketed): backward runs alone, then one blocking collective
  per gradient (naive) or per bucket (bucketed), one after the other;
- overlapped (overlapped, skip_sync, drop_in): a bucket is launched once all its
  gradients are ready and every earlier bucket was launched (buckets go out in bucket
  order on every rank), into a queue served one collective at a time; backward goes on
  at 1 / (1 + slowdown) of its speed while a collective is on the wire (1 / (1 +
  latency_slowdown) while one is in its latency), and a collective at 1 / (1 +
  comm_slowdown) of its speed on the wire (1 / (1 + comm_latency_slowdown) in its
  latency) while backward runs. The step waits for the last collective, then runs the
  optimizer;
- `busy_launch_s`: a collective launched while another is in flight or waiting pays
  this much more latency (measured: on two shared cores, small all-reduces launched all
  at once can cost more per call than the same issued one after the other);
- `lanes` > 1 (round_robin): bucket i goes to lane i mod lanes; lanes run at once,
  and collectives in their wire phase at the same time share the link equally;
- `accumulation_steps` k (no_sync): k - 1 micro-batches of forward and backward with
  no communication, then one synchronised;
- `copy_in_s_per_byte`, `copy_out_s_per_byte`: the stage's own passes over a gradient,
  on the compute lane: into its bucket (divided by the world size) before the
  all-reduce, and the average back out after it. After backward (bucketed), each
  bucket's copy in, all-reduce and copy out follow one another; overlapped, the copy in
  runs in backward's hook, so each gradient is ready that much later, and the copies
  out run after backward, bucket by bucket, each once its all-reduce has ended;
- `own_s_per_grad`: the rest of what the stage's step takes beyond the compute with no
  communication at all (its hooks' and bookkeeping's Python), per gradient, on the
  compute lane: overlapped, in backward's hook, like the copy in; after backward, all
  of it at once, before the first collective.

Everything is in seconds. The schedule is exact for the model: tests check it against
schedules worked out by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


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
    """The simplest cost model: a fixed latency, then bytes at one rate."""
    return lambda nbytes: Cost(latency_s, nbytes * s_per_byte)


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
    # Extra latency of a collective launched while another is in flight or waiting: on
    # two shared cores, Gloo's second worker thread takes it up at once, and a burst of
    # small all-reduces can cost more per call than the same one after the other.
    busy_launch_s: float = 0.0
    # Passes over the gradients the stage makes itself, seconds per byte (0: none).
    copy_in_s_per_byte: float = 0.0
    copy_out_s_per_byte: float = 0.0
    # The stage's own time beyond the compute and its copies, seconds per gradient.
    own_s_per_grad: float = 0.0


# --8<-- [start:simulate]
def simulate(
    workload: Workload,
    buckets: Sequence[Sequence[int]],
    cost: CostModel,
    schedule: StageSchedule,
    slowdown: float = 0.0,
    comm_slowdown: float = 0.0,
    latency_slowdown: float | None = None,
    comm_latency_slowdown: float | None = None,
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
    copy_in, copy_out = schedule.copy_in_s_per_byte, schedule.copy_out_s_per_byte
    if schedule.overlap:
        t = _overlapped_backward(
            step, t, _in_hooks(workload, copy_in, schedule.own_s_per_grad), buckets, cost,
            schedule,
            slowdown, comm_slowdown,
            slowdown if latency_slowdown is None else latency_slowdown,
            comm_slowdown if comm_latency_slowdown is None else comm_latency_slowdown,
        )  # fmt: skip
    else:
        t = _compute(step, t, "backward", workload.backward_s)
        if schedule.own_s_per_grad:
            t = _compute(step, t, "stage", len(workload.grads) * schedule.own_s_per_grad)
        for index, members in enumerate(buckets):  # blocking, one after the other
            nbytes = sum(workload.grads[i].nbytes for i in members)
            if copy_in:
                t = _compute(step, t, "copy in", nbytes * copy_in)
            c = cost(nbytes)
            step.segments.append(
                Segment("comm", _label(workload, members, index), t, t + c.seconds)
            )
            t += c.seconds
            if copy_out:
                t = _compute(step, t, "copy out", nbytes * copy_out)
    t = _compute(step, t, "optimizer", workload.optimizer_s)
    step.step_s = t
    return step


# --8<-- [end:simulate]


def _compute(step: Step, t: float, label: str, seconds: float, note: str = "") -> float:
    step.segments.append(Segment("compute", label + note, t, t + seconds))
    return t + seconds


def _in_hooks(workload: Workload, s_per_byte: float, s_per_grad: float = 0.0) -> Workload:
    """The workload as an overlapped stage's backward sees it when its hook copies each
    gradient into its bucket (`s_per_byte`) and does its own work (`s_per_grad`): every
    gradient later by the hooks of all ready by then, its own included, and backward
    longer by all of them."""
    if not s_per_byte and not s_per_grad:
        return workload
    order = sorted(range(len(workload.grads)), key=lambda i: workload.grads[i].ready_s)
    later, copied = {}, 0.0
    for i in order:
        copied += workload.grads[i].nbytes * s_per_byte + s_per_grad
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
    schedule: StageSchedule,
    slowdown: float,
    comm_slowdown: float,
    latency_slowdown: float,
    comm_latency_slowdown: float,
) -> float:
    """Backward with buckets launched as they fill; returns when the last collective
    ends (or backward, if later). An event loop: at each turn, find the next thing to
    happen (a gradient ready, backward's end, a collective's latency or wire done),
    move every clock to it, and act on it."""
    grads, lanes = workload.grads, schedule.lanes
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
                latency_s = c.latency_s + (schedule.busy_launch_s if index in busy_launched else 0)
                flying.append(_InFlight(index, lane, t, latency_s, c.wire_s))
        if backward_end is not None and not flying and next_launch == len(buckets):
            return _copies_out(step, backward_end, ends, workload, buckets, schedule)
        # Rates: backward slows while anything is in flight, and communication while
        # backward runs, each by the slowdown of the phase the collective is in (with
        # two lanes, the larger); wires share the link.
        on_wire = [f for f in flying if f.latency_left_s <= 0]
        phases = [slowdown] * bool(on_wire) + [latency_slowdown] * (len(on_wire) < len(flying))
        compute_rate = 1.0 / (1.0 + max(phases)) if phases else 1.0
        backward_on = backward_end is None
        comm_rate = 1.0 / (1.0 + comm_slowdown) if backward_on else 1.0
        latency_rate = 1.0 / (1.0 + comm_latency_slowdown) if backward_on else 1.0
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
    schedule: StageSchedule,
) -> float:
    """After backward, bucket by bucket in launch order: wait for its all-reduce, then
    copy its average out. Returns when the last copy is done (with no copies: when the
    last all-reduce or backward ended)."""
    t = backward_end
    for index, members in enumerate(buckets):
        t = max(t, ends.get(index, t))
        seconds = sum(workload.grads[i].nbytes for i in members) * schedule.copy_out_s_per_byte
        if seconds:
            t = _compute(step, t, "copy out", seconds)
    return t


def achievable_bound(
    workload: Workload, buckets: Sequence[Sequence[int]], cost: CostModel
) -> float:
    """The fastest this layout can step: the overlapped schedule with no contention.
    Tighter than max(compute, forward + comm + optimizer), which lets communication
    start before any gradient exists."""
    return simulate(workload, buckets, cost, StageSchedule(overlap=True)).step_s


def perfect_overlap_bound(
    workload: Workload, buckets: Sequence[Sequence[int]], cost: CostModel
) -> float:
    """The bound the benchmark tables print: max(compute, forward + comm + optimizer)."""
    comm = sum(cost(sum(workload.grads[i].nbytes for i in m)).seconds for m in buckets)
    return max(workload.compute_s, workload.forward_s + comm + workload.optimizer_s)
