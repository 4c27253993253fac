"""A tiny LightningModule trained by ``lightning.Trainer``: a user's workload module, as the
integration tests (test_integrations.py) and replay import it."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule

from sdcreplay.integrations.lightning import module_workload

FEATURES, BATCH = 8, 4


class Regressor(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ScheduledRegressor(Regressor):
    """Warm-up then decay, stepped every batch (interval 'step'), as LLM recipes do; or, with
    ``interval='epoch'``, Lightning's default, stepped when an epoch ends."""

    def __init__(self, interval: str = "step"):
        super().__init__()
        self.interval = interval

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-2, total_steps=64)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.interval},
        }


def make_module(seed: int = 0, scheduled: str | None = None) -> Regressor:
    torch.manual_seed(seed)
    return Regressor() if scheduled is None else ScheduledRegressor(scheduled)


def batches(seed: int = 0, count: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = torch.randn(count * BATCH, FEATURES, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    return [
        (inputs[i * BATCH : (i + 1) * BATCH], targets[i * BATCH : (i + 1) * BATCH])
        for i in range(count)
    ]


def make_workload(
    seed: int = 0,
    scheduled: str | None = None,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str = "norm",
):
    """What replay rebuilds: the same module; its automatic optimization as train_step, with
    the clipping the Trainer was given."""
    data = batches(seed)
    return module_workload(
        make_module(seed, scheduled),
        lambda index: data[index % len(data)],
        gradient_clip_val=gradient_clip_val,
        gradient_clip_algorithm=gradient_clip_algorithm,
    )
