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
the step; it hands the state entering the step to the later runs as HDF5.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar, get_args

import h5py
import torch

from ..bundle.manifest import Bundle, JobBundle, StepRecord, is_job_bundle
from ..capture import determinism
from ..capture.determinism import restore_operator_rng
from ..capture.digest import tensor_digest
from ..capture.faults import Injector, parse_specs
from ..capture.layers import (
    CallSite,
    InputOrigin,
    OperatorLog,
    OperatorRecord,
    memory_address,
    operator_results,
    state_tensors,
)
from ..capture.signature import SignatureLog, layer_of
from ..compare.forensics import element_forensics, words
from ..compare.logs import RECORD, Divergence, compare_logs
from ..devices import torch_device, validate_label
from ..errors import SdcReplayError, StructureError
from ..heartbeat import HEARTBEAT
from ..kinds import BisectVerdict, Isolation
from ..replay.job import ranks_failure, recorded_log, replay_job, require_own_gpus, this_rank
from ..replay.launch import run_ranks
from ..replay.processes import run_device_processes
from ..replay.session import ReplaySession, progress_timeout, replay_devices
from ..replay.worker import device_task, task_function, task_reference
from ..storage.tensorio import read_tensor, write_tensor
from .operator_case import OPERATOR_FILE, OperatorCase, place, resolve_op

REPORT_FILE = "report.json"
STATE_FILE = "state.h5"
ENTRY_STATE_FILE = "state-entering-step.h5"
SCHEMA = "sdcreplay.bisect/1"


# ---------------------------------------------------------------------------
# Worker side: each device_task runs in a device process (see worker.py).


@dataclass
class StepEntry:
    """A session in the state entering the bisected step, that state, and the step's record."""

    session: ReplaySession
    digests: dict[str, str]  # state name -> digest, after this device's own faults before the step
    state: dict[str, torch.Tensor]
    target: StepRecord
    window_steps: int  # steps of the window this process replayed to get here (0: loaded)
    continuation: list[tuple[str, str]] | None = None  # the step run on from the window itself


def _enter_step(
    bundle: str,
    device: str,
    inject: Sequence[str],
    step: int,
    repeat: int,
    *,
    entry_state: str | None = None,
    save_entry: str | None = None,
) -> StepEntry:
    """Bring a session to the state entering the bisected step.

    Only the reference replays the window, once, and writes that state
    (``save_entry``); every later run loads it (``entry_state``): every
    device matched the reference up to this step, so it is the same state,
    and a bisect of step 90 costs one extra window replay, not four. The
    device's own memory faults before the step still apply after loading,
    and its state is digested here and compared with the reference's, so
    memory corrupted at rest entering the step is still seen.
    """

    def new_session() -> ReplaySession:
        return ReplaySession(bundle, device, inject=inject, repeat=repeat)

    session = new_session()
    window_steps, continuation = 0, None
    try:
        target = next((r for r in session.bundle.steps if r.index == step), None)
        if target is None:
            raise SdcReplayError(
                f"the bundle has no step {step}", f"Steps: {session.bundle.step_indices}."
            )
        if entry_state:
            session.load_state(Path(entry_state))
        else:
            for record in session.steps_until(step - 1):
                session.run_step(record)
                window_steps += 1
            if save_entry:
                # The reference runs the step in a session fresh from the saved state, like every
                # later run: objects that build tensors lazily (a GradScaler's scale) then call
                # the same operators.
                session.save_state(Path(save_entry))
                continuation = session.run_step(target)
                window_steps += 1
                session.close()
                session = new_session()
                session.load_state(Path(save_entry))
    except BaseException:
        session.close()
        raise
    session.injector.before_step(
        step, session.model
    )  # memory corrupted before the step belongs to its state
    state = state_tensors(session.model, session.optimizer)
    digests = {name: tensor_digest(tensor) for name, tensor in state.items()}
    return StepEntry(session, digests, state, target, window_steps, continuation)


def _records_to_json(records: list[OperatorRecord]) -> list:
    return [[r.site.phase, r.site.module, r.site.op, r.digests] for r in records]


def _records_from_json(rows: list, step: int) -> list[OperatorRecord]:
    return [
        OperatorRecord(CallSite(step, phase, module, op, index), digests)
        for index, (phase, module, op, digests) in enumerate(rows)
    ]


@device_task
def run_oplog_task(
    device: str,
    bundle: str,
    step: int,
    work_dir: str,
    inject: Sequence[str] = (),
    *,
    save_entry: str | None = None,
    entry_state: str | None = None,
    expected_log: str | None = None,
    repeats: int = 1,
) -> dict:
    """Reference: write the step's operator log. Suspect: compare and keep the first divergence.

    ``expected_log`` is the reference's operator log (a suspect runs up to ``repeats``
    times); ``save_entry`` and ``entry_state``: see `_enter_step`.
    """
    work = Path(work_dir)
    expected = json.loads(Path(expected_log).read_text()) if expected_log else None
    repeats = repeats if expected else 1
    steps_run = 0
    for repeat in range(repeats):
        entry = _enter_step(
            bundle, device, inject, step, repeat, entry_state=entry_state, save_entry=save_entry
        )
        session, digests, state, target = entry.session, entry.digests, entry.state, entry.target
        steps_run += entry.window_steps + 1
        reference = _records_from_json(expected["operators"], step) if expected else None
        oplog = OperatorLog(
            expected=reference, state_memory={memory_address(t): name for name, t in state.items()}
        )
        try:
            differing = [
                n for n, d in digests.items() if expected and expected["state"].get(n) != d
            ]
            _save_state(work / f"state-{device.replace(':', '-')}.h5", state, differing)
            entries = session.run_step(target, observers=[oplog])
        finally:
            session.close()
        if entry.continuation is not None and entries != entry.continuation:
            _refuse_unreproduced(step)
        environment = determinism.environment(session.device)
        if expected is None:
            path = work / "oplog-reference.json"
            path.write_text(
                json.dumps({"state": digests, "operators": _records_to_json(oplog.records)})
            )
            return {
                "oplog": str(path),
                "operators": len(oplog.records),
                "environment": environment,
                "steps_run": steps_run,
            }
        structure_error = oplog.structure_error or _missing_calls(oplog, expected["operators"])
        if structure_error:
            return {"structure_error": structure_error, "repeat": repeat, "steps_run": steps_run}
        if oplog.divergent is not None or differing:
            case_path = work / "suspect-call.h5"
            # Comparing against a log, the oplog keeps a call only when it diverges.
            if oplog.kept is not None and oplog.divergent is not None:
                args, kwargs, outputs = oplog.kept
                OperatorCase(oplog.divergent.site, Counter(), args, kwargs, outputs, outputs).write(
                    case_path
                )
            return {
                "divergent": True,
                "repeat": repeat,
                "repeats_run": repeat + 1,
                "environment": environment,
                "steps_run": steps_run,
                "op_index": oplog.divergent.site.index if oplog.divergent else None,
                "state_differs": differing,
                "case": str(case_path) if oplog.kept is not None else None,
                "origins": [_origin_to_json(o, expected["operators"]) for o in oplog.origins],
            }
    return {"divergent": False, "repeats_run": repeats, "steps_run": steps_run}


def _origin_to_json(origin: InputOrigin, expected: list) -> dict:
    """One input of the divergent call; did its producer's output match the reference's?"""
    producer = None
    if origin.producer is not None:
        site = origin.producer.site
        producer = {
            "index": site.index,
            "op": site.op,
            "module": site.module,
            "phase": site.phase,
            "matched_reference": origin.producer.digests == expected[site.index][3],
        }
    return {
        "position": origin.position,
        "element": origin.element,
        "name": origin.name,
        "producer": producer,
        "state": origin.state,
    }


def _missing_calls(oplog: OperatorLog, expected: list) -> str | None:
    """The first reference call the suspect never made, when its calls were a strict prefix.

    OperatorLog compares each call as it comes, so a suspect that stops early
    (fewer operators, same values) would otherwise pass as no divergence. After
    a value divergence the rest of the sequence may legitimately differ.
    """
    made = len(oplog.records)
    if oplog.divergent is not None or made >= len(expected):
        return None
    phase, module, op, _ = expected[made]
    return f"operator call {made}: nothing here, {op} under {module} ({phase}) on the reference"


def _save_state(path: Path, state: dict[str, torch.Tensor], names: Sequence[str]) -> None:
    if not names:
        return
    with h5py.File(path, "w") as handle:
        for name in names:
            write_tensor(handle, name.replace("/", "|"), state[name])


@device_task
def run_fetch_task(
    device: str,
    bundle: str,
    step: int,
    work_dir: str,
    op_index: int | None,
    inject: Sequence[str] = (),
    *,
    state_names: Sequence[str] = (),
    entry_state: str | None = None,
    expected_log: str | None = None,
) -> dict:
    """Reference: keep the inputs and outputs of one call, and named state tensors.

    Given the reference's own operator log (``expected_log``), the run from the
    loaded state must reproduce it call for call: otherwise the saved state
    was not all the step depends on, and no later comparison could be trusted.
    """
    oplog = OperatorLog(watch=op_index)
    entry = _enter_step(bundle, device, inject, step, 0, entry_state=entry_state)
    try:
        _save_state(Path(work_dir) / "state-reference.h5", entry.state, state_names)
        if op_index is not None:
            entry.session.run_step(entry.target, observers=[oplog])
    finally:
        entry.session.close()
    steps_run = entry.window_steps + (op_index is not None)
    if expected_log and op_index is not None:
        expected = json.loads(Path(expected_log).read_text())
        _check_reproduced(expected, entry.digests, oplog, step)
    if oplog.kept is None or op_index is None:  # only a watched call is kept
        return {"case": None, "steps_run": steps_run}
    args, kwargs, outputs = oplog.kept
    path = Path(work_dir) / "reference-call.h5"
    site = oplog.records[op_index].site
    prior = Counter(r.site.key for r in oplog.records[:op_index])
    OperatorCase(site, prior, args, kwargs, outputs, outputs, rng=oplog.rng_before).write(path)
    return {"case": str(path), "steps_run": steps_run}


def _check_reproduced(expected: dict, state_digests: dict, oplog: OperatorLog, step: int) -> None:
    calls = [row[3] for row in expected["operators"]]
    if state_digests != expected["state"] or [r.digests for r in oplog.records] != calls:
        _refuse_unreproduced(step)


def _refuse_unreproduced(step: int) -> None:
    """Every run after the window starts from the saved state: it must be the whole state."""
    raise SdcReplayError(
        f"the reference does not reproduce its own step {step} from the state saved entering it",
        "The step depends on state outside the model, optimizer and the workload's state "
        "objects (a Python counter?); give it to the workload as a state object "
        "(docs/recording.md), since bisect starts the step from what the saved state holds.",
    )


@device_task
def run_isolate_task(
    device: str,
    bundle: str,
    case_file: str,
    runs: int,
    inject: Sequence[str] = (),
    rank: int | None = None,
) -> dict:
    """Suspect: run the one call alone from the reference's inputs, ``runs`` times.

    ``rank``: the job rank the call was made on (the call needs no peers, but a fault spec
    with ``rank=`` fires as it did there)."""
    determinism.apply(Bundle.open(bundle).manifest.determinism.to_json())
    where = torch_device(device)
    case = OperatorCase.read(Path(case_file))
    op = resolve_op(case.op)
    injector = Injector(parse_specs(inject), device, rank=rank)
    expected = [tensor_digest(v) for v in place(case.expected, where)]
    failures, first_failure = 0, None
    for run in range(runs):
        args, kwargs = place((list(case.args), case.kwargs), where)
        restore_operator_rng(case.rng, where)
        out = op(*args, **kwargs)
        injector.on_isolated_call(case.site, case.prior, out)
        if [tensor_digest(v) for v in operator_results(op, args, out)] != expected:
            failures += 1
            first_failure = run if first_failure is None else first_failure
    return {
        "runs": runs,
        "failures": failures,
        "first_failure": first_failure,
        "kernels": kernel_names(op, case, where),
    }


@device_task
def run_rank_bisect_task(
    device: str, job: str, rank: int, task: str, arguments: dict, serve_until: int
) -> dict:
    """One rank of a job bisect: rank ``rank`` runs bisect's ``task``; every other rank
    replays its own part up to step ``serve_until`` to serve the collectives."""
    mine = this_rank()
    if mine == rank:
        return task_function(task)(device=device, **arguments)
    session = ReplaySession(JobBundle.open(job).rank(mine), device)
    try:
        for record in session.steps_until(serve_until):
            HEARTBEAT.beat(f"serving step {record.index}")
            session.run_step(record)
    finally:
        session.close()
    return {}


def _cuda_profile(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA])


KERNEL_PROFILERS: dict[str, Callable] = {"cuda": _cuda_profile}
"""Device type -> a profiler context for one call (its ``events()`` name the kernels)."""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_names(op, case: OperatorCase, device: torch.device) -> list[str]:
    """The device kernels one call launches, from the profiler (none on a CPU)."""
    profiler = KERNEL_PROFILERS.get(device.type)
    if profiler is None:
        return []
    args, kwargs = place((list(case.args), case.kwargs), device)
    _synchronize(device)
    with profiler(device) as prof:
        op(*args, **kwargs)
        _synchronize(device)
    return device_kernels(prof.events())


def device_kernels(events) -> list[str]:
    """Names of the profiler events that ran on the device (CUDA activity), in order, once each."""
    names: list[str] = []
    for event in events:
        if event.device_type.name == "CUDA" and event.name not in names:
            names.append(event.name)
    return names


# ---------------------------------------------------------------------------
# Orchestration.


@dataclass
class BisectResult:
    """The report: ``to_json()`` is what ``--json`` prints and report.json holds.

    The fields every report has are typed; ``findings`` holds what the verdict
    adds (the call, its elements and bits, upstream, state; docs/bisect.md),
    under the report's keys and in its order.
    """

    verdict: BisectVerdict
    step: int | None  # None: no step diverged
    suspect: str  # a device label, or "record"
    reference: str
    report: str  # the report directory
    findings: dict = field(default_factory=dict)

    _TYPED: ClassVar = ("verdict", "step", "suspect", "reference", "report")

    @classmethod
    def from_json(cls, data: dict) -> BisectResult:
        if data.get("verdict") not in get_args(BisectVerdict):
            raise ValueError(f"not a bisect verdict: {data.get('verdict')!r}")
        rest = {key: value for key, value in data.items() if key not in (*cls._TYPED, "schema")}
        return cls(
            data["verdict"], data["step"], data["suspect"], data["reference"], data["report"], rest
        )

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "divergence" else 0

    def to_json(self) -> dict:
        typed = {name: getattr(self, name) for name in self._TYPED}
        return {"schema": SCHEMA, **typed, **self.findings}


def _first_divergent_step(
    bundle: Bundle,
    suspect: str | None,
    reference: str,
    repeats: int,
    inject: Sequence[str],
    work: Path,
    on_event,
) -> tuple[int | None, dict]:
    """Replay the bundle; the first entry where the suspect (or the recording) leaves the reference.

    The reference is trusted by definition, so the suspect is compared with it
    directly, not through a majority vote: with the recording and one device
    there is no majority, and a recording made on the suspect would outvote
    the reference.
    """
    labels = [reference] + ([suspect] if suspect else [])
    on_event(
        "replay", f"replaying the window on {', '.join(labels)} to find the first divergent step"
    )
    report = replay_devices(
        bundle.path, labels, repeats=repeats, inject=inject, log_dir=work / "replay"
    )
    for run in report.devices:
        if run.error:
            raise SdcReplayError(
                f"the {run.device} replay failed: {run.error['message']}",
                run.error.get("hint") or "See the device's stderr in the work directory.",
            )
    runs = {run.device: run for run in report.devices}
    trusted = runs[reference].logs[0]
    record_first = _first_divergence(trusted, [bundle.signature_log()])
    first = record_first if suspect is None else _first_divergence(trusted, runs[suspect].logs)
    return (first.step if first else None), {
        "replay": report.to_json(),
        "first_entry": first.brief() if first else None,
        "record_first_entry": record_first.brief() if record_first else None,
        "steps_run": _total(
            {"replay": sum(len(log.steps) for r in report.devices for log in r.logs)}
        ),
    }


def _job_to_bisect(
    bundle: str | Path, rank: int | None, suspect: str | None, repeats: int
) -> JobBundle | None:
    """The job bundle whose rank ``rank`` is bisected, or None for a single-process bundle."""
    if not is_job_bundle(Path(bundle)):
        if rank is not None:
            raise SdcReplayError(
                f"--rank {rank} is for a job bundle (record --nproc); {bundle} is a single "
                "process's bundle",
                "Leave out --rank.",
            )
        return None
    job = JobBundle.open(bundle)
    if rank is None or not 0 <= rank < job.world_size:
        raise SdcReplayError(
            f"{bundle} is a job of {job.world_size} ranks: say which rank to bisect",
            "Give --rank R, e.g. the origin_rank `sdcreplay replay` named.",
        )
    if repeats != 1:
        raise SdcReplayError(
            "--repeats is for a single process's bisect: a job's rank runs its step once among "
            "its peers",
            "Leave out --repeats (replay with --repeats shows an intermittent rank first).",
        )
    return job


def _first_divergent_job_step(
    job: JobBundle,
    rank: int,
    suspect: str | None,
    reference: str,
    inject: Sequence[str],
    work: Path,
) -> tuple[int | None, dict]:
    """As `_first_divergent_step`, for one rank of a job: a replay of the job with the rank on
    the reference (and one with it on the suspect); the other ranks on their recorded devices."""
    recorded = [part.device for part in job.ranks]
    logs = {}
    for label in [reference] + ([suspect] if suspect else []):
        labels = [label if r == rank else device for r, device in enumerate(recorded)]
        report = replay_job(job.path, labels, inject=inject, log_dir=work / f"replay-{label}")
        run = report.ranks[rank].runs[0]
        failed = [run for _, run in report.failed]
        if failed:
            error = failed[0].error or {}
            raise SdcReplayError(
                f"the job replay with rank {rank} on {label} failed: {error.get('message')}",
                error.get("hint") or "See the ranks' logs in the work directory.",
            )
        logs[label] = run.logs
    trusted = logs[reference][0]
    record_first = _first_divergence(trusted, [recorded_log(job.rank(rank))])
    first = record_first if suspect is None else _first_divergence(trusted, logs[suspect])
    return (first.step if first else None), {
        "first_entry": first.brief() if first else None,
        "record_first_entry": record_first.brief() if record_first else None,
    }


def _first_divergence(trusted: SignatureLog, logs: Sequence[SignatureLog]) -> Divergence | None:
    """The earliest entry, in execution order, where any of ``logs`` differs from ``trusted``."""
    found = []
    for log in logs:
        first = compare_logs(trusted, log, sorted(set(trusted.steps) & set(log.steps))).first
        if first is not None:
            names = [name for name, _ in trusted.steps[first.step]]
            found.append(((first.step, names.index(first.name)), first))
    return min(found, key=lambda pair: pair[0])[1] if found else None


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
) -> BisectResult:
    """Find the first corrupted operator call of a step on ``suspect`` (see module docstring)."""
    on_event = on_event or (lambda kind, text: None)
    job = _job_to_bisect(bundle, rank, suspect, repeats)
    opened = Bundle.open(bundle) if job is None else job.rank(rank or 0)
    if step is not None and step not in opened.step_indices:
        raise SdcReplayError(
            f"the bundle has no step {step} (it has steps {opened.step_indices})",
            "Give --step one of the recorded steps (`sdcreplay info BUNDLE` lists them).",
        )
    reference = validate_label(reference)
    suspect = validate_label(suspect) if suspect else None
    if suspect == reference:
        raise SdcReplayError(
            "--suspect and --reference are the same device",
            "Compare the suspect with a device you trust, e.g. --reference cpu:0.",
        )
    if plot is not None:
        _plotter()
    named = job.path if job is not None else opened.path  # never inside a job bundle
    out = Path(out) if out else named.with_name(named.name + ".bisect")
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    (out / OPERATOR_FILE).unlink(missing_ok=True)  # a report never shows an earlier run's call
    base: dict = {
        "schema": SCHEMA,
        "bundle": str(named),
        "suspect": suspect or RECORD,
        "reference": reference,
        "inject": list(inject),
        "workload": opened.manifest.workload.to_json(),
        "report": str(out),
        "determinism": opened.manifest.determinism.to_json(),
        "commands": [_command_line()],
    }
    if job is not None:
        base["rank"] = rank
    replayed: dict = {}
    if step is None or suspect is None:
        found, replayed = (
            _first_divergent_step(opened, suspect, reference, repeats, inject, work, on_event)
            if job is None
            else _first_divergent_job_step(job, rank or 0, suspect, reference, inject, work)
        )
        step = found if step is None else step
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
        return _finish(out, result, on_event)
    if suspect is None:
        entry = replayed["first_entry"]
        return _finish(
            out,
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
        "bundle": str(opened.path),
        "step": step,
        "inject": list(inject),
        "work_dir": str(work),
    }
    pinned = determinism.pinned_environment(opened.manifest.fingerprint)
    alone = partial(_run_alone, work=work, environment=pinned)
    # A job's rank runs among its peers, which replay the window with it: no saved state.
    entry_state = str(work / ENTRY_STATE_FILE) if job is None else None
    run = (
        alone
        if job is None
        else partial(_run_in_job, job=job, rank=rank, work=work, environment=pinned)
    )

    on_event("oplog", f"operator-level replay of step {step} on {reference}")
    ref_log = run("oplog", run_oplog_task, reference, {**common, "save_entry": entry_state})
    common["entry_state"] = entry_state  # every later run starts from the state entering the step
    on_event(
        "oplog", f"operator-level replay of step {step} on {suspect} (up to {repeats} repeats)"
    )
    sus = run(
        "oplog",
        run_oplog_task,
        suspect,
        {**common, "expected_log": ref_log["oplog"], "repeats": repeats},
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
            "The devices run different code or configuration (different kernels chosen?); "
            "this is not silent data corruption.",
        )
    if not sus["divergent"]:
        return _finish(
            out,
            {
                **base,
                "verdict": "no_divergence",
                "step": step,
                "repeats_run": sus["repeats_run"],
                "steps_run": _total(steps),
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
            "expected_log": ref_log["oplog"],
        },
    )
    steps["fetch"] = fetched["steps_run"]
    state_report = _state_forensics(work, suspect, sus["state_differs"])
    result = {
        **base,
        "verdict": "divergence",
        "step": step,
        "repeats_run": sus["repeats_run"],
        "steps_run": _total(steps),
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
        return _finish(out, result, on_event)

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
    case.write(out / OPERATOR_FILE)
    runs = isolation_runs or max(repeats, 3)
    on_event(
        "isolate",
        f"re-running {case.op} alone on {suspect} from {reference}'s inputs ({runs} runs)",
    )
    isolated = alone(
        "isolate",
        run_isolate_task,
        suspect,
        {
            "bundle": str(opened.path),
            "case_file": str(out / OPERATOR_FILE),
            "inject": list(inject),
            "runs": runs,
            "rank": rank,
        },
    )
    output_index, forensics = _first_differing_output(case)
    inputs_equal = _trees_equal((case.args, case.kwargs), (case.suspect_args, case.suspect_kwargs))
    verdict: Isolation = (
        "kernel" if isolated["failures"] else ("intermittent" if inputs_equal else "upstream")
    )
    site = case.site
    result.update(
        phase=site.phase,
        module=site.module,
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
        elements={
            k: forensics.get(k)
            for k in (
                "count",
                "total",
                "indices",
                "positions",
                "xor",
                "expected",
                "actual",
                "max_abs_diff",
                "max_rel_diff",
                "dtype",
                "shape",
            )
        },
        bits=forensics.get("bits"),
        pattern=forensics.get("pattern"),
        fault_model=forensics.get("fault_model"),
        site=asdict(site),
        prior_calls=[[*key, n] for key, n in case.prior.items()],
        environment={"reference": ref_log.get("environment"), "suspect": sus.get("environment")},
    )
    if verdict == "upstream":
        result["upstream"] = _upstream(case, sus.get("origins", []), sus["state_differs"])
        producer = result["upstream"] and result["upstream"]["producer"]
        if result["upstream"] and result["upstream"]["at_rest"] and producer:
            # Where the corruption is first seen: the producer's side (the reader: site, upstream).
            result.update(phase=producer["phase"], module=producer["module"])
    if plot is not None and forensics.get("count"):
        plot_element_heatmap = _plotter()
        expected = [v for v in case.expected if isinstance(v, torch.Tensor)][output_index]
        actual = [v for v in case.actual if isinstance(v, torch.Tensor)][output_index]
        result["plot"] = str(
            plot_element_heatmap(
                expected,
                actual,
                Path(plot),
                f"{site.op} under {site.module} ({site.phase}), step {step}",
            )
        )
    return _finish(out, result, on_event)


def _total(steps: dict[str, int]) -> dict[str, int]:
    """Training steps each stage executed, and in all: what a bisect costs."""
    return {**steps, "total": sum(steps.values())}


def _plotter():
    """The heatmap function, checked before any work is done (it draws only at the end)."""
    hint = "Install the plot extra (pip install 'sdcreplay[plot]'), or leave out --plot."
    try:
        from ..compare.plot import plot_element_heatmap
    except ImportError as exc:
        raise SdcReplayError(f"--plot is not available here: {exc}", hint) from exc
    if importlib.util.find_spec("matplotlib") is None:
        raise SdcReplayError("--plot needs matplotlib, which is not installed", hint)
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
        detail = f": {error.stderr_tail.splitlines()[-1]}" if error.stderr_tail else ""
        raise SdcReplayError(
            f"the {label} process failed: {error.message}{detail}",
            error.hint or "See the stderr file in the report's work directory.",
        )
    return result.value or {}


def _run_in_job(
    kind: str,
    task: Callable[..., dict],
    label: str,
    arguments: dict,
    *,
    job: JobBundle,
    rank: int | None,
    work: Path,
    environment: dict[str, str],
) -> dict:
    """``task`` on rank ``rank`` of the job, on ``label``, its peers serving the collectives
    on their recorded devices: its value, or the error that stops the bisect."""
    rank = rank or 0
    labels = [label if r == rank else part.device for r, part in enumerate(job.ranks)]
    require_own_gpus(labels)
    runs_step = task is not run_fetch_task or arguments.get("op_index") is not None
    job_arguments = {
        "job": str(job.path),
        "rank": rank,
        "task": task_reference(task),
        "arguments": arguments,
        "serve_until": arguments["step"] if runs_step else arguments["step"] - 1,
    }
    results = run_ranks(
        kind,
        run_rank_bisect_task,
        labels,
        lambda _: job_arguments,
        work / f"{kind}-{label.replace(':', '-')}",
        environment=environment,
        timeout=progress_timeout(job.rank(rank)),
    )
    failure = ranks_failure(f"the {kind} run of rank {rank} on {label}", results)
    if failure is not None:
        raise failure
    return results[rank].value or {}


def _trees_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(words(a), words(b))
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_trees_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_trees_equal(a[k], b[k]) for k in a)
    return a == b


def _input_at(args: tuple, origin: dict):
    value = args[origin["position"]]
    return value if origin["element"] is None else value[origin["element"]]


def _upstream(case: OperatorCase, origins: list[dict], state_differs: list[str]) -> dict | None:
    """The first input of the call that differed, where it came from, and when it went wrong.

    Every call before the first divergent one matched the reference, so a
    wrong input whose producer's output matched when produced (or whose state
    tensor entered the step right) was corrupted *at rest*, in memory between
    the write and this read. An input that was state which already differed
    entering the step is the ``state`` evidence instead.
    """
    suspect_args = case.suspect_args
    if suspect_args is None:
        return None
    differing = [
        o for o in origins if not _trees_equal(_input_at(case.args, o), _input_at(suspect_args, o))
    ]
    if not differing:
        return None
    first, site = differing[0], case.site
    producer, state = first["producer"], first["state"]
    reader = {"index": site.index, "op": site.op, "module": site.module, "phase": site.phase}
    if producer:
        at_rest = bool(producer["matched_reference"])
    else:
        at_rest = state is not None and state not in state_differs
    element = "" if first["element"] is None else f"[{first['element']}]"
    read = (
        f"call {site.index} ({site.op} under {site.module}, {site.phase}) read it wrong "
        f"as input {first['position']}{element} ({first['name']})"
    )
    if producer:
        how = "right" if producer["matched_reference"] else "wrong"
        made = (
            f"call {producer['index']} ({producer['op']} under {producer['module']}, "
            f"{producer['phase']}) produced it {how}"
        )
    else:
        how = "right" if at_rest else "already wrong"
        made = (
            f"it entered the step as {state}, {how}"
            if state
            else "no operator call of the step wrote it (an input of the step?)"
        )
    summary = f"{'memory corrupted at rest: ' if at_rest else ''}{made}; {read}"
    forensics = element_forensics(_input_at(case.args, first), _input_at(suspect_args, first))
    evidence = ("count", "total", "indices", "positions", "xor", "bits", "pattern", "fault_model")
    return {
        "at_rest": at_rest,
        "summary": summary,
        "input": {key: first[key] for key in ("position", "element", "name")},
        "producer": producer,
        "state": state,
        "reader": reader,
        "inputs_differ": [
            o["name"] + ("" if o["element"] is None else f"[{o['element']}]") for o in differing
        ],
        "elements": {k: forensics.get(k) for k in evidence},
    }


def _first_differing_output(case: OperatorCase) -> tuple[int, dict]:
    expected = [v for v in case.expected if isinstance(v, torch.Tensor)]
    actual = [v for v in case.actual if isinstance(v, torch.Tensor)]
    for index, (e, a) in enumerate(zip(expected, actual)):
        report = element_forensics(e, a)
        if report.get("count") != 0:
            return index, report
    return 0, {"count": 0}


def _state_forensics(work: Path, suspect: str, names: list[str]) -> list[dict]:
    if not names:
        return []
    found = []
    with (
        h5py.File(work / f"state-{suspect.replace(':', '-')}.h5") as mine,
        h5py.File(work / "state-reference.h5") as theirs,
    ):
        for name in names:
            key = name.replace("/", "|")
            report = element_forensics(read_tensor(theirs[key]), read_tensor(mine[key]))
            found.append(
                {
                    "tensor": name,
                    **{
                        k: report.get(k)
                        for k in (
                            "count",
                            "indices",
                            "positions",
                            "xor",
                            "expected",
                            "actual",
                            "bits",
                            "pattern",
                            "fault_model",
                        )
                    },
                }
            )
    return found


def _finish(out: Path, data: dict, on_event) -> BisectResult:
    (out / REPORT_FILE).write_text(json.dumps(data, indent=2, default=str))
    on_event("done", f"report written to {out}")
    return BisectResult.from_json(data)


def _command_line() -> str:
    argv = sys.argv[:]
    if argv and argv[0].endswith("sdcreplay"):
        argv[0] = "sdcreplay"
    return " ".join(shlex.quote(a) for a in argv)
