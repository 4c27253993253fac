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
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.hooks import RemovableHandle

from ..bundle.jobs import JobRecording, ddp_buckets_rebuilt, ddp_iterations_before, distributed_job
from ..bundle.manifest import (
    PARTIAL_SUFFIX,
    Bundle,
    BundleWriter,
    CaptureSettings,
    CheckpointState,
    Environment,
    Switches,
    Trigger,
    WorkloadRef,
    checkpoint_reference,
    load_checkpoint,
    part_dir,
)
from ..capture import determinism
from ..capture.collectives import Message, MessageLog
from ..capture.digest import algorithm_for
from ..capture.faults import Injector, parse_specs
from ..capture.layers import (
    OperatorMode,
    SignatureCapture,
    _own_work,
    grads_entering,
    state_digests,
)
from ..capture.signature import is_program_entry
from ..capture.snapshot import TrainingSnapshot
from ..devices import torch_device
from ..errors import (
    CheckpointError,
    FaultSpecError,
    MessageOrderError,
    SdcReplayError,
    WorkloadMismatchError,
)
from ..online.replay_check import (
    ReplayCheck,
    TrainingStopped,
    UpdateDetector,
)
from ..replay.session import ReplaySession
from ..storage.tensorio import map_tensors
from ..workload.definition import (
    Workload,
    accepts_seed,
    build_workload,
    canonical_ref,
    check_state_objects,
)
from .ring import HeldStep, StepRing, model_state_dict

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
    --inject`), which the check re-executes under too. ``ring=K`` writes nothing while
    recording: the last K steps stay in memory (ring.py) until ``dump(reason)`` writes them
    as a bundle at ``path`` (docs/recording.md, "Ring buffer"; under torch.distributed the
    ranks' dumps at the same step write one job bundle). ``data_parallel``: the
    DistributedDataParallel the step runs ``model`` through, when ``model`` is the plain
    module (a DDP given as ``model`` is found by itself): a replay's fresh DDP then runs the
    iterations it had run before the first step (its bucket rebuild).
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
        ring: int | None = None,
        data_parallel: torch.nn.Module | None = None,
    ):
        if verify not in VERIFY_MODES:
            raise SdcReplayError(f"verify={verify!r} is not one of True, 'warn', False")
        _check_ring(ring, checkpoint)
        first_param = next(model.parameters())
        self.device = first_param.device
        self.model, self.optimizer = model, optimizer
        self._data_parallel = model if data_parallel is None else data_parallel
        self.state_objects = check_state_objects(dict(state or {}), "Recorder")
        self.label = device_label or str(self.device)
        self.verify_mode = VERIFY_MODES[verify]
        self._inject = list(inject)
        switches = determinism.enable() if deterministic else determinism.current_switches()
        workload_ref = WorkloadRef(ref=canonical_ref(workload), kwargs=dict(workload_kwargs or {}))
        # Under torch.distributed this rank writes its part of a job bundle at `path`, with
        # every collective of its steps in a message log (jobs.py, collectives.py). With a ring
        # it holds its steps and their messages, and every rank's dump() writes one job bundle.
        distributed = distributed_job()
        self._workload_ref = workload_ref
        self._job = (
            JobRecording(Path(path), workload_ref, self.label, overwrite)
            if distributed and ring is None
            else None
        )
        self._messages = MessageLog(algorithm_for(self.device.type)) if distributed else None
        self._overwrite = overwrite
        self._bundle_settings: dict[str, Any] = dict(  # BundleWriter's, for every bundle
            workload=workload_ref,
            device=self.label,
            device_type=self.device.type,
            digest=algorithm_for(self.device.type),
            environment=Environment(**determinism.environment(self.device)),
            determinism=Switches(**switches),
            fingerprint=determinism.fingerprint(self.device),
            capture=CaptureSettings(max_depth=max_depth, program=True),
            distributed=self._job.distributed if self._job else None,
        )
        self._ring = None if ring is None else StepRing(ring)
        self._ring_problem: str | None = None  # ring mode: why no dump can pass verification
        self.dumps: list[Path] = []
        self._writer: BundleWriter | None = None
        if self._ring is None:
            self._writer = BundleWriter(
                self._job.part_path if self._job else Path(path),
                overwrite=overwrite,
                **self._bundle_settings,
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
        self._open_batch: Any = None  # the stored batch of the step whose block is open
        self._in_block = False
        self._ddp_rebuilt_at_start: bool | None = None  # a job's DDP, as the step began
        self._verify_due = False
        self._end_digests: dict[str, str] | None = None
        self._held_end_digests: dict[str, str] | None = None  # ring: as the last held step ended
        self.steps_written = 0
        self.entries_written = 0
        if self._job is not None:
            self.path: Path = self._job.path
        else:
            self.path = Path(path) if self._writer is None else self._writer.path

    @contextlib.contextmanager
    def step(self, batch: Any) -> Iterator[None]:
        """Record one training step: the block, and the optimizer step right after a block
        without one."""
        self._finish_pending()
        self.verify()
        self._check_unchanged_since_last_step()
        grads = grads_entering(self.model)
        if self._ring is not None:
            self._ring_step_begins(grads)
        elif (
            self._next_index == self._first_index and grads == "kept" and self.verify_mode != "off"
        ):
            self._mismatch(
                "the first recorded step begins with gradients accumulated before it, which "
                "the bundle does not hold: start recording at an optimizer-step boundary "
                "(after zero_grad)"
            )
        if self._messages is not None:
            self._ddp_rebuilt_at_start = ddp_buckets_rebuilt(self._data_parallel)
        started = time.perf_counter()
        rng = determinism.capture_rng(self.device)
        stored_batch = _stored(batch)
        self._capture.begin_step(rng)
        if self._messages is not None:
            self._messages.begin_step(self._next_index)
        self._open_batch, self._in_block = stored_batch, True
        try:
            with self._capture.backward_capture():
                yield
        finally:
            self._open_batch, self._in_block = None, False
        self._capture.close_window()
        self._pending = (self._next_index, stored_batch, rng, grads, started)
        self._next_index += 1
        if self._capture.optimizer_stepped:
            self._finish_pending()

    def extend_batch(self, micro_batch: Any) -> None:
        """Add a micro-batch to the open step's batch, a list (a trainer that hands over each
        micro-batch only as its forward begins: the step's batch is all of them)."""
        if not isinstance(self._open_batch, list):
            raise SdcReplayError(
                "extend_batch() needs an open step whose batch is a list of micro-batches",
                "Call it inside `with recorder.step([first_micro_batch]):`.",
            )
        self._open_batch.append(_stored(micro_batch))

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
        # What a replay's fresh DDP must run first to issue the collectives recorded here.
        ddp_before = (
            ddp_iterations_before(
                self._ddp_rebuilt_at_start, ddp_buckets_rebuilt(self._data_parallel)
            )
            if self._messages is not None
            else None
        )
        if self._job is not None and index == self._first_index:
            self._job.distributed.present("ddp_iterations_before", ddp_before)
        if self._writer is not None:
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
        elif self._ring is not None:
            self._ring.add(
                HeldStep(index, batch, rng, entries, stepped, grads, seconds, messages, ddp_before)
            )
        self.steps_written += 1
        self.entries_written += len(entries)
        self._verify_due = (
            self.steps_written == 1 and self.verify_mode != "off" and self._writer is not None
        )
        if self.verify_mode != "off":
            # From the optimizer's hook, the parameters and buffers are still as the capture
            # digested them a moment ago: its entries are their digests, not hashed again.
            updated = self._capture.updated_state if at_optimizer_step else {}
            self._end_digests = updated or state_digests(self.model)
            self._held_end_digests = self._end_digests

    @property
    def own_bundle_path(self) -> Path | None:
        """The bundle this process wrote (with a ring: its first dump, None before one), or
        its rank's part of it under torch.distributed."""
        path = self.path if self._ring is None else next(iter(self.dumps), None)
        return path if path is None else _own_part(path)

    def verify(self) -> None:
        """Re-execute the first recorded step now if due (else the next ``step()``/``close()``
        does)."""
        if not self._verify_due or self._writer is None:
            return
        self._verify_due = False
        problem = self._first_step_problem(self._writer.path, live_state=True)
        if problem is None:
            self._writer.set_verification(self.verify_mode, "passed")
        else:
            self._mismatch(problem)

    def _first_step_problem(self, bundle_path: Path, *, live_state: bool) -> str | None:
        """Re-execute the bundle's first step; ``live_state``: the loop's state must also equal
        replay's after it (true only while the loop is at the start of its second step)."""
        # Building the workload reseeds the generators; the loop goes on from its own states.
        saved = determinism.capture_rng(self.device)
        try:
            return self._reexecute_first_step(bundle_path, live_state)
        finally:
            determinism.restore_rng(saved, self.device)

    def _reexecute_first_step(self, bundle_path: Path, live_state: bool) -> str | None:
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
            record = session.bundle.steps[0]
            try:
                replayed = session.run_step(record)
            except MessageOrderError as exc:
                return exc.message + self._unknown_ddp_note(session.bundle)
            recorded = session.bundle.signature_log().steps[record.index]
            problem = describe_first_difference(recorded, replayed)
            if problem is None and self._messages is not None:
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
        if self._writer is not None:
            self._writer.set_verification(self.verify_mode, "failed", problem)
        else:
            self._ring_problem = problem
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
        if self._writer is not None:
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

    # --- ring mode (ring.py): the last K steps in memory, a bundle only when asked ---

    def _ring_step_begins(self, grads: str) -> None:
        assert self._ring is not None
        if self._capture.step_open and not self._continues_held_steps():
            self._ring.clear()  # the previous step raised mid-way and left the state changed
        if self._ring.wants_snapshot(grads):
            with _own_work():  # not the step's operators (an OperatorMode may be active)
                snapshot = TrainingSnapshot.take(
                    self.model,
                    self.optimizer,
                    self.state_objects,
                    grads=False,
                    rng=False,
                    device="cpu",
                )
            self._ring.open_window(snapshot)

    def _continues_held_steps(self) -> bool:
        """Are parameters and buffers as the last held step left them (a step that raised
        before its optimizer step, e.g. stopped by a detector, changed none)? Unknown without
        verification: then no."""
        held = self._held_end_digests
        return held is not None and state_digests(self.model) == held

    def rewind(self) -> None:
        """Forget the last completed step: a detector rolled the state back to before it, to
        run it again inside ``step()`` under the same index (dump first to keep it)."""
        if self._ring is None:
            raise SdcReplayError(
                "rewind() needs a ring buffer: a step written to disk is not taken back",
                "Create the Recorder with ring=K.",
            )
        self._finish_pending()
        dropped = self._ring.drop_last()
        if dropped is None:
            raise SdcReplayError("the ring holds no completed step to rewind")
        self._next_index = dropped.index
        self._end_digests = self._held_end_digests = None
        self.steps_written -= 1
        self.entries_written -= len(dropped.entries)

    @property
    def ring_nbytes(self) -> int:
        """Bytes the ring holds: snapshots' and batches' tensors, RNG states, signature
        characters (0 without a ring)."""
        return 0 if self._ring is None else self._ring.nbytes

    @property
    def ring_steps(self) -> list[int]:
        """The steps a dump now would write, oldest first."""
        return [] if self._ring is None else [step.index for step in self._ring.steps]

    def dump(self, reason: str, *, source: str = "user") -> Path:
        """Write the ring's steps as a complete bundle and return its path.

        The first dump goes to ``path``, later ones to ``path`` with ``-2``, ``-3``... before
        the suffix (a name already taken is skipped unless ``overwrite``). A step whose block
        has not ended is not in it (its evidence is incomplete). The bundle's first step is
        re-executed from the bundle as the verification; a failure is written in the bundle
        and warned about, never raised: the alarm that asked for the dump matters more.

        Under torch.distributed every rank must call it at the same step, outside a step's
        block: each writes its held steps as its part of one job bundle (rank 0 names it), and
        the ranks re-execute their parts' first step together (its collectives need them all).
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
        self._finish_pending()
        held, start = self._ring.steps, self._ring.start
        if not held or start is None:
            raise SdcReplayError(
                "the ring holds no completed step yet: there is nothing to write",
                "Dump after a step has ended (a step that began with accumulated gradients "
                "cannot start a bundle).",
            )
        trigger = Trigger(
            reason=_shortened(reason, Trigger.REASON_LIMIT),
            source=_shortened(source, 64),
            step=held[-1].index,
            ring=self._ring.size,
        )
        if self._messages is None:
            path = self._write_dump(self._free_dump_path(), held, start, trigger, None)
        else:
            self._messages.abandon()  # a step that raised mid-way left it open: no evidence
            job = JobRecording(
                self.path, self._workload_ref, self.label, self._overwrite, self._free_dump_path
            )
            job.distributed.present("ddp_iterations_before", held[0].ddp_iterations_before)
            self._write_dump(job.part_path, held, start, trigger, job)
            path = job.close()
        self.dumps.append(path)
        return path

    def _write_dump(
        self,
        path: Path,
        held: list[HeldStep],
        start: TrainingSnapshot,
        trigger: Trigger,
        job: JobRecording | None,
    ) -> Path:
        """The held steps as a bundle at ``path`` (a job's part: ``job``), verified."""
        settings = dict(self._bundle_settings, distributed=job and job.distributed)
        writer = BundleWriter(path, overwrite=self._overwrite, **settings)
        try:
            writer.embed_state(model_state_dict(start), start.optimizer_state, start.object_states)
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
                )
            writer.set_trigger(trigger)
            # Called from inside the loop's step, the verification must not reach it: neither
            # through a fault injector's mode nor through the capture of the open step.
            with _disable_current_modes(), self._capture.paused():
                self._verify_dump(writer, job)
        except BaseException:
            writer.abort()
            raise
        return writer.close()

    def _verify_dump(self, writer: BundleWriter, job: JobRecording | None) -> None:
        if self.verify_mode == "off":
            writer.set_verification("off", "off")
            return
        problem = self._ring_problem
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
        problem = problem or self._first_step_problem(writer.path, live_state=False)
        writer.set_verification(self.verify_mode, "failed" if problem else "passed", problem)
        if problem:
            bundle = writer.final_path if job is None else job.final_path
            warnings.warn(
                f"the workload cannot replay the ring's bundle {bundle}: {problem}",
                stacklevel=4,
            )

    def _free_dump_path(self) -> Path:
        base = Path(self.path)
        number = len(self.dumps) + 1
        while True:
            name = base if number == 1 else base.with_name(f"{base.stem}-{number}{base.suffix}")
            partial = name.with_name(name.name + PARTIAL_SUFFIX)
            if self._overwrite or not (name.exists() or partial.exists()):
                return name
            number += 1

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


def _own_part(path: Path) -> Path:
    """The bundle this process wrote at ``path``: its rank's part of a job bundle under
    torch.distributed, else ``path`` itself."""
    return path / part_dir(torch.distributed.get_rank()) if distributed_job() else path


def _stored(batch: Any) -> Any:
    """The recorder's own CPU copy: the loop may reuse or change its batch afterwards."""
    return map_tensors(batch, lambda t: t.detach().to("cpu", copy=True))


def _shortened(text: str, limit: int) -> str:
    """At most ``limit`` characters (a detector's reason may name every parameter)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_ring(ring: int | None, checkpoint: str | Path | None) -> None:
    if ring is None:
        return
    if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
        raise SdcReplayError(
            f"ring={ring!r} is not a number of steps", "Pass ring=K with K >= 1, or no ring."
        )
    if checkpoint is not None:
        raise SdcReplayError(
            "a ring buffer's bundle starts from the state at its window's start, not from the "
            "checkpoint",
            "Drop checkpoint= with ring= (the ring embeds its own start state).",
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
    """What ``sdcreplay record`` wrote (``sdcreplay.record/1``). With a ring buffer, ``bundle``
    is the first bundle the ring dumped (None: no alarm, nothing written) and ``ring`` says
    what the ring held and wrote."""

    bundle: Path | None
    workload: str
    kwargs: dict
    device: str
    steps: int
    entries: int
    size_bytes: int
    final_loss: float | None
    verification: dict
    ring: dict | None = None  # {size, peak_nbytes, dumps: [{bundle, trigger}], stopped}

    @property
    def exit_code(self) -> int:
        """A recording is no finding; a detector's alarm during it (``--ring``) is (exit 1)."""
        dumps = self.ring["dumps"] if self.ring else []
        return 1 if any(dump["trigger"]["source"] != "record" for dump in dumps) else 0

    def to_json(self) -> dict:
        return {
            "schema": "sdcreplay.record/1",
            "bundle": None if self.bundle is None else str(self.bundle),
            "workload": self.workload,
            "kwargs": self.kwargs,
            "device": self.device,
            "steps": self.steps,
            "entries": self.entries,
            "size_bytes": self.size_bytes,
            "final_loss": self.final_loss,
            "verification": self.verification,
            "ring": self.ring,
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
    ring: int | None = None,
    dump_on: Sequence[str] = (),
) -> RecordSummary:
    """Drive a workload for ``steps`` steps under a Recorder (what `sdcreplay record` does).

    ``inject`` corrupts the recording device as a defective GPU would; the
    bundle does not say so, exactly like one recorded on a defective GPU.
    ``ring``: keep only the last ``ring`` steps in memory and write a bundle when
    ``dump_on`` asks (DUMP_ON): ``update`` / ``replay``, an ``UpdateDetector`` /
    ``ReplayCheck`` (every step) drives each step and dumps on an alarm (a mismatch, a
    persistent fault or a recompute limit also ends the run); ``end``, when the run ends.
    """
    detecting = check_dump_on(ring, dump_on, inject)
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
        ring=ring,
        data_parallel=built.data_parallel,
    )
    detector = _detector(detecting, built, recorder)
    peak_nbytes, stopped = 0, None
    with recorder:
        for index in range(steps):
            batch = map_tensors(built.get_batch(index), lambda t: t.to(target))
            chain = [injector] if injector.has_operator_faults else []
            mode = (
                OperatorMode(built.model, built.optimizer, chain, index)
                if chain
                else contextlib.nullcontext()
            )
            if detector is not None:  # it opens the recorder's step itself
                try:
                    with mode:
                        loss = detector.run_step(batch)
                except TrainingStopped as alarm:
                    stopped = f"step {index}: {alarm.message}"
                    break
            else:
                with recorder.step(batch):  # its checks run before the step, outside the mode
                    injector.before_step(index, built.model)
                    with mode:
                        loss = built.run_step(batch)
            peak_nbytes = max(peak_nbytes, recorder.ring_nbytes)
            loss_value = None if loss is None else float(loss.detach())
            if on_step is not None:
                on_step(index, loss_value)
        if "end" in dump_on and stopped is None:
            recorder.dump("the run ended", source="record")
        if detector is not None:
            detector.close()
    bundle_path = recorder.path if ring is None else next(iter(recorder.dumps), None)
    for miss in injector.unmatched():
        raise FaultSpecError(
            f"fault spec {miss['spec']!r} matches no operator call of the recorded steps "
            f"({bundle_path} was recorded without it)",
            "Closest calls: "
            + "; ".join(miss["closest"])
            + ". `sdcreplay ops BUNDLE --step N` lists them all.",
        )
    own = recorder.own_bundle_path
    opened = None if own is None else Bundle.open(own, verify=False)
    return RecordSummary(
        bundle=bundle_path,
        workload=workload,
        kwargs=kwargs,
        device=device,
        steps=recorder.steps_written,
        entries=recorder.entries_written,
        size_bytes=0 if opened is None else opened.size_bytes(),
        final_loss=loss_value,
        verification={} if opened is None else opened.verification.to_json(),
        ring=None if ring is None else _ring_summary(recorder, ring, peak_nbytes, stopped),
    )


DUMP_ON = ("update", "replay", "end")
"""What writes a ring recording's bundle: an UpdateDetector alarm, a ReplayCheck mismatch,
the end of the run."""


def check_dump_on(ring: int | None, dump_on: Sequence[str], inject: Sequence[str]) -> str | None:
    """The detector named in ``dump_on`` (or None), once the combination is known to work."""
    unknown = sorted(set(dump_on) - set(DUMP_ON))
    detectors = [name for name in DUMP_ON[:2] if name in dump_on]
    problem, hint = None, "--dump-on is update, replay or end (with --ring K)."
    if unknown:
        problem = f"--dump-on {unknown[0]!r} is not one of {', '.join(DUMP_ON)}"
    elif dump_on and ring is None:
        problem = "--dump-on needs --ring: without a ring every step is written anyway"
    elif len(detectors) > 1:
        problem = "--dump-on update and replay together: one detector drives each step"
        hint = "Choose one detector (end may go with either)."
    elif detectors and any(spec.kind == "memflip" for spec in parse_specs(inject)):
        problem = "a memflip fault corrupts memory between steps, outside a detector's step"
        hint = "With a detector, inject operator faults (bitflip, bias, nan...) instead."
    if problem is not None:
        raise SdcReplayError(problem, hint)
    return detectors[0] if detectors else None


def _detector(
    name: str | None, built: Workload, recorder: Recorder
) -> UpdateDetector | ReplayCheck | None:
    if name == "update":
        return UpdateDetector(built, recorder=recorder)
    if name == "replay":
        return ReplayCheck(built, recorder=recorder, num_steps=-1)
    return None


def _ring_summary(recorder: Recorder, size: int, peak_nbytes: int, stopped: str | None) -> dict:
    dumps = []
    for path in recorder.dumps:
        trigger = Bundle.open(_own_part(path), verify=False).manifest.trigger
        dumps.append({"bundle": str(path), "trigger": trigger and trigger.to_json()})
    return {"size": size, "peak_nbytes": peak_nbytes, "dumps": dumps, "stopped": stopped}
