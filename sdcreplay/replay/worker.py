"""Inside a device process: read the task, run the function it names, write the result.

The task and the result are JSON files (`DeviceTask`, `DeviceResult`). A task
names its function by reference (``sdcreplay.bisect.tasks:run_oplog_task``), as a
bundle names its workload; only a function of sdcreplay's own modules marked
with `device_task` runs, so a task file is data and cannot name other code.
This module knows no task: replay and bisect mark their own. Starting the
processes and watching them is `processes.py`. ``python -m sdcreplay.replay.worker
TASK.json`` runs a task by hand.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SdcReplayError, interrupt_exit_code, interrupt_signal
from ..heartbeat import HEARTBEAT

PACKAGE = "sdcreplay"
PLANTED_FAILURE_VAR = "SDCREPLAY_TEST_INTERNAL_ERROR"
"""Set to a task reference, a test makes the tool's own code fail as that task starts."""
_TASKS: dict[str, Callable[..., dict]] = {}
"""Reference (``module:function``) -> each function `device_task` marked, once its module ran."""


class TaskError(SdcReplayError):
    default_hint = "Device tasks are written by sdcreplay itself; run the command that wrote it."


def device_task(function: Callable[..., dict]) -> Callable[..., dict]:
    """Mark ``function`` as one a task may name: it takes ``device=`` and the task's arguments
    as keywords, and returns a JSON-able dict."""
    _TASKS[f"{function.__module__}:{function.__qualname__}"] = function
    return function


def task_reference(function: Callable[..., dict] | str) -> str:
    """The reference a task names ``function`` by (it must be marked with `device_task`).

    A reference given as text (``sdcreplay.replay.session:run_replay_task``) is checked
    without importing its module: a command's process that only starts device processes
    leaves torch, which a task's module imports, to them (the worker checks the mark)."""
    if isinstance(function, str):
        module, sep, name = function.partition(":")
        if not sep or not name or module.split(".")[0] != PACKAGE:
            raise TaskError(f"task function {function!r} is not one of sdcreplay's")
        if importlib.util.find_spec(module) is None:
            raise TaskError(f"no module {module} for task function {function!r}")
        return function
    reference = f"{function.__module__}:{function.__qualname__}"
    if _TASKS.get(reference) is not function:
        raise TaskError(f"{reference} is not a device task")
    return reference


def task_function(reference: str) -> Callable[..., dict]:
    """The marked function ``reference`` names; refused unless it is sdcreplay's own."""
    module, sep, name = reference.partition(":")
    if not sep or module.split(".")[0] != PACKAGE:
        raise TaskError(f"task function {reference!r} is not one of sdcreplay's")
    try:
        importlib.import_module(module)  # its device_task marks register its functions
    except ImportError as exc:
        raise TaskError(f"cannot import {module} for task function {reference!r}: {exc}") from exc
    if reference not in _TASKS:
        raise TaskError(f"{reference} is not a device task")
    return _TASKS[reference]


_TASK_FIELDS: dict[str, type | tuple[type, ...]] = {
    "function": str,
    "device": str,
    "result": str,
    "arguments": dict,
    "environment": dict,
    "stderr": (str, type(None)),
    "alive": (str, type(None)),
}
_REQUIRED = ("function", "device", "result")


def absolute_paths(value: Any) -> Any:
    """``value`` with every path in it (an ``os.PathLike``, in dicts, lists and tuples too) an
    absolute one, as a string: resolved in the directory of the process that asks."""
    if isinstance(value, os.PathLike):
        return os.path.abspath(os.fspath(value))
    if isinstance(value, dict):
        return {key: absolute_paths(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [absolute_paths(item) for item in value]
    return value


def given_forms(value: Any) -> dict[str, str]:
    """Each path in ``value`` that `absolute_paths` changes: its absolute form -> as given."""
    if isinstance(value, os.PathLike):
        given = os.fspath(value)
        absolute = os.path.abspath(given)
        return {} if given == absolute else {absolute: str(given)}
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return {}
    return {absolute: given for item in value for absolute, given in given_forms(item).items()}


def in_given_form(value: Any, forms: dict[str, str]) -> Any:
    """``value`` (what a device process returned) with every path under an absolute one of
    ``forms`` in the form the command gave it: a command speaks of its paths as typed."""
    if isinstance(value, str):
        for absolute in sorted(forms, key=len, reverse=True):
            if value == absolute or value.startswith(absolute + os.sep):
                return forms[absolute] + value[len(absolute) :]
        return value
    if isinstance(value, dict):
        return {key: in_given_form(item, forms) for key, item in value.items()}
    if isinstance(value, list):
        return [in_given_form(item, forms) for item in value]
    return value


@dataclass(frozen=True)
class DeviceTask:
    """What one device process is asked to do, and where it reports.

    Every path in it is absolute, resolved in the directory of the command that made it: a
    device process moves to the recorded directory (a script-mode workload, `replay.script`)
    before it reads the bundle or writes a result, and a path a person typed is theirs, not
    the recorded directory's. The task's own files are; its arguments' paths are those given
    as paths (``Path``, not ``str``). What it returns names them as the command gave them
    (`DeviceResult.in_given_form`): a returned path handed to another task goes as a ``Path``."""

    function: str  # a device_task reference, e.g. "sdcreplay.replay.session:run_replay_task"
    device: str
    result: str  # path of the result JSON
    arguments: dict[str, Any] = field(default_factory=dict)  # the function's keywords
    environment: dict[str, str] = field(default_factory=dict)  # set before the task runs
    stderr: str | None = None  # the process's log, named in error hints
    alive: str | None = None  # the liveness file (`Heartbeat`)

    def __post_init__(self) -> None:
        for name in ("result", "stderr", "alive"):
            path = getattr(self, name)
            if path:
                object.__setattr__(self, name, os.path.abspath(path))
        object.__setattr__(self, "arguments", absolute_paths(self.arguments))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> DeviceTask:
        if not isinstance(data, dict):
            raise TaskError(f"a device task is a JSON object, not {type(data).__name__}")
        for name, types in _TASK_FIELDS.items():
            if name in _REQUIRED and name not in data:
                raise TaskError(f"the device task has no {name!r}")
            if name in data and not isinstance(data[name], types):
                raise TaskError(f"the device task's {name!r} is {type(data[name]).__name__}")
        unknown = sorted(set(data) - set(_TASK_FIELDS))
        if unknown:
            raise TaskError(f"the device task has unknown fields {unknown}")
        if not all(isinstance(value, str) for value in data.get("environment", {}).values()):
            raise TaskError("the device task's 'environment' holds a value that is not a string")
        return cls(**data)

    @classmethod
    def read(cls, path: Path) -> DeviceTask:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise TaskError(f"cannot read the device task {path}: {exc}") from exc
        return cls.from_json(data)


@dataclass(frozen=True)
class DeviceFailure:
    """Why a device process gave no result: what the task raised, or how the process ended."""

    message: str
    hint: str | None = None
    exit_status: int | None = None  # None while it ran (killed for a timeout)
    log: str | None = None  # its stderr file, traceback included
    stderr_tail: str | None = None  # its last stderr lines, without traceback frames
    timed_out: float | None = None  # the timeout it exceeded, in seconds
    kind: str | None = None  # the SdcReplayError class the task raised (e.g. MessageOrderError)

    def said(self) -> str:
        """Its message and, where the message does not say why (a process that died without a
        word, the hint pointing at "the stderr lines above"), its last stderr line."""
        last = self.stderr_tail.splitlines()[-1] if self.stderr_tail else ""
        said = not last or last.split(": ", 1)[-1][:60] in self.message
        return self.message if said else f"{self.message}: {last}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> DeviceFailure:
        if not isinstance(data, dict) or not isinstance(data.get("message"), str):
            raise ValueError("a device failure is an object with a message")
        try:
            return cls(**data)
        except TypeError as exc:  # a field it does not have
            raise ValueError(f"not a device failure: {exc}") from exc


@dataclass(frozen=True)
class DeviceResult:
    """What the task function returned (``value``), or why there is nothing (``error``)."""

    value: dict | None = None
    error: DeviceFailure | None = None

    def __post_init__(self) -> None:
        if (self.value is None) == (self.error is None):
            raise ValueError("a device result holds a value or an error, not both or neither")

    def to_json(self) -> dict:
        if self.error is not None:
            return {"error": self.error.to_json()}
        return {"value": self.value}

    def in_given_form(self, forms: dict[str, str]) -> DeviceResult:
        """The value's paths as the command gave them (`in_given_form`)."""
        return self if self.value is None else DeviceResult(in_given_form(self.value, forms))

    @classmethod
    def from_json(cls, data: Any) -> DeviceResult:
        """Raises ValueError for anything a worker would not have written."""
        if isinstance(data, dict) and "error" in data:
            return cls(error=DeviceFailure.from_json(data["error"]))
        if isinstance(data, dict) and isinstance(data.get("value"), dict):
            return cls(value=data["value"])
        raise ValueError("a device result is an object with a value or an error")


_OWN = Path(__file__).resolve().parents[1]
_BUILTIN_WORKLOADS = _OWN / "workload"  # tiny-llama and tiny-moe are workloads like any other
_WORKLOAD_MACHINERY = ("__init__.py", "definition.py", "references.py")  # the tool's own there
_LIBRARIES = tuple(
    str(Path(spec.origin).resolve().parent)
    for spec in (importlib.util.find_spec(name) for name in ("torch", "functorch"))
    if spec is not None and spec.origin
)


def _library(path: str) -> bool:
    """PyTorch or the standard library: code that runs on behalf of whoever called it."""
    stdlib = sysconfig.get_paths()["stdlib"]
    in_stdlib = path.startswith(stdlib) and "-packages" not in path[len(stdlib) :]
    return in_stdlib or path.startswith(_LIBRARIES)


def tool_frame(exc: BaseException) -> str | None:
    """``path:line in function`` of sdcreplay's own code where ``exc`` was raised, or None when
    the workload's code raised it.

    Decided by the innermost frame that is neither PyTorch nor the standard library (both run
    on behalf of whoever called them): sdcreplay's own modules (not the built-in workloads)
    make it the tool's failure, anything else the workload's."""
    innermost = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if not _library(str(Path(frame.filename).resolve())):
            innermost = frame
    if innermost is None:
        return None
    path, frame = Path(innermost.filename).resolve(), innermost
    builtin_workload = path.parent == _BUILTIN_WORKLOADS and path.name not in _WORKLOAD_MACHINERY
    if not path.is_relative_to(_OWN) or builtin_workload:
        return None
    where = path.relative_to(_OWN.parent)
    return f"{where}:{frame.lineno} ({frame.name})"


def _call(task: DeviceTask) -> dict:
    planted = os.environ.get(PLANTED_FAILURE_VAR)
    if planted and planted == task.function:
        raise RuntimeError(f"a failure planted by {PLANTED_FAILURE_VAR} (a test)")
    function = task_function(task.function)
    try:
        inspect.signature(function).bind(device=task.device, **task.arguments)
    except TypeError as exc:
        raise TaskError(f"{task.function} does not take the task's arguments: {exc}") from exc
    return function(device=task.device, **task.arguments)


def main(argv: list[str]) -> int:
    task = DeviceTask.read(Path(argv[1]))
    os.environ.update(task.environment)  # before the first operator: e.g. the recorded kernels
    HEARTBEAT.path = Path(task.alive) if task.alive else None
    HEARTBEAT.beat("start-up")
    log_hint = (
        f"The traceback is in {task.stderr}." if task.stderr else "The traceback is on stderr."
    )
    try:
        result = DeviceResult(value=_call(task))
        status = 0
    except SdcReplayError as exc:
        traceback.print_exc()  # into the device's log file, for whoever debugs it
        result = DeviceResult(error=DeviceFailure(exc.message, exc.hint, kind=type(exc).__name__))
        status = 3
    except KeyboardInterrupt as exc:  # a ^C reached it, or the workload raised it: no crash
        traceback.print_exc()
        result = DeviceResult(
            error=DeviceFailure(
                f"the {task.device} process was interrupted ({interrupt_signal(exc).name}) at "
                f"{HEARTBEAT.where}",
                "It was stopped from outside (a ^C, a scheduler) or the workload raised "
                f"KeyboardInterrupt; run it again to get its result. {log_hint}",
                kind="interrupted",
            )
        )
        status = interrupt_exit_code(exc)
    except SystemExit as exc:  # workload code called sys.exit(): this device's failure
        traceback.print_exc()
        exit_call = f"sys.exit({exc.code!r})"
        result = DeviceResult(
            error=DeviceFailure(
                f"the workload called {exit_call} at {HEARTBEAT.where}",
                f"Workload code must not exit the process. {log_hint}",
            )
        )
        status = 3
    except Exception as exc:  # reported for this device; the others go on
        traceback.print_exc()
        first_line = (str(exc).splitlines() or [""])[0][:300]
        what = f"{type(exc).__name__}: {first_line}"
        frame = tool_frame(exc)
        if frame is not None:
            failure = DeviceFailure(
                f"internal error in sdcreplay at {HEARTBEAT.where}, in {frame}: {what}",
                "This is a bug in sdcreplay, not a fault of the workload, the bundle or the "
                f"device. Please report it with the traceback ({task.stderr or 'stderr'}) and "
                "the output of `sdcreplay doctor`.",
                kind="InternalError",
            )
        else:
            failure = DeviceFailure(
                f"the workload failed at {HEARTBEAT.where}: {what}",
                "A stored batch or state the workload cannot use (a damaged or foreign bundle), "
                f"or a workload that changed since the recording. {log_hint}",
            )
        result = DeviceResult(error=failure)
        status = 3
    # Whole or absent, never half: the parent may read it the moment it appears.
    written = Path(f"{task.result}.{os.getpid()}.tmp")
    written.write_text(json.dumps(result.to_json()))
    os.replace(written, task.result)
    return status


def run_by_hand(argv: list[str]) -> int:
    """``python -m sdcreplay.worker TASK.json``: a task file's problem as Error/Hint, exit 3."""
    if len(argv) != 2:
        print("usage: python -m sdcreplay.worker TASK.json", file=sys.stderr)
        return 2
    try:
        return main(argv)
    except SdcReplayError as exc:
        print(f"Error: {exc.message}\nHint: {exc.hint}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    # The task functions register in sdcreplay.replay.worker, not in this __main__ copy of it.
    from sdcreplay.replay.worker import run_by_hand

    sys.exit(run_by_hand(sys.argv))
