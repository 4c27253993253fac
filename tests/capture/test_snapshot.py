"""TrainingSnapshot: a rolled-back step recomputes bit for bit, in the same objects."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sdcreplay.capture.snapshot import TrainingSnapshot
from sdcreplay.errors import SdcReplayError


class Counter:
    """A caller-owned state object, as a loop's token counter."""

    def __init__(self) -> None:
        self.tokens = 0

    def state_dict(self) -> dict:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.tokens = state["tokens"]


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    counter = Counter()
    return model, optimizer, {"scheduler": scheduler, "counter": counter}


def _step(model, optimizer, state) -> tuple[torch.Tensor, float, int]:
    """A step drawing from every generator: random batch (torch), noise (NumPy, Python)."""
    x = torch.randn(4, 6) + float(np.random.rand()) + random.random()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    state["scheduler"].step()
    state["counter"].tokens += x.shape[0]
    return loss.detach(), random.random(), state["counter"].tokens


def _everything(model, optimizer) -> list[torch.Tensor]:
    """Every tensor the step changes, to compare two executions bitwise."""
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def test_restore_makes_the_step_recompute_bitwise_in_the_same_objects() -> None:
    model, optimizer, state = _setup()
    _step(model, optimizer, state)  # optimizer state and gradients exist now
    params_before = list(model.parameters())
    snapshot = TrainingSnapshot.take(model, optimizer, state)
    first = _step(model, optimizer, state)
    after_first = _everything(model, optimizer)
    lr_after = optimizer.param_groups[0]["lr"]
    snapshot.restore()
    assert optimizer.param_groups[0]["lr"] == 5e-3  # the scheduler's lr before the step
    assert state["counter"].tokens == 4
    second = _step(model, optimizer, state)
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
    assert all(torch.equal(a, b) for a, b in zip(after_first, _everything(model, optimizer)))
    assert optimizer.param_groups[0]["lr"] == lr_after == 2.5e-3
    # in place: the same Parameter objects, still the ones the optimizer updates
    assert all(a is b for a, b in zip(params_before, model.parameters()))
    assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], model.parameters()))
    # the snapshot is reusable: a second restore gives the same recomputation again
    snapshot.restore()
    assert _step(model, optimizer, state)[1:] == first[1:]


def test_gradients_come_back_as_they_were_none_or_values() -> None:
    model, optimizer, state = _setup()
    first, last = model[0].weight, model[3].weight
    first.grad = torch.full_like(first, 2.0)
    grad_object = first.grad
    snapshot = TrainingSnapshot.take(model, optimizer, state)
    model(torch.randn(4, 6)).sum().backward()
    snapshot.restore()
    assert first.grad is grad_object and torch.equal(first.grad, torch.full_like(first, 2.0))
    assert last.grad is None
    without = TrainingSnapshot.take(model, optimizer, state, grads=False)
    last.grad = torch.ones_like(last)
    without.restore()
    assert torch.equal(last.grad, torch.ones_like(last))  # grads=False leaves gradients alone


def test_rng_is_optional_and_nbytes_counts_every_held_tensor() -> None:
    model, optimizer, state = _setup()
    _step(model, optimizer, state)
    snapshot = TrainingSnapshot.take(model, optimizer, state, rng=False, device="cpu")
    floats = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # parameters + gradients + AdamW's exp_avg and exp_avg_sq (float32) + its step counters
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    assert snapshot.nbytes == 4 * floats * 4 + buffers + steps
    random.seed(1)
    drawn = random.random()
    random.seed(1)
    snapshot.restore()
    assert random.random() == drawn  # rng=False: the generators are not touched
    with_rng = TrainingSnapshot.take(model, optimizer, state)
    assert with_rng.nbytes == snapshot.nbytes + torch.get_rng_state().numel()


def test_a_changed_model_is_refused_by_name() -> None:
    model, optimizer, state = _setup()
    snapshot = TrainingSnapshot.take(model, optimizer, state)
    model.add_module("extra", torch.nn.Linear(2, 2))
    with pytest.raises(SdcReplayError, match="parameters or buffers changed"):
        snapshot.restore()


def test_a_buffer_that_was_none_is_none_again_and_an_emptied_one_comes_back() -> None:
    """A step that fills in a buffer registered as None (a lazily built cache) is rolled back
    to None, not refused as a changed model; one the step set to None gets its values back.
    A buffer registered after the snapshot is still a changed model."""
    model, optimizer, state = _setup()
    model[1].register_buffer("cache", None)
    running_mean = model[1].running_mean.clone()
    snapshot = TrainingSnapshot.take(model, optimizer, state)
    model[1].cache = torch.ones(3)
    model[1].running_mean = None
    snapshot.restore()
    assert model[1].cache is None and "cache" in model[1]._buffers
    assert torch.equal(model[1].running_mean, running_mean)
    model[1].register_buffer("added", torch.zeros(1))
    with pytest.raises(SdcReplayError, match="parameters or buffers changed"):
        snapshot.restore()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_a_non_blocking_copy_holds_the_state_as_it_was_taken(device: str) -> None:
    """A ring's copy to the host (pinned memory, a side stream on a GPU): the step goes on while
    it is copied, the update waits for it on the device, and what is read is the state as the
    copy was taken, BatchNorm's running statistics (changed by the forward) included."""
    model, optimizer, state = _setup()
    model.to(device)
    _step_on(model, optimizer, device)  # optimizer state exists
    expected = [t.detach().cpu().clone() for t in model.state_dict().values()]
    moments = [s["exp_avg"].cpu().clone() for s in optimizer.state.values()]
    copy = TrainingSnapshot.take(
        model, optimizer, state, grads=False, rng=False, device="cpu", non_blocking=True
    )
    assert (copy.pending is not None) == (device == "cuda")
    loss = model(torch.randn(4, 6, device=device)).square().mean()  # the forward moves BN
    loss.backward()
    copy.before_update()
    optimizer.step()
    copy.ready()
    assert copy.pending is None
    held = copy.params | copy.buffers
    assert all(t.device.type == "cpu" for t in held.values())
    names = list(model.state_dict())
    assert all(torch.equal(held[n], e) for n, e in zip(names, expected) if n in held)
    saved = copy.optimizer_state["state"]
    assert all(torch.equal(saved[i]["exp_avg"], m) for i, m in enumerate(moments))


def _step_on(model, optimizer, device: str) -> None:
    model(torch.randn(4, 6, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
