"""The update detector on real steps, with faults planted by sdcreplay's injector.

By default it judges before the optimizer's update and copies nothing: an alarmed execution
is stopped before the update and recomputed from the unchanged parameters. The copy-based
rule (``when="after_update"``) judges the update's norms. ``nth=0`` fires a fault in the
first execution of the step only (transient); no ``nth`` fires it in the recompute too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import SMALL, planted, ring_recorder, wrapped_as

from sdcreplay import Bundle, compare_logs, replay_on_device
from sdcreplay.capture.faults import Injector, parse_specs
from sdcreplay.capture.operators import OperatorMode
from sdcreplay.errors import SdcReplayError
from sdcreplay.online.second_opinion import ReplicaOpinion
from sdcreplay.online.stopping import (
    NonFiniteResultError,
    PersistentFaultError,
    RecomputeLimitError,
    TrainingStopped,
)
from sdcreplay.online.update_detector import UpdateDetector
from sdcreplay.workload.definition import Workload, build_workload

BIAS = "kind=bias,op=aten.mm,module=layers.0.attn.wq,phase=backward,step=10,index=69,scale=1e4"


def small_llama(**kwargs) -> Workload:
    return build_workload("builtin:tiny-llama", dict(SMALL, **kwargs))


def run_detector(spec: str | None, steps: int = 14, **options) -> UpdateDetector:
    workload = small_llama()
    detector = UpdateDetector(workload, warmup=5, spike_steps=5, **options)
    for i in range(steps):
        with planted(workload.model, workload.optimizer, spec, i):
            detector.run_step(workload.get_batch(i))
    return detector


def same_weights(a: Workload, b: Workload) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values())
    )


def test_a_transient_bias_fault_is_recomputed_and_the_clean_run_continues() -> None:
    detector = run_detector(BIAS + ",nth=0")  # fires in the first execution only
    (alarm,) = detector.alarms
    assert (alarm.step, alarm.reasons, alarm.classification, alarm.recomputes) == (
        10,
        ["grad_spike", "grad_norm_jump", "grad:layers.0.attn.wq.weight"],
        "transient",
        1,
    )
    assert alarm.original.update_norms == {} and alarm.original.grad_norms  # judged before
    metrics = detector.metrics()
    assert {k: metrics[k] for k in ("steps", "detections", "recomputes", "transient")} == {
        "steps": 14,
        "detections": 1,
        "recomputes": 1,
        "transient": 1,
    }
    assert metrics["overhead_ms"] >= metrics["recompute_ms"] > 0
    # the recompute was kept: the run equals one that never had the fault
    clean = run_detector(None)
    assert clean.alarms == []
    assert same_weights(clean.workload, detector.workload)


def test_an_alarmed_step_is_stopped_before_its_update_so_nothing_needs_a_copy() -> None:
    """A NaN the recompute gives again stops training: the optimizer never ran (its state and
    every parameter as before the step), though nothing was copied to put them back."""
    spec = "kind=nan,op=aten.mm,module=layers.0.mlp.w2,phase=backward,step=2,index=3"
    workload = small_llama()
    detector = UpdateDetector(workload, warmup=5, spike_steps=5)
    for i in range(2):
        detector.run_step(workload.get_batch(i))
    before = [p.detach().clone() for p in workload.model.parameters()]
    moments = {k: v.clone() for k, v in workload.optimizer.state_dict()["state"][0].items()}
    with pytest.raises(NonFiniteResultError) as stopped:
        with planted(workload.model, workload.optimizer, spec, 2):
            detector.run_step(workload.get_batch(2))
    alarm = stopped.value.alarm
    assert (alarm.step, alarm.classification, alarm.recomputes) == (2, "correct", 1)
    assert "nonfinite:grad (" in stopped.value.message  # every gradient: summarized
    assert all(torch.equal(a, b) for a, b in zip(before, workload.model.parameters()))
    after = workload.optimizer.state_dict()["state"][0]
    assert all(torch.equal(moments[k], after[k]) for k in moments)  # step count included
    assert all(p.grad is None for p in workload.model.parameters())  # discarded
    assert isinstance(stopped.value, TrainingStopped) and "another device" in stopped.value.hint


def test_nan_in_the_gradients_alarms_without_warmup_and_is_recomputed_away() -> None:
    spec = "kind=nan,op=aten.mm,module=layers.0.mlp.w2,phase=backward,step=2,nth=0,index=3"
    detector = run_detector(spec, steps=4)
    (alarm,) = detector.alarms
    assert alarm.step == 2 and alarm.classification == "transient"
    assert "nonfinite:grad:layers.0.mlp.w2.weight" in alarm.reasons
    assert all(reason.startswith("nonfinite:") for reason in alarm.reasons)
    assert all(math.isfinite(p.sum().item()) for p in detector.workload.model.parameters())
    assert same_weights(run_detector(None, steps=4).workload, detector.workload)


def test_a_sticky_bias_fault_is_persistent_when_another_device_disagrees() -> None:
    opinion = ReplicaOpinion(small_llama)
    with pytest.raises(PersistentFaultError) as caught:
        run_detector(BIAS, second_opinion=opinion)
    alarm = caught.value.alarm
    assert (alarm.step, alarm.classification) == (10, "persistent")
    assert alarm.reasons[:3] == ["grad_spike", "grad_norm_jump", "grad:tok_embeddings.weight"]
    assert alarm.recomputed is not None and alarm.recomputed.result == alarm.original.result
    assert opinion.last is not None and opinion.last.loss == pytest.approx(alarm.original.loss)
    assert "rolled back" in str(caught.value)
    assert caught.value.accuses_device and alarm.contradicted_by == "cpu"
    assert "cpu computed another result" in str(caught.value)
    assert caught.value.hint.startswith("Take this device out of service")


def weighted_llama() -> Workload:
    """tiny-llama whose batches carry a loss weight: a weight of 1000 is a genuine anomaly
    (the data asks for it), which every device computes alike."""
    workload = small_llama()

    def train_step(batch):
        loss = workload.loss(batch) * batch.get("weight", 1.0)
        loss.backward()
        workload.optimizer.step()
        workload.optimizer.zero_grad()
        return loss

    workload.train_step = train_step
    return workload


@pytest.mark.parametrize("when", ["before_update", "after_update"])
def test_a_reproducible_alarm_another_device_confirms_is_correct(when: str) -> None:
    workload = weighted_llama()
    opinion = ReplicaOpinion(weighted_llama)
    detector = UpdateDetector(workload, warmup=5, spike_steps=5, second_opinion=opinion, when=when)
    for i in range(12):
        batch = workload.get_batch(i)
        detector.run_step({**batch, "weight": 1000.0} if i == 10 else batch)
    (alarm,) = detector.alarms
    assert (alarm.step, alarm.reasons[:2], alarm.classification) == (
        10,
        ["loss_spike", "grad_spike"],
        "correct",
    )
    assert opinion.last is not None and opinion.last.loss == alarm.original.loss
    assert detector.metrics()["correct"] == 1
    # the alarmed step was kept: the run equals one without a detector
    plain = weighted_llama()
    for i in range(12):
        batch = plain.get_batch(i)
        plain.run_step({**batch, "weight": 1000.0} if i == 10 else batch)
    assert same_weights(plain, workload)


def test_without_a_second_opinion_repeated_reproducible_alarms_become_persistent() -> None:
    """A sticky fault from step 10 on: each alarm reproduces; isolated ones pass as correct,
    the second in a row is persistent."""
    sticky = BIAS.replace("step=10,", "")
    workload = small_llama()
    detector = UpdateDetector(workload, warmup=5, spike_steps=5, persistent_after=2)
    with pytest.raises(PersistentFaultError) as caught:
        for i in range(20):
            with planted(workload.model, workload.optimizer, sticky if i >= 10 else None, i):
                detector.run_step(workload.get_batch(i))
    *earlier, last = detector.alarms
    assert caught.value.alarm is last and last.classification == "persistent"
    assert earlier and all(a.classification == "correct" for a in earlier)
    assert earlier[0].step >= 10 and earlier[-1].step == last.step - 1
    # no other device was asked: a persistent alarm, not an accusation
    assert not caught.value.accuses_device and last.contradicted_by is None
    assert "accuses no device" in str(caught.value)
    assert "out of service" not in caught.value.hint and "another device" in caught.value.hint


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_fault_on_every_recompute_hits_the_cap(deterministic: bool) -> None:
    """Only a deterministic step accuses the device: otherwise a healthy device may compute
    every execution differently too, and the error says so."""
    torch.use_deterministic_algorithms(deterministic)  # put back by conftest's autouse fixture
    # a new element each time: every execution differs from the one before
    workload = small_llama()
    detector = UpdateDetector(workload, warmup=5, spike_steps=5, max_recomputes=2)
    specs = [BIAS + f",nth={2 * n},index={69 + n}" for n in range(3)]
    for i in range(10):
        detector.run_step(workload.get_batch(i))
    before = [p.detach().clone() for p in workload.model.parameters()]
    injector = Injector(parse_specs(specs, include_env=False), "cpu")
    with pytest.raises(RecomputeLimitError, match="2 recomputes of step 10") as caught:
        with OperatorMode(workload.model, workload.optimizer, [injector], 10):
            detector.run_step(workload.get_batch(10))
    assert detector.metrics()["recomputes"] == 2
    assert all(torch.equal(a, b) for a, b in zip(before, workload.model.parameters()))
    assert caught.value.accuses_device is deterministic
    assert ("accuses no device" in str(caught.value)) is not deterministic
    assert caught.value.hint.startswith(
        "The device fails" if deterministic else "Train with sdcreplay's determinism switches"
    )


def test_a_step_that_begins_with_accumulated_gradients_is_refused_with_the_copy_as_hint():
    workload = small_llama()
    detector = UpdateDetector(workload)
    workload.loss(workload.get_batch(0)).backward()
    with pytest.raises(SdcReplayError, match="accumulated before it") as refused:
        detector.run_step(workload.get_batch(0))
    assert "when='after_update'" in refused.value.hint
    with pytest.raises(SdcReplayError, match="when='later'"):
        UpdateDetector(workload, when="later")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# No false alarm on healthy training with the default thresholds


def mlp_loop(optimizer: str, schedule: str, seed: int, steps: int):
    """The model of docs/online.md's loop with an ordinary optimizer and schedule: the
    detector's keyword arguments and the batches."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if optimizer == "sgd-momentum":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedules = {
        "cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
        "step-decay": lambda: torch.optim.lr_scheduler.StepLR(opt, steps // 4, gamma=0.3),
        "warmup-cosine": lambda: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / steps))
        ),
    }
    scheduler = schedules[schedule]()

    def train_step(batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()
        opt.zero_grad()
        return loss

    def batches(i: int):
        generator = torch.Generator().manual_seed(1000 * seed + i)
        x = torch.randn(32, 16, generator=generator)
        return x, x.sum(1, keepdim=True)

    pieces = {"model": model, "optimizer": opt, "train_step": train_step}
    return {**pieces, "state": {"scheduler": scheduler}}, batches


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw"])
@pytest.mark.parametrize("schedule", ["cosine", "step-decay", "warmup-cosine"])
def test_healthy_training_raises_no_alarm_with_the_default_thresholds(optimizer, schedule):
    """The loop that alarmed on momentum's own rise (SGD with momentum, a cosine schedule:
    update norms 0.0137, 0.0205, 0.0298 at steps 9-11) and its kin: 0 alarms in 3 x 100
    clean steps each."""
    for seed in range(3):
        pieces, batches = mlp_loop(optimizer, schedule, seed, 100)
        with UpdateDetector(**pieces) as detector:
            for i in range(100):
                detector.run_step(batches(i))
        assert detector.alarms == [], (seed, [a.describe() for a in detector.alarms])


def test_a_transformer_with_warmup_and_cosine_raises_no_alarm() -> None:
    for seed in range(2):
        workload = small_llama(seed=seed, warmup_steps=10, schedule_steps=60)
        with UpdateDetector(workload) as detector:
            for i in range(60):
                detector.run_step(workload.get_batch(i))
        assert detector.alarms == [] and detector.metrics()["detections"] == 0


def test_the_fault_of_docs_online_trips_the_default_thresholds() -> None:
    """docs/online.md's planted backward bias, with the defaults it states."""
    text = (Path(__file__).parents[2] / "docs" / "online.md").read_text()
    blocks = text.split("```python\n")[1:]
    (block,) = [b for b in blocks if "last_alarm.describe()" in b and "kind=bias" in b]
    printed: list[str] = []
    exec(compile(block.split("```")[0], "docs/online.md", "exec"), {"print": printed.append})
    assert printed == ["step 10: grad_norm_jump, grad:layers.0.attn.wq.weight -> transient"]


# ---------------------------------------------------------------------------
# The copy-based rule: the update's norms


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)


def test_after_the_update_an_unusual_update_norm_alarms_by_parameter() -> None:
    """Plain SGD: the update is the gradient; a x100 gradient element in fc1 moves fc1's update
    norm far outside its recent spread (and its gradient's), and only fc1's (spikes are off)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(8, 16, bias=False))
    model.add_module("act", torch.nn.Tanh())
    model.add_module("fc2", torch.nn.Linear(16, 4, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    detector = UpdateDetector(
        model=model,
        optimizer=optimizer,
        loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        when="after_update",
        spike_steps=10**9,
        sigmas=6.0,  # random batches: 3 sigmas alarms once on a clean step here (correct)
    )
    spec = "kind=bias,op=aten.mm,module=fc1,phase=backward,step=30,nth=0,index=5,scale=100"
    for i in range(32):
        with planted(model, optimizer, spec, i):
            detector.run_step(batch(i))
    (alarm,) = detector.alarms
    assert (alarm.step, alarm.reasons, alarm.classification) == (
        30,
        ["grad_norm_jump", "grad:fc1.weight", "update:fc1.weight"],
        "transient",
    )
    assert alarm.original.update_norms and alarm.original.grad_norms


def test_after_the_update_a_transient_fault_is_rolled_back_from_the_copy() -> None:
    detector = run_detector(BIAS + ",nth=0", when="after_update")
    (alarm,) = detector.alarms
    assert (alarm.step, alarm.classification, alarm.recomputes) == (10, "transient", 1)
    assert "grad_spike" in alarm.reasons and alarm.original.update_norms
    assert same_weights(run_detector(None, when="after_update").workload, detector.workload)


# ---------------------------------------------------------------------------
# With a ring Recorder: the alarmed execution, stopped before its update, is the evidence


@pytest.mark.parametrize("signature", ["layer", "boundary"])
def test_the_dump_holds_the_alarmed_execution_stopped_before_its_update(
    tmp_path: Path, cli, signature: str
):
    workload = small_llama()
    recorder = ring_recorder(workload, tmp_path / "update.bundle", signature=signature)
    detector = UpdateDetector(workload, warmup=5, spike_steps=5, recorder=recorder)
    for i in range(14):
        with planted(workload.model, workload.optimizer, BIAS + ",nth=0" if i == 10 else None, i):
            detector.run_step(workload.get_batch(i))
    (alarm,) = detector.alarms
    assert (alarm.step, alarm.classification) == (10, "transient")
    assert recorder.ring_steps == [8, 9, 10, 11, 12, 13]  # step 10 once: the kept execution
    assert same_weights(run_detector(None).workload, workload)  # the recompute was kept
    bundle = Bundle.open(alarm.bundle)
    last = bundle.steps[-1]
    assert (last.index, last.stopped, last.optimizer_step) == (10, True, False)
    assert bundle.verified
    names = [name for name, _ in bundle.signature_log().steps[10]]
    assert names[-1].startswith("step_grad:") and not any(n.startswith("param:") for n in names)
    about = json.loads(cli("info", alarm.bundle, "--json").stdout)
    assert (about["trigger"]["source"], about["trigger"]["step"]) == ("UpdateDetector", 10)
    # a clean replay stops the step where the recording did, and diverges from it at the fault
    first = compare_logs(bundle.signature_log(), replay_on_device(bundle, "cpu")).first
    assert first is not None and first.step == 10
    assert first.phase == ("backward" if signature == "layer" else "optimizer")
    replayed = cli("replay", alarm.bundle, "--json")
    assert replayed.exit_code == 1, replayed.output
    device = json.loads(replayed.stdout)["devices"][0]["first_divergence"]
    assert (device["step"], device["name"]) == (10, first.name)


def test_an_unusual_update_is_seen_once_applied_dumped_and_left_unresolved(tmp_path: Path):
    """A fault in the optimizer's own arithmetic (AdamW's write of the new weights) changes
    nothing the optimizer is given: judged before the update, the step passes; the sketch of
    the update (its rows' and columns' sums, divided by the learning rate) sees it once
    applied. Nothing was copied to take it back: the alarm is dumped, warned about and left
    unresolved, and training goes on."""
    spec = (
        "kind=bitflip,op=aten.addcdiv_,module=layers.0.mlp.w1.weight,phase=optimizer,"
        "step=12,nth=0,index=5,bit=25"
    )
    workload = small_llama()
    recorder = ring_recorder(workload, tmp_path / "update.bundle")
    detector = UpdateDetector(workload, recorder=recorder)
    with pytest.warns(UserWarning, match="the update was applied"):
        for i in range(14):
            with planted(workload.model, workload.optimizer, spec, i):
                detector.run_step(workload.get_batch(i))
    (alarm,) = detector.alarms
    assert (alarm.step, alarm.reasons, alarm.classification) == (
        12,
        ["update:layers.0.mlp.w1.weight"],
        None,
    )
    assert alarm.recomputes == 0 and detector.metrics()["detections"] == 1
    bundle = Bundle.open(alarm.bundle)
    assert bundle.step_indices[-1] == 12 and not bundle.steps[-1].stopped
    assert bundle.manifest.trigger.reason.endswith("(unresolved)")
    # the step's recorded parameters hold the corrupted write: a healthy replay differs there
    first = compare_logs(bundle.signature_log(), replay_on_device(bundle, "cpu")).first
    assert (first.step, first.name) == (12, "param:layers.0.mlp.w1.weight")


def test_the_norms_of_fsdp2_gradients_are_those_of_the_whole_gradients(lone_rank):
    """FSDP2 (TorchTitan's) trains DTensor parameters: their gradient norms used to raise
    ``.tolist() is not supported for tensor subclasses`` into the training loop."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdcreplay.online.alarms import gradient_norms

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    sharded = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    sharded.load_state_dict(plain.state_dict())
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
    x = torch.randn(3, 4)
    for model in (plain, sharded):
        model(x).square().sum().backward()
    assert gradient_norms(sharded) == pytest.approx(gradient_norms(plain), rel=1e-6)
    assert set(gradient_norms(sharded)) == {"0.weight", "0.bias", "1.weight", "1.bias"}


@pytest.mark.parametrize("wrapper", ["checkpoint", "ddp"])
def test_an_alarm_under_a_wrapper_names_the_plain_parameters(wrapper: str, request) -> None:
    """TorchTitan's checkpointed blocks, a DDP: the reasons name what the model itself calls
    its parameters (a fault spec's names), not ``_checkpoint_wrapped_module.`` or ``module.``."""
    if wrapper == "ddp":
        request.getfixturevalue("lone_rank")
    spec = "kind=nan,op=aten.mm,module=layers.0.mlp.w2,phase=backward,step=2,nth=0,index=3"
    workload = wrapped_as(small_llama(), wrapper)
    detector = UpdateDetector(workload, warmup=5, spike_steps=5)
    for i in range(3):
        with planted(workload.model, workload.optimizer, spec, i):
            detector.run_step(workload.get_batch(i))
    (alarm,) = detector.alarms
    assert (alarm.step, alarm.classification) == (2, "transient")
    plain = [name for name, _ in small_llama().model.named_parameters()]
    assert "nonfinite:grad:layers.0.mlp.w2.weight" in alarm.reasons
    assert {reason.split(":")[-1] for reason in alarm.reasons} <= set(plain)
    assert list(alarm.original.grad_norms) == plain
