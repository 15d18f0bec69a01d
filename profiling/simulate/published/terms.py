"""Two terms the bare step model leaves out, each measured on a real GPU trace.

    python -m profiling.simulate published --terms-from TRACE   # measure, then predict

- **DDP's own passes over the gradients.** torch's DDP (with `gradient_as_bucket_view=
  False`, the default) moves every gradient through its bucket on the compute stream,
  which a GPU with nothing to send pays too. The trace's reducer (torch 2.x) makes two
  passes: `reducer::mul_out` writes gradient / world size into the bucket at the hook
  (an elementwise kernel), and `copy_bucket_to_grad` copies the average back after the
  bucket's all-reduce (a `Memcpy DtoD`). Each kind is measured as the GPU work those CPU
  ops launched, fitted as a fixed time per launch plus the gradient's bytes at a share
  of the GPU's memory bandwidth (`reducer_work`). torch 1.4's reducer, which the
  benchmark ran, made three: `copy_` into the bucket at the hook, `div_` of the whole
  bucket once it is full, and the copy back once the bucket's all-reduce has ended,
  bucket by bucket after backward (`torch/csrc/distributed/c10d/reducer.cpp` of that
  release).
- **Compute beside NCCL.** NCCL's kernels take streaming multiprocessors and memory
  bandwidth from backward's. Measured as the time-weighted ratio of a compute kernel's
  duration while an NCCL kernel runs to its duration alone, over kernels of the same
  name, grid and block that ran both ways (`beside_nccl`).

`GpuSharing` puts both into the model: the passes at each hook on the compute lane,
each bucket's copy back once its all-reduce has ended, and backward `slowdown` =
ratio - 1 slower while a collective is in flight. Either can be switched off.

The trace the docs use is a real one recorded by others: torch's DDP training
ResNet-50 on two A100s with NCCL 2.17.1 (rank 0, 3 steps; HolisticTraceAnalysis's test
data, `tests/fixtures/gpu-traces/a100-ddp-resnet50`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from profiling.analysis.formats import complete_events, is_collective, span
from profiling.analysis.intervals import intersect, length, merge
from profiling.analysis.runs import load_trace
from profiling.simulate.schedule import Grad, Sharing, Workload

A100_MEMORY_BYTES_PER_S = 1555e9  # A100 40GB SXM data sheet
DOCS_TRACE = "tests/fixtures/gpu-traces/a100-ddp-resnet50/a100-ddp-resnet50-rank0.json.gz"
# The CPU ops of torch 2.x's reducer whose GPU work is a pass over one gradient.
SCALE_OP = "torch::distributed::reducer::mul_out"
COPY_OP = "torch.distributed.ddp.reducer::copy_bucket_to_grad"
# PyTorch's vectorized elementwise kernels (aten/src/ATen/native/cuda/Loops.cuh): 128
# threads a block, 4 elements a thread; float32 gradients.
ELEMENTS_PER_THREAD, FLOAT32_BYTES = 4, 4


@dataclass(frozen=True)
class Pass:
    """One kind of DDP's pass over a gradient on the GPU, per traced step."""

    launches_per_step: float
    bytes_per_step: float  # the gradients' bytes (each pass reads and writes them)
    fixed_s: float  # each launch's fixed time
    share_of_memory_bandwidth: float  # gradient bytes per second over the GPU's peak

    def seconds(self, nbytes: float, memory_bytes_per_s: float) -> float:
        """One launch over `nbytes` on a GPU of `memory_bytes_per_s`."""
        return self.fixed_s + nbytes / (self.share_of_memory_bandwidth * memory_bytes_per_s)


@dataclass(frozen=True)
class ReducerWork:
    """torch's reducer's two kinds of pass over a gradient, as a trace measured them."""

    scale: Pass  # gradient / world size into the bucket (an elementwise kernel)
    copy: Pass  # a gradient's bytes between its tensor and the bucket (a Memcpy DtoD)


@dataclass(frozen=True)
class BesideNccl:
    ratio: float  # a compute kernel's time beside NCCL over its time alone
    kernel_s: float  # compute kernel time beside NCCL that the ratio weighs
    shapes: int  # (name, grid, block) kernels that ran both ways


def load(path: str | Path) -> list[dict]:
    return complete_events(load_trace(Path(path)))


def launched_by(events: list[dict], op: str) -> list[dict]:
    """The GPU events (kernels, copies) that the CPU op `op` launched: the runtime calls
    inside each of its calls on its thread, joined to the GPU by their correlation id."""
    on_gpu = {e["args"]["correlation"]: e for e in events
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
              and "correlation" in e.get("args", {})}  # fmt: skip
    runtime: dict[object, list[dict]] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime":
            runtime.setdefault(e.get("tid"), []).append(e)
    out = []
    for call in (e for e in events if e.get("name") == op):
        end = call["ts"] + call["dur"]
        for r in runtime.get(call.get("tid"), []):
            if call["ts"] <= r["ts"] <= end and (g := on_gpu.get(r["args"].get("correlation"))):
                out.append(g)
    return out


def gradient_bytes(gpu_event: dict) -> float:
    """The bytes a pass moved: a copy's own count, or an elementwise kernel's elements
    (grid x block x 4, rounded up to a whole block) in float32."""
    args = gpu_event["args"]
    if "bytes" in args:
        return float(args["bytes"])
    threads = math.prod(args["grid"]) * math.prod(args["block"])
    return float(threads * ELEMENTS_PER_THREAD * FLOAT32_BYTES)


def fit_pass(gpu_events: list[dict], steps: int, memory_bytes_per_s: float) -> Pass:
    """The least-squares line of duration against bytes: the fixed time is its
    intercept, the bandwidth its slope."""
    if len(gpu_events) < 2:
        raise ValueError(f"no DDP pass to measure: {len(gpu_events)} launches in {steps} steps")
    xs = [gradient_bytes(e) for e in gpu_events]
    ys = [float(e["dur"]) * 1e-6 for e in gpu_events]
    slope, intercept = statistics.linear_regression(xs, ys)
    if not slope > 0:
        raise ValueError(f"the {len(xs)} launches take no longer for more bytes "
                         f"(slope {slope:.3g} s/byte): no bandwidth to fit")  # fmt: skip
    return Pass(len(xs) / steps, sum(xs) / steps, max(intercept, 0.0),
                1 / slope / memory_bytes_per_s)  # fmt: skip


def reducer_work(events: list[dict], memory_bytes_per_s: float) -> ReducerWork:
    """torch's reducer's two passes in a trace of torch's DDP (torch 2.x, the default
    `gradient_as_bucket_view=False`), each fitted on its own launches."""
    steps = sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#"))
    if not steps:
        raise ValueError("no ProfilerStep# in the trace: cannot count per step")
    return ReducerWork(
        scale=fit_pass(launched_by(events, SCALE_OP), steps, memory_bytes_per_s),
        copy=fit_pass(launched_by(events, COPY_OP), steps, memory_bytes_per_s),
    )


def beside_nccl(events: list[dict]) -> BesideNccl:
    """Compute kernels wholly inside NCCL kernels' time (90% or more of them) against the
    same kernels (name, grid, block) wholly outside it: the ratio of their total time
    beside NCCL to what the same launches take alone (each shape's median alone)."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    nccl = merge(span(e) for e in kernels if is_collective(e))
    alone: dict[tuple, list[float]] = {}
    beside: dict[tuple, list[float]] = {}
    for e in kernels:
        if is_collective(e) or not e["dur"] > 0:
            continue
        args = e.get("args", {})
        key = (e["name"], str(args.get("grid")), str(args.get("block")))
        inside = length(intersect([span(e)], nccl)) / e["dur"]
        if inside >= 0.9:
            beside.setdefault(key, []).append(e["dur"])
        elif inside == 0:
            alone.setdefault(key, []).append(e["dur"])
    both = [k for k in beside if k in alone]
    if not both:
        raise ValueError("no compute kernel ran both beside NCCL and alone")
    measured = sum(sum(beside[k]) for k in both)
    if_alone = sum(len(beside[k]) * statistics.median(alone[k]) for k in both)
    return BesideNccl(measured / if_alone, measured * 1e-6, len(both))


@dataclass(frozen=True)
class GpuSharing(Sharing):
    """The bare model's sharing (`slowdown`) plus DDP's passes over each gradient on a
    GPU of `memory_bytes_per_s`: at its hook (`hook_s`; all of them after backward when
    nothing overlaps, `after_backward_s`), and each bucket's copy back once its
    all-reduce has ended (`copy_out_s`: torch's reducer waits for each bucket in turn
    and copies it back). Make it for a layout with `for_buckets`."""

    work: ReducerWork | None = None
    memory_bytes_per_s: float = 0.0
    # torch 1.4's reducer: copy_ into the bucket at the hook, then div_ of the bucket;
    # False: torch 2.x's one mul_out that does both.
    copy_then_divide: bool = True
    # Set by `for_buckets`: the gradients whose hook fills their bucket (torch 1.4's
    # div_ of the whole bucket is launched there, once a bucket), and each bucket's
    # copy back as (its bytes, seconds).
    bucket_last: frozenset[str] | None = None
    copies_out: tuple[tuple[int, float], ...] = ()

    def hook_s(self, grad: Grad) -> float:
        """DDP's passes at the gradient's hook, on the compute stream."""
        if self.work is None:
            return 0.0
        if not self.copy_then_divide:
            return self.work.scale.seconds(grad.nbytes, self.memory_bytes_per_s)
        if self.bucket_last is None:
            raise ValueError("GpuSharing: call for_buckets first (div_ is once a bucket)")
        copy = self.work.copy.seconds(grad.nbytes, self.memory_bytes_per_s)
        # div_ reads and writes the whole bucket (up to 25 MiB) after it filled, which
        # on a V100 (6 MB of L2) comes from memory: at the copy's share of memory
        # bandwidth, not the trace's mul_out's, whose gradients sat in the A100's 40 MB
        # L2 as backward wrote them.
        divide = copy - self.work.copy.fixed_s
        launch = self.work.scale.fixed_s if grad.name in self.bucket_last else 0.0
        return copy + divide + launch

    def after_backward_s(self, workload: Workload) -> float:
        """Not overlapped: the hooks' passes, all before the first collective."""
        return sum(self.hook_s(g) for g in workload.grads)

    def copy_out_s(self, nbytes: int) -> float:
        """The bucket's gradients copied back, one copy each."""
        if self.work is None:
            return 0.0
        for bucket_bytes, seconds in self.copies_out:
            if bucket_bytes == nbytes:
                return seconds
        raise ValueError(f"GpuSharing: no bucket of {nbytes} bytes; call for_buckets first")

    def for_buckets(self, workload: Workload, buckets: list[list[int]]) -> GpuSharing:
        """This sharing for `buckets` (lists of indices into workload.grads). Two buckets
        of the same bytes share the first one's copy back (their launches may differ by
        a few microseconds)."""
        grads, m = workload.grads, self.memory_bytes_per_s
        last = {grads[max(b, key=lambda i: grads[i].ready_s)].name for b in buckets if b}
        copies = []
        if self.work is not None:
            copies = [(sum(grads[i].nbytes for i in b),
                       sum(self.work.copy.seconds(grads[i].nbytes, m) for i in b))
                      for b in buckets]  # fmt: skip
        return replace(self, bucket_last=frozenset(last), copies_out=tuple(copies))


def sharing(
    work: ReducerWork | None, beside: BesideNccl | None, memory_bytes_per_s: float
) -> GpuSharing:
    """The terms measured on one GPU's trace, carried to a GPU of `memory_bytes_per_s`:
    the same fixed times, the same shares of memory bandwidth, the same slowdown beside
    NCCL. None: that term off."""
    slowdown = 0.0 if beside is None else beside.ratio - 1
    return GpuSharing(slowdown, work=work, memory_bytes_per_s=memory_bytes_per_s)


# ---------------------------------------------------------------------------------------
# Stragglers: every step waits for the slowest of p GPUs. With each GPU's step drawn
# independently from a normal law of relative spread sigma, the step is on average
# 1 + sigma * m(p) times the mean, m(p) the expected largest of p standard normal draws.


def expected_max_normal(p: int) -> float:
    """m(p) = E[max of p standard normal draws] = integral of x p phi(x) Phi(x)^(p-1)
    (m(1) = 0, m(2) = 1/sqrt(pi)), by the trapezoid rule on [-8, 8] in steps of 1/1000."""
    if p < 1:
        raise ValueError(f"expected_max_normal: p = {p}, at least 1 draw")
    law = statistics.NormalDist()
    xs = [i / 1000 for i in range(-8000, 8001)]
    ys = [x * p * law.pdf(x) * law.cdf(x) ** (p - 1) for x in xs]
    return (sum(ys) - (ys[0] + ys[-1]) / 2) / 1000


def straggler_efficiency(sigma: float, gpus: int, reference: int) -> float:
    """E(gpus) against `reference` GPUs when stragglers are all that differs."""
    return (1 + sigma * expected_max_normal(reference)) / (1 + sigma * expected_max_normal(gpus))


def straggler_sigma_for(efficiency: float, gpus: int, reference: int) -> float:
    """The spread sigma at which stragglers alone make E(gpus) = `efficiency`."""
    m, m_ref = expected_max_normal(gpus), expected_max_normal(reference)
    if not m_ref / m < efficiency <= 1:
        raise ValueError(f"stragglers cannot make E({gpus}) = {efficiency} against "
                         f"{reference} GPUs: it stays above {m_ref / m:.3f}")  # fmt: skip
    return (1 - efficiency) / (efficiency * m - m_ref)
