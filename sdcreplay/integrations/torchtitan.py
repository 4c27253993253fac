"""TorchTitan's ``Trainer``, recorded in its own config style (TorchTitan 0.3.0).

A run of TorchTitan's own entry point, recorded, with one section more in its config::

    torchrun --nproc-per-node 8 -m sdcreplay.integrations.torchtitan \\
        --module llama3 --config llama3_debugmodel --sdcreplay.bundle run.bundle
    torchrun ... -m sdcreplay.integrations.torchtitan --module llama3 --config llama3_8b \\
        --sdcreplay.bundle alarm.bundle --sdcreplay.ring 8 --sdcreplay.detect

or in a config registry of one's own, ``recorded(llama3_debugmodel(), bundle="run.bundle")``,
which is a `RecordingTrainer.Config`. The first form writes every step (script mode: a replay
runs the same command again, in replay mode, and the bundle keeps the command line, the
directory and the variables that change results); with ``ring`` the last steps stay in
memory, and with ``detect`` the update detector judges every step and, on an alarm, dumps
the ring as a bundle whose last step is the alarmed one; training goes on.

The Trainer is recorded as it runs: ``train_step`` is the recorded step (its micro-batches,
gradient accumulation, clipping, the optimizers' and schedulers' steps), each batch its data
iterator yields is fed through the recorder, and the Recorder is handed the Trainer's own
objects: the model parts, the ``OptimizersContainer``, the ``LRSchedulersContainer`` and the
Trainer's step counters as state. What TorchTitan compiles (each block, the loss) is
recorded as compiled code; its FSDP2 mesh gives the job's layout. docs/porting.md, "TorchTitan".
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from torchtitan.config import ConfigManager
from torchtitan.trainer import Trainer

from ..errors import SdcReplayError
from ..online.update_detector import UpdateDetector
from ..recording.recorder import Recorder
from ..replay.script import replaying


@dataclass(kw_only=True, slots=True)
class SdcReplay:
    """The ``--sdcreplay.*`` section of a recorded run's config."""

    bundle: str = ""
    """The bundle the run writes (with a ring: the one an alarm dumps); empty: none."""

    ring: int = 0
    """Keep the last RING steps in memory, written only by a dump (0: every step written)."""

    detect: bool = False
    """The update detector judges every step; an alarm dumps the ring (needs ring)."""

    verify: bool = True
    """At the second step, check that the first replays bit for bit in a fresh process."""

    signature: Literal["layer", "boundary"] = "layer"
    """What each step's signature log holds: every module, or the boundary (docs/recording.md)."""

    env: list[str] = field(default_factory=list)
    """The loop's own environment variables (NAME or NAME*) the bundle keeps."""


class RecordingTrainer(Trainer):
    """TorchTitan's Trainer with its steps recorded (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sdcreplay: SdcReplay = field(default_factory=SdcReplay)

    def __init__(self, config: Config):
        options = config.sdcreplay
        if options.detect and not (options.bundle and options.ring):
            raise SdcReplayError(
                "--sdcreplay.detect dumps the steps a ring keeps into --sdcreplay.bundle, and "
                "the ring or the bundle is not given",
                "Give --sdcreplay.bundle PATH and --sdcreplay.ring K (the steps an alarm's "
                "bundle holds, e.g. 8).",
            )
        super().__init__(config)
        self.recorder: Recorder | None = None
        self.detector: UpdateDetector | None = None
        if not options.bundle:
            return
        if replaying():  # the bundle's state is the replay's: no checkpoint loaded or saved
            self.checkpointer.load = _nothing  # type: ignore[method-assign]
            self.checkpointer.save = _nothing  # type: ignore[method-assign]
        parts = self.model_parts
        self.recorder = Recorder(
            options.bundle,
            model=parts[0] if len(parts) == 1 else list(parts),
            optimizer=self.optimizers,
            state={"lr_schedulers": self.lr_schedulers, "train_state": self},
            ring=options.ring or None,
            verify=options.verify,
            signature=options.signature,
            env=list(options.env),
        )
        if options.detect:
            self.detector = UpdateDetector(
                model=self.recorder.model, optimizer=self.recorder.optimizer, recorder=self.recorder
            )

    def batch_generator(
        self, data_iterable: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Each batch the step takes is one of the step's recorded inputs (in a replay, the
        recorded batch)."""
        for batch in super().batch_generator(data_iterable):
            yield batch if self.recorder is None else self.recorder.feed(batch)

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]):
        if self.recorder is None:
            super().train_step(data_iterator)
            return
        # The step zeroes them first anyway; none carried in makes every step a boundary a
        # ring's window can start at (ring.py).
        self.optimizers.zero_grad(set_to_none=True)
        # train() counts the step before it calls train_step: the count moves into the
        # recorded step, so the state a step begins from (what a replay loads, and the script's
        # own loop counts on from) is the count before it, and changes only inside steps.
        self.step -= 1
        with self._recorded_step():
            self.step += 1
            super().train_step(data_iterator)

    def _recorded_step(self) -> contextlib.AbstractContextManager:
        if self.detector is not None:
            return self.detector.step()
        assert self.recorder is not None
        return self.recorder.step()

    def close(self) -> None:
        try:
            if self.recorder is not None:
                self.recorder.close()
            if self.detector is not None:
                self.detector.close()
        finally:
            super().close()


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def recorded(config: Trainer.Config, **sdcreplay: Any) -> RecordingTrainer.Config:
    """A config registry's ``Trainer.Config`` as a recorded run's, with ``sdcreplay`` the
    `SdcReplay` section's fields: ``recorded(llama3_debugmodel(), bundle="run.bundle")``."""
    if type(config) is not Trainer.Config:
        raise SdcReplayError(
            f"recorded() takes TorchTitan's Trainer.Config; this config is a "
            f"{type(config).__qualname__}, the config of another trainer",
            "Subclass that trainer as RecordingTrainer subclasses Trainer (docs/porting.md, "
            '"TorchTitan"), or record its steps with sdcreplay.Recorder in its train_step.',
        )
    given = {item.name: getattr(config, item.name) for item in fields(config) if item.init}
    return RecordingTrainer.Config(**given, sdcreplay=SdcReplay(**sdcreplay))


class RecordingConfigManager(ConfigManager):
    """TorchTitan's ConfigManager, whose ``--module/--config`` config is a recorded run's."""

    def _load_config(self, args: list[str]) -> tuple[object, list[str]]:
        loaded, rest = super()._load_config(args)
        assert isinstance(loaded, Trainer.Config)
        return recorded(loaded), rest


def main(argv: list[str] | None = None) -> None:
    """TorchTitan's ``torchtitan.train`` entry point, with the ``--sdcreplay.*`` section; what
    sdcreplay refuses (before training starts) is said as ``Error:``/``Hint:``, exit 3."""
    from torchtitan.tools.logging import init_logger

    init_logger()
    try:
        _train(RecordingConfigManager().parse_args(argv))
    except SdcReplayError as exc:
        print(f"Error: {exc.message}\nHint: {exc.hint}", file=sys.stderr)
        raise SystemExit(3) from None


def _train(config: RecordingTrainer.Config) -> None:
    trainer = None
    try:
        trainer = config.build()  # type: ignore[attr-defined]
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


__all__ = ["RecordingConfigManager", "RecordingTrainer", "SdcReplay", "main", "recorded"]

if __name__ == "__main__":
    main()
