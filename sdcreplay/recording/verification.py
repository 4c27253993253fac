"""The proof that a recording can be replayed: its first step re-executed from the bundle.

A loop may do things its workload's step does not (clip gradients, step a scheduler
outside it, keep an EMA), or depend on what its bundle does not keep (a variable of the
environment a launcher set, a file); its bundle would then replay as a corruption and accuse
a healthy device. So the Recorder has the bundle's first step replayed the way
`sdcreplay replay` replays it: in a fresh device process (replay/processes.py, which is why
recording sits above replay), from the bundle alone, with the recorded command, working
directory and environment (capture/environment.py), on the recording's device label
(``SDCREPLAY_VERIFY_DEVICE`` names another, for a GPU without the memory for a second copy),
and says where the two steps part and what likely causes it, naming the variables set while
recording that the bundle does not keep. The same re-execution notes the step's distinct
operator calls for the kernel probe (capture/probe.py), which the bundle keeps as evidence of
how this device computes them. A job's rank re-executes in its own process instead, with the
step's collectives among the job's live ranks; a job of one rank (a one-process torchrun)
re-executes in a fresh process too, as rank 0 of a world of one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..bundle.reader import Bundle
from ..capture import comparable, determinism, environment
from ..capture.layers import grads_entering, state_digests
from ..capture.message import Message
from ..capture.probe import collecting_calls, record_probe
from ..capture.signature import at_level, is_program_entry
from ..compare.compiled_code import code_differences
from ..devices import validate_label
from ..errors import MessageOrderError, SdcReplayError, message_of
from ..replay.alone import join_alone
from ..replay.processes import run_device_processes
from ..replay.replicas import progress_timeout
from ..replay.session import ReplaySession
from ..replay.worker import device_task
from ..storage.rundir import temporary_run_dir

VERIFY_DEVICE_ENV = "SDCREPLAY_VERIFY_DEVICE"
"""The device label the first-step check's process runs on, when not the recording's."""


@dataclass
class Reexecution:
    """What re-executing the first step found: the difference (None: none), the kernel probe,
    and the replayed state after the step (its digests, the gradients entering the next)."""

    problem: str | None
    probe: dict | None = None
    state: dict[str, str] = field(default_factory=dict)
    grads: str | None = None  # grads_entering, for a workload with its own train_step

    def to_json(self) -> dict:
        return {
            "problem": self.problem,
            "probe": self.probe,
            "state": self.state,
            "grads": self.grads,
        }


class FirstStepCheck:
    """Re-executes a bundle's first step and compares it with the loop's ``model``,
    ``optimizer`` and ``state_objects`` (under ``inject``, the recording device's faults;
    ``distributed``: a job's rank, in this process with the step's collectives, whose
    messages must match too)."""

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
        arguments: dict[str, Any] = {
            "bundle": str(bundle_path),
            "inject": self._inject,
            "state_names": sorted(self.state_objects),
            "expected_start": expected_start,
        }
        if self._distributed and torch.distributed.get_world_size() > 1:
            # Building the workload reseeds the generators; the loop goes on from its own.
            saved = determinism.capture_rng(self.device)
            try:
                found = reexecute_first_step(device=self.label, distributed=True, **arguments)
            finally:
                determinism.restore_rng(saved, self.device)
        else:  # a job of one rank (one torchrun process) is a world of one there too
            arguments["world_of_one"] = self._distributed
            found = self._in_fresh_process(bundle_path, arguments)
        self.probe = found.probe
        if found.problem is None and live_state:
            return self._state_difference(found)
        return found.problem

    def _in_fresh_process(self, bundle_path: Path, arguments: dict) -> Reexecution:
        """The re-execution in a device process of its own, as a replay runs it; what it
        cannot do is the problem, with the variables the bundle did not keep as candidates."""
        work: Path | None = None
        try:
            opened = Bundle.open(bundle_path)
            label = validate_label(os.environ.get(VERIFY_DEVICE_ENV) or self.label)
            work = temporary_run_dir("verify")
            results = run_device_processes(
                "verify",
                run_first_step_task,
                [label],
                lambda _: arguments,
                work,
                environment=comparable.pinned_environment(opened.manifest.fingerprint),
                timeout=progress_timeout(opened),
            )
        except Exception as exc:  # the loop goes on (strict mode refuses the bundle)
            return Reexecution(f"the first-step check could not run: {message_of(exc)}")
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)  # the device's log: its tail is said
        result = results[label]
        if result.error is None:
            assert result.value is not None
            found = Reexecution(**result.value)
        else:
            failure = result.error
            said = (
                f" (it said: {failure.stderr_tail.splitlines()[-1]})" if failure.stderr_tail else ""
            )
            found = Reexecution(
                f"a fresh process replaying the bundle failed: {failure.message}{said}"
            )
        if found.problem is not None:
            found.problem += _unkept_note(opened)
        return found

    def _state_difference(self, found: Reexecution) -> str | None:
        """Does replay's state equal the loop's as the next step begins?"""
        live = state_digests(self.model, self.state_objects, self.optimizer)
        for name, digest in live.items():
            # Hyperparameters are set back as each step begins (capture/around.py): the loop may
            # already have set the next step's (a schedule outside the step).
            if found.state.get(name) != digest and not name.startswith("hyper:"):
                return (
                    f"{name} differs after the first step although every entry of the step "
                    f"matched: the loop changes it where the workload's step does not (an EMA? "
                    f"a scheduler? a manual edit, or something done after the block?)"
                )
        if found.grads is not None:
            loop = grads_entering(self.model)
            if loop != found.grads:
                return (
                    f"the gradients enter the second step as {loop!r} in the loop but "
                    f"{found.grads!r} after the workload's step: the loop zeroes (or keeps) "
                    "gradients outside it"
                )
        return None


def _unkept_note(bundle: Bundle) -> str:
    """The variables of this (the recording's) process a replay of its script does not get
    (a factory is rebuilt from its arguments: nothing to say)."""
    workload = bundle.manifest.workload
    if not workload.is_script:
        return ""
    unkept = environment.unkept(os.environ, (workload.command or {}).get("env", {}))
    if not unkept:
        return ""
    return (
        f". The check replayed in a fresh process with the bundle's environment only; "
        f"{unkept} (if the loop depends on one: keep a loop's own with "
        'Recorder(..., env=["NAME*"]))'
    )


@device_task
def run_first_step_task(
    device: str,
    bundle: str,
    inject: Sequence[str],
    state_names: list[str],
    expected_start: dict[str, str] | None,
    world_of_one: bool = False,
) -> dict:
    """In the check's device process: the first step re-executed from the bundle
    (``world_of_one``: a one-rank job's, as rank 0 of a world of one, which is what its
    collectives computed)."""
    if not world_of_one:
        return reexecute_first_step(device, bundle, inject, state_names, expected_start).to_json()
    join_alone(0, 1, device)
    try:
        found = reexecute_first_step(
            device, bundle, inject, state_names, expected_start, distributed=True
        )
    finally:
        torch.distributed.destroy_process_group()
    return found.to_json()


def reexecute_first_step(
    device: str,
    bundle: str,
    inject: Sequence[str],
    state_names: list[str],
    expected_start: dict[str, str] | None,
    distributed: bool = False,
) -> Reexecution:
    """Replay the first step as `sdcreplay replay` would, in this process: what differs."""
    try:
        session = ReplaySession(Bundle.open(bundle), device, inject=inject)
    except SdcReplayError as exc:
        return Reexecution(f"replay cannot rebuild this recording: {exc.message}")
    try:
        if sorted(session.workload.state) != state_names:
            return Reexecution(
                f"the workload's state objects are {sorted(session.workload.state)}, the "
                f"Recorder was given {state_names}: pass the same, by the same "
                f"names (Recorder(..., state=workload.state))"
            )
        if expected_start is not None:
            problem = _start_difference(session, expected_start)
            if problem is not None:
                return Reexecution(problem)
        record = session.bundle.steps[0]
        collected: list = []

        @contextlib.contextmanager
        def collecting() -> Iterator[None]:  # entered where the step runs (its thread)
            with collecting_calls(session.device) as calls:
                collected.append(calls)
                yield

        try:
            replayed = session.run_step(record, within=collecting())
        except MessageOrderError as exc:
            return Reexecution(exc.message + _unknown_ddp_note(session.bundle))
        except Exception as exc:  # the workload's own code: a finding, not a crash
            return Reexecution(
                f"the workload's step raised {type(exc).__name__}: {message_of(exc)}"
            )
        probe = record_probe(list(collected[0].calls.values()), session.device).to_json()
        found = Reexecution(None, probe)
        differences = code_differences(session.bundle.compiled_regions, session.compiled.regions())
        if differences:  # the same model compiled into other code
            found.problem = f"the re-executed step ran other compiled code: {differences[0]}"
            return found
        log = session.bundle.signature_log()
        recorded = log.steps[record.index]  # replay holds every layer, the record its level
        replayed = [(name, digest) for name, digest in replayed if at_level(name, log.level)]
        found.problem = describe_first_difference(recorded, replayed)
        if found.problem is None and distributed:
            problem = describe_message_difference(
                session.bundle.messages()[record.index], session.last_messages
            )
            found.problem = problem and problem + _unknown_ddp_note(session.bundle)
        found.state = state_digests(session.model, session.workload.state, session.optimizer)
        if session.workload.train_step is not None:
            found.grads = grads_entering(session.model)
        return found
    finally:
        session.close()


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
