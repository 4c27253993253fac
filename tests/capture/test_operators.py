"""Operator-level capture: what an OperatorMode names as the step's calls, and what it leaves
to the capture itself."""

from __future__ import annotations

import torch

from sdcreplay.capture.operators import OperatorLog, OperatorMode, _own_work


def test_the_captures_own_work_stays_its_own_until_the_outermost_mark_ends():
    """A digest inside a copy inside a callback: each marks its work, and the inner mark ending
    does not hand the rest of the outer one to the step."""
    oplog = OperatorLog()
    tensor = torch.arange(4.0)
    with OperatorMode(torch.nn.Linear(2, 2), None, [oplog], step=0):
        with _own_work():
            with _own_work():
                tensor.clone()
            tensor.sum()  # still the capture's
        tensor.mul(2)  # the step's
    assert [(r.site.op, r.site.index) for r in oplog.records] == [("aten.mul.Tensor", 0)]
