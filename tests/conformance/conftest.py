"""Selects, from torch's distributed tests, the ones that use DistributedDataParallel:
a test whose body, or a helper it calls (however deep), names the class or `DDP`."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap


def tests_using_ddp(test_base: type) -> set[str]:
    source = textwrap.dedent(inspect.getsource(test_base))
    tree = ast.parse(source)
    methods = {
        node.name: ast.get_source_segment(source, node)
        for node in tree.body[0].body
        if isinstance(node, ast.FunctionDef)
    }
    uses = {
        name for name, text in methods.items() if re.search(r"DistributedDataParallel|DDP", text)
    }
    calls = {name: set(re.findall(r"self\.(_\w+)\(", text)) for name, text in methods.items()}
    grew = True
    while grew:  # a test that calls a helper that uses DDP uses DDP
        before = len(uses)
        uses |= {name for name, called in calls.items() if called & uses}
        grew = len(uses) > before
    return {name for name in uses if name.startswith("test_")}


def pytest_collection_modifyitems(config, items):
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    wanted = tests_using_ddp(DistributedTest._DistTestBase)
    kept = [item for item in items if item.name in wanted]
    config.hook.pytest_deselected(items=[item for item in items if item.name not in wanted])
    items[:] = kept
