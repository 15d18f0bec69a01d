"""The calibration's worker itself (`profiling.simulate.calibrate.worker`), on 2 ranks
over loopback (no link shaped: nothing here checks a figure against a rate), with a
tiny MLP and a two-size sweep: what it keeps of the compute. About 15 s."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ddp.config import Config
from profiling.simulate import calibrate

ROOT = Path(__file__).resolve().parent.parent


def test_the_compute_is_the_medians_over_the_repeats_in_a_row_and_every_spell(tmp_path):
    out = tmp_path / "calibration.json"
    settings = {
        "out": str(out),
        "sweep": {**calibrate.SWEEP, "sizes_bytes": [4096, 65536], "seconds_per_size": 0.05},
        "configs": {
            "mlp": dataclasses.asdict(Config(model="mlp", width=32, depth=2, batch_size=8))
        },
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "profiling.simulate.calibrate",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", calibrate.ENV: json.dumps(settings)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    mlp = json.loads(out.read_text())["models"]["mlp"]
    # Each repeat the slowest rank's: the 15 in a row, then five in each of four spells.
    repeats = mlp["compute_repeats_s"]
    assert len(repeats) == calibrate.REPEATS + 4 * calibrate.SPELL_REPEATS
    for i, phase in enumerate(("forward_s", "backward_s", "optimizer_s")):
        assert mlp["workload"][phase] == statistics.median(r[i] for r in repeats), phase
    # When each was timed: four spells and the repeats in a row, from the first spell on.
    at = [t for t, _ in mlp["compute_spells_s"]]
    assert len(at) == 5 and at == sorted(at) and at[0] < 0.01 < at[-1]
