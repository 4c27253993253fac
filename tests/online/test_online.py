"""Online detectors on real steps, with faults planted by sdcreplay's injector.

A fault is put into one execution of a checked step by its ordinal among the
matching calls (``nth``): the operator mode spans every execution of the step,
so ``nth=0`` is the reference execution's call and ``nth=1`` the replay's.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.optim.optimizer as optimizer_module
from conftest import REPO, SMALL, ring_recorder

from sdcreplay.capture.faults import Injector, parse_specs
from sdcreplay.capture.operators import OperatorMode
from sdcreplay.errors import SdcReplayError
from sdcreplay.online.replay_check import ReplayCheck
from sdcreplay.online.step import AttributeScalar
from sdcreplay.online.stopping import (
    SDCReplayMismatch,
)
from sdcreplay.workload.definition import Workload, build_workload


class Loop:
    """A user's loop with its own step: dropout and BatchNorm (RNG, buffers), a token counter
    outside every module, Python and NumPy noise, optional gradient accumulation."""

    def __init__(self, micro_batches: int = 1, seed: int = 0, set_to_none: bool = True):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential()
        self.model.add_module("fc1", torch.nn.Linear(8, 16, bias=False))
        self.model.add_module("norm", torch.nn.BatchNorm1d(16))
        self.model.add_module("drop", torch.nn.Dropout(0.25))
        self.model.add_module("fc2", torch.nn.Linear(16, 4, bias=False))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.micro_batches = micro_batches
        self.set_to_none = set_to_none
        self.tokens = 0

    def train_step(self, batch) -> torch.Tensor:
        x, y = batch
        total = torch.zeros(())
        for xs, ys in zip(x.chunk(self.micro_batches), y.chunk(self.micro_batches)):
            noise = 1e-3 * (random.random() + float(np.random.rand()))
            loss = torch.nn.functional.mse_loss(self.model(xs + noise), ys)
            (loss / self.micro_batches).backward()
            self.tokens += xs.shape[0]
            total = total + loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        return total

    def check(self, **options) -> ReplayCheck:
        return ReplayCheck(
            model=self.model,
            optimizer=self.optimizer,
            train_step=self.train_step,
            scalars={"tokens": AttributeScalar(self, "tokens")},
            **options,
        )


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)


def injected(model, optimizer, spec: str | None, step: int, label: str = "cpu"):
    """The operator mode of a step with ``spec`` planted (none: a clean step)."""
    if spec is None:
        return contextlib.nullcontext()
    injector = Injector(parse_specs([spec], include_env=False), label)
    return OperatorMode(model, optimizer, [injector], step)


def seeded(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def generators() -> tuple:
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()


def same_generators(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_fault_in_the_replay_only_is_named_exactly(deterministic: bool) -> None:
    """With torch's deterministic algorithms on, the odd execution accuses the device; off, a
    non-deterministic kernel could do the same on a healthy one, and the exception says so."""
    torch.use_deterministic_algorithms(deterministic)  # put back by conftest's autouse fixture
    loop = Loop()
    check = loop.check(num_steps=-1)
    check.run_step(batch(0))
    weight = loop.model.fc1.weight.detach().clone()
    # fc1's input needs no gradient: its backward has one mm, the weight's gradient
    spec = "kind=bitflip,op=aten.mm,module=fc1,phase=backward,nth=1,index=5,bit=22"
    with pytest.raises(SDCReplayMismatch) as caught, injected(loop.model, loop.optimizer, spec, 1):
        check.run_step(batch(1))
    error = caught.value
    assert (error.step, error.local_step, error.replay, error.rank) == (1, 2, 1, 0)
    assert (error.entry, error.micro_batch) == ("grad:fc1.weight", 0)
    assert (error.elements, error.bit_histogram, error.bundle) == (1, {22: 1}, None)
    assert error.evidence == "reference" and "agreed with neither" not in str(error)
    assert error.accuses_device is deterministic
    assert ("accuses no device" in str(error)) is not deterministic
    assert ("take the device of rank 0 (the one that" in error.hint) is deterministic
    assert "entry='grad:fc1.weight'" in str(error) and "bit 22: 1" in str(error)
    # raised before the optimizer step, with the state as the step began
    assert torch.equal(loop.model.fc1.weight, weight)
    assert loop.model.fc1.weight.grad is None and loop.tokens == 8


def test_a_check_built_inside_an_operator_mode_stops_executions_before_its_hooks() -> None:
    """The mode's optimizer pre-hook never runs for a stopped execution (else it would believe
    the replay's forward is in the optimizer, and a forward fault would not fire there)."""
    loop = Loop()
    spec = "kind=bitflip,op=aten.mm,module=fc2,phase=forward,nth=1,index=0,bit=22"
    with pytest.raises(SDCReplayMismatch) as caught, injected(loop.model, loop.optimizer, spec, 0):
        loop.check().run_step(batch(0))
    assert (caught.value.entry, caught.value.replay, caught.value.elements) == ("loss", 1, 1)


def test_every_micro_batch_is_checked() -> None:
    """TorchTitan replays only the first micro-batch; the second one's fault is found too."""
    loop = Loop(micro_batches=2)
    check = loop.check()
    spec = "kind=bitflip,op=aten.mm,module=fc1,phase=backward,nth=3,index=5,bit=22"
    with pytest.raises(SDCReplayMismatch) as caught, injected(loop.model, loop.optimizer, spec, 0):
        check.run_step(batch(0))
    error = caught.value
    assert (error.entry, error.micro_batch, error.replay) == ("grad:fc1.weight#1", 1, 1)
    assert error.elements == 1  # the sum of two micro-batches: one element, its own bits


def test_a_fault_in_a_later_replay_names_that_replay_and_a_fault_in_the_reference_too() -> None:
    loop = Loop()
    check = loop.check(num_steps=-1, num_replays=3)
    spec = "kind=bitflip,op=aten.mm,module=fc1,phase=backward,nth=2,index=5,bit=22"
    with pytest.raises(SDCReplayMismatch) as caught, injected(loop.model, loop.optimizer, spec, 0):
        check.run_step(batch(0))
    assert (caught.value.replay, caught.value.entry, caught.value.elements) == (
        2,
        "grad:fc1.weight",
        1,
    )
    # In the reference: every replay differs from it, the evidence execution sides with them,
    # so the reference's values (never copied) cannot be compared bit by bit.
    spec = spec.replace("nth=2", "nth=0")
    with pytest.raises(SDCReplayMismatch) as caught, injected(loop.model, loop.optimizer, spec, 1):
        check.run_step(batch(1))
    assert (caught.value.replay, caught.value.entry) == (1, "grad:fc1.weight")
    assert caught.value.elements is None and caught.value.bit_histogram is None
    assert caught.value.evidence == "replay"


def test_clean_steps_never_fire_and_the_run_equals_one_without_the_check() -> None:
    """50 checked steps with 2 replays each: same losses, parameters, buffers, generators and
    token count as the loop alone, so only the last execution's effects are kept."""
    runs = []
    for checked in (False, True):
        seeded()
        loop = Loop(micro_batches=2)
        check = loop.check(num_steps=-1, num_replays=2)
        losses = []
        for i in range(50):
            loss = check.run_step(batch(i)) if checked else loop.train_step(batch(i))
            losses.append(loss)
        runs.append((loop, losses, generators(), check.checked_steps))
    (plain, plain_losses, plain_rng, _), (loop, losses, rng, checked_steps) = runs
    assert checked_steps == 50
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    assert all(
        torch.equal(a, b)
        for a, b in zip(plain.model.state_dict().values(), loop.model.state_dict().values())
    )
    assert int(loop.model.norm.num_batches_tracked) == 100  # 50 steps x 2 micro-batches
    assert loop.tokens == plain.tokens == 400
    assert same_generators(plain_rng, rng)


def test_restores_generators_buffers_and_scalars_between_executions() -> None:
    """A scalar left out of ``scalars`` is not restored: the replay sees another count and the
    check names it; registered, the step passes."""
    loop = Loop()
    seeded()
    before = generators()
    unregistered = ReplayCheck(
        model=loop.model,
        optimizer=loop.optimizer,
        train_step=lambda b: loop.train_step(b) + 0 * loop.tokens,
        state={"tokens": _TokenState(loop)},
    )
    with pytest.raises(SDCReplayMismatch) as caught:
        unregistered.run_step(batch(0))
    assert caught.value.entry == "state:tokens.count"
    assert caught.value.evidence == "neither"  # 8, 16, 24 tokens: every execution differs
    assert loop.tokens == 24  # never restored: reference, replay and evidence execution counted
    assert same_generators(generators(), before)
    assert int(loop.model.norm.num_batches_tracked) == 0
    assert torch.equal(loop.model.norm.running_mean, torch.zeros(16))
    loop.tokens = 0
    loop.check().run_step(batch(0))
    assert loop.tokens == 8 and int(loop.model.norm.num_batches_tracked) == 1


class _TokenState:
    """The counter as a state object: in the signature, but restoring it is not the check's."""

    def __init__(self, loop: Loop):
        self.loop = loop

    def state_dict(self) -> dict:
        return {"count": self.loop.tokens}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_zeroed_gradients_stay_the_same_tensors() -> None:
    """Gradients entering as zeros are zeroed in place between executions, never copied or
    replaced (CUDA graphs hold their addresses)."""
    loop = Loop(set_to_none=False)
    loop.train_step(batch(0))
    grads = [p.grad for p in loop.model.parameters()]
    assert all(g is not None and not g.any() for g in grads)
    loop.check(num_replays=2).run_step(batch(1))
    assert all(p.grad is g for p, g in zip(loop.model.parameters(), grads))


def test_the_schedule_checks_num_steps_then_again_after_reset() -> None:
    loop = Loop()
    check = loop.check(num_steps=2)
    for i in range(4):
        check.run_step(batch(i))
    assert check.checked_steps == 2 and not check.due
    check.reset_schedule()  # as after a checkpoint load
    assert check.due
    check.run_step(batch(4))
    assert check.checked_steps == 3


def test_a_check_leaves_no_optimizer_hook_behind() -> None:
    hooks = optimizer_module._global_optimizer_pre_hooks
    gc.collect()  # the checks of earlier tests, and their hooks
    before = len(hooks)
    loop = Loop()
    with loop.check() as check:
        check.run_step(batch(0))
        assert len(hooks) == before + 1
    assert len(hooks) == before
    loop.check()  # dropped at once: collected with its hook
    gc.collect()
    assert len(hooks) == before


def test_gradients_carried_into_a_checked_step_are_refused() -> None:
    loop = Loop()
    loop.model.fc1.weight.grad = torch.ones_like(loop.model.fc1.weight)
    with pytest.raises(SdcReplayError, match="gradients accumulated before it"):
        loop.check().run_step(batch(0))
    with pytest.raises(SdcReplayError, match="num_steps=0"):
        loop.check(num_steps=0)
    with pytest.raises(SdcReplayError, match="Workload, or model="):
        ReplayCheck(model=loop.model)


class ScaledLoop:
    """Mixed precision as users write it: float16 autocast, a GradScaler that unscales before
    clipping, skips the steps whose gradients overflow and grows its scale every 2 steps."""

    def __init__(self, init_scale: float = 2.0**20):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential()
        self.model.add_module("fc1", torch.nn.Linear(8, 16, bias=False))
        self.model.add_module("act", torch.nn.GELU())
        self.model.add_module("fc2", torch.nn.Linear(16, 4, bias=False))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        # 2**20 overflows float16 gradients: the first steps are skipped and the scale backs off
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)

    def train_step(self, batch) -> torch.Tensor:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(self.model(x).float(), y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        return loss.detach()

    def check(self, state: dict | None = None, **options) -> ReplayCheck:
        return ReplayCheck(
            model=self.model,
            optimizer=self.optimizer,
            train_step=self.train_step,
            state={"scaler": self.scaler} if state is None else state,
            **options,
        )


def test_a_gradscaler_step_is_checked_and_the_run_equals_one_without_the_check() -> None:
    """The stopped executions unscaled the gradients; the replay may unscale them again, and
    the scaler's scale (backed off, then grown) is the loop's own."""
    runs = []
    for checked in (False, True):
        loop = ScaledLoop()
        check = loop.check(num_steps=-1, num_replays=2)
        scales, losses = [], []
        for i in range(12):
            losses.append(check.run_step(batch(i)) if checked else loop.train_step(batch(i)))
            scales.append(loop.scaler.get_scale())
        runs.append((loop, losses, scales))
    (plain, plain_losses, plain_scales), (loop, losses, scales) = runs
    assert scales == plain_scales
    assert scales[0] < 2.0**20 and max(scales[5:]) > min(scales[:5])  # backed off, then grew
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    assert all(
        torch.equal(a, b)
        for a, b in zip(plain.model.state_dict().values(), loop.model.state_dict().values())
    )
    assert (
        plain.optimizer.state_dict()["state"][0]["step"]
        == loop.optimizer.state_dict()["state"][0]["step"]
    )


def test_a_fault_under_a_gradscaler_is_named_and_the_scaler_left_as_the_step_began() -> None:
    loop = ScaledLoop()
    check = loop.check(num_steps=-1)
    for i in range(6):  # past the overflowing steps
        check.run_step(batch(i))
    scale = loop.scaler.get_scale()
    weight = loop.model.fc1.weight.detach().clone()
    spec = "kind=bitflip,op=aten.mm,module=fc1,phase=backward,nth=1,index=5,bit=12"
    with pytest.raises(SDCReplayMismatch) as caught, injected(loop.model, loop.optimizer, spec, 6):
        check.run_step(batch(6))
    error = caught.value
    assert (error.step, error.replay, error.entry, error.evidence) == (
        6,
        1,
        "grad:fc1.weight",
        "reference",
    )
    # one float16 element of the backward's mm flipped; the float32 gradient it became, unscaled
    assert error.elements == 1 and error.bit_histogram
    assert loop.scaler.get_scale() == scale and torch.equal(loop.model.fc1.weight, weight)
    check.run_step(batch(6))  # the loop goes on: the scaler unscales this step afresh


def test_a_gradscaler_left_out_of_the_state_is_a_clear_error_never_an_accusation() -> None:
    """Not restored, the scaler refuses the replay's unscale_(): said so. Where the step's
    gradients overflowed, each execution halves the scale and scales the loss differently:
    a mismatch whose third execution agrees with neither, which accuses no device."""
    loop = ScaledLoop(init_scale=2.0**8)
    with pytest.raises(SdcReplayError, match="GradScaler refused to unscale") as refused:
        loop.check(state={}).run_step(batch(0))
    assert "state={'scaler': scaler}" in refused.value.hint
    with pytest.raises(SDCReplayMismatch) as caught:
        ScaledLoop().check(state={}).run_step(batch(0))
    error = caught.value
    assert (error.entry, error.evidence, error.elements) == ("loss", "neither", None)
    assert "agreed with neither" in str(error) and "accuses no device" in str(error)
    assert "GradScaler" in error.hint and "out of service" not in error.hint


def small_llama() -> Workload:
    return build_workload("builtin:tiny-llama", dict(SMALL))


# ---------------------------------------------------------------------------
# With a ring Recorder: the failing step as a bundle that replay and bisect start from


WQ = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=2,index=69,bit=22"


def test_replay_check_bundle_is_reproduced_by_replay_and_localized_by_bisect(tmp_path, cli):
    """The fault fires in the reference execution only (nth=0) on 'device' cpu:1: the
    evidence execution the bundle holds is clean, and the same spec on cpu:1 reproduces the
    divergence from it."""
    spec = WQ + ",nth=0,device=cpu:1"
    workload = small_llama()
    recorder = ring_recorder(workload, tmp_path / "alarm.bundle", device_label="cpu:1")
    check = ReplayCheck(workload, num_steps=-1, recorder=recorder)
    with pytest.raises(SDCReplayMismatch) as caught:
        for i in range(4):
            with injected(workload.model, workload.optimizer, spec, i, label="cpu:1"):
                check.run_step(workload.get_batch(i))
    error = caught.value
    assert (error.step, error.entry, error.replay, error.elements) == (2, "loss", 1, None)
    bundle = Path(error.bundle)
    assert bundle == tmp_path / "alarm.bundle" and str(bundle) in str(error)
    about = json.loads(cli("info", bundle, "--json").stdout)
    assert about["trigger"]["source"] == "ReplayCheck" and about["trigger"]["step"] == 2

    replayed = cli(
        "replay", bundle, "--device", "cpu:0", "--device", "cpu:1", "--inject", spec, "--json"
    )
    assert replayed.exit_code == 1, replayed.output
    devices = {d["device"]: d for d in json.loads(replayed.stdout)["devices"]}
    assert devices["cpu:0"]["verdict"] == "match"
    assert devices["cpu:1"]["first_divergence"]["step"] == 2
    assert devices["cpu:1"]["first_divergence"]["name"] == "forward:layers.0.attn.wq"

    bisected = cli(
        "bisect",
        bundle,
        "--suspect",
        "cpu:1",
        "--reference",
        "cpu:0",
        "--step",
        "2",
        "--inject",
        spec,
        "--out",
        tmp_path / "report",
        "--json",
    )
    assert bisected.exit_code == 1, bisected.output
    report = json.loads(bisected.stdout)
    assert (report["step"], report["phase"], report["module"], report["op"]) == (
        2,
        "forward",
        "layers.0.attn.wq",
        "aten.mm.default",
    )
    assert report["elements"]["indices"] == [69] and report["bits"]["histogram"] == {"22": 1}


# ---------------------------------------------------------------------------
# Two ranks, launched as torchrun launches them

RANKS_SCRIPT = """
import json, os, sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdcreplay.capture.operators import OperatorMode
from sdcreplay.capture.faults import Injector, parse_specs
from sdcreplay.online.replay_check import ReplayCheck
from sdcreplay.online.stopping import SDCReplayMismatch
from sdcreplay.online.update_detector import UpdateDetector

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential()
model.add_module("fc1", torch.nn.Linear(8, 16, bias=False))
model.add_module("act", torch.nn.Tanh())
model.add_module("fc2", torch.nn.Linear(16, 4, bias=False))
ddp = DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

def train_step(batch):
    x, y = batch
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss

def run(detector, spec, steps):
    specs = [spec] if rank == 1 else []  # rank 1 is the defective one
    result = {"rank": rank, "steps": 0}
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * rank + step)
        batch = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        injector = Injector(parse_specs(specs, include_env=False), "cpu")
        try:
            with OperatorMode(model, optimizer, [injector], step):
                detector.run_step(batch)
            result["steps"] += 1
        except SDCReplayMismatch as error:
            result.update(step=error.step, replay=error.replay, failing_rank=error.rank,
                          ranks=error.ranks, message=error.message,
                          entry=error.entry, elements=error.elements,
                          histogram=error.bit_histogram, fired=len(injector.fired))
            break
    detector.close()
    return result

replay = run(ReplayCheck(model=ddp, optimizer=optimizer, train_step=train_step, num_steps=-1),
             sys.argv[2], 4)
detector = UpdateDetector(model=ddp, optimizer=optimizer, train_step=train_step, warmup=3,
                          spike_steps=3, sigmas=6.0)
update = run(detector, sys.argv[3], 10)
update["alarms"] = [[a.step, a.reasons, a.classification] for a in detector.alarms]
update["weights"] = [p.sum().item() for p in model.parameters()]
spread = run(ReplayCheck(model=ddp, optimizer=optimizer, train_step=train_step, num_steps=-1),
             sys.argv[4], 4)
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as out:
    json.dump({"replay": replay, "update": update, "spread": spread}, out)
dist.destroy_process_group()
# torch's teardown at exit after gloo and optimizer steps sometimes aborts (replay_check_ranks)
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


# Rank 1's replay of step 2 computes fc1 wrongly; later its step 6 gradient once; then its
# replay of step 1's fc1 weight gradient, which DDP's all-reduce hands to rank 0 too.
RANK_FAULTS = (
    "kind=bitflip,op=aten.mm,module=fc1,phase=forward,step=2,nth=1,index=5,bit=22",
    "kind=bias,op=aten.mm,module=fc1,phase=backward,step=6,nth=0,index=5,scale=1e4",
    "kind=bitflip,op=aten.mm,module=fc1,phase=backward,step=1,nth=1,index=5,bit=22",
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """The script above on 2 gloo ranks, launched as torchrun launches them: ReplayCheck for
    4 steps, then UpdateDetector for 10 more."""
    out = tmp_path_factory.mktemp("ranks")
    script = out / "train.py"
    script.write_text(RANKS_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(script), str(out), *RANK_FAULTS]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_two_gloo_ranks_agree_on_the_mismatching_rank(two_ranks: list[dict]) -> None:
    """DDP all-reduces the gradients, so every rank's gradients differ after rank 1's fault;
    its loss (before the all-reduce) differs on rank 1 only, first in the step: every rank
    names rank 1."""
    results = [ranks["replay"] for ranks in two_ranks]
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["steps"] == 2
        assert (result["step"], result["replay"], result["failing_rank"]) == (2, 1, 1)
        assert result["entry"] == "loss"
    assert results[1]["fired"] == 1 and results[0]["fired"] == 0
    assert results[0]["elements"] == results[1]["elements"] == 1  # rank 1's loss, shared


def test_a_gradient_spread_by_the_all_reduce_is_named_by_its_collective_input(
    two_ranks: list[dict],
) -> None:
    """Rank 1's backward fault reaches both ranks' gradients through DDP's all-reduce: every
    checked entry differs on both ranks at once, but the bucket's input (logged by the
    message log in each execution) differs on rank 1 only, so every rank names rank 1, never
    the lowest rank's healthy device."""
    results = [ranks["spread"] for ranks in two_ranks]
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["steps"] == 1
        assert (result["step"], result["replay"], result["failing_rank"]) == (1, 1, 1)
        assert result["ranks"] == [1] and result["entry"] == "grad:fc1.weight"
    assert results[1]["fired"] == 1 and results[0]["fired"] == 0


def test_two_gloo_ranks_roll_back_and_recompute_together(two_ranks: list[dict]) -> None:
    """Rank 1's gradient fault reaches rank 0 through DDP's all-reduce; both roll back and
    recompute (the same collectives on both), both classify it transient, and the run goes on
    with the ranks' weights still equal."""
    results = [ranks["update"] for ranks in two_ranks]
    for result in results:
        assert result["steps"] == 10
        assert [(step, kind) for step, _, kind in result["alarms"]] == [(6, "transient")]
        assert "grad_spike" in result["alarms"][0][1]
    assert results[0]["weights"] == results[1]["weights"]


def test_the_loops_in_docs_online_run(tmp_path: Path, monkeypatch) -> None:
    """The two complete loops of docs/online.md, as a user would paste them."""
    text = (REPO / "docs" / "online.md").read_text()
    loops = [block for block in text.split("```python\n")[1:] if "for step in range" in block]
    assert len(loops) == 2
    monkeypatch.chdir(tmp_path)
    for block in loops:
        exec(compile(block.split("```")[0], "docs/online.md", "exec"), {"__name__": "docs"})
    assert not (tmp_path / "alarm.bundle").exists()  # clean: the ring never had to dump
