"""Backward's shape measured on a GPU: when each gradient of a model becomes ready.

    python -m profiling.simulate shape --model resnet50 --batch 112 \\
        --json docs/results/shape-resnet50-b112.json
    python -m profiling.simulate shape --model bert_large --batch 8 --optimizer adam \\
        --json docs/results/shape-bert_large-b8.json
    python -m profiling.simulate shape --model mypackage.models:build \\
        --input-shape 3,224,224 --batch 32 --json mine.json
    python -m profiling.simulate paper --shape docs/results/shape-resnet50-b112.json
    python -m profiling.simulate shape --compare   # each guess against these, no GPU

The simulator guesses backward's shape from FLOPs (`usermodel.flops_profile`). This
command measures it, on whatever GPU it runs on: the model built for real (a preset or
`MODULE:FACTORY`, untrained), a training step at the given batch, float32 with TF32 off
(the V100 and P100 have no TF32, and TF32 would shorten the matrix products against
everything else), timed with CUDA events (`usermodel.measure`): forward with the loss
(the sum of the model's outputs), backward with each gradient's ready time stamped by
its accumulate hook on the stream backward runs on, the optimizer's step. Each figure
is the median over --repeats steps after --warmup. Without CUDA it runs on the CPU with
wall clocks, which the tests use on small models; those figures say nothing about a GPU.
`presets.workload(..., shape=...)` keeps the published iteration time and the
optimizer's cost, and takes from the measurement forward's share and each gradient's
ready time as a fraction of backward.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from profiling.common import report
from profiling.common.report import command_line, markdown_table, produced_by
from profiling.simulate import presets, usermodel
from profiling.simulate.usermodel import Profile


@dataclass(frozen=True)
class Shape:
    """One model's step on one device: phase seconds and each gradient's ready time,
    seconds after backward starts, by parameter name."""

    model: str
    batch: int
    device: str
    forward_s: float
    backward_s: float
    optimizer_s: float
    ready_s: dict[str, float]

    def ready_fraction(self, name: str) -> float:
        return self.ready_s[name] / self.backward_s

    @property
    def forward_fraction(self) -> float:
        """Forward's share of forward and backward together."""
        return self.forward_s / (self.forward_s + self.backward_s)

    def profile(self, model: Profile) -> Profile:
        """`model`'s profile (its gradients) split as measured."""
        if set(self.ready_s) != set(model.names):
            unknown = sorted(set(self.ready_s) ^ set(model.names))[:3]
            raise ValueError(f"the shape's parameters are not the model's: {unknown} differ")
        fractions = {n: self.ready_fraction(n) for n in model.names}
        return replace(model, forward_fraction=self.forward_fraction,
                       ready_fraction=fractions, method="measured")  # fmt: skip


def split(shape: Shape, model: str) -> Profile:
    """A preset's profile split as `shape` measured it, for `presets.workload`."""
    if shape.model != model:
        raise ValueError(f"a shape measured on {shape.model} cannot split {model}'s iteration")
    return shape.profile(presets.profile(model))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument(
        "--model", default="resnet50", metavar="PRESET|MODULE:FACTORY",
        help="a preset or your model (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--input-shape", help="one sample's shape (a preset knows its own)")
    parser.add_argument("--batch-size", "--batch", dest="batch", type=int,
                        help="per GPU (default: the V100 preset's)")  # fmt: skip
    parser.add_argument(
        "--optimizer", choices=list(usermodel.OPTIMIZER_BYTES),
        help="(default: a preset's own, adam for BERT-large; else sgd)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20, help="timed steps (default: 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed before (default: 5)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (wall clocks)")
    parser.add_argument("--json", help="write the measurement here")
    parser.add_argument(
        "--compare", nargs="*", metavar="JSON",
        help="measure nothing: how far each way of guessing the ready times (`scale "
        "--ready`) is from these GPU measurements of the presets (default: the docs' own)",
    )  # fmt: skip
    parser.add_argument("--markdown", help="with --compare: write the table here")


def run(args: argparse.Namespace) -> None:
    if args.compare is not None:
        return print_comparison(args.compare, args.markdown)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU; pass --device cpu to time on the CPU")
    preset = args.model in presets.MODELS
    if not preset and (args.input_shape is None or args.batch is None):
        raise SystemExit(f"shape: --model {args.model} needs --input-shape and --batch")
    batch = args.batch or presets.COMPUTE[args.model, "V100"].batch
    spec, input_shape = presets.FACTORIES[args.model] if preset else (args.model, None)
    if args.input_shape:
        input_shape = usermodel.parse_input_shape(args.input_shape)
    optimizer = args.optimizer or presets.OPTIMIZERS.get(args.model, "sgd")
    shape = measure(spec, input_shape, batch, args.device, repeats=args.repeats,
                    warmup=args.warmup, optimizer=optimizer, name=args.model)  # fmt: skip
    device_name = (
        torch.cuda.get_device_name(torch.device(args.device))
        if args.device.startswith("cuda")
        else platform.processor() or platform.machine()
    )
    print(
        f"{args.model}, batch {batch} on {device_name}: forward {shape.forward_s * 1e3:.1f} ms, "
        f"backward {shape.backward_s * 1e3:.1f} ms, optimizer {shape.optimizer_s * 1e3:.1f} ms; "
        f"forward is {shape.forward_fraction:.1%} of forward and backward"
    )
    if args.json:
        data = shape.__dict__ | {"device_name": device_name, "torch": torch.__version__}
        data |= {"tf32": False, "repeats": args.repeats, "warmup": args.warmup}
        data["command"] = report.command_line("profiling.simulate")
        report.write_json(args.json, data)
        print(f"wrote {args.json}")


def measure(spec: str, input_shape, batch: int, device: str = "cuda", *, name: str = "",
            **kwargs) -> Shape:  # fmt: skip
    """`usermodel.measure` of the model `spec` names, TF32 off, as a `Shape`."""
    if batch < 1:
        raise ValueError(f"need batch >= 1, got {batch}")
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark)  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True  # as NVIDIA's training scripts run
    try:
        prof, t = usermodel.measure_spec(spec, input_shape, batch, device, **kwargs)
    finally:  # the process's own settings again
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = flags  # fmt: skip
    ready = {n: f * t.backward_s for n, f in prof.ready_fraction.items()}
    return Shape(name or spec, batch, device, t.forward_s, t.backward_s, t.optimizer_s, ready)


def load(path: str, flag: str = "--shape") -> Shape:
    """A measurement written by --json, with a clear error for a file that is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"{flag}: no such file: {path}") from None
    except ValueError:
        raise SystemExit(f"{flag}: {path} is not JSON") from None
    try:
        return Shape(
            model=data["model"], batch=int(data["batch"]), device=data["device"],
            forward_s=float(data["forward_s"]), backward_s=float(data["backward_s"]),
            optimizer_s=float(data["optimizer_s"]),
            ready_s={k: float(v) for k, v in data["ready_s"].items()},
        )  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise SystemExit(
            f"{flag}: {path} is not a measurement written by `shape --json` ({error!r})"
        ) from None


# ---------------------------------------------------------------------------------------
# How far each guess of the ready times is from a GPU's measurement.

DOCS_SHAPES = ("shape-resnet50-b112.json", "shape-bert_large-b8.json")


def comparison(shapes: list[Shape]) -> list[dict]:
    """Per measured shape of a preset and per method (`scale --ready`): forward's share,
    and the gap in ready fraction from the GPU's (median and largest over gradients)."""
    rows = []
    for measured in shapes:
        if measured.model not in presets.FACTORIES:
            raise SystemExit(f"--compare: {measured.model} is not a preset; the guesses are "
                             f"compared on {', '.join(presets.MODELS)}")  # fmt: skip
        spec, input_shape = presets.FACTORIES[measured.model]
        for method in usermodel.READY_METHODS:
            guess = usermodel.profile(spec, input_shape, method)
            gaps = [abs(guess.ready_fraction[n] - measured.ready_fraction(n))
                    for n in measured.ready_s]  # fmt: skip
            rows.append({
                "model": measured.model, "batch": measured.batch, "method": method,
                "forward_fraction": guess.forward_fraction,
                "gpu_forward_fraction": measured.forward_fraction,
                "ready_gap_median": statistics.median(gaps), "ready_gap_max": max(gaps),
            })  # fmt: skip
    return rows


def print_comparison(paths: list[str], markdown_path: str | None) -> None:
    docs = Path(__file__).resolve().parents[2] / "docs" / "results"
    shapes = [load(p, "--compare") for p in paths or [str(docs / name) for name in DOCS_SHAPES]]
    body = [
        [f"{r['model']} (batch {r['batch']})", f"--ready {r['method']}",
         f"{r['forward_fraction']:.0%} (GPU {r['gpu_forward_fraction']:.0%})",
         f"{r['ready_gap_median']:.3f}", f"{r['ready_gap_max']:.3f}"]
        for r in comparison(shapes)
    ]  # fmt: skip
    header = ["model", "ready times by", "forward's share", "gap median", "gap max"]
    text = produced_by([command_line("profiling.simulate")]) + "\n\n"
    text += markdown_table(header, body) + "\n"
    print(text)
    if markdown_path:
        Path(markdown_path).write_text(text)
        print(f"wrote {markdown_path}")
