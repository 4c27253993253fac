"""A Hugging Face ``transformers.Trainer`` callback: ring buffer and update detector on.

```python
from sdcreplay.integrations.hf import SdcReplayCallback

trainer = Trainer(model=model, args=args, train_dataset=ds,
                  callbacks=[SdcReplayCallback("alarm.bundle", "mytrain:make_workload",
                                               workload_kwargs={"seed": 0}, ring=16)])
trainer.train()  # an alarm writes alarm.bundle (then alarm-2.bundle...) and stops training
```
The workload named is what ``sdcreplay replay`` rebuilds: a factory that builds the same
model and Trainer and returns ``trainer_workload(trainer)``, whose ``train_step`` is the
Trainer's update step. Contract and limits: docs/online.md, "Callbacks".
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..errors import SdcReplayError
from ..workload.definition import Workload
from .watch import WatchOptions

SCHEDULER = "scheduler"  # the Trainer's learning-rate scheduler, a state object of the bundle
ITEMS = "num_items_in_batch"  # compute_loss's argument, kept in a recorded micro-batch
_CALLER_DEPTH = 8  # frames between a callback's event method and the Trainer's loop, at most


def _micro_batches(batch: Any) -> list[Any]:
    """A recorded step's batch: compute_loss's inputs, or (gradient accumulation) the list of
    them, one per micro-batch."""
    return batch if isinstance(batch, list) else [batch]


class SdcReplayCallback(WatchOptions, TrainerCallback):
    """Records the last ``ring`` steps in memory; on an ``UpdateDetector`` alarm writes them
    as a bundle at ``path`` and (``stop_on_alarm``) stops training (options: WatchOptions).

    A step's batch is what the Trainer hands its ``compute_loss`` (the inputs, and
    ``num_items_in_batch`` under the key of that name), the Trainer's own or a subclass's:
    ``trainer_workload``'s ``train_step`` replays that ``compute_loss`` on it. The Trainer
    passes itself to no callback; the one running this callback's ``on_train_begin`` is
    found as its caller, and its ``compute_loss`` watched (an instance attribute, removed
    at ``on_train_end``) while training.
    """

    def __init__(self, path: str | Path, workload: str, **options: Any):
        super().__init__(path, workload, **options)
        self._trainer: Trainer | None = None
        self._awaiting_batch = False
        self._accumulating = False  # gradient accumulation: a step's batch is a list

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        with self.guarded("on_train_begin"):
            trainer = _running_trainer(self)
            if trainer is None:
                raise SdcReplayError(
                    "no transformers.Trainer runs this callback: its compute_loss, where a "
                    "step's batch is recorded, is out of reach",
                    "Give the callback to a Trainer (Trainer(callbacks=[...]) or "
                    "trainer.add_callback) and call trainer.train().",
                )
            self._accumulating = args.gradient_accumulation_steps > 1
            scheduler = kwargs.get("lr_scheduler")
            self.start_watch(
                model,
                getattr(optimizer, "optimizer", optimizer),  # accelerate's wrapper holds it
                state={SCHEDULER: getattr(scheduler, "scheduler", scheduler)} if scheduler else {},
                start_step=state.global_step,
            )
            self._trainer = trainer
            trainer.compute_loss = functools.partial(self._compute_loss, trainer.compute_loss)

    def on_step_begin(self, args, state, control, **kwargs):
        self._awaiting_batch = self.watching

    def _compute_loss(self, compute_loss: Callable[..., Any], model, inputs, *args, **kwargs):
        """The Trainer's compute_loss, its inputs recorded as the step's batch first: the
        first call after on_step_begin opens the step, later ones of the step join its batch
        under gradient accumulation; an evaluation's calls are no step's."""
        joins = self.watching and (self._awaiting_batch or (self._accumulating and self.in_step))
        if joins:
            items = kwargs.get(ITEMS, args[1] if len(args) > 1 else None)
            with self.guarded("compute_loss"):
                self._add_micro_batch({**inputs, **({ITEMS: items} if items is not None else {})})
        result = compute_loss(model, inputs, *args, **kwargs)
        if joins and self.watching:
            with self.guarded("compute_loss"):
                assert self.watch is not None
                self.watch.saw_loss(result[0] if isinstance(result, tuple) else result)
        return result

    @property
    def in_step(self) -> bool:
        return self.watch is not None and self.watch.in_step

    def _add_micro_batch(self, micro_batch: dict) -> None:
        assert self.watch is not None
        if self._awaiting_batch:
            self._awaiting_batch = False
            self.watch.begin([micro_batch] if self._accumulating else micro_batch)
        else:
            self.watch.extend(micro_batch)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.watching and self.in_step:
            with self.guarded("on_pre_optimizer_step"):
                assert self.watch is not None
                self.watch.before_optimizer()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.watching:
            return
        with self.guarded("on_step_end"):
            assert self.watch is not None
            alarm = self.watch.end()
            if alarm is not None and self.stop_on_alarm:
                control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        """The Trainer saved its checkpoint of this step: the ring's window starts there."""
        if self.watch is not None:
            self.watch.checkpoint_saved(
                Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            )

    def on_train_end(self, args, state, control, **kwargs):
        with self.guarded("on_train_end"):
            self.stop_watching()

    def stop_watching(self) -> None:
        """Also give the Trainer its own compute_loss back."""
        trainer, self._trainer = self._trainer, None
        if trainer is not None:
            vars(trainer).pop("compute_loss", None)
        super().stop_watching()


def _running_trainer(callback: TrainerCallback) -> Trainer | None:
    """The Trainer whose event is calling ``callback`` now: a caller's ``self`` that holds it
    among its callbacks (CallbackHandler.call_event is called from the Trainer's loop)."""
    frame = inspect.currentframe()
    try:
        for _ in range(_CALLER_DEPTH):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and callback in candidate.callback_handler.callbacks:
                return candidate
        return None
    finally:
        del frame


def trainer_workload(trainer: Trainer) -> Workload:
    """The Workload replay rebuilds from a Trainer built as for training (not trained).

    Its optimizer and scheduler are the Trainer's own (``create_optimizer_and_scheduler``
    for ``args.max_steps``); ``train_step(batch)`` is one update step of the Trainer's loop:
    for each micro-batch the Trainer's own ``compute_loss`` (a subclass's when it overrides
    it) under its ``compute_loss_context_manager``, the loss divided by the number of
    micro-batches unless the Trainer says it is scaled already (``Trainer.training_step``'s
    rule), and backward; then gradient clipping at ``max_grad_norm``, optimizer and
    scheduler steps, ``zero_grad``. ``batch`` is what ``compute_loss`` received (the
    callback records exactly that): its inputs with ``num_items_in_batch`` among them, a
    list of them under gradient accumulation. ``get_batch(i)`` is the i-th update step's
    batch from the Trainer's dataloader (its order under ``args.seed``), for
    ``sdcreplay record`` and ``doctor``.
    """
    args = trainer.args
    accumulation = args.gradient_accumulation_steps
    if args.max_steps <= 0:
        raise SdcReplayError(
            "the Trainer has no max_steps: its scheduler's length depends on the dataset",
            "Build the Trainer with TrainingArguments(max_steps=N), as for training.",
        )
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.lr_scheduler
    if model is None or optimizer is None or scheduler is None:
        raise SdcReplayError(
            "the Trainer built no model, optimizer or scheduler to replay with",
            "Give the Trainer its model (not model_init) and the default optimizer set-up.",
        )
    batches: list[Any] = []

    def train_step(batch: Any) -> torch.Tensor:
        model.train()
        micro_batches = _micro_batches(batch)
        losses = []
        for recorded in micro_batches:
            inputs = dict(recorded)
            items = inputs.pop(ITEMS, None)
            with trainer.compute_loss_context_manager():
                loss: Any = trainer.compute_loss(model, inputs, num_items_in_batch=items)
            losses.append(loss.detach())
            if not _scaled_for_accumulation(trainer, items):
                loss = loss / len(micro_batches)
            loss.backward()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        model.zero_grad()
        return torch.stack(losses).mean()

    def get_batch(index: int) -> Any:
        if not batches:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(args.seed)
                batches.extend(trainer.get_train_dataloader())
        first = index * accumulation
        samples = [dict(batches[(first + k) % len(batches)]) for k in range(accumulation)]
        _, items = trainer.get_batch_samples(iter(samples), accumulation, args.device)
        if items is not None:  # as the Trainer hands it to compute_loss
            for sample in samples:
                sample[ITEMS] = items
        return samples if accumulation > 1 else samples[0]

    return Workload(
        model, optimizer, get_batch, train_step=train_step, state={SCHEDULER: scheduler}
    )


def _scaled_for_accumulation(trainer: Trainer, items: Any) -> bool:
    """Whether the Trainer leaves a micro-batch's loss as it is (``Trainer.training_step``):
    the model normalized it by the step's ``num_items_in_batch``, or a ``compute_loss_func``
    did; else it divides it by the number of micro-batches."""
    if trainer.loss_is_scaled_for_ga is not None:
        return bool(trainer.loss_is_scaled_for_ga)
    given_items = trainer.model_accepts_loss_kwargs and items is not None
    return given_items or trainer.compute_loss_func is not None
