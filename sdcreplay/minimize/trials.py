"""Minimize: from a bisect report to a measured, standalone kernel reproducer.

The reported operator call is run alone, with its recorded inputs, again and
again: on the suspect device to measure how often it computes wrong (F of N,
with a Wilson 95% interval), and on the reference device to show the inputs
and the expected output are sound. Then its inputs are shrunk by delta
debugging while the failure persists, under SiliFuzz's acceptance rule (the
reference passes all ``good_trials`` runs, the suspect fails within
``bad_trials``), the smallest shape is tried with random data (does the
failure depend on the values?), and a ticket directory is written (ticket.py).

Both devices run in this process, one after the other. A virtual replica
``cpu:1`` is the same CPU as ``cpu:0``: only a fault spec naming it (``--inject``
or ``SDCREPLAY_INJECT``) makes it "defective", as in replay and bisect.
"""

from __future__ import annotations

import itertools
import json
import math
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..bisect.localize import REPORT_FILE, kernel_names
from ..bisect.localize import SCHEMA as BISECT_SCHEMA
from ..bisect.operator_case import (
    OPERATOR_FILE,
    OperatorCase,
    place,
    resolve_op,
    to_cpu,
)
from ..bundle.manifest import Bundle
from ..capture import determinism
from ..capture.determinism import restore_operator_rng
from ..capture.digest import tensor_digest
from ..capture.faults import FaultSpec, Injector, parse_specs
from ..capture.layers import CallSite, operator_results
from ..compare.forensics import element_forensics
from ..devices import torch_device, validate_label
from ..errors import BundleError, DeterminismError, ReportError, SdcReplayError
from ..kinds import ShrinkStatus
from ..storage.tensorio import dtype_name, map_tensors, raw_bits
from . import ticket

SCHEMA = "sdcreplay.minimize/1"
Z95 = 1.959963984540054  # two-sided 95% quantile of the normal distribution
DEFAULT_TRIALS = 1000
DEFAULT_GOOD_TRIALS = 10
MISS_PROBABILITY = (
    0.01  # the default --bad-trials misses a failure at the measured rate this rarely
)
RANDOM_DATA_DRAWS = 3
PROGRESS_SECONDS = 0.2
KEPT_OUTPUT_BYTES = 256 << 20  # outputs a device may hold while its verdicts wait for one sync
Progress = Callable[[str, int, "int | None", int], None]
"""``on_progress(stage, done, total, failures)``; stages: suspect, reference,
shrink (done = candidates tested, failures = candidates kept; no total: the number of candidates
is not known in advance), random data (failures = draws that still fail), minimal."""


def wilson_interval(failures: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a failure rate: sound at 0 of N and N of N, unlike p +- z*se."""
    if trials <= 0:
        return (0.0, 1.0)
    rate = failures / trials
    spread = z * z / trials
    center = (rate + spread / 2) / (1 + spread)
    half = z * math.sqrt(rate * (1 - rate) / trials + spread / (4 * trials)) / (1 + spread)
    low = 0.0 if failures == 0 else max(0.0, center - half)
    high = 1.0 if failures == trials else min(1.0, center + half)
    return (low, high)


def ddmin(units: Sequence, test: Callable[[tuple], bool]) -> tuple:
    """Zeller's delta debugging: a 1-minimal subset of ``units`` for which ``test`` holds.

    ``test(units)`` is known to hold. The result is never empty, and removing
    any one of its units makes ``test`` fail. Pure: caching and keeping the
    best so far (for an interruption) belong to ``test``.
    """
    current = tuple(units)
    granularity = 2
    while len(current) >= 2:
        chunks = _split(current, granularity)
        subset = next((chunk for chunk in chunks if test(chunk)), None)
        if subset is not None:
            current, granularity = subset, 2
            continue
        complements = (
            []
            if granularity == 2
            else (
                tuple(
                    unit for other, chunk in enumerate(chunks) if other != skipped for unit in chunk
                )
                for skipped in range(len(chunks))
            )
        )
        subset = next((complement for complement in complements if test(complement)), None)
        if subset is not None:
            current, granularity = subset, max(granularity - 1, 2)
        elif granularity >= len(current):
            break
        else:
            granularity = min(2 * granularity, len(current))
    return current


def _split(units: tuple, parts: int) -> list[tuple]:
    size, extra = divmod(len(units), parts)
    bounds = list(itertools.accumulate([0] + [size + (i < extra) for i in range(parts)]))
    return [units[start:end] for start, end in itertools.pairwise(bounds)]


def shapes_of(tree: Any) -> list[list[int]]:
    """Shapes of the tensors in a call's inputs, in argument order."""
    shapes: list[list[int]] = []
    map_tensors(tree, lambda t: shapes.append(list(t.shape)))
    return shapes


@dataclass
class Measurement:
    """F failures in N trials of one input set on one device."""

    device: str
    trials: int
    failures: int
    trials_to_first_failure: int | None  # 1-based: the trial that failed first
    first_failure: dict | None  # which output, and element_forensics of it
    failing_outputs: list | None  # the first failing trial's outputs, on the CPU
    seconds: float

    @property
    def rate(self) -> float:
        return self.failures / self.trials if self.trials else 0.0

    @property
    def ci95(self) -> tuple[float, float]:
        return wilson_interval(self.failures, self.trials)

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "trials": self.trials,
            "failures": self.failures,
            "rate": self.rate,
            "ci95": list(self.ci95),
            "trials_to_first_failure": self.trials_to_first_failure,
            "seconds": round(self.seconds, 3),
            "trials_per_second": round(self.trials / self.seconds, 1) if self.seconds else None,
        }


class TrialRunner:
    """Runs one operator call again and again on one device label; counts outputs that differ.

    Inputs are placed on the device once per measurement, used as they are
    when already there (cloned per trial only when the call can write to
    them: in place, ``out=``, or through an output that is a view of one).
    Each output is compared with the expected one where it lies, over the raw
    bits: on a CPU by its xxh3 digest read where it lies (one pass over the
    bytes, several times faster than ``torch.equal``), on an accelerator word
    by word into a flag that stays on the device and is fetched once per block
    of trials, so the loop never waits for the device.
    Only a failing trial's outputs are copied back.
    """

    def __init__(
        self,
        op,
        site: CallSite,
        prior,
        label: str,
        specs: Sequence[FaultSpec],
        rng: dict | None = None,
    ):
        self.op, self.site, self.prior, self.label = op, site, prior, label
        self.rng = rng  # a random operator draws the numbers it drew in the step, every trial
        self.device = torch_device(label)
        self.specs = list(specs)
        # Inputs the call can write (in place, out=, or through an output that views them, which
        # an injected flip writes) are cloned for every trial, so each trial starts from the case.
        self.writes_inputs = op._schema.is_mutable or any(
            value.alias_info is not None for value in op._schema.returns
        )
        self._salts = itertools.count()  # a fresh random stream for each block of trials

    def _injector(self) -> Injector | None:
        injector = Injector(self.specs, self.label, salt=next(self._salts))
        return injector if injector.has_operator_faults else None

    def _call(self, args: list, kwargs: dict, injector: Injector | None) -> list:
        if self.writes_inputs:
            args, kwargs = map_tensors((args, kwargs), torch.clone)
        restore_operator_rng(self.rng, self.device)
        out = self.op(*args, **kwargs)
        if injector is not None:
            injector.on_isolated_call(self.site, self.prior, out)
        return operator_results(self.op, args, out)

    def _placed(self, args: Sequence, kwargs: dict) -> tuple[list, dict]:
        """The inputs on the device; no copy of inputs already there (a trial never writes them)."""
        tree = (list(args), kwargs)
        on_device = []
        map_tensors(tree, lambda t: on_device.append(t.device == self.device))
        return tree if all(on_device) else place(tree, self.device)

    def outputs(self, args: Sequence, kwargs: dict) -> list:
        """One run's outputs, on the CPU: the expected outputs of a candidate on the reference."""
        placed_args, placed_kwargs = self._placed(args, kwargs)
        return to_cpu(self._call(placed_args, placed_kwargs, self._injector()))

    def measure(
        self,
        args: Sequence,
        kwargs: dict,
        expected: Sequence,
        trials: int,
        *,
        stop_at_first_failure: bool = False,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> Measurement:
        placed_args, placed_kwargs = self._placed(args, kwargs)
        wanted = self._expectation(expected)
        injector = self._injector()
        block = 1 if self.device.type == "cpu" else _block_size(expected)
        failures, first_trial, first_outputs = 0, None, None
        started = time.perf_counter()
        reported = started
        done = 0
        while done < trials and not (stop_at_first_failure and failures):
            pending = [
                self._call(placed_args, placed_kwargs, injector)
                for _ in range(min(block, trials - done))
            ]
            for offset, failed in enumerate(self._verdicts(pending, wanted)):
                if failed:
                    failures += 1
                    if first_trial is None:
                        first_trial, first_outputs = done + offset + 1, to_cpu(pending[offset])
            done += len(pending)
            # Free this block's outputs before the next call allocates its own: the allocator
            # then hands that call the same, cache-warm memory, as in a bare loop (two outputs
            # alive at once made glibc give a 256 KiB matmul output back and fault it in again).
            del pending
            if progress is not None and (
                time.perf_counter() - reported >= PROGRESS_SECONDS or done == trials
            ):
                progress(done, trials, failures)
                reported = time.perf_counter()
        seconds = time.perf_counter() - started
        described = (
            describe_failure(list(expected), first_outputs) if first_outputs is not None else None
        )
        return Measurement(
            self.label, done, failures, first_trial, described, first_outputs, seconds
        )

    def _expectation(self, expected: Sequence) -> list:
        """What each trial's outputs are compared with: digests on a CPU, raw words elsewhere."""
        if self.device.type == "cpu":
            return [tensor_digest(value) for value in expected]
        return [
            raw_bits(e) if isinstance(e, torch.Tensor) else e
            for e in place(list(expected), self.device)
        ]

    def _verdicts(self, pending: list, wanted: list) -> list[bool]:
        """Which trials of a block failed; an accelerator's flags come back in one copy (one
        sync)."""
        if self.device.type == "cpu":
            return [[tensor_digest(value) for value in results] != wanted for results in pending]
        return _fetch([_device_flag(results, wanted) for results in pending])


def _device_flag(results: list, wanted: list) -> bool | torch.Tensor:
    """Outputs vs expected words on the device: a 0-dim bool tensor, or a bool when decided on
    the host."""
    if len(results) != len(wanted):
        return True
    flag: bool | torch.Tensor = False
    for result, expected in zip(results, wanted, strict=True):
        if not isinstance(expected, torch.Tensor):
            if result != expected:
                return True
        elif (
            not isinstance(result, torch.Tensor)
            or result.dtype.itemsize != expected.dtype.itemsize
            or result.shape != expected.shape
        ):
            return True
        else:
            differs = torch.ne(raw_bits(result), expected).any()
            flag = differs if flag is False else flag | differs
    return flag


def _block_size(expected: Sequence) -> int:
    """How many trials' outputs a device may hold before their verdicts are fetched."""
    nbytes = sum(t.numel() * t.element_size() for t in expected if isinstance(t, torch.Tensor))
    return max(1, min(1024, KEPT_OUTPUT_BYTES // max(nbytes, 1)))


def _fetch(verdicts: list) -> list[bool]:
    """Resolve a block's verdicts; the device flags come back in one copy (one sync)."""
    flags = [v for v in verdicts if isinstance(v, torch.Tensor)]
    fetched = iter(torch.stack(flags).tolist() if flags else ())
    return [bool(next(fetched)) if isinstance(v, torch.Tensor) else v for v in verdicts]


def describe_failure(expected: Sequence, actual: Sequence) -> dict:
    """The first differing output of a failing trial and its elements and bits."""
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
            forensics = element_forensics(want, got)
            if forensics.get("count") != 0:
                return {"output": index, **forensics}
        elif want != got:
            return {"output": index, "expected": want, "actual": got}
    return {"output": None, "note": f"{len(actual)} outputs instead of {len(expected)}"}


class Acceptance:
    """SiliFuzz's rule for a candidate reproducer.

    The expected output is the reference device's; the candidate is kept only
    if the suspect fails within ``bad_trials`` runs and the reference then
    passes all ``good_trials`` runs (so a shape that the reference itself does
    not compute reproducibly is never kept).
    """

    def __init__(
        self, suspect: TrialRunner, reference: TrialRunner, good_trials: int, bad_trials: int
    ):
        self.suspect, self.reference = suspect, reference
        self.good_trials, self.bad_trials = good_trials, bad_trials

    def holds(self, args: Sequence, kwargs: dict) -> bool:
        expected = self.reference.outputs(args, kwargs)
        failing = self.suspect.measure(
            args, kwargs, expected, self.bad_trials, stop_at_first_failure=True
        )
        return (
            failing.failures > 0
            and self.reference.measure(args, kwargs, expected, self.good_trials).failures == 0
        )


# ---------------------------------------------------------------------------
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


def random_inputs(args: Sequence, kwargs: dict, generator: torch.Generator) -> tuple[list, dict]:
    """The same shapes, dtypes and layouts with random values in each input's range."""

    def draw(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:
            return t.clone()
        if t.dtype == torch.bool:
            values = torch.randint(0, 2, t.shape, generator=generator).bool()
        elif t.is_complex():
            values = torch.randn(t.shape, generator=generator, dtype=t.dtype)
        elif t.is_floating_point():
            finite = t[torch.isfinite(t)].double()
            low, high = (finite.min().item(), finite.max().item()) if finite.numel() else (0.0, 1.0)
            values = (
                torch.rand(t.shape, generator=generator, dtype=torch.float64) * (high - low) + low
            ).to(t.dtype)
        else:
            values = torch.randint(
                int(t.min()), int(t.max()) + 1, t.shape, generator=generator, dtype=t.dtype
            )
        return dense_like(values, t)

    return map_tensors((list(args), kwargs), draw)


# ---------------------------------------------------------------------------
# The report and the whole procedure.


def load_report(report_dir: str | Path) -> tuple[dict, OperatorCase]:
    """``report.json`` and ``operator.h5`` of a bisect report that names an operator call."""
    path = Path(report_dir)
    if not path.is_dir():
        raise ReportError(f"{path} is not a bisect report directory")
    try:
        report = json.loads((path / REPORT_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ReportError(f"{path} has no {REPORT_FILE}") from exc
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path / REPORT_FILE} is not readable JSON: {exc}") from exc
    if not isinstance(report, dict) or report.get("schema") != BISECT_SCHEMA:
        raise ReportError(f"{path / REPORT_FILE} is not a bisect report (schema {BISECT_SCHEMA})")
    if report.get("verdict") != "divergence" or not report.get("op"):
        raise ReportError(
            f"the report in {path} names no operator call (verdict {report.get('verdict')}, "
            f"isolated {report.get('isolated')})",
            "minimize starts from a bisect that named a corrupted operator; "
            "bisect with --suspect first.",
        )
    if not (path / OPERATOR_FILE).is_file():
        raise ReportError(f"{path} has no {OPERATOR_FILE} (the operator's inputs and outputs)")
    try:
        case = OperatorCase.read(path / OPERATOR_FILE)
    except BundleError as exc:
        raise ReportError(f"cannot read {path / OPERATOR_FILE}: {exc.message}") from exc
    return report, case


def deterministic_switches(report: dict, report_dir: Path, warnings: list[str]) -> dict:
    """Put in force the switches the bundle was recorded with (TF32, threads... change the bits)."""
    recorded = Path(report.get("bundle") or "")
    found = next(
        (
            path
            for path in (recorded, report_dir.parent / recorded.name)
            if report.get("bundle") and path.is_dir()
        ),
        None,
    )
    if found is None:
        warnings.append(
            f"bundle {report.get('bundle')} not found: "
            "running with the default deterministic switches"
        )
        return determinism.enable()
    determinism.apply(Bundle.open(found, verify=False).manifest.determinism.to_json())
    return determinism.current_switches()


@dataclass
class MinimizeResult:
    """What ``--json`` prints and the ticket records (``sdcreplay.minimize/1``)."""

    reproduced: bool
    op: str
    site: dict
    device: str  # the suspect the trials ran on
    reference: str
    trials: int
    failures: int
    rate: float
    ci95: list[float]  # Wilson 95% interval of the rate
    trials_to_first_failure: int | None
    trials_per_second: float
    reference_trials: int
    reference_failures: int
    dtypes: list[str]
    input_shapes_original: list[list[int]]
    input_shapes_minimal: list[list[int]]
    shrink: dict  # status (ShrinkStatus), reason, tests, axes, kept
    acceptance: dict[str, int]  # good_trials, bad_trials
    minimal: dict | None  # the measurement on the minimal inputs
    data_dependent: bool | None
    first_mismatch: dict | None
    coordinates: dict | None
    bits: dict | None
    pattern: str | None
    fault_model: dict | None  # forensics.fault_model of a failing trial: original, minimal inputs
    kernels: list[str]
    inject: list[str]
    report: str
    ticket: str
    switches: dict
    warnings: list[str]
    commands: list[str]
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if self.reproduced else 0

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **vars(self)}


def default_bad_trials(rate: float, trials: int) -> int:
    """Trials that see a failure at ``rate`` with probability 1 - MISS_PROBABILITY, at most
    ``trials``."""
    if rate >= 1.0:
        return 1
    if rate <= 0.0:
        return trials
    return max(1, min(trials, math.ceil(math.log(MISS_PROBABILITY) / math.log1p(-rate))))


def minimize(
    report_dir: str | Path,
    *,
    device: str | None = None,
    reference: str | None = None,
    trials: int = DEFAULT_TRIALS,
    good_trials: int = DEFAULT_GOOD_TRIALS,
    bad_trials: int | None = None,
    inject: Sequence[str] = (),
    out: str | Path | None = None,
    seed: int = 0,
    on_progress: Progress | None = None,
) -> MinimizeResult:
    """Measure, shrink and write the ticket (see the module docstring); the ticket path is in the
    result."""
    report_dir = Path(report_dir)
    report, case = load_report(report_dir)
    suspect_label = validate_label(device or report["suspect"])
    reference_label = validate_label(reference or report["reference"])
    if suspect_label == reference_label:
        raise SdcReplayError(
            f"--device and --reference are both {suspect_label}",
            "Compare the suspect with a device you trust, e.g. --reference cpu:0.",
        )
    if min(trials, good_trials, bad_trials or 1) < 1:
        raise SdcReplayError("--trials, --good-trials and --bad-trials must be at least 1")
    progress = on_progress or (lambda stage, done, total, failures: None)
    specs = parse_specs(inject)
    warnings = _report_warnings(report, specs)
    switches = deterministic_switches(report, report_dir, warnings)
    op = resolve_op(case.op)
    suspect = TrialRunner(op, case.site, case.prior, suspect_label, specs, rng=case.rng)
    checker = TrialRunner(op, case.site, case.prior, reference_label, specs, rng=case.rng)
    started = time.perf_counter()

    measured = suspect.measure(
        case.args, case.kwargs, case.expected, trials, progress=partial(progress, "suspect")
    )
    checked = checker.measure(
        case.args, case.kwargs, case.expected, trials, progress=partial(progress, "reference")
    )
    if checked.failures:
        raise DeterminismError(
            f"the reference {reference_label} does not reproduce the recorded output of {case.op} "
            f"({checked.failures} of {checked.trials} trials differ)",
            "Run minimize where the report's reference ran "
            "(same device model, torch version and switches), "
            "or name another --reference.",
        )
    reproduced = measured.failures > 0
    bad_trials = bad_trials or default_bad_trials(measured.rate, trials)
    acceptance = Acceptance(suspect, checker, good_trials, bad_trials)
    args, kwargs, shrink, cut = shrink_inputs(
        case,
        op,
        acceptance if reproduced else None,
        on_test=lambda tested, kept: progress("shrink", tested, None, kept),
    )
    expected = checker.outputs(args, kwargs)
    minimal, data_dependent = None, None
    if reproduced:
        data_dependent = depends_on_data(
            args, kwargs, acceptance, seed, on_draw=partial(progress, "random data")
        )
        minimal = suspect.measure(
            args, kwargs, expected, trials, progress=partial(progress, "minimal")
        )

    target = Path(out) if out else report_dir / "ticket"
    kernels = report.get("kernels") or []
    if suspect.device.type == "cuda":
        kernels = kernel_names(
            op,
            OperatorCase(case.site, case.prior, tuple(args), kwargs, expected, expected),
            suspect.device,
        )
    failure = (minimal.first_failure if minimal else None) or measured.first_failure
    result = MinimizeResult(
        reproduced=reproduced,
        op=case.op,
        site=asdict(case.site),
        device=suspect_label,
        reference=reference_label,
        trials=measured.trials,
        failures=measured.failures,
        rate=measured.rate,
        ci95=list(measured.ci95),
        trials_to_first_failure=measured.trials_to_first_failure,
        trials_per_second=measured.to_json()["trials_per_second"],
        reference_trials=checked.trials,
        reference_failures=checked.failures,
        dtypes=[dtype_name(t.dtype) for t in case.args if isinstance(t, torch.Tensor)],
        input_shapes_original=shapes_of((list(case.args), case.kwargs)),
        input_shapes_minimal=shapes_of((args, kwargs)),
        shrink=shrink,
        acceptance={"good_trials": good_trials, "bad_trials": bad_trials},
        minimal=minimal.to_json() if minimal else None,
        data_dependent=data_dependent,
        first_mismatch=_first_element(failure),
        coordinates=failing_element_coordinates(
            _first_element(failure),
            _first_element(measured.first_failure),
            cut,
            shrunk=minimal is not None,
        ),
        bits=failure.get("bits") if failure else None,
        pattern=failure.get("pattern") if failure else None,
        fault_model=_fault_models(measured.first_failure, minimal),
        kernels=kernels,
        inject=[str(spec) for spec in specs],
        report=str(report_dir),
        ticket=str(target),
        switches=switches,
        warnings=warnings,
        commands=[
            *report.get("commands", []),
            _command_line(
                report_dir, device, reference, trials, good_trials, bad_trials, inject, out
            ),
        ],
    )
    suspect_outputs = (
        minimal.failing_outputs if minimal and minimal.failing_outputs is not None else expected
    )
    ticket_case = OperatorCase(
        case.site, case.prior, tuple(args), kwargs, expected, suspect_outputs, rng=case.rng
    )
    result.seconds = round(time.perf_counter() - started, 3)
    ticket.write_ticket(target, result.to_json(), report, ticket_case)
    return result


Cut = list[tuple[Axis, tuple]]
"""Each shrink axis with the original indices it kept."""


def shrink_inputs(
    case: OperatorCase, op, acceptance: Acceptance | None, on_test: Callable[[int, int], None]
) -> tuple[list, dict, dict, Cut]:
    """The smallest inputs that still meet the acceptance rule, how the shrink went, the cut.

    Without an acceptance rule (nothing reproduced) the inputs stay whole. The
    inputs are always fresh copies in the originals' layout: what repro.py rebuilds.
    """
    axes, reason = shrink_axes(case.op, op, case.args, case.expected)
    shrinker = Shrinker(
        case.args, case.kwargs, axes, acceptance.holds if acceptance else None, on_test
    )
    status: ShrinkStatus = (
        "not reproduced" if acceptance is None else ("not applicable" if not axes else "shrunk")
    )
    if status == "shrunk":
        try:
            shrinker.run()
        except KeyboardInterrupt:
            status = "interrupted"
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
    )


def depends_on_data(
    args: list,
    kwargs: dict,
    acceptance: Acceptance,
    seed: int,
    on_draw: Callable[[int, int, int], None] = lambda done, total, held: None,
) -> bool:
    """True when random data of the same shape, dtype and range never meets the acceptance rule.

    ``on_draw(done, total, held)`` after each draw tested; the first that meets it ends the test.
    """
    generator = torch.Generator().manual_seed(seed)
    draws = [random_inputs(args, kwargs, generator) for _ in range(RANDOM_DATA_DRAWS)]
    on_draw(0, RANDOM_DATA_DRAWS, 0)
    for done, draw in enumerate(draws, 1):
        held = acceptance.holds(*draw)
        on_draw(done, RANDOM_DATA_DRAWS, int(held))
        if held:
            return False
    return True


def _report_warnings(report: dict, specs: list[FaultSpec]) -> list[str]:
    warnings = []
    if report.get("inject") and not specs:
        warnings.append(
            "the report was made with injected faults ("
            + "; ".join(report["inject"])
            + "); pass the same --inject to reproduce them here"
        )
    if report.get("isolated") not in (None, "kernel"):
        warnings.append(
            f"bisect found the operator alone computes right (isolated: {report.get('isolated')}); "
            "it may not reproduce here"
        )
    return warnings


def _fault_models(original: dict | None, minimal: Measurement | None) -> dict | None:
    """The damage a failing trial did, as a fault model, on the original and minimal inputs.

    The original inputs show the defect as training saw it (a whole burst);
    the minimal inputs may keep only part of it (a burst cut to the row the
    shrink kept).
    """
    if not original:
        return None
    shrunk = minimal.first_failure if minimal else None
    return {
        "original": original.get("fault_model"),
        "minimal": shrunk.get("fault_model") if shrunk else None,
    }


def _first_element(failure: dict | None) -> dict | None:
    """The first mismatching element of a failing trial: index, values and XOR mask."""
    if not failure or not failure.get("indices"):
        return failure
    return {
        "output": failure["output"],
        "index": failure["indices"][0],
        "position": failure["positions"][0],
        "expected": failure["expected"][0],
        "actual": failure["actual"][0],
        "xor": failure["xor"][0],
        "count": failure["count"],
        "total": failure["total"],
        "dtype": failure["dtype"],
    }


def failing_element_coordinates(
    minimal: dict | None, original: dict | None, cut: Cut, shrunk: bool
) -> dict | None:
    """The failing element in the minimal inputs' coordinates, in the original's, how they relate.

    ``minimal`` is the first mismatch of a failing trial on the minimal inputs,
    ``original`` of one on the original inputs (what bisect saw). An output
    dimension an axis cut maps back through the indices it kept; one no axis
    cut is the original's. A matrix product's inner dimension is in no output
    position but changes every value that sums over it.
    """
    if not minimal or "position" not in minimal or not shrunk:
        return None
    first = None
    if original and "position" in original:
        first = {key: original[key] for key in ("output", "index", "position")}
    result: dict[str, Any] = {
        "minimal": {key: minimal[key] for key in ("output", "index", "position")},
        "original": None,
        "original_first_mismatch": first,
    }
    by_dim = {axis.output_dim: kept for axis, kept in cut if axis.output_dim is not None}
    position = minimal["position"]
    if len(position) <= max(by_dim, default=-1):
        result["why"] = (
            "the failing output does not have the dimensions the shrink cut, "
            "so its element has no place in the original output"
        )
        return result
    mapped = [by_dim[dim][index] if dim in by_dim else index for dim, index in enumerate(position)]
    result["original"] = {"output": minimal["output"], "position": mapped}
    cuts = [(axis, kept) for axis, kept in cut if len(kept) < axis.size]
    kept = "; ".join(f"{axis.name} {_indices(kept)} of {axis.size}" for axis, kept in cuts)
    said = [
        f"the minimal inputs keep {kept or 'every index'}, so element {position} of the "
        f"minimal output is element {mapped} of the original output"
    ]
    inner = [
        f"{len(kept)} of {axis.size} {axis.name} terms"
        for axis, kept in cuts
        if axis.output_dim is None
    ]
    if inner:
        said.append(f"computed from {', '.join(inner)}, so its value differs from the original's")
    if first is not None:
        same = first["position"] == mapped and first["output"] == minimal["output"]
        said.append(
            "the same element the original inputs fail at first"
            if same
            else f"the original inputs fail first at element {first['position']}: "
            + _why_elsewhere(minimal, first)
        )
    result["why"] = "; ".join(said)
    return result


def _why_elsewhere(minimal: dict, original: dict) -> str:
    """Why a shrunk call fails at another element than the original call did."""
    same_index = minimal["index"] == original["index"] and minimal["output"] == original["output"]
    where = (
        f"both are flat index {minimal['index']} of their output, so the corruption follows "
        "the position in the output's memory, not the data"
        if same_index
        else "the corruption is tied to where an element is computed (a lane, a tile, an address), "
        "and a smaller shape puts other elements there"
    )
    return f"{where}; the minimal inputs still fail, which is what the reproducer needs"


def _indices(kept: tuple) -> str:
    shown = ", ".join(map(str, kept[:8]))
    return f"[{shown}{', ...' if len(kept) > 8 else ''}]"


def _command_line(
    report_dir: Path, device, reference, trials, good_trials, bad_trials, inject, out
) -> str:
    """The ``sdcreplay minimize`` command that does what this call did."""
    words = ["sdcreplay", "minimize", str(report_dir)]
    options = {
        "--device": device,
        "--reference": reference,
        "--trials": trials,
        "--good-trials": good_trials,
        "--bad-trials": bad_trials,
        "--out": out,
    }
    for name, value in options.items():
        if value is not None:
            words += [name, str(value)]
    for spec in inject:
        words += ["--inject", spec]
    return shlex.join(words)
