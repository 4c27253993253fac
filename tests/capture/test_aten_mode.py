"""The tool's dispatch modes let a higher-order operator through: compiled code calls one
under activation checkpointing (TorchTitan's blocks: ``run_and_save_rng_state``), and torch
used to fail the step under any mode without a rule for it."""

from __future__ import annotations

import pytest
import torch
from torch._prims.rng_prims import run_and_save_rng_state

from sdcreplay.capture.faults import _OtherMachineKernels
from sdcreplay.capture.operators import OperatorMode
from sdcreplay.capture.probe import collecting_calls


def _rng_call() -> torch.Tensor:
    torch.manual_seed(3)
    _, out = run_and_save_rng_state(torch.ops.aten.bernoulli.p, torch.ones(8), 0.5)
    return out


@pytest.mark.parametrize("mode", ["probe", "operators", "other_machine"])
def test_a_higher_order_operator_runs_through_each_mode_unchanged(mode):
    expected = _rng_call()
    if mode == "probe":
        context = collecting_calls(torch.device("cpu"))
    elif mode == "operators":
        context = OperatorMode(torch.nn.Linear(2, 2), None, [], step=0)
    else:
        context = _OtherMachineKernels({"aten.mm"})
    with context:
        got = _rng_call()
    assert torch.equal(got, expected)
