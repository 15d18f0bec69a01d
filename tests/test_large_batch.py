"""Large-minibatch training: the learning-rate rules against their formulas,
the no-decay parameter groups, the per-epoch split over workers, and k workers of n
against one process on the k*n batch, written here independently of the code under test."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from profiling.studies.large_batch.classification_data import (
    Split,
    classification_data,
    epoch_batches,
    worker_samplers,
)
from profiling.studies.large_batch.experiment import BatchNormMLP, build, train_run
from profiling.studies.large_batch.lr import large_batch_schedule, linear_scaled_lr
from profiling.studies.large_batch.param_groups import no_decay_param_groups
from profiling.studies.large_batch.settings import Settings
from tests.pool import RankError, check_no_errors

# ---------------------------------------------------------------- learning-rate rules


def expected_lr(t, *, base, scaled, warmup, warmup_iters, decay, milestones, gamma, total):
    """The paper's rules written out (arXiv 1706.02677, sections 2.1-2.2)."""
    if warmup != "none" and t < warmup_iters:
        if warmup == "gradual":
            return base + (scaled - base) * t / warmup_iters
        return base
    start = warmup_iters if warmup != "none" else 0
    if decay == "step":
        return scaled * gamma ** sum(m <= t for m in milestones)
    return scaled * (1 + math.cos(math.pi * (t - start) / max(total - start, 1))) / 2


@settings(max_examples=150, deadline=None)
@given(
    workers=st.integers(1, 64),
    per_worker=st.integers(1, 64),
    base_lr=st.floats(1e-3, 1.0),
    iters_per_epoch=st.integers(1, 12),
    epochs=st.integers(1, 8),
    warmup=st.sampled_from(["none", "gradual", "constant"]),
    decay=st.sampled_from(["step", "cosine"]),
    data=st.data(),
)
def test_schedule_matches_formula(
    workers, per_worker, base_lr, iters_per_epoch, epochs, warmup, decay, data
):
    warmup_epochs = data.draw(st.integers(0, epochs), label="warmup_epochs")
    total, warmup_iters = epochs * iters_per_epoch, warmup_epochs * iters_per_epoch
    first = warmup_iters if warmup != "none" else 0
    milestones = sorted(data.draw(st.sets(st.integers(first, total), max_size=3)))
    # base_lr is the rate at batch 256; warmup starts there, so scale from >= 256.
    scaled = linear_scaled_lr(base_lr, workers, per_worker)
    assert scaled == pytest.approx(base_lr * workers * per_worker / 256, rel=1e-12)
    start = min(base_lr, scaled)
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param, nn.Parameter(torch.zeros(1))], lr=scaled)
    scheduler = large_batch_schedule(
        optimizer,
        base_lr=start,
        total_iters=total,
        warmup=warmup,
        warmup_iters=warmup_iters,
        decay=decay,
        milestones=milestones,
        gamma=0.1,
    )
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
    for t in range(total):
        want = expected_lr(
            t,
            base=start,
            scaled=scaled,
            warmup=warmup,
            warmup_iters=warmup_iters,
            decay=decay,
            milestones=milestones,
            gamma=0.1,
            total=total,
        )
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(want, rel=1e-9, abs=1e-12 * scaled), (t, want)
        assert scheduler.get_last_lr()[0] == pytest.approx(want, rel=1e-9, abs=1e-12 * scaled)
        optimizer.step()
        scheduler.step()


def test_gradual_warmup_rises_by_a_constant_increment():
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=linear_scaled_lr(0.1, 32, 256))  # 3.2 at 8k
    scheduler = large_batch_schedule(
        optimizer, base_lr=0.1, total_iters=100, warmup="gradual", warmup_iters=10
    )
    lrs = []
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    steps = [b - a for a, b in zip(lrs[:10], lrs[1:11], strict=True)]
    assert lrs[0] == pytest.approx(0.1) and lrs[10] == pytest.approx(3.2)
    assert steps == pytest.approx([0.31] * 10)
    assert lrs[11] == pytest.approx(3.2)


def test_schedule_rejects_bad_input():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="milestones"):
        large_batch_schedule(optimizer, base_lr=0.1, total_iters=10, warmup_iters=5, milestones=[3])
    with pytest.raises(ValueError, match="warmup"):
        large_batch_schedule(optimizer, base_lr=0.1, total_iters=10, warmup="linear")
    with pytest.raises(ValueError, match="base_lr"):
        large_batch_schedule(optimizer, base_lr=2.0, total_iters=10, warmup_iters=2)


# ---------------------------------------------------------------- parameter groups


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 4)
        self.twin = nn.Linear(4, 4, bias=False)
        self.twin.weight = self.fc.weight  # shared: must appear once

    def forward(self, x):  # x: (B, 2, 3, 3)
        h = self.bn(self.conv(x)).flatten(1)  # (B, 4)
        return self.head(self.twin(self.ln(self.fc(h))))


def test_no_weight_decay_on_norms_and_biases():
    torch.manual_seed(0)
    model = Mixed()
    groups = no_decay_param_groups(model, weight_decay=0.5)
    decay, exempt = ({id(p) for p in g["params"]} for g in groups)
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    named = dict(model.named_parameters())  # shared weight listed once, as fc.weight
    want_decay = {"conv.weight", "fc.weight", "head.weight"}
    want_exempt = {"bn.weight", "bn.bias", "fc.bias", "ln.weight", "ln.bias", "head.bias"}
    assert decay == {id(named[n]) for n in want_decay}
    assert exempt == {id(named[n]) for n in want_exempt}
    # Behaviour, against SGD's documented update with zero gradient: w -= lr * wd * w
    # on the decayed weights only.
    before = {n: p.detach().clone() for n, p in named.items()}
    optimizer = torch.optim.SGD(groups, lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for n, p in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if n in want_decay else 1.0
        torch.testing.assert_close(p.detach(), before[n] * factor, msg=n)


# ---------------------------------------------------------------- the split over workers


@settings(max_examples=100, deadline=None)
@given(
    size=st.integers(1, 400),
    workers=st.integers(1, 8),
    per_worker=st.integers(1, 8),
    epoch=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_each_sample_goes_to_one_worker_per_epoch(size, workers, per_worker, epoch, seed):
    share = size // workers  # drop_last: every worker gets the same number
    if share < per_worker:
        with pytest.raises(ValueError, match="fewer than its batch"):
            epoch_batches(worker_samplers(size, workers, 0, workers, seed), epoch, per_worker)
        return
    batches = epoch_batches(worker_samplers(size, workers, 0, workers, seed), epoch, per_worker)
    assert len(batches) == share // per_worker
    assert all(len(b) == workers and all(len(i) == per_worker for i in b) for b in batches)
    seen = torch.cat([idx for step in batches for idx in step]).tolist()
    assert len(seen) == len(set(seen)) == len(batches) * workers * per_worker
    assert all(0 <= i < size for i in seen)
    if size % (workers * per_worker) == 0:
        assert sorted(seen) == list(range(size))  # every sample, exactly once
    # Ranks agree without talking: each builds only its own workers' samplers.
    for w in range(workers):
        alone = epoch_batches(worker_samplers(size, workers, w, 1, seed), epoch, per_worker)
        assert all(torch.equal(a[0], b[w]) for a, b in zip(alone, batches, strict=True))


def test_order_changes_with_the_epoch():
    samplers = worker_samplers(96, 4, 0, 4, seed=3)
    epochs = [
        torch.cat([i for step in epoch_batches(samplers, e, 4) for i in step]) for e in (0, 1)
    ]
    assert sorted(epochs[0].tolist()) == sorted(epochs[1].tolist()) == list(range(96))
    assert not torch.equal(epochs[0], epochs[1])
    again = torch.cat([i for step in epoch_batches(samplers, 0, 4) for i in step])
    assert torch.equal(again, epochs[0])  # set_epoch(0) again: the same order


# ---------------------------------------------------------------- k workers of n


def tiny(**changes) -> Settings:
    base = dict(
        per_worker_batch=4,
        epochs=2,
        warmup_epochs=1.0,
        decay_epochs="",
        base_lr=0.05,
        reference_batch=4,
        weight_decay=0.01,
        width=8,
        seeds=1,
        jobs=1,
    )
    return Settings(**{**base, **changes})


@pytest.fixture(scope="module")
def data() -> Split:
    return classification_data(train_samples=64, val_samples=16, features=8, classes=3, seed=1)


DECAYED = {"layers.0.weight", "layers.3.weight", "layers.6.weight"}  # not BatchNorm, not bias


def reference(s: Settings, data: Split, workers: int, seed: int, ghost: bool = True):
    """The paper's recipe, written out on one process: each iteration, the k*n samples
    of the epoch's permutation, forward in k chunks of n (each chunk its own BatchNorm
    statistics) or in one piece (ghost=False), the loss summed over all and divided by
    k*n, one SGD step; lr from the gradual-warmup formula; weight decay on weights."""
    torch.manual_seed(seed)
    model = BatchNormMLP(8, s.width, 3)
    n, x, y = s.per_worker_batch, *data.train.tensors
    iters = (len(x) // workers) // n
    scaled = s.base_lr * workers * n / s.reference_batch
    warmup_iters = round(s.warmup_epochs * iters)
    params = dict(model.named_parameters())
    velocity = {name: torch.zeros_like(p) for name, p in params.items()}
    t = 0
    for epoch in range(s.epochs):
        g = torch.Generator().manual_seed(seed + epoch)  # DistributedSampler's documented shuffle
        perm = torch.randperm(len(x), generator=g)[: workers * (len(x) // workers)]
        parts = [perm[w::workers] for w in range(workers)]
        for i in range(iters):
            chunks = [part[i * n : (i + 1) * n] for part in parts]
            if ghost:
                loss = sum(F.cross_entropy(model(x[c]), y[c], reduction="sum") for c in chunks)
            else:
                c = torch.cat(chunks)
                loss = F.cross_entropy(model(x[c]), y[c], reduction="sum")
            model.zero_grad()
            (loss / (workers * n)).backward()
            lr = s.base_lr + (scaled - s.base_lr) * t / warmup_iters if t < warmup_iters else scaled
            with torch.no_grad():
                for name, p in params.items():
                    d = p.grad + (s.weight_decay * p if name in DECAYED else 0)
                    velocity[name] = s.momentum * velocity[name] + d if t else d
                    p -= lr * velocity[name]
            t += 1
    return [p.detach() for p in model.parameters()]


def distributed_run(rank, group, s, data, workers, seed):
    import torch.distributed as dist

    assert dist.get_rank(group) == rank
    return train_run(s, data, workers, "gradual", seed, process_group=group, keep_params=True)


@pytest.mark.parametrize("world,workers", [(1, 4), (2, 4), (4, 4), (2, 8)])
def test_k_workers_of_n_equal_one_process_on_kn(pool, data, world, workers):
    s, seed = tiny(), 5
    results = pool.run(world, distributed_run, s, data, workers, seed)
    errors = [r for r in results if isinstance(r, RankError)]
    assert not errors, errors[0].traceback
    want = reference(s, data, workers, seed)
    simulated = train_run(s, data, workers, "gradual", seed, keep_params=True)  # one process
    for run in [*results, simulated]:
        for got, ref in zip(run.params, want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    # Training error is counted over all k workers' samples, on every rank.
    assert all(r.train_error == pytest.approx(simulated.train_error) for r in results)
    # The reference can tell: BatchNorm over the whole k*n batch is another model.
    whole = reference(s, data, workers, seed, ghost=False)
    assert any(
        not torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(whole, want, strict=True)
    )


def test_the_docs_figures_redrawn_from_their_json_are_legible(tmp_path, monkeypatch):
    """--render draws from the committed results, without training, at the docs' width."""
    from pathlib import Path

    from profiling.studies.large_batch import cli
    from tests.figures import assert_legible, record_font_sizes

    sizes = record_font_sizes(monkeypatch)
    results = Path(__file__).resolve().parent.parent / "docs" / "results" / "large-batch.json"
    trained = []
    monkeypatch.setattr(cli, "run_all", lambda s: trained.append(s))
    cli.main(["--render", str(results), "--plot-prefix", str(tmp_path / "lb")])
    assert not trained
    for name in ("lb-error.png", "lb-curves.png"):
        assert_legible(tmp_path / name, sizes)


def test_render_needs_a_plot_prefix():
    from profiling.studies.large_batch import cli

    with pytest.raises(SystemExit, match="--plot-prefix"):
        cli.main(["--render", "docs/results/large-batch.json"])


# ---------------------------------------------------------------- checkpoints


class Interrupted(Exception):
    """What the tests raise to stop a run at a chosen step, as a killed process would."""


def count_steps(steps: dict, interrupt: tuple[int, str, int, int] | None = None):
    """A replacement for experiment.build whose optimizers count their steps in `steps`,
    by (k, rule, seed), and raise Interrupted before step `interrupt[3]` of run
    `interrupt[:3]` (counted from that run's start in this process)."""

    def counting_build(s, data, workers, variant, seed):
        built = build(s, data, workers, variant, seed)
        key = (workers, variant, seed)
        steps[key] = 0

        def hook(*_):
            if interrupt == (*key, steps[key]):
                raise Interrupted(f"before step {steps[key]} of {key}")
            steps[key] += 1

        built[1].register_step_pre_hook(hook)  # built: model, optimizer, scheduler, ...
        return built

    return counting_build


def results(run) -> tuple:
    """What a run must end with, bit for bit: its parameters and every epoch's figures."""
    return run.params_sha256, run.train_loss, run.train_error, run.val_error, run.diverged


# Two runs (k = 2: 8 steps an epoch; k = 4: 4), 2 epochs, warmup over the first, a step
# decay half-way through the second. With a checkpoint every 3 steps, k = 4 saves at 3
# (in the warmup, mid-epoch), 6 (mid-epoch) and 8 (the end).
RESUMABLE = dict(
    workers="2,4", variants="gradual", decay_epochs="1.5", train_samples=64, val_samples=16
)


@pytest.fixture
def one_thread():
    """As the command line runs: tiny ops gain nothing from threads, and on a loaded
    machine waiting for them costs more than the op (tens of ms per BatchNorm)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_interrupted_experiment_resumes_bit_for_bit(tmp_path, monkeypatch, capsys, one_thread):
    from profiling.studies.large_batch import experiment

    reference = experiment.run_all(tiny(**RESUMABLE))  # never interrupted, no checkpoints
    s = tiny(**RESUMABLE, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    steps: dict = {}
    # k = 2 finishes; k = 4 stops after 5 steps, 2 past its checkpoint at step 3.
    monkeypatch.setattr(experiment, "build", count_steps(steps, (4, "gradual", 0, 5)))
    with pytest.raises(Interrupted):
        experiment.run_all(s)
    assert steps == {(2, "gradual", 0): 16, (4, "gradual", 0): 5}
    capsys.readouterr()
    steps.clear()
    monkeypatch.setattr(experiment, "build", count_steps(steps))
    resumed = experiment.run_all(s)
    err = capsys.readouterr().err
    # The finished run is read back, not trained; the other goes on from step 3.
    assert steps == {(2, "gradual", 0): 0, (4, "gradual", 0): 8 - 3}
    assert "k2-gradual-seed0: finished before" in err
    assert f"resuming from {tmp_path / 'k4-gradual-seed0' / 'step-00000003'} (step 3)" in err
    assert [results(r) for r in resumed] == [results(r) for r in reference]


def test_a_checkpoint_of_other_settings_is_refused(tmp_path, one_thread):
    from ddp.checkpoint import CheckpointError
    from profiling.studies.large_batch import experiment

    s = tiny(**{**RESUMABLE, "workers": "4"}, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    experiment.run_all(s)
    with pytest.raises(CheckpointError, match="base_lr 0.05 there, 0.1 here"):
        experiment.run_all(dataclasses.replace(s, base_lr=0.1))


def interrupted_run(rank, group, s, data, interrupt_at):
    """train_run on this rank, interrupted on every rank before step `interrupt_at`
    (the optimizer's pre-hook runs after the step's all-reduce: no rank is left in one)."""
    from profiling.studies.large_batch import experiment

    steps: dict = {}
    experiment.build = count_steps(
        steps, None if interrupt_at is None else (4, "gradual", 0, interrupt_at)
    )
    try:
        run = train_run(s, data, 4, "gradual", 0, process_group=group)
    except Interrupted:
        run = None
    finally:
        experiment.build = build
    return run, steps


def test_interrupted_run_on_two_ranks_resumes_bit_for_bit(pool, data, tmp_path):
    plain = tiny(decay_epochs="1.5")
    reference = check_no_errors(pool.run(2, interrupted_run, plain, data, None))
    s = dataclasses.replace(plain, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    stopped = check_no_errors(pool.run(2, interrupted_run, s, data, 5))
    assert all(run is None for run, _ in stopped)
    resumed = check_no_errors(pool.run(2, interrupted_run, s, data, None))
    assert [steps for _, steps in resumed] == [{(4, "gradual", 0): 8 - 3}] * 2
    assert sorted((tmp_path / "k4-gradual-seed0" / "step-00000008").iterdir()) == [
        tmp_path / "k4-gradual-seed0" / "step-00000008" / name
        for name in ("COMMITTED", "rank-00000.pt", "rank-00001.pt")
    ]
    for (run, _), (want, _) in zip(resumed, reference, strict=True):
        assert results(run) == results(want)
