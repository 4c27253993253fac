"""The Recorder: the hook a training loop uses to write a trace bundle.

```python
rec = sdcreplay.Recorder("run.bundle", workload="mytrain:make_workload", model=model,
                         optimizer=opt, state={"scheduler": sched})
for batch in loader:
    with rec.step(batch):
        loss = train_step(batch)  # the whole step: backward, clipping, opt.step(), sched.step()
rec.close()
```
A step ends when the block exits, or at the optimizer step right after it
(``with rec.step(b): loss.backward()`` then ``opt.step()``), and is written
then, so a run that dies later keeps every step that completed.

By default the recording proves it can be replayed: at the start of the
second step (or at ``close()``) the first step is re-executed through the
workload's own step from the saved state, on the same device, and every
signature entry compared; at the start of every later step the parameters and
buffers must equal their digests at the end of the previous one. A loop that
does something its workload's step does not raises WorkloadMismatchError.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from . import determinism
from .bundle import (
    Bundle,
    BundleWriter,
    CaptureSettings,
    CheckpointState,
    Environment,
    Switches,
    WorkloadRef,
    checkpoint_reference,
    load_checkpoint,
    part_dir,
)
from .capture import OperatorMode, SignatureCapture, grads_entering, state_digests
from .collectives import Message, MessageLog
from .devices import torch_device
from .digest import algorithm_for
from .errors import CheckpointError, FaultSpecError, SdcReplayError, WorkloadMismatchError
from .faults import Injector, parse_specs
from .jobs import JobRecording, distributed_job
from .replay import ReplaySession
from .signature import is_program_entry
from .tensorio import map_tensors
from .workload import accepts_seed, build_workload, canonical_ref, check_state_objects

VERIFY_MODES = {True: "on", "warn": "warn", False: "off"}


class Recorder:
    """Writes the steps of a training loop into a bundle at ``path``.

    ``workload`` names the factory replay will call (with ``workload_kwargs``) to
    rebuild the model, optimizer and state objects; the state they start from
    is embedded in the bundle, or referenced by SHA-256 when ``checkpoint`` is
    the file the model and optimizer were just loaded from. ``state`` names the
    loop's other stateful objects (schedulers, a GradScaler, an EMA model...),
    under the names the workload gives them. ``verify`` (True, ``"warn"`` or
    False) checks that the workload's step reproduces the loop's (module
    docstring); ``inject`` is the recording device's faults (`sdcreplay record
    --inject`), which the check re-executes under too.
    """

    def __init__(
        self,
        path: str | Path,
        workload: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        state: Mapping[str, Any] | None = None,
        workload_kwargs: dict | None = None,
        checkpoint: str | Path | None = None,
        device_label: str | None = None,
        start_step: int = 0,
        max_depth: int | None = None,
        deterministic: bool = True,
        overwrite: bool = False,
        verify: bool | str = True,
        inject: Sequence[str] = (),
    ):
        if verify not in VERIFY_MODES:
            raise SdcReplayError(f"verify={verify!r} is not one of True, 'warn', False")
        first_param = next(model.parameters())
        self.device = first_param.device
        self.model, self.optimizer = model, optimizer
        self.state_objects = check_state_objects(dict(state or {}), "Recorder")
        self.label = device_label or str(self.device)
        self.verify_mode = VERIFY_MODES[verify]
        self._inject = list(inject)
        switches = determinism.enable() if deterministic else determinism.current_switches()
        workload_ref = WorkloadRef(ref=canonical_ref(workload), kwargs=dict(workload_kwargs or {}))
        # Under torch.distributed this rank writes its part of a job bundle at `path`, with
        # every collective of its steps in a message log (jobs.py, collectives.py).
        self._job = (
            JobRecording(Path(path), workload_ref, self.label, overwrite)
            if distributed_job()
            else None
        )
        self._messages = MessageLog(algorithm_for(self.device.type)) if self._job else None
        self._writer = BundleWriter(
            self._job.part_path if self._job else Path(path),
            workload=workload_ref,
            device=self.label,
            device_type=self.device.type,
            digest=algorithm_for(self.device.type),
            environment=Environment(**determinism.environment(self.device)),
            determinism=Switches(**switches),
            fingerprint=determinism.fingerprint(self.device),
            capture=CaptureSettings(max_depth=max_depth, program=True),
            overwrite=overwrite,
            distributed=self._job.distributed if self._job else None,
        )
        objects = {name: obj.state_dict() for name, obj in self.state_objects.items()}
        if checkpoint is not None:
            reference = checkpoint_reference(Path(checkpoint))
            _check_model_matches_checkpoint(model, reference)
            self._writer.reference_checkpoint(reference, objects)
        else:
            self._writer.embed_state(model.state_dict(), optimizer.state_dict(), objects)
        status = "pending" if self.verify_mode != "off" else "off"
        self._writer.set_verification(self.verify_mode, status)
        self._capture = SignatureCapture(
            model, optimizer, max_depth=max_depth, state=self.state_objects, program=True
        )
        # Right after the capture's own post-hook: nothing runs between the two.
        self._hook: RemovableHandle | None = optimizer.register_step_post_hook(
            lambda *_: self._finish_pending(at_optimizer_step=True)
        )
        self._next_index = start_step
        self._first_index = start_step
        self._pending: tuple[int, Any, determinism.RngState, str, float] | None = None
        self._verify_due = False
        self._end_digests: dict[str, str] | None = None
        self.steps_written = 0
        self.entries_written = 0
        self.path: Path = self._job.path if self._job else self._writer.path

    @contextlib.contextmanager
    def step(self, batch: Any) -> Iterator[None]:
        """Record one training step: the block, and the optimizer step right after a block
        without one."""
        self._finish_pending()
        self.verify()
        self._check_unchanged_since_last_step()
        grads = grads_entering(self.model)
        if self._next_index == self._first_index and grads == "kept" and self.verify_mode != "off":
            self._mismatch(
                "the first recorded step begins with gradients accumulated before it, which "
                "the bundle does not hold: start recording at an optimizer-step boundary "
                "(after zero_grad)"
            )
        started = time.perf_counter()
        rng = determinism.capture_rng(self.device)
        stored_batch = map_tensors(batch, lambda t: t.detach().to("cpu", copy=True))
        self._capture.begin_step(rng)
        if self._messages is not None:
            self._messages.begin_step(self._next_index)
        with self._capture.backward_capture():
            yield
        self._capture.close_window()
        self._pending = (self._next_index, stored_batch, rng, grads, started)
        self._next_index += 1
        if self._capture.optimizer_stepped:
            self._finish_pending()

    def _finish_pending(self, at_optimizer_step: bool = False) -> None:
        """Write the step that ended; ``at_optimizer_step``: called from the optimizer's hook."""
        if self._pending is None:
            return
        index, batch, rng, grads, started = self._pending
        self._pending = None
        stepped = self._capture.optimizer_stepped
        entries = self._capture.end_step()
        messages = self._messages.end_step() if self._messages is not None else None
        seconds = time.perf_counter() - started  # replay derives its hang timeout from it
        self._writer.add_step(
            index,
            batch,
            rng,
            entries,
            optimizer_step=stepped,
            grads=grads,
            seconds=seconds,
            messages=messages,
        )
        self.steps_written += 1
        self.entries_written += len(entries)
        self._verify_due = self.steps_written == 1 and self.verify_mode != "off"
        if self.verify_mode != "off":
            # From the optimizer's hook, the parameters and buffers are still as the capture
            # digested them a moment ago: its entries are their digests, not hashed again.
            updated = self._capture.updated_state if at_optimizer_step else {}
            self._end_digests = updated or state_digests(self.model)

    @property
    def own_bundle_path(self) -> Path:
        """The bundle this process wrote: ``path``, or its rank's part of a job bundle."""
        if self._job is None:
            return self.path
        return self.path / part_dir(self._job.rank)

    def verify(self) -> None:
        """Re-execute the first recorded step now if due (else the next ``step()``/``close()``
        does)."""
        if not self._verify_due:
            return
        self._verify_due = False
        # Building the workload reseeds the generators; the loop goes on from its own states.
        saved = determinism.capture_rng(self.device)
        try:
            problem = self._reexecute_first_step()
        finally:
            determinism.restore_rng(saved, self.device)
        if problem is None:
            self._writer.set_verification(self.verify_mode, "passed")
        else:
            self._mismatch(problem)

    def _reexecute_first_step(self) -> str | None:
        """Replay the first step as `sdcreplay replay` would, in this process: what differs, or
        None."""
        try:
            session = ReplaySession(Bundle.open(self._writer.path), self.label, inject=self._inject)
        except SdcReplayError as exc:
            return f"replay cannot rebuild this recording: {exc.message}"
        try:
            if sorted(session.workload.state) != sorted(self.state_objects):
                return (
                    f"the workload's state objects are {sorted(session.workload.state)}, the "
                    f"Recorder was given {sorted(self.state_objects)}: pass the same, by the same "
                    f"names (Recorder(..., state=workload.state))"
                )
            record = session.bundle.steps[0]
            replayed = session.run_step(record)
            recorded = session.bundle.signature_log().steps[record.index]
            problem = describe_first_difference(recorded, replayed)
            if problem is None and self._job is not None:
                problem = describe_message_difference(
                    session.bundle.messages()[record.index], session.last_messages
                )
            if problem is None:
                problem = self._state_difference(session)
            return problem
        finally:
            session.close()

    def _state_difference(self, session: ReplaySession) -> str | None:
        """Does replay's state equal the loop's as the next step begins?"""
        live = state_digests(self.model, self.state_objects, self.optimizer)
        replayed = state_digests(session.model, session.workload.state, session.optimizer)
        for name, digest in live.items():
            if replayed.get(name) != digest:
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

    def _check_unchanged_since_last_step(self) -> None:
        """Parameters and buffers must be as the previous recorded step left them."""
        if self._end_digests is None:
            return
        now = state_digests(self.model)
        changed = next(
            (name for name, digest in self._end_digests.items() if now.get(name) != digest), None
        )
        self._end_digests = None
        if changed is not None:
            self._mismatch(
                f"{changed} changed between recorded steps {self._next_index - 1} and "
                f"{self._next_index}, outside any recorded step (an EMA or a manual edit after "
                f"the block?); replay would start step {self._next_index} from another state"
            )

    def _mismatch(self, problem: str) -> None:
        self._writer.set_verification(self.verify_mode, "failed", problem)
        message = f"the workload cannot replay this recording: {problem}"
        if self.verify_mode == "warn":
            warnings.warn(message, stacklevel=3)
            return
        raise WorkloadMismatchError(message)

    def close(self) -> Path:
        """Write the last step, run a check still due, mark the bundle complete, give it its name.

        What the loop does after its last recorded step is no recorded step's business: only
        the first-step check can still be due here.
        """
        self._finish_pending()
        try:
            self.verify()
        finally:
            self._release()
        self.path = self._writer.close()
        if self._job is not None:
            self.path = self._job.close()
        return self.path

    def abandon(self) -> Path:
        """Stop after a failure: keep the steps written so far as an incomplete ``.partial``
        bundle."""
        if self._capture.step_open and self._pending is None:
            self._capture.end_step()  # a step that raised mid-way is not evidence
            if self._messages is not None:
                self._messages.abandon()
        self._finish_pending()
        self._release()
        return self.path

    def _release(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._capture.close()
            self._hook = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()


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


def _check_model_matches_checkpoint(model: torch.nn.Module, reference: CheckpointState) -> None:
    model_state, _ = load_checkpoint(reference)
    for name, tensor in model.state_dict().items():
        saved = model_state.get(name)
        if saved is None or not torch.equal(saved, tensor.detach().cpu()):
            raise CheckpointError(
                f"the model's {name} differs from checkpoint {reference.path}",
                "Load the checkpoint into the model (and optimizer) before creating the Recorder.",
            )


@dataclass
class RecordSummary:
    """What ``sdcreplay record`` wrote (``sdcreplay.record/1``)."""

    bundle: Path
    workload: str
    kwargs: dict
    device: str
    steps: int
    entries: int
    size_bytes: int
    final_loss: float | None
    verification: dict

    exit_code = 0  # a recording is never a finding

    def to_json(self) -> dict:
        return {
            "schema": "sdcreplay.record/1",
            "bundle": str(self.bundle),
            "workload": self.workload,
            "kwargs": self.kwargs,
            "device": self.device,
            "steps": self.steps,
            "entries": self.entries,
            "size_bytes": self.size_bytes,
            "final_loss": self.final_loss,
            "verification": self.verification,
        }


def record(
    workload: str,
    out: str | Path,
    *,
    steps: int = 4,
    device: str = "cpu",
    seed: int = 0,
    kwargs: dict | None = None,
    checkpoint: str | Path | None = None,
    overwrite: bool = False,
    inject: Sequence[str] = (),
    max_depth: int | None = None,
    verify: bool | str = True,
    on_step: Callable[[int, float | None], None] | None = None,
) -> RecordSummary:
    """Drive a workload for ``steps`` steps under a Recorder (what `sdcreplay record` does).

    ``inject`` corrupts the recording device as a defective GPU would; the
    bundle does not say so, exactly like one recorded on a defective GPU.
    """
    kwargs = dict(kwargs or {})
    if accepts_seed(workload):
        kwargs.setdefault("seed", seed)
    target = torch_device(device)
    determinism.enable()
    built = build_workload(workload, kwargs)
    built.model.to(target)
    if checkpoint is not None:
        model_state, optimizer_state = load_checkpoint(checkpoint_reference(Path(checkpoint)))
        built.model.load_state_dict(model_state)
        if optimizer_state is not None:
            built.optimizer.load_state_dict(optimizer_state)
    determinism.seed_everything(seed)
    injector = Injector(parse_specs(inject), device)
    loss_value = None
    recorder = Recorder(
        out,
        workload,
        built.model,
        built.optimizer,
        state=built.state,
        workload_kwargs=kwargs,
        checkpoint=checkpoint,
        device_label=device,
        overwrite=overwrite,
        max_depth=max_depth,
        verify=verify,
        inject=inject,
    )
    with recorder:
        for index in range(steps):
            batch = map_tensors(built.get_batch(index), lambda t: t.to(target))
            chain = [injector] if injector.has_operator_faults else []
            mode = (
                OperatorMode(built.model, built.optimizer, chain, index)
                if chain
                else contextlib.nullcontext()
            )
            with recorder.step(batch):  # its checks run before the step, outside the operator mode
                injector.before_step(index, built.model)
                with mode:
                    loss = built.run_step(batch)
            loss_value = None if loss is None else float(loss.detach())
            if on_step is not None:
                on_step(index, loss_value)
    bundle_path = recorder.path
    for miss in injector.unmatched():
        raise FaultSpecError(
            f"fault spec {miss['spec']!r} matches no operator call of the recorded steps "
            f"({bundle_path} was recorded without it)",
            "Closest calls: "
            + "; ".join(miss["closest"])
            + ". `sdcreplay ops BUNDLE --step N` lists them all.",
        )
    opened = Bundle.open(recorder.own_bundle_path, verify=False)
    return RecordSummary(
        bundle=bundle_path,
        workload=workload,
        kwargs=kwargs,
        device=device,
        steps=recorder.steps_written,
        entries=recorder.entries_written,
        size_bytes=opened.size_bytes(),
        final_loss=loss_value,
        verification=opened.verification.to_json(),
    )
