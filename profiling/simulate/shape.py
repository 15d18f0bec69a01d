"""The backward's shape on a GPU: when each gradient of a preset model becomes ready.

    python -m profiling.simulate shape --model resnet50 --batch 112 \\
        --json docs/results/shape-resnet50-b112.json
    python -m profiling.simulate shape --model bert_large --batch 8 \\
        --json docs/results/shape-bert_large-b8.json
    python -m profiling.simulate paper --shape docs/results/shape-resnet50-b112.json \\
        --shape docs/results/shape-bert_large-b8.json

The paper presets (`presets.workload_from`) split one published iteration time by
assumption: forward a third and backward two thirds of what the optimizer leaves, and
each gradient ready when backward has done the FLOPs of the layers after it. This
command measures what the assumption guesses, on whatever GPU it runs on: the model
built for real (`presets.resnet50`, `presets.bert_large`, untrained), a training step
at the given batch, float32 with TF32 off (the V100 and P100 have no TF32, and TF32
would shorten the matrix products against everything else), timed with CUDA events:

- forward: the model and the loss (cross-entropy; BERT's two pre-training losses);
- backward: `loss.backward()`, and each gradient's ready time, an event recorded by a
  `register_post_accumulate_grad_hook` on the stream backward runs on, so it marks
  when the GPU has finished the gradient, not when the CPU queued its kernels;
- optimizer: SGD with momentum (ResNet-50) or Adam (BERT), as the presets cost them.

Each figure is the median over --repeats steps after --warmup. Each step starts on an
idle GPU (the clock waits for the step before), so forward includes the time the CPU
takes to launch its first kernels. Without CUDA it runs on
the CPU with wall clocks, which the tests use on small models; those figures say
nothing about a GPU. `presets.workload_from(..., shape=...)` then keeps the published
iteration time and the optimizer's cost, and takes from the measurement the
forward : backward ratio and each gradient's ready time as a fraction of backward.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

BERT_MASKED = 0.15  # the share of tokens the masked-LM loss scores (Devlin et al.)


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from profiling.simulate import presets

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument("--model", choices=list(presets.MODELS), default="resnet50")
    parser.add_argument("--batch", type=int, help="per GPU (default: the V100 preset's)")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (wall clocks)")
    parser.add_argument("--json", help="write the measurement here")


def run(args: argparse.Namespace) -> None:
    import platform

    import torch

    from profiling import report
    from profiling.simulate import presets

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU; pass --device cpu to time on the CPU")
    batch = args.batch or presets.COMPUTE[args.model, "V100"].batch
    shape = measure(args.model, batch, args.device, repeats=args.repeats, warmup=args.warmup)
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
        data = shape_to_json(shape)
        data |= {"device_name": device_name, "torch": torch.__version__, "tf32": False}
        data |= {"repeats": args.repeats, "warmup": args.warmup}
        data["command"] = report.command_line("profiling.simulate")
        report.write_json(args.json, data)
        print(f"wrote {args.json}")


def measure(
    model_name: str,
    batch: int,
    device: str = "cuda",
    *,
    repeats: int = 20,
    warmup: int = 5,
    bert_config=None,
    image_size: int = 224,
) -> Shape:
    """Time `repeats` training steps of a preset model (see the module's docstring)."""
    import torch

    if repeats < 1 or warmup < 0 or batch < 1:
        raise ValueError(
            f"need repeats >= 1, warmup >= 0, batch >= 1; got {repeats}, {warmup}, {batch}"
        )
    dev = torch.device(device)
    flags = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True  # as NVIDIA's training scripts run
    try:
        return _measure(model_name, batch, dev, repeats, warmup, bert_config, image_size)
    finally:  # the process's own settings again
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
        ) = flags


def _measure(model_name, batch, dev, repeats, warmup, bert_config, image_size) -> Shape:
    import torch

    from ddp.clock import DeviceClock
    from profiling.simulate import presets

    gen = torch.Generator(device="cpu").manual_seed(0)
    if model_name == "resnet50":
        model = presets.resnet50(str(dev))
        images = torch.randn(batch, 3, image_size, image_size, generator=gen).to(dev)
        labels = torch.randint(0, 1000, (batch,), generator=gen).to(dev)

        def loss_of() -> torch.Tensor:
            return torch.nn.functional.cross_entropy(model(images), labels)

        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif model_name == "bert_large":
        cfg = bert_config or presets.BertConfig()
        model = presets.bert_large(cfg, str(dev))
        shape = (batch, cfg.seq_len)
        ids = torch.randint(0, cfg.vocab, shape, generator=gen).to(dev)
        types = (torch.arange(cfg.seq_len) >= cfg.seq_len // 2).long().expand(shape).to(dev)
        scored = torch.rand(shape, generator=gen) < BERT_MASKED
        token_labels = torch.where(scored, torch.randint(0, cfg.vocab, shape, generator=gen), -100)
        token_labels, next_labels = token_labels.to(dev), torch.randint(0, 2, (batch,)).to(dev)

        def loss_of() -> torch.Tensor:
            scores, next_scores = model(ids, types)
            masked = torch.nn.functional.cross_entropy(
                scores.reshape(-1, cfg.vocab), token_labels.reshape(-1), ignore_index=-100
            )
            return masked + torch.nn.functional.cross_entropy(next_scores, next_labels)

        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        raise ValueError(f"no model preset {model_name!r}; pick one of {', '.join(presets.MODELS)}")
    model.train()

    clock = DeviceClock(dev)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    marks: dict[str, object] = {}
    for name, parameter in named:
        parameter.register_post_accumulate_grad_hook(
            lambda _, name=name: marks.update({name: clock.mark()})
        )
    steps = []
    for step in range(warmup + repeats):
        marks.clear()
        start = clock.mark()
        loss = loss_of()
        backward_start = clock.mark()
        loss.backward()
        backward_end = clock.mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = clock.mark()
        clock.wait()
        missing = [n for n, _ in named if n not in marks]
        if missing:
            raise RuntimeError(f"parameters {missing[:3]} of {model_name} got no gradient")
        if step >= warmup:
            steps.append(
                (
                    clock.seconds(start, backward_start),
                    clock.seconds(backward_start, backward_end),
                    clock.seconds(backward_end, end),
                    {n: clock.seconds(backward_start, marks[n]) for n, _ in named},
                )
            )
    return Shape(
        model=model_name,
        batch=batch,
        device=str(dev),
        forward_s=statistics.median(s[0] for s in steps),
        backward_s=statistics.median(s[1] for s in steps),
        optimizer_s=statistics.median(s[2] for s in steps),
        ready_s={n: statistics.median(s[3][n] for s in steps) for n, _ in named},
    )


def shape_to_json(shape: Shape) -> dict:
    return {
        "model": shape.model,
        "batch": shape.batch,
        "device": shape.device,
        "forward_s": shape.forward_s,
        "backward_s": shape.backward_s,
        "optimizer_s": shape.optimizer_s,
        "ready_s": shape.ready_s,
    }


def shape_from_json(data: dict) -> Shape:
    return Shape(
        model=data["model"],
        batch=int(data["batch"]),
        device=data["device"],
        forward_s=float(data["forward_s"]),
        backward_s=float(data["backward_s"]),
        optimizer_s=float(data["optimizer_s"]),
        ready_s={k: float(v) for k, v in data["ready_s"].items()},
    )


def load(path: str) -> Shape:
    """A measurement written by --json, with a clear error for a file that is not one."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"--shape: no such file: {path}") from None
    except ValueError:
        raise SystemExit(f"--shape: {path} is not JSON") from None
    try:
        return shape_from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise SystemExit(
            f"--shape: {path} is not a measurement written by `shape --json` ({error!r})"
        ) from None
