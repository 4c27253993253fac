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
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py
import torch

from . import determinism
from .bundle import Bundle, StepRecord
from .capture import (
    CallSite,
    InputOrigin,
    OperatorLog,
    OperatorRecord,
    memory_address,
    operator_results,
    state_tensors,
)
from .compare import RECORD, Divergence, compare_logs
from .determinism import restore_operator_rng
from .devices import torch_device, validate_label
from .digest import tensor_digest
from .errors import SdcReplayError, StructureError
from .faults import Injector, parse_specs
from .operator_case import OPERATOR_FILE, OperatorCase, place, resolve_op
from .replay import ReplaySession, replay_devices, run_device_processes
from .signature import SignatureLog, layer_of
from .tensorio import raw_bits, read_tensor, write_tensor

REPORT_FILE = "report.json"
STATE_FILE = "state.h5"
ENTRY_STATE_FILE = "state-entering-step.h5"
SCHEMA = "sdcreplay.bisect/1"


# ---------------------------------------------------------------------------
# Worker side: each function runs in a device process (see worker.py).

@dataclass
class StepEntry:
    """A session in the state entering the bisected step, that state, and the step's record."""

    session: ReplaySession
    digests: dict[str, str]  # state name -> digest, after this device's own faults before the step
    state: dict[str, torch.Tensor]
    target: StepRecord
    window_steps: int  # steps of the window this process replayed to get here (0: loaded)
    continuation: list[tuple[str, str]] | None = None  # the step run on from the window itself


def _enter_step(task: dict, repeat: int) -> StepEntry:
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
        return ReplaySession(task["bundle"], task["device"], inject=task.get("inject", ()),
                             repeat=repeat)

    session = new_session()
    step, window_steps, continuation = task["step"], 0, None
    try:
        target = next((r for r in session.bundle.steps if r.index == step), None)
        if target is None:
            raise SdcReplayError(f"the bundle has no step {step}",
                                 f"Steps: {session.bundle.step_indices}.")
        if task.get("entry_state"):
            session.load_state(Path(task["entry_state"]))
        else:
            for record in session.steps_until(step - 1):
                session.run_step(record)
                window_steps += 1
            if task.get("save_entry"):
                # The reference runs the step in a session fresh from the saved state, like every
                # later run: objects that build tensors lazily (a GradScaler's scale) then call
                # the same operators.
                session.save_state(Path(task["save_entry"]))
                continuation = session.run_step(target)
                window_steps += 1
                session.close()
                session = new_session()
                session.load_state(Path(task["save_entry"]))
    except BaseException:
        session.close()
        raise
    session.injector.before_step(step, session.model)  # memory corrupted before the step belongs to its state
    state = state_tensors(session.model, session.optimizer)
    digests = {name: tensor_digest(tensor) for name, tensor in state.items()}
    return StepEntry(session, digests, state, target, window_steps, continuation)


def _records_to_json(records: list[OperatorRecord]) -> list:
    return [[r.site.phase, r.site.module, r.site.op, r.digests] for r in records]


def _records_from_json(rows: list, step: int) -> list[OperatorRecord]:
    return [OperatorRecord(CallSite(step, phase, module, op, index), digests)
            for index, (phase, module, op, digests) in enumerate(rows)]


def run_oplog_task(task: dict) -> dict:
    """Reference: write the step's operator log. Suspect: compare and keep the first divergence."""
    step, work = task["step"], Path(task["work_dir"])
    expected = json.loads(Path(task["expected"]).read_text()) if task.get("expected") else None
    repeats = task.get("repeats", 1) if expected else 1
    steps_run = 0
    for repeat in range(repeats):
        entry = _enter_step(task, repeat)
        session, digests, state, target = entry.session, entry.digests, entry.state, entry.target
        steps_run += entry.window_steps + 1
        reference = _records_from_json(expected["operators"], step) if expected else None
        oplog = OperatorLog(expected=reference,
                            state_memory={memory_address(t): name for name, t in state.items()})
        try:
            differing = [n for n, d in digests.items() if expected and expected["state"].get(n) != d]
            _save_state(work / f"state-{task['device'].replace(':', '-')}.h5", state, differing)
            entries = session.run_step(target, observers=[oplog])
        finally:
            session.close()
        if entry.continuation is not None and entries != entry.continuation:
            _refuse_unreproduced(step)
        environment = determinism.environment(session.device)
        if expected is None:
            path = work / "oplog-reference.json"
            path.write_text(json.dumps({"state": digests, "operators": _records_to_json(oplog.records)}))
            return {"oplog": str(path), "operators": len(oplog.records), "environment": environment,
                    "steps_run": steps_run}
        structure_error = oplog.structure_error or _missing_calls(oplog, expected["operators"])
        if structure_error:
            return {"structure_error": structure_error, "repeat": repeat, "steps_run": steps_run}
        if oplog.divergent is not None or differing:
            case_path = work / "suspect-call.h5"
            if oplog.kept is not None:
                args, kwargs, outputs = oplog.kept
                OperatorCase(oplog.divergent.site, Counter(), args, kwargs, outputs, outputs).write(case_path)
            return {
                "divergent": True, "repeat": repeat, "repeats_run": repeat + 1, "environment": environment,
                "steps_run": steps_run,
                "op_index": oplog.divergent.site.index if oplog.divergent else None,
                "state_differs": differing, "case": str(case_path) if oplog.kept is not None else None,
                "origins": [_origin_to_json(o, expected["operators"]) for o in oplog.origins],
            }
    return {"divergent": False, "repeats_run": repeats, "steps_run": steps_run}


def _origin_to_json(origin: InputOrigin, expected: list) -> dict:
    """One input of the divergent call; did its producer's output match the reference's?"""
    producer = None
    if origin.producer is not None:
        site = origin.producer.site
        producer = {"index": site.index, "op": site.op, "module": site.module, "phase": site.phase,
                    "matched_reference": origin.producer.digests == expected[site.index][3]}
    return {"position": origin.position, "element": origin.element, "name": origin.name,
            "producer": producer, "state": origin.state}


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


def run_fetch_task(task: dict) -> dict:
    """Reference: keep the inputs and outputs of one call, and named state tensors.

    Given the reference's own operator log (``expected``), the run from the
    loaded state must reproduce it call for call: otherwise the saved state
    was not all the step depends on, and no later comparison could be trusted.
    """
    oplog = OperatorLog(watch=task["op_index"])
    entry = _enter_step(task, 0)
    try:
        _save_state(Path(task["work_dir"]) / "state-reference.h5", entry.state,
                    task.get("state_names", []))
        if task["op_index"] is not None:
            entry.session.run_step(entry.target, observers=[oplog])
    finally:
        entry.session.close()
    steps_run = entry.window_steps + (task["op_index"] is not None)
    if task.get("expected") and task["op_index"] is not None:
        expected = json.loads(Path(task["expected"]).read_text())
        _check_reproduced(expected, entry.digests, oplog, task["step"])
    if oplog.kept is None:
        return {"case": None, "steps_run": steps_run}
    args, kwargs, outputs = oplog.kept
    path = Path(task["work_dir"]) / "reference-call.h5"
    site = oplog.records[task["op_index"]].site
    prior = Counter(r.site.key for r in oplog.records[: task["op_index"]])
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
        "(docs/recording.md), since bisect starts the step from what the saved state holds.")


def run_isolate_task(task: dict) -> dict:
    """Suspect: run the one call alone from the reference's inputs, ``runs`` times."""
    bundle = Bundle.open(task["bundle"])
    determinism.apply(bundle.manifest.determinism.to_json())
    device = torch_device(task["device"])
    case = OperatorCase.read(Path(task["case"]))
    op = resolve_op(case.op)
    injector = Injector(parse_specs(task.get("inject", ())), task["device"], salt=task.get("salt", 0))
    expected = [tensor_digest(v) for v in place(case.expected, device)]
    failures, first_failure = 0, None
    for run in range(task["runs"]):
        args, kwargs = place((list(case.args), case.kwargs), device)
        restore_operator_rng(case.rng, device)
        out = op(*args, **kwargs)
        injector.on_isolated_call(case.site, case.prior, out)
        if [tensor_digest(v) for v in operator_results(op, args, out)] != expected:
            failures += 1
            first_failure = run if first_failure is None else first_failure
    return {"runs": task["runs"], "failures": failures, "first_failure": first_failure,
            "kernels": kernel_names(op, case, device)}


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
# Forensics: which elements, which bits, what shape the damage has.

def _words(tensor: torch.Tensor) -> torch.Tensor:
    return raw_bits(tensor.contiguous()).reshape(-1).to(torch.int64)


def element_forensics(expected: torch.Tensor, actual: torch.Tensor, shown: int = 16) -> dict:
    """Differing elements (bitwise), their XOR masks, flipped-bit histogram and pattern."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return {"count": None, "note": f"shape/dtype differ: {tuple(expected.shape)} {expected.dtype} vs {tuple(actual.shape)} {actual.dtype}"}
    width = 8 * expected.element_size()
    xor = _words(expected) ^ _words(actual)
    if width < 64:
        xor &= (1 << width) - 1
    indices = torch.nonzero(xor).flatten()
    masks = xor[indices]
    histogram = Counter()
    for bit in range(width):
        flipped = int(((masks >> bit) & 1).sum()) if bit < 63 else int((masks < 0).sum())
        if flipped:
            histogram[bit] = flipped
    flat_e, flat_a = expected.reshape(-1), actual.reshape(-1)
    chosen = indices[:shown]
    result = {
        "count": int(indices.numel()),
        "total": int(expected.numel()),
        "indices": [int(i) for i in chosen],
        "positions": [list(_unravel(int(i), expected.shape)) for i in chosen],
        "xor": [f"{int(m) & ((1 << width) - 1):0{width // 4}x}" for m in masks[:shown]],
        "expected": [_value(flat_e[i]) for i in chosen],
        "actual": [_value(flat_a[i]) for i in chosen],
        "bits": {"width": width, "histogram": {str(b): n for b, n in sorted(histogram.items())}},
        "dtype": str(expected.dtype).removeprefix("torch."),
        "shape": list(expected.shape),
    }
    if expected.is_floating_point() and indices.numel():
        e, a = flat_e[indices].double(), flat_a[indices].double()
        diff = (e - a).abs()
        result["max_abs_diff"] = _number(diff.max())
        result["max_rel_diff"] = _number((diff / e.abs().clamp_min(torch.finfo(torch.float64).tiny)).max())
    else:
        result["max_abs_diff"] = _number((flat_e[indices].double() - flat_a[indices].double()).abs().max()) if indices.numel() else 0.0
    result["pattern"] = _pattern(indices, masks, expected, actual)
    return result


def _value(scalar: torch.Tensor):
    value = scalar.item()
    return _number(value) if isinstance(value, float) else value


def _number(value) -> float | str:
    value = float(value)
    return value if value == value and abs(value) != float("inf") else str(value)


def _unravel(flat: int, shape) -> tuple[int, ...]:
    position = []
    for size in reversed(list(shape)):
        position.append(flat % size)
        flat //= size
    return tuple(reversed(position))


def _pattern(indices: torch.Tensor, masks: torch.Tensor, expected: torch.Tensor, actual: torch.Tensor) -> str:
    """A word for the set of differing elements, as a vendor would describe it."""
    count = indices.numel()
    if count == 0:
        return "none"
    if count == 1:
        return "single element"
    flat_e, flat_a = expected.reshape(-1), actual.reshape(-1)
    if count == 2:
        i, j = int(indices[0]), int(indices[1])
        if _words(flat_a[i:i + 1]).equal(_words(flat_e[j:j + 1])) and _words(flat_a[j:j + 1]).equal(_words(flat_e[i:i + 1])):
            return "two elements swapped"
        if int(masks[0]) == int(masks[1]):
            return "two elements, same bit"
    columns = expected.shape[-1] if expected.dim() else 1
    rows, cols = indices // columns, indices % columns
    one_row, one_column = rows.unique().numel() == 1, cols.unique().numel() == 1
    height = int(rows.max() - rows.min()) + 1
    width = int(cols.max() - cols.min()) + 1
    if one_row and width == count:
        return "row segment"
    if one_column and height == count:
        return "column segment"
    if height * width == count:
        return f"block {height}x{width}"
    steps = (indices[1:] - indices[:-1]).unique()
    if count > 2 and steps.numel() == 1:  # checked before "one row": a 1-D tensor is all one row
        return f"strided (every {int(steps[0])} elements)"
    if one_row:
        return "scattered in one row"
    if one_column:
        return "scattered in one column"
    return "scattered"


# ---------------------------------------------------------------------------
# Orchestration.

class BisectResult:
    """The report: ``to_json()`` is what ``--json`` prints and report.json holds."""

    def __init__(self, data: dict):
        self.data = data

    @property
    def exit_code(self) -> int:
        return 1 if self.data["verdict"] == "divergence" else 0

    def to_json(self) -> dict:
        return self.data


def _first_divergent_step(bundle: Bundle, suspect: str | None, reference: str, repeats: int,
                          inject: Sequence[str], work: Path, on_event) -> tuple[int | None, dict]:
    """Replay the bundle; the first entry where the suspect (or the recording) leaves the reference.

    The reference is trusted by definition, so the suspect is compared with it
    directly, not through a majority vote: with the recording and one device
    there is no majority, and a recording made on the suspect would outvote
    the reference.
    """
    labels = [reference] + ([suspect] if suspect else [])
    on_event("replay", f"replaying the window on {', '.join(labels)} to find the first divergent step")
    report = replay_devices(bundle.path, labels, repeats=repeats, inject=inject, log_dir=work / "replay")
    for run in report.devices:
        if run.error:
            raise SdcReplayError(f"the {run.device} replay failed: {run.error['message']}",
                                 run.error.get("hint") or "See the device's stderr in the work directory.")
    runs = {run.device: run for run in report.devices}
    trusted = runs[reference].logs[0]
    record_first = _first_divergence(trusted, [bundle.signature_log()])
    first = record_first if suspect is None else _first_divergence(trusted, runs[suspect].logs)
    return (first.step if first else None), {
        "replay": report.to_json(), "first_entry": first.brief() if first else None,
        "record_first_entry": record_first.brief() if record_first else None,
        "steps_run": _total({"replay": sum(len(log.steps) for r in report.devices
                                           for log in r.logs)}),
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
    opened = Bundle.open(bundle)
    if step is not None and step not in opened.step_indices:
        raise SdcReplayError(f"the bundle has no step {step} (it has steps {opened.step_indices})",
                             "Give --step one of the recorded steps "
                             "(`sdcreplay info BUNDLE` lists them).")
    reference = validate_label(reference)
    suspect = validate_label(suspect) if suspect else None
    if suspect == reference:
        raise SdcReplayError("--suspect and --reference are the same device",
                             "Compare the suspect with a device you trust, e.g. --reference cpu:0.")
    if plot is not None:
        _plotter()
    out = Path(out) if out else opened.path.with_name(opened.path.name + ".bisect")
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    (out / OPERATOR_FILE).unlink(missing_ok=True)  # a report never shows an earlier run's call
    base = {
        "schema": SCHEMA, "bundle": str(opened.path), "suspect": suspect or RECORD, "reference": reference,
        "inject": list(inject), "workload": opened.manifest.workload.to_json(), "report": str(out),
        "determinism": opened.manifest.determinism.to_json(),
        "commands": [_command_line()],
    }
    replayed: dict = {}
    if step is None or suspect is None:
        found, replayed = _first_divergent_step(opened, suspect, reference, repeats, inject, work, on_event)
        step = found if step is None else step
    if step is None or (suspect is None and replayed["first_entry"] is None):
        result = {**base, "verdict": "no_divergence", "step": step, "repeats_run": repeats, **replayed}
        recorded = replayed.get("record_first_entry")
        if suspect is not None and recorded is not None:
            result["next"] = (f"{suspect} reproduces {reference}, but the recording differs from {reference} at step "
                              f"{recorded['step']} {recorded['name']}: the device that recorded ({opened.manifest.device} on "
                              f"{opened.manifest.environment.host}) is the suspect; bisect with --suspect set to it.")
        return _finish(out, result, on_event)
    if suspect is None:
        entry = replayed["first_entry"]
        return _finish(out, {
            **base, "verdict": "divergence", "step": entry["step"], "phase": entry["phase"],
            "module": layer_of(entry["name"]), "entry": entry["name"], "op": None, "isolated": None,
            "repeats_run": 1,
            "next": f"The recording diverges from {reference} at {entry['name']}; to name the operator, "
                    f"bisect again with --suspect set to the device that recorded ({opened.manifest.device} on "
                    f"{opened.manifest.environment.host}).",
            **replayed,
        }, on_event)

    common = {"bundle": str(opened.path), "step": step, "inject": list(inject), "work_dir": str(work)}
    entry_state = str(work / ENTRY_STATE_FILE)
    on_event("oplog", f"operator-level replay of step {step} on {reference}")
    ref_log = _one(run_device_processes(
        "oplog", [reference], lambda _: {**common, "save_entry": entry_state}, work), reference)
    common["entry_state"] = entry_state  # every later run starts from the state entering the step
    on_event("oplog", f"operator-level replay of step {step} on {suspect} (up to {repeats} repeats)")
    sus = _one(run_device_processes("oplog", [suspect], lambda _: {**common, "expected": ref_log["oplog"], "repeats": repeats}, work), suspect)
    steps = {"replay": replayed.pop("steps_run", {}).get("replay", 0),
             "oplog_reference": ref_log["steps_run"], "oplog_suspect": sus["steps_run"]}
    if "structure_error" in sus:
        raise StructureError(
            f"{suspect} runs a different sequence of operators than {reference} in step {step}: {sus['structure_error']}",
            "The devices run different code or configuration (different kernels chosen?); this is not silent data corruption.",
        )
    if not sus["divergent"]:
        return _finish(out, {**base, "verdict": "no_divergence", "step": step,
                             "repeats_run": sus["repeats_run"], "steps_run": _total(steps),
                             **replayed},
                       on_event)

    on_event("fetch", f"fetching the reference's inputs of the divergent call from {reference}")
    fetched = _one(run_device_processes("fetch", [reference], lambda _: {
        **common, "op_index": sus["op_index"], "state_names": sus["state_differs"],
        "expected": ref_log["oplog"]}, work), reference)
    steps["fetch"] = fetched["steps_run"]
    state_report = _state_forensics(work, suspect, sus["state_differs"])
    result = {**base, "verdict": "divergence", "step": step, "repeats_run": sus["repeats_run"],
              "steps_run": _total(steps), "state": state_report, **replayed}
    if fetched["case"] is None:
        result.update(phase="state", module=state_report[0]["tensor"] if state_report else None, op=None,
                      op_index=None, isolated="upstream", kernels=[])
        return _finish(out, result, on_event)

    reference_case = OperatorCase.read(Path(fetched["case"]))
    suspect_case = OperatorCase.read(Path(sus["case"]))
    case = OperatorCase(reference_case.site, reference_case.prior, reference_case.args, reference_case.kwargs,
                        reference_case.expected, suspect_case.actual, suspect_case.args, suspect_case.kwargs,
                        rng=reference_case.rng)
    case.write(out / OPERATOR_FILE)
    runs = isolation_runs or max(repeats, 3)
    on_event("isolate", f"re-running {case.op} alone on {suspect} from {reference}'s inputs ({runs} runs)")
    isolated = _one(run_device_processes("isolate", [suspect], lambda _: {
        "bundle": str(opened.path), "case": str(out / OPERATOR_FILE), "inject": list(inject), "runs": runs}, work), suspect)
    output_index, forensics = _first_differing_output(case)
    inputs_equal = _trees_equal((case.args, case.kwargs), (case.suspect_args, case.suspect_kwargs))
    verdict = "kernel" if isolated["failures"] else ("intermittent" if inputs_equal else "upstream")
    site = case.site
    result.update(
        phase=site.phase, module=site.module, op=site.op, op_index=site.index, output_index=output_index,
        kernels=isolated["kernels"], isolated=verdict,
        isolation={"runs": isolated["runs"], "failures": isolated["failures"], "first_failure": isolated["first_failure"]},
        inputs_match_reference=inputs_equal,
        elements={k: forensics.get(k) for k in ("count", "total", "indices", "positions", "xor", "expected", "actual",
                                                 "max_abs_diff", "max_rel_diff", "dtype", "shape")},
        bits=forensics.get("bits"), pattern=forensics.get("pattern"),
        site=asdict(site), prior_calls=[[*key, n] for key, n in case.prior.items()],
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
        result["plot"] = str(plot_element_heatmap(expected, actual, Path(plot), f"{site.op} under {site.module} ({site.phase}), step {step}"))
    return _finish(out, result, on_event)


def _total(steps: dict[str, int]) -> dict[str, int]:
    """Training steps each stage executed, and in all: what a bisect costs."""
    return {**steps, "total": sum(steps.values())}


def _plotter():
    """The heatmap function, checked before any work is done (it draws only at the end)."""
    hint = "Install the plot extra (pip install 'sdcreplay[plot]'), or leave out --plot."
    try:
        from .plot import plot_element_heatmap
    except ImportError as exc:
        raise SdcReplayError(f"--plot is not available here: {exc}", hint) from exc
    if importlib.util.find_spec("matplotlib") is None:
        raise SdcReplayError("--plot needs matplotlib, which is not installed", hint)
    return plot_element_heatmap


def _one(results: dict, label: str) -> dict:
    result = results[label]
    if "error" in result:
        error = result["error"]
        detail = f": {error['stderr_tail'].splitlines()[-1]}" if error.get("stderr_tail") else ""
        raise SdcReplayError(f"the {label} process failed: {error['message']}{detail}",
                             error.get("hint") or "See the stderr file in the report's work directory.")
    return result


def _trees_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_words(a), _words(b)))
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
    differing = [o for o in origins if case.suspect_args is not None
                 and not _trees_equal(_input_at(case.args, o), _input_at(case.suspect_args, o))]
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
    read = (f"call {site.index} ({site.op} under {site.module}, {site.phase}) read it wrong "
            f"as input {first['position']}{element} ({first['name']})")
    if producer:
        how = "right" if producer["matched_reference"] else "wrong"
        made = (f"call {producer['index']} ({producer['op']} under {producer['module']}, "
                f"{producer['phase']}) produced it {how}")
    else:
        how = "right" if at_rest else "already wrong"
        made = (f"it entered the step as {state}, {how}" if state
                else "no operator call of the step wrote it (an input of the step?)")
    summary = f"{'memory corrupted at rest: ' if at_rest else ''}{made}; {read}"
    forensics = element_forensics(_input_at(case.args, first), _input_at(case.suspect_args, first))
    return {
        "at_rest": at_rest, "summary": summary,
        "input": {key: first[key] for key in ("position", "element", "name")},
        "producer": producer, "state": state, "reader": reader,
        "inputs_differ": [o["name"] + ("" if o["element"] is None else f"[{o['element']}]")
                          for o in differing],
        "elements": {k: forensics.get(k)
                     for k in ("count", "total", "indices", "positions", "xor", "bits", "pattern")},
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
    with h5py.File(work / f"state-{suspect.replace(':', '-')}.h5") as mine, h5py.File(work / "state-reference.h5") as theirs:
        for name in names:
            key = name.replace("/", "|")
            report = element_forensics(read_tensor(theirs[key]), read_tensor(mine[key]))
            found.append({"tensor": name, **{k: report.get(k) for k in ("count", "indices", "positions", "xor", "expected", "actual", "bits", "pattern")}})
    return found


def _finish(out: Path, data: dict, on_event) -> BisectResult:
    (out / REPORT_FILE).write_text(json.dumps(data, indent=2, default=str))
    on_event("done", f"report written to {out}")
    return BisectResult(data)


def _command_line() -> str:
    argv = sys.argv[:]
    if argv and argv[0].endswith("sdcreplay"):
        argv[0] = "sdcreplay"
    return " ".join(shlex.quote(a) for a in argv)
