"""ReplayCheck sees the whole step up to the optimizer, and a mismatch leaves it as it began.

The loops here are written as users write them (clipping between backward and the
optimizer, a sample counter outside every module, a lazily filled buffer, a complex
buffer); faults are planted by sdcreplay's injector in one execution (``nth`` counts the
matching calls over every execution of the step) or by the loop's own code.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

from sdcreplay.bundle.reader import Bundle
from sdcreplay.capture.faults import Injector, parse_specs
from sdcreplay.capture.operators import OperatorMode
from sdcreplay.errors import SdcReplayError
from sdcreplay.online import ConfigurationError
from sdcreplay.online.replay_check import ReplayCheck
from sdcreplay.online.step import AttributeScalar
from sdcreplay.online.stopping import SDCReplayMismatch
from sdcreplay.recording.recorder import Recorder
from sdcreplay.workload.definition import Workload

PARAMS = ("0.weight", "2.weight")  # in the order the clipping multiplies their gradients


class ClippedLoop:
    """SGD with momentum and gradient clipping by norm (one ``mul_`` per gradient: the kernel
    between backward and the optimizer the faults go into), and a sample counter."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=False)
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.samples_seen = 0

    def train_step(self, batch) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.01, foreach=False)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.samples_seen += x.shape[0]
        return loss

    def check(self, **options) -> ReplayCheck:
        return ReplayCheck(
            model=self.model,
            optimizer=self.optimizer,
            train_step=self.train_step,
            scalars={"samples_seen": AttributeScalar(self, "samples_seen")},
            **options,
        )


def clipped_workload() -> Workload:
    """What a replay rebuilds of ClippedLoop (the ring Recorder's dumps are verified with it)."""
    loop = ClippedLoop()
    return Workload(loop.model, loop.optimizer, batch, train_step=loop.train_step)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)


def planted(loop, spec: str | None, step: int) -> OperatorMode:
    specs = [spec] if spec is not None else []
    injector = Injector(parse_specs(specs, include_env=False), "cpu")
    return OperatorMode(loop.model, loop.optimizer, [injector], step)


def test_twenty_bit_flips_between_backward_and_the_optimizer_are_named_with_their_bit() -> None:
    """Each flip hits one gradient element in the replay's clipping kernel, after its backward
    digested it: ``grad:`` entries all match, ``step_grad:`` (as the optimizer is given it)
    differs, with that one bit; the loop goes on after each and every flip is caught."""
    torch.use_deterministic_algorithms(True)  # put back by conftest's autouse fixture
    loop = ClippedLoop()
    check = loop.check(num_steps=-1)
    draws = random.Random(21)
    caught = []
    for step in range(20):
        which, index, bit = draws.randrange(2), draws.randrange(64), draws.randrange(32)
        # per execution one mul_ per gradient: nth 0-1 the reference's, 2-3 the replay's
        spec = f"kind=bitflip,op=aten.mul_,phase=forward,nth={2 + which},index={index},bit={bit}"
        with pytest.raises(SDCReplayMismatch) as mismatch, planted(loop, spec, step):
            check.run_step(batch(step))
        error = mismatch.value
        caught.append((error.entry, error.micro_batch, error.elements, error.bit_histogram))
        assert caught[-1] == (f"step_grad:{PARAMS[which]}", None, 1, {bit: 1})
        assert (error.step, error.replay, error.evidence) == (step, 1, "reference")
        assert error.accuses_device and f"bit {bit}: 1" in str(error)
        check.run_step(batch(step))  # the clean retry trains on
    assert len(caught) == 20 and check.checked_steps == 40


def test_a_gradient_the_loop_edits_after_backward_in_one_execution_is_a_mismatch() -> None:
    """A manual change between backward and the optimizer (here a flip of bit 3 of element 9
    of the first layer's gradient in the replay only) is checked, as any kernel's would be."""
    loop = ClippedLoop()
    executions = 0

    def edited(batch):
        nonlocal executions
        executions += 1
        x, y = batch
        torch.nn.functional.mse_loss(loop.model(x), y).backward()
        if executions == 2:
            loop.model[0].weight.grad.view(-1).view(torch.int32)[9] ^= 1 << 3
        loop.optimizer.step()
        loop.optimizer.zero_grad()

    check = ReplayCheck(model=loop.model, optimizer=loop.optimizer, train_step=edited)
    with pytest.raises(SDCReplayMismatch) as caught:
        check.run_step(batch(0))
    assert (caught.value.entry, caught.value.elements, caught.value.bit_histogram) == (
        "step_grad:0.weight",
        1,
        {3: 1},
    )


def test_the_retry_of_a_mismatching_step_is_checked_again() -> None:
    """``num_steps=1``: the step that raised does not count, so its retry is the step checked
    (a fault there is caught too), then the schedule moves on."""
    loop = ClippedLoop()
    check = loop.check(num_steps=1, start_step=5)
    fault = "kind=bitflip,op=aten.mul_,phase=forward,nth=3,index=2,bit=12"
    for _attempt in range(2):
        with pytest.raises(SDCReplayMismatch) as caught, planted(loop, fault, 5):
            check.run_step(batch(5))
        assert (caught.value.step, caught.value.local_step) == (5, 1)
        assert (check.next_step, check.local_step, check.due) == (5, 0, True)
    check.run_step(batch(5))  # the retry without the fault is still checked, and passes
    assert (check.checked_steps, check.next_step, check.local_step, check.due) == (3, 6, 1, False)
    check.run_step(batch(6))
    assert check.checked_steps == 3


@pytest.mark.parametrize("ring", [False, True], ids=["alone", "ring-recorder"])
def test_a_registered_scalar_is_as_the_step_began_after_a_mismatch(tmp_path: Path, ring) -> None:
    """24 samples after three steps: still 24 after each of two mismatches at the fourth (the
    reference, replay and evidence executions each counted 8), 32 after its clean retry; the
    same with a ring Recorder, which records and dumps the evidence execution."""
    loop = ClippedLoop()
    recorder = None
    if ring:
        workload = Workload(loop.model, loop.optimizer, batch, train_step=loop.train_step)
        recorder = Recorder(
            tmp_path / "alarm.bundle", f"{__file__}:clipped_workload", loop.model, loop.optimizer,
            ring=4,
        )  # fmt: skip
        check = ReplayCheck(
            workload,
            scalars={"samples_seen": AttributeScalar(loop, "samples_seen")},
            num_steps=-1,
            recorder=recorder,
        )
    else:
        check = loop.check(num_steps=-1)
    for step in range(3):
        check.run_step(batch(step))
    assert loop.samples_seen == 24
    fault = "kind=bitflip,op=aten.mul_,phase=forward,nth=2,index=4,bit=20"
    for _attempt in range(2):
        with pytest.raises(SDCReplayMismatch) as caught, planted(loop, fault, 3):
            check.run_step(batch(3))
        assert caught.value.entry == "step_grad:0.weight" and loop.samples_seen == 24
        assert (caught.value.bundle is not None) is ring
    check.run_step(batch(3))
    assert loop.samples_seen == 32
    if recorder is not None:  # each dump's evidence execution was taken back out of the ring
        assert recorder.ring_steps == [0, 1, 2, 3]
        for dump in recorder.dumps:  # the second mismatch's dump still holds the steps before
            bundle = Bundle.open(dump)
            assert bundle.step_indices == [0, 1, 2, 3]
            assert bundle.verification.status == "passed"


class LazyCache(torch.nn.Module):
    """A buffer registered as None that the first forward fills in (a lazily built table)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("table", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.linspace(0, 1, 4)
        return self.fc(x) * self.table


def test_a_buffer_the_step_fills_in_is_none_again_for_each_execution() -> None:
    """Every execution starts with the buffer None, as the step did, and fills it in the same;
    the kept execution's table stays (TorchTitan restores None buffers to None too)."""
    model = LazyCache()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fills = []

    def train_step(x):
        fills.append(model.table is None)
        loss = model(x).square().sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    ReplayCheck(model=model, optimizer=optimizer, train_step=train_step, num_replays=2).run_step(
        torch.ones(2, 4)
    )
    assert fills == [True, True, True] and torch.equal(model.table, torch.linspace(0, 1, 4))


def test_configuration_errors_are_value_errors_too() -> None:
    loop = ClippedLoop()
    for options, message in (
        ({"num_steps": 0}, "num_steps=0 checks nothing"),
        ({"num_replays": 0}, "num_replays=0 replays nothing"),
    ):
        with pytest.raises(ValueError, match=message) as caught:
            loop.check(**options)
        assert isinstance(caught.value, SdcReplayError) and caught.value.hint
        assert isinstance(caught.value, ConfigurationError)
    with pytest.raises(ValueError, match="needs a Workload, or model="):
        ReplayCheck(model=loop.model)


def test_a_complex_buffer_that_differs_is_named_without_a_casting_warning() -> None:
    """Rotary frequencies as a complex64 buffer, one bit of its element 1's imaginary part
    flipped in the replay: the mismatch names the buffer, element and bit (bit 3 of the
    imaginary part's word: bit 35 of the element's 64), and nothing warns."""

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(4, 4)
            self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)))

        def forward(self, x):
            return self.fc(x) * self.freqs.real

    model = Rotary()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    executions = 0

    def train_step(x):
        nonlocal executions
        executions += 1
        model(x).sum().backward()
        if executions == 2:
            model.freqs.view(torch.int32)[3] ^= 1 << 3  # element 1's imaginary part
        optimizer.step()
        optimizer.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(SDCReplayMismatch) as caught:
            ReplayCheck(model=model, optimizer=optimizer, train_step=train_step).run_step(
                torch.ones(2, 4)
            )
    assert (caught.value.entry, caught.value.elements, caught.value.bit_histogram) == (
        "buffer:freqs",
        1,
        {35: 1},
    )
