"""The presets' models against published parameter counts and torch's own layers, and
their workloads against the published iteration times they come from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from profiling.simulate import presets

MiB = 2**20


def test_resnet50_matches_torchvisions_documented_size():
    # torchvision's model table, ResNet50_Weights.IMAGENET1K_V1: 25,557,032 parameters
    # and 4.09 "GFLOPS" (multiply-adds) at 224 x 224.
    assert sum(p.numel() for p in presets.resnet50("meta").parameters()) == 25_557_032
    assert presets.profile("resnet50").parameters == 25_557_032
    # torch's FLOP counter on the meta model, one image: multiply-adds.
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        presets.resnet50("meta")(torch.empty(1, 3, 224, 224, device="meta"))
    assert counter.get_total_flops() / 2 == pytest.approx(4.09e9, rel=0.005)


@pytest.mark.parametrize(
    ("factory", "parameters"),
    [("resnet101", 44_549_160), ("resnext50_32x4d", 25_028_904), ("resnext101_32x8d", 88_791_336)],
)  # torchvision's documented sizes (its model table's "Params")
def test_resnets_of_torchs_ddp_benchmark_match_torchvision(factory: str, parameters: int):
    from profiling.simulate.published import torch_bench

    model = getattr(presets, factory, None) or getattr(torch_bench, factory)
    model = model("meta")
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_bert_large_counted_with_torchs_transformer_layer():
    cfg = presets.BertConfig()
    # One encoder layer of BERT is what torch's TransformerEncoderLayer holds: Q, K, V and
    # output projections, the feed-forward pair, two LayerNorms.
    layer = sum(p.numel() for p in nn.TransformerEncoderLayer(1024, 16, 4096).parameters())
    embeddings = (30522 + 512 + 2) * 1024 + 2 * 1024  # three tables and a LayerNorm
    pooler = 1024 * 1024 + 1024
    bert_model = embeddings + 24 * layer + pooler
    assert 334e6 <= bert_model <= 340e6  # the commonly quoted "BERT-large, 335M / 340M"
    # Pre-training heads: the masked-LM transform (dense + LayerNorm) and decoder bias
    # (its weight is the word embedding's), the next-sentence classifier.
    heads = (1024 * 1024 + 1024) + 2 * 1024 + 30522 + (1024 * 2 + 2)
    assert cfg == presets.BertConfig()
    assert presets.profile("bert_large").parameters == bert_model + heads


@pytest.mark.parametrize("model,gpu", list(presets.COMPUTE))
def test_workload_adds_up_to_the_published_iteration(model, gpu):
    w = presets.workload(model, gpu)
    compute = presets.COMPUTE[model, gpu]
    published = {
        ("resnet50", "V100"): 112 / 367,
        ("bert_large", "V100"): 8 / 33.36,
        ("resnet50", "P100"): 32 / 195,
    }
    assert w.compute_s == pytest.approx(published[model, gpu])
    # Backward does about two products per forward product: the FLOP count says so.
    assert 1.9 < w.backward_s / w.forward_s < 2.1
    assert sum(g.nbytes for g in w.grads) == 4 * presets.profile(model).parameters
    # Backward ends with the first layer: its gradient is ready last, at backward's end.
    assert max(g.ready_s for g in w.grads) == pytest.approx(w.backward_s)
    assert w.grads[0].ready_s == pytest.approx(w.backward_s)
    assert compute.batch in (8, 32, 112)


def test_resnet_gradients_ready_last_layer_first():
    w = {g.name: g for g in presets.workload("resnet50", "V100").grads}
    assert w["fc.bias"].ready_s < w["layer4.2.conv3.weight"].ready_s
    assert w["layer4.2.conv3.weight"].ready_s < w["layer1.0.conv1.weight"].ready_s
    # A BatchNorm after a convolution is ready no later than that convolution.
    assert w["layer2.1.bn2.weight"].ready_s <= w["layer2.1.conv2.weight"].ready_s
    assert w["fc.weight"].nbytes == 2048 * 1000 * 4


def test_unknown_presets_are_named():
    with pytest.raises(ValueError, match="no published iteration time for bert_large on the P100"):
        presets.workload("bert_large", "P100")
    with pytest.raises(ValueError, match="no model preset 'gpt'"):
        presets.workload("gpt", "V100")


def test_meta_model_holds_no_memory():
    assert all(p.device == torch.device("meta") for p in presets.resnet50("meta").parameters())
