"""`make gpu-check` (`tests/gpu_check.py`), on a machine without a GPU: the Makefile has
the target, with its help comment; it stops at once, saying why, instead of running
checks that would skip; and what it reads from the checks' outputs fails a skipped
test or a difference from torch's DDP. The checks themselves run on a GPU only."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import gpu_check
from tests.gpu_check import pytest_summary

ROOT = Path(__file__).resolve().parents[1]


def test_the_makefile_has_the_target() -> None:
    text = (ROOT / "Makefile").read_text()
    rule = re.search(r"^gpu-check: .*## (.+)\n\t(.+)$", text, re.M)
    assert rule is not None, "no `gpu-check:` rule with a `## help` comment"
    assert "-m tests.gpu_check" in rule.group(2), rule.group(2)
    assert re.search(r"^\.PHONY:.* gpu-check\b", text, re.M), "gpu-check is not .PHONY"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it runs every check")
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_without_a_gpu_it_stops_at_once_saying_why() -> None:
    venv = Path(sys.prefix)  # this interpreter's environment, taken as set up (-o)
    command = ["make", "-o", str(venv / "bin" / ".installed"), f"VENV={venv}", "gpu-check"]
    # A hang fails here; the run itself is an import of torch.
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0, out.stdout
    assert "gpu-check needs a CUDA GPU: torch sees none" in out.stderr, out.stderr


def test_a_skip_or_a_difference_from_torch_fails_its_check(tmp_path, monkeypatch) -> None:
    assert pytest_summary("....\n4 passed, 9 deselected in 95.20s\n", tmp_path) == (
        "4 passed, 9 deselected in 95.20s", []
    )  # fmt: skip
    _, problems = pytest_summary("..s\n= 2 passed, 1 skipped in 9.00s =\n", tmp_path)
    assert problems == ["a test skipped: on a GPU every one must run"]
    monkeypatch.setattr(gpu_check, "gpus", lambda: 1)  # what one GPU's two lines say
    printed = (
        "rank 0 reduce torch.float32: max difference 0, dtypes ['torch.float32']\n"
        "rank 0 reduce None: max difference {}, dtypes ['torch.float32']\n"
    )
    figures, problems = gpu_check.mixed_precision_figures(printed.format("3e-08"), tmp_path)
    assert "reduce None: max difference 3e-08" in figures and problems == [], figures
    _, problems = gpu_check.mixed_precision_figures(printed.format("0.5"), tmp_path)
    assert problems == ["max difference 0.5 over 1e-06"]
