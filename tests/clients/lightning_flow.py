"""PyTorch Lightning's Trainer with its DDP strategy on CPU, under torchrun, in one of four
variants: `auto` (BoringModel, automatic optimization), `manual` (manual optimization),
`static` (manual optimization with `DDPStrategy(static_graph=True)`: Lightning then calls
the reducer's `_delay_all_reduce()` itself) and `unused` (`find_unused_parameters=True`,
with a layer that takes no part in the loss).

    torchrun --standalone --nproc-per-node 2 tests/clients/lightning_flow.py manual
    torchrun --standalone --nproc-per-node 2 -m stages.swap tests/clients/lightning_flow.py manual
"""

from __future__ import annotations

import sys
from typing import Any

import lightning
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from tests.clients.common import check_ddp, report_params


class CheckedModel(BoringModel):
    """BoringModel that checks, once training starts, which DDP class wraps it."""

    def on_train_start(self) -> None:
        check_ddp(self.trainer.strategy.model)


class ManualModel(CheckedModel):
    """BoringModel with manual optimization: `manual_backward` then `opt.step()`."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.step(batch))
        opt.step()


class UnusedModel(CheckedModel):
    """BoringModel with a layer its forward never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(2, 2)  # BoringModel's forward reaches self.layer only


VARIANTS = {  # name -> (model class, strategy)
    "auto": (CheckedModel, lambda: "ddp"),
    "manual": (ManualModel, lambda: "ddp"),
    "static": (ManualModel, lambda: DDPStrategy(static_graph=True)),
    "unused": (UnusedModel, lambda: DDPStrategy(find_unused_parameters=True)),
}


def main(variant: str) -> None:
    lightning.seed_everything(0)
    model_class, strategy = VARIANTS[variant]
    model = model_class()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy(),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model)
    report_params(trainer.lightning_module.parameters())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "auto")
