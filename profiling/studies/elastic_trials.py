"""Losing a server: kill one node of an elastic run at a random step, check that the nodes
left re-form and go on to the end, with no sample lost or trained twice.

    python -m profiling.studies.elastic_trials --trials 10 --seed 1 --policy keep-global-batch
    make elastic-trials      # both policies, the tables of docs/when-a-server-is-lost.md

Each trial makes a virtual cluster (`profiling.cluster`: 2 nodes of 2 ranks on a shaped
link), starts `stages.drop_in --elastic POLICY` on it under torchrun's elastic rendezvous
(`ElasticLaunch`: --nnodes 1:2, the store on node 0), and once the run reaches the drawn
step with all its ranks, loses node 1: SIGKILL to its torchrun and workers, as a machine
that loses power (`--lose link`: its link taken down instead, as a pulled cable; the
node is killed after the run, as the machine that never came back). Node 0 must re-form
with its 2 ranks, resume from the last committed checkpoint and finish. Checked per trial:

- the samples: each rank logs the ids it trains on (DDP_STAGES_SAMPLE_LOG); the steps
  that count (each group's, up to the checkpoint the next group resumed from) must train
  every sample once: none lost, none repeated;
- the final loss (over the data set, --dataset-size 1024 samples) against the spread of
  uninterrupted runs on all the nodes, one per data seed;
- with keep-global-batch, the final parameters against an uninterrupted 2-rank run from
  the same checkpoint (every checkpoint is kept: --checkpoint-keep), bit for bit, and
  their largest difference from the uninterrupted 4-rank run;
- nothing left behind: no process and no listener in any namespace after the run, and
  every namespace gone after the cluster.

`--loopback` runs the same on this machine's loopback (two torchrun agents on 127.0.0.1,
no namespaces, no root), as `tests/test_elastic.py` does."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddp.elastic import KEEP_GLOBAL_BATCH, SAMPLE_LOG, SCALE_LR
from profiling.cluster import network
from profiling.cluster.nodes import NodeRun, kill_tree, run_nodes
from profiling.cluster.virtual_cluster import ElasticLaunch, VirtualCluster
from profiling.studies.fault_trials import HASH, free_port, run

HEADER = re.compile(r"^elastic \S+: (?:re-formed from (\d+) to )?(\d+) ranks?,", re.M)
RESUMED = re.compile(r"resuming from \S+ \(step (\d+)\)")
FINAL_LOSS = re.compile(r"^elastic: final loss ([0-9.]+)", re.M)
RUN = "drop_in"  # the stage trained, and its checkpoints' folder
NETNS = Path("/run/netns")  # where `ip netns add` names each namespace


# -- the run ---------------------------------------------------------------------------


def training_args(args: argparse.Namespace, checkpoint_dir: str, seed: int) -> list[str]:
    """What follows torchrun's options: the drop-in stage on an MLP, with --elastic."""
    return [
        "-m", f"stages.{RUN}", "--model", "mlp", "--width", str(args.width),
        "--depth", str(args.depth), "--steps", str(args.steps), "--warmup-steps", "0",
        "--batch-size", str(args.batch_size),
        "--global-batch-size", str(args.batch_size * args.nodes * args.ranks_per_node),
        "--elastic", args.policy, "--seed", str(seed), "--timeout", str(args.timeout),
        "--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(args.every),
        # Every checkpoint stays: the one a trial resumed from is its reference's start.
        "--checkpoint-keep", str(args.steps),
    ]  # fmt: skip


class Loopback:
    """The nodes as torchrun agents on this machine's loopback: no namespaces, no root."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.nodes, self.ranks_per_node = args.nodes, args.ranks_per_node

    def run(
        self, args: list[str], *, launch: ElasticLaunch, env: dict[str, str], **options
    ) -> NodeRun:
        """As `VirtualCluster.run` with `launch`: one agent per node, node 0 the host."""
        endpoint = f"127.0.0.1:{free_port()}"
        commands = [
            [sys.executable, "-m", "torch.distributed.run",
             *launch.torchrun_options(endpoint, "127.0.0.1", self.nodes, self.ranks_per_node,
                                      host=k == 0), *args]
            for k in range(self.nodes)
        ]  # fmt: skip
        return run_nodes(commands, {**os.environ, "OMP_NUM_THREADS": "1", **env}, **options)

    def leftovers(self, procs: list[subprocess.Popen], mark: str) -> list[str]:
        """The agents still running, and any process (a worker, orphaned) whose command
        line holds `mark`, the run's own checkpoint folder."""
        found = [f"agent {p.pid} running" for p in procs if p.poll() is None]
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and mark in (entry / "cmdline").read_bytes().decode():
                    found.append(f"process {entry.name} running")
        return found


@dataclass
class Run:
    """One elastic run, and what it left."""

    out: NodeRun
    log: dict[tuple[str, int], list[dict]]  # (group, rank): the sample log's lines
    lost_at: int | None  # the step the run had reached when the node was lost
    leftovers: list[str]
    checkpoint_dir: Path
    lost_time: float | None = None  # time.time() when the node was lost


def run_elastic(
    place: VirtualCluster | Loopback, args: argparse.Namespace, work: Path, seed: int,
    lose_at: int | None,
) -> Run:  # fmt: skip
    """Train on every node of `place`; once rank 0 of the whole world has started step
    `lose_at` (None: never), lose the last node (`args.lose`). Returns once node 0 has
    ended (or the run has passed --hang-s) and every node is stopped."""
    samples, checkpoints = work / "samples", work / "checkpoints"
    world = args.nodes * args.ranks_per_node
    launch = ElasticLaunch(max_restarts=args.max_restarts, last_call_s=args.last_call_s)
    started: list[subprocess.Popen] = []
    finished: dict[str, NodeRun] = {}

    def train() -> None:
        finished["out"] = place.run(
            training_args(args, str(checkpoints), seed), launch=launch, timeout=args.hang_s,
            capture=True, grace=args.hang_s, env={SAMPLE_LOG: str(samples)},
            started=started.extend,
        )  # fmt: skip

    runner = threading.Thread(target=train)
    runner.start()
    lost_at = lost_time = None
    try:
        while lose_at is not None and runner.is_alive():
            reached = step_reached(samples, world)
            if reached is not None and reached >= lose_at:
                lost_at, lost_time = reached, time.time()
                lose_node(place, started, args.lose)
                break
            time.sleep(0.02)
        # Node 0 ends by itself; the lost node (cut off, or killed) is stopped after.
        while runner.is_alive() and started and started[0].poll() is None:
            time.sleep(0.1)
        if len(started) > 1:
            kill_tree(started[-1].pid)
    finally:
        runner.join()
    return Run(finished["out"], read_sample_log(samples), lost_at,
               leftovers(place, started, str(checkpoints)), checkpoints, lost_time)  # fmt: skip


def step_reached(samples: Path, world: int) -> int | None:
    """The last step that rank 0 of a group of `world` ranks started, from its log."""
    reached = None
    for path in samples.glob(f"group-*-{world}-rank-0.jsonl"):
        lines = path.read_text().splitlines()
        with contextlib.suppress(ValueError):  # a line read while it is being written
            if lines:
                reached = max(reached or 0, json.loads(lines[-1])["step"])
    return reached


def lose_node(place: VirtualCluster | Loopback, started: list[subprocess.Popen], how: str) -> None:
    if how == "link":
        place.set_link(len(started) - 1, up=False)
    else:
        kill_tree(started[-1].pid)


def leftovers(
    place: VirtualCluster | Loopback, started: list[subprocess.Popen], mark: str
) -> list[str]:
    """What is still there after the run: processes, and on the cluster, listeners."""
    if isinstance(place, Loopback):
        return place.leftovers(started, mark)
    return place.left_behind()


# -- the sample log ----------------------------------------------------------------------


def read_sample_log(folder: Path) -> dict[tuple[str, int], list[dict]]:
    """{(group, rank): lines} of a sample log folder (ddp/elastic.py writes it)."""
    logs = {}
    for path in sorted(folder.glob("group-*-rank-*.jsonl")):
        group, rank = path.stem.removeprefix("group-").rsplit("-rank-", 1)
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        logs[group, int(rank)] = lines
    return logs


def kept_samples(logs: dict[tuple[str, int], list[dict]]) -> list[int]:
    """The ids trained on by the steps that count, repeats included. The groups, in the
    order they started: each group's steps up to the step the next group resumed from
    (the checkpoint it loaded: the steps after it were trained again), the last's all."""
    first: dict[str, tuple[float, int]] = {}  # group: (when, step) of its first line
    for (group, _), lines in logs.items():
        if lines:
            mine = (lines[0]["time"], lines[0]["step"])
            first[group] = min(first.get(group, mine), mine)
    order = sorted(first, key=lambda g: first[g])
    end = {g: first[after][1] for g, after in zip(order, order[1:], strict=False)}
    kept = []
    for (group, _), lines in logs.items():
        for line in lines:
            if first[group][1] <= line["step"] < end.get(group, sys.maxsize):
                kept += [i for start, stop in line["ids"] for i in range(start, stop)]
    return kept


def lost_and_repeated(kept: list[int], expected: int | None = None) -> tuple[int, int]:
    """Samples skipped (below `expected`, else below the highest id trained) and samples
    trained more than once."""
    seen = set(kept)
    end = expected if expected is not None else max(seen, default=-1) + 1
    return len(set(range(end)) - seen), len(kept) - len(seen)


# -- a trial -----------------------------------------------------------------------------


@dataclass
class Trial:
    lose_at: int  # the step drawn
    lost_at: int | None = None  # the step the run had reached when the node went
    seconds: float = 0.0
    continued: bool = False  # node 0 re-formed and finished with exit 0
    world_after: int | None = None
    resumed_from: int | None = None  # the checkpoint's step (None: started over)
    lost: int | None = None
    repeated: int | None = None
    final_loss: float | None = None
    sha256: str | None = None
    equal_reference: bool | None = None  # keep-global-batch: = the 2-rank run from there
    max_diff: float | None = None  # keep-global-batch: from the uninterrupted run's
    leftovers: list[str] = field(default_factory=list)
    hang: bool = False  # node 0 still ran after --hang-s
    reformed_s: float | None = None  # from the loss to the first step of the group left
    tail: str = ""


def judge(trial: Trial, run_: Run, args: argparse.Namespace) -> Trial:
    """What the run's node 0 said and its sample log hold."""
    out = run_.out
    said = out.stdout[0] + out.stderr[0]
    trial.lost_at, trial.seconds, trial.leftovers = run_.lost_at, out.seconds, run_.leftovers
    headers = HEADER.findall(out.stdout[0])
    trial.world_after = int(headers[-1][1]) if headers else None
    resumed = RESUMED.findall(said)
    reformed = any(before for before, _ in headers)
    trial.resumed_from = int(resumed[-1]) if resumed and reformed else None
    hashes, losses = HASH.findall(out.stdout[0]), FINAL_LOSS.findall(out.stdout[0])
    trial.sha256 = hashes[-1] if hashes else None
    trial.final_loss = float(losses[-1]) if losses else None
    trial.hang = out.returncode == 124
    # Re-formed smaller: said by the header, or (lost before the first checkpoint) the
    # last group's world.
    smaller = args.nodes * args.ranks_per_node - args.ranks_per_node
    trial.continued = (out.returncodes[0] == 0 and trial.world_after == smaller
                       and trial.sha256 is not None)  # fmt: skip
    # Both policies train the planned samples: --steps of the full world's global batch.
    expected = args.steps * args.batch_size * args.nodes * args.ranks_per_node
    trial.lost, trial.repeated = lost_and_repeated(kept_samples(run_.log), expected)
    firsts = [lines[0]["time"] for lines in run_.log.values() if lines]
    if run_.lost_time is not None and firsts and max(firsts) > run_.lost_time:
        trial.reformed_s = max(firsts) - run_.lost_time
    trial.tail = out.tail()
    return trial


# -- the references: uninterrupted runs ----------------------------------------------------


def final_params(checkpoint_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    """The model state in a run's final checkpoint (rank 0's file)."""
    path = checkpoint_dir / RUN / f"step-{steps:08d}" / "rank-00000.pt"
    return torch.load(path, weights_only=True)["model"]


def standalone(
    args: argparse.Namespace, ranks: int, train: list[str], env: dict[str, str] | None = None
) -> str:
    """Run `train` on `ranks` ranks of this machine (loopback, no restarts); its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), *train]  # fmt: skip
    code, output, _ = run(command, env or {}, args.hang_s)
    if code != 0:
        raise SystemExit(f"a reference run failed (exit {code}):\n{output[-3000:]}")
    return output


def same_checkpoint_reference(
    args: argparse.Namespace, trial_checkpoints: Path, resumed_from: int | None, work: Path
) -> str:
    """params sha256 of an uninterrupted run of the ranks left (on loopback) from the
    checkpoint the trial resumed from, copied out of the trial's (None: from scratch)."""
    if resumed_from is not None:
        name = f"step-{resumed_from:08d}"
        shutil.copytree(trial_checkpoints / RUN / name, work / RUN / name)
    train = training_args(args, str(work), args.data_seed)
    return HASH.findall(standalone(args, args.nodes * args.ranks_per_node - args.ranks_per_node,
                                   train))[-1]  # fmt: skip


def uninterrupted(place, args: argparse.Namespace, seed: int, work: Path) -> tuple[float, Run]:
    """The final loss of a run on every node that loses none."""
    run_ = run_elastic(place, args, work, seed, lose_at=None)
    losses = FINAL_LOSS.findall(run_.out.stdout[0])
    if run_.out.returncode != 0 or not losses:
        raise SystemExit(f"an uninterrupted run failed:\n{run_.out.tail()}")
    return float(losses[-1]), run_


# -- the table and the command line --------------------------------------------------------


def table(trials: list[Trial], spread: list[float]) -> str:
    """One row per trial: markdown. A final loss is in the spread if, to the 4 decimals
    shown, it lies between the lowest and the highest of the uninterrupted runs'; beside
    it, its difference from the uninterrupted run of its own data seed (the first)."""
    low, high = round(min(spread), 4), round(max(spread), 4)
    keep = any(t.equal_reference is not None for t in trials)
    columns = ["trial", "lost at step", "continued", "world after", "resumed from",
               "samples lost", "repeated", "final loss", "in spread", "vs same seed"]  # fmt: skip
    if keep:
        columns += ["= ranks left from there", "max diff vs uninterrupted"]
    columns += ["left behind", "re-formed in s", "seconds"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for i, t in enumerate(trials, 1):
        loss, inside, versus = "-", False, "-"
        if t.final_loss is not None:
            loss, inside = f"{t.final_loss:.4f}", low <= round(t.final_loss, 4) <= high
            versus = f"{t.final_loss - spread[0]:+.1e}"
        continued = "hang" if t.hang else "yes" if t.continued else "NO"
        cells = [str(i), str(t.lost_at), continued, str(t.world_after),
                 str(t.resumed_from if t.resumed_from is not None else "start"), str(t.lost),
                 str(t.repeated), loss, "yes" if inside else "NO", versus]  # fmt: skip
        if keep:
            cells += ["yes" if t.equal_reference else "NO",
                      "-" if t.max_diff is None else f"{t.max_diff:.1e}"]  # fmt: skip
        reformed = "-" if t.reformed_s is None else f"{t.reformed_s:.1f}"
        cells += ["nothing" if not t.leftovers else "; ".join(t.leftovers), reformed,
                  f"{t.seconds:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.studies.elastic_trials",
        description=__doc__.split("\n\n")[0] + " A trial takes about a minute on two cores.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    # fmt: off
    add("--trials", type=int, default=10, help="trials, each losing one node")
    add("--seed", type=int, default=0, help="seed of the draws of the step")
    add("--policy", choices=(KEEP_GLOBAL_BATCH, SCALE_LR), default=KEEP_GLOBAL_BATCH,
        help="--elastic of the runs")
    add("--lose", choices=("kill", "link"), default="kill",
        help="how node 1 is lost: its processes killed, or its link taken down")
    add("--nodes", type=int, default=2, help="nodes; the last one is lost")
    add("--ranks-per-node", type=int, default=2, help="ranks in each node")
    add("--rate", default="1gbit", help="the link's rate, tc's units")
    add("--width", type=int, default=256, help="MLP units per layer")
    add("--depth", type=int, default=3, help="MLP layers")
    add("--batch-size", type=int, default=16, help="samples per rank of the full world")
    add("--steps", type=int, default=60, help="optimizer steps of each run")
    add("--every", type=int, default=5, help="checkpoint every this many steps")
    add("--timeout", type=float, default=10.0, help="the runs' --timeout, seconds")
    add("--max-restarts", type=int, default=3, help="torchrun's restarts before it gives up")
    add("--last-call-s", type=int, default=3,
        help="the rendezvous' last call: how long the nodes may start apart, and what each "
        "re-formation waits")
    add("--data-seed", type=int, default=0, help="the trials' --seed")
    add("--spread-runs", type=int, default=5,
        help="uninterrupted runs (data seeds --data-seed on): their final losses are the spread")
    add("--hang-s", type=float, default=300.0, help="a run lasting this long is a hang")
    add("--loopback", action="store_true", help="agents on loopback, not a virtual cluster")
    add("--out", type=Path, help="also write the table and command here (Markdown)")
    add("--verbose", action="store_true", help="print failed trials' output")
    # fmt: on
    return parser.parse_args(argv)


def place_for(args: argparse.Namespace):
    """A fresh place to run on: a virtual cluster (a context manager), or loopback."""
    if args.loopback:
        return contextlib.nullcontext(Loopback(args))
    ok, why = network.available()
    if not ok:
        raise SystemExit(f"no virtual cluster here ({why}); add --loopback")
    return VirtualCluster(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate=args.rate)


def one_place(args: argparse.Namespace, work: Path, act) -> object:
    """`act(place)` on a fresh place; then check that the cluster left no namespace."""
    with place_for(args) as place:
        names = [] if args.loopback else place.state.all_namespaces
        result = act(place)
    there = [name for name in names if (NETNS / name).exists()]
    if there and isinstance(result, Trial):
        result.leftovers.append(f"namespaces {there}")
    return result


def main(argv: list[str] | None = None) -> list[Trial]:
    args = options(argv)
    if args.loopback and args.lose == "link":
        raise SystemExit("--lose link takes a virtual cluster: loopback has no link to cut")
    total_world = args.nodes * args.ranks_per_node
    with tempfile.TemporaryDirectory(prefix="elastic-") as tmp:
        tmp_path = Path(tmp)
        spread, reference = [], None
        for i in range(args.spread_runs):
            work = tmp_path / f"uninterrupted-{i}"
            loss, run_ = one_place(args, work, lambda p, w=work, s=args.data_seed + i:
                                   uninterrupted(p, args, s, w))  # fmt: skip
            spread.append(loss)
            if i == 0:
                reference = final_params(run_.checkpoint_dir, args.steps)
            print(f"uninterrupted run, data seed {args.data_seed + i}: final loss {loss:.6f}",
                  flush=True)  # fmt: skip
        rng = random.Random(args.seed)
        trials = []
        for i in range(args.trials):
            work = tmp_path / f"trial-{i}"
            trial = Trial(lose_at=rng.randrange(1, args.steps - 1))

            def act(place, trial=trial, work=work):
                return judge(trial, run_elastic(place, args, work, args.data_seed,
                                                trial.lose_at), args)  # fmt: skip

            trial = one_place(args, work, act)
            if args.policy == KEEP_GLOBAL_BATCH and trial.continued:
                want = same_checkpoint_reference(args, work / "checkpoints", trial.resumed_from,
                                                 tmp_path / f"reference-{i}")  # fmt: skip
                trial.equal_reference = trial.sha256 == want
                params = final_params(work / "checkpoints", args.steps)
                trial.max_diff = max((params[k] - reference[k]).abs().max().item() for k in params)
            trials.append(trial)
            print(f"[{i + 1}/{args.trials}] lost at step {trial.lost_at}: continued "
                  f"{trial.continued} on {trial.world_after} ranks from step {trial.resumed_from}, "
                  f"lost {trial.lost}, repeated {trial.repeated}, final loss {trial.final_loss}, "
                  f"{trial.seconds:.1f} s", flush=True)  # fmt: skip
            if (not trial.continued or trial.leftovers) and args.verbose:
                print(trial.tail, file=sys.stderr)
    result = table(trials, spread)
    seeds = f"{args.data_seed} to {args.data_seed + args.spread_runs - 1}"
    losses = ", ".join(f"{loss:.4f}" for loss in spread)
    note = (f"Uninterrupted runs on all {total_world} ranks, data seeds {seeds}: final loss "
            f"{losses}.")  # fmt: skip
    print(result + "\n\n" + note)
    if args.out:
        command = "python -m profiling.studies.elastic_trials " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        args.out.write_text(f"{result}\n\n{note}\nMade with `{command}`.\n")
    return trials


if __name__ == "__main__":
    main()
