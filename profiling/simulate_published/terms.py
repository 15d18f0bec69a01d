"""Two terms the bare step model leaves out, each measured on a real GPU trace.

    python -m profiling.simulate published --terms-from TRACE   # measure, then predict

- **DDP's gradient copies.** torch's DDP copies every gradient into its bucket and the
  average back (with `gradient_as_bucket_view=False`, the default): device-to-device
  copies on the compute stream, which a GPU with nothing to send pays too. Measured as
  the trace's `Memcpy DtoD` events per step, fitted as a fixed time per copy plus bytes
  at a share of the GPU's memory bandwidth (`copies`).
- **Compute beside NCCL.** NCCL's kernels take streaming multiprocessors and memory
  bandwidth from backward's. Measured as the time-weighted ratio of a compute kernel's
  duration while an NCCL kernel runs to its duration alone, over kernels of the same
  name, grid and block that ran both ways (`beside_nccl`).

`GpuSharing` puts both into the model: the copies on the compute lane at each gradient's
hook (two copies per gradient, as the trace has), and backward `slowdown` = ratio - 1
slower while a collective is in flight. Either can be switched off (0).

The trace the docs use is a real one recorded by others: torch's DDP training
ResNet-50 on two A100s with NCCL 2.17.1 (rank 0, 3 steps; HolisticTraceAnalysis's test
data, `tests/fixtures/gpu-traces/a100-ddp-resnet50`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from profiling.simulate.schedule import Grad, Sharing

A100_MEMORY_BYTES_PER_S = 1555e9  # A100 40GB SXM data sheet
DOCS_TRACE = "tests/fixtures/gpu-traces/a100-ddp-resnet50/a100-ddp-resnet50-rank0.json.gz"


@dataclass(frozen=True)
class Copies:
    """DDP's device-to-device copies, per traced step."""

    per_step: float  # copies
    bytes_per_step: float
    fixed_s: float  # each copy's fixed time
    share_of_memory_bandwidth: float  # bytes copied per second over the GPU's peak


@dataclass(frozen=True)
class BesideNccl:
    ratio: float  # a compute kernel's time beside NCCL over its time alone
    kernel_s: float  # compute kernel time beside NCCL that the ratio weighs
    shapes: int  # (name, grid, block) kernels that ran both ways


def load(path: str | Path) -> list[dict]:
    from profiling.analysis.formats import complete_events
    from profiling.analysis.runs import load_trace

    return complete_events(load_trace(Path(path)))


def copies(events: list[dict], memory_bytes_per_s: float) -> Copies:
    """The trace's `Memcpy DtoD` events: per step, and the least-squares line of duration
    against bytes (the fixed time is its intercept, the bandwidth its slope)."""
    steps = sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#"))
    dtod = [e for e in events if e.get("name", "").startswith("Memcpy DtoD")]
    if not steps or len(dtod) < 2:
        raise ValueError(f"no DDP copies to measure: {len(dtod)} Memcpy DtoD in {steps} steps")
    xs = [float(e["args"]["bytes"]) for e in dtod]
    ys = [float(e["dur"]) * 1e-6 for e in dtod]
    slope, intercept = statistics.linear_regression(xs, ys)
    return Copies(len(dtod) / steps, sum(xs) / steps, max(intercept, 0.0),
                  1 / slope / memory_bytes_per_s)  # fmt: skip


def beside_nccl(events: list[dict]) -> BesideNccl:
    """Compute kernels wholly inside NCCL kernels' time (90% or more of them) against the
    same kernels (name, grid, block) wholly outside it: the ratio of their total time
    beside NCCL to what the same launches take alone (each shape's median alone)."""
    from profiling.analysis.formats import is_collective, span
    from profiling.analysis.intervals import intersect, length, merge

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
    """The bare model's sharing (`slowdown`) plus DDP's copies of each gradient."""

    copies_per_grad: float = 0.0
    copy_fixed_s: float = 0.0
    copy_bytes_per_s: float = float("inf")

    def hook_s(self, grad: Grad) -> float:
        """The gradient's copies: into its bucket and back, on the compute stream."""
        return self.copies_per_grad * self.copy_fixed_s + grad.nbytes / self.copy_bytes_per_s


def sharing(
    copied: Copies | None,
    beside: BesideNccl | None,
    grads_in_trace: int,
    memory_bytes_per_s: float,
) -> GpuSharing:
    """The terms measured on one GPU's trace, carried to a GPU of `memory_bytes_per_s`:
    the same copies per gradient and fixed time, the same share of memory bandwidth, the
    same slowdown beside NCCL. None: that term off."""
    slowdown = 0.0 if beside is None else beside.ratio - 1
    if copied is None:
        return GpuSharing(slowdown)
    return GpuSharing(
        slowdown,
        copies_per_grad=copied.per_step / grads_in_trace,
        copy_fixed_s=copied.fixed_s,
        # The trace copies each gradient's bytes once per step in all (see Copies).
        copy_bytes_per_s=copied.share_of_memory_bandwidth * memory_bytes_per_s,
    )
