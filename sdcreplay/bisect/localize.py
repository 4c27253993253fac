"""Bisect: from a divergent step to the first corrupted operator call and its bits.

The step is replayed once more with operator-level capture on the reference
device, then on the suspect, which compares as it runs and keeps the inputs
and outputs of the first call whose outputs differ (and the state tensors
that already differed when the step began). The reference then hands over the
same call's inputs and outputs, and the call is re-run alone on the suspect
from the reference's inputs: still wrong means the operator itself computes
wrong there (``kernel``); right means the corruption came from before
(``upstream``: the wrong input, the call that wrote it, and whether it changed
at rest in between) or does not fire every time (``intermittent``). Every
device runs in its own process. Only the reference replays the window up to
the step; it hands the state entering the step to the later runs as HDF5, unless that state
does not reproduce the step (a loop's counter outside it): then every run replays the window,
as replay does, and the report says so (``start``).

This module drives those stages: what each device process runs is `tasks.py` (on a job's
rank, `rank.py`), and the report it writes is `report.py`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from ..bundle.reader import Bundle
from ..capture import comparable
from ..capture.signature import layer_of
from ..compare.logs import RECORD
from ..devices import require_available
from ..errors import SdcReplayError, StructureError
from ..kinds import Isolation
from ..ledger.identity import identify, recorded_identity
from ..ledger.notes import note_result
from ..ledger.verdicts import incident_of
from ..replay.comparability import probe_in_processes, refuse_unlike_reference
from ..replay.processes import process_context, run_device_processes
from ..replay.replicas import REPLAY_TASK
from .alone import (
    check_bisect_alone,
    first_divergent_alone_step,
    kept_state_to_bisect,
    run_alone,
)
from .divergent_step import first_divergent_job_step, first_divergent_step
from .evidence import (
    first_differing_output,
    output_findings,
    state_forensics,
    trees_equal,
    upstream,
)
from .kernel_stage import bisect_kernels
from .operator_case import OPERATOR_FILE, OperatorCase
from .rank import collectives_around, job_to_bisect, run_in_job
from .report import (
    ENTRY_STATE_FILE,
    SCHEMA,
    BisectResult,
    ReportDirectory,
    command_line,
    total,
)
from .tasks import UNSTEADY_STEP, run_fetch_task, run_isolate_task, run_oplog_task


def bisect(
    bundle: str | Path,
    *,
    rank: int | None = None,
    suspect: str | None = None,
    reference: str = "cpu:0",
    step: int | None = None,
    repeats: int = 1,
    isolation_runs: int | None = None,
    inject: Sequence[str] = (),
    out: str | Path | None = None,
    plot: str | Path | None = None,
    on_event: Callable[[str, str], None] | None = None,
    ledger: bool = True,
    overwrite: bool = False,
    alone: bool = False,
    from_state: str | Path | None = None,
) -> BisectResult:
    """Find the first corrupted operator call of a step on ``suspect`` (see module docstring);
    ``ledger``: append a divergence to the device ledger (docs/fleet.md); ``overwrite``:
    replace a report already at ``out``, moving it (and the tickets in it) aside; ``alone``: a
    job's rank runs without its data-parallel peers (`bisect.alone`, docs/at-scale.md);
    ``from_state``: alone, start at a state phase 1 kept (`replay.kept_state`)."""
    # Every stage's processes fork from one server, started now: it imports torch and the
    # stages' tasks (the replay's, the operator-level runs') once, while the bundle is read.
    process_context(REPLAY_TASK.partition(":")[0], run_oplog_task.__module__)
    begun: list[ReportDirectory] = []
    try:
        result = _localize(
            bundle,
            begun,
            rank=rank,
            suspect=suspect,
            reference=reference,
            step=step,
            repeats=repeats,
            isolation_runs=isolation_runs,
            inject=inject,
            out=out,
            plot=plot,
            on_event=on_event,
            overwrite=overwrite,
            alone=alone,
            from_state=from_state,
        )
    except Exception:
        for written in begun:
            written.discard()
        raise
    if ledger:
        note_result(result.to_json())
    return result


def _localize(
    bundle: str | Path,
    begun: list[ReportDirectory],
    *,
    rank: int | None,
    suspect: str | None,
    reference: str,
    step: int | None,
    repeats: int,
    isolation_runs: int | None,
    inject: Sequence[str],
    out: str | Path | None,
    plot: str | Path | None,
    on_event: Callable[[str, str], None] | None,
    overwrite: bool,
    alone: bool = False,
    from_state: str | Path | None = None,
) -> BisectResult:
    on_event = on_event or (lambda kind, text: None)
    job = job_to_bisect(bundle, rank, suspect, repeats)
    kept = None
    if alone:
        check_bisect_alone(job, rank, suspect)
    if from_state is not None:
        job, kept, step = kept_state_to_bisect(job, alone, from_state, step)
    opened = Bundle.open(bundle) if job is None else job.rank(rank or 0)
    if step is not None and step not in opened.step_indices:
        raise SdcReplayError(
            f"the bundle has no step {step} (it has steps {opened.step_indices})",
            "Give --step one of the recorded steps (`sdcreplay info BUNDLE` lists them).",
            python_hint="Give step= one of the recorded steps (Bundle.open(path).step_indices).",
        )
    reference = require_available(reference)
    suspect = require_available(suspect) if suspect else None
    if suspect == reference:
        raise SdcReplayError(
            "--suspect and --reference are the same device",
            "Compare the suspect with a device you trust, e.g. --reference cpu:0.",
            python_hint="Compare the suspect with a device you trust, e.g. reference='cpu:0'.",
        )
    if plot is not None:
        _plotter()
    named = job.path if job is not None else opened.path  # never inside a job bundle
    written = ReportDirectory.begin(
        Path(out) if out else named.with_name(named.name + ".bisect"), overwrite
    )
    begun.append(written)  # a failure discards it (`bisect`)
    work, finish = written.work, written.finish
    base: dict = {
        "schema": SCHEMA,
        "bundle": str(named),
        "incident": incident_of((job or opened).manifest.manifest_sha256),
        "suspect": suspect or RECORD,
        "reference": reference,
        "inject": list(inject),
        "recorded_faults": (job or opened).injected_faults,  # a drill bundle's (its manifest)
        "workload": opened.manifest.workload.to_json(),
        "report": str(written.final),
        "determinism": opened.manifest.determinism.to_json(),
        "commands": [command_line()],
        "identities": {
            "suspect": (
                identify(suspect)
                if suspect
                else recorded_identity(
                    opened.manifest.device,
                    opened.manifest.environment.host,
                    opened.manifest.environment.device,
                )
            ).to_json(),
            "reference": identify(reference).to_json(),
        },
    }
    if job is not None:
        base["rank"] = rank
        base["alone"] = alone
    replayed: dict = {}
    if step is None or suspect is None:
        found, replayed = (
            first_divergent_step(opened, suspect, reference, repeats, inject, work, on_event)
            if job is None
            else first_divergent_alone_step(job, rank or 0, suspect, reference, inject, work)
            if alone
            else first_divergent_job_step(job, rank or 0, suspect, reference, inject, work)
        )
        step = found if step is None else step
    elif job is None:  # no replay ran: the probe alone says whether the reference can judge
        labels = [reference] + ([suspect] if suspect else [])
        unlike = probe_in_processes(opened, labels, work / "probe")
        refuse_unlike_reference(unlike, reference, suspect)
    if step is None or (suspect is None and replayed["first_entry"] is None):
        result = {
            **base,
            "verdict": "no_divergence",
            "step": step,
            "repeats_run": repeats,
            **replayed,
        }
        recorded = replayed.get("record_first_entry")
        if suspect is not None and recorded is not None:
            result["next"] = (
                f"{suspect} reproduces {reference}, but the recording differs from {reference} "
                f"at step {recorded['step']} {recorded['name']}: the device that recorded "
                f"({opened.manifest.device} on {opened.manifest.environment.host}) is the "
                "suspect; bisect with --suspect set to it."
            )
        return finish(result, on_event)
    if suspect is None:
        entry = replayed["first_entry"]
        return finish(
            {
                **base,
                "verdict": "divergence",
                "step": entry["step"],
                "phase": entry["phase"],
                "module": layer_of(entry["name"]),
                "entry": entry["name"],
                "op": None,
                "isolated": None,
                "repeats_run": 1,
                "next": f"The recording diverges from {reference} at {entry['name']}; to name "
                "the operator, bisect again with --suspect set to the device that recorded "
                f"({opened.manifest.device} on {opened.manifest.environment.host}).",
                **replayed,
            },
            on_event,
        )

    common = {
        "bundle": opened.path,
        "step": step,
        "inject": list(inject),
        "work_dir": work,
    }
    pinned = comparable.pinned_environment(opened.manifest.fingerprint)
    single = partial(_run_alone, work=work, environment=pinned)
    # A job's rank among its peers replays the window with them: no saved state. A rank
    # alone starts every later run from the state entering the step, as a single process.
    entry_state = work / ENTRY_STATE_FILE if job is None or alone else None
    if kept is not None:  # the kept state is the state entering the step: no run saves it
        common["entry_state"] = entry_state = kept.rank_state(rank or 0)
    kept_path = None if kept is None else kept.path
    run = (
        single
        if job is None
        else partial(
            run_alone, job=job, rank=rank or 0, work=work, environment=pinned, from_state=kept_path
        )
        if alone
        else partial(run_in_job, job=job, rank=rank, work=work, environment=pinned)
    )

    on_event("oplog", f"operator-level replay of step {step} on {reference}")
    saving = {} if kept is not None else {"save_entry": entry_state}
    ref_log = run("oplog", run_oplog_task, reference, {**common, **saving})
    start = ref_log.get("start")
    if start is not None:  # the saved state lacks what the step depends on: replay's start
        entry_state = None
        base["warnings"] = [start.pop("warning")]
        on_event(
            "start",
            f"step {step} does not reproduce from the state saved entering it: every later run "
            "starts from the window's start",
        )
    base["start"] = start or {"from": "window" if entry_state is None else "saved_state"}
    common["entry_state"] = entry_state  # every later run starts from the state entering the step
    if ref_log.get("kernel_calls") and suspect is not None:
        in_kernels = bisect_kernels(
            run, common, reference, suspect, repeats, isolation_runs or max(repeats, 3),
            written.staging, on_event,
        )  # fmt: skip
        if in_kernels is not None:
            kernel_steps = in_kernels.pop("steps_run")
            issued = in_kernels.pop("messages_before")
            if job is not None:
                in_kernels["collectives"] = collectives_around(opened, step, issued)
            steps = {"replay": replayed.pop("steps_run", {}).get("replay", 0)}
            steps |= {"oplog_reference": ref_log["steps_run"], **kernel_steps}
            result = {**base, "verdict": "divergence", "step": step, **replayed, **in_kernels}
            result["steps_run"] = total(steps)
            return finish(result, on_event)
    on_event(
        "oplog", f"operator-level replay of step {step} on {suspect} (up to {repeats} repeats)"
    )
    sus = run(
        "oplog",
        run_oplog_task,
        suspect,
        {**common, "expected_log": Path(ref_log["oplog"]), "repeats": repeats},
    )
    steps = {
        "replay": replayed.pop("steps_run", {}).get("replay", 0),
        "oplog_reference": ref_log["steps_run"],
        "oplog_suspect": sus["steps_run"],
    }
    if "structure_error" in sus:
        raise StructureError(
            f"{suspect} runs a different sequence of operators than {reference} in step {step}: "
            f"{sus['structure_error']}",
            _sequence_hint(suspect, reference, sus["environment"], ref_log["environment"]),
        )
    if not sus["divergent"]:
        return finish(
            {
                **base,
                "verdict": "no_divergence",
                "step": step,
                "repeats_run": sus["repeats_run"],
                "steps_run": total(steps),
                **replayed,
            },
            on_event,
        )

    on_event("fetch", f"fetching the reference's inputs of the divergent call from {reference}")
    fetched = run(
        "fetch",
        run_fetch_task,
        reference,
        {
            **common,
            "op_index": sus["op_index"],
            "state_names": sus["state_differs"],
            "expected_log": Path(ref_log["oplog"]),
        },
    )
    steps["fetch"] = fetched["steps_run"]
    state_report = state_forensics(work, suspect, sus["state_differs"])
    result = {
        **base,
        "verdict": "divergence",
        "step": step,
        "repeats_run": sus["repeats_run"],
        "steps_run": total(steps),
        "state": state_report,
        **replayed,
    }
    if fetched["case"] is None:
        result.update(
            phase="state",
            module=state_report[0]["tensor"] if state_report else None,
            op=None,
            op_index=None,
            isolated="upstream",
            kernels=[],
        )
        return finish(result, on_event)

    reference_case = OperatorCase.read(Path(fetched["case"]))
    suspect_case = OperatorCase.read(Path(sus["case"]))
    case = OperatorCase(
        reference_case.site,
        reference_case.prior,
        reference_case.args,
        reference_case.kwargs,
        reference_case.expected,
        suspect_case.actual,
        suspect_case.args,
        suspect_case.kwargs,
        rng=reference_case.rng,
    )
    case.write(written.staging / OPERATOR_FILE)
    runs = isolation_runs or max(repeats, 3)
    on_event(
        "isolate",
        f"re-running {case.op} alone on {suspect} from {reference}'s inputs ({runs} runs)",
    )
    isolated = single(
        "isolate",
        run_isolate_task,
        suspect,
        {
            "bundle": opened.path,
            "case_file": written.staging / OPERATOR_FILE,
            "inject": list(inject),
            "runs": runs,
            "rank": rank,
        },
    )
    output_index, forensics = first_differing_output(case)
    inputs_equal = trees_equal((case.args, case.kwargs), (case.suspect_args, case.suspect_kwargs))
    verdict: Isolation = (
        "kernel" if isolated["failures"] else ("intermittent" if inputs_equal else "upstream")
    )
    site = case.site
    result.update(
        phase=site.phase,
        module=site.module,
        recompute=site.recompute,
        op=site.op,
        op_index=site.index,
        output_index=output_index,
        kernels=isolated["kernels"],
        isolated=verdict,
        isolation={
            "runs": isolated["runs"],
            "failures": isolated["failures"],
            "first_failure": isolated["first_failure"],
        },
        inputs_match_reference=inputs_equal,
        **output_findings(forensics),
        site=asdict(site),
        prior_calls=[[*key, n] for key, n in case.prior.items()],
        environment={"reference": ref_log.get("environment"), "suspect": sus.get("environment")},
    )
    if job is not None:  # where the call lies among the rank's collectives
        result["collectives"] = collectives_around(opened, step, fetched.get("messages_before"))
    if verdict == "upstream":
        result["upstream"] = upstream(case, sus.get("origins", []), sus["state_differs"])
        producer = result["upstream"] and result["upstream"]["producer"]
        if result["upstream"] and result["upstream"]["at_rest"] and producer:
            # Where the corruption is first seen: the producer's side (the reader: site, upstream).
            result.update(phase=producer["phase"], module=producer["module"])
    if plot is not None:
        result["plot"] = None  # asked for, and drawn only where an output's elements differ
    if plot is not None and forensics.get("count"):
        plot_element_heatmap = _plotter()
        expected = [v for v in case.expected if isinstance(v, torch.Tensor)][output_index]
        actual = [v for v in case.actual if isinstance(v, torch.Tensor)][output_index]
        result["plot"] = str(
            plot_element_heatmap(
                expected,
                actual,
                written.while_written(Path(plot)),
                f"{site.op} under {site.module} ({site.phase}), step {step}",
            )
        )
    return finish(result, on_event)


def _sequence_hint(suspect: str, reference: str, theirs: dict, ours: dict) -> str:
    """Why two devices ran other operators in the same step: other kernels, or the step."""
    if _kind(theirs) == _kind(ours):
        return (
            f"{suspect} and {reference} are the same kind of device with the same torch "
            f"({theirs['device']['name']}). " + UNSTEADY_STEP
        )
    return (
        f"{suspect} ({theirs['device']['name']}, torch {theirs['torch']}) and {reference} "
        f"({ours['device']['name']}, torch {ours['torch']}) choose other kernels or "
        "decompositions for this step, and bisect compares them call for call: bisect again "
        "with a reference of the suspect's model and software. This says nothing about the "
        "device's arithmetic."
    )


def _kind(environment: dict) -> tuple:
    """What decides which kernels a step gets: the device's type and model, and torch."""
    device = environment["device"]
    return (device["type"], device["name"], device.get("capability"), environment["torch"])


def _plotter():
    """The heatmap function, checked before any work is done (it draws only at the end)."""
    hint = "Install the plot extra (pip install 'sdcreplay[plot]'), or leave out --plot."
    python_hint = "Install the plot extra (pip install 'sdcreplay[plot]'), or pass plot=None."
    try:
        from ..compare.plot import plot_element_heatmap
    except ImportError as exc:
        raise SdcReplayError(
            f"--plot is not available here: {exc}", hint, python_hint=python_hint
        ) from exc
    if importlib.util.find_spec("matplotlib") is None:
        raise SdcReplayError(
            "--plot needs matplotlib, which is not installed", hint, python_hint=python_hint
        )
    return plot_element_heatmap


def _run_alone(
    kind: str,
    task: Callable[..., dict],
    label: str,
    arguments: dict,
    *,
    work: Path,
    environment: dict[str, str],
) -> dict:
    """``task`` in one device process: its value, or the error that stops the bisect."""
    results = run_device_processes(
        kind, task, [label], lambda _: arguments, work, environment=environment
    )
    result, error = results[label], results[label].error
    if error is not None:
        raise SdcReplayError(
            f"the {label} process failed: {error.said()}",
            error.hint or f"See the process's stderr in {error.log or work}.",
        )
    return result.value or {}
