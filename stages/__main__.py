"""The main job: every stage, compute-only and torch's DDP on the same workload, one table.

torchrun --standalone --nproc-per-node 2 -m stages --model cnn --steps 10
torchrun --standalone --nproc-per-node 2 -m stages --runs compute_only,overlapped,torch_ddp
"""

from __future__ import annotations

from ddp.config import parse_config
from ddp.dist import setup_process_group, teardown_process_group
from ddp.heap import steady_heap
from ddp.progress import Progress
from ddp.train import print_table, set_determinism, train
from stages import standard_runs


def main() -> None:
    cfg = parse_config(module="stages", description=__doc__)
    runs = standard_runs()
    if cfg.runs:  # before any process group: a name no run has is refused at once
        chosen = [name.strip() for name in cfg.runs.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in runs]
        if unknown or not chosen:
            raise SystemExit(f"--runs: no run {unknown or cfg.runs!r}; pick from {', '.join(runs)}")
        runs = {name: runs[name] for name in runs if name in chosen}  # in table order
    steady_heap()  # each run's steps cost the same whatever the run before it freed
    device = setup_process_group(cfg.backend, cfg.timeout)
    set_determinism(cfg, device)
    try:
        progress = Progress(runs=len(runs), work=len(runs) * (cfg.warmup_steps + cfg.steps))
        results = [train(name, wrap, cfg, device, progress) for name, wrap in runs.items()]
        print_table(results, cfg, reference="torch_ddp" if "torch_ddp" in runs else None)
        if not all(r.replicas_identical for r in results if r.name != "compute_only"):
            raise SystemExit("replicas differ after training")
    finally:
        teardown_process_group()


if __name__ == "__main__":
    main()
