"""The ring buffer's side of the Recorder: the last steps in memory, a bundle only when asked.

``Recorder(ring=K)`` holds its steps in a ``ring.StepRing`` and writes nothing while it
records. Each window of held steps starts from a state replay can load: a copy taken as a
step begins (every K steps), or, once the loop says it saved one
(``checkpoint_saved(path)``), the job's own checkpoint, which a dump references by SHA-256
(anchors.py). ``dump(reason)`` writes the held steps as a bundle (dump.py); ``rewind()`` takes
the last one back for a detector that runs it again.
"""

from __future__ import annotations

import itertools
import json
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..bundle.jobs import RankExchange
from ..capture.collectives import MessageLog
from ..capture.layers import SignatureCapture, grads_entering, state_digests
from ..capture.operators import _own_work
from ..errors import SdcReplayError, message_of
from ..ledger.notes import note
from ..ledger.verdicts import dump_record
from .anchors import CheckpointAnchor
from .dump import dump_trigger
from .ring import HeldRange, HeldStep, RingSnapshot, common_window, steps_text

if TYPE_CHECKING:
    from .dump import RingDumper
    from .ring import StepRing

_job_dumps = itertools.count()
"""Job dumps asked in this process: every rank asks them in the same order, so the n-th
one's store keys are the same on every rank."""


FAILED_SUFFIX = ".dump-failed.txt"


class DumpFailedWarning(UserWarning):
    """A ring's dump failed: why is written beside its bundle's path; the loop goes on."""


class RingMode:
    """The Recorder's ring methods (it sets these attributes)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    state_objects: dict[str, Any]
    path: Path
    dumps: list[Path]
    steps_written: int
    entries_written: int
    _ring: StepRing | None
    _dumper: RingDumper | None
    _capture: SignatureCapture
    _messages: MessageLog | None
    _in_block: bool
    _next_index: int
    _ring_problem: str | None
    _end_digests: dict[str, str] | None
    _held_end_digests: dict[str, str] | None
    _earlier_end_digests: dict[str, str] | None
    _ledger: bool
    label: str
    injected_faults: list[str]
    _copy_in_flight: RingSnapshot | None = None  # a window's copy the update must await
    _copy_failure: str | None = None  # why the last copy of the state failed, while it does

    def _finish_pending(self, at_optimizer_step: bool = False) -> None:
        """The Recorder's: write the step that ended."""

    def _ring_step_begins(self, grads: str) -> None:
        assert self._ring is not None
        if self._capture.step_open and not self._continues_held_steps():
            self._ring.clear()  # the previous step raised mid-way and left the state changed
        if self._ring.wants_snapshot(grads):
            try:
                with _own_work():  # not the step's operators (an OperatorMode may be active)
                    snapshot = RingSnapshot.copy(self.model, self.optimizer, self.state_objects)
            except Exception as exc:  # never into the loop: the held steps go on instead
                self._copy_failed(exc)
                return
            self._copy_failure = None
            self._ring.open_window(snapshot)
            self._copy_in_flight = snapshot if snapshot.pending is not None else None

    def _copy_failed(self, exc: Exception) -> None:
        """The state could not be copied as a step began: the held steps go on from the last
        copy (at most ``max_window`` of them, then the ring starts over and a dump says why it
        holds none); warned once until a copy succeeds."""
        assert self._ring is not None
        if len(self._ring.steps) >= self._ring.max_window:
            self._ring.clear()
        failure = f"{type(exc).__name__}: {message_of(exc)}"
        if self._copy_failure is None:
            warnings.warn(
                f"sdcreplay: the ring could not copy the state as step {self._next_index} "
                f"began, training goes on: {failure} (its held steps go on from its last copy, "
                f"at most max_window={self._ring.max_window}, until a copy succeeds)",
                DumpFailedWarning,
                stacklevel=4,
            )
        self._copy_failure = failure

    def _update_begins(self) -> None:
        """The optimizer's step pre-hook: its update must not overwrite what a window's copy
        is still reading (the device waits; the host does not)."""
        if self._copy_in_flight is not None:
            self._copy_in_flight.before_update()
            self._copy_in_flight = None

    def _continues_held_steps(self) -> bool:
        """Are parameters and buffers as the last held step left them (a step that raised
        before its optimizer step, e.g. stopped by a detector, changed none)? Unknown without
        verification: then no."""
        held = self._held_end_digests
        return held is not None and state_digests(self.model) == held

    def checkpoint_saved(self, path: str | Path) -> None:
        """The loop just saved a checkpoint at ``path`` (a ``torch.save`` file of
        ``{"model", "optimizer"}`` or a Lightning checkpoint, a Hugging Face Trainer checkpoint
        directory, a ``torch.distributed.checkpoint`` directory of ``{"model", "optimizer"}``),
        between two steps: the ring's window starts there from now on, holding every step
        since (at most ``max_window``), and a dump references the checkpoint by SHA-256
        instead of copying the state. Call it right after the save, before the next step."""
        if self._ring is None:
            raise SdcReplayError(
                "checkpoint_saved() anchors a ring buffer's window; this Recorder writes every "
                "step from the state it started with",
                "Create it with Recorder(..., ring=K) (a recording to disk takes checkpoint= "
                "for the checkpoint it starts from).",
            )
        if self._in_block:
            raise SdcReplayError(
                "checkpoint_saved() inside a step's block: a window starts between two steps",
                "Call it right after saving the checkpoint, before the next recorder.step().",
            )
        if self._messages is not None:
            raise SdcReplayError(
                "checkpoint_saved() under torch.distributed: a job's ring anchors its windows "
                "on copies of each rank's state for now",
                "Leave it out under torchrun; the ring copies the state every K steps.",
            )
        self._finish_pending()
        if grads_entering(self.model) == "kept":
            warnings.warn(
                f"sdcreplay: checkpoint {path} was saved with gradients accumulated, which it "
                "does not hold: the ring's window does not start there",
                stacklevel=2,
            )
            return
        with _own_work():
            anchor = CheckpointAnchor.saved(path, self.model, self.state_objects, self._next_index)
        self._ring.anchor(anchor)

    def rewind(self) -> None:
        """Forget the last completed step: a detector rolled the state back to before it, to
        run it again inside ``step()`` under the same index (dump first to keep it). The
        held steps then end where the step before it ended, so a later step that raised
        mid-way (a detector stopping it again) still continues them."""
        if self._ring is None:
            raise SdcReplayError(
                "rewind() needs a ring buffer: a step written to disk is not taken back",
                "Create the Recorder with ring=K.",
            )
        self._finish_pending()
        dropped = self._ring.drop_last()
        if dropped is None and self._copy_failure is None:
            raise SdcReplayError("the ring holds no completed step to rewind")
        # With no copy of the state, the ring held no step: the index goes back all the same.
        self._next_index = self._next_index - 1 if dropped is None else dropped.index
        self._end_digests = None
        self._held_end_digests, self._earlier_end_digests = self._earlier_end_digests, None
        self.steps_written -= 1
        self.entries_written -= 0 if dropped is None else len(dropped.entries)

    @property
    def ring_nbytes(self) -> int:
        """Bytes the ring holds: snapshots' and batches' tensors, RNG states, signature
        characters (0 without a ring)."""
        return 0 if self._ring is None else self._ring.nbytes

    @property
    def ring_steps(self) -> list[int]:
        """The steps a dump now would write, oldest first."""
        return [] if self._ring is None else [step.index for step in self._ring.steps]

    def dump(self, reason: str, *, source: str = "user") -> Path | None:
        """Write the ring's steps as a complete bundle and return its path; never raises into
        the loop for a dump that fails (no completed step held, the bundle's write, its
        verification...): then warns (``DumpFailedWarning``), writes why beside the bundle's
        path (``PATH.dump-failed.txt``) and returns None.

        The first dump goes to ``path``, later ones to ``path`` with ``-2``, ``-3``... before
        the suffix (a name already taken is skipped unless ``overwrite``). A step whose block
        has not ended is not in it (its evidence is incomplete). The bundle's first step is
        re-executed from the bundle as the verification; a failure is written in the bundle
        and warned about, never raised: the alarm that asked for the dump matters more. A
        window anchored on a checkpoint references it (and the verification also checks it
        holds the state the loop had when it was saved).

        Under torch.distributed every rank must call it, outside a step's block, at the same
        step: each writes its held steps as its part of one job bundle (rank 0 names it), and
        the ranks re-execute their parts' first step together (its collectives need them all).
        Ranks that call it at different steps write the steps they all hold (warned, and
        noted in the trigger), or, holding none in common, nothing: the refusal, naming each
        rank's steps, is warned about on every rank and the dump returns None.
        """
        if self._ring is None:
            raise SdcReplayError(
                "dump() needs a ring buffer: this Recorder writes every step as it goes",
                "Create it with Recorder(..., ring=K) to keep the last K steps in memory.",
            )
        if self._messages is not None and self._in_block:
            raise SdcReplayError(
                "dump() under torch.distributed inside a step's block: the ranks re-execute the "
                "dumped steps together, with collectives of their own",
                "Call dump() on every rank after the step's block ended.",
            )
        try:
            self._finish_pending()
            window = self._ring.window_note()
            if self._messages is None:
                held, start = self._ring.steps, self._ring.start
            else:
                try:
                    held, start, aligned = self._job_window()
                except SdcReplayError as refused:  # every rank refuses alike
                    warnings.warn(
                        f"sdcreplay: the ring's dump ({reason}) wrote nothing: "
                        f"{refused.message} (Hint: {refused.hint})",
                        DumpFailedWarning,
                        stacklevel=2,
                    )
                    return None
                window = window if aligned is None else (window[0], aligned)
            if not held or start is None:
                copying = self._copy_failure
                raise SdcReplayError(
                    "the ring holds no completed step yet: there is nothing to write"
                    + ("" if copying is None else f" (its copy of the state failed: {copying})"),
                    "Dump after a step has ended (a step that began with accumulated gradients "
                    "cannot start a bundle)."
                    if copying is None
                    else "The ring holds steps again from the first step whose copy succeeds.",
                )
            assert self._dumper is not None
            trigger = dump_trigger(reason, source, held, self._ring.size, window)
            path = self._dumper.write(
                len(self.dumps) + 1, held, start, trigger, self._messages, self._ring_problem
            )
        except Exception as exc:  # the loop goes on: its alarm matters more than the bundle
            self._dump_failed(reason, source, exc)
            return None
        self.dumps.append(path)
        if self._ledger:
            note([dump_record(self.label, reason, str(path), held[0].index, self.injected_faults)])
        return path

    def _job_window(
        self,
    ) -> tuple[list[HeldStep], RingSnapshot | CheckpointAnchor | None, str | None]:
        """The held steps this rank's part of a job's dump holds, their start, and a note
        where the ranks dumped at different steps: the ranks tell each other what they hold
        (through the store: nothing in the message log) and write the steps they all hold,
        from a window start they share. Raises (alike on every rank) where there are none."""
        assert self._ring is not None
        mine = self._ring.held_range()
        words = RankExchange(
            f"sdcreplay/dump{next(_job_dumps)}/",
            "Call dump() on every rank (the ranks of a job dump together: agree on the alarm "
            "first, e.g. with an all-reduce of a per-rank check, as the online detectors do).",
        )
        told = [HeldRange(**json.loads(w)) for w in words.gather("held", json.dumps(vars(mine)))]
        if all(held.last is None for held in told):
            return [], None, None  # nothing anywhere: refused below, as in a single process
        dumped = ", ".join(f"rank {r} holding {held.describe()}" for r, held in enumerate(told))
        window = common_window(told)
        if window is None:
            raise SdcReplayError(
                f"the ranks dumped at different steps and hold no steps in common ({dumped}): "
                "a job bundle's parts must hold the same steps",
                "Dump on every rank at the same step: agree on the alarm first (an all-reduce "
                "of each rank's check, as the online detectors do), then call rec.dump() on "
                "every rank; or keep more steps (ring=K larger than the ranks' difference).",
            )
        first, last = window
        start, held = self._ring.between(first, last)
        if len({held.last for held in told}) == 1:
            return held, start, None
        later = ", ".join(
            f"rank {r}'s {steps_text(last + 1, h.last)}"
            for r, h in enumerate(told)
            if h.last is not None and h.last > last
        )
        text = (
            f"the ranks dumped at different steps ({dumped}): every part holds "
            f"{steps_text(first, last)}, the steps all ranks hold"
        )
        warnings.warn(f"sdcreplay: {text}; left out: {later}", stacklevel=3)
        return held, start, text

    def _dump_failed(self, reason: str, source: str, exc: Exception) -> None:
        """Write why a dump failed beside the bundle it would have been (appended to
        ``PATH.dump-failed.txt``, a rank's own under torch.distributed), and warn."""
        rank = f".rank{torch.distributed.get_rank()}" if self._messages is not None else ""
        failed = self.path.with_name(f"{self.path.name}{rank}{FAILED_SUFFIX}")
        said = message_of(exc)
        hint = f"\nHint: {exc.hint}" if isinstance(exc, SdcReplayError) else ""
        try:
            with open(failed, "a", encoding="utf-8") as out:
                out.write(
                    f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} dump before step {self._next_index} "
                    f"({source}: {reason}) failed: {type(exc).__name__}: {said}{hint}\n"
                    f"{''.join(traceback.format_exception(exc))}\n"
                )
            where = f"written to {failed}"
        except OSError as error:
            where = f"and could not be written to {failed}: {error}"
        warnings.warn(
            f"sdcreplay: the ring's dump ({source}: {reason}) failed, training goes on: "
            f"{type(exc).__name__}: {said} ({where})",
            DumpFailedWarning,
            stacklevel=3,
        )
