"""Ranks: run a device task on N processes that form one ``torch.distributed`` job.

The processes are started by PyTorch's own elastic agent and c10d rendezvous (what
``torchrun`` runs): on one node, a rendezvous on localhost; across nodes, the one
`rendezvous.NodeLink` joined, this node's ranks only. Each rank
runs a `worker.DeviceTask` as a device process does (`processes.py`): its own
task file, result file, liveness file and log files, the recorded kernels
pinned in its environment. Before the task runs, the rank joins the process
group (gloo for CPU labels, NCCL for CUDA ones) with a timeout, so no
collective waits forever.

A rank that dies (a signal, ``os._exit``) or raises makes the launcher stop
the others; a job where no rank made progress for the timeout is stuck, and
the rank that progressed least (the one the others wait for in a collective)
is killed. Every rank then has a `DeviceResult`: its value, its own failure,
or that it failed after another rank failed first (`followed`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from ..bundle import trust
from ..capture import environment
from ..errors import SdcReplayError, Terminated
from . import processes, rendezvous, worker
from .endings import Ending, exchange, first_failure
from .worker import DeviceFailure, DeviceResult, DeviceTask, given_forms

_ELASTIC_PREFIXES = ("TORCHELASTIC_",)
_ELASTIC_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "CUDA_VISIBLE_DEVICES",
)
"""What the launcher sets for each rank (it wins over the caller's environment)."""
GROUP_TIMEOUT_FACTOR = 2.0
"""A collective may wait this many progress timeouts: the watchdog names a stuck rank first."""
SHUTDOWN_SECONDS = 5
"""How long the launcher waits for the other ranks to end on SIGTERM before SIGKILL."""
_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class LaunchError(SdcReplayError):
    default_hint = (
        "The ranks could not be started (a rendezvous on localhost needs a free TCP port); "
        "the rank logs are in the log directory."
    )


def backend_for(labels: list[str]) -> str:
    """NCCL for CUDA labels, gloo for CPU ones; a job is on one kind of device."""
    kinds = {label.split(":")[0] for label in labels}
    if len(kinds) != 1:
        raise LaunchError(
            f"the ranks' device labels mix device types: {labels}",
            "Give every rank of a job the same kind of device (all cpu... or all cuda:N).",
        )
    return "nccl" if kinds == {"cuda"} else "gloo"


# ---------------------------------------------------------------------------
# Inside a rank (pickled by reference into the launcher's worker processes).


def _rank_environment(parent: dict[str, str]) -> dict[str, str]:
    """What a rank inherits of the caller's environment (`environment.inherited`), with what
    the launcher set for this rank on top."""
    own = {
        name: value
        for name, value in os.environ.items()
        if name in _ELASTIC_VARIABLES or name.startswith(_ELASTIC_PREFIXES)
    }
    return {**parent, **own}


def join_group(device: str, backend: str, group_timeout: float) -> None:
    """Join the job's default process group (the launcher's environment says where), with a
    timeout on every collective."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=group_timeout)
    if backend == "nccl":
        target = torch.device(device)
        torch.cuda.set_device(target)
        dist.init_process_group("nccl", timeout=timeout, device_id=target)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def _rank_entry(
    task_paths: list[str],
    parent: dict[str, str],
    backend: str,
    timeout: float,
    command: int,
    first_rank: int = 0,
):
    """One rank, as the launcher starts it: a supervisor that forks the process running the
    task and writes how it ended (``TASK.exit``). The launcher itself reports only the first
    rank it sees fail; this is how every rank's exit status is known, even an ``os._exit``.
    It ends with the command (``command``: its pid), and its task process with it. Its rank
    is this node's ``first_rank`` plus its local rank (`rendezvous.Nodes`: the node's place,
    not the order the rendezvous found the nodes in)."""
    processes.end_with(command)
    environment = _rank_environment(parent)
    local = int(environment["LOCAL_RANK"])
    environment["RANK"] = str(first_rank + local)
    os.environ.clear()
    os.environ.update(environment)
    path = task_paths[local]
    supervisor = os.getpid()
    child = os.fork()
    if child == 0:  # never returns into the launcher's code: that is the supervisor's
        status = 3
        try:
            processes.die_with_parent(supervisor)
            status = _run_rank(path, backend, timeout)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    stopped: list[int] = []

    def forward(signum: int, _frame: object) -> None:  # the launcher ends the job
        stopped.append(signum)
        with contextlib.suppress(OSError):
            os.kill(child, signum)

    for name in ("SIGTERM", "SIGINT"):
        signal.signal(getattr(signal, name), forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked in the forkserver
    status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    Path(f"{path}.exit").write_text(json.dumps({"status": status, "stopped": bool(stopped)}))
    if status != 0:
        os._exit(status if status > 0 else 128 - status)


def _run_rank(path: str, backend: str, timeout: float) -> int:
    """The task in the process group: its exit status (the worker's)."""
    task = DeviceTask.read(Path(path))
    Path(f"{path}.pid").write_text(str(os.getpid()))
    os.environ.update({**task.environment, "SDCREPLAY_DEVICE": task.device})
    try:
        join_group(task.device, backend, timeout)
    except Exception as exc:  # the rendezvous or the backend: this rank's failure
        failure = DeviceFailure(f"could not join the process group ({backend}): {exc}")
        Path(task.result).write_text(json.dumps(DeviceResult(error=failure).to_json()))
        return 3
    status = worker.main(["worker", path])
    if status == 0:
        import torch.distributed as dist

        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    return status


# ---------------------------------------------------------------------------
# The caller's side.


def _rank_logs_class():
    """A LogsSpecs (the launcher's extension point for log files) that puts each rank's
    stdout and stderr where the caller says. Built lazily: importing torch.distributed costs."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RankLogs(LogsSpecs):
        def __init__(self, directory: Path, stems: list[Path]):
            super().__init__(log_dir=str(directory))
            self.stems = stems

        @property
        def root_log_dir(self) -> str:
            return str(self._root_log_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            errors = {rank: f"{self.stems[rank]}.error.json" for rank in envs}
            for rank, env in envs.items():
                env["TORCHELASTIC_ERROR_FILE"] = errors[rank]
            return LogsDest(
                stdouts={rank: f"{self.stems[rank]}.stdout.txt" for rank in envs},
                stderrs={rank: f"{self.stems[rank]}.stderr.txt" for rank in envs},
                error_files=errors,
            )

    return RankLogs


@dataclass
class _Rank(processes.Liveness):
    """One rank's files: ``<stem>.task.json``, ``.result.json``, ``.stderr.txt``, ..."""

    rank: int
    label: str
    stem: Path

    @property
    def result(self) -> Path:
        return Path(f"{self.stem}.result.json")

    @property
    def stderr(self) -> Path:
        return Path(f"{self.stem}.stderr.txt")

    @property
    def task(self) -> Path:
        return Path(f"{self.stem}.task.json")

    @property
    def exit(self) -> Path:
        return Path(f"{self.task}.exit")

    def finished(self) -> bool:
        return self.result.is_file()

    def ending(self) -> tuple[int | None, bool]:
        """(exit status, whether the launcher stopped it), as its supervisor wrote them."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            ended = json.loads(self.exit.read_text())
            return int(ended["status"]), bool(ended["stopped"])
        return None, False

    def ended_by_itself(self) -> bool:
        status, stopped = self.ending()
        return status not in (None, 0) and not stopped

    def pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(Path(f"{self.task}.pid").read_text())
        return None


class _Watchdog(threading.Thread):
    """Kills the rank the others wait for when no unfinished rank progressed for ``timeout``:
    the one that issued fewest collectives, of those the one whose last beat is oldest."""

    def __init__(self, ranks: list[_Rank], timeout: float):
        super().__init__(name="sdcreplay-rank-watchdog", daemon=True)
        self.ranks, self.timeout = ranks, timeout
        self.killed: tuple[int, str] | None = None  # (rank, where it was)
        self._done = threading.Event()

    def stale(self, rank: _Rank) -> bool:
        """No progress for the timeout; before its first step, a rank may take as long as a
        device process may to start (the rendezvous and loading the job come first)."""
        allowed = self.timeout
        if rank.where() == "start-up":
            allowed = max(allowed, processes.STARTUP_SECONDS)
        return time.time() - rank.last_progress() > allowed

    def run(self) -> None:
        while not self._done.wait(0.1) and self.killed is None:
            waiting = [rank for rank in self.ranks if not rank.finished()]
            if not waiting or not all(self.stale(rank) for rank in waiting):
                continue
            laggard = min(waiting, key=lambda r: (r.collectives_issued(), r.last_progress()))
            pid = laggard.pid()
            if pid is None:
                continue  # not started yet: the rendezvous has its own timeout
            self.killed = (laggard.rank, laggard.where())
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        self._done.set()
        self.join()


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """The launcher installs its own handlers (a signal raises its SignalException once it has
    stopped the ranks); put ours back afterwards, and turn the signal into the interruption
    the CLI expects (KeyboardInterrupt for SIGINT, `Terminated` for the others)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    saved = {name: signal.getsignal(getattr(signal, name)) for name in _HANDLED_SIGNALS}
    try:
        yield
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from exc
        raise Terminated(exc.sigval) from exc
    finally:
        for name, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, name), handler)


@contextlib.contextmanager
def _launcher_quiet() -> Iterator[None]:
    """The launcher logs every failure (and signal) it handles; the ranks' failures are
    reported here. Its modules' loggers carry levels of their own, so each is quieted."""
    prefixes = ("torch.distributed", "torch.multiprocessing")
    names = [name for name in logging.root.manager.loggerDict if name.startswith(prefixes)]
    loggers = [logging.getLogger(name) for name in {*prefixes, *names}]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


_AFTER = "after rank"


def followed(failure: DeviceFailure) -> bool:
    """This rank failed only after another one did: the launcher stopped it, or its collective
    lost the peer that had failed first."""
    return f"({_AFTER} " in failure.message or f"stopped {_AFTER} " in failure.message


def _ending(rank: _Rank, hung: tuple[int, str] | None, timeout: float) -> Ending:
    """How a rank on this node ended."""
    reported_at = 0
    with contextlib.suppress(OSError):
        reported_at = rank.result.stat().st_mtime_ns
    return Ending(
        rank.rank,
        rank.label,
        _own_result(rank, hung, timeout),
        rank.finished(),
        rank.ended_by_itself() and not rank.finished(),
        hung is not None and hung[0] == rank.rank,
        reported_at,
        rank.where(),
        rank.ending()[0],
        str(rank.stderr),
        processes.tail(rank.stderr),
    )


def run_ranks(
    kind: str,
    task: Callable[..., dict],
    labels: list[str],
    arguments_for: Callable[[int], dict],
    work_dir: Path,
    *,
    environment: dict[str, str] | None = None,
    timeout: float = processes.UNKNOWN_STEP_TIMEOUT,
) -> dict[int, DeviceResult]:
    """Run ``task`` (a `worker.device_task`) on ``len(labels)`` ranks of one job.

    Rank r gets ``device=labels[r]`` and ``arguments_for(r)``; ``environment``
    is set in every rank before it runs (e.g. `comparable.pinned_environment`).
    Its files in ``work_dir`` are ``<kind>-rank<r>.*`` (``stderr.txt`` and
    ``stdout.txt`` are its logs). ``timeout``: seconds the job may go without
    any rank making progress (`heartbeat.HEARTBEAT`); every collective may wait
    `GROUP_TIMEOUT_FACTOR` times that. Returns every rank's result.

    Across nodes (within `rendezvous.across`) this node runs its own ranks of
    ``labels``; node 0 returns every rank's result, the files they name copied
    into its ``work_dir``, and the other nodes raise `rendezvous.NotReporting`
    once they have handed theirs over.
    """
    link = rendezvous.current()
    local = link.nodes.local_ranks if link is not None else range(len(labels))
    reference = worker.task_reference(task)
    backend = backend_for([labels[rank] for rank in local])
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(
            f"cannot create the log directory {work_dir}: {exc.strerror}",
            "Choose a --logs/--out directory that can be written.",
            python_hint="Choose a log_dir/out directory that can be written.",
        ) from exc
    now = time.time()
    ranks = [
        _Rank(Path(f"{stem}.alive"), now, rank, labels[rank], stem)
        for rank, stem in ((rank, work_dir / f"{kind}-rank{rank}") for rank in local)
    ]
    forms: dict[int, dict[str, str]] = {}  # per rank, the paths it was given (worker.given_forms)
    for rank_number in range(len(labels)):
        forms[rank_number] = given_forms(arguments_for(rank_number))
    for rank in ranks:
        for stale in (rank.result, rank.alive, rank.exit, Path(f"{rank.task}.pid")):
            stale.unlink(missing_ok=True)
        device_task = DeviceTask(
            reference,
            rank.label,
            str(rank.result),
            arguments_for(rank.rank),
            dict(environment or {}),
            stderr=str(rank.stderr),
            alive=str(rank.alive),
        )
        rank.task.write_text(json.dumps(device_task.to_json()))
    with processes.logs_written(work_dir):
        hung = _launch(ranks, work_dir, backend, timeout, task.__module__, link)
    endings = [_ending(rank, hung, timeout) for rank in ranks]
    if link is not None:
        endings = exchange(link, endings, work_dir)
    results = {e.rank: e.result.in_given_form(forms[e.rank]) for e in endings}
    first = first_failure(endings)
    for ending in endings:
        failure = results[ending.rank].error
        if failure is not None and first is not None and ending.rank != first:
            results[ending.rank] = DeviceResult(
                error=replace(failure, message=f"{failure.message} ({_AFTER} {first} failed)")
            )
        elif failure is None and not ending.finished:  # the launcher ended it
            why = f"was stopped {_AFTER} {first} failed" if first is not None else "ended early"
            results[ending.rank] = DeviceResult(
                error=DeviceFailure(
                    f"rank {ending.rank} ({ending.label}) {why} (it was at {ending.where})",
                    f"Rank {first}'s failure is the one to read."
                    if first is not None
                    else f"Its log may say why: {ending.log}.",
                    exit_status=ending.status,
                    log=ending.log,
                    stderr_tail=ending.tail,
                )
            )
    return dict(sorted(results.items()))


def _launch(
    ranks: list[_Rank],
    work_dir: Path,
    backend: str,
    timeout: float,
    task_module: str,
    link: rendezvous.NodeLink | None = None,
) -> tuple[int, str] | None:
    """Start the ranks under torch's elastic agent and c10d rendezvous (what ``torchrun``
    runs; across nodes, the link's) and wait; the (rank, where) the watchdog killed, if it did
    (each rank's supervisor wrote how it ended)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    processes.process_context(task_module)  # the launcher forks from the same warm server
    parent = {**environment.inherited(os.environ), **trust.child_environment()}
    parent.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does
    meeting = (
        link.rendezvous
        if link is not None
        else rendezvous.open_rendezvous(None, f"sdcreplay-{uuid.uuid4().hex[:12]}")
    )
    paths = [os.path.abspath(rank.task) for rank in ranks]  # a rank may move (script mode)
    first = ranks[0].rank
    spec = WorkerSpec(
        role="sdcreplay",
        local_world_size=len(ranks),
        entrypoint=_rank_entry,
        args=(paths, parent, backend, GROUP_TIMEOUT_FACTOR * timeout, os.getpid(), first),
        rdzv_handler=meeting.handler,
        max_restarts=0,
        monitor_interval=0.05,
    )
    agent = LocalElasticAgent(
        spec,
        _rank_logs_class()(work_dir, [rank.stem for rank in ranks]),
        start_method="forkserver",
        exit_barrier_timeout=GROUP_TIMEOUT_FACTOR * timeout,  # a lost node's: not torch's 300 s
        shutdown_timeout=SHUTDOWN_SECONDS,
    )
    watchdog = _Watchdog(ranks, timeout)
    watchdog.start()

    def end_ranks() -> None:  # a node was lost: its peers here would wait in a collective,
        for rank in ranks:  # or the agent in the rendezvous, for their timeouts
            pid = rank.pid()
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            meeting.handler.set_closed()

    watching = link.watching(end_ranks) if link is not None else contextlib.nullcontext()
    try:
        with _signals_kept(), _launcher_quiet(), processes.caller_main_hidden(), watching:
            agent.run()
    except Exception as exc:  # the rendezvous (a lost store, a node that never came)
        if link is None:
            raise
        if link.lost is None:  # else `endings.exchange` names the node that was lost
            link.silent_node()  # a store gone: node 0, its host, is named
            raise rendezvous.NodeError(
                f"the rendezvous at {link.nodes.endpoint} failed: {exc}",
                "Every node's launch must run until the verdict; start them all again.",
            ) from exc
    finally:
        watchdog.stop()
        with contextlib.suppress(Exception):
            meeting.handler.shutdown()
    return watchdog.killed


def _own_result(rank: _Rank, hung: tuple[int, str] | None, timeout: float) -> DeviceResult:
    """What this rank reported, or how it ended by itself; a rank without either is judged
    once every rank's own result is known (it was stopped)."""
    if hung is not None and hung[0] == rank.rank:
        return DeviceResult(
            error=DeviceFailure(
                f"rank {rank.rank} ({rank.label}) made no progress for {timeout:g} s (at "
                f"{hung[1]}) while the other ranks waited, and was killed",
                "A hung rank (its log may say where). If its step is just slow, give it more "
                "time with --timeout SECONDS.",
                exit_status=-signal.SIGKILL,
                log=str(rank.stderr),
                stderr_tail=processes.tail(rank.stderr),
                timed_out=timeout,
            )
        )
    status = rank.ending()[0]
    result = None
    if rank.finished():
        with contextlib.suppress(ValueError, OSError):
            result = DeviceResult.from_json(json.loads(rank.result.read_text()))
    if result is None and rank.ended_by_itself():  # died without a word: stderr is all there is
        assert status is not None
        said = processes.tail(rank.stderr)
        return DeviceResult(
            error=DeviceFailure(
                f"rank {rank.rank} ({rank.label}) {processes.exit_description(status)}",
                processes.retry_hint(status, said),
                exit_status=status,
                log=str(rank.stderr),
                stderr_tail=said,
            )
        )
    if result is None or result.error is None:
        return result or DeviceResult(value={})  # placeholder: judged by the caller
    message = result.error.message
    if not message.startswith("rank "):
        message = f"rank {rank.rank} ({rank.label}): {message}"
    return DeviceResult(
        error=replace(
            result.error,
            message=message,
            exit_status=status,
            log=str(rank.stderr),
            stderr_tail=processes.tail(rank.stderr),
        )
    )
