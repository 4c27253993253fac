"""The exceptions a training loop catches when a detector stops it.

``TrainingStopped`` and its kinds leave the state as it was before the step and
say, the same on every rank, whether the evidence accuses a device and what to
run next; a loop needs only these, not the detectors' machinery.
"""

from __future__ import annotations

import torch

from ..errors import SdcReplayError
from .alarms import Alarm, summarize_reasons


class TrainingStopped(SdcReplayError):
    """A detector stopped training at a step: the state is as it was before that step, and the
    alarm's bundle (with a ring Recorder) holds the evidence. Catch this to stop a loop."""


class SDCReplayMismatch(TrainingStopped):
    """A replayed execution of a step differed from its reference: raised on every rank,
    before the optimizer step.

    ``entry`` is the first differing signature entry (``loss``, ``grad:NAME`` with ``#k``
    for the k-th micro-batch's backward, ``step_grad:NAME`` as the optimizer is given it,
    ``buffer:NAME``, ``rng:cpu``, ``scalar:NAME``, ``state:...``); ``elements`` and
    ``bit_histogram`` (bit -> elements with it flipped) compare that tensor of the odd
    execution with a third execution that agreed with the other one (None where it is not
    a tensor, or the reference was the odd one out); of a DTensor, they count the local
    shard of rank ``shard_of`` (the full tensor is never gathered).
    ``evidence`` says which one that third execution agreed with: ``"reference"``,
    ``"replay"``, or ``"neither"``, a step whose result changes with every execution (state
    the check does not restore, a non-deterministic kernel), which accuses no device.
    ``accuses_device``: one execution was the odd one and torch's deterministic algorithms
    were on, so nothing but the device of rank ``rank`` explains it (the same on every rank).
    """

    def __init__(
        self,
        *,
        step: int,
        local_step: int,
        replay: int,
        rank: int | None,
        entry: str,
        micro_batch: int | None = None,
        elements: int | None = None,
        bit_histogram: dict[int, int] | None = None,
        shard_of: int | None = None,
        bundle: str | None = None,
        ranks: list[int] | None = None,
        evidence: str | None = None,
        deterministic: bool = True,
    ):
        self.step, self.local_step, self.replay, self.rank = step, local_step, replay, rank
        self.ranks = [rank] if ranks is None and rank is not None else list(ranks or [])
        self.entry, self.micro_batch = entry, micro_batch
        self.elements, self.bit_histogram, self.bundle = elements, bit_histogram, bundle
        self.shard_of = shard_of
        self.evidence = evidence
        message = (
            f"SDC replay mismatch: step={step}, local_step={local_step}, replay={replay}, "
            f"rank={rank}, entry={entry!r}"
        )
        if rank is None:
            message += (
                f" (ranks {', '.join(map(str, self.ranks))} differ there at once: a collective "
                "spread it before the first checked entry, so this check cannot tell which "
                "rank went wrong first)"
            )
        if elements is not None:
            bits = ", ".join(f"bit {b}: {n}" for b, n in sorted((bit_histogram or {}).items()))
            where = "" if shard_of is None else f" of rank {shard_of}'s local shard (a DTensor)"
            message += f"; {elements} element(s){where} differ ({bits})"
        if bundle is not None:
            message += f"; bundle {bundle}"
        # Evidence against the device: one execution of a deterministic step was the odd one.
        self.accuses_device = deterministic and evidence in ("reference", "replay")
        if evidence == "neither":
            message += (
                "; a third execution agreed with neither: the step's result changes with every "
                "execution, which by itself accuses no device"
            )
            hint = (
                "Give the check every object the step changes (state={...}: a GradScaler, "
                "schedulers; scalars={...}: counters), run the step with sdcreplay's "
                "determinism switches (deterministic algorithms, no non-deterministic "
                "kernels), and check again; a device is suspect only if the step then still "
                "differs between executions."
            )
        elif not deterministic:
            message += (
                "; torch's deterministic algorithms are off, so a non-deterministic kernel can "
                "differ like this on a healthy device: this accuses no device by itself"
            )
            hint = (
                "Run the step with sdcreplay's determinism switches "
                "(sdcreplay.capture.determinism.enable(), or "
                "torch.use_deterministic_algorithms(True)) "
                "and check again; a device is suspect only if it then still differs."
            )
        elif bundle is not None:
            hint = (
                f"Replay the failing step on other devices (`sdcreplay replay {bundle} "
                f"--device ...`) and localize the operator (`sdcreplay bisect {bundle}`)."
            )
        elif rank is None:
            hint = (
                "Record the job with a Recorder under torchrun (or `sdcreplay record --nproc`) "
                "and replay it: its message log names the rank whose input to the collective "
                "went wrong first (docs/distributed.md). Accuse no device before that."
            )
        else:
            hint = (
                "Attach a ring Recorder (ReplayCheck(..., recorder=Recorder(..., ring=K))) to "
                f"get a bundle of the failing step; take the device of rank {rank} (the one "
                "that computed the odd execution) out of service meanwhile."
            )
        super().__init__(message, hint)


class PersistentFaultError(TrainingStopped):
    """A recompute on this device reproduced the alarmed result: another device computed
    otherwise (the second opinion; ``accuses_device``), or, without one, such alarms ended
    ``persistent_after`` steps in a row, which a training instability does as well, so it
    accuses no device until a replay elsewhere disagrees."""

    def __init__(self, alarm: Alarm):
        self.alarm = alarm
        self.accuses_device = alarm.contradicted_by is not None
        keep = (
            f"`sdcreplay bisect {alarm.bundle}` localizes the operator."
            if alarm.bundle
            else "attach a ring Recorder (recorder=) to keep a bundle of the step."
        )
        if self.accuses_device:
            super().__init__(
                f"persistent fault: {alarm.describe()}; {alarm.contradicted_by} computed "
                "another result from the same state; the step was rolled back",
                f"Take this device out of service; {keep}",
            )
            return
        replay = (
            f"`sdcreplay replay {alarm.bundle} --device ...`"
            if alarm.bundle
            else "a replay of the step on another device (attach a ring Recorder, recorder=)"
        )
        super().__init__(
            f"persistent alarm: {alarm.describe()}; the step reproduces bit for bit here and no "
            "other device was asked, which accuses no device by itself (an unstable run "
            "reproduces too); the step was rolled back",
            f"Check it on another device: {replay}; this device is suspect only if that one "
            "disagrees. A second_opinion=ReplicaOpinion(...) does it during training.",
        )


class NonFiniteResultError(TrainingStopped):
    """A step gives NaN/Inf again when recomputed from the same state: there is no transient
    fault to recompute away, and training cannot go on from a non-finite result. Megatron
    stops the job on a reproducible NaN too; a second device tells a numerical problem (it
    gives NaN as well) from a persistent fault (it does not: ``PersistentFaultError``)."""

    def __init__(self, alarm: Alarm):
        self.alarm = alarm
        where = (
            f"`sdcreplay replay {alarm.bundle} --device D` on another device"
            if alarm.bundle
            else "the step on another device (second_opinion=; a ring Recorder keeps a bundle)"
        )
        super().__init__(
            f"step {alarm.step} gives NaN/Inf again when recomputed "
            f"({summarize_reasons(alarm.reasons)}): not a transient fault, and training cannot "
            "go on from it; the step was rolled back",
            f"A numerical problem of the model or its data, or a persistent device fault: run "
            f"{where}; a finite result there accuses this device.",
        )


class RecomputeLimitError(TrainingStopped):
    """Every recompute of a step alarmed with another result: nothing trustworthy to keep.
    That accuses the device only where the step is deterministic (``accuses_device``):
    without torch's deterministic algorithms a healthy device may compute every execution
    differently too."""

    def __init__(self, alarm: Alarm, limit: int):
        self.alarm = alarm
        self.accuses_device = torch.are_deterministic_algorithms_enabled()
        message = (
            f"{limit} recomputes of step {alarm.step} all alarmed "
            f"({summarize_reasons(alarm.reasons)}) "
            "and disagreed with each other; the step was rolled back"
        )
        bisect = f" and bisect {alarm.bundle}." if alarm.bundle else "."
        if self.accuses_device:
            super().__init__(
                message,
                "The device fails intermittently but often: take it out of service" + bisect,
            )
            return
        super().__init__(
            message + "; torch's deterministic algorithms are off, so a healthy device may "
            "compute each execution differently too: this accuses no device by itself",
            "Train with sdcreplay's determinism switches "
            "(sdcreplay.capture.determinism.enable(), or "
            "torch.use_deterministic_algorithms(True)); if recomputes still disagree, the "
            "device fails intermittently: take it out of service" + bisect,
        )
