"""The main job: every stage, compute-only and torch's DDP on the same workload, one table.

torchrun --standalone --nproc-per-node 2 -m stages --model cnn --steps 10
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
    steady_heap()  # each run's steps cost the same whatever the run before it freed
    device = setup_process_group(cfg.backend, cfg.timeout)
    set_determinism(cfg, device)
    runs = standard_runs()
    try:
        progress = Progress(runs=len(runs), work=len(runs) * (cfg.warmup_steps + cfg.steps))
        results = [train(name, wrap, cfg, device, progress) for name, wrap in runs.items()]
        print_table(results, cfg, reference="torch_ddp")
        if not all(r.replicas_identical for r in results if r.name != "compute_only"):
            raise SystemExit("replicas differ after training")
    finally:
        teardown_process_group()


if __name__ == "__main__":
    main()
