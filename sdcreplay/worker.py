"""The device process: one per device label, so a device that crashes takes only its own result.

The task and the result are JSON files; logs are written next to the result.
Processes are forked from a multiprocessing *forkserver* that has imported
torch once (a fresh interpreter would pay several seconds per device to import
torch and torch._dynamo); the server never runs a torch operator or touches
CUDA, so every child starts clean. ``python -m sdcreplay.worker TASK.json``
runs a task by hand.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import traceback
import types
from pathlib import Path

from .errors import SdcReplayError


class Heartbeat:
    """The liveness signal: the task touches its ``alive`` file whenever it makes progress.

    The parent kills a process whose file stays untouched longer than the
    timeout; the file's text says where the task got to, for the report.
    """

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.where = "start-up"

    def beat(self, where: str) -> None:
        self.where = where
        if self.path is not None:
            self.path.write_text(where)


HEARTBEAT = Heartbeat(None)


def run_replay_task(task: dict) -> dict:
    from .replay import replay_on_device
    from .signature import write_signature_log

    logs, warnings, injected, unmatched = [], [], [], None
    for repeat in range(task["repeats"]):
        log = replay_on_device(
            task["bundle"], task["device"], last_step=task.get("last_step"),
            inject=task.get("inject", ()), repeat=repeat,
            on_step=lambda index, repeat=repeat: HEARTBEAT.beat(f"step {index} (repeat {repeat})"),
        )
        path = Path(task["log_dir"]) / f"{task['device'].replace(':', '-')}.r{repeat}.sig.zst"
        write_signature_log(path, log)
        logs.append(str(path))
        warnings = log.meta.get("warnings", [])
        injected.append(log.meta.get("injected", []))
        unmatched = log.meta["unmatched"] if unmatched is None else unmatched
    from .determinism import fingerprint
    from .devices import torch_device

    return {"logs": logs, "warnings": warnings, "injected": injected, "unmatched": unmatched or [],
            "fingerprint": fingerprint(torch_device(task["device"]))}


def _bisect_task(name: str):
    def run(task: dict) -> dict:
        from . import bisect

        return getattr(bisect, name)(task)

    return run


TASKS = {
    "replay": run_replay_task,
    "oplog": _bisect_task("run_oplog_task"),
    "fetch": _bisect_task("run_fetch_task"),
    "isolate": _bisect_task("run_isolate_task"),
}


def _pin_recorded_kernels(task: dict) -> None:
    """Put the recording's kernel choices in force before this process runs its first operator."""
    from .bundle import Bundle
    from .determinism import pin_environment

    if "bundle" in task:
        with contextlib.suppress(SdcReplayError, OSError):  # the task reports a bad bundle
            pin_environment(Bundle.open(task["bundle"], verify=False).manifest.fingerprint)


def main(argv: list[str]) -> int:
    task = json.loads(Path(argv[1]).read_text())
    result_path = Path(task["result"])
    _pin_recorded_kernels(task)
    HEARTBEAT.path = Path(task["alive"]) if task.get("alive") else None
    HEARTBEAT.beat("start-up")
    log = task.get("stderr")
    log_hint = f"The traceback is in {log}." if log else "The traceback is on stderr."
    try:
        result = TASKS[task["kind"]](task)
        status = 0
    except SdcReplayError as exc:
        traceback.print_exc()  # into the device's log file, for whoever debugs it
        result = {"error": {"message": exc.message, "hint": exc.hint}}
        status = 3
    except SystemExit as exc:  # workload code called sys.exit(): this device's failure
        traceback.print_exc()
        exit_call = f"sys.exit({exc.code!r})"
        result = {"error": {"message": f"the workload called {exit_call} at {HEARTBEAT.where}",
                            "hint": f"Workload code must not exit the process. {log_hint}"}}
        status = 3
    except Exception as exc:  # reported for this device; the others go on
        traceback.print_exc()
        first_line = (str(exc).splitlines() or [""])[0][:300]
        what = f"{type(exc).__name__}: {first_line}"
        result = {"error": {"message": f"the workload failed at {HEARTBEAT.where}: {what}",
                            "hint": "A stored batch or state the workload cannot use (a damaged "
                                    "or foreign bundle), or a workload that changed since the "
                                    f"recording. {log_hint}"}}
        status = 3
    result_path.write_text(json.dumps(result))
    return status


_server = None


def _process_context():
    global _server
    if _server is None:
        _server = multiprocessing.get_context("forkserver")
        _server.set_forkserver_preload(["sdcreplay.worker", "sdcreplay.bisect", "torch._dynamo"])
    return _server


def _child(task_path: str, stderr_path: str, env: dict, cwd: str) -> None:
    """In the forked process: the caller's environment and directory, stderr to a file."""
    descriptor = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    status = main(["worker", task_path])
    sys.stderr.flush()
    sys.exit(status)


def start(task_path: Path, stderr_path: Path, label: str):
    """Start the device process for one task; ``.exitcode`` is None while it runs."""
    from .trust import child_environment

    env = {**os.environ, **child_environment(), "SDCREPLAY_DEVICE": label}
    process = _process_context().Process(
        target=_child, args=(str(task_path), str(stderr_path), env, os.getcwd()), name=f"sdcreplay-{label}", daemon=False
    )
    # multiprocessing would re-import the caller's script in the child (as it does for
    # spawn); a script that calls replay_devices() without a __main__ guard would then
    # run again there. The child needs nothing from it.
    caller_main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        process.start()
    finally:
        sys.modules["__main__"] = caller_main
    return process


if __name__ == "__main__":
    sys.exit(main(sys.argv))
