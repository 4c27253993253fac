"""Replay engine: re-run a bundle's steps on one device label, in this process.

Rebuild the workload from its recorded name, load the recorded state (a
checkpoint only after its SHA-256 matched), put the recorded determinism
switches in force, and run every step with the same capture as the record.
Running several labels at once, each in its own process, is
`replicas.replay_devices`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import h5py
import torch

from ..bundle.jobs import shard_like, shard_optimizer_state_like
from ..bundle.manifest import StepRecord, WorkloadRef
from ..bundle.reader import Bundle
from ..bundle.state import write_state
from ..capture import determinism
from ..capture.around import RestorePoints, set_hyperparameters
from ..capture.collectives import MessageLog
from ..capture.compiled import CompileWatch
from ..capture.compiled_kernels import KernelObserver
from ..capture.digest import algorithm_for
from ..capture.faults import Injector, other_machine_kernels, parse_specs
from ..capture.layers import SignatureCapture
from ..capture.message import Message
from ..capture.operators import OperatorMode, OperatorObserver
from ..capture.probe import Probe, run_probe
from ..capture.signature import SignatureLog, write_signature_log
from ..capture.snapshot import TrainingSnapshot
from ..devices import torch_device
from ..errors import BundleError, SdcReplayError, WorkloadError
from ..heartbeat import HEARTBEAT
from ..kinds import ModuleNaming
from ..ledger.verdicts import incident_of
from ..storage.tensorio import map_tensors, read_tree, write_tree
from ..workload.definition import Workload, build_workload
from .script import LoopObjects, ScriptRun, StepFeeds
from .worker import device_task


class _StoppedBeforeUpdate(Exception):
    """Ends a replayed step where its recording was stopped, at the optimizer's step."""


def _absolute(bundle: Bundle) -> Bundle:
    """``bundle``, its files named by an absolute path (resolved in this directory, now)."""
    if bundle.path.is_absolute():
        return bundle
    return Bundle(bundle.path.absolute(), bundle.manifest)


class ReplaySession:
    """A workload rebuilt from a bundle, in the state before its first step."""

    def __init__(
        self,
        bundle: Bundle | str | Path,
        device: str = "cpu",
        *,
        apply_switches: bool = True,
        after_load: Callable[[torch.nn.Module, torch.optim.Optimizer], None] | None = None,
        inject: Sequence[str] = (),
        repeat: int = 0,
        feed: Bundle | None = None,
    ):
        # Read by absolute paths: a script-mode step runs in the recorded directory (script.py).
        self.bundle = _absolute(bundle if isinstance(bundle, Bundle) else Bundle.open(bundle))
        # Whose batches and RNG states the steps run on: another rank's part of the job in a
        # same-batch replay (docs/at-scale.md), else the bundle's own.
        self.feed = _absolute(feed) if feed is not None else self.bundle
        self.recorded_messages: dict[int, list[Message]] = {}
        self.message_log = self._message_log()
        info = self.bundle.manifest.distributed
        # A job's DDP: its iterations before the part's first step, for the first step run.
        self._ddp_before = info.ddp_iterations_before if info is not None else None
        self.last_messages: list[Message] = []  # the last replayed step's collective messages
        self.injector = Injector(parse_specs(inject), device, salt=repeat)
        self.label = device
        self.device = torch_device(device)
        recorded = self.bundle.manifest.determinism.to_json()
        if apply_switches:
            determinism.apply(recorded)
        determinism.verify(recorded)
        self.warnings = determinism.environment_warnings(
            self.bundle.manifest.environment.to_json(), determinism.environment(self.device)
        )
        self.bundle.require_trusted()
        workload_ref = self.bundle.manifest.workload
        self._points: RestorePoints | None = None
        self._entries: list[tuple[str, str]] = []
        # Script mode: the loop's own script, run in replay mode, is the step (script.py).
        self.script = ScriptRun(workload_ref) if workload_ref.is_script else None
        changed = self.script and self.script.command.changed()
        if changed:
            self.warnings.append(changed)
        try:
            self._build(workload_ref, after_load)
        except BaseException:
            if self.script is not None:
                self.script.close()
            raise

    def _build(
        self,
        workload_ref: WorkloadRef,
        after_load: Callable[[torch.nn.Module, torch.optim.Optimizer], None] | None,
    ) -> None:
        self.workload: Workload = (
            build_workload(workload_ref.ref, workload_ref.kwargs)
            if self.script is None
            else _script_workload(self.script.start())
        )
        self.workload.model.to(self.device)
        model_state, optimizer_state = self._as_sharded(*self.bundle.load_state())
        try:
            self.workload.model.load_state_dict(_with_tied_twins(model_state, self.model))
            if optimizer_state is not None:
                self.workload.optimizer.load_state_dict(optimizer_state)
            self._load_state_objects()
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WorkloadError(
                f"{self.bundle.workload_named} no longer builds the recorded model: "
                f"{str(exc).splitlines()[0]}",
                "Replay with the code (and workload arguments) the bundle was recorded with.",
            ) from exc
        if after_load is not None:
            after_load(self.workload.model, self.workload.optimizer)
        # What the loop set around each step: its torch RNG at each input it fed and each
        # entry of its model's forward (script mode), put back there (capture/around.py).
        self._points = RestorePoints(self.device, self.model) if self.script else None
        # The code this process generates for the workload's compiled regions, compared with
        # the record's (capture/compiled.py): other code is another program, not evidence.
        capture = self.bundle.manifest.capture
        names: ModuleNaming = "plain" if capture.naming == "plain" else "wrapped"
        self.compiled = CompileWatch(self.workload.model, names)
        # Every layer, whatever the record holds: the replicas vote at every entry, the record
        # at the entries its level has (compare/logs.py).
        self.capture = SignatureCapture(
            self.workload.model,
            self.workload.optimizer,
            max_depth=capture.max_depth,
            state=self.workload.state,
            program=capture.program or capture.level != "layer",
            names=names,
        )
        if self.script is not None:  # the script runs on to its first rec.step()
            self.script.go()

    def _warm_up_ddp(self, batch: object, index: int) -> None:
        """DDP rebuilds its buckets in its second iteration (two broadcasts, then another
        bucket layout): the recorded DDP had run iterations before step ``index``, the first
        this session runs (the part's first, or a later one after ``load_state``). This fresh
        one runs as many (up to 2) on its batch, outside any step, and everything they changed
        is put back, so the step issues the recorded collectives over the recorded buckets."""
        assert self._ddp_before is not None
        iterations = min(2, self._ddp_before + index - self.bundle.steps[0].index)
        self._ddp_before = None
        if iterations <= 0:
            return
        if self.script is not None:
            raise WorkloadError(
                f"{self.bundle.path}'s DistributedDataParallel had run {iterations} iterations "
                "before this window, which a replayed script cannot run outside its steps",
                "Record the script's window from its first DDP iteration on.",
            )
        snapshot = TrainingSnapshot.take(self.model, self.optimizer, self.workload.state)
        with self.capture.paused():
            for _ in range(iterations):
                self.workload.run_step(batch)
        snapshot.restore()

    def _as_sharded(self, model: dict, optimizer: dict | None) -> tuple[dict, dict | None]:
        """A job's rank part holds its shards of FSDP2's DTensors: lay them out as the live
        model's and optimizer's are, so that load_state_dict takes them."""
        if self.message_log is None:
            return model, optimizer
        model = shard_like(model, self.model.state_dict())
        if optimizer is not None:
            optimizer = shard_optimizer_state_like(optimizer, self.optimizer)
        return model, optimizer

    def _message_log(self) -> MessageLog | None:
        """A job's rank part replays among its peers, in the recorded collective order."""
        info = self.bundle.manifest.distributed
        if info is None:
            return None
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_initialized() else None
        if world_size != info.world_size:
            raise SdcReplayError(
                f"{self.bundle.path} is rank {info.rank} of a {info.world_size}-rank job: its "
                "collectives need its peers, and this process "
                + (
                    "has no process group"
                    if world_size is None
                    else f"is in a {world_size}-rank process group"
                ),
                f"Replay the whole job (`sdcreplay replay JOB`), or call ReplaySession in each "
                f"of {info.world_size} ranks started by torchrun, after init_process_group.",
            )
        self.recorded_messages = self.bundle.messages()
        manifest = self.bundle.manifest
        return MessageLog(manifest.digest or algorithm_for(manifest.device_type))

    def _load_state_objects(self) -> None:
        saved = self.bundle.load_state_objects()
        missing = sorted(set(saved) - set(self.workload.state))
        if missing:
            raise WorkloadError(
                f"{self.bundle.workload_named} has no state object {missing[0]!r} (it has "
                f"{sorted(self.workload.state) or 'none'}), but the recording saved one",
                "Return the same named state objects from the workload (Workload(state={...})).",
            )
        for name, state in saved.items():
            self.workload.state[name].load_state_dict(state)

    @property
    def model(self) -> torch.nn.Module:
        return self.workload.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.workload.optimizer

    def new_log(self, **meta) -> SignatureLog:
        return SignatureLog(
            meta={
                "device_type": self.device.type,
                "device": self.label,
                "digest": algorithm_for(self.device.type),
                "source": str(self.bundle.path),
                "incident": incident_of(self.bundle.manifest.manifest_sha256),
                "workload": {
                    "ref": self.bundle.workload_ref,
                    "kwargs": self.bundle.workload_kwargs,
                },
                "role": "replay",
                "naming": self.capture.names,
                **meta,
            }
        )

    def run_step(
        self,
        record: StepRecord,
        observers: Sequence[OperatorObserver] = (),
        kernel_observers: Sequence[KernelObserver] = (),
        within: contextlib.AbstractContextManager | None = None,
    ) -> list[tuple[str, str]]:
        """Run one recorded step from its recorded batch and RNG state; return its entries.

        ``observers`` see every operator call (through an OperatorMode, after
        the fault injector), e.g. bisect's operator log; ``kernel_observers`` every Inductor
        kernel call of its compiled regions (after the injector's ``kernel=`` faults);
        ``within``: a context the step runs in, entered where the step runs (the script's
        thread in script mode).
        """
        if self.script is not None:
            self.script.run_block(self._step_block(record, observers, kernel_observers, within))
        else:
            with self._step_block(record, observers, kernel_observers, within) as batch:
                if self.workload.train_step is not None:
                    self.workload.train_step(batch)
                else:
                    self._default_step(record, batch)
        return self._entries

    @contextlib.contextmanager
    def _step_block(
        self,
        record: StepRecord,
        observers: Sequence[OperatorObserver],
        kernel_observers: Sequence[KernelObserver],
        within: contextlib.AbstractContextManager | None = None,
    ) -> Iterator[object]:
        """Everything around one step's body: its recorded batch, RNG and hyperparameters,
        the injector, observers and capture; ``_entries`` holds its signature as it ends.
        The body is the workload's step, or, in script mode, the loop's own, run in the
        script's thread (script.py), which yields it the recorded inputs to feed."""
        batch, rng = self.feed.load_step(record.index)
        batch = map_tensors(batch, lambda t: t.to(self.device))
        around = self.feed.load_around(record.index) or {}
        if self._ddp_before is not None:
            self._warm_up_ddp(batch, record.index)
        if "hyper" in around:
            set_hyperparameters(self.optimizer, around["hyper"])
        determinism.restore_rng(rng, self.device)
        self.injector.before_step(record.index, self.model)
        chain = ([self.injector] if self.injector.has_operator_faults else []) + list(observers)
        mode = (
            OperatorMode(self.model, self.optimizer, chain, record.index)
            if chain
            else contextlib.nullcontext()
        )
        kernel_mode = self.injector.kernel_faults(record.index, self.model, kernel_observers)
        if self.workload.train_step is None:
            self._set_gradients(record.grads)
        self.capture.begin_step(determinism.capture_rng(self.device))
        log = self.message_log
        if log is not None:
            log.begin_step(record.index, self.recorded_messages.get(record.index, []))
        fed: object = batch
        if self._points is not None:
            if "rng" in around:  # else nothing to put back (a bundle recorded without them)
                self._points.begin_replay(around["rng"])
            fed = StepFeeds(batch, self._points)
        try:  # stopped where the recording stopped: before the mode's optimizer phase
            with (
                within or contextlib.nullcontext(),
                self._stopped_like(record),
                mode,
                kernel_mode,
                self.capture.backward_capture(),
            ):
                yield fed
        except BaseException as exc:
            if log is not None:
                log.abandon()
                if log.violation is not None and log.violation is not exc:
                    raise log.violation from exc  # raised inside autograd, maybe rewrapped
            raise
        finally:
            if self._points is not None:
                self._points.end()
        if log is not None:
            self.last_messages = log.end_step()
        self._entries = self.capture.end_step()

    @contextlib.contextmanager
    def _stopped_like(self, record: StepRecord) -> Iterator[None]:
        """A step a detector stopped before its optimizer's update is stopped there again, once
        the capture's own pre-hook took what the optimizer was given."""
        if not record.stopped:
            yield
            return

        def stop(optimizer, args, kwargs) -> None:
            raise _StoppedBeforeUpdate

        handle = self.optimizer.register_step_pre_hook(stop)
        try:
            yield
        except _StoppedBeforeUpdate:
            pass
        finally:
            handle.remove()

    def _set_gradients(self, grads: str) -> None:
        """Give the step the gradients the loop's step began with (it may have accumulated)."""
        if grads != "kept":
            self.optimizer.zero_grad(set_to_none=grads == "none")

    def _default_step(self, record: StepRecord, batch) -> None:
        """A loss_fn-only workload: backward, and the optimizer step only where the loop took it."""
        self.workload.loss(batch).backward()
        if record.optimizer_step or record.stopped:
            self.optimizer.step()

    def save_state(self, path: Path) -> None:
        """Everything the next step starts from, as plain HDF5 (no pickle crosses processes):
        model, optimizer, state objects, and the gradients a step may accumulate into."""
        objects = {name: obj.state_dict() for name, obj in self.workload.state.items()}
        grads = {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}
        write_state(path, self.model.state_dict(), self.optimizer.state_dict(), objects)
        with h5py.File(path, "a") as handle:
            write_tree(handle.create_group("grads"), grads)

    def load_state(self, path: Path) -> None:
        """Put the session in the state ``save_state`` wrote (from this bundle's own replay)."""
        with h5py.File(path, "r") as handle:
            model = read_tree(handle["model"])
            optimizer = read_tree(handle["optimizer"]) if "optimizer" in handle else None
            objects = {name: read_tree(handle["objects"][name]) for name in self.workload.state}
            grads = read_tree(handle["grads"])
        model, optimizer = self._as_sharded(model, optimizer)
        if self.message_log is not None:
            grads = shard_like(grads, dict(self.model.named_parameters()))
        self.model.load_state_dict(model)
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        for name, obj in self.workload.state.items():
            obj.load_state_dict(objects[name])
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.grad = grads[name].to(param.device) if name in grads else None

    def steps_until(self, last: int | None) -> Iterator[StepRecord]:
        for record in self.bundle.steps:
            if last is not None and record.index > last:
                return
            yield record

    def close(self) -> None:
        if self.script is not None:
            self.script.close()
        if self._points is not None:
            self._points.close()
        self.capture.close()
        self.compiled.close()


def _script_workload(objects: LoopObjects) -> Workload:
    """The loop's objects as the Workload replay reads; its step is the script's own."""

    def no_batches(index: int) -> object:
        raise WorkloadError("a replayed script feeds its own step the recorded inputs")

    return Workload(
        model=objects.model,
        optimizer=objects.optimizer,
        get_batch=no_batches,
        state=objects.state,
        data_parallel=objects.data_parallel,
    )


def _with_tied_twins(model_state: dict, model: torch.nn.Module) -> dict:
    """A state dict that names a tied parameter once (a Hugging Face checkpoint's weights):
    its twins, the same tensor in the model, take its value."""
    live = model.state_dict(keep_vars=True)
    missing = [name for name in live if name not in model_state]
    if not missing:
        return model_state
    names_of: dict[int, list[str]] = {}
    for name, tensor in live.items():
        names_of.setdefault(id(tensor), []).append(name)
    completed = dict(model_state)
    for name in missing:
        twin = next((other for other in names_of[id(live[name])] if other in model_state), None)
        if twin is not None:
            completed[name] = model_state[twin]
    return completed


def replay_on_device(
    bundle: Bundle | str | Path,
    device: str = "cpu",
    *,
    last_step: int | None = None,
    inject: Sequence[str] = (),
    repeat: int = 0,
    after_load: Callable[[torch.nn.Module, torch.optim.Optimizer], None] | None = None,
    apply_switches: bool = True,
    on_step: Callable[[int], None] | None = None,
    after_step: Callable[[ReplaySession, int], None] | None = None,
    feed: Bundle | None = None,
    start_state: tuple[str, int] | None = None,
) -> SignatureLog:
    """Replay the bundle's steps (up to ``last_step``) on one device label in this process.

    ``inject`` adds fault specs (``SDCREPLAY_INJECT`` is read too); ``repeat``
    varies the draws of intermittent faults between repeats; ``on_step(index)``
    is called as each step starts (the device process's liveness signal),
    ``after_step(session, index)`` as it ends (a rank takes its messages); ``feed``: the
    bundle whose batches and RNG states the steps run on (`ReplaySession`); ``start_state``:
    (a state `ReplaySession.save_state` wrote, the step it enters): start there.
    """
    session = ReplaySession(
        bundle,
        device,
        apply_switches=apply_switches,
        after_load=after_load,
        inject=inject,
        repeat=repeat,
        feed=feed,
    )
    try:
        log = session.new_log(warnings=session.warnings, repeat=repeat)
        if start_state is not None:
            session.load_state(Path(start_state[0]))
        for record in session.steps_until(last_step):
            if start_state is not None and record.index < start_state[1]:
                continue
            if on_step is not None:
                on_step(record.index)
            log.steps[record.index] = _run_workload_step(session, record)
            if after_step is not None:
                after_step(session, record.index)
        log.meta["compiled"] = [region.to_json() for region in session.compiled.regions()]
        log.meta["injected"] = [injection.to_json() for injection in session.injector.fired]
        log.meta["unmatched"] = session.injector.unmatched()
        return log
    finally:
        session.close()


@device_task
def run_replay_task(
    device: str,
    bundle: str,
    repeats: int,
    log_dir: str,
    inject: Sequence[str] = (),
    last_step: int | None = None,
) -> dict:
    """In a device process: run the bundle's kernel probe, then replay ``repeats`` times, one
    signature log each, in ``log_dir``."""
    opened = Bundle.open(bundle)  # its files hashed once, for the probe and every repeat
    with other_machine_kernels():
        probe = run_recorded_probe(opened, device)
        value = _replay_repeats(device, opened, repeats, log_dir, inject, last_step)
    return {**value, "probe": probe}


def run_recorded_probe(bundle: Bundle, device: str) -> dict | None:
    """The bundle's kernel probe run here under the recording's switches: which calls give
    other bits (capture/probe.py), or None for a bundle recorded without one."""
    recorded = bundle.probe()
    if recorded is None:
        return None
    HEARTBEAT.beat("kernel probe")
    determinism.apply(bundle.manifest.determinism.to_json())
    try:
        probe = Probe.from_json(recorded)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{bundle.path}'s kernel probe is malformed: {exc}") from exc
    return run_probe(probe, torch_device(device)).to_json(probe)


def _replay_repeats(
    device: str,
    bundle: Bundle,
    repeats: int,
    log_dir: str,
    inject: Sequence[str],
    last_step: int | None,
) -> dict:
    logs, warnings, injected, unmatched = [], [], [], None
    compiled: list[dict] = []
    for repeat in range(repeats):

        def beat(index: int, repeat: int = repeat) -> None:
            HEARTBEAT.beat(f"step {index} (repeat {repeat})")

        log = replay_on_device(
            bundle,
            device,
            last_step=last_step,
            inject=inject,
            repeat=repeat,
            on_step=beat,
        )
        path = Path(log_dir) / f"{device.replace(':', '-')}.r{repeat}.sig.zst"
        write_signature_log(path, log)
        logs.append(str(path))
        warnings = log.meta.get("warnings", [])
        injected.append(log.meta.get("injected", []))
        unmatched = log.meta["unmatched"] if unmatched is None else unmatched
        compiled = compiled or log.meta["compiled"]  # later repeats reuse the first's code
    return {
        "compiled": compiled,
        "logs": logs,
        "warnings": warnings,
        "injected": injected,
        "unmatched": unmatched or [],
        "fingerprint": determinism.fingerprint(torch_device(device)),
    }


def _run_workload_step(session: ReplaySession, record: StepRecord) -> list[tuple[str, str]]:
    """One step; what the workload raises on the bundle's data is named as such (exit 3)."""
    try:
        return session.run_step(record)
    except SdcReplayError:
        raise
    except Exception as exc:
        first_line = (str(exc).splitlines() or [""])[0][:300]
        raise WorkloadError(
            f"{session.bundle.workload_named} raised {type(exc).__name__} in step {record.index} "
            f"on {session.label}: {first_line}",
            "The stored batch or state does not fit the workload (a damaged or foreign "
            "bundle), or the workload changed since the recording; the device's log holds "
            "the traceback.",
        ) from exc
