"""The backward's shape: measured on small versions of the presets' models (on the CPU
here; `python -m profiling.simulate shape` measures them full size on a GPU), and how a
measurement replaces the presets' assumed split, checked by hand and against the paper
comparisons."""

from __future__ import annotations

import pytest

from profiling.simulate import paper, presets, shape

TINY_BERT = presets.BertConfig(
    layers=2, hidden=32, heads=4, ffn=64, vocab=50, positions=16, seq_len=8
)


def test_bert_module_holds_the_layer_lists_parameters_by_name_and_size():
    module = [(n, p.numel()) for n, p in presets.bert_large().named_parameters()]
    layers = [param for layer in presets.bert_large_layers() for param in layer.params]
    assert sorted(module) == sorted(layers)
    tiny = [(n, p.numel()) for n, p in presets.bert_large(TINY_BERT).named_parameters()]
    assert sorted(tiny) == sorted(
        p for layer in presets.bert_large_layers(TINY_BERT) for p in layer.params
    )


def test_bert_shape_on_the_cpu_has_every_gradient_in_backward_order():
    s = shape.measure("bert_large", 2, "cpu", repeats=2, warmup=1, bert_config=TINY_BERT)
    names = {name for layer in presets.bert_large_layers(TINY_BERT) for name, _ in layer.params}
    assert set(s.ready_s) == names
    assert all(0 <= t <= s.backward_s for t in s.ready_s.values())
    assert 0 < s.forward_fraction < 1 and s.optimizer_s > 0
    # The word embedding is used first in forward and again by the tied decoder: its
    # gradient is complete only when backward reaches the embedding, last.
    assert max(s.ready_s, key=s.ready_s.get) == "bert.embeddings.word_embeddings.weight"
    assert (
        s.ready_s["cls.seq_relationship.weight"]
        < s.ready_s["bert.encoder.layer.0.output.dense.weight"]
    )


def test_resnet_shape_on_the_cpu_is_ready_from_the_head_back():
    s = shape.measure("resnet50", 2, "cpu", repeats=1, warmup=0, image_size=32)
    assert len(s.ready_s) == 161
    assert s.ready_s["fc.weight"] < s.ready_s["layer3.0.conv1.weight"] < s.ready_s["conv1.weight"]


def test_bad_measure_arguments_are_named():
    with pytest.raises(ValueError, match="no model preset 'gpt'"):
        shape.measure("gpt", 1, "cpu")
    with pytest.raises(ValueError, match="need repeats >= 1"):
        shape.measure("resnet50", 1, "cpu", repeats=0)


def assumed_as_shape(model: str, gpu: str) -> shape.Shape:
    """A measurement that says exactly what the assumption says."""
    w = presets.workload(model, gpu)
    ready = {g.name: g.ready_s for g in w.grads}
    batch = presets.COMPUTE[model, gpu].batch
    return shape.Shape(model, batch, "none", w.forward_s, w.backward_s, w.optimizer_s, ready)


def test_a_shape_that_says_what_the_assumption_says_changes_nothing():
    for model, gpu in presets.COMPUTE:
        assumed = presets.workload(model, gpu)
        again = presets.workload(model, gpu, assumed_as_shape(model, gpu))
        assert again.forward_s == pytest.approx(assumed.forward_s)
        assert again.optimizer_s == assumed.optimizer_s
        assert [g.name for g in again.grads] == [g.name for g in assumed.grads]
        assert [g.ready_s for g in again.grads] == pytest.approx([g.ready_s for g in assumed.grads])


def test_a_measured_split_by_hand():
    # Two layers, 10 s an iteration; measured: forward 1 s, backward 3 s, and each
    # gradient at 1, 1/4 and 1/10 of backward.
    layers = (
        presets.Layer("a", (("a.weight", 2),), 1.0),
        presets.Layer("b", (("b.weight", 3), ("b.bias", 1)), 3.0),
    )
    compute = presets.Compute("V100", 10, 1.0, "by hand", 4)  # 10 s an iteration
    measured = shape.Shape(
        "x", 10, "none", forward_s=1.0, backward_s=3.0, optimizer_s=5.0,
        ready_s={"a.weight": 3.0, "b.weight": 0.75, "b.bias": 0.3},
    )  # fmt: skip
    w = presets.workload_from(layers, compute, measured)
    rest = 10.0 - w.optimizer_s  # the optimizer stays the preset's: bytes over bandwidth
    assert w.optimizer_s == pytest.approx(6 * 4 / presets.MEMORY_BYTES_PER_S["V100"])
    assert w.forward_s == pytest.approx(rest / 4)  # forward: 1 of 1 + 3 measured
    assert w.backward_s == pytest.approx(rest * 3 / 4)
    assert [(g.name, g.nbytes) for g in w.grads] == [
        ("a.weight", 8),
        ("b.weight", 12),
        ("b.bias", 4),
    ]
    assert [g.ready_s for g in w.grads] == pytest.approx(
        [w.backward_s * 1.0, w.backward_s * 0.25, w.backward_s * 0.1]
    )


def test_a_shape_of_another_model_or_other_parameters_is_refused():
    resnet = assumed_as_shape("resnet50", "V100")
    with pytest.raises(ValueError, match="measured on resnet50 cannot split bert_large"):
        presets.workload("bert_large", "V100", resnet)
    fewer = shape.Shape("resnet50", 112, "none", 1, 2, 0, {"fc.weight": 1.0})
    with pytest.raises(ValueError, match="parameters are not the model's"):
        presets.workload("resnet50", "V100", fewer)


def test_paper_comparisons_move_with_the_measured_ready_times():
    same = [assumed_as_shape(m, g) for m, g in presets.COMPUTE]
    result = paper.compare()
    result["measured_shape"] = paper.with_shapes(same)
    result["command"] = "test"
    table = paper.markdown(result)["shape"].split("\n\n")[2]
    rows = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    assert len(rows) == 7 and all(row[2] == row[3] for row in rows)  # nothing moved
    # Every BERT gradient ready only at backward's end: nothing left to overlap.
    bert = assumed_as_shape("bert_large", "V100")
    late = shape.Shape(**{**bert.__dict__, "ready_s": dict.fromkeys(bert.ready_s, bert.backward_s)})
    moved = paper.with_shapes([late])
    overlap = moved["comparison"]["li_overlap"]["bert_large"]
    assert overlap["speedup"] == pytest.approx(0.0, abs=1e-9)
    assert result["li_overlap"]["bert_large"]["speedup"] > 0.3  # 41% as assumed
    gaps = moved["shapes"][0]
    assert gaps["ready_gap_median"] > 0.3 and gaps["forward_fraction"] == pytest.approx(1 / 3)


def test_a_shape_at_a_batch_no_preset_has_is_refused():
    odd = shape.Shape(**{**assumed_as_shape("resnet50", "V100").__dict__, "batch": 64})
    with pytest.raises(SystemExit, match="resnet50 at batch 64 matches no preset"):
        paper.with_shapes([odd])
