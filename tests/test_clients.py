"""Real clients of torch's DDP driving the drop-in, the part that fits in CI: the plain
script (tests/clients/plain_flow.py) and accelerate's own test_sync.py, each under torchrun
on 2 CPU Gloo ranks with `-m stages.swap` (`make clients` runs every flow, with torch's DDP
as well, and compares). Skipped unless the `clients` extra (accelerate, lightning) is
installed. About 15 s on 2 cores."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from tests.clients.run import run_flow  # noqa: E402


@pytest.mark.parametrize("flow", ["plain", "accelerate-sync"])
def test_client_passes_with_the_drop_in(flow: str) -> None:
    result = run_flow(flow, drop_in=True, timeout=600)
    assert result.status == "pass", f"{result.error()}\n{result.traceback_tail()}"
