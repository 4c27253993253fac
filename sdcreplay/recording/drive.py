"""`sdcreplay record`: a workload's steps driven under a Recorder.

The command line, the demo and each rank of `record_job` record the same way: build
the workload, drive its own step for a number of steps under a ``Recorder`` (the
recording device's faults injected as a defective GPU would corrupt it), and say
what was written. With a ring buffer an online detector (``--dump-on update`` or
``replay``) drives each step instead, and its alarm writes the bundle.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..bundle.checkpoints import checkpoint_reference, load_checkpoint
from ..bundle.reader import Bundle
from ..capture import determinism
from ..capture.faults import parse_specs
from ..devices import torch_device
from ..errors import FaultSpecError, SdcReplayError
from ..kinds import SignatureLevel
from ..online.replay_check import ReplayCheck
from ..online.stopping import TrainingStopped
from ..online.update_detector import UpdateDetector
from ..storage.tensorio import map_tensors
from ..workload.definition import Workload, accepts_seed, build_workload
from .drill import UnmatchedFaultWarning, listing_command
from .recorder import Recorder, own_part


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
    moved_aside: list[str] = field(default_factory=list)  # what --overwrite moved away

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
            "moved_aside": self.moved_aside,
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
    signature: SignatureLevel = "layer",
) -> RecordSummary:
    """Drive a workload for ``steps`` steps under a Recorder (what `sdcreplay record` does).

    ``inject`` corrupts the recording device as a defective GPU would; the bundle's
    values are exactly those of one recorded on a defective GPU, and its manifest says it
    is a drill (``injected_faults``), so no verdict made from it is evidence.
    ``ring``: keep only the last ``ring`` steps in memory and write a bundle when
    ``dump_on`` asks (DUMP_ON): ``update`` / ``replay``, an ``UpdateDetector`` /
    ``ReplayCheck`` (every step) drives each step and dumps on an alarm (a mismatch, a
    persistent fault or a recompute limit also ends the run); ``end``, when the run ends.
    ``signature``: the level each step's log holds (``Recorder(signature=...)``).
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
        signature=signature,
    )
    detector = _detector(detecting, built, recorder)
    peak_nbytes, stopped = 0, None
    # record() refuses a spec that matched nothing (below): the Recorder's warning is not said
    with warnings.catch_warnings(), recorder:  # the filter outlasts close(), which warns
        warnings.simplefilter("ignore", UnmatchedFaultWarning)
        for index in range(steps):
            batch = map_tensors(built.get_batch(index), lambda t: t.to(target))
            if detector is not None:  # it opens the recorder's step itself, maybe more than once
                try:  # every execution of the step on this device under the drill's one count
                    with recorder.drill.step(index):
                        loss = detector.run_step(batch)
                except TrainingStopped as alarm:
                    stopped = f"step {index}: {alarm.message}"
                    break
            else:
                with recorder.step(batch):  # the recording device's faults fire in it (drill.py)
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
    listed = recorder.own_bundle_path or "BUNDLE"  # a job's: its rank's part, which ops takes
    for miss in recorder.drill.unmatched():
        raise FaultSpecError(
            f"fault spec {miss['spec']!r} matches no operator call of the recorded steps "
            f"({bundle_path} was recorded without it)",
            "Closest calls: "
            + "; ".join(miss["closest"])
            + f". `{listing_command(listed, miss['spec'])}` lists them all.",
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
        moved_aside=[str(path) for path in recorder.moved_aside],
    )


DUMP_ON = ("update", "replay", "end")
"""What writes a ring recording's bundle: an UpdateDetector alarm, a ReplayCheck mismatch,
the end of the run."""


def check_dump_on(ring: int | None, dump_on: Sequence[str], inject: Sequence[str]) -> str | None:
    """The detector named in ``dump_on`` (or None), once the combination is known to work."""
    unknown = sorted(set(dump_on) - set(DUMP_ON))
    detectors = [name for name in DUMP_ON[:2] if name in dump_on]
    problem, hint = None, "--dump-on is update, replay or end (with --ring K)."
    python_hint = "dump_on holds update, replay or end (with ring=K)."
    if unknown:
        problem = f"--dump-on {unknown[0]!r} is not one of {', '.join(DUMP_ON)}"
    elif dump_on and ring is None:
        problem = "--dump-on needs --ring: without a ring every step is written anyway"
    elif len(detectors) > 1:
        problem = "--dump-on update and replay together: one detector drives each step"
        hint = python_hint = "Choose one detector (end may go with either)."
    elif detectors and any(spec.kind == "memflip" for spec in parse_specs(inject)):
        problem = "a memflip fault corrupts memory between steps, outside a detector's step"
        hint = python_hint = (
            "With a detector, inject operator faults (bitflip, bias, nan...) instead."
        )
    if problem is not None:
        raise SdcReplayError(problem, hint, python_hint=python_hint)
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
        trigger = Bundle.open(own_part(path), verify=False).manifest.trigger
        dumps.append({"bundle": str(path), "trigger": trigger and trigger.to_json()})
    return {"size": size, "peak_nbytes": peak_nbytes, "dumps": dumps, "stopped": stopped}
