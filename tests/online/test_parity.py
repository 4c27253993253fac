"""TorchTitan's SDC replay scenarios, written against ReplayCheck: the same faults for both.

TorchTitan's replayer (its docs/silent_data_corruption.md and the unit tests of its SDC
replayer) re-executes a step's forward/backward on the same device and compares a
signature of the loss, local gradients, buffers, Python and torch RNG and the token
counter. Each scenario here plants the fault TorchTitan's tests plant (or one its XOR
``torch.hash_tensor`` cannot see) in one execution of a real step, and asserts the exact
entry ReplayCheck names. The loop's own code plants it: the step counts its executions,
and the second one (the first replay) is the faulty one.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TESTS

from sdcreplay.errors import SdcReplayError
from sdcreplay.online import AttributeScalar, ReplayCheck, SDCReplayMismatch

Fault = Callable[["Unit"], None]


class Unit(torch.nn.Module):
    """TorchTitan's test module, a little wider: a weight, a counter buffer the step adds to,
    an optional buffer that is None, and a complex buffer (rotary frequencies)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("counter", torch.zeros(1), persistent=False)
        self.register_buffer("optional", None, persistent=False)
        self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)))
        self.register_buffer("empty", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight * self.freqs.real).square().sum()


class Trainer:
    """The loop: one step is forward, backward, ``optimizer.step()``, ``zero_grad``; it counts
    tokens (``ntokens_seen``, a scalar of the check) and calls ``fault`` at its place in the
    execution whose number is ``faulty`` (1: the reference, 2: the first replay); ``fills``:
    every execution fills in the buffer that is None (a lazily built cache)."""

    def __init__(self, place: str = "after_backward", faulty: int = 2, fills: bool = False):
        self.fills = fills
        self.model = Unit()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.ntokens_seen = 0
        self.executions = 0
        self.place, self.faulty = place, faulty
        self.fault: Fault | None = None

    def at(self, place: str) -> None:
        if self.fault is not None and place == self.place and self.executions == self.faulty:
            self.fault(self.model)

    def train_step(self, x: torch.Tensor) -> torch.Tensor:
        self.executions += 1
        if self.fills:
            self.model.optional = torch.ones(1)
        self.at("before_forward")
        loss = self.model(x)
        self.at("before_backward")
        loss.backward()
        self.at("after_backward")
        with torch.no_grad():
            self.model.counter.add_(1)
        self.ntokens_seen += x.shape[0]
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def check(self, **options) -> ReplayCheck:
        return ReplayCheck(
            model=self.model,
            optimizer=self.optimizer,
            train_step=self.train_step,
            scalars={"ntokens_seen": AttributeScalar(self, "ntokens_seen")},
            **options,
        )


BATCH = torch.arange(8.0).reshape(2, 4) / 8


def mismatch_of(fault: Fault, place: str = "after_backward", **options) -> SDCReplayMismatch:
    trainer = Trainer(place)
    trainer.fault = fault
    with pytest.raises(SDCReplayMismatch) as caught:
        trainer.check(**options).run_step(BATCH)
    return caught.value


def test_only_the_last_execution_is_kept() -> None:
    """``num_replays=2``: three executions; the counter buffer, the token count, the weights
    and the generators are as after one step of the loop alone."""
    alone, checked = Trainer(), Trainer()
    torch.manual_seed(3)
    alone.train_step(BATCH)
    after_alone = torch.get_rng_state()
    torch.manual_seed(3)
    checked.check(num_replays=2).run_step(BATCH)
    assert checked.executions == 3
    assert torch.equal(checked.model.counter, torch.ones(1)) and checked.ntokens_seen == 2
    assert torch.equal(checked.model.weight, alone.model.weight)
    assert torch.equal(torch.get_rng_state(), after_alone)


def test_a_compiled_forward_takes_part_in_the_replay() -> None:
    trainer = Trainer()
    compiled = torch.compile(trainer.model, backend="eager")  # the loop calls this one

    def train_step(x):
        trainer.executions += 1
        compiled(x).backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    ReplayCheck(model=trainer.model, optimizer=trainer.optimizer, train_step=train_step).run_step(
        BATCH
    )
    assert trainer.executions == 2


def test_scratch_state_the_step_overwrites_before_reading_needs_no_restoring() -> None:
    trainer = Trainer()
    trainer.fault = lambda model: setattr(model, "scratch", torch.full((3,), 7.0))
    trainer.check().run_step(BATCH)  # an attribute, not a buffer: never compared or restored
    assert trainer.executions == 2 and torch.equal(trainer.model.scratch, torch.full((3,), 7.0))


def test_a_gradient_changed_after_backward_is_named_at_the_optimizer_step() -> None:
    """TorchTitan's ``grad.add_(1)`` in the second execution, after backward returned: every
    ``grad:`` entry matches; the gradient the optimizer is given differs in all 16 elements."""
    error = mismatch_of(lambda model: model.weight.grad.add_(1))
    assert (error.entry, error.micro_batch, error.elements) == ("step_grad:weight", None, 16)


def _flip(tensor: torch.Tensor, index: int, bit: int) -> None:
    tensor.view(-1).view(torch.int32)[index] ^= 1 << bit


@pytest.mark.parametrize("case", range(20))
def test_two_swapped_gradient_elements_are_named(case: int) -> None:
    """A swap leaves the XOR of the elements (TorchTitan's hash) as it was; not the digest."""
    i, j = random.Random(case).sample(range(16), 2)
    seen = {}

    def swap(model) -> None:
        grad = model.weight.grad.view(-1)
        seen["before"] = torch.hash_tensor(grad)
        grad[[i, j]] = grad[[j, i]].clone()
        seen["after"] = torch.hash_tensor(grad)

    error = mismatch_of(swap)
    assert torch.equal(seen["before"], seen["after"])  # blind to it
    assert (error.entry, error.elements) == ("step_grad:weight", 2)


@pytest.mark.parametrize("case", range(20))
def test_the_same_bit_flipped_in_two_gradient_elements_is_named(case: int) -> None:
    draws = random.Random(100 + case)
    (i, j), bit = draws.sample(range(16), 2), draws.randrange(31)
    seen = {}

    def flips(model) -> None:
        grad = model.weight.grad
        seen["before"] = torch.hash_tensor(grad)
        _flip(grad, i, bit)
        _flip(grad, j, bit)
        seen["after"] = torch.hash_tensor(grad)

    error = mismatch_of(flips)
    assert torch.equal(seen["before"], seen["after"])  # XOR: the two flips cancel
    assert (error.entry, error.elements, error.bit_histogram) == ("step_grad:weight", 2, {bit: 2})


DRAWS = {
    "python": (lambda: random.random(), "rng:python"),
    "numpy": (lambda: np.random.rand(), "rng:numpy"),
    "torch": (lambda: torch.rand(1), "rng:cpu"),
}


@pytest.mark.parametrize(
    ("generator", "place"),
    [
        ("python", "before_forward"),
        ("numpy", "before_forward"),
        ("torch", "before_forward"),
        ("torch", "before_backward"),
        ("python", "before_backward"),
        ("torch", "after_backward"),
        ("python", "after_backward"),
        ("numpy", "after_backward"),
    ],
)
def test_an_extra_random_draw_is_named_by_its_generator(generator: str, place: str) -> None:
    """Eight places and generators of one extra draw, in the second execution only; the
    model draws nothing, so its values match and the generator's state differs."""
    draw, entry = DRAWS[generator]
    assert mismatch_of(lambda model: draw(), place).entry == entry


@pytest.mark.parametrize(
    ("fault", "entry"),
    [
        (lambda model: model.counter.add_(1), "buffer:counter"),
        (lambda model: model.freqs.view(torch.int32)[3].bitwise_xor_(1 << 3), "buffer:freqs"),
        (lambda model: setattr(model, "optional", torch.ones(1)), "buffer:optional"),
    ],
    ids=["counter", "complex-imaginary-part", "none-buffer-filled-once"],
)
def test_a_buffer_that_differs_is_named(fault: Fault, entry: str) -> None:
    """A changed counter; one bit of a complex buffer's imaginary part (TorchTitan hashes a
    real view of it; no "discards the imaginary part" warning here); a None buffer that only
    the second execution fills in (it is restored to None before each execution)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mismatch_of(fault).entry == entry


def test_a_token_counter_that_differs_is_named_and_rolled_back() -> None:
    trainer = Trainer()
    trainer.fault = lambda model: setattr(trainer, "ntokens_seen", trainer.ntokens_seen + 1)
    with pytest.raises(SDCReplayMismatch) as caught:
        trainer.check().run_step(BATCH)
    assert caught.value.entry == "scalar:ntokens_seen" and trainer.ntokens_seen == 0


def test_none_buffers_come_back_as_none_and_filled_ones_are_kept() -> None:
    """A step that fills the None buffer in every execution is no mismatch; after a mismatch
    elsewhere it is None again, as every other part of the state is as the step began."""
    trainer = Trainer(fills=True)
    trainer.check().run_step(BATCH)
    assert torch.equal(trainer.model.optional, torch.ones(1))  # the kept execution's
    trainer = Trainer(fills=True)
    trainer.fault = lambda model: model.weight.grad.mul_(2)
    with pytest.raises(SDCReplayMismatch) as caught:
        trainer.check().run_step(BATCH)
    assert caught.value.entry == "step_grad:weight"
    assert trainer.model.optional is None and torch.equal(trainer.model.counter, torch.zeros(1))


def test_an_empty_buffer_is_digested_and_a_fault_beside_it_still_named() -> None:
    assert Unit().empty.numel() == 0
    error = mismatch_of(lambda model: _flip(model.weight.grad, 5, 30))
    assert (error.entry, error.elements, error.bit_histogram) == ("step_grad:weight", 1, {30: 1})


@pytest.mark.parametrize(
    ("num_steps", "steps_done", "due"),
    [(1, 0, True), (1, 1, False), (3, 2, True), (3, 3, False), (-1, 100, True)],
)
def test_the_schedule_counts_steps_since_the_start_or_a_checkpoint_load(
    num_steps: int, steps_done: int, due: bool
) -> None:
    trainer = Trainer()
    check = trainer.check(num_steps=num_steps)
    for _ in range(steps_done):
        check.run_step(BATCH)
    assert check.due is due
    check.reset_schedule()  # as after loading a checkpoint: checks again
    assert check.due


def test_a_mismatching_step_is_retried_checked_and_applies_no_update() -> None:
    """TorchTitan keeps its attempt step at 0 after a mismatch: the retry is checked again,
    and no optimizer step was applied."""
    trainer = Trainer()
    trainer.fault = lambda model: model.weight.grad.add_(1)
    weight = trainer.model.weight.detach().clone()
    check = trainer.check(num_steps=1)
    with pytest.raises(SDCReplayMismatch):
        check.run_step(BATCH)
    assert torch.equal(trainer.model.weight, weight) and check.due
    trainer.faulty = trainer.executions + 2  # the retry's replay is faulty too
    with pytest.raises(SDCReplayMismatch) as caught:
        check.run_step(BATCH)
    assert (caught.value.entry, caught.value.step, caught.value.local_step) == (
        "step_grad:weight",
        0,
        1,
    )


@pytest.mark.parametrize("option", ["num_steps", "num_replays"])
def test_configuration_errors_are_value_errors(option: str) -> None:
    with pytest.raises(ValueError, match=option) as caught:
        Trainer().check(**{option: 0})
    assert isinstance(caught.value, SdcReplayError)


# ---------------------------------------------------------------------------
# Two gloo ranks, one faulty: tests/replay_check_ranks.py as torchrun starts it


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(TESTS / "replay_check_ranks.py"), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_rank_that_matches_locally_stops_with_the_faulty_one(ranks: list[dict]) -> None:
    """Rank 1's replay computed fc2 wrongly; rank 0's executions matched, and it raises too,
    naming rank 1, after the same three executions (reference, replay, evidence)."""
    for result in ranks:
        seen = result["replicated"]
        assert (seen["rank"], seen["ranks"], seen["entry"]) == (1, [1], "loss")
        assert seen["executions"] == 3 and seen["elements"] == 1


@pytest.mark.parametrize(
    ("name", "entry", "bit"),
    [("dtensor-buffer", "buffer:seen", 5), ("dtensor-grad", "step_grad:fc1.weight", 9)],
)
def test_a_dtensor_that_differs_is_a_mismatch_on_the_local_shard(
    ranks: list[dict], name: str, entry: str, bit: int
) -> None:
    """Rank 1's shard of a DTensor buffer, or of a gradient, differs in its replay: every
    rank raises SDCReplayMismatch (never a sharding-propagation RuntimeError), naming rank 1
    and the one flipped bit of its local shard."""
    for result in ranks:
        seen = result[name]
        assert (seen["rank"], seen["entry"], seen["elements"], seen["bits"]) == (
            1,
            entry,
            1,
            {str(bit): 1},
        )
        assert seen["shard_of"] == 1 and "of rank 1's local shard (a DTensor)" in seen["message"]


def test_forensics_compare_dtensors_on_the_local_shard(ranks: list[dict]) -> None:
    """Each rank's 4-element shard: rank 1's element 2 differs in bit 4, rank 0's not at all."""
    found = [result["forensics"] for result in ranks]
    assert [(f["count"], f["total"], f["indices"], f["local_shard"]) for f in found] == [
        (0, 4, [], True),
        (1, 4, [2], True),
    ]
    assert found[1]["bits"] == {"width": 32, "histogram": {"4": 1}}
