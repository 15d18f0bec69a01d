"""The training loop every stage runs under torchrun, and the compute-only floor."""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from ddp import checkpoint
from ddp.config import Config, parse_config
from ddp.data import rank_batch, split_batch
from ddp.dist import (
    broadcast_module_states,
    replicas_identical,
    require_process_group,
    setup_process_group,
    teardown_process_group,
)
from ddp.elastic import Elastic
from ddp.fault_injection import Fault
from ddp.heap import steady_heap
from ddp.models import rank_model
from ddp.progress import Progress

Wrap = Callable[[nn.Module, Config], nn.Module]


class ComputeOnly(nn.Module):
    """The same step with no gradient communication: the floor every stage is measured
    against. Replicas start identical and then drift apart, by design."""

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        broadcast_module_states(module, require_process_group(process_group))

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)


@dataclass
class RunResult:
    name: str
    step_times_s: list[float]  # per timed step, the slowest rank's time
    replicas_identical: bool
    final_loss: float
    params_sha256: str = ""  # of the final parameters, see ddp.checkpoint.params_sha256

    @property
    def median_step_s(self) -> float:
        # A run resumed from its last checkpoint may have no timed step left to run.
        return statistics.median(self.step_times_s) if self.step_times_s else float("nan")


def train(
    name: str, wrap: Wrap, cfg: Config, device: torch.device, progress: Progress | None = None
) -> RunResult:
    """Train `cfg.model` wrapped by `wrap` for cfg.warmup_steps + cfg.steps steps,
    reporting each step to `progress` (rank 0 prints it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    global_batch = cfg.global_batch(world)
    split_batch(global_batch, rank, world)  # fail before any collective if it does not split
    model = rank_model(cfg, rank).to(device)
    wrapped = wrap(model, cfg)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=cfg.lr, momentum=0.9)
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    total_steps = cfg.warmup_steps + cfg.steps  # warm-up steps train too: they resume alike
    # --8<-- [start:resume]
    run_dir = Path(cfg.checkpoint_dir) / name
    settings = checkpoint.run_settings(cfg, global_batch, world)
    # --elastic: a checkpoint of another world size resumes too, with its data position
    # and learning rate (ddp/elastic.py); the run's header says what this world trains.
    elastic = Elastic(cfg, model, device) if cfg.elastic != "off" else None
    if elastic is not None:
        settings = elastic.settings
        first_step = elastic.resume(run_dir if cfg.checkpoint_dir else None, model, optimizer)
    elif cfg.checkpoint_dir:
        first_step = checkpoint.resume(run_dir, model, optimizer, settings)
    else:
        first_step = 0
    # --8<-- [end:resume]
    if elastic is not None:
        total_steps = elastic.end  # scale-lr: a smaller world takes more steps
    fault = Fault.from_env()
    if fault is not None:
        fault.install(model, optimizer)
    times = []
    tracing = Tracing(cfg, name, rank, device) if cfg.profile_dir else None
    if progress is not None:
        # What is left after a restart. Its median is this rank's, warm-up included; the
        # table's is of the slowest rank of each timed step.
        progress.start(name, total_steps - first_step, of="this rank, warm-up included")
    loss = torch.tensor(float("nan"))
    for step in range(first_step, total_steps):
        if fault is not None:
            fault.current_step = step
        if elastic is None:
            micro_batches = make_micro_batches(model, cfg, step, device)
        else:  # sets the step's learning rate too
            micro_batches = elastic.start_step(step, optimizer)
        synchronize(device)
        start = time.perf_counter()
        loss = train_step(wrapped, micro_batches, optimizer, finish)
        synchronize(device)
        step_s = time.perf_counter() - start
        if step >= cfg.warmup_steps:
            times.append(step_s)
        if tracing is not None:
            tracing.step(step, loss.item(), optimizer.param_groups[0]["lr"], step_s)
        if progress is not None:
            progress.step(step_s)
        # --8<-- [start:checkpoint]
        done = step + 1
        if elastic is not None:
            elastic.end_step()
        if cfg.checkpoint_dir and (done % cfg.checkpoint_every == 0 or done == total_steps):
            midway = partial(fault.at, "checkpoint", done) if fault else lambda: None
            position = elastic.position() if elastic is not None else None
            checkpoint.save(run_dir, done, model, optimizer, settings, midway,
                            position=position, keep=cfg.checkpoint_keep)  # fmt: skip
        # --8<-- [end:checkpoint]
    if elastic is not None:
        elastic.final_loss(model)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    result = RunResult(
        name=name,
        step_times_s=slowest.tolist(),
        replicas_identical=replicas_identical(model),
        final_loss=loss.item(),
        params_sha256=checkpoint.params_sha256(model),
    )
    if progress is not None:
        progress.finish()
    return result


MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


def make_micro_batches(
    model: nn.Module, cfg: Config, step: int, device: torch.device
) -> MicroBatches:
    """This rank's cfg.accumulation_steps (inputs, labels) slices for optimizer step `step`."""
    rank, world, k = dist.get_rank(), dist.get_world_size(), cfg.accumulation_steps
    global_batch = cfg.global_batch(world)
    return [
        tuple(
            t.to(device)
            for t in rank_batch(model, global_batch, step * k + j, rank, world, cfg.seed)
        )
        for j in range(k)
    ]


def train_step(
    wrapped: nn.Module,
    micro_batches: MicroBatches,
    optimizer: torch.optim.Optimizer,
    finish: Callable[[], None],
) -> torch.Tensor:
    """One optimizer step over the micro-batches, with labelled spans for the profiler.
    Returns the last micro-batch's loss."""
    k = len(micro_batches)
    for j, (inputs, labels) in enumerate(micro_batches):
        # Wrappers without no_sync() (the first stages) synchronise every micro-batch.
        local = j < k - 1 and hasattr(wrapped, "no_sync")
        with wrapped.no_sync() if local else nullcontext():
            with record_function("forward"):
                loss = F.cross_entropy(wrapped(inputs), labels)
            with record_function("backward"):
                (loss / k).backward()  # the mean over all k micro-batches
        if not local:
            with record_function("finish gradient synchronization"):
                finish()
    with record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


class Tracing:
    """torch.profiler traces and TensorBoard scalars for one run, under
    <profile_dir>/<run name>: TensorBoard shows each run (stage) as one run, with one
    gzip'd trace per rank, and the same files open in Perfetto."""

    def __init__(self, cfg: Config, name: str, rank: int, device: torch.device):
        from torch.utils.tensorboard import SummaryWriter

        run_dir = Path(cfg.profile_dir) / name
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)  # kernels, NCCL too
        self.profiler = torch.profiler.profile(
            activities=activities,
            # Skip the warm-up steps (allocations, lazy init), then one step to warm up
            # the profiler itself, then trace.
            schedule=torch.profiler.schedule(
                skip_first=max(cfg.warmup_steps - 1, 0),
                wait=0,
                warmup=1,
                active=cfg.profile_steps,
                repeat=1,
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(run_dir), worker_name=f"rank{rank}", use_gzip=True
            ),
            record_shapes=True,
        )
        self.writer = SummaryWriter(str(run_dir / f"scalars-rank{rank}"))
        self.profiler.start()

    def step(self, step: int, loss: float, lr: float, step_s: float) -> None:
        self.profiler.step()
        self.writer.add_scalar("loss", loss, step)
        self.writer.add_scalar("learning rate", lr, step)
        self.writer.add_scalar("step time ms", step_s * 1e3, step)

    def close(self) -> None:
        self.profiler.stop()
        self.writer.close()


# --8<-- [start:determinism]
def set_determinism(cfg: Config, device: torch.device) -> None:
    """--deterministic: torch's deterministic algorithms, set before the first step. On a
    GPU, without them the CNN's parameters after 20 steps differ from one run to the
    next (some of cuDNN's convolution backward kernels add in an order that varies),
    so a resumed run cannot match an uninterrupted one bit for bit."""
    if cfg.deterministic:
        # cuBLAS is deterministic only with a fixed workspace, which torch checks for.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    elif cfg.checkpoint_dir and device.type == "cuda" and dist.get_rank() == 0:
        print(
            "note: on a GPU, a resumed run matches an uninterrupted one bit for bit only "
            "with --deterministic",
            file=sys.stderr,
            flush=True,
        )


# --8<-- [end:determinism]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stage_wrap(stage_cls: type[nn.Module]) -> Wrap:
    """Wrap with `stage_cls`, giving it the config's bucket cap if it has buckets (the
    first stage sends each gradient on its own). `--bucket-cap-mb auto` never gets here
    for a stage that does not measure its own: `parse_config` refuses it."""
    if "bucket_cap_mb" in keyword_options(stage_cls):
        return lambda model, cfg: stage_cls(model, bucket_cap_mb=cfg.bucket_cap_mb)
    return lambda model, cfg: stage_cls(model)


def keyword_options(stage_cls: type[nn.Module]) -> set[str]:
    """The keywords the class's constructor takes: its own, and those it passes on to the
    stage before it through `**options`, down the chain."""
    names: set[str] = set()
    for cls in stage_cls.__mro__:
        if "__init__" not in vars(cls):
            continue
        parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, module
        names |= {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break  # this constructor passes nothing further down
    return names


def torch_ddp_wrap(model: nn.Module, cfg: Config) -> nn.Module:
    device_ids = [model_device(model)] if model_device(model).type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb
    )


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def print_table(
    results: list[RunResult], cfg: Config, reference: str | None = None, buckets: bool = True
) -> None:
    """Rank 0 prints the table of `format_table`."""
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        # Every rank on this one machine: the ranks talk over loopback, not a network.
        loopback = os.environ.get("LOCAL_WORLD_SIZE", str(world)) == str(world)
        print(format_table(results, cfg, world, dist.get_backend(), reference, loopback, buckets))


def format_table(
    results: list[RunResult],
    cfg: Config,
    world: int,
    backend: str,
    reference: str | None = None,
    loopback: bool = True,
    buckets: bool = True,
) -> str:
    """The workload, then one row per run (median step time, its ratio to `reference`'s,
    whether the replicas are identical), then what the ratio means. `buckets`: whether the
    bucket cap applies to any run (the naive stage has none)."""
    base = next((r.median_step_s for r in results if r.name == reference), None)
    lines = [
        f"\nmodel={cfg.model} world={world} backend={backend} "
        f"global batch={cfg.global_batch(world) * cfg.accumulation_steps} per optimizer step "
        f"({cfg.accumulation_steps} micro-batch{'es' if cfg.accumulation_steps > 1 else ''} "
        f"of {cfg.global_batch(world)}) "
        + (f"bucket_cap_mb={cfg.bucket_cap_mb} " if buckets else "")
        + f"steps={cfg.steps} (median of the slowest rank per step)"
    ]
    # Every column as wide as its widest cell: run names differ in length (rebuilt_buckets).
    name_width = max(len("run"), *(len(r.name) for r in results))
    ratio = f"vs {reference}" if base else ""
    agree = "replicas identical"
    header = [f"{'run':<{name_width}}", f"{'step ms':>9}"] + ([ratio] if base else [])
    lines.append("  ".join([*header, agree]))
    for r in results:
        cells = [f"{r.name:<{name_width}}", f"{r.median_step_s * 1e3:>9.2f}"]
        if base:
            cells.append(f"{r.median_step_s / base:.2f}x".rjust(len(ratio)))
        identical = "n/a (no sync)" if r.name == "compute_only" else str(r.replicas_identical)
        lines.append("  ".join([*cells, identical.rjust(len(agree))]))
    if base:
        noise = " On loopback most such gaps are within noise:" if loopback else ""
        noise += " docs/benchmarks.md compares the stages on a shaped 1 Gbit network."
        lines.append(f"{ratio} = step ms / {reference}'s; below 1.00x is faster.{noise}")
    return "\n".join(lines)


def main(stage_cls: type[nn.Module], argv: list[str] | None = None) -> RunResult:
    """What `torchrun ... -m stages.<name>` runs: train, then report and check."""
    # stages/<name>.py (also when run as __main__), or stages/<name>/__init__.py (drop_in)
    path = Path(inspect.getfile(stage_cls))
    stage_name = path.parent.name if path.name == "__init__.py" else path.stem
    buckets = "bucket_cap_mb" in keyword_options(stage_cls)
    cfg = parse_config(
        argv,
        module=f"stages.{stage_name}",
        description=stage_description(stage_cls, stage_name),
        not_applicable={
            "runs": f"{stage_name} trains one run; --runs picks the main job's (python -m stages)"
        }
        | (
            {}
            if buckets
            else {"bucket_cap_mb": f"{stage_name} has no buckets, it all-reduces each gradient"}
        ),
        auto_bucket_cap=getattr(stage_cls, "measures_bucket_cap", False),
    )
    steady_heap()  # step times that do not hang on what the process freed before
    device = setup_process_group(cfg.backend, cfg.timeout)
    set_determinism(cfg, device)
    try:
        progress = Progress(runs=1, work=cfg.warmup_steps + cfg.steps)
        result = train(stage_name, stage_wrap(stage_cls), cfg, device, progress)
        print_table([result], cfg, buckets=buckets)
        if dist.get_rank() == 0:
            print(f"params sha256: {result.params_sha256}", flush=True)
        if not result.replicas_identical:
            raise SystemExit(f"rank {os.environ['RANK']}: replicas differ after training")
        return result
    finally:
        teardown_process_group()


def stage_description(stage_cls: type[nn.Module], stage_name: str) -> str:
    """--help's description: the stage module's first line and example command line."""
    doc = inspect.getmodule(stage_cls).__doc__ or ""
    paragraphs = doc.strip().split("\n\n")
    examples = [p for p in paragraphs if p.lstrip().startswith("torchrun")]
    return "\n\n".join([paragraphs[0], *examples, f"More: docs/stages/{stage_name}.md"])
