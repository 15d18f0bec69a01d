"""torch DDP's logging data (`_get_ddp_logging_data()`), kept by a wrapper in Python.

Frameworks read it (Lightning's DDP strategy reads `can_set_static_graph` at teardown)
and so do torch's tests. torch's C++ logger fills a dict of strings and integers: the
constructor's settings, the environment, the bucket layout, and runtime stats of
sampled iterations (the first 10, then one every `sample_rate`: 100 unless set). Times
are nanoseconds; `*_start`/`*_end` are host clock readings (`time.time_ns()`).

`RuntimeStats` is the runtime part: in a step whose times the next forward records
(`timing`), the wrapper marks when each phase starts and ends, a few clock readings;
at the start of a sampled step's forward (as torch does) the previous step's phases
are recorded. Other steps read no clock, as torch's reducer times only the iterations
it samples.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

# The phases of a synchronised step whose times torch's logger records (its names).
PHASES = ("forward_compute", "backward_compute", "backward_comm")

# torch's names for dtypes in "dtypes" (caffe2's type names)
_DTYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
    torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}


class RuntimeStats:
    """When each phase of the last synchronised step started and ended, and the record
    of the sampled steps, as torch's logger keeps them."""

    def __init__(self) -> None:
        self.sample_rate = 100  # torch's kDDPRuntimeLoggingSampleRate
        self.iteration = -1  # synchronised forwards so far, less one (torch counts from 0)
        self.marks: dict[str, int] = {}  # "<phase>_start"/"_end" -> time.time_ns()
        self.timing = False  # this step's marks will be recorded: callers mark only then
        self.record: dict[str, int] = {}  # the last sampled step's times, torch's keys
        self._sums = dict.fromkeys(PHASES + ("backward_compute_comm_overlap",), 0)
        self._samples = 0

    def set_sample_rate(self, rate: int) -> None:
        if rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        self.sample_rate = rate

    def forward_started(self) -> bool:
        """At each synchronised forward: record the step before if this one is sampled
        (and say so: the caller adds what it records with the times)."""
        self.iteration += 1
        i = self.iteration
        sampled = i > 0 and self._samples_at(i) and self._complete()
        if sampled:
            self._sample(i)
        self.timing = self._samples_at(i + 1)  # the next forward records this step
        self.marks = {"forward_compute_start": time.time_ns()} if self.timing else {}
        return sampled

    def _samples_at(self, iteration: int) -> bool:
        """Whether the forward of `iteration` records the step before it: the first 10
        steps, then one every `sample_rate` (a rate set between the two forwards makes
        a step without marks, which is then skipped)."""
        return iteration < 10 or iteration % self.sample_rate == 0

    def mark(self, event: str) -> None:
        """The first time `event` happens in this step (e.g. "backward_comm_start");
        called only where `timing` is set."""
        if event not in self.marks:
            self.marks[event] = time.time_ns()

    def _complete(self) -> bool:
        return all(f"{p}_{end}" in self.marks for p in PHASES for end in ("start", "end"))

    def _sample(self, iteration: int) -> None:
        m = self.marks
        times = {p: max(1, m[f"{p}_end"] - m[f"{p}_start"]) for p in PHASES}
        # The time backward computed while communication was in flight.
        overlap = min(m["backward_compute_end"], m["backward_comm_end"]) - max(
            m["backward_compute_start"], m["backward_comm_start"]
        )
        times["backward_compute_comm_overlap"] = max(0, overlap)
        self._samples += 1
        for phase, ns in times.items():
            self._sums[phase] += ns
        self.record = {
            "iteration": iteration,
            **{f"{phase}_time": ns for phase, ns in times.items()},
            **{f"avg_{phase}_time": s // self._samples for phase, s in self._sums.items()},
            "forward_compute_time_start": m["forward_compute_start"],
        }
        for phase in PHASES[1:]:  # torch's names: "backward_comm_time_end", ...
            self.record[f"{phase}_time_start"] = m[f"{phase}_start"]
            self.record[f"{phase}_time_end"] = m[f"{phase}_end"]


def environment(process_group: dist.ProcessGroup) -> dict[str, str | int]:
    """The environment torch's logger reports ("N/A" where a variable is unset)."""

    def env(name: str) -> str:
        return os.environ.get(name, "N/A")

    data: dict[str, str | int] = {
        name.lower(): env(name)
        for name in (
            "MASTER_PORT",
            "MASTER_ADDR",
            "TORCH_DISTRIBUTED_DEBUG",
            "CUDA_VISIBLE_DEVICES",
        )
    }
    backend = dist.get_backend(process_group)
    data["backend_name"] = backend
    if backend == "gloo":
        data["gloo_socket_ifname"] = env("GLOO_SOCKET_IFNAME")
        data["gloo_device_transport"] = env("GLOO_DEVICE_TRANSPORT")
        data["gloo_num_threads"] = 2  # torch's Gloo group: two threads per device
    elif backend == "nccl":
        for name in (
            "NCCL_SOCKET_IFNAME",
            "NCCL_BLOCKING_WAIT",
            "NCCL_ASYNC_ERROR_HANDLING",
            "NCCL_DEBUG",
            "NCCL_NTHREADS",
            "NCCL_IB_TIMEOUT",
        ):
            data[name.lower()] = env(name)
    return data


def dtype_names(params: list[torch.nn.Parameter]) -> str:
    """The parameters' dtypes as torch's logger names them, once each, in order."""
    names = dict.fromkeys(_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params)
    return ", ".join(names)


def gradient_bytes(params: list[torch.nn.Parameter]) -> int:
    """Bytes of the parameters (of their gradients: the same dtype and size)."""
    return sum(p.numel() * p.element_size() for p in params)


def layout_record(ddp: torch.nn.Module) -> dict[str, str | int]:
    """What torch's logger records with a sampled step's times: the ready order of
    the step before, the buckets (rebuilt or not), the unused parameters' bytes."""
    record: dict[str, str | int] = {
        "prev_iteration_grad_ready_order_indices": ", ".join(map(str, ddp._last_ready_order)),
        "has_rebuilt_buckets": int(ddp._rebuilt),
    }
    if ddp._rebuilt:
        record["rebuilt_bucket_sizes"] = ", ".join(
            str(gradient_bytes(b.params)) for b in ddp.buckets
        )
        record["rebuilt_per_bucket_param_indices"] = ", ".join(
            " ".join(str(ddp._position[id(p)]) for p in b.params) for b in ddp.buckets
        )
    params = [p for _, p in ddp.named_trainable]
    record["unused_parameter_size"] = gradient_bytes([params[k] for k in ddp._backward.unreached])
    record["num_buckets_reduced"] = len(ddp.buckets)
    return record


def logging_data(ddp: torch.nn.Module) -> dict[str, str | int]:
    """torch's logging data, with torch's keys, from this class's own state."""
    params = [p for _, p in ddp.named_trainable]
    data: dict[str, str | int] = {
        **environment(ddp.process_group),
        "module_name": type(ddp.module).__name__,
        "device_ids": ", ".join(str(d) for d in ddp.device_ids or []),
        "output_device": -1
        if ddp.output_device is None
        else int(
            torch.device(ddp.output_device).index
            if not isinstance(ddp.output_device, int)
            else ddp.output_device
        ),
        "dtypes": dtype_names(params),
        "bucket_sizes": ", ".join(map(str, ddp._initial_bucket_bytes)),
        "world_size": ddp.world_size,
        "rank": ddp.rank,
        "broadcast_buffers": int(ddp.broadcast_buffers),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "static_graph": int(ddp.static_graph),
        "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.modules())),
        "is_multi_device_module": 0,
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": gradient_bytes(params),
        "join_uneven_inputs": int(ddp._join_config.enable),
        "iteration": 0,
        **ddp._stats.record,
    }
    if ddp._comm_hook is not None:
        data["comm_hook"] = getattr(ddp._comm_hook, "__qualname__", repr(ddp._comm_hook))
    if ddp._synced_backwards:
        # Every synchronised backward brought every gradient, as many as the first:
        # the graph looks static, so static_graph=True would do (torch's reading,
        # which torch's logger reports only once its reducer is destroyed).
        data["can_set_static_graph"] = int(
            ddp._all_arrived and len(ddp._arrivals_per_step) == 1 and not ddp._backward.unreached
        )
    if ddp._logged_error is not None:
        data["has_error"], data["error"] = 1, ddp._logged_error
    return data
