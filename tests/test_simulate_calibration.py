"""The calibration: the compute input, the fits of the cost and of the contention, and
the timed measurements on a one-rank group, against references worked out by hand or
taken from torch; no cluster, a few seconds in all."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ddp.config import Config
from ddp.models import build_model
from profiling.simulate.cpu_cluster import measure
from profiling.simulate.cpu_cluster.calibration import (
    buffer_bytes,
    busy_launch_s,
    call_s,
    cost_model,
    lanes,
    slope_s,
)
from profiling.simulate.cpu_cluster.contention import (
    LATENCY_SLOWDOWN_MAX,
    comm_slowdown,
    flight_under,
    latency_slowdowns,
    model_trickle,
    trickle_slowdowns,
)
from profiling.simulate.cpu_cluster.inputs import (
    Repeat,
    measure_workload,
    pooled_repeats,
    slowest_workload,
)
from profiling.simulate.schedule import linear_cost

# - inputs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_mlp():
    cfg = Config(model="mlp", width=64, depth=4, batch_size=16)
    return cfg, measure_workload(cfg, world_size=2, repeats=5, warmup=2)


def test_gradient_bytes_are_the_parameters_bytes_in_parameter_order(tiny_mlp):
    cfg, workload = tiny_mlp
    model = build_model(cfg.model, width=cfg.width, depth=cfg.depth)  # torch's own count
    expected = [(n, p.numel() * p.element_size()) for n, p in model.named_parameters()]
    assert [(g.name, g.nbytes) for g in workload.grads] == expected


def test_ready_times_run_last_layer_first_within_backward(tiny_mlp):
    _, workload = tiny_mlp
    ready = {g.name: g.ready_s for g in workload.grads}
    weights = [g.name for g in workload.grads if g.name.endswith("weight")]
    # Backward reaches the last layer first: each layer's weight after the next one's.
    for earlier, later in zip(weights, weights[1:], strict=False):
        assert ready[earlier] > ready[later], (earlier, later, ready)
    assert all(0 < g.ready_s <= workload.backward_s for g in workload.grads)
    assert workload.forward_s > 0 and workload.optimizer_s > 0


def test_slowest_rank_of_each_repeat_then_medians():
    def rep(f, b, o, *ready):
        return Repeat(f, b, o, ready)

    grads = [("w", 4), ("b", 4)]
    rank0 = [rep(1, 2, 1, 1.0, 2.0), rep(1, 5, 1, 3.0, 5.0), rep(1, 2, 1, 1.0, 2.0)]
    rank1 = [rep(2, 2, 1, 1.5, 2.0), rep(1, 2, 1, 1.0, 2.0), rep(1, 3, 1, 2.0, 3.0)]
    # Slowest per repeat: rank 1 (5 s), rank 0 (7 s), rank 1 (5 s).
    w = slowest_workload(grads, [rank0, rank1])
    assert (w.forward_s, w.backward_s, w.optimizer_s) == (1, 3, 1)  # medians of 2,1,1 / 2,5,3
    assert [g.ready_s for g in w.grads] == [2.0, 3.0]  # of 1.5,3,2 and 2,5,3


def test_inputs_time_on_one_thread_and_give_the_callers_back():
    from profiling.simulate.cpu_cluster.inputs import time_repeats

    before, seen = torch.get_num_threads(), []
    cfg = Config(model="mlp", width=16, depth=2, batch_size=4)
    time_repeats(
        cfg, repeats=2, warmup=1, before_repeat=lambda: seen.append(torch.get_num_threads())
    )
    assert seen == [1, 1, 1]
    assert torch.get_num_threads() == before  # no setting leaks to the tests after this one


def test_the_compute_is_pooled_over_the_repeats_in_a_row_and_every_spell_by_hand():
    # Two ranks. Of each repeat the slowest rank's step, then the medians over the three
    # in a row and the two spells' two each: seven repeats, worked out by hand.
    def r(forward, backward, ready):
        return Repeat(forward, backward, 0.0, (ready,))

    in_a_row = [
        [r(1, 2, 1), r(1, 2, 1), r(1, 2, 1)],  # rank 0
        [r(1, 1, 0.5), r(3, 2, 2), r(1, 1, 0.5)],  # rank 1: the slowest in repeat 1
    ]
    spells = [
        [[r(2, 4, 3), r(2, 4, 3)], [r(1, 1, 1), r(1, 1, 1)]],  # rank 0 the slowest
        [[r(1, 1, 1), r(1, 1, 1)], [r(2, 6, 5), r(2, 6, 5)]],  # rank 1 the slowest
    ]
    w = slowest_workload([("w", 4)], pooled_repeats(in_a_row, spells))
    # forward 1, 3, 1, 2, 2, 2, 2; backward 2, 2, 2, 4, 4, 6, 6; ready 1, 2, 1, 3, 3, 5, 5
    assert (w.forward_s, w.backward_s, w.grads[0].ready_s) == (2, 4, 3)
    alone = slowest_workload([("w", 4)], in_a_row)
    assert (alone.forward_s, alone.backward_s, alone.grads[0].ready_s) == (1, 2, 1)


# - calibration arithmetic ---------------------------------------------------------------

FIT = {"alpha_s": 1e-4, "beta_s_per_byte": 1e-8, "gamma": 1e-10, "free_bytes": 65536}


def test_cost_from_the_fit_by_hand():
    # Gloo's ring on 4 ranks, 1 MiB: 2(p-1) = 6 steps; one phase of 2(p-1)/p n = 1.5 MiB
    # through the link, of which 64 KiB free; (p-1)/p n = 0.75 MiB added.
    cost = cost_model(FIT, world_size=4)(2**20)
    assert cost.latency_s == pytest.approx(6 * 1e-4 + 0.75 * 2**20 * 1e-10)
    assert cost.wire_s == pytest.approx((1.5 * 2**20 - 65536) * 1e-8)
    # 2 ranks, 32 KiB: one phase of 32 KiB, under the free bytes: no wire time.
    small = cost_model(FIT, world_size=2)(32 * 2**10)
    assert small.wire_s == 0
    assert small.latency_s == pytest.approx(2 * 1e-4 + 16 * 2**10 * 1e-10)


def test_lanes_from_two_all_reduces_at_once():
    def measured(one, two):
        return [
            {"size_bytes": 4096, "one_s": one, "two_s": two},
            {"size_bytes": 2**22, "one_s": 1.0, "two_s": 2.0},
        ]

    assert lanes(measured(1e-3, 1.1e-3)) == 2  # together in about the time of one
    assert lanes(measured(1e-3, 2.0e-3)) == 1  # one after the other


def test_busy_launch_from_the_slopes_of_bursts_and_sequences_by_hand():
    # One after the other: 1 call in 3 ms, 16 in 18 ms, 1 ms a call. All at once: 1 in
    # 3 ms, 16 in 33 ms, 2 ms a call: a call queued behind others pays 1 ms more.
    sequence = {
        "size_bytes": 4096,
        "lengths": [1, 16],
        "seconds": [[3e-3] * 3, [18e-3] * 3],
        "async_seconds": [[3e-3] * 3, [33e-3] * 3],
    }
    assert busy_launch_s(sequence) == pytest.approx(1e-3)
    # All at once no slower than one by one: nothing more to pay.
    quick = {**sequence, "async_seconds": [[3e-3], [12e-3]]}
    assert busy_launch_s(quick) == 0


def test_a_call_in_a_sequence_costs_its_slope_beyond_the_fit_by_hand():
    # 1 call in 3 ms (most of it waiting for the slowest rank), 16 in 18 ms: 1 ms per
    # call; the fit says 0.4 ms for 4 KiB, so each call costs 0.6 ms more in a sequence.
    sequence = {"size_bytes": 4096, "lengths": [1, 16], "seconds": [[3e-3] * 3, [18e-3] * 3]}
    fitted = linear_cost(0.4e-3, 0.0)
    assert call_s(sequence, fitted) == pytest.approx(0.6e-3)
    # Listed the other way round, the slope is the same. 0.2 ms a call, below the fit:
    # each call costs 0.2 ms less in a sequence.
    backwards = {**sequence, "lengths": [16, 1], "seconds": [[18e-3], [3e-3]]}
    assert call_s(backwards, fitted) == pytest.approx(0.6e-3)
    assert call_s({**sequence, "seconds": [[3e-3], [6e-3]]}, fitted) == pytest.approx(-0.2e-3)
    # Added to every collective's latency, whatever its size; the wire is untouched.
    plain, slow = cost_model(FIT, 4)(2**20), cost_model(FIT, 4, call_s=0.6e-3)(2**20)
    assert slow.latency_s == pytest.approx(plain.latency_s + 0.6e-3)
    assert slow.wire_s == plain.wire_s
    # Less, but never below nothing.
    assert cost_model(FIT, 4, call_s=-1.0)(2**20).latency_s == 0


def test_communications_slowdown_from_when_it_ended_by_hand():
    # 2 s alone; launched with a 2 s backward, it ended at 3 s: its last 1 s ran alone,
    # so 1 s of its work took backward's 2 s, half speed: slowdown 1.
    assert comm_slowdown([[3.0, 2.0]], alone_s=2.0) == pytest.approx(1.0)
    # Over before backward was: 0.5 s of work in 1 s, half speed too.
    assert comm_slowdown([[1.0, 2.0]], alone_s=0.5) == pytest.approx(1.0)
    # The median over repeats: half speed, half speed, full speed.
    assert comm_slowdown([[3.0, 2.0], [3.0, 2.0], [2.0, 2.0]], 2.0) == pytest.approx(1.0)
    # Never faster than alone; and at most 1 / 0.05 slower (nothing done under backward).
    assert comm_slowdown([[1.5, 2.0]], alone_s=2.0) == 0
    assert comm_slowdown([[5.0, 2.0]], alone_s=2.0) == pytest.approx(19.0)


def test_flight_under_compute_by_hand():
    # Calls flying 1-3, launched at 2.5 and served 3-5, launched at 6 and flying to 7;
    # the compute ended at 6.5: in flight 1-5 and 6-6.5, 4.5 s; the second launched
    # while the first flew, the third not.
    calls = [[1.0, 3.0], [2.5, 5.0], [6.0, 7.0]]
    assert flight_under(calls, 6.5) == (4.5, 1)
    assert flight_under(calls, 10.0) == (5.0, 1)
    assert flight_under([], 1.0) == (0.0, 0)


def test_trickle_slowdowns_by_hand():
    # Compute 4 s alone took 5 s, with calls in flight for 3 s of it (2-4, then the
    # second, queued, 4-5): 1 s lost in 3, so 2 s of work in 3: slowdown 0.5. Two calls
    # of 1 s (0.5 more for the second, launched while the first flew): 2.5 s of work,
    # the last ended 1 s after the compute, so 1.5 s of it in the 3 s in flight: half
    # speed, slowdown 1.
    repeat = [5.0, 6.0, 4.0, [[2.0, 4.0], [3.0, 6.0]]]
    assert trickle_slowdowns(repeat, 1.0, 0.5) == pytest.approx((0.5, 1.0))
    # Lost more (2 s) than it flew (1 s): the uniform rate cannot place it, so the whole
    # compute's 6 against 4; all the calls' work after the compute: the floor rate.
    repeat = [6.0, 8.0, 4.0, [[5.0, 6.0], [6.0, 8.0]]]
    assert trickle_slowdowns(repeat, 1.0, 0.0) == pytest.approx((0.5, 19.0))


def test_trickle_slowdowns_give_back_the_models_own():
    # The model's trickle at known slowdowns, 16 calls of 0.5 ms a millisecond apart
    # (where the lane keeps up, the two ends alone fit a whole curve of pairs: the
    # flights tell them apart), and with calls that queue: each pair comes back.
    cost = linear_cost(0.5e-3, 1e-9)
    call_s = cost(4096).seconds
    for ls, cls in [(0.4, 3.0), (2.8, 1.2), (0.0, 0.5), (1.0, 0.0), (0.5, 0.5)]:
        repeat = model_trickle(16e-3, 16, cost, 0.0, ls, cls)
        assert trickle_slowdowns(repeat, call_s, 0.0) == pytest.approx((ls, cls), abs=1e-9)
    # The same ends from two pairs (2.8, 1.2) and (1, about 2.24): only the flights differ.
    a, b = (
        model_trickle(16e-3, 16, cost, 0.0, 2.8, 1.2),
        model_trickle(16e-3, 16, cost, 0.0, 1.0, 2.2425),
    )
    assert a[:2] == pytest.approx(b[:2], rel=1e-3)
    assert sum(a[3], []) != pytest.approx(sum(b[3], []), rel=1e-2)


def test_latency_slowdowns_give_back_the_models_trickle():
    # Repeats all made by the model at (0.8, 0.5): both come back.
    cost = linear_cost(0.5e-3, 0.0)
    repeats = [model_trickle(16e-3, 16, cost, 0.0, 0.8, 0.5) for _ in range(3)]
    sequence = {"size_bytes": 4096, "trickle": {"calls": 16, "repeats": repeats}}
    assert latency_slowdowns(sequence, cost, 0.0) == pytest.approx(
        {"latency_slowdown": 0.8, "comm_latency_slowdown": 0.5}, abs=1e-9
    )


def test_latency_slowdown_ends_the_models_trickle_at_the_median_repeat():
    # Three repeats made at (2.8, 1.2), (0.4, 3) and (1, 0.5), each with its own compute
    # alone (20, 16 and 13 ms: the median 16, not the mean, nor the first's).
    # Communication: each repeat's figure, the median, 1.2. Compute: the model's
    # trickle over the median alone at 1.2 ends where the median repeat's compute did;
    # the median of the three latency figures (1.0) ends it elsewhere.
    cost = linear_cost(0.5e-3, 0.0)
    made = [(20e-3, 2.8, 1.2), (16e-3, 0.4, 3.0), (13e-3, 1.0, 0.5)]
    repeats = [model_trickle(t, 16, cost, 0.0, ls, cls) for t, ls, cls in made]
    ends = [r[0] for r in repeats]
    median_end = sorted(ends)[1]
    assert median_end not in (ends[0], sum(ends) / 3)  # the median is its own figure
    sequence = {"size_bytes": 4096, "trickle": {"calls": 16, "repeats": repeats}}
    got = latency_slowdowns(sequence, cost, 0.0)
    assert got["comm_latency_slowdown"] == pytest.approx(1.2, abs=1e-9)
    replay = model_trickle(16e-3, 16, cost, 0.0, got["latency_slowdown"], 1.2)
    assert replay[0] == pytest.approx(median_end, rel=1e-9)
    at_medians = model_trickle(16e-3, 16, cost, 0.0, 1.0, 1.2)
    assert at_medians[0] != pytest.approx(median_end, rel=1e-2)
    # Computes that ended before the model's at no slowdown at all: 0, not below; so
    # late that no slowdown up to the fit's end reaches them: that end.
    for scale, expected in [(0.9, 0.0), (40.0, LATENCY_SLOWDOWN_MAX)]:
        sequence["trickle"]["repeats"] = [[r[2] * scale, r[1], r[2], r[3]] for r in repeats]
        assert latency_slowdowns(sequence, cost, 0.0)["latency_slowdown"] == expected


# - the measurements, on a one-rank group -------------------------------------------------


def test_copy_after_backward_is_seconds_per_byte_of_one_pass(monkeypatch):
    # On a clock that moves 1 s at every reading, every repeat's two passes (each
    # gradient divided into the flat buffer, then copied back) take 1 s between its
    # two readings: per byte of one pass over all the model's gradients, 1 / (2 x bytes).
    import itertools
    import time

    import torch.distributed as dist

    cfg = Config(model="mlp", width=16, depth=2, batch_size=4)
    model = build_model(cfg.model, width=cfg.width, depth=cfg.depth)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ticks = itertools.count()
        monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))
        per_byte = measure.copy_after_backward(cfg)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    assert per_byte == pytest.approx(1 / (2 * nbytes))


@contextlib.contextmanager
def clock_moved_by(monkeypatch, collective: str, seconds: float):
    """A one-rank Gloo group, on a clock that moves `seconds` at every call of
    `dist.<collective>` and never otherwise: yields {"now", "calls"}."""
    import time

    import torch.distributed as dist

    clock = {"now": 0.0, "calls": 0}
    real = getattr(dist, collective)

    def ticking(tensor, *args, **kwargs):
        clock["now"] += seconds
        clock["calls"] += 1
        return real(tensor, *args, **kwargs)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
        monkeypatch.setattr(dist, collective, ticking)
        yield clock
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_calls_after_backward_alternate_lengths_and_slope_by_hand(monkeypatch):
    # On a clock that moves only when a call is made, 1 s a call: repeats alternate 1 and
    # 16 calls, each length timed SEQUENCE_REPEATS times after the warm-up, and the
    # slope between them is 1 s a call.
    cfg = Config(model="mlp", width=16, depth=2, batch_size=4)
    with clock_moved_by(monkeypatch, "all_reduce", 1.0):
        sequence = measure.calls_after_backward(cfg)
    assert sequence["lengths"] == [1, 16]
    repeats = measure.SEQUENCE_REPEATS
    assert sequence["seconds"] == [[1.0] * repeats, [16.0] * repeats]
    assert slope_s(sequence) == pytest.approx(1.0)


def test_broadcast_buffers_times_one_broadcast_per_dtype_by_hand(monkeypatch):
    # On a clock that moves 1 ms at every broadcast: the CNN's buffers are two dtypes,
    # so each timed repeat is two broadcasts, 2 ms, the warm-up dropped. The MLP has no
    # buffers: 0, with nothing broadcast.
    with clock_moved_by(monkeypatch, "broadcast", 1e-3) as clock:
        cnn_s = measure.broadcast_buffers_s(Config(model="cnn", batch_size=4))
        calls = clock["calls"]
        mlp_s = measure.broadcast_buffers_s(Config(model="mlp", width=16, depth=2))
    assert cnn_s == pytest.approx(2e-3)
    assert calls == 2 * (measure.WARMUP + measure.BROADCAST_REPEATS)
    assert mlp_s == 0.0 and clock["calls"] == calls


def test_buffer_bytes_per_dtype_by_hand():
    # The CNN's five BatchNorms over 32, 32, 64, 64, 128 channels: running mean and
    # variance in float32, 2 x 320 x 4 bytes; a step count each in int64, 5 x 8 bytes.
    assert sorted(buffer_bytes(Config(model="cnn"))) == [40, 2560]
    assert buffer_bytes(Config(model="mlp")) == []
