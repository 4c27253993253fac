"""The trainer callbacks: a tiny model trained by the framework's own Trainer, a fault planted
in one step, the alarm bundle the callback writes, and its replay."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import TESTS

import sdcreplay
from sdcreplay import Bundle
from sdcreplay.capture.faults import Injector, parse_specs
from sdcreplay.capture.operators import OperatorMode
from sdcreplay.online.update_detector import UpdateDetector

HERE = TESTS
RING = 4
FAULTY_STEP = 3


class Defect:
    """The recording device's defect: an Injector under an OperatorMode during one step (what
    `sdcreplay record --inject` does), entered and left by trainer callback events."""

    def __init__(self, spec: str):
        self.spec, self.mode = spec, None

    def enter(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if step == FAULTY_STEP:
            injector = Injector(parse_specs([self.spec]), "cpu")
            self.mode = OperatorMode(model, optimizer, [injector], step)
            self.mode.__enter__()

    def leave(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None


def check_alarm_bundle(path: Path, source_entry: str) -> None:
    """Written because of the alarm at the faulty step; the workload reproduces every clean
    step bit for bit and the faulty one diverges where the fault was planted."""
    bundle = Bundle.open(path)
    assert bundle.complete and bundle.trusted
    assert bundle.step_indices == list(range(FAULTY_STEP + 1))  # fewer than 2K: all held
    trigger = bundle.manifest.trigger
    assert (trigger.source, trigger.step, trigger.ring) == ("UpdateDetector", FAULTY_STEP, RING)
    assert trigger.reason.startswith(f"UpdateDetector: step {FAULTY_STEP} nonfinite:")
    assert bundle.verification.status == "passed"  # step 0 re-executed through the workload
    replayed = sdcreplay.replay_on_device(bundle, "cpu")
    first = sdcreplay.compare_logs(bundle.signature_log(), replayed).first
    assert (first.step, first.name) == (FAULTY_STEP, source_entry)


Q_PROJ_NAN = (
    "kind=nan,op=aten.mm,module=model.layers.0.self_attn.q_proj,phase=forward,"
    f"step={FAULTY_STEP},index=0"
)


def hf_defective_run(tmp_path: Path, out: Path, factory: dict, **trainer_options):
    """A tiny Llama trained by a Trainer (hf_workload.make_trainer with ``trainer_options``),
    the q_proj NaN planted at the faulty step, watched by a callback naming
    hf_workload.make_workload with ``factory``; returns (trainer, callback), not trained."""
    from hf_workload import make_trainer
    from transformers import TrainerCallback

    from sdcreplay.integrations.hf import SdcReplayCallback

    defect = Defect(Q_PROJ_NAN)

    class DefectCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            defect.enter(state.global_step, model, optimizer.optimizer)

        def on_step_end(self, args, state, control, **kwargs):
            defect.leave()

    callback = SdcReplayCallback(
        out,
        f"{HERE / 'hf_workload.py'}:make_workload",
        workload_kwargs={"seed": 0, "max_steps": 8, **factory},
        ring=RING,
    )
    trainer = make_trainer(
        str(tmp_path / "trainer"), callbacks=[DefectCallback(), callback], **trainer_options
    )
    return trainer, callback


@pytest.mark.parametrize("accumulation", [1, 3])
def test_hf_trainer_callback_writes_an_alarm_bundle_that_replays(
    tmp_path, monkeypatch, accumulation
):
    """With gradient accumulation each recorded step's batch is its micro-batches, every one
    with the step's num_items_in_batch, and the workload replays the Trainer's update step."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(HERE))
    out = tmp_path / "hf-alarm.bundle"
    trainer, callback = hf_defective_run(
        tmp_path, out, {"accumulation": accumulation}, accumulation=accumulation
    )
    with pytest.warns(UserWarning, match=f"step {FAULTY_STEP}: nonfinite"):
        trainer.train()
    assert trainer.state.global_step == FAULTY_STEP + 1  # stopped at the alarm
    assert [alarm.bundle for alarm in callback.alarms] == [str(out)]
    assert sorted(os.listdir(tmp_path)) == ["hf-alarm.bundle", "trainer"]
    check_alarm_bundle(out, "forward:model.layers.0.self_attn.q_proj")
    first, _ = Bundle.open(out).load_step(0)
    if accumulation == 1:
        assert sorted(first) == ["input_ids", "labels", "num_items_in_batch"]
    else:
        assert len(first) == accumulation  # each micro-batch, the step's item count in each
        assert len({int(micro["num_items_in_batch"]) for micro in first}) == 1
        assert int(first[0]["num_items_in_batch"]) == accumulation * 2 * 7  # shifted labels


def test_hf_trainer_with_its_own_compute_loss_replays_it(tmp_path, monkeypatch):
    """The subclass pops the labels and calls the model without them: the callback records
    what compute_loss received (labels included) and the workload replays that compute_loss,
    so the dump's verification passes and the bundle replays, and the Trainer gets its own
    compute_loss back after training."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(HERE))
    out = tmp_path / "own-loss.bundle"
    trainer, callback = hf_defective_run(tmp_path, out, {"own_loss": True}, own_loss=True)
    with pytest.warns(UserWarning, match=f"step {FAULTY_STEP}: nonfinite"):
        trainer.train()
    assert trainer.state.global_step == FAULTY_STEP + 1
    assert [alarm.bundle for alarm in callback.alarms] == [str(out)]
    check_alarm_bundle(out, "forward:model.layers.0.self_attn.q_proj")
    first, _ = Bundle.open(out).load_step(0)
    assert sorted(first) == ["input_ids", "labels", "num_items_in_batch"]
    assert "compute_loss" not in vars(trainer) and callback.failure is None


def test_a_dump_whose_replay_raises_is_written_and_warned_about(tmp_path, monkeypatch):
    """The factory's train_step raises KeyError('loss') when the dump re-executes the first
    step: the bundle is written with a failed verification naming it, a warning says so,
    and the alarm stops training as usual; nothing is raised out of train()."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(HERE))
    out = tmp_path / "broken.bundle"
    trainer, callback = hf_defective_run(tmp_path, out, {"broken": True})
    with pytest.warns(UserWarning) as warned:
        trainer.train()
    messages = [str(w.message) for w in warned]
    assert any("the workload cannot replay the ring's bundle" in m for m in messages), messages
    assert trainer.state.global_step == FAULTY_STEP + 1
    verification = Bundle.open(out).verification
    assert (verification.status, verification.problem) == (
        "failed",
        "the workload's step raised KeyError: 'loss'",
    )


def _judging_fails(self, *args, **kwargs) -> None:
    raise RuntimeError("the detector failed")


def test_a_failure_of_the_callback_is_warned_and_training_goes_on(tmp_path, monkeypatch):
    """The detector fails (made to raise as it judges a step: a ring's dump itself never
    raises): the callback warns, stops watching and gives the Trainer its compute_loss back;
    train() runs to max_steps."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setattr(UpdateDetector, "judge", _judging_fails)
    trainer, callback = hf_defective_run(tmp_path, tmp_path / "x.bundle", {})
    with pytest.warns(UserWarning, match="SdcReplayCallback failed in on_step_end") as warned:
        trainer.train()
    assert trainer.state.global_step == 8
    assert callback.failure is not None and not callback.watching
    assert "compute_loss" not in vars(trainer)
    assert any("stops watching and training goes on unwatched" in str(w.message) for w in warned)


def lightning_trainer(lightning, callbacks: list, max_steps: int = 8, **options):
    return lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **options,
    )


@pytest.mark.parametrize(
    "recipe",
    [
        {},
        {"scheduled": "step", "gradient_clip_val": 0.05},
        {"scheduled": "step", "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    ],
    ids=["plain", "scheduler+clip-norm", "scheduler+clip-value"],
)
def test_lightning_callback_writes_an_alarm_bundle_that_replays(tmp_path, monkeypatch, recipe):
    """Also with a per-batch scheduler and the Trainer's clipping (small enough to clip every
    step): the bundle holds the scheduler's state, and the workload clips as the Trainer."""
    lightning = pytest.importorskip("lightning")
    monkeypatch.syspath_prepend(str(HERE))
    from lightning.pytorch import Callback
    from lightning_workload import batches, make_module

    from sdcreplay.integrations.lightning import SdcReplayCallback

    clipping = {k: v for k, v in recipe.items() if k.startswith("gradient_clip")}
    norms: list[float] = []

    # Lightning runs the forward inside optimizer.step(closure): named by operator and count.
    defect = Defect(f"kind=nan,op=aten.addmm,step={FAULTY_STEP},nth=0,index=0")

    class DefectCallback(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            defect.enter(trainer.global_step, pl_module, trainer.optimizers[0])

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            parameters = [p for p in pl_module.parameters() if p.grad is not None]
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in parameters])))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            defect.leave()

    out = tmp_path / "lightning-alarm.bundle"
    callback = SdcReplayCallback(
        out, f"{HERE / 'lightning_workload.py'}:make_workload",
        workload_kwargs={"seed": 0, **recipe}, ring=RING,
    )  # fmt: skip
    trainer = lightning_trainer(lightning, [DefectCallback(), callback], **clipping)
    loader = torch.utils.data.DataLoader(batches(0), batch_size=None)
    module = make_module(0, recipe.get("scheduled"))
    with pytest.warns(UserWarning, match=f"step {FAULTY_STEP}: nonfinite:loss"):
        trainer.fit(module, loader)
    assert trainer.global_step == FAULTY_STEP + 1
    assert [alarm.bundle for alarm in callback.alarms] == [str(out)]
    check_alarm_bundle(out, "forward:net.0")
    if recipe:  # clipping changed the gradients; the scheduler state is part of the bundle
        assert min(norms[:FAULTY_STEP]) > 4 * recipe["gradient_clip_val"]
        assert Bundle.open(out).state_object_names == ["scheduler"]
        lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
        assert lrs != [2e-3]  # OneCycleLR moved on from its initial max_lr / 25


def test_a_lightning_workload_that_clips_otherwise_than_the_trainer_fails_verification(
    tmp_path, monkeypatch
):
    """The Trainer clips, the workload replay rebuilds does not: the alarm bundle's first-step
    check says so (written in the bundle and warned about; the alarm still stops training)."""
    lightning = pytest.importorskip("lightning")
    monkeypatch.syspath_prepend(str(HERE))
    from lightning.pytorch import Callback
    from lightning_workload import batches, make_module

    from sdcreplay.integrations.lightning import SdcReplayCallback

    defect = Defect(f"kind=nan,op=aten.addmm,step={FAULTY_STEP},nth=0,index=0")

    class DefectCallback(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            defect.enter(trainer.global_step, pl_module, trainer.optimizers[0])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            defect.leave()

    out = tmp_path / "x.bundle"
    callback = SdcReplayCallback(
        out, f"{HERE / 'lightning_workload.py'}:make_workload", workload_kwargs={"seed": 0},
        ring=RING,
    )  # fmt: skip
    trainer = lightning_trainer(lightning, [DefectCallback(), callback], gradient_clip_val=0.05)
    loader = torch.utils.data.DataLoader(batches(0), batch_size=None)
    with pytest.warns(UserWarning) as warned:
        trainer.fit(make_module(0), loader)
    messages = [str(w.message) for w in warned]
    assert any("the workload cannot replay the ring's bundle" in m for m in messages), messages
    verification = Bundle.open(out).verification
    assert verification.status == "failed", verification
    # the gradients the step computed match; what the optimizer did with them does not
    assert verification.problem.startswith("optim:net.0.weight.exp_avg differs: every grad: ")
    assert "(clipping? a scheduler? an EMA?)" in verification.problem


def test_lightning_callback_refuses_what_it_cannot_record(tmp_path, monkeypatch):
    lightning = pytest.importorskip("lightning")
    monkeypatch.syspath_prepend(str(HERE))
    from lightning_workload import batches, make_module

    from sdcreplay.errors import SdcReplayError
    from sdcreplay.integrations.lightning import SdcReplayCallback

    loader = torch.utils.data.DataLoader(batches(0), batch_size=None)
    for module, options, problem in (
        (make_module(0), {"accumulate_grad_batches": 2}, "accumulate_grad_batches=2"),
        (make_module(0, "epoch"), {}, "a scheduler with interval='epoch', frequency=1"),
    ):
        callback = SdcReplayCallback(tmp_path / "x.bundle", "lightning_workload:make_workload")
        with pytest.raises(SdcReplayError, match=problem):
            lightning_trainer(lightning, [callback], max_steps=2, **options).fit(module, loader)
        assert not (tmp_path / "x.bundle").exists()


def test_only_the_integrations_import_transformers_and_lightning():
    from test_architecture import PACKAGE, _module_name, _third_party

    frameworks = {"transformers", "lightning", "accelerate", "pytorch_lightning"}
    importers = {
        _module_name(path) for path in PACKAGE.rglob("*.py") if _third_party(path) & frameworks
    }
    assert importers == {"sdcreplay.integrations.hf", "sdcreplay.integrations.lightning"}


def test_lightning_step_that_raises_leaves_nothing_patched(tmp_path, monkeypatch):
    lightning = pytest.importorskip("lightning")
    monkeypatch.syspath_prepend(str(HERE))
    from lightning_workload import Regressor, batches

    from sdcreplay.integrations.lightning import SdcReplayCallback

    class Crashes(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if batch_idx == 2:
                raise RuntimeError("the loop failed mid-step")
            return loss

    backward = torch.autograd.backward
    callback = SdcReplayCallback(tmp_path / "crash.bundle", "lightning_workload:make_workload")
    trainer = lightning.Trainer(
        max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="mid-step"):
        trainer.fit(Crashes(), torch.utils.data.DataLoader(batches(0), batch_size=None))
    assert torch.autograd.backward is backward  # the recorder's capture let go
    assert callback.watch.recorder.ring_steps == [0, 1]  # the step cut short is not held
    assert not (tmp_path / "crash.bundle").exists()


def test_a_failure_of_the_lightning_callback_is_warned_and_training_goes_on(tmp_path, monkeypatch):
    """The detector fails (made to raise as it judges a step: a ring's dump itself never
    raises): a warning, the callback stops watching (the recorder's capture lets go of
    backward), fit() runs to max_steps."""
    lightning = pytest.importorskip("lightning")
    monkeypatch.syspath_prepend(str(HERE))
    from lightning.pytorch import Callback
    from lightning_workload import batches, make_module

    from sdcreplay.integrations.lightning import SdcReplayCallback

    defect = Defect(f"kind=nan,op=aten.addmm,step={FAULTY_STEP},nth=0,index=0")

    class DefectCallback(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            defect.enter(trainer.global_step, pl_module, trainer.optimizers[0])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            defect.leave()

    monkeypatch.setattr(UpdateDetector, "judge", _judging_fails)
    callback = SdcReplayCallback(
        tmp_path / "x.bundle", f"{HERE / 'lightning_workload.py'}:make_workload",
        workload_kwargs={"seed": 0}, ring=RING,
    )  # fmt: skip
    trainer = lightning_trainer(lightning, [DefectCallback(), callback])
    backward = torch.autograd.backward
    loader = torch.utils.data.DataLoader(batches(0), batch_size=None)
    with pytest.warns(UserWarning, match="SdcReplayCallback failed in on_train_batch_end"):
        trainer.fit(make_module(0), loader)
    assert trainer.global_step == 8 and not callback.watching
    assert torch.autograd.backward is backward


LATE_FAULT = 7  # after the checkpoint of step 6


def check_anchored_bundle(path: Path, checkpoint: Path, first_entry: str) -> None:
    """The alarm bundle references the trainer's last checkpoint (no copy of the state), holds
    every step since it, verifies, and a replay from the checkpoint matches the clean step and
    diverges at the faulty one."""
    bundle = Bundle.open(path)
    state = bundle.manifest.state
    assert (state.kind, Path(state.path)) == ("checkpoint", checkpoint.resolve())
    assert bundle.step_indices == [6, LATE_FAULT]
    assert bundle.manifest.trigger.anchor == "checkpoint"
    assert bundle.manifest.capture.level == "boundary"
    assert bundle.verification.status == "passed"
    replayed = sdcreplay.replay_on_device(bundle, "cpu")
    first = sdcreplay.compare_logs(bundle.signature_log(), replayed).first
    assert (first.step, first.name) == (LATE_FAULT, first_entry)


def test_hf_trainer_checkpoints_anchor_the_ring(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(HERE))
    from hf_workload import make_trainer
    from transformers import TrainerCallback

    from sdcreplay.integrations.hf import SdcReplayCallback

    defect = Defect(
        "kind=nan,op=aten.mm,module=model.layers.0.self_attn.q_proj,phase=forward,index=0"
    )

    class DefectCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step == LATE_FAULT:
                defect.enter(FAULTY_STEP, model, optimizer.optimizer)

        def on_step_end(self, args, state, control, **kwargs):
            defect.leave()

    out = tmp_path / "hf-anchored.bundle"
    callback = SdcReplayCallback(
        out,
        f"{HERE / 'hf_workload.py'}:make_workload",
        workload_kwargs={"seed": 0, "max_steps": 8},
        ring=RING,
        signature="boundary",
    )
    trainer = make_trainer(
        str(tmp_path / "trainer"), callbacks=[DefectCallback(), callback], save_steps=3
    )
    with pytest.warns(UserWarning, match=f"step {LATE_FAULT}: nonfinite"):
        trainer.train()
    assert [alarm.bundle for alarm in callback.alarms] == [str(out)]
    check_anchored_bundle(out, tmp_path / "trainer" / "checkpoint-6", "loss")
    reference = Bundle.open(out).manifest.state
    assert reference.format == "hf" and "optimizer.pt" in reference.files


def test_lightning_checkpoints_anchor_the_ring(tmp_path, monkeypatch):
    lightning = pytest.importorskip("lightning")
    monkeypatch.syspath_prepend(str(HERE))
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_workload import batches, make_module

    from sdcreplay.integrations.lightning import SdcReplayCallback

    defect = Defect("kind=nan,op=aten.addmm,nth=0,index=0")

    class DefectCallback(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == LATE_FAULT:
                defect.enter(FAULTY_STEP, pl_module, trainer.optimizers[0])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            defect.leave()

    out = tmp_path / "lightning-anchored.bundle"
    callback = SdcReplayCallback(
        out,
        f"{HERE / 'lightning_workload.py'}:make_workload",
        workload_kwargs={"seed": 0},
        ring=RING,
        signature="boundary",
    )
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = lightning.Trainer(
        max_steps=8,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[DefectCallback(), callback, saving],
    )
    loader = torch.utils.data.DataLoader(batches(0), batch_size=None)
    with pytest.warns(UserWarning, match=f"step {LATE_FAULT}: nonfinite:loss"):
        trainer.fit(make_module(0), loader)
    assert [alarm.bundle for alarm in callback.alarms] == [str(out)]
    check_anchored_bundle(out, tmp_path / "ckpt" / "epoch=0-step=6.ckpt", "loss")
    assert type(trainer.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"  # put back
