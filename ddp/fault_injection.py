"""Fault injection: a worker kills (or stops) itself at an exact step and phase.

    DDP_STAGES_FAULT=<rank>:<step>:<phase>[:<signal>]

`phase` is one of PHASES: inside the model's forward, inside backward once half of the
parameters have their gradients (earlier buckets are then in flight), at the optimizer
step, or halfway through writing the checkpoint after `step` steps. `signal` is KILL
(default) or STOP (a rank that hangs without dying). It fires on torchrun's first attempt
only (TORCHELASTIC_RESTART_COUNT 0), so the restarted workers run to the end; the harness
in `profiling/studies/fault_trials.py` draws the rank, step and phase."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

import torch
from torch import nn

ENV = "DDP_STAGES_FAULT"
PHASES = ("forward", "backward", "optimizer", "checkpoint")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


@dataclass
class Fault:
    rank: int
    step: int
    phase: str
    signal_name: str = "KILL"
    current_step: int = -1  # the training loop sets it before each step

    @classmethod
    def from_env(cls) -> Fault | None:
        """The fault this process must inject, or None (unset, another rank, a restart)."""
        spec = os.environ.get(ENV)
        if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return None
        parts = spec.split(":")
        if (
            len(parts) not in (3, 4)
            or parts[2] not in PHASES
            or parts[3:4] not in ([], ["KILL"], ["STOP"])
        ):
            raise ValueError(
                f"{ENV}={spec!r}: expected <rank>:<step>:<phase>[:KILL|STOP] with phase one "
                f"of {', '.join(PHASES)}"
            )
        fault = cls(int(parts[0]), int(parts[1]), parts[2], *parts[3:])
        return fault if fault.rank == int(os.environ.get("RANK", "0")) else None

    def install(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Hooks that fire at the forward, backward and optimizer phases."""
        model.register_forward_pre_hook(lambda *_: self.at("forward"))
        params = [p for p in model.parameters() if p.requires_grad]
        # Gradients arrive in roughly reverse order: the middle one comes halfway through.
        params[len(params) // 2].register_hook(lambda grad: self.at("backward"))
        optimizer.register_step_pre_hook(lambda *_: self.at("optimizer"))

    def at(self, phase: str, step: int | None = None) -> None:
        """Kill or stop this process if this is the step and phase."""
        step = self.current_step if step is None else step
        if (step, phase) != (self.step, self.phase):
            return
        print(
            f"rank {self.rank} (pid {os.getpid()}): {ENV} sends SIG{self.signal_name} "
            f"at step {step}, {phase}",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), SIGNALS[self.signal_name])
