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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..errors import SdcReplayError
from ..workload.definition import Workload
from .watch import WatchOptions

SCHEDULER = "scheduler"  # the Trainer's learning-rate scheduler, a state object of the bundle


def _micro_batches(batch: Any) -> list[Any]:
    """A recorded step's batch: the model's keyword arguments, or (gradient accumulation) the
    list of them, one per micro-batch."""
    return batch if isinstance(batch, list) else [batch]


class SdcReplayCallback(WatchOptions, TrainerCallback):
    """Records the last ``ring`` steps in memory; on an ``UpdateDetector`` alarm writes them
    as a bundle at ``path`` and (``stop_on_alarm``) stops training (options: WatchOptions)."""

    def __init__(self, path: str | Path, workload: str, **options: Any):
        super().__init__(path, workload, **options)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._awaiting_batch = False
        self._accumulating = False  # gradient accumulation: a step's batch is a list

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._accumulating = args.gradient_accumulation_steps > 1
        scheduler = kwargs.get("lr_scheduler")
        self.start_watch(
            model,
            getattr(optimizer, "optimizer", optimizer),  # accelerate's wrapper holds it
            state={SCHEDULER: getattr(scheduler, "scheduler", scheduler)} if scheduler else {},
            start_step=state.global_step,
        )
        # The batch reaches the callback only as the model's arguments: the step is recorded
        # from the first forward after on_step_begin (nothing draws random numbers between).
        self._hooks = [
            model.register_forward_pre_hook(self._forward_begins, prepend=True, with_kwargs=True),
            model.register_forward_hook(self._forward_ends),
        ]

    def on_step_begin(self, args, state, control, **kwargs):
        self._awaiting_batch = True

    def _forward_begins(self, module, args, kwargs) -> None:
        """Each micro-batch reaches the callback only as the model's arguments: the first
        forward after on_step_begin opens the step, later ones of the step join its batch
        under gradient accumulation (a second forward of a custom compute_loss does not: the
        dump's verification then says the workload's train_step is not the Trainer's)."""
        watch = self.watch
        if watch is None or not (self._awaiting_batch or (watch.in_step and self._accumulating)):
            return
        if args:
            raise SdcReplayError(
                "the model was called with positional arguments; the callback records the "
                "keyword inputs a Trainer passes (model(**inputs))",
                "Call the model with keyword arguments in compute_loss.",
            )
        if self._awaiting_batch:
            self._awaiting_batch = False
            watch.begin([dict(kwargs)] if self._accumulating else dict(kwargs))
        else:
            watch.extend(dict(kwargs))

    def _forward_ends(self, module, args, output) -> None:
        if self.watch is not None and self.watch.in_step and isinstance(output, Mapping):
            self.watch.saw_loss(output.get("loss"))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.watch is not None and self.watch.in_step:
            self.watch.before_optimizer()

    def on_step_end(self, args, state, control, **kwargs):
        if self.watch is None:
            return
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
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.watch is not None:
            self.watch.close()


def trainer_workload(trainer: Trainer) -> Workload:
    """The Workload replay rebuilds from a Trainer built as for training (not trained).

    Its optimizer and scheduler are the Trainer's own (``create_optimizer_and_scheduler``
    for ``args.max_steps``); ``train_step(batch)`` is one update step of the Trainer's loop:
    for each micro-batch ``model(**micro_batch)["loss"]`` (divided by their number unless the
    Trainer has the model normalize it by ``num_items_in_batch``) and backward, then gradient
    clipping at ``max_grad_norm``, optimizer and scheduler steps, ``zero_grad``. ``batch``
    is what the model received (the callback records exactly that): its keyword arguments,
    a list of them under gradient accumulation. ``get_batch(i)`` is the i-th update step's
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
        for inputs in micro_batches:
            loss = model(**inputs)["loss"]
            losses.append(loss.detach())
            if not _scaled_for_accumulation(trainer, inputs):
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
        if trainer.model_accepts_loss_kwargs and items is not None:
            for sample in samples:
                sample["num_items_in_batch"] = items
        return samples if accumulation > 1 else samples[0]

    return Workload(
        model, optimizer, get_batch, train_step=train_step, state={SCHEDULER: scheduler}
    )


def _scaled_for_accumulation(trainer: Trainer, inputs: Mapping) -> bool:
    """Whether the Trainer leaves a micro-batch's loss as it is (``Trainer.training_step``):
    the model normalized it by the step's ``num_items_in_batch``, or a ``compute_loss_func``
    did; else it divides it by the number of micro-batches."""
    if trainer.loss_is_scaled_for_ga is not None:
        return bool(trainer.loss_is_scaled_for_ga)
    given_items = trainer.model_accepts_loss_kwargs and "num_items_in_batch" in inputs
    return given_items or trainer.compute_loss_func is not None
