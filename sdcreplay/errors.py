"""One exception family: every failure the tool can explain carries a hint.

The CLI prints ``Error: <message>`` and ``Hint: <hint>`` and exits 3 for any of
these (with ``--json``, `error_json` on stdout too); library users catch
:class:`SdcReplayError`, whose ``str()`` is the message and the hint worded for Python.
"""

from __future__ import annotations

import signal

ERROR_SCHEMA = "sdcreplay.error/1"


def error_json(message: str, hint: str, exit_code: int, kind: str) -> dict:
    """What ``--json`` prints on stdout when a command fails (``sdcreplay.error/1``)."""
    return {
        "schema": ERROR_SCHEMA,
        "kind": kind,
        "message": message,
        "hint": hint,
        "exit_code": exit_code,
    }


class SdcReplayError(Exception):
    """The tool could not do its job; ``hint`` says what the person can do."""

    default_hint = "Run with SDCREPLAY_DEBUG=1 for the full traceback."
    default_python_hint: str | None = None  # the default hint for Python, where it names a flag

    def __init__(self, message: str, hint: str | None = None, *, python_hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint or self.default_hint
        # The same advice worded for a Python caller (``overwrite=True`` where the CLI says
        # ``--overwrite``); the CLI prints ``hint``, ``str()`` this.
        default = None if hint else self.default_python_hint
        self.python_hint = python_hint or default or self.hint

    def __str__(self) -> str:
        """The message and its hint: what a Python caller's traceback shows. Code that puts an
        error into another message uses ``.message``, so the hint is said once."""
        return f"{self.message}\nHint: {self.python_hint}"

    def to_json(self, exit_code: int = 3) -> dict:
        return error_json(self.message, self.hint, exit_code, type(self).__name__)


def message_of(exc: BaseException) -> str:
    """What an exception says, for another message to quote: an `SdcReplayError`'s message
    without its hint (the quoting error has its own), anything else's ``str()``."""
    return exc.message if isinstance(exc, SdcReplayError) else str(exc)


class Terminated(KeyboardInterrupt):
    """A SIGTERM (or SIGHUP) raised where ^C raises KeyboardInterrupt, so what a ^C gets
    (device processes and ranks stopped, leftovers named) a scheduler's signal gets too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def interrupt_signal(exc: KeyboardInterrupt) -> signal.Signals:
    """The signal an interruption came from: SIGINT for a plain KeyboardInterrupt."""
    return signal.Signals(exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def interrupt_exit_code(exc: KeyboardInterrupt) -> int:
    """128 + the signal, as a shell reports a process the signal ended: 130 ^C, 143 SIGTERM."""
    return 128 + interrupt_signal(exc)


class BundleError(SdcReplayError):
    default_hint = "The bundle is incomplete or damaged; record it again or restore a copy."


class CheckpointError(SdcReplayError):
    default_hint = "Point the bundle at the exact checkpoint it was recorded from."


class WorkloadError(SdcReplayError):
    default_hint = (
        "Name a workload as builtin:NAME, package.module:function or path/to/file.py:function."
    )


class DeterminismError(SdcReplayError):
    default_hint = (
        "Run the replay with the recorded determinism settings (see `sdcreplay info BUNDLE`)."
    )


class StructureError(SdcReplayError):
    """Two logs describe different programs: a configuration change, not SDC."""

    default_hint = "Compare runs of the same workload, configuration and device type."


class FaultSpecError(SdcReplayError):
    default_hint = "A fault spec is comma-separated key=value pairs; see docs/fault-injection.md."


class DeviceError(SdcReplayError):
    default_hint = "Use cpu, cpu:N (virtual replicas) or cuda:N for a GPU this machine has."


class ReportError(SdcReplayError):
    default_hint = "Pass the report directory written by `sdcreplay bisect --out`."
    default_python_hint = "Pass the report directory bisect() wrote (its result's .report)."


class WorkloadMismatchError(SdcReplayError):
    """The workload's step does not reproduce the loop's: a replay of it could not be evidence."""

    default_hint = (
        "Put everything the loop does in a step (clipping, GradScaler, schedulers, EMA, zero_grad) "
        "inside `with rec.step(batch):` and into the workload's train_step (docs/recording.md); "
        "or record with verify=False, and the replay carries a caveat."
    )


class UntrustedWorkloadError(SdcReplayError):
    """A bundle names code that the person has not said they trust."""

    default_hint = "Add --trust-workload if you trust the workload the bundle names."
    default_python_hint = (
        "If you trust the workload the bundle names, run the call inside "
        "`with sdcreplay.bundle.trust.granting([REFERENCE]):`."
    )


class MessageOrderError(StructureError):
    """A replayed rank issued another collective than the recorded one at the same place."""

    default_hint = (
        "The replay runs another program than the record (its collectives, their order, sizes "
        "or process groups differ): replay with the code, configuration and world size the job "
        "was recorded with."
    )
