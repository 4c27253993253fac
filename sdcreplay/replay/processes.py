"""Device processes: one per device label, so a device that crashes takes only its own result.

`run_device_processes` writes each process's `DeviceTask`, starts them all at
once and collects each `DeviceResult`; a process that dies, or shows no
progress for the timeout, becomes a `DeviceFailure` for its device alone. What
runs inside a process is `worker.py`. Processes are forked from a
multiprocessing *forkserver* that has imported torch once (a fresh
interpreter would pay several seconds per device to import torch and
torch._dynamo); the server never runs a torch operator or touches CUDA, so
every child starts clean.

No process outlives the command: an interruption (^C, SIGTERM) kills the running ones
before it goes on, and each device process ends itself when the command's process ends,
however it ends (`end_with`). The server is started with ^C blocked, so a ^C while it
imports torch prints nothing (it ignores ^C afterwards and ends with its last client).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import select
import signal
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from ..bundle import trust
from ..capture import environment
from ..errors import SdcReplayError
from ..leftovers import writing
from . import worker
from .worker import DeviceFailure, DeviceResult, DeviceTask, given_forms

STARTUP_SECONDS = 120.0
"""For a device process to start (fork, build the workload, load the state) before step one."""
STEP_FACTOR = 50
"""A step may take this many times the slowest recorded step before its device is deemed hung."""
UNKNOWN_STEP_TIMEOUT = 3600.0
"""Without recorded step times (a bundle from before they were recorded, or a bisect task)."""

_server = None


def process_context(*task_modules: str):
    """The forkserver context, its server started if it is not running.

    The server imports torch, torch._dynamo and the first caller's ``task_modules`` once, in
    its own process, while the command goes on (a device process's start waits for it): a
    command starts it as soon as it knows it will run device processes, naming the modules of
    every stage's tasks, so that no stage's processes import them again each. One server per
    command: every later call, every stage, forks from it."""
    global _server
    if _server is None:
        _server = multiprocessing.get_context("forkserver")
        _server.set_forkserver_preload([__name__, *task_modules, "torch._dynamo"])
    _start_server()
    return _server


def _start_server() -> None:
    """Start the forkserver (and multiprocessing's resource tracker), if it is not running,
    with SIGINT blocked (a ^C while it imports torch would print a KeyboardInterrupt traceback
    on the person's terminal; one that comes meanwhile reaches this process once it is up) and
    their stderr in `server_log`."""
    from multiprocessing import forkserver, resource_tracker

    _sockets_in_a_short_dir()
    terminal = os.dup(2)
    try:
        with open(server_log(), "ab") as log:
            os.dup2(log.fileno(), 2)
        resource_tracker.ensure_running()  # first: it unblocks SIGINT after starting its process
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            with _inherited_only():
                forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    finally:
        os.dup2(terminal, 2)
        os.close(terminal)
    _end_server_with(os.getpid())


@contextlib.contextmanager
def _inherited_only() -> Iterator[None]:
    """While the server starts: only what a device process inherits (`environment.inherited`),
    so that what torch reads of the environment as the server imports it is never the shell's
    (a replay's processes and the recording's first-step check import alike)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environment.inherited(saved))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


_server_ends_with: list[int] = []


def _end_server_with(command: int) -> None:
    """The server ends with the command that started it: it ends by itself once its last
    client has, but only when it reads its pipe again, which it does not while it still
    imports its preload (seconds under load, with ^C blocked). A process forked from the
    command inherits this exit hook and leaves the server alone."""
    if command in _server_ends_with:
        return
    _server_ends_with.append(command)

    def end() -> None:
        from multiprocessing import forkserver

        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if os.getpid() == command and pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)

    atexit.register(end)


SOCKET_DIR_MAX = 75
"""multiprocessing's sockets lie at TEMP/pymp-XXXXXXXX/listener-XXXXXXXX: 32 characters more,
within the 107 an AF_UNIX address holds on Linux."""


def _sockets_in_a_short_dir() -> None:
    """A deep TMPDIR (a test's, a batch scheduler's per-job one) would make the forkserver's
    socket address too long ("AF_UNIX path too long"); its sockets then go under the system's
    own temp dir, as Python 3.13's multiprocessing does. The command's files stay in TMPDIR."""
    from multiprocessing import util

    if len(tempfile.gettempdir()) <= SOCKET_DIR_MAX:
        return
    for candidate in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.access(candidate, os.W_OK | os.X_OK):
            chosen, tempfile.tempdir = tempfile.tempdir, candidate
            try:
                util.get_temp_dir()  # made once and kept for this process
            finally:
                tempfile.tempdir = chosen
            return


def server_log() -> Path:
    """The forkserver's stderr: what a process forked from it says before its own log file
    takes over (a child that could not even start, torn down by an interruption) goes there,
    not onto the person's terminal. Removed when this process ends, unless it holds something."""
    path = Path(tempfile.gettempdir()) / f"sdcreplay-forkserver-{os.getpid()}.log"
    if not path.exists():
        atexit.register(_remove_if_empty, path)
    return path


def _remove_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            path.unlink()


def end_with(command: int) -> None:
    """End this process (SIGKILL) as soon as process ``command`` ends, however it ends (even
    by SIGKILL): a device process or rank never outlives the command that started it. A
    forkserver child's parent is the server, which lives as long as any of its children, so
    the parent-death signal cannot say this."""

    def watch() -> None:
        try:
            descriptor = os.pidfd_open(command)
        except ProcessLookupError:
            descriptor = None
        except OSError:  # no pidfd here (an old kernel): look every half second
            while _alive(command):
                time.sleep(0.5)
            descriptor = None
        if descriptor is not None:
            select.select([descriptor], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="sdcreplay-end-with-command", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def die_with_parent(parent: int) -> None:
    """SIGKILL when the parent process ends (Linux's parent-death signal); at once where it
    ended before the request took hold. ``parent`` is the pid the parent had before it forked:
    read here, it would already be the reaper's had the parent ended before this ran."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)


def _child(task_path: str, stderr_path: str, env: dict, cwd: str, command: int) -> None:
    """In the forked process: ``env`` and the caller's directory, stderr to a file (and
    stdout, so what a workload prints is kept with its log, never in a command's output); ^C
    as the workload would get it (the server it was forked from blocks it)."""
    end_with(command)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    descriptor = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    status = worker.main(["worker", task_path])
    sys.stderr.flush()
    sys.exit(status)


def device_process(task_path: Path, stderr_path: Path, label: str, task_module: str):
    """The device process for one task, not started yet (``.start()``); ``.exitcode`` is None
    while it runs. Its environment is what it inherits of the caller's
    (`environment.INHERITED`), the task's (set by the worker) and, replaying a script, the
    bundle's: never the rest of the shell's, so who runs a replay does not change it."""
    env = {
        **environment.inherited(os.environ),
        **trust.child_environment(),
        "SDCREPLAY_DEVICE": label,
    }
    return process_context(task_module).Process(
        target=_child,
        args=(str(task_path), str(stderr_path), env, os.getcwd(), os.getpid()),
        name=f"sdcreplay-{label}",
        daemon=False,
    )


@contextlib.contextmanager
def caller_main_hidden() -> Iterator[None]:
    """While processes start: multiprocessing would re-import the caller's script in the child
    (as it does for spawn); a script that calls replay_devices() without a __main__ guard would
    then run again there. The child needs nothing from it."""
    caller_main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if caller_main is None:
            del sys.modules["__main__"]
        else:
            sys.modules["__main__"] = caller_main


def tail(path: Path, lines: int = 12) -> str:
    """The last lines of a device's stderr without traceback frames (those stay in the file)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - 65536))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    frames = (" ", "\t", "Traceback ", "During handling", "The above exception")
    kept = [line for line in text.splitlines() if line.strip() and not line.startswith(frames)]
    return "\n".join(kept[-lines:])


def exit_description(status: int) -> str:
    if status < 0:
        try:
            return f"killed by signal {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with status {status}"


def retry_hint(status: int, said: str) -> str:
    """Whether running the device again is worth it, from how its process ended (``said``: the
    last lines of its stderr, which the hint points at; empty: it wrote nothing)."""
    if status in (-signal.SIGKILL, 137):
        return (
            "Killed from outside (out of memory, or a person/scheduler): retry alone on that "
            "device; if it dies again, look for the kill in `dmesg` or the scheduler's log."
        )
    if status in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGILL, -signal.SIGFPE):
        return (
            "A crash inside a kernel or the driver: retry once; if the same device crashes "
            "again while the others do not, treat it as the suspect."
        )
    if not said:
        return (
            "It ended without a word on stderr (os._exit, or a crash in native code); run it "
            "again alone to see whether it ends the same way."
        )
    return (
        "The stderr lines above say why; fix that and retry (a retry alone does not change "
        "the outcome)."
    )


@dataclass
class Liveness:
    """A task's liveness file (`heartbeat.Heartbeat`), as the process that watches it reads it."""

    alive: Path
    started: float

    def last_progress(self) -> float:
        with contextlib.suppress(OSError):
            return max(self.started, self.alive.stat().st_mtime)
        return self.started

    def _beat(self) -> list[str]:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            return self.alive.read_text().split("\n")
        return []

    def where(self) -> str:
        return (self._beat() or [""])[0][:80] or "start-up"

    def collectives_issued(self) -> int:
        beat = self._beat()
        with contextlib.suppress(IndexError, ValueError):
            return int(beat[1])
        return 0


@dataclass
class _DeviceProcess(Liveness):
    process: multiprocessing.process.BaseProcess
    result: Path
    stderr: Path


def _stop_all(started: list, grace: float = 5.0) -> None:
    """SIGKILL every process, then reap each: one slow to die does not delay the others' kill."""
    started = [process for process in started if process.pid is not None]
    for process in started:
        with contextlib.suppress(OSError, ValueError):
            process.kill()
    ends = time.monotonic() + grace
    for process in started:
        process.join(max(0.0, ends - time.monotonic()))


def logs_written(work_dir: Path):
    """While device processes or ranks write into ``work_dir``: an interruption names it."""
    return writing(
        work_dir,
        "the logs of an interrupted run",
        "each process's stderr.txt there says how far it got; delete the directory when done",
    )


def _prepared(stem: Path, task: DeviceTask, task_module: str) -> _DeviceProcess:
    """One device's files (``<stem>.task.json``, ...) and its process, not started yet."""
    result, stderr, alive = (
        Path(f"{stem}.{name}") for name in ("result.json", "stderr.txt", "alive")
    )
    task = replace(task, result=str(result), stderr=str(stderr), alive=str(alive))
    task_path = Path(f"{stem}.task.json")
    task_path.write_text(json.dumps(task.to_json()))
    alive.unlink(missing_ok=True)
    process = device_process(task_path, stderr, task.device, task_module)
    return _DeviceProcess(alive, time.time(), process, result, stderr)


def run_device_processes(
    kind: str,
    task: Callable[..., dict] | str,
    devices: list[str],
    arguments_for: Callable[[str], dict],
    work_dir: Path,
    *,
    environment: dict[str, str] | None = None,
    on_done: Callable[[str, DeviceResult], None] | None = None,
    timeout: float | None = None,
    deadline: float | None = None,
) -> dict[str, DeviceResult]:
    """Run ``task`` (a `worker.device_task`, or its reference) in one process per device label
    at once.

    Each process gets ``device=label`` and ``arguments_for(label)`` as keywords,
    and ``environment`` set before it runs; its files in ``work_dir`` are named
    ``<kind>-<label>.*``. A process that dies yields a `DeviceFailure` with its exit
    status, its log file and the last lines of its stderr (never traceback
    frames); one that shows no progress for ``timeout`` seconds (default:
    ``UNKNOWN_STEP_TIMEOUT``) is killed and reported as timed out. The others run
    to the end, or until ``deadline`` (a ``time.time()``), when every process still running
    is killed and reported as stopped (screen's budget).
    """
    reference = worker.task_reference(task)
    timeout = UNKNOWN_STEP_TIMEOUT if timeout is None else timeout
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SdcReplayError(
            f"cannot create the log directory {work_dir}: {exc.strerror}",
            "Choose a --logs/--out directory that can be written (not under a file or /proc, "
            "each name at most 255 bytes).",
            python_hint="Choose a log_dir/out directory that can be written (not under a file "
            "or /proc, each name at most 255 bytes).",
        ) from exc
    running: dict[str, _DeviceProcess] = {}
    results: dict[str, DeviceResult] = {}
    forms: dict[str, dict[str, str]] = {}  # per label, the paths it was given (worker.given_forms)
    try:
        with logs_written(work_dir):
            for label in devices:
                arguments = arguments_for(label)
                forms[label] = given_forms(arguments)
                device = running[label] = _prepared(
                    work_dir / f"{kind}-{label.replace(':', '-')}",
                    DeviceTask(reference, label, "", arguments, dict(environment or {})),
                    reference.partition(":")[0],
                )
                with caller_main_hidden():
                    device.process.start()
            while running:
                for label, device in list(running.items()):
                    finished = _poll(label, device, timeout, deadline)
                    if finished is None:
                        continue
                    del running[label]
                    results[label] = finished = finished.in_given_form(forms[label])
                    if on_done is not None:
                        on_done(label, finished)
                if running:
                    time.sleep(0.05)
    finally:  # interrupted: no process outlives the command
        _stop_all([device.process for device in running.values()])
    return results


def _poll(
    label: str, device: _DeviceProcess, timeout: float, deadline: float | None = None
) -> DeviceResult | None:
    """The result of a process that ended (or was killed for a timeout or at the deadline), or
    None while it runs."""
    process = device.process
    status = process.exitcode
    if status is None and deadline is not None and time.time() >= deadline:
        _stop_all([process])
        return DeviceResult(
            error=DeviceFailure(
                f"the {label} process was stopped at the deadline (at {device.where()})",
                "It had not finished within the time it was given; give it more.",
                log=str(device.stderr),
                stderr_tail=tail(device.stderr),
            )
        )
    if status is None and time.time() - device.last_progress() <= timeout:
        return None
    if status is None:
        where = device.where()
        _stop_all([process])
        return DeviceResult(
            error=DeviceFailure(
                f"the {label} process timed out after {timeout:g} s without progress "
                f"(at {where}) and was killed",
                "A hung device or workload (its log may say where). If the step is just slow, "
                "give it more time with --timeout SECONDS.",
                log=str(device.stderr),
                stderr_tail=tail(device.stderr),
                timed_out=timeout,
            )
        )
    process.join(5)
    result = None
    if device.result.is_file():
        with contextlib.suppress(ValueError, OSError):
            result = DeviceResult.from_json(json.loads(device.result.read_text()))
    if result is None or (status != 0 and result.error is None):
        # died without a word (signal, os._exit): its last lines of stderr are all there is to say
        said = tail(device.stderr)
        result = DeviceResult(
            error=DeviceFailure(
                f"the {label} process {exit_description(status)}",
                retry_hint(status, said),
                stderr_tail=said,
            )
        )
    if result.error is not None:
        error = replace(result.error, exit_status=status, log=str(device.stderr))
        result = DeviceResult(error=error)
    return result
