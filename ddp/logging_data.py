"""torch DDP's logging data (`_get_ddp_logging_data()`), kept by a wrapper in Python.

Frameworks read it (Lightning's DDP strategy reads `can_set_static_graph` at teardown)
and so do torch's tests. torch's C++ logger fills a dict of strings and integers: the
constructor's settings, the environment, the bucket layout, and runtime stats of
sampled iterations (the first 10, then one every `sample_rate`: 100 unless set). Times
are nanoseconds; `*_start`/`*_end` are host clock readings (`time.time_ns()`).

`RuntimeStats` is the runtime part: the wrapper marks when each phase of a
synchronised step starts and ends, a few clock readings a step, and at the start of
a sampled step's forward (as torch does) the previous step's phases are recorded.
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
        sampled = i > 0 and (i < 10 or i % self.sample_rate == 0) and self._complete()
        if sampled:
            self._sample(i)
        self.marks = {"forward_compute_start": time.time_ns()}
        return sampled

    def mark(self, event: str) -> None:
        """The first time `event` happens in this step (e.g. "backward_comm_start")."""
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
