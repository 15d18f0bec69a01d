"""The command line and console as a user meets them: --help describes every option,
a bad value is refused with the usage line before anything starts, the main job's table
lines up, and progress is one line per finished run where output is not a terminal."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
import torch

from ddp import progress as progress_module
from ddp.config import Config, parse_config
from ddp.progress import Progress
from ddp.train import RunResult, format_table, main
from profiling.studies.large_batch.experiment import run_all
from profiling.studies.large_batch.settings import Settings
from stages import STAGES, standard_runs
from tests.test_torchrun import ROOT, torchrun


def help_entries(text: str) -> dict[str, str]:
    """--help's option entries: flag -> its help, wrapped lines joined."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (--[\w-]+|-h)", line)
        if match:
            flag = match.group(1)
            entries[flag] = line[match.end() :]
        elif flag and line.startswith("   "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return {flag: " ".join(help.split()) for flag, help in entries.items()}


def shown_default(value: object) -> str:
    return "off" if value == "" or value is False else str(value)


def stage_help(stage: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        main(STAGES[stage], ["--help"])
    assert exit.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("stage", list(STAGES))
def test_help_names_every_field_with_its_default(stage: str, capsys) -> None:
    entries = help_entries(stage_help(stage, capsys))
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        assert flag in entries, f"{stage}: {flag} missing from --help"
        if stage == "naive" and f.name == "bucket_cap_mb":
            assert "does not apply" in entries[flag] and "no buckets" in entries[flag]
            continue
        if f.name == "runs":  # the main job's: a stage trains one run
            assert "does not apply" in entries[flag] and "main job" in entries[flag]
            continue
        assert f"(default: {shown_default(f.default)})" in entries[flag], (flag, entries[flag])
        assert len(entries[flag]) > len("(default: )") + 10, f"{flag} has no description"


def test_main_job_help_shows_descriptions_defaults_and_choices() -> None:
    out = torchrun(2, "-m", "stages", "--help", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("usage: torchrun ... -m stages") == 1  # rank 0's, not one per rank
    entries = help_entries(out.stdout)
    for f in dataclasses.fields(Config):
        assert f"(default: {shown_default(f.default)})" in entries["--" + f.name.replace("_", "-")]
    # The choices are the models that exist and the backends torch can use, nothing else.
    models = re.search(r"--model \{([\w,]+)\}", out.stdout).group(1).split(",")
    assert models == ["mlp", "cnn", "transformer", "frozen"]
    assert re.search(r"--backend \{([\w,]+)\}", out.stdout).group(1) == "gloo,nccl,auto"
    assert "MLP units per layer" in entries["--width"]


BAD_VALUES = [
    (["--model", "foo"], "argument --model: invalid choice: 'foo'"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
]
if not torch.cuda.is_available():
    BAD_VALUES.append((["--backend", "nccl"], "--backend nccl needs CUDA"))


def test_a_bad_value_is_refused_with_the_usage_line_before_any_process_group(group_log) -> None:
    """Under torchrun, end to end, for one bad value: every bad value takes the same path
    (argparse's error, before any process group), and each one's message is checked in
    one process below."""
    args, message = BAD_VALUES[1]
    out = torchrun(2, "-m", "stages.naive", *args, timeout=300)  # only a hang reaches it
    assert out.returncode != 0
    # Once, from rank 0: every rank parses the same arguments, only rank 0 says so.
    assert out.stderr.count("usage: torchrun ... -m stages.naive") == 1, out.stderr
    assert out.stderr.count(message) == 1, out.stderr
    # No traceback from any rank. torchrun itself ends with its ChildFailedError block,
    # whose own traceback runs through torch's launcher only, never through our code.
    assert "[rank" not in out.stderr and str(ROOT / "ddp") not in out.stderr, out.stderr
    assert out.stderr.count("Traceback") <= 1
    if "Traceback" in out.stderr:
        assert "ChildFailedError" in out.stderr
    # Rank 0, which printed why, is the root cause torchrun names, with argparse's status.
    root_cause = out.stderr.split("Root Cause", 1)[1]
    assert re.search(r"rank\s+: 0 .*\n\s+exitcode\s+: 2\b", root_cause), root_cause
    # Before any process group: neither rank met the other at a store, nor made a group.
    made = group_log.made(ranks=2)
    assert made == [], f"refused only after: {made}"


@pytest.mark.parametrize(("args", "message"), BAD_VALUES)
def test_each_bad_value_is_refused_with_its_message(
    args: list[str], message: str, capsys, monkeypatch
) -> None:
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)  # as torchrun sets them: parsing checks them first
    with pytest.raises(SystemExit) as exit:
        main(STAGES["naive"], args)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count(message) == 1 and "usage: torchrun ... -m stages.naive" in err, err


def test_naive_refuses_a_bucket_cap(capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(STAGES["naive"], ["--bucket-cap-mb", "5"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: torchrun ... -m stages.naive")
    assert "--bucket-cap-mb does not apply: naive has no buckets" in err


def test_bucket_cap_auto_where_the_stage_measures_its_own(capsys, monkeypatch) -> None:
    from profiling.bench.options import parse_options

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = parse_config(["--bucket-cap-mb", "auto"], module="stages.auto_bucket",
                       auto_bucket_cap=True)  # fmt: skip
    assert cfg.bucket_cap_mb == "auto"
    for parse in (
        lambda: parse_config(["--bucket-cap-mb", "auto"], module="stages.bucketed"),
        lambda: parse_config(["--bucket-cap-mb", "lots"], module="stages.auto_bucket"),
        lambda: parse_options(["--bucket-cap-mb", "auto"]),
    ):
        with pytest.raises(SystemExit) as exit:
            parse()
        assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--bucket-cap-mb auto: stages.bucketed takes a number of MiB" in err
    assert "'lots': give MiB (a number) or auto" in err
    assert "the automatic bucket size is the drop_in_auto variant" in err


def test_a_switch_that_does_not_apply_is_refused_by_name(capsys) -> None:
    from profiling.bench.options import parse_options

    with pytest.raises(SystemExit) as exit:
        parse_options(["--deterministic"])
    assert exit.value.code == 2
    assert "--deterministic does not apply: the benchmark times" in capsys.readouterr().err


def test_nccl_with_more_ranks_than_gpus_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit:
        parse_config(["--backend", "nccl"], module="stages")
    assert exit.value.code == 2
    assert (
        "--backend nccl needs a GPU per rank: 2 ranks on this node, 1 GPUs"
        in capsys.readouterr().err
    )


def test_auto_takes_gloo_where_a_node_has_fewer_gpus_than_ranks(monkeypatch) -> None:
    import torch.distributed as dist

    from ddp.dist import setup_process_group, teardown_process_group
    from profiling.studies.fault_trials import free_port

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    device = setup_process_group("auto")
    try:
        assert device == torch.device("cpu") and dist.get_backend() == "gloo"
    finally:
        teardown_process_group()


def test_without_torchrun_the_parser_says_how_to_launch(monkeypatch, capsys) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit:
        parse_config([], module="stages")
    assert exit.value.code == 2
    assert "launch with torchrun, e.g. `torchrun --standalone" in capsys.readouterr().err


TABLE_ROW = re.compile(r"^(\w+) +(\d+\.\d\d) +(\d+\.\d\dx) +(True|False|n/a \(no sync\))$")


def assert_table_aligned(table: str, names: list[str]) -> None:
    """Every row's cells end where the header's column titles end (numbers right-aligned),
    names start in column 0, and the note under the table explains the ratio."""
    lines = table.strip("\n").splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    title = lines[header]
    ends = [title.index(t) + len(t) for t in ("step ms", "vs torch_ddp", "replicas identical")]
    rows = lines[header + 1 : header + 1 + len(names)]
    assert [row.split()[0] for row in rows] == names
    for row in rows:
        match = TABLE_ROW.match(row)
        assert match, row
        assert [match.end(i) for i in (2, 3, 4)] == ends, f"misaligned:\n{title}\n{row}"
    note = lines[header + 1 + len(names)]
    assert "below 1.00x is faster" in note and "noise" in note and "docs/benchmarks.md" in note


def test_table_aligns_for_the_longest_stage_name() -> None:
    names = list(standard_runs())
    assert max(names, key=len) == "rebuilt_buckets"
    # Step times of every magnitude, so cell widths differ too.
    results = [
        RunResult(name, [10.0 ** (i % 5 - 3) * 1.2345], True, 0.0) for i, name in enumerate(names)
    ]
    table = format_table(results, Config(), 2, "gloo", reference="torch_ddp")
    assert_table_aligned(table, names)


PROGRESS_LINE = re.compile(
    r"^\[(\d+)/(\d+)\] (\w+): (\d+) steps, [\d.]+ ms/step \(this rank, warm-up included\), "
    r"[\d.]+ s; (.*)$"
)


def test_main_job_table_and_progress_on_a_pipe() -> None:
    out = torchrun(
        2, "-m", "stages", "--width", "8", "--depth", "2", "--batch-size", "2",
        "--steps", "2", "--warmup-steps", "1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    names = list(standard_runs())
    assert_table_aligned(out.stdout, names)
    # The batch per optimizer step, and what it is made of; the progress line's step time
    # says whose it is, beside the table's.
    assert "global batch=4 per optimizer step (1 micro-batch of 4)" in out.stdout
    # Not a terminal: no redrawing, one line per finished run, from rank 0 alone, and
    # nothing else (torchrun prints its OMP_NUM_THREADS notice only when that is unset).
    assert "\r" not in out.stderr and "\x1b" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == len(names), out.stderr
    for i, (line, name) in enumerate(zip(lines, names, strict=True), start=1):
        match = PROGRESS_LINE.match(line)
        assert match, line
        assert match.groups()[:4] == (str(i), str(len(names)), name, "3")
        assert match.group(5).endswith("left") if i < len(names) else "all 16 in" in line


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_estimates_what_is_left_and_prints_one_line_per_run(monkeypatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    monkeypatch.delenv("RANK", raising=False)
    log = io.StringIO()  # not a terminal
    progress = Progress(runs=4, work=4 * 10, stream=log)
    for run in range(4):
        progress.start(f"run{run}", steps=10)
        for _ in range(10):
            clock.now += 0.5
            progress.step(0.5)
        progress.finish()
    # By hand: each run takes 10 steps of 0.5 s, so after run r, (4 - r) * 5 s are left.
    assert log.getvalue().splitlines() == [
        "[1/4] run0: 10 steps, 500.0 ms/step, 5.0 s; ~15 s left",
        "[2/4] run1: 10 steps, 500.0 ms/step, 5.0 s; ~10 s left",
        "[3/4] run2: 10 steps, 500.0 ms/step, 5.0 s; ~5.0 s left",
        "[4/4] run3: 10 steps, 500.0 ms/step, 5.0 s; all 4 in 20 s",
    ]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_line_on_a_terminal(monkeypatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    monkeypatch.delenv("RANK", raising=False)
    screen = Terminal()
    progress = Progress(runs=2, work=2 * 4, stream=screen)
    progress.start("naive", steps=4)
    for _ in range(2):
        clock.now += 1.0  # slower than the redraw interval: every step is drawn
        progress.step(1.0)
    assert screen.getvalue().split("\r")[-1] == (
        "[1/2] naive | step 2/4 | 1.0 s/step | ~6.0 s left\x1b[K"
    )
    assert "\n" not in screen.getvalue()  # still one line, redrawn in place


def test_progress_is_silent_on_other_ranks(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    log = io.StringIO()
    progress = Progress(runs=1, work=1, stream=log)
    progress.start("naive", steps=1)
    progress.step(0.1)
    progress.finish()
    assert log.getvalue() == ""


def test_large_batch_prints_one_line_per_finished_training(capsys) -> None:
    settings = Settings(
        workers="1,2", variants="unscaled", seeds=1, epochs=2, warmup_epochs=0.0,
        decay_epochs="", train_samples=256, val_samples=64, jobs=1, width=8,
    )  # fmt: skip
    runs = run_all(settings)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(runs) == 2
    assert lines[0].startswith("[1/2] k=1 unscaled seed=0: 2 epochs, ")
    assert f"val error {runs[1].final_val_error:.4f}, " in lines[1] and "; all 2 in " in lines[1]


def _bench_main(argv: list[str]) -> None:
    from profiling.bench.launch import main as bench

    bench(argv)


def _versus_main(argv: list[str]) -> None:
    from profiling.bench.versus import main as versus

    versus(argv)


def _collectives_main(argv: list[str]) -> None:
    from profiling.collectives.cli import main as collectives

    collectives(argv)


def _large_batch_main(argv: list[str]) -> None:
    from profiling.studies.large_batch.cli import main as large_batch

    large_batch(argv)


def _simulate_main(argv: list[str]) -> None:
    from profiling.simulate.cli import main as simulate

    simulate(argv)


def _cpu_cluster_main(argv: list[str]) -> None:
    from profiling.simulate.cli import main as simulate
    from profiling.simulate.cpu_cluster.__main__ import COMMANDS

    simulate(argv, commands=COMMANDS)


def _simulated_steps_main(argv: list[str]) -> None:
    import argparse

    from profiling.course import simulated_steps

    parser = argparse.ArgumentParser()
    simulated_steps.add_arguments(parser)
    simulated_steps.run(parser.parse_args(argv))


# Every command that reads back a results file that one of them wrote, and how it is given.
RESULTS_READERS = {
    "bench --render": (_bench_main, ["--render", "{path}"]),
    "bench.versus": (_versus_main, ["{path}"]),
    "collectives --render": (_collectives_main, ["--render", "{path}"]),
    "large_batch --render": (_large_batch_main, ["--render", "{path}", "--plot-prefix", "{dir}/f"]),
    "simulate validate --render": (_simulate_main, ["validate", "--render", "{path}"]),
    "course.simulated_steps": (_simulated_steps_main, ["--calibration", "{path}"]),
    "simulate.cpu_cluster buckets": (_cpu_cluster_main, ["buckets", "--calibration", "{path}"]),
    "simulate paper --shape": (_simulate_main, ["paper", "--no-files", "--shape", "{path}"]),
}


@pytest.mark.parametrize("reader", RESULTS_READERS)
@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no (such|calibration) file:? {path}"),  # buckets says how to make one
        ("{", "{path} is not JSON"),
        ('{"something": "else"}', "{path}"),
    ],
    ids=["missing", "not-json", "another-file"],
)
def test_a_bad_results_file_is_named_not_a_traceback(tmp_path, reader, content, message) -> None:
    """A results file that is missing, not JSON, or another command's: the command stops
    with a message naming the file, before anything runs (no KeyError, no traceback)."""
    main_, argv = RESULTS_READERS[reader]
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    argv = [a.format(path=path, dir=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as stopped:
        main_(argv)
    assert re.search(message.format(path=re.escape(str(path))), str(stopped.value))


def test_the_main_job_trains_the_runs_asked_for() -> None:
    out = torchrun(
        2, "-m", "stages", "--width", "8", "--depth", "2", "--batch-size", "2", "--steps", "1",
        "--warmup-steps", "0", "--runs", "overlapped,compute_only",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [
        line.split()[0] for line in out.stdout.splitlines() if line.startswith(("comp", "over"))
    ]
    assert rows == ["compute_only", "overlapped"]  # in table order, only those
    out = torchrun(2, "-m", "stages", "--runs", "overlaped", timeout=300)
    assert out.returncode != 0
    assert "--runs: no run ['overlaped']; pick from compute_only, naive" in out.stderr
