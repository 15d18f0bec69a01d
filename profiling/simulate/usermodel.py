"""Your model as the simulator sees it: each gradient's bytes, and when backward makes it.

    python -m profiling.simulate scale --model mypackage.models:build \\
        --input-shape 3,224,224 --batch-size 32 --iteration-ms 180 --cluster dgx_a100

`--model MODULE:FACTORY` names any importable callable that returns an `nn.Module`
(MODULE is imported as `python -m` would, the current directory first on the path).
What the step model needs from it (`schedule.Workload`):

- **gradient bytes**: the module built on the meta device (shapes, no memory), one
  gradient per trainable parameter in parameter order, at `--dtype`'s bytes per
  element (DDP all-reduces the gradients' own dtype);
- **when each gradient is ready**, as a fraction of backward, by one of two methods
  (`--ready`):
    - `flops` (the default): one forward and backward on the meta device under
      torch's FLOP counter; a gradient is ready when backward has done the FLOPs it
      had done when the gradient's accumulate hook fired. Memory-bound operations
      (norms, activations) count no FLOPs, so they take no time here. A convolution's
      backward is counted here (`conv_backward_flops`), per group: torch's own formula
      leaves `groups` out of the weight's gradient, counting a grouped convolution's
      backward `groups` times too many FLOPs;
    - `measured`: the module built for real and trained a few steps on this machine's
      CPU at batch 2 (`measure`), each gradient's ready time stamped by the same hook;
      a large model takes minutes, so it says on stderr which step of how many it is
      on, and the time elapsed, every few seconds (`Heartbeat`);
  forward's share of forward and backward comes from the same method;
- **the iteration time**: `--iteration-ms`, one GPU's forward, backward and optimizer
  at `--batch-size`; without it, on a machine with a GPU, measured there (`measure`
  at --batch-size, CUDA events; the ready times then come from that measurement too).
  The optimizer's share is its memory traffic at the GPU's memory bandwidth
  (`--optimizer`: SGD with momentum or Adam, in float32); forward and backward split
  the rest.

`python -m profiling.simulate shape --compare` shows, on the presets, how far each
method's ready times are from the ones measured on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from ddp.clock import DeviceClock
from profiling.simulate.schedule import Grad, Workload

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
READY_METHODS = ("flops", "measured")
MEASURE_BATCH = 2  # `measured`: small, so a large model fits in this machine's memory
MEASURE_REPEATS = 3  # timed steps after one untimed
MEASURED_METHOD = (f"timed on this CPU at batch {MEASURE_BATCH}: medians of {MEASURE_REPEATS} "
                   "steps after one warm-up")  # fmt: skip
PROGRESS_EVERY_S = 5.0  # `measured`: a line on stderr at least this often
OPTIMIZER_BYTES = {"sgd": 5 * 4, "adam": 7 * 4}  # float32 bytes per parameter, read and written


@dataclass(frozen=True)
class Profile:
    """A model's gradients and backward's shape, independent of any GPU's speed."""

    names: tuple[str, ...]  # trainable parameters, in parameter order
    elements: tuple[int, ...]  # each parameter's number of elements
    forward_fraction: float  # forward's share of forward and backward together
    ready_fraction: dict[str, float]  # when each gradient is ready, a fraction of backward
    method: str  # flops or measured

    @property
    def parameters(self) -> int:
        return sum(self.elements)


def load_factory(spec: str) -> Callable[[], object]:
    """The callable `MODULE:FACTORY` names; errors say which part is wrong."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(
            f"--model {spec!r}: give a preset or MODULE:FACTORY, a callable that returns an "
            "nn.Module (e.g. mypackage.models:build)"
        )
    if os.getcwd() not in sys.path:  # as `python -m` finds modules in the current directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({error})") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {attribute!r}")
    return factory


def build(factory: Callable[[], object], spec: str, device: str = "meta"):
    """`factory()` under `device` as the default device; on meta it holds no memory."""
    try:
        with torch.device(device):
            model = factory()
    except Exception as error:  # the user's code: any failure is theirs to see
        raise ValueError(
            f"--model {spec!r}: building it on the {device} device failed ({error!r}); the "
            "factory must build the model without loading weights or moving it to a device"
        ) from None
    if not isinstance(model, nn.Module):
        kind = type(model).__name__
        raise ValueError(f"--model {spec!r}: the factory returned {kind}, not an nn.Module")
    if any(p.device.type != torch.device(device).type for p in model.parameters()):
        raise ValueError(f"--model {spec!r}: the factory moved its parameters off {device}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"--model {spec!r}: the model has no trainable parameters")
    return model


def parse_input_shape(text: str) -> tuple[int, ...]:
    """`3,224,224` (a sample's shape, float inputs) or `512` (a sequence length, token ids)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"--input-shape {text!r}: give positive integers: 3,224,224 or 512")
    return shape


# An nn.Embedding of learned positions, by its name: BERT's `position_embeddings`, GPT-2's
# `wpe`, BART's `embed_positions`, ... at the start of a name's part (split on . and _, so
# not "decomposition"); not a relative-position table, indexed by distances (RELATIVE).
POSITION_EMBEDDING = re.compile(r"(^|[._])(wpe$|position|pos_?emb|embed_?pos)", re.IGNORECASE)
RELATIVE = re.compile(r"relative|(^|[._])rel_", re.IGNORECASE)


def position_limit(model) -> tuple[str, int] | None:
    """(name, longest sequence) of `model`'s smallest learned-position table, an
    nn.Embedding named for positions; None if it has none (sinusoidal or rotary
    positions have no table to run off). A table with a padding row (RoBERTa's: 514
    rows, padding at 1) numbers positions after it, so holds that many fewer. Found by
    name, so a table named otherwise goes unchecked here."""
    tables = [(m.num_embeddings - (0 if m.padding_idx is None else m.padding_idx + 1), name)
              for name, m in model.named_modules()
              if isinstance(m, nn.Embedding) and POSITION_EMBEDDING.search(name)
              and not RELATIVE.search(name)]  # fmt: skip
    return (min(tables)[1], min(tables)[0]) if tables else None


def example_input(model, input_shape: Sequence[int], batch: int, device: str):
    """A batch for `model`: float samples of `input_shape`, or, for one number, token ids
    of that sequence length below the model's first embedding's vocabulary. A sequence
    longer than the model's learned positions is refused: on a GPU looking up a position
    past the table fails, but on the meta device no index is checked."""
    if len(input_shape) > 1:
        return torch.randn(batch, *input_shape, device=device)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError(
            f"--input-shape {input_shape[0]}: one number is a token model's sequence length, "
            "but the model has no nn.Embedding; give a sample's shape, e.g. 3,224,224"
        )
    limit = position_limit(model)
    if limit and input_shape[0] > limit[1]:
        raise ValueError(
            f"--input-shape {input_shape[0]}: longer than the model's {limit[1]} positions "
            f"(its position embedding {limit[0]}); give a sequence length of at most "
            f"{limit[1]}"
        )
    vocab = embeddings[0].num_embeddings
    return torch.randint(0, vocab, (batch, input_shape[0]), device=device)


def _loss(output):
    """A scalar of every floating-point tensor the model returned (a tensor, a tuple, a
    dict, a dataclass of outputs), so backward reaches every gradient they depend on."""
    if hasattr(output, "to_tuple"):  # Hugging Face's ModelOutput
        output = output.to_tuple()
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("the model's output holds no tensor that depends on its parameters")
    return sum(t.float().sum() for t in leaves)


@contextlib.contextmanager
def _named_failure(x):
    """The user's model failing on the batch built for it: say which input it was given."""
    try:
        yield
    except ValueError:
        raise
    except Exception as error:  # the user's code: shape mismatches, out of memory, ...
        shape = ",".join(map(str, x.shape[1:]))
        raise ValueError(
            f"the model's forward and backward failed on a batch of {x.shape[0]} of "
            f"--input-shape {shape} ({type(error).__name__}: {str(error)[:200]}); check "
            "--input-shape, and --batch-size where it runs on a GPU"
        ) from None


# How `flops` counts, as the command line says it.
FLOPS_METHOD = "backward's FLOPs on the meta device, grouped convolutions counted per group"


def conv_backward_flops(
    grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
    _output_padding, _groups, output_mask, out_shape=None, **kwargs,
) -> int:  # fmt: skip
    """FLOPs of `aten.convolution_backward`, for `FlopCounterMode(custom_mapping=...)`:
    the input's gradient and the weight's each take the forward's FLOPs (each is one
    convolution of the same products, regrouped), `2 * N * Cout * (Cin / groups) * kh * kw`
    per output position (per input position for a transposed convolution); the bias's
    gradient is a sum, no FLOPs. `grad_out_shape` is the forward's output's shape.

    torch's `conv_backward_flop` counts the weight's gradient as a convolution over all
    `Cin` input channels, not `Cin / groups`: `groups` times too many, 32 on ResNeXt's
    3x3 convolutions, 64 on a depthwise one of 64 channels."""
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (bool(output_mask[0]) + bool(output_mask[1]))


# --8<-- [start:flops]
def flops_profile(model, x) -> Profile:
    """Backward's shape by FLOPs, on the meta device: forward's FLOPs against backward's,
    and the FLOPs backward had done when each gradient's accumulate hook fired.
    Convolutions' backward by `conv_backward_flops`, per group."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    counter = FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten.convolution_backward: conv_backward_flops}
    )
    done_at: dict[str, int] = {}

    def hook(name: str) -> Callable[[object], None]:
        return lambda _: done_at.setdefault(name, counter.get_total_flops()) and None

    handles = [p.register_post_accumulate_grad_hook(hook(n)) for n, p in named]
    try:
        with counter, _named_failure(x):
            loss = _loss(model(x))
            forward = counter.get_total_flops()
            loss.backward()
            total = counter.get_total_flops()
    finally:
        for h in handles:
            h.remove()
    backward = total - forward
    if forward <= 0 or backward <= 0:
        raise ValueError("the model does no matrix products or convolutions the FLOP counter sees")
    return Profile(
        names=tuple(n for n, _ in named),
        elements=tuple(p.numel() for _, p in named),
        forward_fraction=forward / total,
        ready_fraction={n: (done_at.get(n, total) - forward) / backward for n, _ in named},
        method="flops",
    )


# --8<-- [end:flops]


class Heartbeat:
    """Lines on stderr while a measurement runs, so that a long one shows it is alive:
    what is measured, where it is (`update`: a string, or a callable for a count that
    changes, such as gradients ready) and the seconds elapsed; one at each `update`,
    and, in between, one every `every_s` seconds from a thread while in `with` (torch's
    operators release the GIL, so it runs during a long forward or backward).
    `clock` and `write` are for tests."""

    def __init__(
        self, what: str, every_s: float = PROGRESS_EVERY_S, *,
        clock: Callable[[], float] = time.monotonic, write: Callable[[str], object] | None = None,
    ) -> None:  # fmt: skip
        self.what, self.every_s, self.clock = what, every_s, clock
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.start = self.last = clock()
        self.state: str | Callable[[], str] = "starting"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self) -> str:
        state = self.state() if callable(self.state) else self.state
        return f"{self.what}: {state}; {self.clock() - self.start:.0f} s elapsed"

    def emit(self) -> None:
        with self._lock:
            self.last = self.clock()
            self.write(self.line())

    def update(self, state: str | Callable[[], str]) -> None:
        self.state = state
        self.emit()

    def poll(self) -> None:
        """A line if none for `every_s` seconds."""
        if self.clock() - self.last >= self.every_s:
            self.emit()

    def _run(self) -> None:
        while not self._stop.wait(min(self.every_s, 1.0)):
            self.poll()

    def __enter__(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


@dataclass(frozen=True)
class Timing:
    """One measured training step's phases, medians over the timed steps."""

    forward_s: float
    backward_s: float
    optimizer_s: float


def measure(
    model, x, device: str, *, repeats: int = MEASURE_REPEATS, warmup: int = 1,
    optimizer: str = "sgd", progress: Heartbeat | None = None,
) -> tuple[Profile, Timing]:  # fmt: skip
    """Train `repeats` steps after `warmup` untimed ones: forward with the loss, backward,
    the optimizer's step. Marks by `ddp.clock.DeviceClock` (CUDA events on a GPU, so a
    gradient's mark is when the GPU finished it); each step starts on an idle device.
    Medians of forward's share, each gradient's ready fraction and each phase.
    `progress`, if given, is told each step and phase (and gradients ready so far)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    clock = DeviceClock(torch.device(device))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    optimizer_ = {"sgd": lambda: torch.optim.SGD(params, lr=0.01, momentum=0.9),
                  "adam": lambda: torch.optim.Adam(params, lr=1e-4)}[optimizer]()  # fmt: skip
    marks: dict[str, object] = {}

    def hook(name: str) -> Callable[[object], None]:
        return lambda _: marks.setdefault(name, clock.mark()) and None

    handles = [p.register_post_accumulate_grad_hook(hook(n)) for n, p in named]
    steps = []

    def tell(step: int, phase: str) -> None:
        if progress is None:
            return
        kind = f"warm-up {step + 1} of {warmup}" if step < warmup else (
            f"timed {step - warmup + 1} of {repeats}")  # fmt: skip
        where = f"step {step + 1} of {warmup + repeats} ({kind}), {phase}"
        if phase == "backward":
            progress.update(lambda: f"{where}, {len(marks)} of {len(named)} gradients ready")
        else:
            progress.update(where)

    try:
        for step in range(warmup + repeats):
            marks.clear()
            tell(step, "forward")
            start = clock.mark()
            with _named_failure(x):
                loss = _loss(model(x))
                backward_start = clock.mark()
                tell(step, "backward")
                loss.backward()
            backward_end = clock.mark()
            tell(step, "optimizer")
            optimizer_.step()
            optimizer_.zero_grad(set_to_none=True)
            end = clock.mark()
            clock.wait()
            if step >= warmup:
                backward = clock.seconds(backward_start, backward_end)
                ready = {n: clock.seconds(backward_start, marks.get(n, backward_end)) / backward
                         for n, _ in named}  # fmt: skip
                steps.append((clock.seconds(start, backward_start), backward,
                              clock.seconds(backward_end, end), ready))  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    forward_s, backward_s, optimizer_s = (statistics.median(s[k] for s in steps) for k in range(3))
    profile = Profile(
        names=tuple(n for n, _ in named),
        elements=tuple(p.numel() for _, p in named),
        forward_fraction=statistics.median(s[0] / (s[0] + s[1]) for s in steps),
        ready_fraction={n: min(1.0, statistics.median(s[3][n] for s in steps)) for n, _ in named},
        method="measured",
    )
    return profile, Timing(forward_s, backward_s, optimizer_s)


def measure_spec(
    spec: str, input_shape: Sequence[int], batch: int, device: str, **kwargs
) -> tuple[Profile, Timing]:
    """`measure` of the model `spec` names, built for real on `device`, seeded; with a
    line on stderr every few seconds (`Heartbeat`) unless `progress=None` is given."""
    factory = load_factory(spec)
    shape = ",".join(map(str, input_shape))
    progress = kwargs.pop("progress") if "progress" in kwargs else Heartbeat(
        f"measuring {spec} at batch {batch} of --input-shape {shape} on {device}")  # fmt: skip
    with progress or contextlib.nullcontext():
        if progress:
            progress.update(f"building it on {device}")
        model = build(factory, spec, device)
        model.train()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            x = example_input(model, input_shape, batch, device)
            result = measure(model, x, device, progress=progress, **kwargs)
        if progress:
            progress.update("done")
        return result


def profile(spec: str, input_shape: Sequence[int], method: str = "flops") -> Profile:
    """The profile of the model `spec` names, by `method` (see the module's docstring)."""
    if method not in READY_METHODS:
        raise ValueError(f"--ready {method!r}: pick one of {', '.join(READY_METHODS)}")
    factory = load_factory(spec)
    model = build(factory, spec, "meta")
    x = example_input(model, input_shape, MEASURE_BATCH, "meta")
    if method == "flops":
        return flops_profile(model, x)
    return measure_spec(spec, input_shape, MEASURE_BATCH, "cpu")[0]


def workload(
    profile: Profile, iteration_s: float, optimizer_s: float, dtype: str = "fp32"
) -> Workload:
    """One GPU's iteration of the profiled model: the optimizer's `optimizer_s`, and the
    rest split between forward and backward, and within backward, as profiled."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype {dtype!r}: pick one of {', '.join(DTYPE_BYTES)}")
    if not iteration_s > optimizer_s:
        raise ValueError(
            f"--iteration-ms {iteration_s * 1e3:g} is not more than the optimizer's estimated "
            f"{optimizer_s * 1e3:.2f} ms; give one GPU's whole forward, backward and optimizer"
        )
    rest = iteration_s - optimizer_s
    forward_s = rest * profile.forward_fraction
    backward_s = rest - forward_s
    grads = tuple(
        Grad(name, n * DTYPE_BYTES[dtype], backward_s * profile.ready_fraction[name])
        for name, n in zip(profile.names, profile.elements, strict=True)
    )
    return Workload(grads, forward_s, backward_s, optimizer_s)
