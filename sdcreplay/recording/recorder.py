"""The Recorder: the hook a training loop uses to write a trace bundle.

```python
rec = sdcreplay.Recorder("run.bundle", model=model, optimizer=opt, state={"scaler": scaler})
for batch in loader:
    with rec.step():
        loss = train_step(rec.feed(batch))  # the whole step: backward, clipping, opt.step()
rec.close()
```
Without ``workload=`` (script mode, script.py) the bundle names the command that ran, and
replay runs this same script in replay mode; ``workload="mytrain:make_workload"`` names a
factory replay calls instead (built-ins, trainer callbacks).
A step ends when the block exits, or at the optimizer step right after it
(``with rec.step(b): loss.backward()`` then ``opt.step()``), and is written
then, so a run that dies later keeps every step that completed.

By default the recording proves it can be replayed: at the start of the
second step (or at ``close()``) the first step is re-executed through the
workload's own step from the saved state, as a replay runs it (a fresh process on
the same device, with the bundle's command, directory and environment only:
verification.py), and every signature entry compared; at the start of every later
step the parameters and buffers must equal their digests at the end of the previous one. A loop that
does something its workload's step does not raises WorkloadMismatchError.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..bundle.checkpoints import checkpoint_reference
from ..bundle.jobs import JobRecording, ddp_buckets_rebuilt, ddp_iterations_before, distributed_job
from ..bundle.layout import ParallelLayout, job_layout
from ..bundle.manifest import (
    CaptureSettings,
    WorkloadRef,
    part_dir,
)
from ..bundle.writer import BundleWriter
from ..capture import determinism, environment
from ..capture.collectives import MessageLog
from ..capture.compiled import CompileWatch
from ..capture.digest import algorithm_for
from ..capture.layers import SignatureCapture, grads_entering, state_digests
from ..errors import SdcReplayError, WorkloadMismatchError
from ..kinds import SignatureLevel
from ..replay.script import ScriptCommand
from ..replay.script import handoff as replay_handoff
from ..workload.definition import check_state_objects
from ..workload.references import recorded_ref
from .arguments import (
    VERIFY_MODES,
    bundle_settings,
    check_model_matches_checkpoint,
    check_options,
    loop_objects,
)
from .drill import Drill
from .dump import RingDumper
from .ring import HeldStep, StepRing
from .ring_mode import RingMode
from .script import AroundSteps, ReplayingRecorder, stored
from .verification import FirstStepCheck


class Recorder(RingMode):
    """Writes the steps of a training loop into a bundle at ``path``.

    Without ``workload`` (script mode, docs/porting.md) the bundle names the command that
    ran and replay runs this script again in replay mode, where ``Recorder(...)`` is a
    `ReplayingRecorder`. ``workload`` names the factory replay will call instead (with
    ``workload_kwargs``) to rebuild the model, optimizer and state objects; the state they
    start from
    is embedded in the bundle, or referenced by SHA-256 when ``checkpoint`` is
    the file the model and optimizer were just loaded from. ``state`` names the
    loop's other stateful objects (schedulers, a GradScaler, an EMA model...),
    under the names the workload gives them. ``verify`` (True, ``"warn"`` or
    False) checks that the workload's step reproduces the loop's (module
    docstring); ``inject`` is the recording device's faults (`sdcreplay record
    --inject`; with ``SDCREPLAY_INJECT``'s): each step's block runs under them (drill.py), the
    check re-executes under them too, and the manifest names those that fired
    (``injected_faults``: a drill bundle). ``ring=K`` writes
    nothing while recording: the last K steps stay in memory (ring.py) until
    ``dump(reason)`` writes them as a bundle at ``path`` (docs/recording.md, "Ring buffer";
    under torch.distributed the ranks' dumps at the same step write one job bundle); after
    ``checkpoint_saved(path)`` the window starts at the loop's checkpoint and holds every step
    since, at most ``max_window`` (then the ring copies the state every K steps again until
    the next checkpoint).
    ``model`` may be a list of model parts (a pipeline's stages on this rank) and
    ``optimizer`` a list of optimizers, a wrapper of one (Accelerate's) or a container
    (TorchTitan's): workload/loop_objects.py; anything else is refused here.
    ``data_parallel``: the DistributedDataParallel the step runs ``model`` through, when
    ``model`` is the plain module (a DDP given as ``model`` is found by itself): a replay's
    fresh DDP then runs the iterations it had run before the first step (its bucket rebuild).
    ``signature``: what each step's signature log holds, ``"layer"`` (every module:
    forensics) or ``"boundary"`` (the production level: losses, what the optimizer is given
    and the parameters it produced; replay computes every layer: docs/recording.md,
    "Signature levels"). ``layout``: the job's parallel layout (bundle/layout.py), where the
    model's DDP or device mesh does not show it (found by itself otherwise). ``env``
    (script mode): names or ``NAME*`` patterns of the loop's own environment variables the
    bundle keeps beside the launchers' and libraries' it always keeps (a replay's process
    gets the bundle's environment, never the investigator's: docs/recording.md, "What a
    replay inherits"); a name holding TOKEN, KEY, SECRET, PASSWORD or CREDENTIAL is never kept.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """In a script replayed in replay mode, the Recorder is the replay's (script.py)."""
        handoff = replay_handoff()
        if handoff is None:
            return super().__new__(cls)
        return ReplayingRecorder(
            handoff,
            *loop_objects(*args, **kwargs),
            kwargs.get("state"),
            kwargs.get("data_parallel"),
        )

    def __init__(
        self,
        path: str | Path,
        workload: str | None = None,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        optimizer: Any = None,
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
        ledger: bool = True,
        signature: SignatureLevel = "layer",
        max_window: int = 1000,
        layout: ParallelLayout | None = None,
        env: Sequence[str] | str | None = None,
    ):
        check_options(verify, ring, checkpoint, max_window, signature)
        watched = environment.check_patterns(env)
        if watched and workload is not None:
            raise SdcReplayError(
                "env= names the variables a script-mode recording keeps; a workload= factory "
                "is rebuilt from its arguments alone",
                "Give the factory its settings as workload_kwargs, or record without workload=.",
            )
        model, optimizer = loop_objects(path, workload, model, optimizer)
        self.device = next(model.parameters()).device
        self.model, self.optimizer = model, optimizer
        self._data_parallel = model if data_parallel is None else data_parallel
        self.state_objects = check_state_objects(dict(state or {}), "Recorder")
        self.label = device_label or str(self.device)
        self._ledger = ledger  # note each dump in the device ledger (docs/fleet.md)
        self.verify_mode = VERIFY_MODES[verify]
        switches = determinism.enable() if deterministic else determinism.current_switches()
        workload_ref = (
            ScriptCommand.of_this_process(watched).workload_ref()
            if workload is None
            else WorkloadRef(ref=recorded_ref(workload), kwargs=dict(workload_kwargs or {}))
        )
        self._around = AroundSteps(model, optimizer, script=workload is None)
        # Under torch.distributed this rank writes its part of a job bundle at `path`, with
        # every collective of its steps in a message log (jobs.py, collectives.py). With a ring
        # it holds its steps and their messages, and every rank's dump() writes one job bundle.
        distributed = distributed_job()
        self._layout = job_layout(layout, model, self._data_parallel) if distributed else None
        self._job = (
            JobRecording(Path(path), workload_ref, self.label, overwrite, layout=self._layout)
            if distributed and ring is None
            else None
        )
        self._messages = MessageLog(algorithm_for(self.device.type)) if distributed else None
        self._check = FirstStepCheck(
            model,
            optimizer,
            self.state_objects,
            device=self.device,
            label=self.label,
            inject=inject,
            distributed=distributed,
        )
        # A drill: the recording device's faults (SDCREPLAY_INJECT's too) fire in each step.
        self.drill = Drill(inject, model, optimizer, self.label)
        self.injected_faults = self.drill.fired_specs  # the manifest's: those that fired
        settings = bundle_settings(
            workload_ref,
            self.label,
            self.device,
            switches,
            CaptureSettings(  # the level is written where it is not the default
                max_depth=max_depth,
                program=True,
                level=signature,
                naming="plain",
                absent=frozenset() if signature != "layer" else frozenset({"level"}),
            ),
            distributed=self._job.distributed if self._job else None,
            injected_faults=self.injected_faults,
        )
        # The code Inductor generates for the model's compiled regions, digested as it is
        # generated (a compile before this point is not seen: capture/compiled.py).
        self._compiled = CompileWatch(model)
        self._ring = None if ring is None else StepRing(ring, max_window)
        self._ring_problem: str | None = None  # ring mode: why no dump can pass verification
        self.dumps: list[Path] = []
        self.moved_aside: list[Path] = []  # what overwrite moved away from the bundle's names
        self._writer: BundleWriter | None = None
        if self._ring is None:
            self._writer = BundleWriter(
                self._job.part_path if self._job else Path(path),
                overwrite=overwrite,
                **settings,
            )
            objects = {name: obj.state_dict() for name, obj in self.state_objects.items()}
            if checkpoint is not None:
                reference = checkpoint_reference(Path(checkpoint))
                check_model_matches_checkpoint(model, reference)
                self._writer.reference_checkpoint(reference, objects)
            else:
                self._writer.embed_state(model.state_dict(), optimizer.state_dict(), objects)
            status = "pending" if self.verify_mode != "off" else "off"
            self._writer.set_verification(self.verify_mode, status)
            self.drill.writer = self._writer
        self._capture = SignatureCapture(
            model,
            optimizer,
            max_depth=max_depth,
            state=self.state_objects,
            program=True,
            level=signature,
        )
        # Right after the capture's own post-hook: nothing runs between the two.
        self._hook: RemovableHandle | None = optimizer.register_step_post_hook(
            lambda *_: self._finish_pending(at_optimizer_step=True)
        )
        self._update_hook = (
            None
            if self._ring is None
            else optimizer.register_step_pre_hook(lambda *_: self._update_begins())
        )
        self._next_index = start_step
        self._first_index = start_step
        self._pending: tuple[int, Any, determinism.RngState, str, float, bool, dict] | None = None
        self._stopped = False  # the open step was stopped before its optimizer's update
        self._open_batch: Any = None  # the stored batch of the step whose block is open
        self._in_block = False
        self._ddp_rebuilt_at_start: bool | None = None  # a job's DDP, as the step began
        self._verify_due = False
        self._end_digests: dict[str, str] | None = None
        self._held_end_digests: dict[str, str] | None = None  # ring: as the last held step ended
        self._earlier_end_digests: dict[str, str] | None = None  # ring: the one before it
        self.steps_written = 0
        self.entries_written = 0
        if self._job is not None:
            self.path: Path = self._job.path
        else:
            self.path = Path(path) if self._writer is None else self._writer.path
        self._dumper = (
            None
            if self._ring is None
            else RingDumper(
                self.path,
                settings,
                overwrite=overwrite,
                workload_ref=workload_ref,
                label=self.label,
                capture=self._capture,
                check=self._check,
                verify_mode=self.verify_mode,
                compiled=self.compiled_regions,
                layout=self._layout,
            )
        )

    @contextlib.contextmanager
    def step(self, batch: Any = None) -> Iterator[Any]:
        """Record one training step: the block, and the optimizer step right after a block
        without one. ``batch``: the step's one input (optional in script mode, where the step
        can take its inputs through ``feed``); the block gets it back (in a replay, the
        recorded one)."""
        if batch is None and not self._around.script:
            raise SdcReplayError(
                "a Recorder with a workload= factory records the batch each step is given",
                "Pass it: `with rec.step(batch):` (or record without workload=: script mode).",
            )
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
        self._around.begin()
        stored_batch = stored(batch) if not self._around.script else None
        if self._around.script and batch is not None:
            self._around.feed(batch)
        self._capture.begin_step(rng)
        if self._messages is not None:
            self._messages.begin_step(self._next_index)
        self._open_batch, self._in_block, self._stopped = stored_batch, True, False
        try:
            with self._capture.backward_capture(), self.drill.step(self._next_index):
                yield batch
        finally:
            self._open_batch, self._in_block = None, False
        feeds, around = self._around.end()
        stored_batch = stored_batch if feeds is None else feeds
        self._capture.close_window()
        self._pending = (self._next_index, stored_batch, rng, grads, started, self._stopped, around)
        self._next_index += 1
        if self._capture.optimizer_stepped or self._stopped:  # nothing of the step comes later
            self._finish_pending()

    def feed(self, obj: Any) -> Any:
        """An input the open step takes (a micro-batch, wherever in the step it is fetched):
        recorded and returned; in a replay, the recorded input instead (script mode)."""
        self._around.feed(obj)
        return obj

    def extend_batch(self, micro_batch: Any) -> None:
        """Add a micro-batch to the open step's batch, a list (a trainer that hands over each
        micro-batch only as its forward begins: the step's batch is all of them)."""
        if not isinstance(self._open_batch, list):
            raise SdcReplayError(
                "extend_batch() needs an open step whose batch is a list of micro-batches",
                "Call it inside `with recorder.step([first_micro_batch]):`.",
            )
        self._open_batch.append(stored(micro_batch))

    def stop_before_optimizer(self) -> None:
        """The open step stops now, at its optimizer's step, before the update (a detector
        judged it there and stops it): what the optimizer was about to be given is recorded,
        and the step is kept as stopped (replay stops it there too)."""
        if not self._in_block:
            raise SdcReplayError(
                "stop_before_optimizer() needs an open step",
                "Call it inside `with recorder.step(batch):`, as the optimizer's step begins.",
            )
        self._capture.record_optimizer_inputs(self.optimizer)
        self._stopped = True

    def _finish_pending(self, at_optimizer_step: bool = False) -> None:
        """Write the step that ended; ``at_optimizer_step``: called from the optimizer's hook."""
        if self._pending is None:
            return
        index, batch, rng, grads, started, stopped, around = self._pending
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
            compiled = self.compiled_regions()
            if compiled:
                self._writer.set_compiled(compiled)
            self._writer.add_step(
                index,
                batch,
                rng,
                entries,
                optimizer_step=stepped,
                grads=grads,
                seconds=seconds,
                messages=messages,
                stopped=stopped,
                around=around,
            )
        elif self._ring is not None:
            self._ring.add(
                HeldStep(
                    index,
                    batch,
                    rng,
                    entries,
                    stepped,
                    grads,
                    seconds,
                    messages,
                    ddp_before,
                    stopped,
                    around,
                )  # fmt: skip
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
            self._earlier_end_digests = self._held_end_digests
            self._held_end_digests = self._end_digests

    def compiled_regions(self) -> list[dict]:
        """The model's compiled regions with the code seen generated for them, as the
        manifest keeps them (empty for a model that runs no compiled code)."""
        return [region.to_json() for region in self._compiled.regions()]

    @property
    def own_bundle_path(self) -> Path | None:
        """The bundle this process wrote (with a ring: its first dump, None before one), or
        its rank's part of it under torch.distributed."""
        path = self.path if self._ring is None else next(iter(self.dumps), None)
        return path if path is None else own_part(path)

    def verify(self) -> None:
        """Re-execute the first recorded step now if due (else the next ``step()``/``close()``
        does)."""
        if not self._verify_due or self._writer is None:
            return
        self._verify_due = False
        problem = self._check.problem(self._writer.path, live_state=True)
        if self._check.probe is not None:
            self._writer.set_probe(self._check.probe)
        if problem is None:
            self._writer.set_verification(self.verify_mode, "passed")
        else:
            self._mismatch(problem)

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
            self.moved_aside += self._writer.moved_aside
        if self._job is not None:
            self.path = self._job.close()
            self.moved_aside += self._job.moved_aside
        self.drill.close(self.own_bundle_path or "BUNDLE")  # named as the bundle now is
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
        if self._update_hook is not None:
            self._update_hook.remove()
            self._update_hook = None
        if self._hook is not None:
            self._hook.remove()
            self._capture.close()
            self._compiled.close()
            self._around.close()
            self._hook = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()


def own_part(path: Path) -> Path:
    """The bundle this process wrote at ``path``: its rank's part of a job bundle under
    torch.distributed, else ``path`` itself."""
    return path / part_dir(torch.distributed.get_rank()) if distributed_job() else path
