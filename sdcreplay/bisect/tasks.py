"""What runs inside a bisect's device processes: the operator-level replay of the step, the
reference's copy of one call, and that call re-run alone on the suspect.

Each device is its own process, so these functions are `device_task`s a task file names
(`replay.worker`); the driver (`localize.py`) starts them and reads only the JSON they return
and the files they write in the work directory. Every run after the reference's first starts
from the state the reference saved entering the step (`_enter_step`), or from the window's start
where that state does not reproduce the step (`_reference_oplog`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py
import torch

from ..bundle.manifest import StepRecord
from ..bundle.reader import Bundle
from ..capture import determinism
from ..capture.collectives import issued_in_step
from ..capture.determinism import restore_operator_rng
from ..capture.digest import tensor_digest
from ..capture.faults import Injector, parse_specs
from ..capture.kernel_log import KernelCount
from ..capture.memory import storage_address
from ..capture.operators import (
    CallSite,
    InputOrigin,
    OperatorLog,
    OperatorRecord,
    operator_results,
    state_tensors,
)
from ..devices import torch_device
from ..errors import SdcReplayError
from ..replay.session import ReplaySession
from ..replay.worker import device_task
from ..storage.tensorio import write_tensor
from .kernels import kernel_names
from .operator_case import OperatorCase, place, resolve_op


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


class MessagesBefore:
    """An operator and kernel observer: how many collective messages the step had issued when
    call ``index`` ran (None outside a job's rank), so a report can name the collectives
    around it."""

    def __init__(self, index: int | None):
        self.index = index
        self.count: int | None = None

    def _note(self, index: int) -> None:
        if index == self.index and self.count is None:
            self.count = issued_in_step()

    def on_call(self, site: CallSite, func, args, kwargs, out):
        self._note(site.index)
        return out

    def on_kernel(self, call) -> None:
        self._note(call.site.index)


def _records_to_json(records: list[OperatorRecord]) -> list:
    return [[r.site.phase, r.site.module, r.site.op, r.digests] for r in records]


def _records_from_json(rows: list, step: int) -> list[OperatorRecord]:
    return [
        OperatorRecord(CallSite(step, phase, module, op, index), digests)
        for index, (phase, module, op, digests) in enumerate(rows)
    ]


@dataclass
class _LoggedStep:
    """The bisected step run once at the operator level, from where its `StepEntry` put it."""

    entry: StepEntry
    oplog: OperatorLog
    kernels: KernelCount
    entries: list[tuple[str, str]]  # its signature
    differing: list[str]  # state entering it that differs from the reference's


def _logged_step(
    bundle: str,
    device: str,
    inject: Sequence[str],
    step: int,
    repeat: int,
    work: Path,
    expected: dict | None,
    **entry: str | None,
) -> _LoggedStep:
    """Enter the step (``entry``: `_enter_step`'s ``entry_state`` and ``save_entry``) and run
    it with the operator log, compared with ``expected`` (the reference's) as it runs."""
    came = _enter_step(bundle, device, inject, step, repeat, **entry)
    reference = _records_from_json(expected["operators"], step) if expected else None
    addresses = {storage_address(t): name for name, t in came.state.items()}
    oplog = OperatorLog(
        expected=reference,
        state_memory={address: name for address, name in addresses.items() if address},
    )
    kernels = KernelCount()
    try:
        differing = [
            n for n, d in came.digests.items() if expected and expected["state"].get(n) != d
        ]
        _save_state(work / f"state-{device.replace(':', '-')}.h5", came.state, differing)
        entries = came.session.run_step(came.target, observers=[oplog], kernel_observers=[kernels])
    finally:
        came.session.close()
    return _LoggedStep(came, oplog, kernels, entries, differing)


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
    if not expected_log:
        return _reference_oplog(device, bundle, step, work, inject, save_entry, entry_state)
    expected = json.loads(Path(expected_log).read_text())
    steps_run = 0
    for repeat in range(repeats):
        ran = _logged_step(
            bundle, device, inject, step, repeat, work, expected, entry_state=entry_state
        )
        oplog, steps_run = ran.oplog, steps_run + ran.entry.window_steps + 1
        environment = determinism.environment(ran.entry.session.device)
        structure_error = oplog.structure_error or _missing_calls(oplog, expected["operators"])
        if structure_error:
            return {
                "structure_error": structure_error,
                "repeat": repeat,
                "environment": environment,
                "steps_run": steps_run,
            }
        if oplog.divergent is not None or ran.differing:
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
                "state_differs": ran.differing,
                "case": str(case_path) if oplog.kept is not None else None,
                "origins": [_origin_to_json(o, expected["operators"]) for o in oplog.origins],
            }
    return {"divergent": False, "repeats_run": repeats, "steps_run": steps_run}


def _reference_oplog(
    device: str,
    bundle: str,
    step: int,
    work: Path,
    inject: Sequence[str],
    save_entry: str | None,
    entry_state: str | None,
) -> dict:
    """The reference's operator log of the step, and where every later run starts it.

    Saving the state entering the step (``save_entry``), the reference runs the step on from
    the window and again from that saved state. Where the two differ, the step depends on
    state the bundle's objects do not hold (a loop's Python counter): the log is taken from the
    window's start instead, as replay runs it, the saved state is removed, and ``start`` says
    that every later run replays the window too (`start_from_window`)."""
    ran = _logged_step(
        bundle, device, inject, step, 0, work, None, entry_state=entry_state, save_entry=save_entry
    )
    steps_run, start = ran.entry.window_steps + 1, None
    continuation = ran.entry.continuation
    if continuation is not None and ran.entries != continuation:
        unreproduced = _first_other_entry(continuation, ran.entries)
        ran = _logged_step(bundle, device, inject, step, 0, work, None)
        steps_run += ran.entry.window_steps + 1
        script = ran.entry.session.script is not None
        if ran.entries != continuation:
            _refuse_unreproduced(
                step,
                f"{_first_other_entry(continuation, ran.entries)} (and from the state saved "
                f"entering it, {unreproduced})",
                script=script,
                from_window=True,
            )
        assert save_entry is not None
        Path(save_entry).unlink()
        start = start_from_window(step, unreproduced, ran.entry.window_steps, script=script)
    path = work / "oplog-reference.json"
    path.write_text(
        json.dumps({"state": ran.entry.digests, "operators": _records_to_json(ran.oplog.records)})
    )
    return {
        "oplog": str(path),
        "operators": len(ran.oplog.records),
        "environment": determinism.environment(ran.entry.session.device),
        "steps_run": steps_run,
        "kernel_calls": ran.kernels.calls,  # compiled code ran: the kernel stage's cue
        "start": start,
    }


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
    oplog, messages = OperatorLog(watch=op_index), MessagesBefore(op_index)
    entry = _enter_step(bundle, device, inject, step, 0, entry_state=entry_state)
    try:
        _save_state(Path(work_dir) / "state-reference.h5", entry.state, state_names)
        if op_index is not None:
            entry.session.run_step(entry.target, observers=[oplog, messages])
    finally:
        entry.session.close()
    steps_run = entry.window_steps + (op_index is not None)
    if expected_log and op_index is not None:
        expected = json.loads(Path(expected_log).read_text())
        _check_reproduced(
            expected,
            entry.digests,
            oplog,
            step,
            script=entry.session.script is not None,
            from_window=entry_state is None,
        )
    if oplog.kept is None or op_index is None:  # only a watched call is kept
        return {"case": None, "steps_run": steps_run}
    args, kwargs, outputs = oplog.kept
    path = Path(work_dir) / "reference-call.h5"
    site = oplog.records[op_index].site
    prior = Counter(r.site.key for r in oplog.records[:op_index])
    OperatorCase(site, prior, args, kwargs, outputs, outputs, rng=oplog.rng_before).write(path)
    return {"case": str(path), "steps_run": steps_run, "messages_before": messages.count}


def _check_reproduced(
    expected: dict,
    state_digests: dict,
    oplog: OperatorLog,
    step: int,
    *,
    script: bool = False,
    from_window: bool = False,
) -> None:
    """The reference's run from the saved state (``from_window``: from the window's start) made
    its first run's calls with its outputs (``script``: a script-mode bundle's words)."""
    rows = expected["operators"]
    saved = expected["state"]
    differing = sorted(n for n in {*saved, *state_digests} if saved.get(n) != state_digests.get(n))
    if differing:
        _refuse_unreproduced(
            step,
            f"the state entering it is not the state the first run entered it with "
            f"({differing[0]})",
            script=script,
            from_window=from_window,
        )
    for record, row in zip(oplog.records, rows):
        site, (phase, module, op, digests) = record.site, row
        if site.key != (op, module, phase):
            raise SdcReplayError(
                f"the reference does not run the same operators twice in step {step}: operator "
                f"call {site.index}: {site.op} under {site.module} ({site.phase}) now, "
                f"{op} under {module} ({phase}) the first time",
                UNSTEADY_STEP,
            )
        if record.digests != digests:
            _refuse_unreproduced(
                step,
                f"operator call {site.index} ({site.op} under {site.module}, {site.phase}) "
                "gives other outputs",
                script=script,
                from_window=from_window,
            )
    if len(oplog.records) != len(rows):
        raise SdcReplayError(
            f"the reference does not run the same operators twice in step {step}: "
            f"{len(oplog.records)} operator calls now, {len(rows)} the first time",
            UNSTEADY_STEP,
        )


UNSTEADY_STEP = (
    "No kernel choice differs between two runs on one device: the step takes another path "
    "from run to run, through a branch on something the bundle does not hold (the time, the "
    "environment, a counter outside the state objects) or through work on another thread "
    "(a callback, a data loader worker). Make the step depend only on its batch and state "
    "(docs/recording.md); this says nothing about the device's arithmetic."
)
"""Why one kind of device runs other operators in the same step: the step, not a kernel."""


def _first_other_entry(first: list[tuple[str, str]], again: list[tuple[str, str]]) -> str:
    """The first signature entry the step run from the saved state gives otherwise."""
    for (name, digest), (name_again, digest_again) in zip(first, again):
        if (name, digest) != (name_again, digest_again):
            return f"its signature entry {name} differs"
    return f"it has {len(again)} signature entries, {len(first)} the first time"


def _refuse_unreproduced(
    step: int, difference: str, *, script: bool = False, from_window: bool = False
) -> None:
    """A later run must start the step where the first did: the saved state (``from_window``:
    the window's start) must be all the step depends on."""
    where = "from the window's start" if from_window else "from the state saved entering it"
    raise SdcReplayError(
        f"the reference does not reproduce its own step {step} {where}: {difference}",
        unreproduced_hint(script),
    )


def unreproduced_hint(script: bool) -> str:
    """What to give the Recorder (``script``: a script-mode loop's) so that the state saved
    entering a step is all the step depends on."""
    if not script:
        return (
            "The step depends on state outside the model, optimizer and the workload's state "
            "objects (a Python counter?); give it to the workload as a state object "
            "(docs/recording.md), since bisect starts the step from what the saved state holds."
        )
    return (
        "The step depends on state the Recorder was not given: something the loop keeps "
        "between steps outside torch, such as a Python counter that decides whether a "
        "micro-batch steps the optimizer (Accelerate's accelerator.step). Pass it in the "
        "Recorder's state= (an object with state_dict() and load_state_dict()), and enter "
        "rec.step() before whatever advances it (`with rec.step(), accelerator.accumulate("
        "model):`, not the other way round), so that the state saved entering a step holds "
        "it (docs/porting.md)."
    )


def start_from_window(step: int, why: str, window_steps: int, *, script: bool) -> dict:
    """Where bisect's later runs start step ``step`` when the state saved entering it does not
    reproduce it (``why``): the window's start, as replay does; the report's ``start``."""
    warning = (
        f"step {step} does not reproduce from the state saved entering it ({why}), so every "
        f"later run of it starts from the window's start, as replay does, and replays the "
        f"{window_steps} step(s) before it. " + unreproduced_hint(script)
    )
    return {"from": "window", "steps_before": window_steps, "reason": why, "warning": warning}


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
