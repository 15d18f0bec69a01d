"""Published numbers the scaling model starts from: the gradients of ResNet-50 and
BERT-large, what one training iteration of each takes on one GPU, and the two papers'
clusters. Each number says where it comes from; the ones no source here gives are
marked ASSUMED, with the reason.

A model is a list of `Layer`s in forward order: the parameters each holds and the
floating-point operations its forward pass does per sample. A `Workload` for
`schedule.simulate` follows from it and one measured iteration time:

- the iteration splits into optimizer (the bytes its update reads and writes, at the
  GPU's memory bandwidth), forward (a third of the rest) and backward (two thirds):
  backward computes two products per forward product, the gradient with respect to
  the input and to the weights (ASSUMED: the usual FLOP count, not a measurement);
- backward runs the layers in reverse and frees a layer's gradients when it is done
  with it; each layer takes a share of backward in proportion to its forward FLOPs.
  So a gradient is ready at backward_s x (FLOPs of the layers from the last up to and
  including its own) / (all FLOPs). Only convolutions and matrix products are
  counted: BatchNorm, LayerNorm, activations, pooling and softmax are memory-bound
  and cost time the FLOP count does not see, so the ready times are approximate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from profiling.simulate.schedule import Grad, Workload
from profiling.simulate.shape import Shape
from profiling.simulate.topology import GB, GBIT, Topology

FLOAT32_BYTES = 4  # both papers' gradients: float32 (DDP all-reduces the .grad dtype)


@dataclass(frozen=True)
class Layer:
    """One operation in forward order: the parameters it holds (name, elements), and
    its forward FLOPs per sample (a multiply-add is two)."""

    name: str
    params: tuple[tuple[str, int], ...]
    flops: float


# ---------------------------------------------------------------------------------------
# ResNet-50: torchvision's definition (v1.5: the stride on the 3x3 convolution), written
# in plain torch because torchvision's wheels on the package index are CUDA builds. The
# parameter names are torchvision's; tests/test_simulate_presets.py checks the count
# against torchvision's documented 25,557,032 and the FLOPs against its 4.09 GFLOPS
# (torchvision's model table counts multiply-adds, as "GFLOPS").


def resnet50(device: str = "meta"):
    """torchvision.models.resnet50(), untrained, built on `device` (meta: shapes only)."""
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int):
            super().__init__()
            cout = width * 4
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            identity = x if self.downsample is None else self.downsample(x)
            return self.relu(out + identity)

    class ResNet50(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin = 64
            for i, (width, blocks, stride) in enumerate(
                [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)], start=1
            ):
                layer = []
                for b in range(blocks):
                    layer.append(Bottleneck(cin, width, stride if b == 0 else 1))
                    cin = width * 4
                setattr(self, f"layer{i}", nn.Sequential(*layer))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(2048, 1000)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    with torch.device(device):
        return ResNet50()


@cache  # a tuple of frozen layers: each caller gets the same, none can change it
def resnet50_layers(image_size: int = 224) -> tuple[Layer, ...]:
    """ResNet-50's parameter-holding modules in the order forward runs them, with their
    FLOPs for one image: found by running forward on a meta tensor (shapes, no data)."""
    import torch
    from torch import nn

    model = resnet50()
    layers: list[Layer] = []

    def record(module, inputs, output):
        if isinstance(module, nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels
            flops = 2 * k // module.groups * output.shape[1:].numel()
        elif isinstance(module, nn.Linear):
            flops = 2 * module.in_features * module.out_features
        else:  # BatchNorm: memory-bound, left out (see the module's docstring)
            flops = 0
        name = names[module]
        params = tuple((f"{name}.{p}", t.numel()) for p, t in module.named_parameters())
        layers.append(Layer(name, params, float(flops)))

    names = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)):
            names[module] = name
            module.register_forward_hook(record)
    model(torch.empty(1, 3, image_size, image_size, device="meta"))
    return tuple(layers)


# ---------------------------------------------------------------------------------------
# BERT-large: the configuration of Devlin et al., "BERT" (arXiv 1810.04805), section 3:
# L = 24 layers, H = 1024, A = 16 heads, feed-forward 4H = 4096; the released
# bert-large-uncased config (vocabulary 30522, 512 positions, 2 token types). With the
# pre-training heads of Hugging Face's BertForPreTraining (the masked-LM head, whose
# decoder weight is the word embedding's, and the next-sentence head).


@dataclass(frozen=True)
class BertConfig:
    layers: int = 24
    hidden: int = 1024
    heads: int = 16
    ffn: int = 4096
    vocab: int = 30522
    positions: int = 512
    token_types: int = 2
    seq_len: int = 128  # the sequence length of the timing below (phase 1 of pre-training)


@cache
def bert_large_layers(cfg: BertConfig = BertConfig()) -> tuple[Layer, ...]:
    """BERT-large for pre-training, in forward order, FLOPs for one sequence."""
    h, s = cfg.hidden, cfg.seq_len

    def linear(name: str, d_in: int, d_out: int, tokens: int = s) -> Layer:
        return Layer(name, ((f"{name}.weight", d_out * d_in), (f"{name}.bias", d_out)),
                     2.0 * d_in * d_out * tokens)  # fmt: skip

    def norm(name: str) -> Layer:
        return Layer(name, ((f"{name}.weight", h), (f"{name}.bias", h)), 0.0)

    e = "bert.embeddings"
    layers = [
        Layer(f"{e}.word_embeddings", ((f"{e}.word_embeddings.weight", cfg.vocab * h),), 0.0),
        Layer(f"{e}.position_embeddings", ((f"{e}.position_embeddings.weight", cfg.positions * h),), 0.0),  # noqa: E501
        Layer(f"{e}.token_type_embeddings", ((f"{e}.token_type_embeddings.weight", cfg.token_types * h),), 0.0),  # noqa: E501
        norm(f"{e}.LayerNorm"),
    ]  # fmt: skip
    for i in range(cfg.layers):
        a = f"bert.encoder.layer.{i}"
        layers += [linear(f"{a}.attention.self.{qkv}", h, h) for qkv in ("query", "key", "value")]
        # Scores Q K^T and their use on V: 2 x (s x s x h) multiply-adds, no parameters.
        layers.append(Layer(f"{a}.attention.scores", (), 2.0 * 2 * s * s * h))
        layers += [
            linear(f"{a}.attention.output.dense", h, h),
            norm(f"{a}.attention.output.LayerNorm"),
            linear(f"{a}.intermediate.dense", h, cfg.ffn),
            linear(f"{a}.output.dense", cfg.ffn, h),
            norm(f"{a}.output.LayerNorm"),
        ]
    layers.append(linear("bert.pooler.dense", h, h, tokens=1))  # the [CLS] token only
    p = "cls.predictions"
    layers += [
        linear(f"{p}.transform.dense", h, h),
        norm(f"{p}.transform.LayerNorm"),
        # The decoder: the word embedding's weight again (tied: one gradient, counted
        # once, above) and a bias of its own; Hugging Face scores every token.
        Layer(f"{p}.decoder", ((f"{p}.bias", cfg.vocab),), 2.0 * h * cfg.vocab * s),
        linear("cls.seq_relationship", h, 2, tokens=1),
    ]
    return tuple(layers)


def bert_large(cfg: BertConfig = BertConfig(), device: str = "meta"):
    """BERT-large for pre-training as a module, untrained, on `device`: the layers above
    with Hugging Face's `BertForPreTraining` parameter names, for timing its backward
    (`profiling.simulate.shape`). Dropout 0.1 and GELU as the released configuration;
    attention by `F.scaled_dot_product_attention`, no padding mask."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    h, drop = cfg.hidden, 0.1

    def block(**modules: nn.Module) -> nn.Module:  # a module that only names its children
        named = nn.Module()
        for name, module in modules.items():
            named.add_module(name, module)
        return named

    def dense_norm(d_in: int) -> nn.Module:  # a dense layer, LayerNorm of the residual sum
        return block(dense=nn.Linear(d_in, h), LayerNorm=nn.LayerNorm(h))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = block(
                embeddings=block(
                    word_embeddings=nn.Embedding(cfg.vocab, h),
                    position_embeddings=nn.Embedding(cfg.positions, h),
                    token_type_embeddings=nn.Embedding(cfg.token_types, h),
                    LayerNorm=nn.LayerNorm(h),
                ),
                encoder=block(layer=nn.ModuleList(encoder_layer() for _ in range(cfg.layers))),
                pooler=block(dense=nn.Linear(h, h)),
            )
            self.cls = block(
                predictions=block(
                    transform=block(dense=nn.Linear(h, h), LayerNorm=nn.LayerNorm(h))
                ),
                seq_relationship=nn.Linear(h, 2),
            )
            # The decoder's weight is the word embedding's (tied); its bias is its own.
            self.cls.predictions.bias = nn.Parameter(torch.zeros(cfg.vocab))

        def forward(self, ids: torch.Tensor, types: torch.Tensor):
            e = self.bert.embeddings
            positions = torch.arange(ids.shape[1], device=ids.device)
            x = e.word_embeddings(ids) + e.position_embeddings(positions)
            x = F.dropout(e.LayerNorm(x + e.token_type_embeddings(types)), drop, self.training)
            for layer in self.bert.encoder.layer:
                x = run_layer(layer, x)
            pooled = torch.tanh(self.bert.pooler.dense(x[:, 0]))
            t = self.cls.predictions.transform
            x = t.LayerNorm(F.gelu(t.dense(x)))
            scores = x @ e.word_embeddings.weight.t() + self.cls.predictions.bias
            return scores, self.cls.seq_relationship(pooled)

    def encoder_layer() -> nn.Module:
        return block(
            attention=block(
                self=block(query=nn.Linear(h, h), key=nn.Linear(h, h), value=nn.Linear(h, h)),
                output=dense_norm(h),
            ),
            intermediate=block(dense=nn.Linear(h, cfg.ffn)),
            output=dense_norm(cfg.ffn),
        )

    def run_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        a = layer.attention
        b, s = x.shape[:2]

        def heads(linear: nn.Module) -> torch.Tensor:
            return linear(x).view(b, s, cfg.heads, h // cfg.heads).transpose(1, 2)

        q, k, v = heads(a.self.query), heads(a.self.key), heads(a.self.value)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=drop if a.training else 0.0)
        attended = attended.transpose(1, 2).reshape(b, s, h)
        out = a.output.dense(attended)
        x = a.output.LayerNorm(x + F.dropout(out, drop, a.training))
        out = layer.output.dense(F.gelu(layer.intermediate.dense(x)))
        return layer.output.LayerNorm(x + F.dropout(out, drop, layer.training))

    with torch.device(device):
        return Bert()


def parameter_count(layers: Sequence[Layer]) -> int:
    return sum(n for layer in layers for _, n in layer.params)


MODELS = {"resnet50": resnet50_layers, "bert_large": bert_large_layers}


# ---------------------------------------------------------------------------------------
# One training iteration on one GPU, no communication: published throughput at a
# published per-GPU batch. Weak scaling keeps this batch per GPU at every GPU count.


@dataclass(frozen=True)
class Compute:
    gpu: str
    batch: int  # per GPU
    samples_per_s: float
    source: str
    optimizer_bytes_per_param: int  # read and written by one update

    @property
    def iteration_s(self) -> float:
        return self.batch / self.samples_per_s


# The update's memory traffic, float32: SGD with momentum reads the parameter, its
# gradient and momentum and writes parameter and momentum (5 x 4 bytes); Adam or LAMB
# reads parameter, gradient and two moments and writes three (7 x 4 bytes).
SGD_MOMENTUM_BYTES, ADAM_BYTES = 5 * FLOAT32_BYTES, 7 * FLOAT32_BYTES
# GPU memory bandwidth, NVIDIA's data sheets: Tesla V100 SXM2 900 GB/s, Tesla P100 SXM2
# 732 GB/s.
MEMORY_BYTES_PER_S = {"V100": 900 * GB, "P100": 732 * GB}

COMPUTE = {
    ("resnet50", "V100"): Compute(
        "V100", 112, 367.0,
        "NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README, 'Training performance: "
        "NVIDIA DGX-1 16GB (8x V100 16GB)', 1 GPU, FP32: 367 img/s (pytorch-21.03 NGC "
        "container); batch 112, the DGX1V FP32 batch_size in its configs.yml",
        SGD_MOMENTUM_BYTES,
    ),
    ("bert_large", "V100"): Compute(
        "V100", 8, 33.36,
        "NVIDIA DeepLearningExamples, PyTorch BERT README, 'Pre-training NVIDIA DGX-1 With "
        "16G', 1 GPU, FP32, batch 8, sequence length 128: 33.36 sequences/s (pytorch:19.07-py3 "
        "NGC container)",
        ADAM_BYTES,
    ),
    # Goyal et al. give no single-GPU time. DERIVED from their two headline figures:
    # ResNet-50 at minibatch 8192 on 256 GPUs in about an hour is 90 epochs x 1,281,167
    # ImageNet images / 8192 = 14,075 iterations in 3600 s, 0.256 s each at 256 GPUs;
    # at ~90% scaling efficiency from 8 GPUs, one iteration at 8 GPUs took 0.9 x 0.256 =
    # 0.230 s, which is taken here as the compute of 32 images on one P100. So the
    # model's E(256) says how much of their 10% communication explains, not the 10%.
    ("resnet50", "P100"): Compute(
        "P100", 32, 32 / (0.9 * 3600 / (90 * 1_281_167 / 8192)),
        "DERIVED from Goyal et al.: 8192 images per iteration on 256 GPUs, 90 epochs in "
        "about 1 hour (0.256 s per iteration), times their ~90% efficiency from 8 GPUs; "
        "32 images per GPU",
        SGD_MOMENTUM_BYTES,
    ),
}  # fmt: skip


def workload(model: str, gpu: str, shape: Shape | None = None) -> Workload:
    """One iteration of `model` on one `gpu`, as `schedule.simulate` takes it; with a
    `shape`, the split measured on a GPU (`workload_from`)."""
    if model not in MODELS:
        raise ValueError(f"no model preset {model!r}; pick one of {', '.join(MODELS)}")
    if (model, gpu) not in COMPUTE:
        known = ", ".join(f"{m} on {g}" for m, g in COMPUTE)
        raise ValueError(f"no published iteration time for {model} on {gpu}; known: {known}")
    if shape is not None and shape.model != model:
        raise ValueError(f"a shape measured on {shape.model} cannot split {model}'s iteration")
    return workload_from(MODELS[model](), COMPUTE[model, gpu], shape)


def workload_from(
    layers: Sequence[Layer], compute: Compute, shape: Shape | None = None
) -> Workload:
    """The split described at the top: optimizer by bytes, forward and backward 1 : 2,
    each gradient ready when backward is done with its layer. With a `shape` measured
    on a GPU (`profiling.simulate.shape`), forward and backward split as measured, and
    each gradient is ready at its measured fraction of backward."""
    params = parameter_count(layers)
    optimizer_s = params * compute.optimizer_bytes_per_param / MEMORY_BYTES_PER_S[compute.gpu]
    rest = compute.iteration_s - optimizer_s
    if shape is not None:
        names = {name for layer in layers for name, _ in layer.params}
        if set(shape.ready_s) != names:
            unknown = sorted(set(shape.ready_s) ^ names)[:3]
            raise ValueError(f"the shape's parameters are not the model's: {unknown} differ")
        forward_s = rest * shape.forward_fraction
        backward_s = rest - forward_s
        grads = tuple(
            Grad(name, n * FLOAT32_BYTES, backward_s * shape.ready_fraction(name))
            for layer in layers
            for name, n in layer.params
        )
        return Workload(grads, forward_s, backward_s, optimizer_s)
    forward_s, backward_s = rest / 3, 2 * rest / 3
    total = sum(layer.flops for layer in layers)
    ready: dict[str, float] = {}
    done = 0.0
    for layer in reversed(layers):
        done += layer.flops
        for name, _ in layer.params:
            ready[name] = backward_s * done / total
    grads = tuple(
        Grad(name, n * FLOAT32_BYTES, ready[name]) for layer in layers for name, n in layer.params
    )
    return Workload(grads, forward_s, backward_s, optimizer_s)


# ---------------------------------------------------------------------------------------
# The clusters. Bandwidths are line rates, each way; what NCCL gets is less.
#
# Latencies: NCCL's own model of them, src/graph/tuning.cc of NCCL 2.7.5 (NVIDIA/nccl
# commit 01afd20a), ring algorithm, Simple protocol (the one for large buffers): a base
# latency of 8.4 us per call, 3.4 us per step over NVLink (hwLat NVLINK), 9.6 us per step
# over the network (hwLat NET). NCCL also multiplies a multi-node ring's latency by 1.9
# for large buffers ("plateau effect"), and switches to its LL and LL128 protocols and to
# trees for small ones; the model does neither.
NCCL_CALL_S, NCCL_NVLINK_STEP_S, NCCL_NET_STEP_S = 8.4e-6, 3.4e-6, 9.6e-6


@dataclass(frozen=True)
class Network:
    topology: Topology  # one server's worth; the sweep adds servers
    gpu: str
    source: str


NETWORKS = {
    # Li et al., "PyTorch Distributed" (VLDB 2020), section 5: 8 Tesla V100 per server,
    # NVLink inside it, servers joined by a Mellanox ConnectX-4 100 Gbit/s NIC (as the
    # paper's evaluation section describes its exclusive 32-GPU cluster; ASSUMED: one
    # such NIC per server, which no text available here confirms). NVLink: V100 SXM2, 6
    # links of 25 GB/s each way (NVIDIA's data sheet: 300 GB/s in all).
    "li2020": Network(
        Topology(
            nodes=1, gpus_per_node=8,
            intra_bytes_per_s=150 * GB, inter_bytes_per_s=100 * GBIT,
            intra_latency_s=NCCL_NVLINK_STEP_S, inter_latency_s=NCCL_NET_STEP_S,
            call_latency_s=NCCL_CALL_S,
        ),
        "V100",
        "Li et al. 2020 section 5: 8 V100 per server, NVLink; 100 Gbit/s per server "
        "(one NIC ASSUMED); NCCL 2.7.5 latencies",
    ),
    # Goyal et al., "Accurate, Large Minibatch SGD" (arXiv 1706.02677), section 5: Big
    # Basin servers of 8 Tesla P100 joined by NVLink, each with a Mellanox ConnectX-4 50
    # Gbit Ethernet card. NVLink: P100 SXM2, 4 links of 20 GB/s each way (data sheet: 160
    # GB/s in all). Latencies ASSUMED NCCL's: Goyal et al.'s inter-server all-reduce was
    # their own (Gloo) over Ethernet, whose per-step latency the paper does not give.
    "goyal2017": Network(
        Topology(
            nodes=1, gpus_per_node=8,
            intra_bytes_per_s=80 * GB, inter_bytes_per_s=50 * GBIT,
            intra_latency_s=NCCL_NVLINK_STEP_S, inter_latency_s=NCCL_NET_STEP_S,
            call_latency_s=NCCL_CALL_S,
        ),
        "P100",
        "Goyal et al. 2017 section 5: 8 P100 per server, NVLink; 50 Gbit/s Ethernet per "
        "server; latencies ASSUMED NCCL 2.7.5's",
    ),
}  # fmt: skip
