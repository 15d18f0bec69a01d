"""The backward's shape: measured on small versions of the presets' models (on the CPU
here; `python -m profiling.simulate shape` measures them full size on a GPU), and how a
measurement replaces the presets' assumed split, checked by hand and against the paper
comparisons."""

from __future__ import annotations

import argparse
import json

import pytest

from profiling.simulate import presets, shape, usermodel
from profiling.simulate.published import paper
from tests.fixtures import user_models

TINY = "tests.fixtures.user_models:tiny_bert"


def test_bert_shape_on_the_cpu_has_every_gradient_in_backward_order():
    s = shape.measure(TINY, (8,), 2, "cpu", repeats=2, warmup=1, optimizer="adam")
    names = [n for n, p in user_models.tiny_bert().named_parameters() if p.requires_grad]
    assert set(s.ready_s) == set(names) and s.model == TINY
    # The classifier's gradients first, the embeddings' last; every one inside backward.
    ready = s.ready_s
    assert ready["cls.seq_relationship.weight"] < ready["bert.encoder.layer.0.output.dense.weight"]
    assert (
        ready["bert.encoder.layer.0.output.dense.weight"]
        <= ready["bert.embeddings.word_embeddings.weight"]
    )
    assert all(0 <= t <= s.backward_s * (1 + 1e-9) for t in ready.values())
    assert s.forward_s > 0 and s.optimizer_s > 0


def test_resnet_shape_on_the_cpu_is_ready_from_the_head_back():
    spec, _ = presets.FACTORIES["resnet50"]
    s = shape.measure(spec, (3, 32, 32), 2, "cpu", repeats=1, warmup=0, name="resnet50")
    assert len(s.ready_s) == 161 and s.model == "resnet50"
    assert s.ready_s["fc.weight"] < s.ready_s["layer3.0.conv1.weight"] < s.ready_s["conv1.weight"]


def test_bad_measure_arguments_are_named():
    with pytest.raises(ValueError, match="cannot import 'gpt'"):
        shape.measure("gpt:build", (8,), 1, "cpu")
    with pytest.raises(ValueError, match="need repeats >= 1"):
        shape.measure(TINY, (8,), 1, "cpu", repeats=0)


def assumed_as_shape(model: str, gpu: str) -> shape.Shape:
    """A measurement that says exactly what the assumption says."""
    w = presets.workload(model, gpu)
    ready = {g.name: g.ready_s for g in w.grads}
    batch = presets.COMPUTE[model, gpu].batch
    return shape.Shape(model, batch, "none", w.forward_s, w.backward_s, w.optimizer_s, ready)


def test_a_shape_that_says_what_the_assumption_says_changes_nothing():
    for model, gpu in presets.COMPUTE:
        assumed = presets.workload(model, gpu)
        again = presets.workload(model, gpu, shape.split(assumed_as_shape(model, gpu), model))
        assert again.forward_s == pytest.approx(assumed.forward_s)
        assert again.optimizer_s == assumed.optimizer_s
        assert [g.name for g in again.grads] == [g.name for g in assumed.grads]
        assert [g.ready_s for g in again.grads] == pytest.approx([g.ready_s for g in assumed.grads])


def test_a_measured_split_by_hand():
    # Three gradients, 10 s an iteration; measured: forward 1 s, backward 3 s, and each
    # gradient at 1, 1/4 and 1/10 of backward.
    names = ("a.weight", "b.weight", "b.bias")
    prof = usermodel.Profile(names, (2, 3, 1), 0.5, dict.fromkeys(names, 0.5), "flops")
    measured = shape.Shape(
        "x", 10, "none", forward_s=1.0, backward_s=3.0, optimizer_s=5.0,
        ready_s={"a.weight": 3.0, "b.weight": 0.75, "b.bias": 0.3},
    )  # fmt: skip
    split = measured.profile(prof)
    assert split.forward_fraction == pytest.approx(1 / 4)  # forward: 1 of 1 + 3 measured
    assert split.ready_fraction == pytest.approx({"a.weight": 1.0, "b.weight": 0.25, "b.bias": 0.1})
    w = usermodel.workload(split, 10.0, 2.0)  # the optimizer stays the preset's
    assert (w.forward_s, w.backward_s) == pytest.approx((2.0, 6.0))
    assert [(g.name, g.nbytes) for g in w.grads] == [
        ("a.weight", 8),
        ("b.weight", 12),
        ("b.bias", 4),
    ]
    assert [g.ready_s for g in w.grads] == pytest.approx([6.0, 1.5, 0.6])


def test_a_shape_of_another_model_or_other_parameters_is_refused():
    resnet = assumed_as_shape("resnet50", "V100")
    with pytest.raises(ValueError, match="measured on resnet50 cannot split bert_large"):
        shape.split(resnet, "bert_large")
    fewer = shape.Shape("resnet50", 112, "none", 1, 2, 0, {"fc.weight": 1.0})
    with pytest.raises(ValueError, match="parameters are not the model's"):
        shape.split(fewer, "resnet50")


def paper_with(shapes) -> dict:
    result = paper.compare()
    result["measured_split"] = paper.compare(shapes)
    result["command"] = "test"
    return result


def test_paper_comparisons_move_with_the_measured_ready_times():
    same = [assumed_as_shape(m, g) for m, g in presets.COMPUTE]
    result = paper_with(same)
    table = paper.markdown(result)["summary"].split("\n\n")[1]
    rows = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    assert len(rows) == 8 and all(row[2] == row[3] for row in rows)  # nothing moved
    # Every BERT gradient ready only at backward's end: nothing left to overlap.
    bert = assumed_as_shape("bert_large", "V100")
    late = shape.Shape(**{**bert.__dict__, "ready_s": dict.fromkeys(bert.ready_s, bert.backward_s)})
    moved = paper.compare([late])
    assert moved["li_overlap"]["bert_large"]["speedup"] == pytest.approx(0.0, abs=1e-9)
    assert result["li_overlap"]["bert_large"]["speedup"] > 0.3  # as split by FLOPs


def test_a_shape_at_a_batch_no_preset_has_is_refused(tmp_path):
    odd = shape.Shape(**{**assumed_as_shape("resnet50", "V100").__dict__, "batch": 64})
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(odd.__dict__))
    args = argparse.Namespace(shape=[str(path)], out=tmp_path, docs=False, no_files=True)
    with pytest.raises(SystemExit, match="resnet50 at batch 64 matches no preset"):
        paper.run(args)
