"""The replay check: a checked step executed again on the same device, compared digest by digest.

``ReplayCheck`` executes a checked step's forward/backward again from the same
state on the same device and compares digests of everything it produced (the
loss and gradients of every backward, the gradients as the optimizer is given
them, buffers, RNG, caller-owned scalars and state objects), as TorchTitan's SDC
replayer does, with sdcreplay's position-aware digest and every micro-batch
checked. It drives the loop's own step (``Workload.run_step``) and, given a ring
``Recorder``, records every step through it and dumps a bundle of a step that
differs, so `sdcreplay replay` and `sdcreplay bisect` start from it. See
docs/online.md.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..capture.collectives import MessageLog, log_open
from ..capture.determinism import capture_rng
from ..capture.digest import SignatureValue, algorithm_for
from ..capture.layers import grads_entering, state_object_items
from ..capture.module_names import named_buffers, named_parameters
from ..capture.operators import _own_work
from ..capture.snapshot import TrainingSnapshot, copy_state
from ..compare.forensics import element_forensics
from ..errors import SdcReplayError
from ..workload.definition import Workload
from .agreement import _distributed, _first_rank, _rank, _shared
from .execution import Difference, _Probe, _probing_backward
from .step import ConfigurationError, ScalarState, step_workload
from .stopping import SDCReplayMismatch


class _OptimizerReached(Exception):
    """Stops an execution that must not update anything at the optimizer's step."""


class _StepAborted(Exception):
    """The kept execution found a mismatch (on some rank) before the optimizer step."""


class ReplayCheck:
    """Runs the loop's step, replaying the forward/backward of checked steps on the device.

    A checked step runs ``1 + num_replays`` times from the same state: each
    execution but the last stops at the optimizer's step and is undone (RNG,
    buffers, state objects and ``scalars`` restored; gradients zeroed in place,
    never copied); the last one continues through the optimizer only when every
    execution produced the same digests on every rank, up to the gradients the
    optimizer is given. ``num_steps`` steps are checked after construction and after
    each ``reset_schedule()`` (call it after loading a checkpoint); ``-1`` checks every
    step; a step that raised (a mismatch) does not count, so its retry is checked
    again. The step must begin with no pending gradients (``None`` or zero, as after
    ``zero_grad``).
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
            raise ConfigurationError(
                f"num_steps={num_steps} checks nothing", "Pass -1 (every step) or N >= 1."
            )
        if num_replays < 1:
            raise ConfigurationError(f"num_replays={num_replays} replays nothing", "Pass N >= 1.")
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
        """One training step (checked when due); returns the loss of the kept execution.

        Only a step that completed advances the schedule (``local_step``, ``next_step``): a
        step that raised (``SDCReplayMismatch``) left the state as it began, so the loop's
        retry of it is the same step, checked again."""
        step = self.next_step if step is None else step
        if self.due:
            self.checked_steps += 1
            loss = self._checked_step(batch, step)
        else:
            with self._recording(batch):
                loss = self.workload.run_step(batch)
        self.next_step = step + 1
        self.local_step += 1
        return loss

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
        self._step_gradients(probe, optimizer)
        self._end_entries(probe)
        if self._on_optimizer is None:
            raise _OptimizerReached
        self._on_optimizer()

    def _step_gradients(self, probe: _Probe, optimizer: torch.optim.Optimizer) -> None:
        """``step_grad:NAME``: each gradient as the optimizer is given it, named as a bundle's
        entries are. Whatever changed it since its backward (clipping, unscaling, a manual
        reduction, a fault in any kernel between them) is then checked too. Hashed afresh:
        in-place foreach ops and ``.data`` edits do not bump the version counter."""
        names = {id(param): name for name, param in named_parameters(self.workload.model)}
        with _own_work():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) in names:
                        probe.add(f"step_grad:{names[id(param)]}", param.grad)

    def _end_entries(self, probe: _Probe) -> None:
        """What the step leaves besides gradients: buffers, RNG, scalars, state objects; and
        the collectives issued so far (the gradients' all-reduces)."""
        if self._messages is not None:
            probe.messages = self._messages.end_step()
            self._messages = None
        model = self.workload.model
        with _own_work():
            for name, buffer in named_buffers(model):
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
        local_step = self.local_step + 1  # this step's place in the schedule, not yet counted
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
            dumped = self.recorder.dump(
                f"ReplayCheck: step {step} replay {verdict['replay']} differs at "
                f"{difference.entry} on rank {verdict['rank']}",  # one rank: no job
                source="ReplayCheck",
            )
            bundle = None if dumped is None else str(dumped)
            self.recorder.rewind()  # the step is undone: the ring ends where training stands
            with _own_work():
                before.restore()
        else:
            self._execute(batch, evidence)
        baseline.restore()  # the scalars too: outside every snapshot, they are the check's own
        forensics = _forensics(difference, evidence, verdict.get("kept")) if mine else None
        forensics = _shared(forensics, verdict["rank"], self.group) or {}
        return SDCReplayMismatch(
            step=step,
            local_step=local_step,
            replay=verdict["replay"],
            rank=verdict["rank"] if len(verdict["ranks"]) == 1 else None,
            ranks=verdict["ranks"],
            entry=difference.entry,
            micro_batch=difference.micro_batch,
            elements=forensics.get("count"),
            bit_histogram=forensics.get("histogram"),
            shard_of=verdict["rank"] if forensics.get("local_shard") else None,
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
    raise ConfigurationError(
        f"a scalar state's get() returned a {type(value).__name__}",
        "A ScalarState holds a number or a tensor.",
    )


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
        forensics["local_shard"] = evidence.kept_shard
    return forensics
