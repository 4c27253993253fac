"""A Lightning ``Callback``: ring buffer and update detector on a ``lightning.Trainer``.

```python
from sdcreplay.integrations.lightning import SdcReplayCallback

trainer = lightning.Trainer(callbacks=[SdcReplayCallback("alarm.bundle",
                                                         "mytrain:make_workload", ring=16)])
trainer.fit(module, loader)  # an alarm writes alarm.bundle and stops training
```
The workload named is what ``sdcreplay replay`` rebuilds: a factory that builds the same
LightningModule and returns ``module_workload(module, get_batch)``, whose ``train_step``
is Lightning's automatic optimization of one batch. Contract and limits: docs/online.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ..errors import SdcReplayError
from ..workload import Workload
from .watch import WatchOptions


def _supported(trainer: Trainer, module: LightningModule) -> None:
    problem = None
    if not module.automatic_optimization:
        problem = "manual optimization"
    elif len(trainer.optimizers) != 1:
        problem = f"{len(trainer.optimizers)} optimizers"
    elif trainer.lr_scheduler_configs:
        problem = "a learning-rate scheduler"
    elif trainer.accumulate_grad_batches != 1:
        problem = f"accumulate_grad_batches={trainer.accumulate_grad_batches}"
    elif trainer.gradient_clip_val:
        problem = f"gradient_clip_val={trainer.gradient_clip_val}"
    if problem is not None:
        raise SdcReplayError(
            f"the callback records automatic optimization with one optimizer, no scheduler, "
            f"accumulation or clipping; this run has {problem}",
            "See docs/online.md (Callbacks) for what the Lightning callback supports.",
        )


class SdcReplayCallback(WatchOptions, Callback):
    """Records the last ``ring`` batches in memory; on an ``UpdateDetector`` alarm writes them
    as a bundle at ``path`` and (``stop_on_alarm``) stops training (options: WatchOptions).

    Lightning zeroes gradients inside the optimizer's closure, before backward; the callback
    drops them at the start of each batch instead (the same values reach the optimizer), so
    every recorded step starts at an optimizer-step boundary, as a bundle needs.
    """

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _supported(trainer, pl_module)
        self.start_watch(pl_module, trainer.optimizers[0], start_step=trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.watch is not None:
            self.watch.begin(batch, clear_grads=True)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.watch is not None and self.watch.in_step:
            self.watch.before_optimizer()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.watch is None:
            return
        self.watch.saw_loss(outputs.get("loss") if isinstance(outputs, Mapping) else outputs)
        alarm = self.watch.end()
        if alarm is not None and self.stop_on_alarm:
            trainer.should_stop = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watch is not None:
            self.watch.close()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception) -> None:
        """A step cut short is no evidence: close it (and the recorder's hooks) now."""
        self.on_train_end(trainer, pl_module)


def module_workload(module: LightningModule, get_batch: Callable[[int], Any]) -> Workload:
    """The Workload replay rebuilds from a LightningModule (built as for training).

    Its optimizer comes from ``configure_optimizers()`` (one optimizer, no scheduler);
    ``train_step(batch)`` is Lightning's automatic optimization of one batch as the callback
    records it: gradients dropped, then ``optimizer.step(closure)`` whose closure runs
    ``training_step(batch, 0)``, ``zero_grad`` and backward (``training_step`` must not
    depend on ``batch_idx`` or ``self.trainer``).
    """
    configured = module.configure_optimizers()
    optimizer = configured.get("optimizer") if isinstance(configured, Mapping) else configured
    if not isinstance(optimizer, torch.optim.Optimizer) or (
        isinstance(configured, Mapping) and configured.keys() - {"optimizer"}
    ):
        raise SdcReplayError(
            "configure_optimizers() must return one optimizer (or {'optimizer': ...}) here",
            "See docs/online.md (Callbacks) for what the Lightning callback supports.",
        )

    def train_step(batch: Any) -> Any:
        module.train()
        optimizer.zero_grad(set_to_none=True)  # as the callback does when a batch starts

        def closure() -> Any:
            output = module.training_step(batch, 0)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if not isinstance(loss, torch.Tensor):
                raise SdcReplayError(
                    "training_step returned no loss, so the step has nothing to replay",
                    "Return the loss (or {'loss': ...}) from training_step.",
                )
            optimizer.zero_grad()
            module.backward(loss)
            return loss.detach()

        return optimizer.step(closure)

    return Workload(module, optimizer, get_batch, train_step=train_step)
