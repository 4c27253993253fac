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
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.core.optimizer import (
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import LRSchedulerConfig

from ..errors import SdcReplayError
from ..workload.definition import Workload
from .watch import WatchOptions

SCHEDULER = "scheduler"  # the learning-rate scheduler, a state object of the bundle
_LIMITS = "See docs/online.md (Callbacks) for what the Lightning callback supports."


def _unsupported(problem: str) -> SdcReplayError:
    return SdcReplayError(
        "the callback records automatic optimization with one optimizer, at most one "
        "learning-rate scheduler stepped every batch (interval 'step', frequency 1), "
        f"clipping by Trainer(gradient_clip_val=...) and no accumulation; this run has {problem}",
        _LIMITS,
    )


def _step_scheduler(configs: list[LRSchedulerConfig]) -> Any:
    """The one scheduler Lightning steps at the end of every batch (inside the recorded step);
    one stepped at an epoch's end or every k batches would change the state between steps in
    a way a replayed step cannot know about."""
    if not configs:
        return None
    if len(configs) > 1:
        raise _unsupported(f"{len(configs)} learning-rate schedulers")
    config = configs[0]
    if config.reduce_on_plateau:
        raise _unsupported("a ReduceLROnPlateau scheduler (it steps on a monitored metric)")
    if config.interval != "step" or config.frequency != 1:
        raise _unsupported(
            f"a scheduler with interval={config.interval!r}, frequency={config.frequency} "
            "(return {'scheduler': ..., 'interval': 'step'} from configure_optimizers)"
        )
    return config.scheduler


def _scheduler_to_record(trainer: Trainer, module: LightningModule) -> Any:
    """The scheduler to record as state (None: none), once the run is one the callback can
    record."""
    if not module.automatic_optimization:
        raise _unsupported("manual optimization")
    if len(trainer.optimizers) != 1:
        raise _unsupported(f"{len(trainer.optimizers)} optimizers")
    if trainer.accumulate_grad_batches != 1:
        raise _unsupported(f"accumulate_grad_batches={trainer.accumulate_grad_batches}")
    if is_overridden("configure_gradient_clipping", module):
        raise _unsupported("its own configure_gradient_clipping (replay runs without a Trainer)")
    return _step_scheduler(trainer.lr_scheduler_configs)


class SdcReplayCallback(WatchOptions, Callback):
    """Records the last ``ring`` batches in memory; on an ``UpdateDetector`` alarm writes them
    as a bundle at ``path`` and (``stop_on_alarm``) stops training (options: WatchOptions).

    Lightning zeroes gradients inside the optimizer's closure, before backward; the callback
    drops them at the start of each batch instead (the same values reach the optimizer), so
    every recorded step starts at an optimizer-step boundary, as a bundle needs.
    """

    _saving: tuple[Any, CheckpointIO] | None = None  # the strategy and its own CheckpointIO

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        scheduler = _scheduler_to_record(trainer, pl_module)  # refused before training starts
        with self.guarded("on_train_start"):
            self.start_watch(
                pl_module,
                trainer.optimizers[0],
                state={SCHEDULER: scheduler} if scheduler is not None else {},
                start_step=trainer.global_step,
            )
            # Every checkpoint the Trainer writes (ModelCheckpoint, trainer.save_checkpoint)
            # goes through its strategy's CheckpointIO: told once it is written, the ring's
            # window starts there.
            strategy = trainer.strategy
            self._saving = (strategy, strategy.checkpoint_io)
            strategy.checkpoint_io = _TellingCheckpointIO(strategy.checkpoint_io, self._saved)

    def _saved(self, path: Path) -> None:
        if self.watching and self.watch is not None:  # the next batch drops the gradients
            with self.guarded("checkpoint saved"):
                self.watch.checkpoint_saved(path, clear_grads=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.watching:
            with self.guarded("on_train_batch_start"):
                assert self.watch is not None
                self.watch.begin(batch, clear_grads=True)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.watching and self.watch is not None and self.watch.in_step:
            with self.guarded("on_before_optimizer_step"):
                self.watch.before_optimizer()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.watching:
            return
        with self.guarded("on_train_batch_end"):
            assert self.watch is not None
            self.watch.saw_loss(outputs.get("loss") if isinstance(outputs, Mapping) else outputs)
            alarm = self.watch.end()
            if alarm is not None and self.stop_on_alarm:
                trainer.should_stop = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._saving is not None:
            strategy, own = self._saving
            strategy.checkpoint_io, self._saving = own, None
        with self.guarded("on_train_end"):
            self.stop_watching()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception) -> None:
        """A step cut short is no evidence: close it (and the recorder's hooks) now."""
        self.on_train_end(trainer, pl_module)


class _TellingCheckpointIO(CheckpointIO):
    """The strategy's own CheckpointIO, calling ``saved(path)`` after each checkpoint it
    wrote (a synchronous one: an asynchronous CheckpointIO tells before the file is whole)."""

    def __init__(self, inner: CheckpointIO, saved: Callable[[Path], None]):
        self.inner, self.saved = inner, saved

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self.saved(Path(path))

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return self.inner.load_checkpoint(
            path, map_location=map_location, weights_only=weights_only
        )

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def module_workload(
    module: LightningModule,
    get_batch: Callable[[int], Any],
    *,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str = "norm",
) -> Workload:
    """The Workload replay rebuilds from a LightningModule (built as for training).

    Its optimizer and scheduler come from ``configure_optimizers()`` (one optimizer, at most
    one scheduler with interval ``'step'``); ``train_step(batch)`` is Lightning's automatic
    optimization of one batch as the callback records it: gradients dropped, then
    ``optimizer.step(closure)`` whose closure runs ``training_step(batch, 0)``, ``zero_grad``,
    backward and the clipping (``gradient_clip_val``/``gradient_clip_algorithm``: pass what the
    Trainer gets), then ``lr_scheduler_step``. ``training_step`` must not depend on
    ``batch_idx`` or ``self.trainer``.
    """
    try:
        configured: Any = module.configure_optimizers()
        optimizers, schedulers, monitor = _configure_optimizers(configured)
        configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    except MisconfigurationException as exc:
        raise SdcReplayError(f"configure_optimizers(): {exc}", _LIMITS) from exc
    if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
        raise _unsupported(f"{len(optimizers)} optimizers from configure_optimizers()")
    optimizer, scheduler = optimizers[0], _step_scheduler(configs)
    if gradient_clip_algorithm not in ("norm", "value"):
        raise SdcReplayError(
            f"gradient_clip_algorithm={gradient_clip_algorithm!r}",
            "Pass 'norm' or 'value', as the Trainer takes.",
        )

    def clip(value: float) -> None:
        """As Lightning's precision plugin: the optimizer's parameters, group by group."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(parameters, value)
        else:
            torch.nn.utils.clip_grad_norm_(parameters, value)

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
            if gradient_clip_val:
                clip(gradient_clip_val)
            return loss.detach()

        loss = optimizer.step(closure)
        if scheduler is not None:
            module.lr_scheduler_step(scheduler, None)
        return loss

    state = {SCHEDULER: scheduler} if scheduler is not None else {}
    return Workload(module, optimizer, get_batch, train_step=train_step, state=state)
