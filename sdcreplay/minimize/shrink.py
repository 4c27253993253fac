"""Shrinking a failing call's inputs: which dimensions can be cut, and delta debugging over them.

An axis is one dimension of the problem, cut in every input that has it; the
cut inputs keep the originals' layout so the kernel path does not change. The
shrink keeps the smallest candidate the acceptance rule still accepts, so an
interrupted shrink has a result too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from ..bisect.operator_case import OperatorCase
from ..errors import SdcReplayError
from ..kinds import ShrinkStatus
from .ddmin import ddmin
from .trials import Acceptance

# What can be cut: the dimensions of an operator call's inputs.


@dataclass(frozen=True)
class Axis:
    """One dimension of the problem, cut in every input that has it (argument position, dim)."""

    name: str
    size: int
    members: tuple[tuple[int, int], ...]
    output_dim: int | None = None  # the output dimension it cuts (None: a matrix product's inner)


# packet -> (left operand, right operand, bias or None, right operand stored as [N, K])
_MATRIX_PRODUCTS = {
    "aten.mm": (0, 1, None, False),
    "aten.addmm": (1, 2, 0, False),
    "aten.bmm": (0, 1, None, False),
    "aten.baddbmm": (1, 2, 0, False),
    "aten.matmul": (0, 1, None, False),
    "aten.linear": (0, 1, 2, True),
}
# packet -> argument holding the normalized (trailing) shape, or the reduced dim
_NORMALIZED_SHAPE = {
    "aten.native_layer_norm": 1,
    "aten.layer_norm": 1,
    "aten.rms_norm": 1,
    "aten._fused_rms_norm": 1,
}
_REDUCED_DIM = {"aten._softmax": 1, "aten._log_softmax": 1, "aten._safe_softmax": 1}


def shrink_axes(
    op_name: str, op, args: Sequence, expected: Sequence
) -> tuple[list[Axis], str | None]:
    """The axes delta debugging may cut for this call, or why there are none."""
    packet = op_name.rsplit(".", 1)[0]
    if packet in _MATRIX_PRODUCTS:
        return _matrix_axes(args, *_MATRIX_PRODUCTS[packet])
    out = next((t for t in expected if isinstance(t, torch.Tensor)), None)
    if out is None or out.dim() == 0:
        return [], "the operator has no tensor output with dimensions to cut"
    if packet in _NORMALIZED_SHAPE:
        leading = out.dim() - len(args[_NORMALIZED_SHAPE[packet]])
    elif packet in _REDUCED_DIM:
        leading = args[_REDUCED_DIM[packet]] % out.dim()
    elif torch.Tag.pointwise in op.tags:
        leading = out.dim()
    else:
        return (
            [],
            f"shrinking does not apply to {op_name} "
            "(only matrix products, element-wise and normalization operators)",
        )
    axes = [axis for dim in range(leading) if (axis := _aligned_axis(f"dim {dim}", args, out, dim))]
    return axes, None if axes else "every input dimension has size 1"


def _aligned_axis(name: str, args: Sequence, out: torch.Tensor, dim: int) -> Axis | None:
    """Output dimension ``dim`` and the input dimensions that broadcast to it (right-aligned)."""
    size = out.shape[dim]
    members = tuple(
        (position, dim - (out.dim() - arg.dim()))
        for position, arg in enumerate(args)
        if isinstance(arg, torch.Tensor)
        and dim - (out.dim() - arg.dim()) >= 0
        and arg.shape[dim - (out.dim() - arg.dim())] == size
    )
    return Axis(name, size, members, dim) if size > 1 and members else None


def _matrix_axes(
    args: Sequence, left: int, right: int, bias: int | None, right_is_nk: bool
) -> tuple[list[Axis], str | None]:
    """Batch, rows of the left operand, columns of the right, then the inner dimension."""
    a, b = args[left], args[right]
    c = (
        args[bias]
        if bias is not None and bias < len(args) and isinstance(args[bias], torch.Tensor)
        else None
    )
    if a.dim() < 2 or b.dim() < 2:
        return [], "a matrix-vector product (shrinking needs two matrices)"
    rows, cols = a.shape[-2], (b.shape[0] if right_is_nk else b.shape[-1])
    col_dim, inner_dim = (0, 1) if right_is_nk else (b.dim() - 1, b.dim() - 2)
    out_dims = a.dim()  # [..., M, N]

    def with_bias(members: list, out_dim: int, size: int) -> tuple:
        bias_dim = out_dim - (out_dims - c.dim()) if c is not None else -1
        if c is not None and bias_dim >= 0 and c.shape[bias_dim] == size:
            members.append((bias, bias_dim))
        return tuple(members)

    axes = []
    for dim in range(a.dim() - 2):
        right_dim = dim - (a.dim() - b.dim())
        members = [(left, dim)] + (
            [(right, right_dim)] if right_dim >= 0 and b.shape[right_dim] == a.shape[dim] else []
        )
        axes.append(Axis(f"batch {dim}", a.shape[dim], with_bias(members, dim, a.shape[dim]), dim))
    row_members = with_bias([(left, a.dim() - 2)], out_dims - 2, rows)
    axes.append(Axis("rows", rows, row_members, out_dims - 2))
    axes.append(Axis("cols", cols, with_bias([(right, col_dim)], out_dims - 1, cols), out_dims - 1))
    axes.append(Axis("inner", a.shape[-1], ((left, a.dim() - 1), (right, inner_dim))))
    return [axis for axis in axes if axis.size > 1], None


def dense_like(values: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``values`` in a fresh dense tensor whose dimensions are laid out in ``template``'s order.

    A transposed operand stays transposed when it is cut, so the kernel path
    does not change; repro.py rebuilds exactly these strides.
    """
    strides = template.stride()
    order = sorted(range(template.dim()), key=lambda d: -strides[d])
    dense = torch.empty_permuted(values.shape, order, dtype=values.dtype)
    return dense.copy_(values)


class Shrinker:
    """Delta debugging over each axis in turn until no axis shrinks; tests are cached.

    ``best`` is the smallest candidate accepted so far, so an interrupted
    shrink still has a result.
    """

    def __init__(
        self,
        args: Sequence,
        kwargs: dict,
        axes: list[Axis],
        accepts: Callable[[list, dict], bool] | None,
        on_test: Callable[[int, int], None] | None = None,
    ):
        self.args, self.kwargs, self.axes = list(args), kwargs, axes
        self.accepts, self.on_test = accepts, on_test
        self.best = tuple(tuple(range(axis.size)) for axis in axes)
        self.tests = self.kept = 0
        self._cache: dict[tuple, bool] = {}

    def inputs(self, candidate: tuple) -> tuple[list, dict]:
        """The call's inputs cut to ``candidate`` (kept indices per axis), laid out as the
        originals."""
        cut = list(self.args)
        for axis, kept in zip(self.axes, candidate, strict=True):
            if len(kept) == axis.size:
                continue
            index = torch.tensor(kept, dtype=torch.long)
            for position, dim in axis.members:
                cut[position] = cut[position].index_select(dim, index)
        return [
            dense_like(c, a) if isinstance(c, torch.Tensor) else c
            for c, a in zip(cut, self.args, strict=True)
        ], self.kwargs

    def size(self, candidate: tuple) -> int:
        """Elements in the cut inputs (from the shapes alone: nothing is copied)."""
        shapes = {
            position: list(arg.shape)
            for position, arg in enumerate(self.args)
            if isinstance(arg, torch.Tensor)
        }
        for axis, kept in zip(self.axes, candidate, strict=True):
            for position, dim in axis.members:
                shapes[position][dim] = len(kept)
        return sum(math.prod(shape) for shape in shapes.values())

    def test(self, candidate: tuple) -> bool:
        if candidate not in self._cache:
            if self.accepts is None:
                raise SdcReplayError(
                    "the shrink has no acceptance rule to test a candidate with",
                    "Shrink only a case that reproduced (shrink_inputs with an Acceptance).",
                )
            self.tests += 1
            held = self._cache[candidate] = self.accepts(*self.inputs(candidate))
            if held and self.size(candidate) < self.size(self.best):
                self.best, self.kept = candidate, self.kept + 1
            if self.on_test is not None:
                self.on_test(self.tests, self.kept)
        return self._cache[candidate]

    def _test_axis(self, base: tuple, position: int, subset: tuple) -> bool:
        """Does ``base`` with one axis cut to ``subset`` still meet the rule?"""
        return self.test(base[:position] + (subset,) + base[position + 1 :])

    def run(self) -> tuple:
        stale = set(range(len(self.axes)))  # axes not minimized since another one changed
        while stale:
            for position in range(len(self.axes)):
                if position not in stale:
                    continue
                base = self.best
                kept = ddmin(base[position], partial(self._test_axis, base, position))
                stale.discard(position)
                if len(kept) < len(base[position]):
                    stale = set(range(len(self.axes))) - {position}
        return self.best


Cut = list[tuple[Axis, tuple]]
"""Each shrink axis with the original indices it kept."""


def shrink_inputs(
    case: OperatorCase, op, acceptance: Acceptance | None, on_test: Callable[[int, int], None]
) -> tuple[list, dict, dict, Cut, KeyboardInterrupt | None]:
    """The smallest inputs that still meet the acceptance rule, how the shrink went, the cut,
    and the interruption (^C, SIGTERM) that ended the shrink early, or None.

    Without an acceptance rule (nothing reproduced) the inputs stay whole. The
    inputs are always fresh copies in the originals' layout: what repro.py rebuilds. An
    interrupted shrink returns the smallest candidate accepted so far (status
    ``interrupted``); the caller keeps what it measured, then lets the interruption end it.
    """
    axes, reason = shrink_axes(case.op, op, case.args, case.expected)
    shrinker = Shrinker(
        case.args, case.kwargs, axes, acceptance.holds if acceptance else None, on_test
    )
    status: ShrinkStatus = (
        "not reproduced" if acceptance is None else ("not applicable" if not axes else "shrunk")
    )
    interruption: KeyboardInterrupt | None = None
    if status == "shrunk":
        try:
            shrinker.run()
        except KeyboardInterrupt as exc:  # ^C or SIGTERM: the smallest so far is the result
            status, interruption = "interrupted", exc
        if status == "shrunk" and shrinker.kept == 0:
            status = "already minimal"
    args, kwargs = shrinker.inputs(shrinker.best)
    cut = list(zip(axes, shrinker.best, strict=True))
    return (
        args,
        kwargs,
        {
            "status": status,
            "reason": reason,
            "tests": shrinker.tests,
            "axes": {axis.name: [axis.size, len(kept)] for axis, kept in cut},
            "kept": {axis.name: list(kept) for axis, kept in cut if len(kept) < axis.size},
        },
        cut,
        interruption,
    )
