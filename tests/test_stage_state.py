"""Who owns the final class's state. Read from the stages' source with `ast`: every
`self.x = ...`, `self.x += ...` and `self.x[...] = ...` in a stage's class. A later stage
that assigns an attribute an earlier stage introduced reaches into that stage's state;
the few that remain are named in the writing stage's module docstring, so a reader of
that stage sees them. State that belongs to one backward lives in the overlapped stage's
`Backward`, made by forward, not in fields each stage assigns."""

from __future__ import annotations

import ast
import gc
import importlib
import inspect
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import stages
from tests.adapters import build_wrapper
from tests.nets import NetSpec, build_net

CROSS_STAGE_WRITES_MAX = 5  # each named in the writing stage's module docstring
SHARED_ATTRIBUTES_MAX = 25  # attributes (methods aside) that two or more stage classes touch


def stage_classes() -> list[tuple[str, ast.ClassDef, str]]:
    """(stage, its class's syntax tree, its module's docstring), simplest stage first."""
    out = []
    for stage, name in stages._ORDER.items():
        module = importlib.import_module(f"stages.{stage}")
        tree = ast.parse(Path(inspect.getsourcefile(module)).read_text())
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
        out.append((stage, cls, ast.get_docstring(tree) or ""))
    return out


def self_attribute(node: ast.AST) -> str | None:
    while isinstance(node, ast.Subscript):  # self.x[...] = ... assigns into x
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.attr if node.value.id == "self" else None
    return None


def assigned(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (name := self_attribute(t)) is not None:
                    names.add(name)
    return names


def touched(cls: ast.ClassDef) -> set[str]:
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and self_attribute(n)}


def cross_stage_writes(classes: list[tuple[str, ast.ClassDef, str]]) -> list[tuple[str, str]]:
    """(stage, attribute) for each attribute a stage assigns that an earlier one did."""
    first: dict[str, int] = {}
    writes = []
    for i, (stage, cls, _) in enumerate(classes):
        for name in sorted(assigned(cls)):
            if first.setdefault(name, i) < i:
                writes.append((stage, name))
    return writes


def shared_attributes(classes: list[tuple[str, ast.ClassDef, str]]) -> list[str]:
    methods = {n.name for _, cls, _ in classes for n in cls.body if isinstance(n, ast.FunctionDef)}
    by_name: dict[str, int] = {}
    for _, cls, _ in classes:
        for name in touched(cls) - methods:
            by_name[name] = by_name.get(name, 0) + 1
    return sorted(name for name, count in by_name.items() if count >= 2)


def test_later_stages_assign_few_fields_of_earlier_ones_each_named():
    classes = stage_classes()
    writes = cross_stage_writes(classes)
    assert len(writes) <= CROSS_STAGE_WRITES_MAX, writes
    docstrings = {stage: doc for stage, _, doc in classes}
    unnamed = [(s, name) for s, name in writes if f"`{name}`" not in docstrings[s]]
    assert not unnamed, f"not named in the writing stage's module docstring: {unnamed}"


def test_few_attributes_are_shared_between_stages():
    shared = shared_attributes(stage_classes())
    assert len(shared) <= SHARED_ATTRIBUTES_MAX, shared


def parsed(source: str) -> list[tuple[str, ast.ClassDef, str]]:
    tree = ast.parse(source)
    return [(c.name, c, "") for c in tree.body if isinstance(c, ast.ClassDef)]


def test_a_later_stage_assigning_an_earlier_ones_field_is_found():
    source = (
        "class A:\n    def __init__(self):\n        self._pending = [1]\n        self.x = 0\n"
        "class B(A):\n    def f(self):\n        self._pending[0] -= 1\n        self.y = self.x\n"
    )
    assert cross_stage_writes(parsed(source)) == [("B", "_pending")]
    assert shared_attributes(parsed(source)) == ["_pending", "x"]


@pytest.mark.parametrize("stage", list(stages.STAGES))
def test_a_dropped_model_is_freed_at_once(stage: str) -> None:
    """No reference cycle runs through a stage's state (hooks hold the model weakly, the
    backward's objects hold no model): a model its user drops goes at once, and with it
    its hold on the process group, which a framework then destroys. A cycle would keep
    both until Python's cycle collector runs, and Gloo's threads into shutdown."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    gc.disable()  # only reference counting frees it
    try:
        wrapped = build_wrapper(
            stage, build_net(NetSpec(3, 4, 2, order=()), seed=0), dist.group.WORLD
        )
        wrapped(torch.randn(4, 3)).sum().backward()
        wrapped.finish_gradient_synchronization()
        dropped = weakref.ref(wrapped)
        del wrapped
        assert dropped() is None, f"{stage}: still referenced after del"
    finally:
        gc.enable()
        dist.destroy_process_group()
