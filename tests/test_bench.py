"""The benchmark's arithmetic (profiling.bench): the perfect-overlap and achievable
bounds, the ratios to them, sweeps, and the tables and figure made from them. Pure
functions on hand-made numbers: no processes, no timing."""

from __future__ import annotations

import json
import statistics

import pytest

from ddp.config import Config
from profiling.bench import output, versus
from profiling.bench.options import COMM, FLOOR, REFERENCE, sweep_configs
from profiling.bench.plot import plot
from profiling.bench.records import achievable_bound, perfect_overlap_bound, variant_entry


def result(name: str, times: list[float], rounds: list[int], **extra) -> dict:
    """A variant's raw result as `benchmark` makes it (seconds, slowest rank per step)."""
    return {
        "name": name,
        "sweep_value": None,
        "accumulation_steps": 1,
        "step_times_s": times,
        "step_rounds": rounds,
        "allreduce_mib": [],
        "syncs_per_step": 1,
        "replicas_identical": None if name in (FLOOR, COMM) else True,
        **extra,
    }


ROUNDS = [0, 0, 1, 1]


def floor(c=(0.40, 0.42, 0.44, 0.46), f=(0.10,) * 4, o=(0.05,) * 4) -> dict:
    return result(FLOOR, list(c), ROUNDS, forward_s=list(f), optimizer_s=list(o))


def test_bound_is_communication_plus_what_cannot_overlap_it():
    comm = result(COMM, [0.80, 0.82, 0.84, 0.86], ROUNDS)
    bound = perfect_overlap_bound(floor(), comm)
    # medians: C 0.43, F 0.10, A 0.83, O 0.05 -> max(0.43, 0.98)
    assert bound["bound_ms"] == pytest.approx(980.0)
    assert bound["bound_by"] == "communication"
    assert bound["compute_only_ms"] == pytest.approx(430.0)
    assert bound["communication_alone_ms"] == pytest.approx(830.0)
    # per round: round 0 max(0.41, 0.10 + 0.81 + 0.05), round 1 max(0.45, 0.10 + 0.85 + 0.05)
    assert bound["per_round_ms"] == {"0": pytest.approx(960.0), "1": pytest.approx(1000.0)}


def test_bound_is_compute_when_communication_is_cheap():
    comm = result(COMM, [0.01] * 4, ROUNDS)
    bound = perfect_overlap_bound(floor(), comm)
    assert bound["bound_ms"] == pytest.approx(430.0)
    assert bound["bound_by"] == "compute"


def test_no_bound_without_both_parts():
    assert perfect_overlap_bound(None, result(COMM, [0.1], [0])) is None
    assert perfect_overlap_bound(floor(), None) is None
    # A compute_only without its parts (an older record) has none either.
    assert perfect_overlap_bound(result(FLOOR, [0.1], [0]), result(COMM, [0.1], [0])) is None


def test_ratios_to_bound_and_reference_overall_and_per_round():
    comm = result(COMM, [0.80, 0.82, 0.84, 0.86], ROUNDS)
    stage = result("overlapped", [1.10, 1.12, 1.00, 1.04], ROUNDS)
    ddp = result(REFERENCE, [1.00, 1.00, 1.00, 1.00], ROUNDS)
    by_name = {r["name"]: r for r in (floor(), comm, stage, ddp)}
    bound = perfect_overlap_bound(by_name[FLOOR], comm)
    entry = variant_entry(stage, by_name, bound)
    assert entry["median_ms"] == pytest.approx(1070.0)
    assert entry["vs_bound"] == pytest.approx(1070.0 / 980.0)
    assert entry["vs_torch_ddp"] == pytest.approx(1.07)
    assert entry["vs_compute_only"] == pytest.approx(1.07 / 0.43)
    assert entry["exposed_comm_ms"] == pytest.approx(640.0)
    # round 0: 1.11 / 0.96, round 1: 1.02 / 1.00
    paired = entry["round_vs_bound"]
    assert paired["min"] == pytest.approx(1.02) and paired["max"] == pytest.approx(1.11 / 0.96)
    assert entry["round_vs_torch_ddp"]["max"] == pytest.approx(1.11)
    # Communication alone exposes nothing: it has no compute.
    assert variant_entry(comm, by_name, bound)["exposed_comm_ms"] is None


# Two layers' gradients; in round 0 the last layer's are ready at 0.15 s into the step,
# the first layer's at 0.30 and 0.31 s; in round 1 all 0.02 s later.
READY = [[0.15, 0.15, 0.30, 0.31]] * 2 + [[0.17, 0.17, 0.32, 0.33]] * 2


def timed_floor() -> dict:
    return {**floor(), "ready_s": READY, "grad_names": ["w1", "b1", "w0", "b0"]}


def timed_comm(ends: list[list[float]]) -> dict:
    """communication_alone with two buckets, the last layer's first (1 MiB), then the
    first layer's (7 MiB), ending at `ends` (seconds into the step, per step)."""
    return {
        **result(COMM, [e[-1] for e in ends], ROUNDS),
        "allreduce_mib": [1.0, 7.0],
        "bucket_end_s": ends,
        "bucket_names": [["b1", "w1"], ["b0", "w0"]],
    }


def test_achievable_bound_replays_buckets_from_when_their_gradients_were_ready():
    # The last bucket ends 0.70 s into the step in round 0, 0.76 in round 1: median
    # 0.73 s, of which the buckets take their bytes' share, 1/8 and 7/8: 0.09125 and
    # 0.63875 (not 0.31 and 0.42, their ends' differences). Median ready times: w1 b1
    # 0.16, w0 0.31, b0 0.32. Replayed: bucket 0 from 0.16 to 0.25125, bucket 1 from
    # 0.32 (its last gradient; bucket 0 has ended) to 0.95875; + optimizer 0.05
    # = 1.00875 > compute_only 0.43.
    comm = timed_comm([[0.30, 0.70]] * 2 + [[0.32, 0.76]] * 2)
    bound = achievable_bound(timed_floor(), comm)
    assert bound["bucket_ready_ms"] == pytest.approx([160.0, 320.0])
    assert bound["allreduce_ms"] == pytest.approx([91.25, 638.75])
    assert bound["bucket_end_ms"] == pytest.approx([310.0, 730.0])
    assert bound["last_allreduce_end_ms"] == pytest.approx(958.75)
    assert bound["achievable_ms"] == pytest.approx(1008.75)
    assert bound["achievable_by"] == "communication"
    # Round 0: 0.70 s -> 0.0875 + 0.6125; 0.15 -> 0.2375, 0.31 -> 0.9225; + 0.05.
    # Round 1: 0.76 s -> 0.095 + 0.665; 0.17 -> 0.265, 0.33 -> 0.995; + 0.05.
    assert bound["achievable_per_round_ms"] == {
        "0": pytest.approx(972.5),
        "1": pytest.approx(1045.0),
    }
    # The perfect-overlap bound of the same parts is looser: 0.10 + 0.73 + 0.05.
    assert perfect_overlap_bound(timed_floor(), comm)["bound_ms"] == pytest.approx(880.0)


def test_achievable_bound_is_compute_when_the_buckets_keep_up():
    # 0.02 s of communication: bucket 1 from 0.32 to 0.3375, + 0.05 < compute_only 0.43.
    bound = achievable_bound(timed_floor(), timed_comm([[0.01, 0.02]] * 4))
    assert bound["last_allreduce_end_ms"] == pytest.approx(337.5)
    assert bound["achievable_ms"] == pytest.approx(430.0)
    assert bound["achievable_by"] == "compute"


def test_no_achievable_bound_without_ready_times():
    comm = timed_comm([[0.30, 0.70]] * 4)
    assert achievable_bound(floor(), comm) is None
    assert achievable_bound(timed_floor(), result(COMM, [0.7] * 4, ROUNDS)) is None


def test_ratios_and_tables_show_both_bounds(capsys):
    comm = timed_comm([[0.30, 0.70]] * 2 + [[0.32, 0.76]] * 2)
    stage = result("overlapped", [1.10, 1.12, 1.00, 1.04], ROUNDS)
    by_name = {FLOOR: timed_floor(), COMM: comm, "overlapped": stage}
    bound = perfect_overlap_bound(timed_floor(), comm) | achievable_bound(timed_floor(), comm)
    entry = variant_entry(stage, by_name, bound)
    assert entry["vs_bound"] == pytest.approx(1070.0 / 880.0)
    assert entry["vs_achievable"] == pytest.approx(1070.0 / 1008.75)
    # round 0: 1.11 / 0.9725, round 1: 1.02 / 1.045
    assert entry["round_vs_achievable"]["min"] == pytest.approx(1.02 / 1.045)
    assert entry["round_vs_achievable"]["max"] == pytest.approx(1.11 / 0.9725)
    record = record_for_sweep()
    record["bounds"][0] |= achievable_bound(timed_floor(), comm)
    record["variants"][2] |= {"vs_achievable": entry["vs_achievable"]}  # cap 1's stage
    columns = output.columns(record)
    assert columns.index("vs achievable") == columns.index("per round vs bound") + 1
    assert [row[columns.index("vs achievable")] for row in output.rows(record)][:3] == [
        "n/a",  # compute_only: shared, no bound of its own
        "n/a",  # communication alone: nothing to bound
        "1.06x",  # 1070 / 1008.75
    ]
    header, body = output.sweep_summary(record)
    assert header[3:5] == ["bound ms", "achievable ms"]
    assert body[0][3:5] == ["980.0", "1008.8"]
    assert body[1][4] == "n/a"  # this value's bound has no ready times
    text = output.markdown([record])
    assert "achievable bound = max(compute_only 430.0, last all-reduce's end 958.8 + " in text
    assert "optimizer 50.0) = 1008.8 ms (communication-bound; 2 buckets" in text
    output.print_table(record)
    assert "achievable ms" in capsys.readouterr().out


def test_per_micro_batch_time_divides_by_the_micro_batches():
    stage = result("skip_sync", [2.0, 2.4], [0, 0], accumulation_steps=4)
    entry = variant_entry(stage, {"skip_sync": stage}, None)
    assert entry["per_micro_batch_ms"] == pytest.approx(550.0)
    assert entry["vs_bound"] is None and entry["round_vs_torch_ddp"] is None


@pytest.mark.parametrize(
    ("text", "field", "values"),
    [
        ("bucket_cap_mb=1e-6,1,25,1e6", "bucket_cap_mb", [1e-6, 1.0, 25.0, 1e6]),
        ("accumulation-steps=1,2,4,8", "accumulation_steps", [1, 2, 4, 8]),
        ("--batch-size=64,128", "batch_size", [64, 128]),
    ],
)
def test_sweep_makes_one_config_per_value(text, field, values):
    name, configs = sweep_configs(Config(), text)
    assert name == field
    assert [v for v, _ in configs] == values
    assert [getattr(c, field) for _, c in configs] == values
    assert all(c.model == Config().model for _, c in configs)


def test_no_sweep_is_one_config():
    cfg = Config()
    assert sweep_configs(cfg, "") == ("", [(None, cfg)])


@pytest.mark.parametrize(
    "text", ["lr=0.1,0.2", "bucket_cap_mb", "bucket_cap_mb=", "accumulation_steps=1,x",
             "accumulation_steps=1,1", "bucket_cap_mb=0,1", "accumulation_steps=1.5"],
)  # fmt: skip
def test_bad_sweeps_say_what_is_wrong(text):
    with pytest.raises(ValueError):
        sweep_configs(Config(), text)


def record_for_sweep() -> dict:
    """A bucket-cap sweep as make_record lays it out: compute_only ran once (shared)."""
    shared = variant_entry(floor(), {FLOOR: floor()}, None)
    variants, bounds = [shared], []
    for cap, comm_s, stage_s in ((1.0, 0.83, 1.07), (1e6, 0.80, 1.40)):
        comm = {**result(COMM, [comm_s] * 4, ROUNDS), "sweep_value": cap}
        stage = {**result("overlapped", [stage_s] * 4, ROUNDS), "sweep_value": cap}
        by_name = {FLOOR: floor(), COMM: comm, "overlapped": stage}
        bound = perfect_overlap_bound(floor(), comm)
        bounds.append({"sweep_value": cap, "accumulation_steps": 1, **bound})
        variants += [variant_entry(r, by_name, bound) for r in (comm, stage)]
    return {
        "workload": "mlp-sweep",
        "command": "python -m profiling.bench --sweep bucket_cap_mb=1,1e6",
        "machine": {
            "cpu": "cpu", "cores": 2, "usable_cores": 2, "threads_per_rank": 1,
            "torch": "2.13.0", "date_utc": "2026-01-01 00:00", "load_average_end": [1, 1, 1],
            "load_average_before": [1, 1, 1],
        },
        "settings": {
            "model": "mlp", "width": 2048, "depth": 7, "parameters": 25_198_602,
            "per_rank_batch": 256, "global_batch": 512, "accumulation_steps": 1,
            "bucket_cap_mb": 25.0, "sweep": {"field": "bucket_cap_mb", "values": [1.0, 1e6]},
            "backend": "gloo", "world_size": 2, "rounds": 2, "steps_per_round": 2,
            "warmup_steps": 3, "round_warmup": 1, "network": {"rate": "1gbit"},
            "elapsed_s": 10.0,
        },
        "bounds": bounds,
        "variants": variants,
    }  # fmt: skip


def test_sweep_summary_has_a_row_per_value_with_the_shared_floor_in_each():
    header, body = output.sweep_summary(record_for_sweep())
    assert header[0] == "bucket_cap_mb" and header[-1] == "overlapped ms (vs bound)"
    assert [row[0] for row in body] == ["1", "1e+06"]
    assert [row[1] for row in body] == ["430.0", "430.0"]  # compute_only, run once
    assert body[0][3:] == ["980.0", "1070.0 (1.09x)"]
    assert body[1][3:] == ["950.0", "1400.0 (1.47x)"]


def test_tables_show_the_bound_and_the_shared_variant_for_every_value(capsys):
    record = record_for_sweep()
    columns = output.columns(record)
    assert "vs bound" in columns and columns[0] == "bucket_cap_mb"
    table = output.rows(record)
    assert table[0][:2] == ["all", FLOOR]
    assert all(len(row) == len(columns) for row in table)
    text = output.markdown([record])
    assert "perfect-overlap bound = max(compute_only 430.0, forward 100.0" in text
    assert "= 980.0 ms (communication-bound)" in text
    output.print_table(record)
    assert "1070.0 (1.09x)" in capsys.readouterr().out


def test_records_without_a_bound_still_render():
    """Results written before the bound existed (docs/results/bench-loopback.json)."""
    record = record_for_sweep()
    del record["bounds"], record["settings"]["sweep"]
    for v in record["variants"]:
        v.pop("vs_bound"), v.pop("round_vs_bound")
    assert "vs bound" not in output.columns(record)
    assert "| variant |" in output.markdown([record])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    record = record_for_sweep()
    plain = json.loads(json.dumps(record))
    del plain["settings"]["sweep"]
    plain["variants"] = [v for v in plain["variants"] if v["sweep_value"] in (None, 1.0)]
    plain["bounds"] = plain["bounds"][:1]
    path = tmp_path / "bench.png"
    plot([record, plain], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_is_legible_at_page_width(tmp_path, monkeypatch):
    """Drawn 8 in wide at >= 150 dpi with no text under 10 pt, so that shown at the docs'
    width (about 770 px at 96 px/in) its text is about 10 pt."""
    pytest.importorskip("matplotlib")
    import matplotlib.text
    from PIL import Image

    sizes = []
    real_text = matplotlib.text.Text.draw

    def draw(self, renderer):  # every text drawn, with its size in points
        if self.get_visible() and self.get_text():
            sizes.append(self.get_fontsize())
        return real_text(self, renderer)

    monkeypatch.setattr(matplotlib.text.Text, "draw", draw)
    record = record_for_sweep()
    plain = json.loads(json.dumps(record))
    del plain["settings"]["sweep"]
    plain["variants"] = [v for v in plain["variants"] if v["sweep_value"] in (None, 1.0)]
    plain["bounds"] = plain["bounds"][:1]
    for records in ([record], [record, record], [plain], [plain, plain]):
        path = tmp_path / "bench.png"
        sizes.clear()
        plot(records, str(path))
        with Image.open(path) as image:
            dpi = image.info["dpi"][0]
            width_in = image.width / dpi
        assert dpi >= 150 and width_in <= 8.5, (len(records), dpi, width_in)
        assert sizes and min(sizes) >= 10, (len(records), sorted(set(sizes)))


def test_versus_pairs_rounds_and_picks_the_best_of_the_sweep():
    def entry(name, value, ms, choice=None):
        times = list(ms)
        return {
            "name": name, "sweep_value": value, "median_ms": statistics.median(times),
            "min_ms": min(times), "max_ms": max(times), "steps": 4, "rounds": 2,
            "step_times_ms": times, "step_rounds": ROUNDS,
            **({"auto_bucket_choice": choice} if choice else {}),
        }  # fmt: skip

    record = record_for_sweep()
    choice = {"layout": "cut", "bucket_cap_mb": 5.0, "bucket_sizes_bytes": [3 * 2**20, 2**20]}
    record["variants"] = [
        entry("drop_in_auto", None, [90, 92, 100, 104], choice),  # rounds: 91, 102
        entry("torch_ddp_default", None, [100, 100, 100, 100]),
        entry("drop_in", 1.0, [95, 95, 98, 98]),  # median 96.5: the best cap
        entry("drop_in", 1e6, [120, 120, 120, 120]),
    ]
    text = versus.table([record], "drop_in_auto", "torch_ddp_default", "drop_in")
    (cells,) = [line for line in text.splitlines() if line.startswith("| mlp")]
    cells = [c.strip() for c in cells.strip("|").split("|")]
    assert cells[0] == "mlp 2048x7, batch 256/rank, 1gbit"
    # medians 96 / 100; per round 91 / 100 and 102 / 100
    assert cells[4] == "0.960x (0.965x, 0.91-1.02)"
    assert cells[5] == "1: 96.5"
    # medians 96 / 96.5; per round 91 / 95 and 102 / 98
    assert cells[6] == f"{96 / 96.5:.3f}x ({(91 / 95 + 102 / 98) / 2:.3f}x, 0.96-1.04)"
    assert cells[7] == "cut: 2 buckets, 3/1 MiB"
