"""The calibration's worker itself (`profiling.simulate.cpu_cluster.worker`), on 2 ranks
over loopback (no link shaped: nothing here checks a figure against a rate), with a
tiny MLP and a two-size sweep: what it keeps of the compute, and each stage's step with
no communication. About 20 s."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ddp.config import Config
from profiling.simulate.cpu_cluster import calibration, worker

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = [["naive", None], ["bucketed", 1e-6], ["overlapped", 1e6], ["drop_in", 1e6]]


def test_the_compute_is_the_medians_over_the_repeats_in_a_row_and_every_spell(tmp_path):
    out = tmp_path / "calibration.json"
    settings = {
        "out": str(out),
        "sweep": {**calibration.SWEEP, "sizes_bytes": [4096, 65536], "seconds_per_size": 0.05},
        "configs": {
            "mlp": dataclasses.asdict(Config(model="mlp", width=32, depth=2, batch_size=8))
        },
        "layouts": {"mlp": LAYOUTS},
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "profiling.simulate.cpu_cluster.worker",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", worker.ENV: json.dumps(settings)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    mlp = json.loads(out.read_text())["models"]["mlp"]
    # Each repeat the slowest rank's: the 15 in a row, then five in each of four spells.
    repeats = mlp["compute_repeats_s"]
    assert len(repeats) == worker.REPEATS + 4 * worker.SPELL_REPEATS
    for i, phase in enumerate(("forward_s", "backward_s", "optimizer_s")):
        assert mlp["workload"][phase] == statistics.median(r[i] for r in repeats), phase
    # When each was timed: four spells and the repeats in a row, from the first spell on.
    at = [t for t, _ in mlp["compute_spells_s"]]
    assert len(at) == 5 and at == sorted(at) and at[0] < 0.01 < at[-1]
    # Every stage of the layouts stepped with no communication, on a group of its rank
    # alone: drop_in's status rows, on a fake group of both ranks, would say the other
    # rank's gradients were all missing and raise.
    own = mlp["own_steps"]
    assert [[stage, cap] for stage, cap, _, _ in own["layouts"]] == LAYOUTS
    assert own["compute_s"] > 0 and all(step_s > 0 for _, _, step_s, _ in own["layouts"])


# As ddp.dist sets up and tears down a group: torch._dynamo imported before it (else the
# optimizer's first step imports it, holding the group past teardown, and Gloo's threads
# then run into interpreter shutdown, which now and then aborts the process), and every
# reference dropped before it is destroyed.
SLOW_STAGE = """
import json, os, sys, tempfile, time
import torch._dynamo
import torch.distributed as dist
import stages
from ddp.config import Config
from ddp.dist import teardown_process_group
from ddp.train import ComputeOnly
from profiling.simulate.cpu_cluster import measure

class Slow(ComputeOnly):  # the compute, and 20 ms of the stage's own after backward
    def __init__(self, module, *, process_group=None, bucket_cap_mb=None):
        super().__init__(module, process_group=process_group)
    def finish_gradient_synchronization(self):
        time.sleep(0.020)

class Cold(Slow):  # 50 ms more in the first of each two steps in a row, as after a switch
    steps = 0
    def finish_gradient_synchronization(self):
        Cold.steps += 1
        if Cold.steps % 2:
            time.sleep(0.050)

stages._load = lambda: {"slow": Slow, "cold": Cold}
store = dist.FileStore(tempfile.mkdtemp() + "/store", 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
cfg = Config(model="mlp", width=32, depth=2, batch_size=8)
print(json.dumps(measure.own_steps(cfg, [["slow", 1e6], ["cold", None]])))
teardown_process_group()
if os.path.isdir("/proc/self/task"):  # Linux: which threads outlived the teardown
    names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    left = [n.strip() for n in names if "gloo" in n]
    assert not left, f"Gloo's threads outlived the group's teardown: {left}"
"""


def test_a_stages_own_time_is_its_step_less_the_compute_alone():
    # A stage that is the compute and then sleeps 20 ms: its step, less the compute
    # alone in the same rounds, is about those 20 ms at least (and not the other way
    # round). One that sleeps 50 ms in the first of each two steps in a row only, as a
    # step just after a switch can pay for a cold cache: that first step is not timed.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SLOW_STAGE], capture_output=True, text=True, timeout=600,
        cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    own = json.loads(done.stdout.splitlines()[-1])
    [[stage, cap, step_s, extra_s], cold] = own["layouts"]
    assert (stage, cap) == ("slow", 1e6)
    assert 0.019 < extra_s < step_s and own["compute_s"] < step_s - 0.019
    assert cold[:2] == ["cold", None] and cold[3] < 0.010
