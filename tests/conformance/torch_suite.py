"""torch's own DistributedDataParallel tests, run against the drop-in.

torch ships its distributed tests in the wheel (`torch.testing._internal.distributed.
distributed_test`); its own repository runs them through a small module like this one,
with one process per rank spawned for each test. Here, before the test module is
imported, `torch.nn.parallel.DistributedDataParallel` is replaced by
`stages.drop_in.DistributedDataParallel` (unless DDP=torch), in the parent and in every
spawned rank, since each rank imports this module again.

    make conformance                    # ours, the CPU selection, then torch's, and a table
    DDP=torch .venv/bin/pytest tests/conformance/torch_suite.py -k test_ddp_comm_hook

Not collected by the default `pytest` run (the file name has no test_ prefix): it takes
minutes. The default run executes `tests/test_conformance.py`, a subset.
"""

from __future__ import annotations

import ast
import atexit
import inspect
import os
import re
import shutil
import tempfile
import textwrap

# Read by torch's test module at import: Gloo on CPU, 2 ranks, a folder for its barriers.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:  # made once: the rank processes torch spawns inherit it
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="ddp-conformance-")
    atexit.register(shutil.rmtree, os.environ["TEMP_DIR"], ignore_errors=True)

import torch.nn.parallel  # noqa: E402

from stages.drop_in import DistributedDataParallel  # noqa: E402

OURS = os.environ.get("DDP", "ours") == "ours"
if OURS:  # before torch's test module binds the name
    torch.nn.parallel.DistributedDataParallel = DistributedDataParallel

import torch.testing._internal.distributed.distributed_test as distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

if OURS:
    distributed_test.DistributedDataParallel = DistributedDataParallel


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


def ddp_test_names(test_base: type) -> set[str]:
    source = textwrap.dedent(inspect.getsource(test_base))
    lines = source.splitlines()
    tree = ast.parse(source)
    # Sliced by line numbers: ast.get_source_segment splits the whole source again for
    # each of the ~800 methods, which took 30 s, in the parent and in every spawned rank.
    methods = {
        node.name: "\n".join(lines[node.lineno - 1 : node.end_lineno])
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


# Only the tests that use DDP: the others would run the same with either class.
_WANTED = ddp_test_names(DistributedTest._DistTestBase)
for _name in dir(DistributedTest._DistTestBase):
    if _name.startswith("test_") and _name not in _WANTED:
        setattr(TestDistBackendWithSpawn, _name, None)  # not callable: not collected
