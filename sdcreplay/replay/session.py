"""Replay engine: re-run a bundle's steps on one device label, in this process.

Rebuild the workload from its recorded name, load the recorded state (a
checkpoint only after its SHA-256 matched), put the recorded determinism
switches in force, and run every step with the same capture as the record.
Running several labels at once, each in its own process, is `replay_devices`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import torch

from ..bundle.jobs import shard_like, shard_optimizer_state_like
from ..bundle.manifest import Bundle, CheckpointState, StepRecord, verify_checkpoint, write_state
from ..capture import determinism
from ..capture.collectives import Message, MessageLog
from ..capture.digest import algorithm_for
from ..capture.faults import Injector, parse_specs
from ..capture.layers import OperatorMode, OperatorObserver, SignatureCapture
from ..capture.signature import SignatureLog, read_signature_log, write_signature_log
from ..capture.snapshot import TrainingSnapshot
from ..compare.logs import RECORD, Consensus, DeviceVerdict, vote
from ..devices import torch_device, validate_label
from ..errors import BundleError, DeviceError, FaultSpecError, SdcReplayError, WorkloadError
from ..heartbeat import HEARTBEAT
from ..kinds import DeviceRunVerdict, DeviceVerdictName
from ..storage.tensorio import map_tensors, read_tree, write_tree
from ..workload.definition import Workload, build_workload
from .processes import STARTUP_SECONDS, STEP_FACTOR, UNKNOWN_STEP_TIMEOUT, run_device_processes
from .worker import DeviceResult, device_task


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
    ):
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
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
        self.workload: Workload = build_workload(
            self.bundle.workload_ref, self.bundle.workload_kwargs
        )
        self.workload.model.to(self.device)
        model_state, optimizer_state = self._as_sharded(*self.bundle.load_state())
        try:
            self.workload.model.load_state_dict(model_state)
            if optimizer_state is not None:
                self.workload.optimizer.load_state_dict(optimizer_state)
            self._load_state_objects()
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WorkloadError(
                f"{self.bundle.workload_ref} no longer builds the recorded model: "
                f"{str(exc).splitlines()[0]}",
                "Replay with the code (and workload arguments) the bundle was recorded with.",
            ) from exc
        if after_load is not None:
            after_load(self.workload.model, self.workload.optimizer)
        capture = self.bundle.manifest.capture
        self.capture = SignatureCapture(
            self.workload.model,
            self.workload.optimizer,
            max_depth=capture.max_depth,
            state=self.workload.state,
            program=capture.program,
        )

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
                f"{self.bundle.workload_ref} has no state object {missing[0]!r} (it has "
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
                "workload": {
                    "ref": self.bundle.workload_ref,
                    "kwargs": self.bundle.workload_kwargs,
                },
                "role": "replay",
                **meta,
            }
        )

    def run_step(
        self, record: StepRecord, observers: Sequence[OperatorObserver] = ()
    ) -> list[tuple[str, str]]:
        """Run one recorded step from its recorded batch and RNG state; return its entries.

        ``observers`` see every operator call (through an OperatorMode, after
        the fault injector), e.g. bisect's operator log.
        """
        batch, rng = self.bundle.load_step(record.index)
        batch = map_tensors(batch, lambda t: t.to(self.device))
        if self._ddp_before is not None:
            self._warm_up_ddp(batch, record.index)
        determinism.restore_rng(rng, self.device)
        self.injector.before_step(record.index, self.model)
        chain = ([self.injector] if self.injector.has_operator_faults else []) + list(observers)
        mode = (
            OperatorMode(self.model, self.optimizer, chain, record.index)
            if chain
            else contextlib.nullcontext()
        )
        if self.workload.train_step is None:
            self._set_gradients(record.grads)
        self.capture.begin_step(determinism.capture_rng(self.device))
        log = self.message_log
        if log is not None:
            log.begin_step(record.index, self.recorded_messages.get(record.index, []))
        try:
            with mode, self.capture.backward_capture():
                if self.workload.train_step is not None:
                    self.workload.train_step(batch)
                else:
                    self._default_step(record, batch)
        except Exception as exc:
            if log is not None:
                log.abandon()
                if log.violation is not None and log.violation is not exc:
                    raise log.violation from exc  # raised inside autograd, maybe rewrapped
            raise
        if log is not None:
            self.last_messages = log.end_step()
        return self.capture.end_step()

    def _set_gradients(self, grads: str) -> None:
        """Give the step the gradients the loop's step began with (it may have accumulated)."""
        if grads != "kept":
            self.optimizer.zero_grad(set_to_none=grads == "none")

    def _default_step(self, record: StepRecord, batch) -> None:
        """A loss_fn-only workload: backward, and the optimizer step only where the loop took it."""
        self.workload.loss(batch).backward()
        if record.optimizer_step:
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
        self.capture.close()


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
) -> SignatureLog:
    """Replay the bundle's steps (up to ``last_step``) on one device label in this process.

    ``inject`` adds fault specs (``SDCREPLAY_INJECT`` is read too); ``repeat``
    varies the draws of intermittent faults between repeats; ``on_step(index)``
    is called as each step starts (the device process's liveness signal),
    ``after_step(session, index)`` as it ends (a rank takes its messages).
    """
    session = ReplaySession(
        bundle,
        device,
        apply_switches=apply_switches,
        after_load=after_load,
        inject=inject,
        repeat=repeat,
    )
    try:
        log = session.new_log(warnings=session.warnings, repeat=repeat)
        for record in session.steps_until(last_step):
            if on_step is not None:
                on_step(record.index)
            log.steps[record.index] = _run_workload_step(session, record)
            if after_step is not None:
                after_step(session, record.index)
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
    """In a device process: replay ``repeats`` times, one signature log each, in ``log_dir``."""
    logs, warnings, injected, unmatched = [], [], [], None
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
    return {
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
            f"{session.bundle.workload_ref} raised {type(exc).__name__} in step {record.index} "
            f"on {session.label}: {first_line}",
            "The stored batch or state does not fit the workload (a damaged or foreign "
            "bundle), or the workload changed since the recording; the device's log holds "
            "the traceback.",
        ) from exc


@dataclass
class DeviceRun:
    """What one device process produced: its logs, or why it died."""

    device: str
    logs: list[SignatureLog] = field(default_factory=list)
    log_paths: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: dict | None = None
    injected: list[list[dict]] = field(default_factory=list)  # faults that fired, per repeat
    judgement: DeviceVerdict | None = None
    fingerprint: dict | None = None  # the process's own, after its run
    differences: list[str] = field(
        default_factory=list
    )  # result-affecting properties unlike the record's
    spread_from: int | None = None  # in a job: the origin rank whose corruption reached it

    @property
    def verdict(self) -> DeviceRunVerdict:
        if self.error is not None:
            return "error"
        if self.spread_from is not None:
            return "spread"
        return self.judgement.verdict if self.judgement else "match"

    def to_json(self) -> dict:
        judgement = self.judgement
        first = judgement.first_divergence if judgement else None
        return {
            "device": self.device,
            "verdict": self.verdict,
            "repeats": judgement.runs if judgement else 0,
            "divergent_repeats": judgement.divergent_runs if judgement else 0,
            "first_divergence": None if first is None else first.brief(),
            "steps": {str(step): count for step, count in judgement.per_step.items()}
            if judgement
            else {},
            "logs": self.log_paths,
            "warnings": self.warnings,
            "injected": self.injected,
            "error": self.error,
            "fingerprint": self.fingerprint,
            "fingerprint_differences": self.differences,
            **({} if self.spread_from is None else {"spread_from": self.spread_from}),
        }


UNVERIFIED_CAVEAT = (
    "the recording was not verified (recorded with verify off, before verification existed, or it "
    "failed): a difference between the record and every replay may be the training loop doing "
    "something the workload's step does not, not the recording device"
)


def caveat_for(bundle: Bundle) -> str | None:
    """What a reader of a replay of this bundle must know before blaming the recording device."""
    if bundle.verified:
        return None
    problem = bundle.verification.problem
    return UNVERIFIED_CAVEAT + (f" (the check found: {problem})" if problem else "")


@dataclass
class ReplayReport:
    bundle: str
    repeats: int
    log_dir: str
    devices: list[DeviceRun]
    consensus: Consensus | None
    caveat: str | None = None
    injected_specs: list[str] = field(default_factory=list)  # the --inject specs asked for

    @property
    def injection_missed(self) -> bool:
        """Faults were asked for and none fired on any device: the spec selects nothing."""
        return bool(self.injected_specs) and not any(
            fired for run in self.devices for fired in run.injected
        )

    @property
    def record_verdict(self) -> DeviceVerdictName:
        judgement = self.consensus.voters.get(RECORD) if self.consensus else None
        return judgement.verdict if judgement else "match"

    @property
    def failed(self) -> list[DeviceRun]:
        """Devices that died or timed out: the verdict is computed without them."""
        return [run for run in self.devices if run.error is not None]

    @property
    def exit_code(self) -> int:
        if self.consensus is not None and self.consensus.verdict == "incomparable":
            return 3  # no comparable machine replayed: no evidence either way
        if self.consensus is not None and self.consensus.verdict != "correct":
            return 1
        return 3 if self.failed else 0

    def failure(self) -> SdcReplayError | None:
        """Why the replay could not give a full answer (exit 3), or None."""
        if not self.failed or self.exit_code != 3:
            return None
        failed = [(run.device, run.error) for run in self.devices if run.error is not None]
        names = "; ".join(f"{device}: {error['message']}" for device, error in failed)
        logs = ", ".join(error["log"] for _, error in failed if error.get("log"))
        where = f" (logs: {logs})" if logs else ""
        if self.consensus is None:
            return SdcReplayError(
                f"no verdict: no device finished ({names})",
                f"Fix what stopped the devices and replay again{where}.",
            )
        return SdcReplayError(
            f"{len(self.failed)} of {len(self.devices)} devices did not finish ({names}); "
            "the verdict covers only the others",
            f"Replay those devices again to include them{where}.",
        )

    def to_json(self) -> dict:
        return {
            "schema": "sdcreplay.replay/1",
            "bundle": self.bundle,
            "repeats": self.repeats,
            "log_dir": self.log_dir,
            "record": {"verdict": self.record_verdict},
            "devices": [run.to_json() for run in self.devices],
            "consensus": self.consensus.to_json() if self.consensus else None,
            "verified": self.caveat is None,
            "caveat": self.caveat,
            "finished": len(self.devices) - len(self.failed),
            "failed": [run.device for run in self.failed],
        }


def progress_timeout(bundle: Bundle) -> float:
    """Seconds a device process may go without progress, derived from the recorded step times.

    Generous on purpose (a replica may share cores with others, or run on a
    slower device): it exists to end a hang, not to judge speed.
    """
    times = [step.seconds for step in bundle.steps if step.seconds is not None]
    if not times or len(times) < len(bundle.steps):
        return UNKNOWN_STEP_TIMEOUT
    return round(STARTUP_SECONDS + STEP_FACTOR * max(times), 1)


def refuse_unmatched_specs(values: Sequence[tuple[str, int | None, dict | None]]) -> None:
    """A fault spec that selected no call in any process it applies to is a mistake in the
    spec, not a finding. ``values``: (device label, rank or None, the task's value or None when
    it failed) of every process; with a failed one nothing can be concluded."""
    finished = [(label, rank, value) for label, rank, value in values if value is not None]
    if not values or len(finished) < len(values) or any("unmatched" not in v for *_, v in finished):
        return
    by_spec: dict[str, list[str]] = {}
    for *_, value in finished:
        for miss in value["unmatched"]:
            by_spec.setdefault(miss["spec"], miss["closest"])
    for spec, closest in by_spec.items():
        applies = [
            (label, rank, value)
            for label, rank, value in finished
            if any(f.applies_to(label, rank) for f in parse_specs([spec], False))
        ]
        missed = [
            entry for entry in applies if any(m["spec"] == spec for m in entry[2]["unmatched"])
        ]
        if applies and len(missed) == len(applies):
            raise FaultSpecError(
                f"fault spec {spec!r} matches no operator call of the replayed steps",
                "Closest calls: "
                + "; ".join(closest)
                + ". `sdcreplay ops BUNDLE --step N` lists them all.",
            )


def default_log_dir(bundle_path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return bundle_path.with_name(bundle_path.name + ".replay") / stamp


def replay_devices(
    bundle: str | Path,
    devices: list[str],
    *,
    repeats: int = 1,
    inject: Sequence[str] = (),
    last_step: int | None = None,
    log_dir: str | Path | None = None,
    on_done: Callable[[str, DeviceResult], None] | None = None,
    timeout: float | None = None,
) -> ReplayReport:
    """Replay on every device label at once, each in its own process, and vote.

    A workload that is neither built in nor recorded here runs only inside
    ``trust.granting([ref])`` (what ``--trust-workload`` does), see trust.py.
    ``timeout``: seconds a device may go without finishing a step before it is
    killed (default: derived from the recorded step times, see `progress_timeout`).
    """
    opened = Bundle.open(bundle)
    labels = [validate_label(label) for label in devices]
    # What would fail on every device is refused here, once, before any process starts.
    if not opened.steps:
        raise BundleError(
            f"{opened.path} holds no steps (the recording ended before its first step finished)",
            "There is nothing to replay: record again, and let at least one step complete.",
        )
    opened.require_trusted()
    parse_specs(inject)
    determinism.check_environment(opened.manifest.determinism.to_json())
    if isinstance(opened.manifest.state, CheckpointState):
        verify_checkpoint(opened.manifest.state)
    if len(set(labels)) != len(labels):
        raise DeviceError(
            f"device labels repeat: {labels}", "Give each replica its own label: cpu:0, cpu:1, ..."
        )
    log_dir = Path(log_dir) if log_dir else default_log_dir(opened.path)
    recorded_fingerprint = opened.manifest.fingerprint
    results = run_device_processes(
        "replay",
        run_replay_task,
        labels,
        lambda label: {
            "bundle": str(opened.path),
            "repeats": repeats,
            "inject": list(inject),
            "last_step": last_step,
            "log_dir": str(log_dir),
        },
        log_dir,
        environment=determinism.pinned_environment(recorded_fingerprint),
        on_done=on_done,
        timeout=progress_timeout(opened) if timeout is None else timeout,
    )
    errors = [result.error for result in results.values() if result.error is not None]
    if len(errors) == len(results) and len({error.message for error in errors}) == 1:
        shared = errors[0]  # the same failure everywhere: the tool's, not a device's
        raise SdcReplayError(f"every device failed: {shared.message}", shared.hint)
    refuse_unmatched_specs([(label, None, result.value) for label, result in results.items()])
    runs = []
    for label in labels:
        error, value = results[label].error, results[label].value or {}
        run = DeviceRun(
            label,
            error=error.to_json() if error else None,
            warnings=value.get("warnings", []),
            injected=value.get("injected", []),
            fingerprint=value.get("fingerprint"),
        )
        if run.error is None:
            run.log_paths = value["logs"]
            run.logs = [read_signature_log(Path(path)) for path in run.log_paths]
            run.differences = determinism.fingerprint_differences(
                recorded_fingerprint, run.fingerprint
            )
        runs.append(run)
    record = opened.signature_log()
    if last_step is not None:
        record.steps = {s: e for s, e in record.steps.items() if s <= last_step}
    healthy = {run.device: run.logs for run in runs if run.error is None}
    incomparable = {run.device: run.differences for run in runs if run.differences}
    consensus = vote(record, healthy, incomparable) if healthy else None
    for run in runs:
        if consensus is not None and run.device in consensus.voters:
            run.judgement = consensus.voters[run.device]
    return ReplayReport(
        str(opened.path),
        repeats,
        str(log_dir),
        runs,
        consensus,
        caveat_for(opened),
        injected_specs=list(inject),
    )
