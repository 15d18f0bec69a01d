"""The main job: every stage, compute-only and torch's DDP on the same workload, one table.

torchrun --standalone --nproc-per-node 2 -m stages --model cnn --steps 10
"""

from __future__ import annotations

from ddp.config import parse_config
from ddp.dist import setup_process_group, teardown_process_group
from ddp.train import ComputeOnly, print_table, stage_wrap, torch_ddp_wrap, train
from stages import STAGES


def main() -> None:
    cfg = parse_config(description=__doc__)
    device = setup_process_group(cfg.backend)
    runs = {
        "compute_only": lambda model, cfg: ComputeOnly(model),
        **{name: stage_wrap(cls) for name, cls in STAGES.items()},
        "torch_ddp": torch_ddp_wrap,
    }
    try:
        results = [train(name, wrap, cfg, device) for name, wrap in runs.items()]
        print_table(results, cfg, reference="torch_ddp")
        if not all(r.replicas_identical for r in results if r.name != "compute_only"):
            raise SystemExit("replicas differ after training")
    finally:
        teardown_process_group()


if __name__ == "__main__":
    main()
