"""The events of a torch.profiler trace, and the trace formats read here.

What a trace holds (torch 2.13, Gloo on CPU; see docs/profiling.md):

- The main thread: one `ProfilerStep#N` span per traced step (N is the training step,
  counted from 0), our `record_function` spans inside it (`forward`, `backward`,
  `finish gradient synchronization`, `optimizer`, `allreduce bucket i (N B)`,
  `allreduce <param> (N B)`, `wait for communication`), and the operators (`cpu_op`:
  aten ops, autograd nodes, `c10d::allreduce_` launching a collective).
- Gloo's worker threads: one `gloo:all_reduce` (or `gloo:broadcast`, ...) event per
  collective, from the moment Gloo starts running it to the moment it completes, with
  the tensor's shape and dtype in its args. torch's DDP's collectives appear the same way.

A GPU trace (CUDA activity recorded) adds, on the device's lanes, one event per kernel
(`kernel`), copy (`gpu_memcpy`) and memset (`gpu_memset`), each on its CUDA stream and
with a `correlation` id shared with the CPU-side call that launched it
(`cudaLaunchKernel`, `cat: cuda_runtime`). NCCL's kernels have "nccl" in their names:
`ncclKernel_AllReduce_*`, `ncclDevKernel_Broadcast_*`, `ncclKernel_SendRecv_*` (all-to-all,
send/recv). The launch sits inside a CPU-side `nccl:all_reduce` (`nccl:all_to_all`, ...)
span, which holds the tensor's shape when shapes were recorded; newer NCCL kernels also
carry `In msg nelems` and `dtype` themselves. Older kineto (2021) named the categories
`Operator`, `Runtime`, `Kernel`, `Memcpy` and `Memset`; they are read the same way.

"""

from __future__ import annotations

import re

from profiling.analysis.intervals import Interval

COMPUTE_ONLY = "compute_only"  # the run every other run's exposed communication refers to
# The same, traced again after every other run (profiling.compare does): the baseline is
# then the mean of the two, and how far they differ says how far the machine's pace moved.
COMPUTE_ONLY_AGAIN = "compute_only_again"
COMPUTE_SPANS = ("forward", "backward", "optimizer")  # ddp/train.py's record_function names
# Main-thread spans and operators that are communication, not compute.
COMMUNICATION_SPAN_PREFIXES = ("allreduce ", "wait for communication", "c10d::", "gloo:", "nccl:")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
OLDER_CATEGORIES = {  # kineto's names before 2022 -> today's
    "Operator": "cpu_op",
    "Runtime": "cuda_runtime",
    "Kernel": "kernel",
    "Memcpy": "gpu_memcpy",
    "Memset": "gpu_memset",
}
# Spans around an NCCL launch that may carry its payload (c10d::* ops list the output
# tensor too, so they would count all-gathers and all-to-alls twice).
NCCL_LAUNCH_SPANS = ("nccl:", "record_param_comms")
DTYPE_BYTES = {
    # the C++ names torch's profiler writes in "Input type"
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "long": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
    # the ScalarType names in an NCCL kernel's or record_param_comms' "dtype"
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
}
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
GLOO_LANE = "Gloo threads"  # GPU traces: where Gloo's collectives (on CUDA tensors) run


class TraceFormatError(ValueError):
    """A trace this module would read wrong; the message says what it found instead."""


def complete_events(trace: dict) -> list[dict]:
    """The trace's complete events (ph "X"), the only kind with a duration, with kineto's
    older category names (`Kernel`, `Memcpy`, ...) replaced by today's."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        found = sorted(trace)[:12] if isinstance(trace, dict) else type(trace).__name__
        raise TraceFormatError(
            f"not a torch.profiler (Chrome trace) file: no traceEvents list; found {found}"
        )
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "dur" not in e:
            continue
        if e.get("cat") in OLDER_CATEGORIES:
            e = {**e, "cat": OLDER_CATEGORIES[e["cat"]]}
        out.append(e)
    return out


def check_format(events: list[dict]) -> None:
    """Refuse, saying what was found, a trace whose figures would come out as zeros or
    wrong without a word: device activity of a kind not read here, GPU work with no launch
    to tie it to a step, NCCL collectives recorded without their kernels."""
    on_streams: dict[str, int] = {}  # what runs on a device stream (kineto puts "stream" there)
    gpu: dict[str, int] = {}
    for e in events:
        cat = e.get("cat")
        if "stream" in e.get("args", {}):
            on_streams[cat] = on_streams.get(cat, 0) + 1
        if cat in GPU_CATEGORIES:
            gpu[cat] = gpu.get(cat, 0) + 1
    unknown = {cat: n for cat, n in on_streams.items() if cat not in GPU_CATEGORIES}
    if unknown:
        raise TraceFormatError(
            f"events on GPU streams in categories not read here: {unknown} (read: "
            f"{', '.join(GPU_CATEGORIES)}, and the older {', '.join(OLDER_CATEGORIES)}); "
            "the figures would leave that work out"
        )
    if gpu and not any(is_launch(e) for e in events):
        raise TraceFormatError(
            f"GPU events {gpu} but no CPU-side launch (a cuda_runtime or cuda_driver event "
            "with args.correlation): no kernel can be tied to the step that launched it"
        )
    nccl = sum(1 for e in events if e.get("name", "").startswith("nccl:"))
    if nccl and not gpu:
        raise TraceFormatError(
            f"{nccl} nccl:* collectives on the CPU but no GPU kernels: the trace was recorded "
            "without CUDA activity, so no communication time can be read from it; profile "
            "with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]"
        )


def span(event: dict) -> Interval:
    return (float(event["ts"]), float(event["ts"]) + float(event["dur"]))


def event_start(event: dict) -> float:
    return event["ts"]


def is_collective(event: dict) -> bool:
    """A collective in flight: a Gloo event (any thread), or an NCCL kernel on a GPU,
    all-to-all and send/recv (`ncclKernel_SendRecv_*`) included."""
    name = event.get("name", "")
    if event.get("cat") == "kernel":
        return "nccl" in name.lower()
    return name.startswith("gloo:")


def is_launch(event: dict) -> bool:
    """A CPU-side call that hands work to the GPU (cudaLaunchKernel, cudaMemcpyAsync,
    cuLaunchKernel, ...): the GPU event with the same args.correlation is its work."""
    cat = event.get("cat") or ""
    return cat.endswith(("_runtime", "_driver")) and "correlation" in event.get("args", {})


def collective_bytes(event: dict) -> int | None:
    """Payload bytes of a collective, from the args of its event: an NCCL kernel's (or
    record_param_comms') `In msg nelems` and `dtype`, or the shapes and dtypes of the
    tensors a Gloo event or `nccl:*` span was recorded with. None where they are missing."""
    args = event.get("args", {})
    if "In msg nelems" in args and args.get("dtype") in DTYPE_BYTES:
        return int(args["In msg nelems"]) * DTYPE_BYTES[args["dtype"]]
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types or len(dims) != len(types):
        return None
    total = 0
    for shape, dtype in zip(dims, types, strict=True):
        if dtype not in DTYPE_BYTES or not isinstance(shape, list):
            return None
        numel = 1
        for size in shape:
            numel *= int(size)
        total += numel * DTYPE_BYTES[dtype]
    return total


def main_thread(events: list[dict]) -> tuple[object, object]:
    """(pid, tid) of the thread that ran the training loop: the one with ProfilerStep spans
    (on the CPU: kineto may mirror them on the GPU's lanes)."""
    for e in events:
        if PROFILER_STEP.match(e.get("name", "")) and not e.get("cat", "").startswith("gpu_"):
            return e["pid"], e["tid"]
    categories: dict[str, int] = {}
    for e in events:
        categories[e.get("cat")] = categories.get(e.get("cat"), 0) + 1
    raise TraceFormatError(
        "no ProfilerStep#N span in this trace; was it written by torch.profiler with a "
        "schedule and profiler.step() once per step (as ddp/train.py does)? Found "
        f"{len(events)} complete events, by category: {categories}"
    )
