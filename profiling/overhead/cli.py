"""What each DDP wrapper adds to the time of a training step on CPU, over the bare model.

    python -m profiling.overhead                      # 1 and 2 ranks, every variant
    python -m profiling.overhead --nproc 2 --variants drop_in --rounds 30 --json out.json
    python -m profiling.overhead --model resnet50 --backend nccl --nproc 1 --variants drop_in

Measured for the bare model (`bare`, no wrapper: the baseline), every stage of
`stages.STAGES` (naive ... drop_in) and torch's own DistributedDataParallel
(`torch_ddp`, the reference), each with its default options and the 25 MiB bucket cap,
at each world size of --nproc. The workload is all overhead and little compute: many
small parameters (--blocks blocks of Linear(W, W) + LayerNorm(W), 4 parameters each,
and a Linear(W, W) head: 194 parameters by default), a batch of 8 per rank, MSE loss
on random data, SGD. What a wrapper does per parameter (hooks, bucket bookkeeping,
Python) is then most of what it adds, and the all-reduce of 0.2 MB is cheap.

Method. One process per rank, spawned here (Gloo over 127.0.0.1, a store on a free
port, one intra-op thread per rank). Each variant wraps its own copy of the same
initial model, and all see the same batches, made once. Every variant first runs one
untimed block (lazy initialisation, torch's bucket rebuild after its first step). Then
--rounds rounds: in each, every variant runs --warmup untimed steps and --steps timed
ones, in an order rotated by one each round, so that a slow spell of the shared machine
falls on every variant alike; at 2 or more ranks the timed block starts at a barrier.
A block is timed with time.perf_counter on the main thread, and its time per step is
the block's / --steps; at several ranks, the slowest rank's. The main thread's CPU time
(time.thread_time) is measured alike: what it adds over bare (the table's last column,
and the last stage's ratio under the table) leaves out the time spent waiting, for
Gloo's threads or the other rank, and so varies less at 2 ranks on a busy machine.

Reported, from rank 0: per variant the median over rounds of its time per step;
"added" = the variant's time per step minus bare's in the same round (paired, so both
share that round's noise), as the median over rounds and the min-max range; the same
per parameter; and the ratio of a variant's added time to torch_ddp's, per round, as
the median and range over rounds (rounds where torch_ddp added nothing measurable are
left out of the ratio and counted); and each variant's step time over torch_ddp's in
the same round (median and range), which is what a GPU user pays. With the defaults,
both world sizes take about 1-2 minutes on 2 cores. Nothing is written but --json and --markdown.

On a GPU (--backend nccl, one GPU per rank), --model resnet50 or gpt2_small times
models of those sizes (`profiling.common.sized_models`) instead: there a wrapper's CPU time
hides behind the GPU's work unless it delays the kernels, and the step ratio says
whether it does. A block is timed from a synchronised GPU to a synchronised GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from ddp.config import Config
from ddp.dist import replicas_identical, setup_process_group, teardown_process_group
from ddp.heap import steady_heap
from ddp.progress import Progress
from ddp.train import Wrap, torch_ddp_wrap
from profiling.common.report import command_line, load_average, machine, write_json
from profiling.common.sized_models import SIZED, example_batch, loss_of
from profiling.overhead.tables import (
    BARE,
    REFERENCE,
    format_table,
    markdown,
    ranks,
    world_result,
)
from stages import STAGES, standard_runs

SMALL = "small"  # the many-small-parameters model: the default workload
LR = 1e-3  # small: the model changes little over a run, and nothing diverges
SEED = 0


def build_model(blocks: int, width: int) -> nn.Module:
    """`blocks` x (Linear(width, width), LayerNorm(width)), then a Linear(width, width)
    head: 4 * blocks + 2 parameters, all small, the same on every rank (seeded)."""
    torch.manual_seed(SEED)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, width))


def stage_names() -> list[str]:
    """The stages, simplest first."""
    return list(STAGES)


def variant_order(chosen: list[str], stages: list[str]) -> list[str]:
    """bare, the chosen stages in stage order, then torch_ddp: the baseline and the
    reference always run, since every figure is relative to them."""
    return [BARE, *(s for s in stages if s in chosen), REFERENCE]


# --- on every rank -------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, settings: dict, out: str) -> None:
    """One rank: join the group through the parent's store, time every variant, and (on
    rank 0) write the slowest rank's times to the JSON file `out`."""
    # As torchrun describes a rank, with the parent's store as the agent's: all ranks are
    # its clients, so no rank has to bind a port that another process may have taken.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )  # fmt: skip
    loopback = _loopback_interface()
    if loopback:  # Gloo's own connections on 127.0.0.1 too, not the host's address
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    torch.set_num_threads(1)  # the ranks share the machine's few cores
    steady_heap()  # a variant's step must not cost more for what another freed before it
    setup_process_group(settings["backend"])
    try:
        record = time_variants(settings)
        if rank == 0:
            write_json(out, record)
    finally:
        teardown_process_group()


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n in ("lo", "lo0")), None)


def time_variants(settings: dict) -> dict:
    """Build every variant, run the interleaved rounds; return per round and variant the
    slowest rank's wall and main-thread CPU seconds per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = settings["variants"]
    wraps = variant_wraps(names)
    cfg = Config()  # the stages' defaults, the 25 MiB bucket cap among them
    device = torch.device("cuda", torch.cuda.current_device()) if settings["backend"] == "nccl" \
        else torch.device("cpu")  # fmt: skip
    base = build_workload(settings).to(device)
    variants = []
    for name in names:
        model = copy.deepcopy(base)  # each its own copy of the same initial model
        wrapped = model if wraps[name] is None else wraps[name](model, cfg)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)

        # naive and bucketed all-reduce here; the later stages did it inside backward
        # and only check; bare and torch_ddp have none.
        finish = getattr(wrapped, "finish_gradient_synchronization", None)
        variants.append((name, model, wrapped, optimizer, finish))

    # Fixed batches, this rank's own, made once: none of it is timed.
    gen = torch.Generator().manual_seed(SEED * 1000 + 1 + rank)
    batches = [make_batch(settings, device, gen) for _ in range(settings["steps"])]
    loss = _loss_function(settings["model"])
    warm = [batches[i % len(batches)] for i in range(settings["warmup"])]

    rounds, n, k = settings["rounds"], len(variants), settings["steps"]
    progress = Progress(rounds + 1, (rounds + 1) * n)
    progress.start(f"{ranks(world)}: first block of each variant, untimed", n, unit="variant")
    for name, _, wrapped, optimizer, finish in variants:
        started = time.perf_counter()
        train_steps(wrapped, optimizer, finish, warm + batches, loss)
        progress.step(time.perf_counter() - started, detail=name)
    progress.finish()

    seconds = torch.zeros(2, rounds, n, dtype=torch.float64)  # wall, cpu
    started = time.perf_counter()
    for r in range(rounds):
        progress.start(f"{ranks(world)}: round {r + 1}/{rounds}", n, unit="variant")
        for i in [(j + r) % n for j in range(n)]:  # rotated by one each round
            name, _, wrapped, optimizer, finish = variants[i]
            train_steps(wrapped, optimizer, finish, warm, loss)
            if world > 1:
                dist.barrier()  # start together: no rank's block absorbs another's lag
            _synchronize(device)
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            train_steps(wrapped, optimizer, finish, batches, loss)
            _synchronize(device)  # the block's GPU work done, not only queued
            cpu1, wall1 = time.thread_time(), time.perf_counter()
            seconds[0, r, i], seconds[1, r, i] = (wall1 - wall0) / k, (cpu1 - cpu0) / k
            progress.step(wall1 - wall0, detail=name)  # shown as ms per variant's block
        progress.finish()
    elapsed = time.perf_counter() - started
    # the slowest rank's, per round and variant
    seconds_on = seconds.to(device)  # NCCL sends device tensors only
    dist.all_reduce(seconds_on, op=dist.ReduceOp.MAX)
    seconds = seconds_on.cpu()

    # The wrappers must still keep the replicas identical (bare trains each on its own).
    identical = {name: replicas_identical(model) for name, model, *_ in variants if name != BARE}
    wall, cpu = seconds.tolist()
    return {
        "parameters": len(list(base.parameters())),
        "elements": sum(p.numel() for p in base.parameters()),
        "wall_s": {name: [wall[r][i] for r in range(rounds)] for i, name in enumerate(names)},
        "cpu_s": {name: [cpu[r][i] for r in range(rounds)] for i, name in enumerate(names)},
        "replicas_identical": identical,
        "threads_per_rank": torch.get_num_threads(),
        "elapsed_s": elapsed,
    }


def build_workload(settings: dict) -> nn.Module:
    """The model every variant copies: the small-parameter blocks, or a sized model."""
    if settings["model"] == SMALL:
        return build_model(settings["blocks"], settings["width"])
    torch.manual_seed(SEED)
    return SIZED[settings["model"]]()


def make_batch(
    settings: dict, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    if settings["model"] == SMALL:
        shape = (settings["batch_size"], settings["width"])
        return torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(
            device
        )
    return example_batch(settings["model"], settings["batch_size"], device, gen)


def _loss_function(model: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if model == SMALL:
        return F.mse_loss
    return lambda output, targets: loss_of(model, output, targets)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def variant_wraps(names: list[str]) -> dict[str, Wrap | None]:
    """Name -> wrap(model, cfg), as the stages' runs and the benchmark build them
    (`stages.standard_runs`: `ddp.train.stage_wrap`, `torch_ddp_wrap`); None for bare."""
    runs = {REFERENCE: torch_ddp_wrap}
    if any(n not in (BARE, REFERENCE) for n in names):
        runs = standard_runs()
    return {n: None if n == BARE else runs[n] for n in names}


def train_steps(
    wrapped: nn.Module,
    optimizer: torch.optim.Optimizer,
    finish: Callable[[], None] | None,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.mse_loss,
) -> None:
    """One optimizer step per (inputs, targets): forward, `loss`, backward, the wrapper's
    finish (if it has one), SGD, zero_grad."""
    for inputs, targets in batches:
        loss(wrapped(inputs), targets).backward()
        if finish is not None:
            finish()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# --- in the parent -----------------------------------------------------------------------


def measure(world: int, settings: dict) -> dict:
    """Spawn `world` ranks, each timing every variant; rank 0's record."""
    # The store the ranks meet at, on a port the OS picks: held here for the run's length.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # Back through a file, not a queue: a record larger than a pipe holds would block
    # rank 0 in put() while the parent waits for it to exit.
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "record.json")
        mp.spawn(_worker, args=(world, store.port, settings, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be >= 1")
    return values


def positive(text: str) -> int:
    (value,) = positive_ints(text)
    return value


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every option's help (an empty one as "off"); the description as
    written (it holds command lines)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default == "":
            return f"{action.help} (default: off)"
        return super()._get_help_string(action)


def parse_args(argv: list[str]) -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(
        prog="python -m profiling.overhead",
        description="\n\n".join(doc[:2])
        + "\n\nWith the defaults: about 1-2 minutes on 2 cores (1 and 2 ranks).",
        formatter_class=_Formatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add(
        "--nproc",
        type=positive_ints,
        default="1,2",
        metavar="N,N",
        help="world sizes to measure, comma-separated, one after the other",
    )
    add(
        "--rounds",
        type=positive,
        default=15,
        metavar="N",
        help="interleaved rounds per world size; the defaults take about 1-2 min on 2 cores",
    )
    add("--steps", type=positive, default=10, metavar="N", help="timed steps per variant per round")
    add(
        "--warmup",
        type=int,
        default=2,
        metavar="N",
        help="untimed steps per variant before each timed block",
    )
    add(
        "--variants",
        default="all",
        metavar="NAMES",
        help=f"comma-separated stages (or all); {BARE} and {REFERENCE} always run",
    )
    add(
        "--blocks",
        type=positive,
        default=48,
        metavar="N",
        help="Linear + LayerNorm blocks (4 parameters each; a Linear head after them)",
    )
    add("--width", type=positive, default=32, metavar="N", help="features of every layer")
    add(
        "--model",
        choices=[SMALL, *SIZED],
        default=SMALL,
        help=f"{SMALL}: the blocks above; resnet50 or gpt2_small: models of those sizes, for a "
        "GPU (with --backend nccl)",
    )
    add(
        "--batch-size",
        type=positive,
        default=None,
        metavar="N",
        help=f"samples per rank per step (default: 8 for {SMALL} and gpt2_small, whose samples "
        "are 512 tokens; 32 for resnet50, as torch's DDP benchmark)",
    )
    add(
        "--backend",
        choices=["gloo", "nccl"],
        default="gloo",
        help="nccl: one GPU per rank, every model and batch on it",
    )
    add(
        "--json",
        default="",
        metavar="FILE",
        help="write every result here as JSON",
    )
    add("--markdown", default="", metavar="FILE", help="write the docs' table here")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.batch_size is None:
        args.batch_size = 32 if args.model == "resnet50" else 8
    if args.backend == "nccl" and not torch.cuda.is_available():
        parser.error("--backend nccl needs CUDA, which this torch does not see; use gloo")
    if args.backend == "nccl" and max(args.nproc) > torch.cuda.device_count():
        parser.error(f"--backend nccl needs a GPU per rank: --nproc {max(args.nproc)} on "
                     f"{torch.cuda.device_count()} GPU(s)")  # fmt: skip
    stages = stage_names()
    chosen = stages if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in chosen if n not in [BARE, *stages, REFERENCE]]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; pick from {[*stages, REFERENCE]}")
    args.variant_list = variant_order(chosen, stages)
    args.stages = stages
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    python = sys.executable
    if Path(python).is_relative_to(Path.cwd()):
        python = os.path.relpath(python)  # `.venv/bin/python`, as typed
    settings = {
        "variants": args.variant_list, "rounds": args.rounds, "steps": args.steps,
        "warmup": args.warmup, "blocks": args.blocks, "width": args.width,
        "batch_size": args.batch_size, "model": args.model, "backend": args.backend,
    }  # fmt: skip
    host = machine()
    load_before = load_average()  # before our own ranks get busy
    gpu = f", {torch.cuda.get_device_name()}" if args.backend == "nccl" else ""
    print(f"machine: {host['cpu']}, {host['usable_cores']} of {host['cores']} cores usable, "
          f"torch {host['torch']}{gpu}, backend {args.backend} over 127.0.0.1, 1 thread per "
          f"rank; load average {load_before}")  # fmt: skip
    model = build_workload(settings)
    params = sum(1 for _ in model.parameters())
    elements = sum(p.numel() for p in model.parameters())
    cap = Config().bucket_cap_mb  # every wrapper's, as the stages' runs give it
    shape = (
        f"{args.blocks} x (Linear({args.width}, {args.width}) + LayerNorm({args.width})) "
        "+ Linear head, MSE"
        if args.model == SMALL
        else f"{args.model}, cross-entropy"
    )
    print(f"workload: {shape}; {params} parameters ({elements / 1e6:.1f}M elements); batch "
          f"{args.batch_size} per rank, SGD(lr={LR}); bucket cap {cap:g} MiB")  # fmt: skip
    print(f"method: {args.rounds} rounds x ({args.warmup} untimed + {args.steps} timed steps) "
          "per variant, order rotated each round; variants: "
          + ", ".join(args.variant_list))  # fmt: skip
    sys.stdout.flush()  # before the ranks' progress on stderr
    last = next((s for s in reversed(args.stages) if s in args.variant_list), None)
    results = {}
    for world in args.nproc:
        started = time.perf_counter()
        record = measure(world, settings)
        result = world_result(world, record, time.perf_counter() - started)
        results[str(world)] = result
        print(format_table(result, args.rounds, last), flush=True)
        differ = [n for n, ok in record["replicas_identical"].items() if ok is False]
        if differ:
            print(f"warning: replicas differ after the run at {ranks(world)} for {differ}")
    command = command_line("profiling.overhead", argv, python=shlex.quote(python))
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, command, host, args.rounds))
    if args.json:
        write_json(args.json, {
            # threads_per_rank: what every rank sets, whatever the parent has
            "command": command,
            "machine": {**machine(), "threads_per_rank": 1, "load_average_before": load_before},
            "settings": {**settings, "nproc": args.nproc, "lr": LR, "bucket_cap_mb": cap,
                         "parameters": params},
            "results": results,
        })  # fmt: skip


if __name__ == "__main__":
    main()
