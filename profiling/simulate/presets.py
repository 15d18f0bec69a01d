"""Published numbers the scaling model starts from: ResNet-50 and BERT-large, and what one
training iteration of each takes on one GPU. Each number says where it comes from; the
ones no source here gives are marked ASSUMED, with the reason.

A preset is a model built on the meta device (its gradients' sizes, no memory), the
input a sample has, and a published iteration time at a published batch. The
`Workload` for `schedule.simulate` follows as for any model (`usermodel`): the
optimizer's share is its memory traffic at the GPU's memory bandwidth; forward and
backward split the rest by their FLOPs, and each gradient is ready when backward has
done the FLOPs it had done when the gradient's hook fired (`usermodel.flops_profile`).
Only matrix products and convolutions count: BatchNorm, LayerNorm, activations,
pooling and softmax are memory-bound and cost time the FLOP count does not see, so the
ready times are approximate (`python -m profiling.simulate shape --compare` measures
how far, against a GPU). A backward measured on a GPU (`shape`) replaces the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

# ResNet-50 and ResNet-101 (torchvision's definition, with device and depth) live in
# `profiling.common.sized_models`; imported here so that `--model
# profiling.simulate.presets:resnet50` (and `:resnet101`) name them, as docs and tests do.
from profiling.common.sized_models import resnet50 as resnet50
from profiling.common.sized_models import resnet101 as resnet101
from profiling.simulate import usermodel
from profiling.simulate.schedule import Workload
from profiling.simulate.topology import GB
from profiling.simulate.usermodel import Profile

FLOAT32_BYTES = 4  # both papers' gradients: float32 (DDP all-reduces the .grad dtype)


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


def bert_large(cfg: BertConfig = BertConfig(), device: str | None = None):
    """BERT-large for pre-training as a module, untrained, on `device`: the layers above
    with Hugging Face's `BertForPreTraining` parameter names, for timing its backward
    (`profiling.simulate.shape`). Dropout 0.1 and GELU as the released configuration;
    attention by `F.scaled_dot_product_attention`, no padding mask."""
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

        def forward(self, ids: torch.Tensor, types: torch.Tensor | None = None):
            e = self.bert.embeddings
            types = torch.zeros_like(ids) if types is None else types
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

    if device is None:
        return Bert()
    with torch.device(device):
        return Bert()


# A preset's factory, as `--model MODULE:FACTORY` would name it, and one sample's shape.
FACTORIES = {
    "resnet50": ("profiling.simulate.presets:resnet50", (3, 224, 224)),
    "bert_large": ("profiling.simulate.presets:bert_large", (BertConfig().seq_len,)),
}
MODELS = tuple(FACTORIES)
OPTIMIZERS = {"resnet50": "sgd", "bert_large": "adam"}  # as COMPUTE costs them


@cache  # frozen: every caller gets the same
def profile(model: str) -> Profile:
    """The preset's gradients and backward's shape by FLOPs, on the meta device."""
    return usermodel.profile(*FACTORIES[model])


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
    # Goyal et al. give no single-GPU time. TensorFlow's own benchmarks timed ResNet-50
    # at 32 images on one P100 of a DGX-1 in the same months (May 2017, CUDA 8, cuDNN
    # 5.1): 195 images/s on synthetic data, 0.164 s an iteration. Its parameters lived
    # on the CPU (variable_update parameter_server), so some of that is their traffic.
    ("resnet50", "P100"): Compute(
        "P100", 32, 195.0,
        "tensorflow/tensorflow tensorflow/docs_src/performance/benchmarks.md, 'Details for "
        "NVIDIA DGX-1 (NVIDIA Tesla P100)', Other Results, batch 32, 1 GPU, ResNet-50, "
        "training synthetic data: 195 images/s (May 2017)",
        SGD_MOMENTUM_BYTES,
    ),
}  # fmt: skip


def workload(
    model: str,
    gpu: str,
    split: Profile | None = None,
    compute: Compute | None = None,
    memory_bytes_per_s: float | None = None,
) -> Workload:
    """One iteration of `model` on one `gpu`, as `schedule.simulate` takes it: the
    published `compute` (or the one given), the optimizer at the GPU's memory bandwidth
    (or the one given), split by FLOPs or as `split` says (`shape.split`: measured)."""
    if model not in MODELS:
        raise ValueError(f"no model preset {model!r}; pick one of {', '.join(MODELS)}")
    if compute is None and (model, gpu) not in COMPUTE:
        known = ", ".join(f"{m} on {g}" for m, g in COMPUTE)
        raise ValueError(f"no published iteration time for {model} on the {gpu}; known: {known}")
    compute = compute or COMPUTE[model, gpu]
    prof = split or profile(model)
    memory = memory_bytes_per_s or MEMORY_BYTES_PER_S[compute.gpu]
    optimizer_s = prof.parameters * compute.optimizer_bytes_per_param / memory
    return usermodel.workload(prof, compute.iteration_s, optimizer_s)
