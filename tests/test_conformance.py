"""torch's own DDP tests against the drop-in, the part that fits in CI: every test of
torch's distributed suite that uses DistributedDataParallel, runs on CPU Gloo and passes
with torch's own class (`make conformance` runs the whole selection with both classes
and compares; docs/stages/drop_in.md gives the counts), less any that read torch's
internals (tests/conformance/outcomes.py would list them, each with its reason)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conformance.outcomes import INTERNALS, outcomes

ROOT = Path(__file__).resolve().parent.parent
SUITE = "tests/conformance/torch_suite.py::TestDistBackendWithSpawn"
# --8<-- [start:subset]
PASSING_WITH_TORCH_ON_CPU = [  # from `make conformance`, torch's DDP on CPU Gloo, 2 ranks
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_ddp_create_graph",
    "test_ddp_logging_data_cpu",
    "test_dump_DDP_relevant_env_vars",
    "test_grads_same_across_ranks_with_no_sync",
    "test_static_graph_api_cpu",
]
# --8<-- [end:subset]


# torch's harness fails a test whose ranks have not all exited after this long (its
# DISTRIBUTED_TESTS_DEFAULT_TIMEOUT, 300 s unless set) and goes on with the next: only a
# hang reaches it: on 2 cores with a load of 4 to 6, the 12 took 26 minutes, 2 each.
PER_TEST_S = 600
# The whole run then outlasts the sum of those only if pytest itself hangs: importing
# torch's test module and collecting take a minute or two on a busy machine.
STARTUP_S = 600


def test_torchs_own_ddp_tests_pass_with_the_drop_in(tmp_path: Path) -> None:
    subset = [name for name in PASSING_WITH_TORCH_ON_CPU if name not in INTERNALS]
    report = tmp_path / "ours.xml"
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            + [f"{SUITE}::{name}" for name in subset]
            + [f"--junitxml={report}"],
            cwd=ROOT,
            env={**os.environ, "DDP": "ours", "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(PER_TEST_S)},
            capture_output=True,
            text=True,
            timeout=STARTUP_S + PER_TEST_S * len(subset),
        )
    except subprocess.TimeoutExpired as hung:
        output = hung.stdout.decode(errors="replace") if hung.stdout else ""
        pytest.fail(f"pytest hung outside torch's per-test timeout:\n{output[-4000:]}")
    assert outcomes(str(report)) == dict.fromkeys(subset, "passed"), out.stdout[-4000:]
