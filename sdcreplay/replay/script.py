"""Script mode, the replay's side: the loop's own script is the step.

A bundle recorded by a Recorder given no ``workload=`` names the command that ran
(``WorkloadRef`` of kind "script"). To replay it, this process runs that script
again, in *replay mode*, in a thread of its own (the script thread), with the
recorded ``sys.argv``, working directory and environment (capture/environment.py). The
script builds its model and optimizer as usual; its Recorder sees replay mode
(`handoff`), hands its objects over (`ScriptRun.start`) and parks. From then on
the replay drives: each step it wants is a *block* (the session's step contexts:
the recorded batch and RNG, the capture, the injector, the observers) that the
parked script enters at its next ``rec.step()``; the loop's own body runs inside
it, fed the recorded inputs through ``rec.feed``; the script runs on to its next
``rec.step()`` and parks again. When the replay is done the parked script is
ended there (`ReplayEnded`), so nothing after the window runs.

The script's code thus runs in one thread at a time: the replay's thread waits
while the script runs and the other way round, so a step's dispatch modes,
grad mode and autocast (thread-local in torch) are entered in the thread that
runs the step.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import runpy
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..bundle.manifest import WorkloadRef
from ..bundle.reader import workload_named
from ..capture import environment
from ..capture.around import RestorePoints
from ..errors import SdcReplayError, WorkloadError, WorkloadMismatchError, message_of

SCRIPT_PREFIX = "script:"

QUIET_LOGGERS = {
    "WANDB_MODE": "disabled",
    "WANDB_DISABLED": "true",
    "WANDB_SILENT": "true",
    "NEPTUNE_MODE": "debug",
    "COMET_MODE": "disabled",
    "COMET_AUTO_LOG_DISABLE": "true",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
    "MLFLOW_TRACKING_URI": "file:///dev/null",
    "HF_HUB_OFFLINE": "1",
}
"""Set in a device process that replays a script: the well-known loggers stay quiet (a
replay is not a run of the experiment). A script's own writes are its to guard with
``sdcreplay.replaying()`` (docs/porting.md)."""


@dataclass(frozen=True)
class ScriptCommand:
    """The command that ran the loop, as a bundle keeps it."""

    python: str
    argv: list[str]  # argv[0]: the script's absolute path (or the module's file with -m)
    cwd: str
    env: dict[str, str]  # environment.recorded: what a replay's process sets
    module: str | None = None  # `python -m MODULE`
    world_size: int | None = None  # torchrun's WORLD_SIZE, when it ran under it
    sha256: str | None = None  # the script file's, as it was recorded
    watched: tuple[str, ...] = ()  # the Recorder's env= patterns, kept beside the defaults

    @classmethod
    def of_this_process(cls, watched: tuple[str, ...] = ()) -> ScriptCommand:
        """This process's command: what `sys.argv` and `__main__` say; its environment's
        variables that can change the loop's results (`environment.recorded`, with the
        ``watched`` patterns of the loop's own)."""
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        module = spec.name if spec is not None and spec.name != "__main__" else None
        script = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv else "")
        if not module and not (script and Path(script).is_file()):
            raise WorkloadError(
                "no script runs this loop (an interactive session or python -c), so there is "
                "no command a replay could run again",
                "Run the loop as a script (python train.py, torchrun train.py), or give the "
                "Recorder a workload= factory.",
            )
        env = environment.recorded(os.environ, watched)
        world = os.environ.get("WORLD_SIZE")
        _recorded_in[:] = [os.getpid()]
        return cls(
            python=sys.executable,
            argv=[str(Path(script).resolve()), *sys.argv[1:]],
            cwd=os.getcwd(),
            env=env,
            module=module,
            world_size=int(world) if world and world.isdigit() else None,
            sha256=_sha256(Path(script)),
            watched=watched,
        )

    def changed(self) -> str | None:
        """Why the script replay runs may not be the recorded one (None when it is)."""
        if self.sha256 is None:
            return None
        now = _sha256(Path(self.argv[0]))
        if now == self.sha256:
            return None
        what = "is gone" if now is None else "changed since the recording (its SHA-256 differs)"
        return f"the recorded script {self.argv[0]} {what}: a difference may be the code's"

    def workload_ref(self) -> WorkloadRef:
        command: dict[str, Any] = {
            "python": self.python,
            "argv": self.argv,
            "cwd": self.cwd,
            "env": self.env,
        }
        if self.module is not None:
            command["module"] = self.module
        if self.world_size is not None:
            command["world_size"] = self.world_size
        if self.sha256 is not None:
            command["sha256"] = self.sha256
        if self.watched:
            command["env_watched"] = list(self.watched)
        return WorkloadRef(
            ref=SCRIPT_PREFIX + self.argv[0],
            kwargs={},
            kind="script",
            command=command,
            absent=frozenset(),
        )

    @classmethod
    def of(cls, ref: WorkloadRef) -> ScriptCommand:
        command = ref.command or {}
        return cls(
            python=command["python"],
            argv=list(command["argv"]),
            cwd=command["cwd"],
            env=dict(command["env"]),
            module=command.get("module"),
            world_size=command.get("world_size"),
            sha256=command["sha256"] if isinstance(command.get("sha256"), str) else None,
            watched=tuple(command.get("env_watched", ())),
        )

    def is_this_process(self) -> bool:
        """Is this the recording's own process (a job's rank checks its first step in it)?
        A process that only looks like it (a device process forked from a server that the
        recording started, which took its ``sys.argv``) is not."""
        here = [str(Path(sys.argv[0]).resolve()) if sys.argv else "", *sys.argv[1:]]
        return _recorded_in == [os.getpid()] and here == self.argv and os.getcwd() == self.cwd


_recorded_in: list[int] = []
"""The process that recorded a script here (`ScriptCommand.of_this_process`), if any."""


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


@dataclass
class LoopObjects:
    """What the script's Recorder hands over in replay mode."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    state: dict[str, Any]
    data_parallel: torch.nn.Module | None


class StepFeeds:
    """What a replayed step's block hands the script: the recorded inputs, fed in order, the
    torch RNG put back at each (capture/around.py)."""

    def __init__(self, recorded: Any, points: RestorePoints):
        if not isinstance(recorded, list):
            raise WorkloadError(
                "the step's recorded batch is not the list of inputs a script feeds: the bundle "
                "was not recorded in script mode"
            )
        self._recorded = iter(recorded)
        self._points = points

    def next(self) -> Any:
        fed = next(self._recorded, _NONE)
        if fed is _NONE:
            raise WorkloadMismatchError(
                "the replayed step feeds more inputs (rec.feed) than the recorded step did: "
                "the script takes another path in replay mode"
            )
        self._points.at_point("a rec.feed")
        return fed


_NONE = object()


class ReplayEnded(BaseException):  # noqa: N818 (an ending, like SystemExit)
    """Ends a replayed script at its next ``rec.step()`` once the replay has its steps: a
    BaseException, so a loop's ``except Exception`` does not swallow it."""


class Handoff:
    """The two queues between the script thread and the replay's thread."""

    def __init__(self) -> None:
        self.to_script: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.to_replay: queue.Queue[tuple[str, Any]] = queue.Queue()

    # -- the script's side (the Recorder in replay mode) --

    def offer(self, objects: LoopObjects) -> None:
        """Hand the loop's objects over; return once the replay has loaded their state."""
        self.to_replay.put(("objects", objects))
        self._wait("go")

    def next_block(self) -> AbstractContextManager:
        """Park at a ``rec.step()``: the block of the step the replay wants next."""
        self.to_replay.put(("parked", None))
        return self._wait("block")

    def _wait(self, expected: str) -> Any:
        kind, value = self.to_script.get()
        if kind == "end":
            raise ReplayEnded
        assert kind == expected, (kind, expected)
        return value


_local = threading.local()


def handoff() -> Handoff | None:
    """The handoff of this thread when it runs a script in replay mode, else None."""
    return getattr(_local, "handoff", None)


def replaying() -> bool:
    """True inside a replay of the loop's script (its checkpoint writes and logging belong
    outside: ``if not sdcreplay.replaying(): save(...)``)."""
    return handoff() is not None


class ScriptRun:
    """One run of a recorded script in replay mode, in its own thread (module docstring)."""

    def __init__(self, ref: WorkloadRef):
        self.command = ScriptCommand.of(ref)
        self.named = workload_named(ref)  # the recorded command, as errors name it
        self._handoff = Handoff()
        self._thread: threading.Thread | None = None
        self._parked = False

    def start(self) -> LoopObjects:
        """Run the script until its Recorder hands its objects over."""
        own_process = self.command.is_this_process()
        if not own_process:
            _enter_command(self.command)
        self._thread = threading.Thread(
            target=self._run, name="sdcreplay-script", args=(own_process,), daemon=True
        )
        self._thread.start()
        kind, value = self._handoff.to_replay.get()
        if kind != "objects":
            self._thread.join()
            raise self._ended_early(value, "before its Recorder was created")
        return value

    def go(self) -> None:
        """Let the script on from its Recorder, to its first ``rec.step()``."""
        self._handoff.to_script.put(("go", None))
        self._parked = False

    def run_block(self, block: AbstractContextManager) -> None:
        """Run one step: the script, parked at (or running on to) its next ``rec.step()``,
        enters ``block`` and runs its body in it, then runs on to the ``rec.step()`` after."""
        if not self._parked:
            self._await_park("before the replay's steps were done")
        self._handoff.to_script.put(("block", block))
        self._parked = False
        self._await_park("in the middle of the replay's steps")

    def _await_park(self, when: str) -> None:
        kind, value = self._handoff.to_replay.get()
        if kind != "parked":
            raise self._ended_early(value, when)
        self._parked = True

    def close(self) -> None:
        """End the script where it is parked; nothing after the window runs."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._handoff.to_script.put(("end", None))
        thread.join()

    def _ended_early(self, error: BaseException | None, when: str) -> Exception:
        if isinstance(error, Exception):
            if isinstance(error, SdcReplayError):
                return error
            return WorkloadError(
                f"{self.named} raised {type(error).__name__} {when}: {message_of(error)}",
                "The script fails in replay mode: run it as recorded to see why; "
                "SDCREPLAY_DEBUG=1 shows the traceback.",
            )
        return WorkloadError(
            f"{self.named} ended {when}"
            + (" (it exited)" if error is not None else " without a Recorder step to replay"),
            "A replayed script must create its Recorder and reach rec.step() as when it "
            "recorded (the same command line and files); guard only writes and logging "
            "with sdcreplay.replaying().",
        )

    def _run(self, own_process: bool) -> None:
        _local.handoff = self._handoff
        outcome: BaseException | None = None
        try:
            with _joined_process_group():
                _run_command(self.command, own_process)
        except ReplayEnded:
            return
        except BaseException as exc:  # SystemExit included: the replay reports it
            outcome = exc
        finally:
            _local.handoff = None
        self._handoff.to_replay.put(("ended", outcome))


def _enter_command(command: ScriptCommand) -> None:
    """A device process becomes the recorded command: its environment (on what the process
    inherited, `environment.INHERITED`), directory, argv; the loggers quiet."""
    os.environ.update(command.env)
    os.environ.update(QUIET_LOGGERS)
    os.environ.update(_world())
    os.chdir(command.cwd)
    sys.argv = list(command.argv)
    # What the recorded PYTHONPATH put on the script's path (the variable alone does not).
    for entry in command.env.get("PYTHONPATH", "").split(os.pathsep):
        if entry and entry not in sys.path:
            sys.path.append(entry)


def _world() -> dict[str, str]:
    """torchrun's variables for a rank this process replays (its group joined already, by the
    replay's launcher or as a rank alone), so the script takes its distributed path."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {}
    rank, size = dist.get_rank(), dist.get_world_size()
    world = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank)}
    world.update(LOCAL_WORLD_SIZE=str(size), GROUP_RANK="0")
    return {name: value for name, value in world.items() if name not in os.environ}


def _run_command(command: ScriptCommand, own_process: bool) -> None:
    """``python SCRIPT`` or ``python -m MODULE``, with the script's directory on the path."""
    directory = str(Path(command.argv[0]).parent)
    if command.module is None and directory not in sys.path:
        sys.path.insert(0, directory)
    main = sys.modules.get("__main__")
    try:
        if command.module is not None:
            runpy.run_module(command.module, run_name="__main__", alter_sys=not own_process)
        else:
            runpy.run_path(command.argv[0], run_name="__main__")
    finally:
        if main is not None:
            sys.modules["__main__"] = main


@contextlib.contextmanager
def _joined_process_group() -> Iterator[None]:
    """The replay's ranks join their process group before the script runs: the script's own
    ``init_process_group`` then joins nothing (and its ``destroy_process_group`` at the end
    never comes: the script ends at its window's last step)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        yield
        return
    original: Callable = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.init_process_group = original
