"""Entry point of a device process: ``python -m sdcreplay.worker TASK.json``.

Each device label runs in a process of its own, so a device that crashes or
hangs takes only its own result with it. The task and the result are JSON
files; logs are written next to the result.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from .errors import SdcReplayError


def run_replay_task(task: dict) -> dict:
    from .replay import replay_on_device
    from .signature import write_signature_log

    logs, warnings, injected = [], [], []
    for repeat in range(task["repeats"]):
        log = replay_on_device(
            task["bundle"], task["device"], last_step=task.get("last_step"),
            inject=task.get("inject", ()), repeat=repeat,
        )
        path = Path(task["log_dir"]) / f"{task['device'].replace(':', '-')}.r{repeat}.sig.zst"
        write_signature_log(path, log)
        logs.append(str(path))
        warnings = log.meta.get("warnings", [])
        injected.append(log.meta.get("injected", []))
    return {"logs": logs, "warnings": warnings, "injected": injected}


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


def main(argv: list[str]) -> int:
    task = json.loads(Path(argv[1]).read_text())
    result_path = Path(task["result"])
    try:
        result = TASKS[task["kind"]](task)
        status = 0
    except SdcReplayError as exc:
        result = {"error": {"message": exc.message, "hint": exc.hint}}
        status = 3
    except Exception as exc:  # reported for this device; the others go on
        traceback.print_exc()
        result = {"error": {"message": f"{type(exc).__name__}: {exc}", "hint": None}}
        status = 3
    result_path.write_text(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
