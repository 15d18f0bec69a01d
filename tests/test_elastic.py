"""Losing a server (`--elastic`, ddp/elastic.py): the two policies' plans, learning rates
and sample ids, checked in one process against their formulas; checkpoints of another
world size taken, another policy's refused; and on loopback, a run under torchrun's
elastic rendezvous that loses one of its two agents, re-forms and goes on, with no sample
lost or trained twice and the parameters of an uninterrupted run from the same
checkpoint, bit for bit. The 10-trial harness on the virtual cluster is
`make elastic-trials` (docs/when-a-server-is-lost.md)."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp import checkpoint, elastic
from ddp.config import Config, config_parser
from ddp.models import build_model
from ddp.train import stage_wrap, train
from profiling.studies import elastic_trials
from stages import STAGES

KEEP, SCALE = elastic.KEEP_GLOBAL_BATCH, elastic.SCALE_LR


# -- the plans, the learning rate, the samples -------------------------------------------


def test_keep_global_batch_splits_the_same_global_batch_over_any_world() -> None:
    cfg = Config(elastic=KEEP, global_batch_size=64, lr=0.1, accumulation_steps=2)
    plans = {w: elastic.plan(cfg, w) for w in (4, 2, 1)}
    assert {w: (p.per_rank, p.global_batch, p.micro_batches, p.lr) for w, p in plans.items()} == {
        4: (16, 64, 2, 0.1), 2: (32, 64, 2, 0.1), 1: (64, 64, 2, 0.1)
    }  # fmt: skip
    with pytest.raises(ValueError, match="global batch 64 does not split over the 3 ranks"):
        elastic.plan(cfg, 3)


def test_scale_lr_keeps_the_batch_per_rank_and_scales_the_rate_linearly() -> None:
    cfg = Config(elastic=SCALE, batch_size=16, global_batch_size=64, lr=0.1)
    plans = {w: elastic.plan(cfg, w) for w in (4, 2, 3)}
    assert {w: (p.per_rank, p.global_batch) for w, p in plans.items()} == {
        4: (16, 64), 2: (16, 32), 3: (16, 48)
    }  # fmt: skip
    # Goyal et al.: a global batch s times the reference's trains at s times its rate.
    assert [plans[w].lr for w in (4, 2, 3)] == [0.1 * 64 / 64, 0.1 * 32 / 64, 0.1 * 48 / 64]
    assert cfg.global_batch(2) == 32  # what the table and the batch check see


def test_every_epoch_trains_every_sample_of_the_data_set_once_in_an_order_of_its_own():
    model = build_model("mlp", width=4, depth=2)
    data = elastic.DataSet(model, size=10, seed=3)
    inputs, labels = data[range(0, 25)]  # two epochs and a half, as steps would ask for them
    rows = [int((data.inputs == x).all(dim=1).nonzero()) for x in inputs]
    assert sorted(rows[:10]) == sorted(rows[10:20]) == list(range(10))
    assert rows[:10] != rows[10:20]  # shuffled anew each epoch
    assert torch.equal(labels, data.labels[rows])
    again = [int((data.inputs == x).all(dim=1).nonzero()) for x in data[range(13, 17)][0]]
    assert again == rows[13:17]  # a function of the id only: any split asks the same


def test_elastic_needs_the_planned_global_batch() -> None:
    with pytest.raises(ValueError, match="--elastic scale-lr needs --global-batch-size"):
        Config(elastic=SCALE)


def test_the_rate_falls_at_once_and_rises_over_the_warmup_as_a_function_of_the_step() -> None:
    start = elastic.next_ramp(None, 0.1, 0, 5)
    assert [start.lr(s) for s in (0, 7)] == [0.1, 0.1]
    down = elastic.next_ramp(start, 0.05, 12, 5)  # a node lost at step 12
    assert [down.lr(s) for s in (12, 13)] == [0.05, 0.05]
    up = elastic.next_ramp(down, 0.1, 20, 5)  # it comes back at step 20
    assert [up.lr(s) for s in range(20, 27)] == pytest.approx([0.05, 0.06, 0.07, 0.08, 0.09,
                                                               0.1, 0.1])  # fmt: skip
    assert up.lr(25) == 0.1  # exactly the target at the end, not a rounding of it
    # A restart at the same world keeps the ramp: the rates of an uninterrupted run.
    assert elastic.next_ramp(up, 0.1, 22, 5) == up
    # Lost again mid-ramp: down at once from where the ramp stood.
    assert elastic.next_ramp(up, 0.05, 22, 5).lr(22) == 0.05


def train_with_losses(cfg: Config, worlds: list[tuple[int, int, int]]) -> dict:
    """The sample log a run would write: `worlds` is (world, first step, last step + 1)
    per group; each group resumes from the step the next one starts at, the steps after
    it trained and thrown away. The data position (blocks) goes through the checkpoint
    as Elastic keeps it: its value after the resumed step."""
    logs, blocks_at = {}, {0: 0}
    for g, (world, first, end) in enumerate(worlds):
        p, blocks = elastic.plan(cfg, world), blocks_at[first]
        for step in range(first, end):
            for rank in range(world):
                ids = elastic.sample_ids(p, step, blocks, rank)
                line = {"step": step, "time": g, "ids": [[r.start, r.stop] for r in ids]}
                logs.setdefault((f"{g}-{world}", rank), []).append(line)
            blocks += p.micro_batches * world
            blocks_at[step + 1] = blocks
    return logs


@pytest.mark.parametrize("policy", [KEEP, SCALE])
def test_no_sample_is_lost_or_repeated_across_changes_of_world(policy: str) -> None:
    cfg = Config(elastic=policy, batch_size=4, global_batch_size=16, accumulation_steps=2)
    # 4 ranks to step 9 (checkpoint at 6), 2 ranks from 6 to 14, back to 4 from 12 to 20.
    logs = train_with_losses(cfg, [(4, 0, 9), (2, 6, 14), (4, 12, 20)])
    kept = elastic_trials.kept_samples(logs)
    expected = 20 * 2 * 16 if policy == KEEP else None  # steps x micro-batches x batch
    assert elastic_trials.lost_and_repeated(kept, expected) == (0, 0)
    if policy == SCALE:  # the stream: 6 + 8 steps of 4 ranks, 6 of 2; 2 micro-batches of 4
        assert sorted(kept) == list(range((14 * 4 + 6 * 2) * 2 * 4))


def test_the_sample_check_sees_a_repeat_and_a_gap() -> None:
    cfg = Config(elastic=SCALE, batch_size=4, global_batch_size=16)
    logs = train_with_losses(cfg, [(4, 0, 9), (2, 6, 14)])
    again = {key: [dict(line) for line in lines] for key, lines in logs.items()}
    again["1-2", 0][0]["ids"] = again["0-4", 0][0]["ids"]  # step 6 trains step 0's samples
    lost, repeated = elastic_trials.lost_and_repeated(elastic_trials.kept_samples(again))
    assert repeated == 4 and lost == 4


# -- checkpoints -------------------------------------------------------------------------


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def add_rank_file(step_dir: Path, source: Path) -> None:
    """Make a committed checkpoint one rank larger: its next rank's file, a copy of
    `source`, in the manifest as the ranks' own files are."""
    manifest = json.loads((step_dir / checkpoint.COMMITTED).read_text())
    name = f"rank-{len(manifest['files']):05d}.pt"
    data = source.read_bytes()
    (step_dir / name).write_bytes(data)
    manifest["files"].append({"file": name, "bytes": len(data),
                              "sha256": hashlib.sha256(data).hexdigest()})  # fmt: skip
    (step_dir / checkpoint.COMMITTED).write_text(json.dumps(manifest))


def test_rank_r_of_any_world_reads_rank_r_mod_w(group, tmp_path: Path) -> None:
    settings = elastic.settings(Config(elastic=KEEP, global_batch_size=8))
    models = [torch.nn.Linear(4, 3) for _ in range(2)]  # rank 1's file holds another model
    step_dirs = [
        checkpoint.save(tmp_path / str(r), 6, m, torch.optim.SGD(m.parameters()), settings)
        for r, m in enumerate(models)
    ]
    add_rank_file(step_dirs[0], step_dirs[1] / "rank-00000.pt")  # as 2 ranks write it
    for rank, source in ((0, 0), (1, 1), (2, 0), (3, 1)):
        state = checkpoint.read_rank_file(step_dirs[0], rank, settings, any_world=True)
        assert torch.equal(state["model"]["weight"], models[source].weight), rank
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.read_rank_file(step_dirs[0], 2, settings)  # without --elastic: no such rank


def test_the_newest_committed_checkpoints_are_kept(group, tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (tmp_path / "step-00000012").mkdir()  # a write that did not finish
    for step in (4, 8, 12):
        checkpoint.save(tmp_path, step, model, optimizer, {"a": 1}, keep=2)
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step-00000008", "step-00000012"]
    checkpoint.save(tmp_path, 16, model, optimizer, {"a": 1})  # keep=1, the default
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step-00000016"]


def test_another_policy_or_model_is_refused_and_the_world_size_is_not(group, tmp_path) -> None:
    cfg = Config(elastic=KEEP, global_batch_size=8)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    position = {"world_size": 2, "blocks": 0, "ramp": {"start": 0, "from_lr": 0.01,
                                                       "to_lr": 0.01, "steps": 0}}  # fmt: skip
    checkpoint.save(tmp_path, 6, model, optimizer, elastic.settings(cfg), position=position)
    state = checkpoint.restore(tmp_path, model, optimizer, elastic.settings(cfg), any_world=True)
    assert state["data"]["world_size"] == 2  # written by 2 ranks, resumed by 1
    refusals = [
        (Config(elastic=SCALE, global_batch_size=8), "elastic keep-global-batch there, scale-lr"),
        (Config(elastic=KEEP, global_batch_size=8, width=128), "width 256 there, 128 here"),
    ]
    for other, message in refusals:
        with pytest.raises(checkpoint.CheckpointError, match=message):
            checkpoint.restore(tmp_path, model, optimizer, elastic.settings(other), any_world=True)
    plain = checkpoint.run_settings(Config(global_batch_size=8), 8, 1)  # a run without --elastic
    with pytest.raises(checkpoint.CheckpointError, match="world_size \\(absent\\) there, 1 here"):
        checkpoint.restore(tmp_path, model, optimizer, plain)


# -- the loop: on loopback, torchrun re-forms the group and the run goes on ----------------


def loopback_args(policy: str) -> argparse.Namespace:
    """The harness's options on loopback: 2 agents of 1 rank, a short run."""
    return elastic_trials.options([
        "--loopback", "--policy", policy, "--nodes", "2", "--ranks-per-node", "1",
        "--steps", "16", "--every", "4", "--width", "64", "--depth", "2", "--batch-size", "8",
        "--hang-s", "600",  # only a hang reaches it
        # The agents start together, but on a loaded machine one may import torch seconds
        # after the other: the first rendezvous waits 10 s for it (each re-formation too).
        "--last-call-s", "10",
    ])  # fmt: skip


def config_of(args: argparse.Namespace, checkpoint_dir: Path) -> Config:
    """The Config of the harness's training command line (after `-m stages.drop_in`)."""
    argv = elastic_trials.training_args(args, str(checkpoint_dir), seed=0)[2:]
    return Config(**vars(config_parser("stages.drop_in").parse_args(argv)))


def train_here(cfg: Config) -> str:
    """Train `cfg` in this process on the one-rank group of the `group` fixture, as
    torchrun's one worker does, on one thread as the harness's workers; params sha256."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(
            "drop_in", stage_wrap(STAGES["drop_in"]), cfg, torch.device("cpu")
        ).params_sha256
    finally:
        torch.set_num_threads(threads)


def test_a_lost_agent_leaves_a_run_that_re_forms_and_matches_its_reference(group, tmp_path):
    """Keep the global batch: agent 1 is killed (its torchrun and worker) at step 9, past
    the checkpoint at 8; agent 0 re-forms alone, resumes step 8, and finishes: every
    sample once, nothing left running, and the parameters of a 1-rank run (here) from a
    copy of the same checkpoint, bit for bit."""
    args = loopback_args(KEEP)
    place = elastic_trials.Loopback(args)
    run = elastic_trials.run_elastic(place, args, tmp_path / "trial", seed=0, lose_at=9)
    trial = elastic_trials.judge(elastic_trials.Trial(lose_at=9), run, args)
    assert trial.continued and trial.world_after == 1, trial.tail
    # The checkpoint at 8, or a later one if agent 0 ran on before it saw the loss.
    assert trial.resumed_from is not None and trial.resumed_from >= 8, trial.tail
    assert (trial.lost, trial.repeated) == (0, 0)
    assert trial.leftovers == []
    name = f"drop_in/step-{trial.resumed_from:08d}"
    shutil.copytree(run.checkpoint_dir / name, tmp_path / "reference" / name)
    assert trial.sha256 == train_here(config_of(args, tmp_path / "reference"))


def test_scale_lr_goes_on_with_the_stream_and_the_scaled_rate(
    group, tmp_path: Path, monkeypatch, capsys
) -> None:
    """Batch per rank kept: 1 rank resumes the checkpoint that 2 ranks wrote after 8 steps
    (16 blocks of 8 samples taken): half the rate, twice the steps for the samples left,
    and the stream goes on where it was: the 16 x 16 samples planned, each once."""
    args = loopback_args(SCALE)
    cfg = config_of(args, tmp_path)
    model = build_model("mlp", width=cfg.width, depth=cfg.depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    ramp = {"start": 0, "from_lr": 0.01, "to_lr": 0.01, "steps": 0}
    step_dir = checkpoint.save(tmp_path / "drop_in", 8, model, optimizer, elastic.settings(cfg),
                               position={"world_size": 2, "blocks": 16, "ramp": ramp})  # fmt: skip
    add_rank_file(step_dir, step_dir / "rank-00000.pt")  # as 2 ranks write it
    monkeypatch.setenv(elastic.SAMPLE_LOG, str(tmp_path / "samples"))
    train_here(cfg)
    said = capsys.readouterr().out
    assert "re-formed from 2 to 1 rank, step 8 to 24" in said, said
    assert "lr 0.005 (--lr 0.01 x 8/16)" in said, said
    kept = elastic_trials.kept_samples(elastic_trials.read_sample_log(tmp_path / "samples"))
    assert sorted(kept) == list(range(16 * 8, 16 * 16))  # after the 16 blocks taken
