"""Minimize: from a bisect report to a measured, standalone kernel reproducer.

The reported operator call is run alone, with its recorded inputs, again and
again: on the suspect device to measure how often it computes wrong (F of N,
with a Wilson 95% interval), and on the reference device to show the inputs
and the expected output are sound. Then its inputs are shrunk by delta
debugging while the failure persists, under SiliFuzz's acceptance rule (the
reference passes all ``good_trials`` runs, the suspect fails within
``bad_trials``), the smallest shape is tried with random data (does the
failure depend on the values?), and a ticket directory is written (ticket.py). An
interruption (^C, SIGTERM) during the shrink writes the ticket of the smallest inputs
accepted so far, marked partial, and then ends the call: nothing measured is lost.

Both devices run in this process, one after the other. A virtual replica
``cpu:1`` is the same CPU as ``cpu:0``: only a fault spec naming it (``--inject``
or ``SDCREPLAY_INJECT``) makes it "defective", as in replay and bisect.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import leftovers
from ..bisect.kernels import kernel_names
from ..bisect.operator_case import OperatorCase, resolve_op
from ..capture.faults import FaultSpec, check_bits_fit, other_machine_kernels, parse_specs
from ..capture.probe import Probe, run_probe
from ..devices import require_available, torch_device
from ..errors import DeterminismError, SdcReplayError, interrupt_signal
from ..ledger.identity import identify
from ..ledger.notes import note_result
from ..replay.comparability import refuse_unlike_reference
from ..replay.replicas import probe_differences
from ..storage.tensorio import dtype_name, map_tensors
from . import ticket
from .data_dependence import depends_on_data, failing_element_coordinates
from .kernel_case import KernelMinimizeResult, is_kernel_report, minimize_kernel
from .report import (
    deterministic_switches,
    job_of,
    load_report,
    read_report,
    recorded_part,
    report_bundle,
    report_rank,
)
from .shrink import shrink_inputs
from .statistics import default_bad_trials
from .trials import Acceptance, Measurement, TrialRunner

SCHEMA = "sdcreplay.minimize/1"
DEFAULT_TRIALS = 1000
DEFAULT_GOOD_TRIALS = 10
Progress = Callable[[str, int, "int | None", int], None]
"""``on_progress(stage, done, total, failures)``; stages: suspect, reference,
shrink (done = candidates tested, failures = candidates kept; no total: the number of candidates
is not known in advance), random data (failures = draws that still fail), minimal."""


def shapes_of(tree: Any) -> list[list[int]]:
    """Shapes of the tensors in a call's inputs, in argument order."""
    shapes: list[list[int]] = []
    map_tensors(tree, lambda t: shapes.append(list(t.shape)))
    return shapes


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
    moved_aside: str | None = None  # where the ticket that was at ``ticket`` went (overwrite)
    reference_ci95: list[float] | None = None  # Wilson 95% interval of the reference's rate
    identities: dict | None = None  # device, reference: ledger.identity's DeviceIdentity
    incident: str | None = None  # the bundle's identity, from the bisect report
    injected_faults: list[str] | None = None  # injected here or when bisect found the call
    recorded_faults: list[str] | None = None  # the bundle's recording device's (a drill)
    interrupted: str | None = None  # the signal that ended the shrink: a partial ticket
    job: dict | None = None  # a job's call: the job, rank, coordinates, collectives around it

    @property
    def exit_code(self) -> int:
        return 1 if self.reproduced else 0

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **vars(self)}


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
    ledger: bool = True,
    overwrite: bool = False,
) -> MinimizeResult | KernelMinimizeResult:
    """Measure, shrink and write the ticket (see the module docstring); the ticket path is in the
    result. ``ledger``: append the measurement to the device ledger (docs/fleet.md);
    ``overwrite``: replace a ticket already at ``out``, moving it aside. A report that names a
    compiled kernel is measured by `kernel_case.minimize_kernel`."""
    report_dir = Path(report_dir)
    if is_kernel_report(read_report(report_dir)):
        return _minimize_kernel(
            report_dir, device, reference, trials, inject, out, ledger, overwrite
        )
    report, case = load_report(report_dir)
    target = Path(out) if out else report_dir / "ticket"
    ticket.claim_ticket(target, overwrite)
    suspect_label, reference_label = _labels(report, device, reference)
    if min(trials, good_trials, bad_trials or 1) < 1:
        raise SdcReplayError("--trials, --good-trials and --bad-trials must be at least 1")
    progress = on_progress or (lambda stage, done, total, failures: None)
    specs = parse_specs(inject)
    check_bits_fit(specs, case.site, case.expected)
    warnings = _report_warnings(report, specs)
    switches = deterministic_switches(report, report_dir, warnings)
    refuse_unlike_reference(
        _unlike_recording(report, report_dir, [suspect_label, reference_label], warnings),
        reference_label,
        suspect_label,
    )
    op = resolve_op(case.op)
    rank = report_rank(report)
    suspect = TrialRunner(op, case.site, case.prior, suspect_label, specs, case.rng, rank)
    checker = TrialRunner(op, case.site, case.prior, reference_label, specs, case.rng, rank)
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
            python_hint="Run minimize where the report's reference ran (same device model, "
            "torch version and switches), or pass another reference=.",
        )
    reproduced = measured.failures > 0
    bad_trials = bad_trials or default_bad_trials(measured.rate, trials)
    acceptance = Acceptance(suspect, checker, good_trials, bad_trials)
    args, kwargs, shrink, cut, interruption = shrink_inputs(
        case,
        op,
        acceptance if reproduced else None,
        on_test=lambda tested, kept: progress("shrink", tested, None, kept),
    )
    expected = checker.outputs(args, kwargs)
    minimal, data_dependent = None, None
    if reproduced and interruption is None:  # interrupted: keep what was measured, and stop
        data_dependent = depends_on_data(
            args, kwargs, acceptance, seed, on_draw=partial(progress, "random data")
        )
        minimal = suspect.measure(
            args, kwargs, expected, trials, progress=partial(progress, "minimal")
        )

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
    result.reference_ci95 = list(checked.ci95)
    result.incident = report.get("incident")
    result.injected_faults = result.inject or report.get("inject") or []
    result.recorded_faults = report.get("recorded_faults") or []
    result.identities = {
        "device": identify(suspect_label).to_json(),
        "reference": identify(reference_label).to_json(),
    }
    result.interrupted = None if interruption is None else interrupt_signal(interruption).name
    result.job = job_of(report, report_dir)
    moved = ticket.write_ticket(target, result.to_json(), report, ticket_case, overwrite)
    result.moved_aside = None if moved is None else str(moved)
    if ledger:
        note_result(result.to_json())
    if interruption is not None:
        leftovers.leave(
            target,
            f"a partial ticket (its shrink was interrupted by {result.interrupted} after "
            f"{shrink['tests']} tests: the smallest inputs accepted so far, measured on the "
            "original inputs only)",
            "it reproduces as it is; minimize again with --overwrite (overwrite=True) to finish "
            "the shrink",
            interruption,
        )
        raise interruption
    return result


def _labels(report: dict, device: str | None, reference: str | None) -> tuple[str, str]:
    """The suspect and the reference (the report's unless given), two devices here."""
    suspect_label = require_available(device or report["suspect"])
    reference_label = require_available(reference or report["reference"])
    if suspect_label == reference_label:
        raise SdcReplayError(
            f"--device and --reference are both {suspect_label}",
            "Compare the suspect with a device you trust, e.g. --reference cpu:0.",
            python_hint="Compare the suspect with a device you trust, e.g. reference='cpu:0'.",
        )
    return suspect_label, reference_label


def _minimize_kernel(report_dir, device, reference, trials, inject, out, ledger, overwrite):
    report = read_report(report_dir)
    ticket.claim_ticket(Path(out) if out else report_dir / "ticket", overwrite)
    suspect_label, reference_label = _labels(report, device, reference)
    result = minimize_kernel(
        report_dir, report, device=suspect_label, reference=reference_label, trials=trials,
        inject=inject, out=out, overwrite=overwrite,
    )  # fmt: skip
    if ledger:
        note_result(result.to_json())
    return result


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


def _unlike_recording(
    report: dict, report_dir: Path, labels: list[str], warnings: list[str]
) -> dict[str, list[str]]:
    """How each device here is unlike the recording (its kernel probe, run in this process);
    nothing when the report's bundle is gone or has no probe (a warning says so)."""
    try:
        bundle = recorded_part(report_bundle(report, report_dir) or Path(report["bundle"]), report)
    except SdcReplayError as exc:
        warnings.append(
            f"the report's bundle cannot be read ({exc.message}): "
            "the devices' kernels were not compared"
        )
        return {}
    recorded = bundle.probe()
    if recorded is None:
        return {}
    probe = Probe.from_json(recorded)
    unlike = {}
    for label in labels:
        with other_machine_kernels(label):
            outcome = run_probe(probe, torch_device(label))
        unlike[label] = probe_differences(outcome.to_json(probe))
    return unlike
