"""Detectors that run inside training and leave evidence a person can bisect.

``ReplayCheck`` executes a checked step's forward/backward again from the same
state on the same device and compares digests of everything it produced (the
loss and gradients of every backward, buffers, RNG, caller-owned scalars and
state objects), as TorchTitan's SDC replayer does, with sdcreplay's
position-aware digest and every micro-batch checked. ``UpdateDetector`` watches
the statistics of each optimizer update (update norms against an EMA baseline,
NaN/Inf, Megatron's loss and gradient-norm spikes) and, on an alarm, rolls the
step back, recomputes it and classifies the alarm as Megatron's rerun state
machine does.

Both drive the loop's own step (``Workload.run_step``: a Workload, or a model,
optimizer and ``train_step``), and both, given a ring ``Recorder``, record every
step through it and dump a bundle when an alarm needs evidence, so `sdcreplay
replay` and `sdcreplay bisect` start from the failing step. See docs/online.md.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..capture.collectives import Message, MessageLog, log_open, unlogged
from ..capture.determinism import capture_rng, restore_rng
from ..capture.digest import Digester, SignatureValue, algorithm_for
from ..capture.layers import _own_work, grads_entering, observed_backward, state_object_items
from ..capture.snapshot import TrainingSnapshot, copy_state
from ..compare.forensics import element_forensics
from ..errors import SdcReplayError
from ..storage.tensorio import map_tensors
from ..workload.definition import Workload, check_state_objects

Classification = Literal["correct", "transient", "persistent"]


class ScalarState(Protocol):
    """A number the step changes that lives outside every module (a token counter)."""

    def get(self) -> Any: ...

    def set(self, value: Any) -> None: ...


@dataclass
class AttributeScalar:
    """``owner.name`` as a ``ScalarState``: ``AttributeScalar(trainer, "ntokens_seen")``."""

    owner: Any
    name: str

    def get(self) -> Any:
        return getattr(self.owner, self.name)

    def set(self, value: Any) -> None:
        setattr(self.owner, self.name, value)


def _no_batches(index: int) -> Any:
    raise SdcReplayError(
        "an online detector is handed each batch by the loop and never asks for one",
        "Call detector.run_step(batch) with the loop's batch.",
    )


def step_workload(
    workload: Workload | None,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    train_step: Callable[[Any], torch.Tensor | None] | None,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None,
    state: Mapping[str, Any] | None,
    who: str,
) -> Workload:
    """The step a detector drives: the Workload's, or one made of the loop's own pieces."""
    pieces = (model, optimizer, train_step, loss_fn, state)
    if workload is not None:
        if any(piece is not None for piece in pieces):
            raise SdcReplayError(
                f"{who} was given a Workload and also model/optimizer/train_step",
                "Give either a Workload or model=, optimizer= and train_step= (or loss_fn=).",
            )
        return workload
    if model is None or optimizer is None or (train_step is None and loss_fn is None):
        raise SdcReplayError(
            f"{who} needs a Workload, or model=, optimizer= and train_step= (or loss_fn=)",
            "train_step(batch) is the loop's whole step: forward, backward(s), clipping, "
            "optimizer.step(), scheduler, zero_grad; it returns the loss.",
        )
    return Workload(
        model=model,
        optimizer=optimizer,
        get_batch=_no_batches,
        loss_fn=loss_fn,
        train_step=train_step,
        state=check_state_objects(dict(state or {}), who),
    )


class _OptimizerReached(Exception):
    """Stops an execution that must not update anything at the optimizer's step."""


class _StepAborted(Exception):
    """The kept execution found a mismatch (on some rank) before the optimizer step."""


# ---------------------------------------------------------------------------
# What one execution of a step produced, as digests in execution order.


@dataclass
class Difference:
    """The first signature entry where an execution differs from the reference."""

    position: int
    entry: str
    reference: str | None  # its digest there; None: the reference has no entry there
    micro_batch: int | None  # the backward (0-based) it came from; None: end-of-step entries
    found: str | None = None  # the execution's digest of that entry; None: it has none there


class _Probe:
    """Digests the entries of one execution; compares them with a reference as they come.

    Entries are fetched after every backward (one device sync) so a gradient is
    digested before the next micro-batch adds to it. The value of the first
    differing entry (or of ``watch``) is copied then, for forensics; nothing
    else is ever copied.
    """

    def __init__(
        self, reference: list[tuple[str, str]] | None = None, watch: str | None = None
    ) -> None:
        self.reference = reference
        self.watch = watch
        # Under torch.distributed: the execution's collectives up to the optimizer's step, and
        # the reference's, so the rank whose input to one differs first can be named.
        self.messages: list[Message] | None = None
        self.reference_messages: list[Message] | None = None
        self.entries: list[tuple[str, str]] = []
        self.difference: Difference | None = None
        self.kept: torch.Tensor | None = None
        self.backwards = 0
        self.finished = False
        self._digester = Digester()
        self._values: dict[str, SignatureValue] = {}
        self._calls: Counter[str] = Counter()

    def add(self, name: str, value: SignatureValue) -> None:
        count = self._calls[name]
        self._calls[name] += 1
        name = name if count == 0 else f"{name}#{count}"
        with _own_work():
            self._digester.add(name, value)
        self._values[name] = value

    def flush(self, micro_batch: int | None) -> None:
        with _own_work():
            fetched = self._digester.entries()
        for name, digest in fetched:
            self._note(len(self.entries), name, digest, micro_batch)
            self.entries.append((name, digest))
        self._values = {}

    def _note(self, position: int, name: str, digest: str, micro_batch: int | None) -> None:
        if name == self.watch and self.kept is None:
            self.kept = _copied(self._values[name])
        if self.reference is None or self.difference is not None:
            return
        expected = self.reference[position] if position < len(self.reference) else None
        if expected == (name, digest):
            return
        same_entry = expected is not None and expected[0] == name
        self.difference = Difference(
            position,
            name if expected is None else expected[0],
            None if expected is None else expected[1],
            micro_batch,
            digest if expected is None or same_entry else None,
        )
        if same_entry:
            self.kept = _copied(self._values[name])

    def first_input_difference(self) -> int | None:
        """Issue order of the first collective whose input differs from the reference's."""
        if self.messages is None or self.reference_messages is None:
            return None
        pairs = enumerate(zip(self.messages, self.reference_messages))
        return next((i for i, (a, b) in pairs if a.input_digest != b.input_digest), None)

    def finish(self) -> None:
        """The execution ended: an entry the reference has beyond the end is a difference."""
        self.finished = True
        reference = self.reference
        if reference is not None and self.difference is None:
            if len(self.entries) < len(reference):
                name, digest = reference[len(self.entries)]
                self.difference = Difference(len(self.entries), name, digest, None)


def _copied(value: SignatureValue) -> torch.Tensor | None:
    if not isinstance(value, torch.Tensor):
        return None
    with _own_work():
        return value.detach().clone()


def _probing_backward(
    probe: _Probe, model: torch.nn.Module
) -> contextlib.AbstractContextManager[None]:
    """While open, each ``backward()`` adds its loss before and every gradient after it."""
    parameters = list(model.named_parameters())

    def gradients() -> None:
        for name, param in parameters:
            probe.add(f"grad:{name}", param.grad)
        probe.flush(probe.backwards)
        probe.backwards += 1

    return observed_backward(lambda loss: probe.add("loss", loss), gradients)


class TrainingStopped(SdcReplayError):
    """A detector stopped training at a step: the state is as it was before that step, and the
    alarm's bundle (with a ring Recorder) holds the evidence. Catch this to stop a loop."""


# ---------------------------------------------------------------------------
# ReplayCheck


class SDCReplayMismatch(TrainingStopped):
    """A replayed execution of a step differed from its reference: raised on every rank,
    before the optimizer step.

    ``entry`` is the first differing signature entry (``loss``, ``grad:NAME`` with ``#k``
    for the k-th micro-batch's backward, ``buffer:NAME``, ``rng:cpu``, ``scalar:NAME``,
    ``state:...``); ``elements`` and ``bit_histogram`` (bit -> elements with it flipped)
    compare that tensor of the odd execution with a third execution that agreed with the
    other one (None where it is not a tensor, or the reference was the odd one out).
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
        bundle: str | None = None,
        ranks: list[int] | None = None,
        evidence: str | None = None,
        deterministic: bool = True,
    ):
        self.step, self.local_step, self.replay, self.rank = step, local_step, replay, rank
        self.ranks = [rank] if ranks is None and rank is not None else list(ranks or [])
        self.entry, self.micro_batch = entry, micro_batch
        self.elements, self.bit_histogram, self.bundle = elements, bit_histogram, bundle
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
            message += f"; {elements} element(s) differ ({bits})"
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


class ReplayCheck:
    """Runs the loop's step, replaying the forward/backward of checked steps on the device.

    A checked step runs ``1 + num_replays`` times from the same state: each
    execution but the last stops at the optimizer's step and is undone (RNG,
    buffers, state objects and ``scalars`` restored; gradients zeroed in place,
    never copied); the last one continues through the optimizer only when every
    execution produced the same digests on every rank. ``num_steps`` steps are
    checked after construction and after each ``reset_schedule()`` (call it after
    loading a checkpoint); ``-1`` checks every step. The step must begin with no
    pending gradients (``None`` or zero, as after ``zero_grad``).
    """

    def __init__(
        self,
        workload: Workload | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        train_step: Callable[[Any], torch.Tensor | None] | None = None,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        state: Mapping[str, Any] | None = None,
        scalars: Mapping[str, ScalarState] | None = None,
        num_steps: int = 1,
        num_replays: int = 1,
        recorder: Any = None,
        start_step: int = 0,
        group: Any = None,
    ):
        if num_steps != -1 and num_steps < 1:
            raise SdcReplayError(
                f"num_steps={num_steps} checks nothing", "Pass -1 (every step) or N >= 1."
            )
        if num_replays < 1:
            raise SdcReplayError(f"num_replays={num_replays} replays nothing", "Pass N >= 1.")
        self.workload = step_workload(
            workload, model, optimizer, train_step, loss_fn, state, "ReplayCheck"
        )
        self.scalars = dict(scalars or {})
        self.num_steps, self.num_replays = num_steps, num_replays
        self.recorder = recorder
        self.group = group
        self.next_step = start_step
        self.local_step = 0
        self.checked_steps = 0
        self._probe: _Probe | None = None
        self._on_optimizer: Callable[[], None] | None = None
        self._messages: MessageLog | None = None  # the running execution's, under ranks
        # A global hook runs before every optimizer's own pre-hooks (an OperatorMode's, a
        # Recorder's), so an execution it stops leaves them untouched. It holds the check
        # weakly and goes when the check does (or at close()).
        self._hook = register_optimizer_step_pre_hook(_weakly(self._optimizer_begins))
        weakref.finalize(self, self._hook.remove)

    def reset_schedule(self) -> None:
        """Check the next ``num_steps`` steps again (after a checkpoint load, as TorchTitan)."""
        self.local_step = 0

    def close(self) -> None:
        """Remove the optimizer hook (also done when the check is garbage collected)."""
        self._hook.remove()

    def __enter__(self) -> ReplayCheck:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def due(self) -> bool:
        """Will the next step be checked?"""
        return self.num_steps == -1 or self.local_step < self.num_steps

    def run_step(self, batch: Any, *, step: int | None = None) -> torch.Tensor | None:
        """One training step (checked when due); returns the loss of the kept execution."""
        checked = self.due
        step = self.next_step if step is None else step
        self.next_step = step + 1
        self.local_step += 1
        if not checked:
            with self._recording(batch):
                return self.workload.run_step(batch)
        self.checked_steps += 1
        return self._checked_step(batch, step)

    def _recording(self, batch: Any):
        return self.recorder.step(batch) if self.recorder is not None else contextlib.nullcontext()

    def _checked_step(self, batch: Any, step: int) -> torch.Tensor | None:
        model = self.workload.model
        if grads_entering(model) == "kept":
            raise SdcReplayError(
                f"step {step} begins with gradients accumulated before it: a replay would start "
                "from zero and differ",
                "Check only whole optimizer steps (zero_grad before the step), and give every "
                "parameter with requires_grad to the optimizer (or freeze it).",
            )
        baseline = _Baseline(model, self.workload.state, self.scalars)
        reference = _Probe()
        self._execute(batch, reference)
        first: tuple[int, _Probe] | None = None
        for replay in range(1, self.num_replays):
            baseline.restore()
            probe = _Probe(reference.entries)
            probe.reference_messages = reference.messages
            self._execute(batch, probe)
            if first is None and probe.difference is not None:
                first = (replay, probe)
        baseline.restore()
        last = _Probe(reference.entries)
        last.reference_messages = reference.messages
        try:
            with self._recording(batch):
                return self._execute(batch, last, keep=lambda: self._agree(first, last))
        except _StepAborted as aborted:
            verdict = aborted.args[0]
        raise self._mismatch(batch, step, baseline, verdict)

    def _execute(
        self, batch: Any, probe: _Probe, keep: Callable[[], None] | None = None
    ) -> torch.Tensor | None:
        """Run the step under ``probe``: up to the optimizer's step, or, with ``keep``, through
        it once ``keep()`` (called at the optimizer's step) lets it."""
        self._probe, self._on_optimizer = probe, keep
        if _distributed(self.group) and not log_open():  # a job recording logs them itself
            self._messages = MessageLog(algorithm_for(_device_of(self.workload.model).type))
            self._messages.begin_step(0)
        try:
            with _probing_backward(probe, self.workload.model):
                loss = self.workload.run_step(batch)
        except _OptimizerReached:
            return None
        except BaseException as exc:
            if self._messages is not None:  # the step raised before its optimizer step
                self._messages.abandon()
                self._messages = None
            if _unscaled_twice(exc):
                raise SdcReplayError(
                    "the step's GradScaler refused to unscale the replayed execution's gradients: "
                    "it still remembers the stopped execution's unscale_()",
                    "Give the GradScaler to the check with the loop's other state objects "
                    "(state={'scaler': scaler}): it is restored between executions.",
                ) from exc
            raise
        finally:
            self._probe, self._on_optimizer = None, None
        if not probe.finished:  # the step did not step the optimizer: it ends here
            self._end_entries(probe)
            if keep is not None:
                keep()
        return loss

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        probe = self._probe
        if optimizer is not self.workload.optimizer or probe is None or probe.finished:
            return
        self._end_entries(probe)
        if self._on_optimizer is None:
            raise _OptimizerReached
        self._on_optimizer()

    def _end_entries(self, probe: _Probe) -> None:
        """What the step leaves besides gradients: buffers, RNG, scalars, state objects; and
        the collectives issued so far (the gradients' all-reduces)."""
        if self._messages is not None:
            probe.messages = self._messages.end_step()
            self._messages = None
        model = self.workload.model
        with _own_work():
            for name, buffer in model.named_buffers():
                probe.add(f"buffer:{name}", buffer)
            for name, value in capture_rng(_device_of(model)).signature_items():
                probe.add(name, value)
            for name, scalar in self.scalars.items():
                probe.add(f"scalar:{name}", _signature_value(scalar.get()))
            for name, leaf in state_object_items(self.workload.state):
                probe.add(name, leaf)
        probe.flush(None)
        probe.finish()

    def _agree(self, first: tuple[int, _Probe] | None, last: _Probe) -> None:
        """Every rank learns whether any rank differed; raise _StepAborted on all if one did."""
        if first is None and last.difference is not None:
            first = (self.num_replays, last)
        local = None
        if first is not None:
            replay, probe = first
            assert probe.difference is not None
            local = {
                "replay": replay,
                "difference": probe.difference,
                "kept": probe.kept,
                "message": probe.first_input_difference(),
            }
        verdict = _first_rank(local, self.group)
        if verdict is not None:
            raise _StepAborted(verdict)

    def _mismatch(
        self, batch: Any, step: int, baseline: _Baseline, verdict: dict
    ) -> SDCReplayMismatch:
        """One more execution of the step (recorded, when a Recorder is attached) as the third
        voice for forensics; then the state as the step began, and the exception."""
        mine = verdict["rank"] == _rank(self.group)
        difference: Difference = verdict["difference"]
        baseline.restore()
        evidence = _Probe(watch=difference.entry if mine else None)
        bundle = None
        if self.recorder is not None:
            with _own_work():
                before = TrainingSnapshot.take(
                    self.workload.model, self.workload.optimizer, self.workload.state
                )
            with self.recorder.step(batch):
                self._execute(batch, evidence, keep=lambda: None)
            bundle = str(
                self.recorder.dump(
                    f"ReplayCheck: step {step} replay {verdict['replay']} differs at "
                    f"{difference.entry} on rank {verdict['rank']}",  # one rank: no job
                    source="ReplayCheck",
                )
            )
            self.recorder.rewind()  # the step is undone: the ring ends where training stands
            with _own_work():
                before.restore()
        else:
            self._execute(batch, evidence)
            baseline.restore()
        forensics = _forensics(difference, evidence, verdict.get("kept")) if mine else None
        forensics = _shared(forensics, verdict["rank"], self.group) or {}
        return SDCReplayMismatch(
            step=step,
            local_step=self.local_step,
            replay=verdict["replay"],
            rank=verdict["rank"] if len(verdict["ranks"]) == 1 else None,
            ranks=verdict["ranks"],
            entry=difference.entry,
            micro_batch=difference.micro_batch,
            elements=forensics.get("count"),
            bit_histogram=forensics.get("histogram"),
            bundle=bundle,
            evidence=forensics.get("evidence"),
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )


def _unscaled_twice(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "unscale_() has already been called" in str(exc)


def _weakly(method: Callable[[Any, Any, Any], None]) -> Callable[[Any, Any, Any], None]:
    """A global hook calling ``method`` while its object lives, without keeping it alive."""
    alive = weakref.WeakMethod(method)

    def hook(optimizer, args, kwargs) -> None:
        bound = alive()
        if bound is not None:
            bound(optimizer, args, kwargs)

    return hook


class _Baseline:
    """What a checked forward/backward may change, as the step began; gradients by contract
    (None, or zeroed in place), never copied."""

    def __init__(self, model: torch.nn.Module, state: dict, scalars: dict[str, ScalarState]):
        self.model = model
        with _own_work():
            self.snapshot = TrainingSnapshot.take(model, None, state, grads=False, params=False)
            self.scalars = {name: (s, copy_state(s.get())) for name, s in scalars.items()}
        # the entry gradients themselves (None or zero by contract), never their values
        self.entry_grads = {name: p.grad for name, p in model.named_parameters()}

    def restore(self) -> None:
        with _own_work():
            self.snapshot.restore()
            for scalar, value in self.scalars.values():
                scalar.set(copy_state(value))
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    entry = self.entry_grads[name]
                    if param.grad is not entry:  # the same tensor (CUDA graphs hold its address)
                        param.grad = entry
                    if entry is not None:
                        entry.zero_()


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _signature_value(value: Any) -> SignatureValue:
    if isinstance(value, (torch.Tensor, int, float, bool)) or value is None:
        return value
    raise SdcReplayError(
        f"a scalar state's get() returned a {type(value).__name__}",
        "A ScalarState holds a number or a tensor.",
    )


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: Any) -> int:
    return dist.get_rank(group) if _distributed(group) else 0


def _highest(value: int, group: Any) -> int:
    """The largest of every rank's ``value`` (an all-reduce MAX; the value itself alone)."""
    if not _distributed(group):
        return value
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # its collectives take device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    with _own_work(), unlogged():  # not the step's collectives: a recording logs none
        flag = torch.tensor([value], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


def _first_rank(local: dict | None, group: Any) -> dict | None:
    """The mismatch every rank reports. Where a collective's input differs (from the same
    rank's reference execution): the rank whose input differs at the earliest collective, as
    the job replay's origin rule; else the one whose first differing entry comes first in the
    step (a forward fault changes the loss of its own rank before any all-reduce). ``ranks``:
    every rank at that place; more than one means no rank can be named (``rank`` is then only
    the one that shares its details)."""
    if not _distributed(group):
        return None if local is None else {**local, "rank": 0, "ranks": [0]}
    if not _highest(0 if local is None else 1, group):
        return None
    with _own_work():
        summary = (
            None
            if local is None
            else {
                "replay": local["replay"],
                "message": local["message"],
                **vars(local["difference"]),
            }
        )
        gathered: list[Any] = [None] * dist.get_world_size(group)
        with unlogged():
            dist.all_gather_object(gathered, summary, group=group)
    differing = [(r, s) for r, s in enumerate(gathered) if s is not None]
    by_message = [(r, s) for r, s in differing if s["message"] is not None]
    if by_message:
        rank, chosen = min(by_message, key=lambda item: (item[1]["message"], item[0]))
        place: tuple[str, ...] = ("replay", "message")
    else:
        rank, chosen = min(differing, key=lambda item: (item[1]["position"], item[0]))
        place = ("replay", "position", "entry")
    tied = [
        r
        for r, s in enumerate(gathered)
        if s is not None and all(s[key] == chosen[key] for key in place)
    ]
    replay = chosen.pop("replay")
    chosen.pop("message")
    kept = local["kept"] if local is not None and rank == _rank(group) else None
    return {
        "rank": rank,
        "ranks": tied,
        "replay": replay,
        "difference": Difference(**chosen),
        "kept": kept,
    }


def _forensics(difference: Difference, evidence: _Probe, kept: torch.Tensor | None) -> dict:
    """Which execution the evidence execution agrees with at the differing entry; when it is
    the reference (the replay was the odd one), the replay's tensor compared with its own."""
    digest = dict(evidence.entries).get(difference.entry)
    if digest is None:
        return {}
    if digest != difference.reference:
        return {"evidence": "replay" if digest == difference.found else "neither"}
    forensics: dict[str, Any] = {"evidence": "reference"}
    if kept is None or evidence.kept is None:
        return forensics
    found = element_forensics(evidence.kept, kept)
    if found["count"] is not None:
        forensics["count"] = found["count"]
        forensics["histogram"] = {int(b): n for b, n in found["bits"]["histogram"].items()}
    return forensics


def _shared(value: dict | None, owner: int, group: Any) -> dict | None:
    """``owner``'s value on every rank."""
    if not _distributed(group):
        return value
    with _own_work(), unlogged():
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, owner) if group else owner)
    return box[0]


# ---------------------------------------------------------------------------
# UpdateDetector


@dataclass
class Observation:
    """What one execution of a step showed the detector."""

    loss: float | None
    grad_norms: dict[str, float]  # at the optimizer's step (empty: it did not step)
    update_norms: dict[str, float]  # ||parameter after - before|| per parameter
    result: tuple[str, ...]  # digests of the loss, parameters and buffers after the step

    @property
    def grad_norm(self) -> float:
        return math.sqrt(sum(n * n for n in self.grad_norms.values()))


@dataclass
class Alarm:
    """An alarm and what the recompute made of it (Megatron's rerun attribution)."""

    step: int
    reasons: list[str]
    classification: Classification | None = None
    recomputes: int = 0
    original: Observation | None = None
    recomputed: Observation | None = None
    bundle: str | None = None
    contradicted_by: str | None = None  # the second opinion's device that computed otherwise

    def describe(self) -> str:
        verdict = self.classification or "unresolved"
        text = f"step {self.step}: {summarize_reasons(self.reasons)} -> {verdict}"
        return text + (f" (bundle {self.bundle})" if self.bundle else "")


def summarize_reasons(reasons: list[str], shown: int = 3) -> str:
    """Reasons a person can read: a NaN reaches every parameter, so ``nonfinite:grad:NAME``
    for 40 names becomes ``nonfinite:grad (40 parameters: a, b, c, ...)``."""
    groups: dict[str, list[str]] = {}
    for reason in reasons:
        kind, _, name = reason.rpartition(":")
        if kind.endswith(("grad", "update")):  # (nonfinite:)grad:NAME, (nonfinite:)update:NAME
            groups.setdefault(kind, []).append(name)
        else:
            groups.setdefault(reason, [])
    parts = []
    for kind, names in groups.items():
        if len(names) == 1:
            parts.append(f"{kind}:{names[0]}")
        elif names:
            more = ", ..." if len(names) > shown else ""
            parts.append(f"{kind} ({len(names)} parameters: {', '.join(names[:shown])}{more})")
        else:
            parts.append(kind)
    return ", ".join(parts)


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


PEER_ALARM = "peer"
"""The reason on a rank that raised no alarm itself but rolls back with one that did."""

# What a recompute showed, ordered so that the largest over the ranks decides for all.
_PASSED, _REPEATED, _OTHER = 0, 1, 2

SecondOpinion = Callable[[Alarm, TrainingSnapshot, Any], bool]
"""``(alarm, snapshot before the step, batch) -> True`` when another device, from the same
state, reproduces the alarmed result (so it was correct)."""


@dataclass
class _Baselines:
    """Per-parameter EMA and recent window of update norms; Megatron's spike references."""

    ema: dict[str, float] = field(default_factory=dict)
    recent: dict[str, deque] = field(default_factory=dict)
    accepted: int = 0
    first_losses: list[float] = field(default_factory=list)
    first_grad_norms: list[float] = field(default_factory=list)


class UpdateDetector:
    """Runs the loop's step and alarms on unusual optimizer updates; rolls back and recomputes.

    Checks, after each step (seeds/001 and Megatron's rerun state machine):
    ``nonfinite:loss``, ``nonfinite:grad:NAME``, ``nonfinite:update:NAME``;
    ``loss_spike`` / ``grad_spike``: the loss / global gradient norm (taken at the
    optimizer's step, before it) above ``spike_factor`` x the largest of the first
    ``spike_steps`` steps; ``update:NAME``: the parameter's update norm differs from
    its EMA by more than ``max(alpha * EMA, sigmas * std)`` of its last ``window``
    accepted updates (after ``warmup`` accepted steps).

    On an alarm the step is rolled back (``TrainingSnapshot`` taken before it) and
    recomputed on the same device. A different result is ``transient`` (the
    recompute is kept once it passes); the same result is reproducible: ``correct``
    when ``second_opinion`` confirms it elsewhere, ``persistent`` when it does not
    (the step is rolled back and ``PersistentFaultError`` raised). Without a second
    opinion a reproducible alarm is ``correct``, unless the last ``persistent_after``
    steps all ended in reproducible alarms: then ``persistent``. Under torch.distributed
    the ranks of ``group`` agree on every decision, so they run the same executions.
    """

    def __init__(
        self,
        workload: Workload | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        train_step: Callable[[Any], torch.Tensor | None] | None = None,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        state: Mapping[str, Any] | None = None,
        alpha: float = 0.05,
        sigmas: float = 3.0,
        ema_decay: float = 0.9,
        window: int = 100,
        warmup: int = 10,
        spike_factor: float = 10.0,
        spike_steps: int = 100,
        max_recomputes: int = 3,
        persistent_after: int = 3,
        second_opinion: SecondOpinion | None = None,
        snapshot_device: torch.device | str | None = None,
        recorder: Any = None,
        start_step: int = 0,
        group: Any = None,
    ):
        if alpha < 0 or sigmas < 0 or not 0 <= ema_decay < 1 or window < 2:
            raise SdcReplayError(
                f"UpdateDetector(alpha={alpha}, sigmas={sigmas}, ema_decay={ema_decay}, "
                f"window={window}) is not a threshold",
                "alpha, sigmas >= 0; 0 <= ema_decay < 1; window >= 2.",
            )
        if max_recomputes < 1 or persistent_after < 1:
            raise SdcReplayError("max_recomputes and persistent_after must be at least 1")
        self.workload = step_workload(
            workload, model, optimizer, train_step, loss_fn, state, "UpdateDetector"
        )
        self.alpha, self.sigmas, self.ema_decay = alpha, sigmas, ema_decay
        self.window, self.warmup = window, warmup
        self.spike_factor, self.spike_steps = spike_factor, spike_steps
        self.max_recomputes, self.persistent_after = max_recomputes, persistent_after
        self.second_opinion = second_opinion
        self.group = group
        self.snapshot_device = snapshot_device
        self.recorder = recorder
        self.next_step = start_step
        self.alarms: list[Alarm] = []
        self._baselines = _Baselines()
        self._reproducible_in_a_row = 0
        self._counts: Counter[str] = Counter()
        self._overhead = 0.0
        self._recompute_seconds = 0.0
        self._grad_norms: dict[str, float] | None = None
        self._step_seconds = 0.0
        self._hook = self.workload.optimizer.register_step_pre_hook(self._optimizer_begins)

    def close(self) -> None:
        """Remove the optimizer hook."""
        self._hook.remove()

    def __enter__(self) -> UpdateDetector:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def metrics(self) -> dict[str, float | int]:
        """Counters to log: ``steps``, ``detections`` (alarms raised), ``recomputes``,
        ``correct``/``transient``/``persistent`` (classifications), ``overhead_ms`` (time
        spent detecting and recomputing, all steps), ``recompute_ms`` (its recompute part)."""
        return {
            "steps": self._counts["steps"],
            "detections": self._counts["detections"],
            "recomputes": self._counts["recomputes"],
            "correct": self._counts["correct"],
            "transient": self._counts["transient"],
            "persistent": self._counts["persistent"],
            "overhead_ms": 1000.0 * self._overhead,
            "recompute_ms": 1000.0 * self._recompute_seconds,
        }

    @property
    def last_alarm(self) -> Alarm | None:
        return self.alarms[-1] if self.alarms else None

    def run_step(self, batch: Any, *, step: int | None = None) -> torch.Tensor | None:
        """One training step, checked; returns the loss of the execution kept."""
        step = self.next_step if step is None else step
        self.next_step = step + 1
        self._counts["steps"] += 1
        started, step_seconds = time.perf_counter(), 0.0
        try:
            with _own_work():
                snapshot = TrainingSnapshot.take(
                    self.workload.model,
                    self.workload.optimizer,
                    self.workload.state,
                    device=self.snapshot_device,
                )
            recording = self.recorder.step(batch) if self.recorder is not None else None
            with recording if recording is not None else contextlib.nullcontext():
                loss, original = self._observe(batch, snapshot)
            step_seconds = self._step_seconds
            reasons = self.reasons(original)
            if not _highest(int(bool(reasons)), self.group):  # every rank agrees: no alarm
                self._reproducible_in_a_row = 0
                self._accept(original)
                return loss
            reasons = reasons or [PEER_ALARM]  # rolled back with the rank that alarmed
            self._counts["detections"] += 1
            alarm = Alarm(step, reasons, original=original)
            self.alarms.append(alarm)
            return self._resolve(batch, snapshot, alarm, loss)
        finally:  # everything but the loop's own step (the first execution) is overhead
            self._overhead += time.perf_counter() - started - step_seconds

    def judge(self, seen: Observation, *, step: int) -> Alarm | None:
        """Judge a step the detector did not run (a Trainer callback's): a clean one joins the
        baselines; an alarm is dumped (with a recorder), neither rolled back nor recomputed."""
        self._counts["steps"] += 1
        self.next_step = step + 1
        reasons = self.reasons(seen)
        if not reasons:
            self._accept(seen)
            return None
        self._counts["detections"] += 1
        alarm = Alarm(step, reasons, original=seen)
        self.alarms.append(alarm)
        if self.recorder is not None:
            self._dump(alarm)
        return alarm

    def _observe(self, batch: Any, snapshot: TrainingSnapshot) -> tuple[Any, Observation]:
        self._grad_norms = {}
        started = time.perf_counter()
        try:
            loss = self.workload.run_step(batch)
            grad_norms = self._grad_norms
        finally:
            self._grad_norms = None
            self._step_seconds = time.perf_counter() - started
        return loss, observe(self.workload.model, snapshot, loss, grad_norms)

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        if self._grad_norms is None or self._grad_norms:
            return
        with _own_work():
            named = [
                (n, p.grad) for n, p in self.workload.model.named_parameters() if p.grad is not None
            ]
            if named:
                norms = torch.stack(
                    [torch.linalg.vector_norm(g, dtype=torch.float64) for _, g in named]
                )
                self._grad_norms.update(zip([n for n, _ in named], norms.tolist()))

    def reasons(self, seen: Observation) -> list[str]:
        """Why ``seen`` is unusual against the baselines (empty: it is not)."""
        found = []
        if seen.loss is not None and not math.isfinite(seen.loss):
            found.append("nonfinite:loss")
        found += [f"nonfinite:grad:{n}" for n, v in seen.grad_norms.items() if not math.isfinite(v)]
        found += [
            f"nonfinite:update:{n}" for n, v in seen.update_norms.items() if not math.isfinite(v)
        ]
        if found:
            return found
        base = self._baselines
        if _spikes(seen.loss, base.first_losses, self.spike_steps, self.spike_factor):
            found.append("loss_spike")
        if seen.grad_norms and _spikes(
            seen.grad_norm, base.first_grad_norms, self.spike_steps, self.spike_factor
        ):
            found.append("grad_spike")
        if base.accepted >= self.warmup:
            for name, norm in seen.update_norms.items():
                recent = base.recent.get(name)
                if recent is None or len(recent) < 2:
                    continue
                ema = base.ema[name]
                std = _std(recent)
                if abs(norm - ema) > max(self.alpha * ema, self.sigmas * std):
                    found.append(f"update:{name}")
        return found

    def _accept(self, seen: Observation) -> None:
        base = self._baselines
        base.accepted += 1
        for name, norm in seen.update_norms.items():
            previous = base.ema.get(name)
            base.ema[name] = (
                norm
                if previous is None
                else self.ema_decay * previous + (1 - self.ema_decay) * norm
            )
            base.recent.setdefault(name, deque(maxlen=self.window)).append(norm)
        if seen.loss is not None and len(base.first_losses) < self.spike_steps:
            base.first_losses.append(abs(seen.loss))
        if seen.grad_norms and len(base.first_grad_norms) < self.spike_steps:
            base.first_grad_norms.append(seen.grad_norm)

    def _resolve(
        self, batch: Any, snapshot: TrainingSnapshot, alarm: Alarm, loss: Any
    ) -> torch.Tensor | None:
        """Recompute until every rank's execution passes (transient, or correct on a rank that
        only followed another's alarm), or one repeats its predecessor (reproducible), at most
        ``max_recomputes`` times. Every decision is agreed by all ranks, so they run the same
        executions (their collectives match). Recomputes run outside the recorder, whose ring
        keeps the alarmed execution as the evidence until the verdict."""
        previous = alarm.original
        assert previous is not None
        started = time.perf_counter()
        try:
            while alarm.recomputes < self.max_recomputes:
                with _own_work():
                    snapshot.restore()
                alarm.recomputes += 1
                self._counts["recomputes"] += 1
                loss, again = self._observe(batch, snapshot)
                alarm.recomputed = again
                repeated = again.result == previous.result
                outcome = _PASSED if not self.reasons(again) else _REPEATED if repeated else _OTHER
                agreed = _highest(outcome, self.group)
                if agreed == _PASSED:
                    if repeated:  # this rank only followed: its step was right
                        return self._correct(alarm, again, loss)
                    return self._transient(batch, snapshot, alarm, again, loss)
                if agreed == _REPEATED:
                    return self._reproducible(batch, snapshot, alarm, again, loss, outcome)
                previous = again
            self._give_up(snapshot, alarm)
            raise RecomputeLimitError(alarm, self.max_recomputes)
        finally:
            self._recompute_seconds += time.perf_counter() - started

    def _transient(
        self, batch: Any, snapshot: TrainingSnapshot, alarm: Alarm, kept: Observation, loss: Any
    ) -> torch.Tensor | None:
        """Keep the recompute. With a recorder: dump the alarmed execution, take it back, and
        record the step once more so the ring holds what training goes on from."""
        self._reproducible_in_a_row = 0
        self._classify(alarm, "transient")
        if self.recorder is not None:
            self._dump(alarm)
            self.recorder.rewind()
            with _own_work():
                snapshot.restore()
            with self.recorder.step(batch):
                loss, kept = self._observe(batch, snapshot)
        self._accept(kept)
        return loss

    def _correct(self, alarm: Alarm, kept: Observation, loss: Any) -> torch.Tensor | None:
        self._classify(alarm, "correct")
        self._accept(kept)
        return loss

    def _reproducible(
        self,
        batch: Any,
        snapshot: TrainingSnapshot,
        alarm: Alarm,
        seen: Observation,
        loss: Any,
        outcome: int,
    ) -> torch.Tensor | None:
        """The same result again (on some rank): correct if another device agrees (or,
        without one, unless it keeps happening), else persistent: roll back and raise, on
        every rank."""
        confirmed = True
        if outcome == _REPEATED:
            self._reproducible_in_a_row += 1
            if self.second_opinion is not None:
                confirmed = self.second_opinion(alarm, snapshot, batch)
                if not confirmed:
                    device = getattr(self.second_opinion, "device", None)
                    alarm.contradicted_by = "the second opinion" if device is None else str(device)
            else:
                confirmed = self._reproducible_in_a_row < self.persistent_after
        if not _highest(int(not confirmed), self.group):
            original = alarm.original
            if outcome == _PASSED and original is not None and seen.result != original.result:
                return self._transient(batch, snapshot, alarm, seen, loss)
            nonfinite = any(reason.startswith("nonfinite:") for reason in alarm.reasons)
            if _highest(int(outcome == _REPEATED and nonfinite), self.group):
                self._classify(alarm, "correct")  # this device is not accused, yet NaN stays out
                self._give_up(snapshot, alarm)
                raise NonFiniteResultError(alarm)
            return self._correct(alarm, seen, loss)
        self._classify(alarm, "persistent")
        self._give_up(snapshot, alarm)
        raise PersistentFaultError(alarm)

    def _classify(self, alarm: Alarm, classification: Classification) -> None:
        alarm.classification = classification
        self._counts[classification] += 1

    def _give_up(self, snapshot: TrainingSnapshot, alarm: Alarm) -> None:
        """Dump the alarmed step, then the state as before it (the ring's too)."""
        if self.recorder is not None:
            self._dump(alarm)
            self.recorder.rewind()
        with _own_work():
            snapshot.restore()

    def _dump(self, alarm: Alarm) -> None:
        assert self.recorder is not None
        path = self.recorder.dump(
            f"UpdateDetector: step {alarm.step} {summarize_reasons(alarm.reasons)} "
            f"({alarm.classification or 'unresolved'})",
            source="UpdateDetector",
        )
        alarm.bundle = str(path)


def observe(
    model: torch.nn.Module, before: TrainingSnapshot, loss: Any, grad_norms: dict[str, float]
) -> Observation:
    """The step's observation: update norms against ``before`` and digests of the result."""
    with _own_work():
        names = [name for name, _ in model.named_parameters()]
        updates = [
            torch.linalg.vector_norm(
                p.detach() - before.params[n].to(p.device), dtype=torch.float64
            )
            for n, p in model.named_parameters()
        ]
        update_norms = dict(zip(names, torch.stack(updates).tolist())) if updates else {}
        digester = Digester()
        digester.add("loss", None if loss is None else loss.detach())
        for name, param in model.named_parameters():
            digester.add(name, param)
        for name, buffer in model.named_buffers():
            digester.add(name, buffer)
        result = tuple(digest for _, digest in digester.entries())
    value = None if loss is None else float(loss.detach())
    return Observation(value, grad_norms, update_norms, result)


class ReplicaOpinion:
    """Megatron's rerun on a different GPU: a second copy of the workload on ``device``
    recomputes the alarmed step from the same state, in its own thread (so no dispatch mode
    of the training thread, where injected faults live, reaches it).

    ``make_workload`` builds the same workload (e.g. ``lambda: build_workload(ref, kwargs)``);
    it is built once, on first use. The alarmed result is confirmed (``correct``) when the
    replica's loss and every update norm agree within ``rtol`` (devices round differently).
    """

    def __init__(
        self, make_workload: Callable[[], Workload], device: str = "cpu", rtol: float = 1e-3
    ):
        self.make_workload, self.device, self.rtol = make_workload, torch.device(device), rtol
        self._replica: Workload | None = None
        self.last: Observation | None = None

    def __call__(self, alarm: Alarm, before: TrainingSnapshot, batch: Any) -> bool:
        outcome: list[Any] = []
        worker = threading.Thread(target=self._recompute, args=(before, batch, outcome))
        saved = capture_rng(before.device)
        try:
            worker.start()
            worker.join()
        finally:
            restore_rng(saved, before.device)
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        seen = self.last = outcome[0]
        original = alarm.original
        assert original is not None
        return self._close(seen.loss, original.loss) and all(
            self._close(seen.update_norms.get(name), norm)
            for name, norm in original.update_norms.items()
        )

    def _close(self, a: float | None, b: float | None) -> bool:
        if a is None or b is None:
            return a is b
        return a == b or math.isclose(a, b, rel_tol=self.rtol)

    def _recompute(self, before: TrainingSnapshot, batch: Any, outcome: list) -> None:
        try:
            if self._replica is None:
                self._replica = self.make_workload()
                self._replica.model.to(self.device)
            replica = self._replica
            load_snapshot(replica, before)
            if before.rng is not None:
                restore_rng(before.rng, self.device)
            moved = map_tensors(batch, lambda t: t.to(self.device))
            state = TrainingSnapshot.take(replica.model, None, grads=False, rng=False)
            loss = replica.run_step(moved)
            outcome.append(observe(replica.model, state, loss, {}))
        except BaseException as exc:  # handed to the training thread
            outcome.append(exc)


def load_snapshot(workload: Workload, snapshot: TrainingSnapshot) -> None:
    """Put a snapshot of one copy of a workload into another copy (same factory: same names
    and parameter order)."""
    params = dict(workload.model.named_parameters())
    buffers = dict(workload.model.named_buffers())
    with torch.no_grad():
        for name, value in snapshot.params.items():
            params[name].copy_(value)
        for name, value in snapshot.buffers.items():
            buffers[name].copy_(value)
    for param in params.values():
        param.grad = None
    if snapshot.optimizer_state is not None:
        workload.optimizer.load_state_dict(copy_state(snapshot.optimizer_state))
    for name, obj in workload.state.items():
        obj.load_state_dict(copy_state(snapshot.object_states[name]))


def _spikes(value: float | None, first: list[float], steps: int, factor: float) -> bool:
    """Megatron's rule: above ``factor`` x the largest of the first ``steps`` values (which
    must all have been seen)."""
    return value is not None and len(first) >= steps and abs(value) > factor * max(first)


def _std(values: deque) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
