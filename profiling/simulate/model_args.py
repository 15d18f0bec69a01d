"""What every command asks about the model: `--model` (a preset or yours), its input,
batch and one GPU's iteration, turned into a `Workload` with the lines that say where
each number came from (`usermodel` for a model of yours, `presets` for the published).
"""

from __future__ import annotations

import argparse

import torch

from profiling.simulate import presets
from profiling.simulate.usermodel import (
    DTYPE_BYTES,
    FLOPS_METHOD,
    MEASURED_METHOD,
    OPTIMIZER_BYTES,
    READY_METHODS,
    measure_spec,
    parse_input_shape,
    profile,
    workload,
)


def add_arguments(parser: argparse.ArgumentParser, default: str | None = "resnet50") -> None:
    add = parser.add_argument_group("model (a preset, or yours: MODULE:FACTORY)").add_argument
    # fmt: off
    add("--model", default=default, metavar="PRESET|MODULE:FACTORY",
        help=f"a preset ({', '.join(presets.MODELS)}) or any importable callable that returns "
        "an nn.Module (default: %(default)s)")
    add("--input-shape", metavar="C,H,W|SEQ",
        help="one sample's shape (3,224,224), or a token model's sequence length (512)")
    add("--batch-size", type=int, help="samples per GPU per iteration")
    add("--iteration-ms", type=float,
        help="one GPU's measured forward + backward + optimizer at --batch-size, ms (default: "
        "a preset's published figure on its GPU; else measured here if a GPU is present)")
    add("--dtype", choices=list(DTYPE_BYTES), default="fp32",
        help="the gradients' dtype, which sets their bytes (default: %(default)s)")
    add("--ready", choices=READY_METHODS, default="flops",
        help="when each gradient is ready: backward's FLOPs on the meta device (grouped "
        "convolutions counted per group), or a few steps timed on this CPU, with progress on "
        "stderr (default: %(default)s)")
    add("--optimizer", choices=list(OPTIMIZER_BYTES),
        help="whose memory traffic sets the optimizer's time (default: a preset's own, "
        "else sgd)")
    # fmt: on


def from_args(args: argparse.Namespace, gpu: str, memory_bytes_per_s: float):
    """(Workload, lines describing it with their sources, settings for the JSON) of
    `--model` on one `gpu`."""
    for flag in ("batch_size", "iteration_ms"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {value:g}")
    preset = args.model in presets.MODELS
    spec, input_shape = presets.FACTORIES[args.model] if preset else (args.model, None)
    if args.input_shape is not None:
        input_shape = parse_input_shape(args.input_shape)
    optimizer = args.optimizer or presets.OPTIMIZERS.get(args.model, "sgd")
    # A preset's published iteration holds only for its own batch and input.
    published = presets.COMPUTE.get((args.model, gpu)) if preset else None
    if preset and input_shape != presets.FACTORIES[args.model][1] or args.iteration_ms:
        published = None
    if published and args.batch_size not in (None, published.batch):
        raise ValueError(f"--batch-size {args.batch_size}: {args.model}'s published iteration is "
                         f"at batch {published.batch}; give --iteration-ms at yours")  # fmt: skip
    on_gpu = args.iteration_ms is None and published is None and torch.cuda.is_available()
    missing = [f for f, v in (("input_shape", input_shape),
                              ("batch_size", args.batch_size or published),
                              ("iteration_ms", args.iteration_ms or published or on_gpu))
               if not v]  # fmt: skip
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        why = f" no published iteration of {args.model} on the {gpu} here;" if preset else ""
        raise ValueError(f"--model {args.model}:{why} give {flags}")
    if on_gpu:  # one GPU's iteration, measured here, and its ready times with it
        prof, timing = measure_spec(spec, input_shape, args.batch_size, "cuda",
                                    repeats=10, warmup=3, optimizer=optimizer)  # fmt: skip
        iteration_s = timing.forward_s + timing.backward_s + timing.optimizer_s
        optimizer_s, batch = timing.optimizer_s, args.batch_size
        source = ready = f"measured on this machine's {torch.cuda.get_device_name()}, in float32"
        optimizer_source = source
    else:
        if preset and args.ready == "flops" and input_shape == presets.FACTORIES[args.model][1]:
            prof = presets.profile(args.model)
        else:
            prof = profile(spec, input_shape, args.ready)
        iteration_s = published.iteration_s if published else args.iteration_ms * 1e-3
        batch = published.batch if published else args.batch_size
        source = published.source if published else "--iteration-ms, --batch-size"
        optimizer_s = prof.parameters * OPTIMIZER_BYTES[optimizer] / memory_bytes_per_s
        optimizer_source = (f"{optimizer}: {OPTIMIZER_BYTES[optimizer]} B per parameter at "
                            f"the {gpu}'s memory bandwidth")  # fmt: skip
        ready = MEASURED_METHOD if prof.method == "measured" else FLOPS_METHOD
    w = workload(prof, iteration_s, optimizer_s, args.dtype)
    lines = [
        f"model {args.model}: {len(prof.names)} gradients, {prof.parameters:,} parameters, "
        f"{sum(g.nbytes for g in w.grads) / 2**20:.1f} MiB in {args.dtype}  "
        f"[{'preset' if preset else 'built on meta'}]",
        f"  iteration {iteration_s * 1e3:.1f} ms at batch {batch} per GPU  [{source}]",
        f"  optimizer {optimizer_s * 1e3:.2f} ms  [{optimizer_source}]",
        f"  forward {w.forward_s * 1e3:.1f} ms, backward {w.backward_s * 1e3:.1f} ms, "
        f"ready times  [{ready}]",
    ]
    settings = {"model": args.model, "batch_per_gpu": batch, "ready": ready,
                "dtype": args.dtype, "iteration_source": source}  # fmt: skip
    return w, lines, settings
