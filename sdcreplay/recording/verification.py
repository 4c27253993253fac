"""The proof that a recording can be replayed: its first step re-executed from the bundle.

A loop may do things its workload's step does not (clip gradients, step a scheduler
outside it, keep an EMA); its bundle would then replay as a corruption. So the
Recorder has the bundle's first step re-executed through the workload by a
``ReplaySession``, as `sdcreplay replay` would, in this process, on the same device
(which is why recording comes after replay), and says where the two steps part and
what likely causes it. The same re-execution notes the step's distinct operator calls for
the kernel probe (capture/probe.py), which the bundle keeps as evidence of how this
device computes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..bundle.reader import Bundle
from ..capture import determinism
from ..capture.layers import grads_entering, state_digests
from ..capture.message import Message
from ..capture.probe import collecting_calls, record_probe
from ..capture.signature import at_level, is_program_entry
from ..compare.compiled_code import code_differences
from ..errors import MessageOrderError, SdcReplayError, message_of
from ..replay.session import ReplaySession


class FirstStepCheck:
    """Re-executes a bundle's first step against the loop's ``model``, ``optimizer`` and
    ``state_objects`` (under ``inject``, the recording device's faults; ``distributed``: with
    the step's collectives, whose messages must match too)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state_objects: dict[str, Any],
        *,
        device: torch.device,
        label: str,
        inject: Sequence[str],
        distributed: bool,
    ):
        self.model, self.optimizer, self.state_objects = model, optimizer, state_objects
        self.device, self.label = device, label
        self._inject = list(inject)
        self._distributed = distributed
        self.probe: dict | None = None  # the last re-execution's kernel probe (sdcreplay.probe/1)

    def problem(
        self,
        bundle_path: Path,
        *,
        live_state: bool,
        expected_start: dict[str, str] | None = None,
    ) -> str | None:
        """Re-execute the bundle's first step; ``live_state``: the loop's state must also equal
        replay's after it (true only while the loop is at the start of its second step);
        ``expected_start``: the digests the parameters and buffers the bundle starts from must
        have (a window anchored on the loop's checkpoint: the state when it was saved)."""
        # Building the workload reseeds the generators; the loop goes on from its own states.
        saved = determinism.capture_rng(self.device)
        try:
            return self._reexecute_first_step(bundle_path, live_state, expected_start)
        finally:
            determinism.restore_rng(saved, self.device)

    def _reexecute_first_step(
        self, bundle_path: Path, live_state: bool, expected_start: dict[str, str] | None
    ) -> str | None:
        """Replay the first step as `sdcreplay replay` would, in this process: what differs, or
        None."""
        try:
            session = ReplaySession(Bundle.open(bundle_path), self.label, inject=self._inject)
        except SdcReplayError as exc:
            return f"replay cannot rebuild this recording: {exc.message}"
        try:
            if sorted(session.workload.state) != sorted(self.state_objects):
                return (
                    f"the workload's state objects are {sorted(session.workload.state)}, the "
                    f"Recorder was given {sorted(self.state_objects)}: pass the same, by the same "
                    f"names (Recorder(..., state=workload.state))"
                )
            if expected_start is not None:
                problem = _start_difference(session, expected_start)
                if problem is not None:
                    return problem
            record = session.bundle.steps[0]
            collected: list = []

            @contextlib.contextmanager
            def collecting() -> Iterator[None]:  # entered where the step runs (its thread)
                with collecting_calls(self.device) as calls:
                    collected.append(calls)
                    yield

            try:
                replayed = session.run_step(record, within=collecting())
            except MessageOrderError as exc:
                return exc.message + self._unknown_ddp_note(session.bundle)
            except Exception as exc:  # the workload's own code: a finding, not a crash
                return f"the workload's step raised {type(exc).__name__}: {message_of(exc)}"
            self.probe = record_probe(list(collected[0].calls.values()), self.device).to_json()
            differences = code_differences(
                session.bundle.compiled_regions, session.compiled.regions()
            )
            if differences:  # the same process compiled the same model into other code
                return f"the re-executed step ran other compiled code: {differences[0]}"
            log = session.bundle.signature_log()
            recorded = log.steps[record.index]  # replay holds every layer, the record its level
            replayed = [(name, digest) for name, digest in replayed if at_level(name, log.level)]
            problem = describe_first_difference(recorded, replayed)
            if problem is None and self._distributed:
                problem = describe_message_difference(
                    session.bundle.messages()[record.index], session.last_messages
                )
                problem = problem and problem + self._unknown_ddp_note(session.bundle)
            if problem is None and live_state:
                problem = self._state_difference(session)
            return problem
        finally:
            session.close()

    @staticmethod
    def _unknown_ddp_note(bundle: Bundle) -> str:
        """Why a job's collectives may differ from a fresh workload's although its step is the
        same: a DDP the Recorder does not know of had trained before the first step."""
        info = bundle.manifest.distributed
        if info is None or info.ddp_iterations_before is not None:
            return ""
        return (
            " (if a DistributedDataParallel trained before this recording began, it issues "
            "other collectives than a fresh one: give it to the Recorder as model= or "
            "data_parallel=)"
        )

    def _state_difference(self, session: ReplaySession) -> str | None:
        """Does replay's state equal the loop's as the next step begins?"""
        live = state_digests(self.model, self.state_objects, self.optimizer)
        replayed = state_digests(session.model, session.workload.state, session.optimizer)
        for name, digest in live.items():
            # Hyperparameters are set back as each step begins (capture/around.py): the loop may
            # already have set the next step's (a schedule outside the step).
            if replayed.get(name) != digest and not name.startswith("hyper:"):
                return (
                    f"{name} differs after the first step although every entry of the step "
                    f"matched: the loop changes it where the workload's step does not (an EMA? "
                    f"a scheduler? a manual edit, or something done after the block?)"
                )
        if session.workload.train_step is not None:
            loop, replay = grads_entering(self.model), grads_entering(session.model)
            if loop != replay:
                return (
                    f"the gradients enter the second step as {loop!r} in the loop but {replay!r} "
                    f"after the workload's step: the loop zeroes (or keeps) gradients outside it"
                )
        return None


def _start_difference(session: ReplaySession, expected: dict[str, str]) -> str | None:
    """Does the checkpoint the bundle references hold the state the loop had as it said it
    saved it?"""
    loaded = state_digests(session.model)
    changed = next((name for name, digest in expected.items() if loaded.get(name) != digest), None)
    if changed is None:
        return None
    state = session.bundle.manifest.state
    return (
        f"{changed} in checkpoint {getattr(state, 'path', '?')} differs from the model's when "
        "checkpoint_saved() was called: the checkpoint holds another state (saved before the "
        "optimizer step, of another model, or written again since?)"
    )


def describe_first_difference(
    recorded: list[tuple[str, str]], replayed: list[tuple[str, str]]
) -> str | None:
    """The first entry where the workload's step differs from the loop's, and its likely cause."""
    names = [name for name, _ in recorded]
    if names != [name for name, _ in replayed]:
        position = next(
            (i for i, (a, (b, _)) in enumerate(zip(names, replayed)) if a != b),
            min(len(names), len(replayed)),
        )

        def at(entries: list) -> str:
            return entries[position][0] if position < len(entries) else "(end of step)"

        return (
            f"the loop's step has {at(recorded)!r} where the workload's step has {at(replayed)!r} "
            f"(entry {position}): they run different programs (another number of backward passes, "
            f"an optimizer step inside vs outside the step, a skipped step?)"
        )
    differing = [name for (name, a), (_, b) in zip(recorded, replayed) if a != b]
    if not differing:
        return None
    first = differing[0]
    kind = first.split(":", 1)[0]
    if is_program_entry(first):
        cause = (
            "the loop changes hyper-parameters or a state object outside the workload's step "
            "(a scheduler? a GradScaler?)"
        )
    elif kind == "step_grad":
        cause = (
            "every grad: matched: the loop changes gradients between backward() and "
            "optimizer.step() "
            "outside the workload's step (clipping? GradScaler unscaling?)"
        )
    elif kind in ("param", "buffer", "optim"):
        cause = (
            "every grad: matched: the loop changes gradients or parameters outside the workload's "
            "step (clipping? a scheduler? an EMA?)"
        )
    else:
        cause = (
            "the workload's forward/backward differs from the loop's (another loss_fn, batch "
            "transform or autocast), or this device computed differently in one of the two runs"
        )
    return f"{first} differs: {cause}"


def describe_message_difference(recorded: list[Message], replayed: list[Message]) -> str | None:
    """The first collective message whose digests differ between the loop's step and the
    workload's (their order was enforced while the step ran)."""
    for loop, workload in zip(recorded, replayed):
        for which in ("input", "output"):
            if getattr(loop, f"{which}_digest") != getattr(workload, f"{which}_digest"):
                return (
                    f"the {which} of collective message {loop.record_id} ({loop.brief()}) "
                    "differs: the loop's step sends other data than the workload's"
                )
    return None
