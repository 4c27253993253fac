"""One exception family: every failure the tool can explain carries a hint.

The CLI prints ``Error: <message>`` and ``Hint: <hint>`` and exits 3 for any of
these; library users catch :class:`SdcReplayError`.
"""

from __future__ import annotations


class SdcReplayError(Exception):
    """The tool could not do its job; ``hint`` says what the person can do."""

    default_hint = "Run with SDCREPLAY_DEBUG=1 for the full traceback."

    def __init__(self, message: str, hint: str | None = None, *, python_hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint or self.default_hint
        # The same advice worded for a Python caller (``overwrite=True`` where the CLI says
        # ``--overwrite``); the CLI prints ``hint``.
        self.python_hint = python_hint or self.hint


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


class MessageOrderError(StructureError):
    """A replayed rank issued another collective than the recorded one at the same place."""

    default_hint = (
        "The replay runs another program than the record (its collectives, their order, sizes "
        "or process groups differ): replay with the code, configuration and world size the job "
        "was recorded with."
    )
