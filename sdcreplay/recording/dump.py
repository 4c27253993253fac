"""Writing a ring's held steps as a bundle, when an alarm asks for one.

A ring ``Recorder`` writes nothing while it records; its bundles appear only on
``dump(reason)``, named by a ``trigger``, at a name not taken yet, and under
torch.distributed as this rank's part of one job bundle (``JobRecording``, created
then). Each is verified like a recording (its first step re-executed), but a failed
check is written and warned about, never raised: the alarm that asked for the dump
matters more.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import _disable_current_modes

from ..bundle.jobs import JobRecording
from ..bundle.layout import ParallelLayout
from ..bundle.manifest import PARTIAL_SUFFIX, Trigger, WorkloadRef
from ..bundle.writer import BundleWriter
from ..capture.collectives import MessageLog
from ..capture.layers import SignatureCapture
from .anchors import CheckpointAnchor
from .ring import HeldStep, RingSnapshot
from .verification import FirstStepCheck


class RingDumper:
    """Writes held steps as bundles at ``path``, ``path`` with ``-2``, ``-3``...; with the
    settings (``BundleWriter``'s) and the verification of the Recorder it serves."""

    def __init__(
        self,
        path: Path,
        bundle_settings: dict[str, Any],
        *,
        overwrite: bool,
        workload_ref: WorkloadRef,
        label: str,
        capture: SignatureCapture,
        check: FirstStepCheck,
        verify_mode: str,
        compiled: Callable[[], list[dict]] = list,
        layout: ParallelLayout | None = None,
    ):
        self.path = path
        self._layout = layout
        self._bundle_settings = bundle_settings
        self._overwrite = overwrite
        self._workload_ref = workload_ref
        self.label = label
        self._capture = capture
        self._check = check
        self.verify_mode = verify_mode
        self._compiled = compiled  # the compiled regions' JSON as the dump is written

    def write(
        self,
        number: int,
        held: list[HeldStep],
        start: RingSnapshot | CheckpointAnchor,
        trigger: Trigger,
        messages: MessageLog | None,
        ring_problem: str | None,
    ) -> Path:
        """The ``number``-th dump (from 1): ``held`` from ``start`` as a bundle, or with
        ``messages`` (torch.distributed) as this rank's part of a job bundle; ``ring_problem``:
        why no dump can pass verification."""
        if messages is None:
            return self._write_dump(
                self._free_dump_path(number), held, start, trigger, None, ring_problem
            )
        messages.abandon()  # a step that raised mid-way left it open: no evidence
        job = JobRecording(
            self.path,
            self._workload_ref,
            self.label,
            self._overwrite,
            lambda: self._free_dump_path(number),
            layout=self._layout,
        )
        job.distributed.present("ddp_iterations_before", held[0].ddp_iterations_before)
        self._write_dump(job.part_path, held, start, trigger, job, ring_problem)
        return job.close()

    def _write_dump(
        self,
        path: Path,
        held: list[HeldStep],
        start: RingSnapshot | CheckpointAnchor,
        trigger: Trigger,
        job: JobRecording | None,
        ring_problem: str | None,
    ) -> Path:
        """The held steps as a bundle at ``path`` (a job's part: ``job``), verified."""
        settings = dict(self._bundle_settings, distributed=job and job.distributed)
        writer = BundleWriter(path, overwrite=self._overwrite, **settings)
        try:
            if isinstance(start, CheckpointAnchor):
                writer.reference_checkpoint(start.reference(), start.object_states)
            else:
                optimizer_state = start.ready().optimizer_state  # a copy still in flight
                writer.embed_state(start.model_state, optimizer_state, start.object_states)
            for step in held:
                writer.add_step(
                    step.index,
                    step.batch,
                    step.rng,
                    step.entries,
                    optimizer_step=step.optimizer_step,
                    grads=step.grads,
                    seconds=step.seconds,
                    messages=step.messages,
                    stopped=step.stopped,
                    around=step.around,
                )
            writer.set_trigger(trigger)
            compiled = self._compiled()
            if compiled:
                writer.set_compiled(compiled)
            # Called from inside the loop's step, the verification must not reach it: neither
            # through a fault injector's mode nor through the capture of the open step.
            expected = start.digests if isinstance(start, CheckpointAnchor) else None
            with _disable_current_modes(), self._capture.paused():
                self._verify_dump(writer, job, ring_problem, expected)
        except BaseException:
            writer.abort()
            raise
        return writer.close()

    def _verify_dump(
        self,
        writer: BundleWriter,
        job: JobRecording | None,
        ring_problem: str | None,
        expected_start: dict[str, str] | None,
    ) -> None:
        if self.verify_mode == "off":
            writer.set_verification("off", "off")
            return
        problem = ring_problem
        if job is not None:  # every rank re-executes (with collectives), or none does
            problems = job.gather("ring-problem", problem or "")
            problem = problem or next(
                (
                    f"rank {rank}'s recording cannot be replayed: {theirs}"
                    for rank, theirs in enumerate(problems)
                    if theirs
                ),
                None,
            )
        self._check.probe = None
        problem = problem or self._check.problem(
            writer.path, live_state=False, expected_start=expected_start
        )
        if self._check.probe is not None:
            writer.set_probe(self._check.probe)
        writer.set_verification(self.verify_mode, "failed" if problem else "passed", problem)
        if problem:
            bundle = writer.final_path if job is None else job.final_path
            warnings.warn(
                f"the workload cannot replay the ring's bundle {bundle}: {problem}",
                stacklevel=5,
            )

    def _free_dump_path(self, number: int) -> Path:
        base = Path(self.path)
        while True:
            name = base if number == 1 else base.with_name(f"{base.stem}-{number}{base.suffix}")
            partial = name.with_name(name.name + PARTIAL_SUFFIX)
            if self._overwrite or not (name.exists() or partial.exists()):
                return name
            number += 1


def dump_trigger(
    reason: str, source: str, held: list[HeldStep], size: int, window: tuple[str, str | None]
) -> Trigger:
    """What asked for a dump of ``held`` from a ring of ``size`` steps, and where its
    ``window`` starts (``StepRing.window_note``)."""
    anchor, note = window
    return Trigger(
        reason=_shortened(reason, Trigger.REASON_LIMIT),
        source=_shortened(source, 64),
        step=held[-1].index,
        ring=size,
        anchor=anchor,
        note=None if note is None else _shortened(note, Trigger.REASON_LIMIT),
        # written where they say more than a copy of the state (the default, and older bundles)
        absent=frozenset(
            (["note"] if note is None else []) + (["anchor"] if anchor == "snapshot" else [])
        ),
    )


def _shortened(text: str, limit: int) -> str:
    """At most ``limit`` characters (a detector's reason may name every parameter)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
