"""Bisect inside compiled code: the first Inductor kernel call whose output differs.

A compiled region's fused kernels are not ATen operators: no dispatch mode sees them, and a
mode that is not compile-aware makes Dynamo run the region eager, which is other code. So
for a workload with compiled modules the step is replayed again at the kernel level
(`capture.compiled_kernels`): the reference writes its kernel log, the suspect compares as it
runs and keeps the first call that differs with its inputs, the reference hands over that
call's inputs, and the suspect re-runs that kernel alone from them, in a process that compiled
the same code itself (never code from a bundle or a report). The report names the kernel as
generated, the ATen operators it fused, where it ran, the element and the bits.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py
import torch

from ..capture.compiled_kernels import Kernel, KernelCall, KernelSite, written_tensors
from ..capture.digest import tensor_digest
from ..capture.faults import Injector, parse_specs
from ..capture.kernel_log import KernelLog, placed, records_from_json, records_to_json
from ..devices import torch_device
from ..errors import ReportError, SdcReplayError
from ..replay.worker import device_task
from ..storage import tensorio
from .evidence import first_differing_output, output_findings, trees_equal
from .tasks import UNSTEADY_STEP, MessagesBefore, _enter_step, _refuse_unreproduced

KERNEL_FILE = "kernel.h5"


@dataclass
class KernelCase:
    """One kernel call with its inputs and outputs on two devices: what minimize re-runs."""

    site: KernelSite
    prior: Counter  # (kernel, module, phase) -> calls before this one in the step
    kernel: Kernel
    args: list  # the reference's arguments before the call, on the CPU
    kwargs: dict
    expected: list  # what the call wrote on the reference
    actual: list  # ... and on the suspect
    suspect_args: list | None = None
    suspect_kwargs: dict | None = None

    @property
    def op(self) -> str:
        """What a ticket runs: the kernel, by its generated name."""
        return self.kernel.name

    @property
    def spec(self) -> str:
        """The fault spec that selects this call."""
        site = self.site
        return (
            f"kind=bitflip,kernel={site.kernel},phase={site.phase},step={site.step},nth={site.nth}"
        )

    def write(self, path: Path) -> None:
        with h5py.File(path, "w") as handle:
            handle.attrs["site"] = json.dumps(asdict(self.site))
            handle.attrs["prior"] = json.dumps([[*key, n] for key, n in self.prior.items()])
            handle.attrs["kernel"] = json.dumps(asdict(self.kernel))
            tensorio.write_tree(
                handle.create_group("reference_inputs"), {"args": self.args, "kwargs": self.kwargs}
            )
            tensorio.write_tree(handle.create_group("reference_outputs"), self.expected)
            tensorio.write_tree(handle.create_group("suspect_outputs"), self.actual)
            if self.suspect_args is not None:
                tensorio.write_tree(
                    handle.create_group("suspect_inputs"),
                    {"args": self.suspect_args, "kwargs": self.suspect_kwargs or {}},
                )

    @classmethod
    def read(cls, path: Path) -> KernelCase:
        try:
            with h5py.File(path, "r") as handle:
                kernel = json.loads(handle.attrs["kernel"])
                inputs = tensorio.read_tree(handle["reference_inputs"], keep_strides=True)
                suspect = (
                    tensorio.read_tree(handle["suspect_inputs"], keep_strides=True)
                    if "suspect_inputs" in handle
                    else None
                )
                return cls(
                    KernelSite(**json.loads(handle.attrs["site"])),
                    Counter({(k, m, p): n for k, m, p, n in json.loads(handle.attrs["prior"])}),
                    _kernel_from_json(kernel),
                    list(inputs["args"]),
                    inputs["kwargs"],
                    list(tensorio.read_tree(handle["reference_outputs"])),
                    list(tensorio.read_tree(handle["suspect_outputs"])),
                    list(suspect["args"]) if suspect else None,
                    suspect["kwargs"] if suspect else None,
                )
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ReportError(f"cannot read kernel case {path}: {exc}") from exc


def _kernel_from_json(data: dict) -> Kernel:
    lists = {key: tuple(value) for key, value in data.items() if isinstance(value, list)}
    return Kernel(**{**data, **lists})


def _kernel_case(log: KernelLog) -> KernelCase:
    assert log.kept is not None and log.kernel is not None and log.site is not None
    args, kwargs, outputs = log.kept
    return KernelCase(log.site, log.prior, log.kernel, args, kwargs, outputs, outputs)


@device_task
def run_kernel_log_task(
    device: str,
    bundle: str,
    step: int,
    work_dir: str,
    entry_state: str | None,
    inject: Sequence[str] = (),
    *,
    expected_log: str | None = None,
    repeats: int = 1,
    watch: int | None = None,
) -> dict:
    """The step at the kernel level, from the state entering it. Reference: write the kernel log
    (``watch``: and keep that call). Suspect: compare with ``expected_log`` and keep the first
    call that differs (up to ``repeats`` runs)."""
    work = Path(work_dir)
    expected = json.loads(Path(expected_log).read_text()) if expected_log else None
    runs = repeats if expected is not None and watch is None else 1
    steps_run = 0  # a job's rank among its peers has no saved state: it replays the window
    for repeat in range(runs):
        entry = _enter_step(bundle, device, inject, step, repeat, entry_state=entry_state)
        steps_run += entry.window_steps + 1
        reference = records_from_json(expected, step) if expected is not None else None
        log = KernelLog(expected=None if watch is not None else reference, watch=watch)
        messages = MessagesBefore(watch)
        try:
            entry.session.run_step(entry.target, kernel_observers=[log, messages])
        finally:
            entry.session.close()
        if watch is not None:  # the reference again: it must make its first run's calls
            _check_reproduced(
                expected or [],
                log,
                step,
                script=entry.session.script is not None,
                from_window=entry_state is None,
            )
            if log.kept is None:
                return {"case": None, "steps_run": steps_run}
            path = work / "reference-kernel.h5"
            _kernel_case(log).write(path)
            return {"case": str(path), "steps_run": steps_run, "messages_before": messages.count}
        if expected is None:
            path = work / "kernellog-reference.json"
            path.write_text(json.dumps(records_to_json(log.records)))
            return {"log": str(path), "kernels": len(log.records), "steps_run": steps_run}
        problem = log.structure_error or log.missing_calls()
        if problem:
            return {"structure_error": problem, "steps_run": steps_run}
        if log.divergent is not None:
            path = work / "suspect-kernel.h5"
            _kernel_case(log).write(path)
            return {"case": str(path), "repeats_run": repeat + 1, "steps_run": steps_run}
    return {"case": None, "repeats_run": runs, "steps_run": steps_run}


def _check_reproduced(
    expected: list, log: KernelLog, step: int, *, script: bool, from_window: bool
) -> None:
    rows = records_from_json(expected, step)
    if [r.site.kernel for r in log.records] != [r.site.kernel for r in rows]:
        raise SdcReplayError(
            f"the reference does not run the same kernels twice in step {step}", UNSTEADY_STEP
        )
    for mine, theirs in zip(log.records, rows):
        if mine.digests != theirs.digests:
            _refuse_unreproduced(
                step,
                f"kernel call {mine.site.index} ({mine.site.kernel}) gives other outputs",
                script=script,
                from_window=from_window,
            )


class _Isolator:
    """At the watched call, the kernel this process compiled is run again alone from the
    reference's inputs, ``runs`` times, and what it writes compared with the reference's."""

    def __init__(self, case: KernelCase, runs: int, injector: Injector, device: torch.device):
        self.case, self.runs, self.injector, self.device = case, runs, injector, device
        self.failures, self.ran = 0, False
        self.first_failure: int | None = None
        self.expected = [tensor_digest(t) for t in case.expected]

    def on_kernel(self, call: KernelCall) -> None:
        if call.site.index != self.case.site.index or self.ran:
            return
        if call.site.kernel != self.case.site.kernel:
            raise SdcReplayError(
                f"kernel call {call.site.index} is {call.site.kernel} here, "
                f"{self.case.site.kernel} in the report",
                "The code this process generated is not the code bisected: minimize and "
                "isolate with the torch, Inductor settings and device model of the report.",
            )
        self.ran = True
        for run in range(self.runs):
            if not trial(self.case, call.invoke, self.injector, self.device, self.expected):
                self.failures += 1
                self.first_failure = run if self.first_failure is None else self.first_failure


def trial(
    case: KernelCase,
    invoke: Callable,
    injector: Injector,
    device: torch.device,
    expected: list[str],
) -> bool:
    """One run of the kernel alone from the case's reference inputs: does it write what the
    reference wrote?"""
    args = [placed(v, device) for v in case.args]
    kwargs = {k: placed(v, device) for k, v in case.kwargs.items()}
    invoke(*args, **kwargs)
    outputs = written_tensors(case.kernel, args, kwargs)
    injector.on_isolated_kernel(case.site, case.prior, outputs)
    return [tensor_digest(t) for t in outputs] == expected


@device_task
def run_kernel_isolate_task(
    device: str,
    bundle: str,
    step: int,
    entry_state: str | None,
    case_file: str,
    runs: int,
    inject: Sequence[str] = (),
) -> dict:
    """Suspect: the divergent kernel alone, from the reference's inputs, ``runs`` times (its
    code is this process's own compile of the step)."""
    case = KernelCase.read(Path(case_file))
    entry = _enter_step(bundle, device, inject, step, 0, entry_state=entry_state)
    isolator = _Isolator(case, runs, Injector(parse_specs(inject), device), torch_device(device))
    try:
        entry.session.run_step(entry.target, kernel_observers=[isolator])
    finally:
        entry.session.close()
    if not isolator.ran:
        raise SdcReplayError(
            f"the step made no kernel call {case.site.index} ({case.site.kernel}) here",
            "Isolate with the torch and Inductor settings of the bisect that found it.",
        )
    return {
        "runs": runs,
        "failures": isolator.failures,
        "first_failure": isolator.first_failure,
        "steps_run": entry.window_steps + 1,
    }


def bisect_kernels(
    run: Callable[..., dict],
    common: dict,
    reference: str,
    suspect: str,
    repeats: int,
    isolation_runs: int,
    staging: Path,
    on_event: Callable[[str, str], None],
) -> dict | None:
    """The kernel stage (see module docstring): the report's findings for the first kernel
    call that differs, or None when every kernel call matched (the divergence is outside
    compiled code: the operator stage looks there)."""
    step = common["step"]
    on_event("kernels", f"kernel-level replay of step {step} on {reference}")
    ref = run("kernels", run_kernel_log_task, reference, common)
    on_event("kernels", f"kernel-level replay of step {step} on {suspect}")
    sus = run(
        "kernels",
        run_kernel_log_task,
        suspect,
        {**common, "expected_log": Path(ref["log"]), "repeats": repeats},
    )
    if "structure_error" in sus:
        raise SdcReplayError(
            f"{suspect} runs other generated kernels than {reference} in step {step}: "
            f"{sus['structure_error']}",
            "The two processes generated other code (other torch, Inductor settings or device "
            "model): kernel names are only the same where the generated code is. Bisect with a "
            "reference of the suspect's model and software; this says nothing about the "
            "device's arithmetic.",
        )
    if sus["case"] is None:
        return None
    suspect_case = KernelCase.read(Path(sus["case"]))
    on_event("fetch", f"fetching the reference's inputs of {suspect_case.site.kernel}")
    fetched = run(
        "fetch",
        run_kernel_log_task,
        reference,
        {**common, "expected_log": Path(ref["log"]), "watch": suspect_case.site.index},
    )
    reference_case = KernelCase.read(Path(fetched["case"]))
    case = KernelCase(
        reference_case.site,
        reference_case.prior,
        reference_case.kernel,
        reference_case.args,
        reference_case.kwargs,
        reference_case.expected,
        suspect_case.expected,
        suspect_case.args,
        suspect_case.kwargs,
    )
    case.write(staging / KERNEL_FILE)
    on_event("isolate", f"re-running {case.site.kernel} alone on {suspect} ({isolation_runs} runs)")
    isolated = run(
        "isolate",
        run_kernel_isolate_task,
        suspect,
        {
            "bundle": common["bundle"],
            "step": step,
            "entry_state": common["entry_state"],
            "case_file": staging / KERNEL_FILE,
            "runs": isolation_runs,
            "inject": common["inject"],
        },
    )
    output_index, forensics = first_differing_output(case)  # type: ignore[arg-type]
    inputs_equal = trees_equal((case.args, case.kwargs), (case.suspect_args, case.suspect_kwargs))
    site = case.site
    return {
        "level": "kernel",
        "phase": site.phase,
        "module": site.module,
        "op": None,
        "op_index": None,
        "kernel": {
            **case.kernel.to_json(),
            "index": site.index,
            "nth": site.nth,
            "spec": case.spec,
            "outputs": [
                {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for t in case.expected
            ],
        },
        "output_index": output_index,
        "kernels": [site.kernel],
        "isolated": (
            "kernel" if isolated["failures"] else ("intermittent" if inputs_equal else "upstream")
        ),
        "isolation": {k: isolated[k] for k in ("runs", "failures", "first_failure")},
        "inputs_match_reference": inputs_equal,
        **output_findings(forensics),
        "site": asdict(site),
        "steps_run": {
            "kernels_reference": ref["steps_run"],
            "kernels_suspect": sus["steps_run"],
            "kernels_fetch": fetched["steps_run"],
            "kernels_isolate": isolated["steps_run"],
        },
        "repeats_run": sus["repeats_run"],
        "messages_before": fetched.get("messages_before"),
    }
