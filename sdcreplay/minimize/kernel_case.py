"""Minimize a compiled kernel: its failure rate alone, and a ticket with its generated source.

A bisect inside compiled code names an Inductor kernel call (``kernel.h5`` in the report). Its
code is never taken from the report or the bundle: this process compiles the bisected step
itself (from the state the bisect saved entering it) and takes the kernel it generated, after
checking its source is the reported one. That kernel is then run alone with the reference's
recorded inputs, ``trials`` times on the suspect and on the reference, and the ticket carries
the generated source, the inputs and the expected outputs, and ``repro.py``, which compiles
the source with Inductor's own compiler and runs it standalone (a person runs it on purpose).
A generated kernel's shapes are part of its code, so its inputs are not shrunk.

A job's rank (``bisect JOB --rank R``, alone or among its peers) compiles its step only inside
a process group: each device then compiles and measures in a device process of its own that
is rank R of the job without peers (`bisect.alone.run_alone`), from the state the bisect saved
entering the step (``--alone``), else replaying the rank's window alone first. The values a
rank alone computes leave the job's after its first reduction; the code it generates does not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..bisect.alone import run_alone
from ..bisect.kernel_stage import KERNEL_FILE, KernelCase, trial
from ..bisect.report import ENTRY_STATE_FILE, WORK_DIR
from ..bisect.tasks import _enter_step
from ..bundle.job_bundle import JobBundle
from ..capture import comparable
from ..capture.compiled_kernels import KernelCall
from ..capture.digest import tensor_digest
from ..capture.faults import Injector, parse_specs
from ..devices import torch_device
from ..errors import DeterminismError, ReportError, SdcReplayError
from ..replay.alone import check_alone
from ..replay.worker import device_task
from ..storage.rundir import make_run_dir
from .report import job_of, report_bundle, report_rank
from .statistics import wilson_interval
from .ticket import JSON_FILE, MARKDOWN_FILE, job_lines, staged_ticket

SCHEMA = "sdcreplay.minimize/1"
SOURCE_FILES = {"cpp": "kernel.cpp", "triton": "kernel.py"}


def is_kernel_report(report: dict) -> bool:
    return report.get("level") == "kernel" and report.get("verdict") == "divergence"


@dataclass
class KernelMinimizeResult:
    """``sdcreplay.minimize/1`` for a compiled kernel (``level: kernel``)."""

    reproduced: bool
    kernel: dict  # name, kind, graph, fused, source_nodes, index, nth, spec, outputs
    site: dict
    device: str
    reference: str
    trials: int
    failures: int
    rate: float
    ci95: list[float]
    trials_to_first_failure: int | None
    reference_trials: int
    reference_failures: int
    inject: list[str]
    report: str
    ticket: str
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    level: str = "kernel"
    job: dict | None = None  # a job's call: the job, rank, coordinates, collectives around it

    @property
    def exit_code(self) -> int:
        return 1 if self.reproduced else 0

    @property
    def op(self) -> str:
        return self.kernel["name"]

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **vars(self)}


class _KernelHere:
    """Takes the kernel this process generated at the reported call."""

    def __init__(self, case: KernelCase):
        self.case = case
        self.call: KernelCall | None = None

    def on_kernel(self, call: KernelCall) -> None:
        if call.site.index == self.case.site.index and self.call is None:
            self.call = call


def compile_kernel_here(bundle: str, label: str, entry_state: str | None, case: KernelCase):
    """The reported kernel as this process generates it for ``label`` (by compiling the step
    from the state entering it, or after replaying the window without one); refused when its
    code is not the reported code."""
    entry = _enter_step(bundle, label, (), case.site.step, 0, entry_state=entry_state)
    here = _KernelHere(case)
    try:
        entry.session.run_step(entry.target, kernel_observers=[here])
    finally:
        entry.session.close()
    call = here.call
    if (
        call is None
        or call.kernel.name != case.kernel.name
        or call.kernel.source != case.kernel.source
    ):
        found = (
            "no such call"
            if call is None
            else f"{call.kernel.name}, other code"
            if call.kernel.name == case.kernel.name
            else call.kernel.name
        )
        raise SdcReplayError(
            f"{label} does not generate the reported kernel {case.kernel.name} at kernel call "
            f"{case.site.index} of step {case.site.step} ({found})",
            "Minimize where the bisect ran: the same torch, Inductor settings and device model "
            "generate the same code (the compiled region's code digest says so).",
        )
    return call.invoke


def _measure(
    case: KernelCase, invoke, label: str, specs: list, trials: int
) -> tuple[int, int | None]:
    device = torch_device(label)
    expected = [tensor_digest(t) for t in case.expected]
    failures, first = 0, None
    for number in range(trials):
        injector = Injector(specs, label, salt=number)
        if not trial(case, invoke, injector, device, expected):
            failures += 1
            first = number + 1 if first is None else first
    return failures, first


@device_task
def run_kernel_trials_task(
    device: str, bundle: str, entry_state: str | None, case_file: str, trials: int, inject: list
) -> dict:
    """A job's rank without peers: compile the reported kernel here and run it ``trials``
    times (a spec's ``rank=`` fires: this process is that rank)."""
    case = KernelCase.read(Path(case_file))
    invoke = compile_kernel_here(bundle, device, entry_state, case)
    failures, first = _measure(case, invoke, device, parse_specs(inject), trials)
    return {"failures": failures, "first": first}


def _measure_as_rank(
    report: dict, report_dir: Path, label: str, entry_state: str | None, trials: int, inject
) -> tuple[int, int | None]:
    """`run_kernel_trials_task` on ``label`` as the report's rank of its job, without peers."""
    found = report_bundle(report, report_dir)
    if found is None:
        raise ReportError(
            f"the job {report.get('bundle')} is not found: a job's kernel is compiled from it",
            "Minimize where the bundle is (or put the job beside the report).",
        )
    job, rank = JobBundle.open(found), report_rank(report) or 0
    try:
        check_alone(job, rank)
    except SdcReplayError as exc:
        raise SdcReplayError(
            f"{exc.message}, and a job's kernel is compiled here by its rank alone",
            "Only a data-parallel rank's kernel (DDP, FSDP2) is minimized; for this one the "
            "report's kernel.h5 and its fault spec are the evidence (docs/minimize.md).",
        ) from exc
    part = job.rank(rank)
    arguments = {
        "bundle": part.path,
        "entry_state": entry_state and Path(entry_state),
        "case_file": report_dir / KERNEL_FILE,
        "trials": trials,
        "inject": list(inject),
    }
    work = make_run_dir(report_dir / WORK_DIR, "minimize-")
    value = run_alone(
        "minimize", run_kernel_trials_task, label, arguments, job=job, rank=rank, work=work,
        environment=comparable.pinned_environment(part.manifest.fingerprint),
    )  # fmt: skip
    return value["failures"], value["first"]


def minimize_kernel(
    report_dir: Path,
    report: dict,
    *,
    device: str,
    reference: str,
    trials: int,
    inject: Sequence[str],
    out: str | Path | None,
    overwrite: bool = False,
) -> KernelMinimizeResult:
    """Measure the reported kernel alone on ``device`` and ``reference``; write the ticket (one
    already there replaced only with ``overwrite``, moved aside)."""
    case_file, entry_state = report_dir / KERNEL_FILE, report_dir / WORK_DIR / ENTRY_STATE_FILE
    in_job = report_rank(report) is not None  # among its peers, a rank's bisect saves no state
    # A step the saved state did not reproduce was bisected from the window's start: no state.
    saved = not in_job and (report.get("start") or {}).get("from") != "window"
    for needed in (case_file, *([entry_state] if saved else [])):
        if not needed.is_file():
            raise ReportError(f"{report_dir} has no {needed.relative_to(report_dir)}")
    case = KernelCase.read(case_file)
    specs = parse_specs(inject)
    started = time.perf_counter()
    entry = str(entry_state) if entry_state.is_file() else None

    def measure(label: str) -> tuple[int, int | None]:
        if in_job:
            return _measure_as_rank(report, report_dir, label, entry, trials, inject)
        invoke = compile_kernel_here(
            str(report_bundle(report, report_dir) or report["bundle"]), label, entry, case
        )
        return _measure(case, invoke, label, specs, trials)

    failures, first = measure(device)
    checked, _ = measure(reference)
    if checked:
        raise DeterminismError(
            f"the reference {reference} does not reproduce the recorded output of "
            f"{case.kernel.name} ({checked} of {trials} trials differ)",
            "Run minimize where the report's reference ran (same device model, torch and "
            "Inductor settings), or name another --reference.",
        )
    warnings = []
    if report.get("inject") and not specs:
        warnings.append(
            "the report was made with injected faults ("
            + "; ".join(report["inject"])
            + "); pass the same --inject to reproduce them here"
        )
    target = Path(out) if out else report_dir / "ticket"
    result = KernelMinimizeResult(
        reproduced=failures > 0,
        kernel=report["kernel"],
        site=report["site"],
        device=device,
        reference=reference,
        trials=trials,
        failures=failures,
        rate=failures / trials,
        ci95=list(wilson_interval(failures, trials)),
        trials_to_first_failure=first,
        reference_trials=trials,
        reference_failures=checked,
        inject=[str(spec) for spec in specs],
        report=str(report_dir),
        ticket=str(target),
        warnings=warnings,
        job=job_of(report, report_dir),
    )
    result.seconds = round(time.perf_counter() - started, 3)
    write_kernel_ticket(target, result, case, report.get("determinism") or {}, overwrite)
    return result


def write_kernel_ticket(
    target: Path,
    result: KernelMinimizeResult,
    case: KernelCase,
    switches: dict,
    overwrite: bool = False,
) -> Path:
    """The ticket directory: ticket.json, ticket.md, the kernel's source, inputs.h5, repro.py;
    a ticket already there (``overwrite``) moved aside."""
    source = SOURCE_FILES.get(case.kernel.kind)
    staged = staged_ticket(target, case, {**result.to_json(), "switches": switches}, overwrite)
    with staged as (staging, _moved):
        if source:
            (staging / source).write_text(case.kernel.source, encoding="utf-8")
        (staging / JSON_FILE).write_text(json.dumps(result.to_json(), indent=2), encoding="utf-8")
        (staging / MARKDOWN_FILE).write_text(_markdown(result, source), encoding="utf-8")
    return target


def _markdown(result: KernelMinimizeResult, source: str | None) -> str:
    kernel = result.kernel
    low, high = result.ci95
    drill = f"SDCREPLAY_INJECT='{';'.join(result.inject)}' " if result.inject else ""
    return "\n".join(
        [
            f"# Silent data corruption in the Inductor kernel {kernel['name']} on {result.device}",
            "",
            f"- kernel: `{kernel['name']}` ({kernel['kind']}, graph {kernel['graph']}, kernel "
            f"call {kernel['index']} of step {result.site['step']}, {result.site['phase']})",
            f"- fused ATen operators: {', '.join(kernel['fused']) or '-'}",
            f"- outputs: {', '.join(o['dtype'] + str(o['shape']) for o in kernel['outputs'])}",
            f"- failure rate on {result.device}: {result.failures} of {result.trials} "
            f"({result.rate:.2%}, 95% interval {low:.2%}-{high:.2%})",
            f"- reference {result.reference}: {result.reference_failures} of "
            f"{result.reference_trials} wrong",
            f"- generated source: `{source}`" if source else "- an extern (ATen) kernel",
            "",
            "## Reproduce",
            "",
            "```",
            f"{drill}python repro.py --device {result.device} --trials {result.trials}",
            "```",
            "",
            "`repro.py` compiles the kernel's generated source with Inductor's own compiler "
            "(torch and h5py, and g++ or Triton) and runs it on the recorded inputs, comparing "
            "what it writes with the expected outputs bit for bit.",
            *job_lines(result.job),
            "",
        ]
    )
