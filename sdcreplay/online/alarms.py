"""What the update detector saw in one execution of a step, and what it made of it.

Apart from the detector because the exceptions that stop training, the second
opinion and the trainer callbacks (``integrations/watch.py``) all speak of it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..capture.digest import Digester
from ..capture.layers import observed_backward
from ..capture.module_names import named_parameters
from ..capture.operators import _own_work
from ..capture.snapshot import TrainingSnapshot

Classification = Literal["correct", "transient", "persistent"]


@dataclass
class Observation:
    """What one execution of a step showed the detector."""

    loss: float | None
    grad_norms: dict[str, float]  # at the optimizer's step (empty: it did not step)
    update_norms: dict[str, float]  # ||parameter after - before|| per parameter (after it)
    # What a recompute must reproduce: digests of the loss, parameters and buffers after the
    # step, or (judged before the update) of the loss and the gradients the optimizer is given
    result: tuple[str, ...] = ()

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


def observe(
    model: torch.nn.Module, before: TrainingSnapshot, loss: Any, grad_norms: dict[str, float]
) -> Observation:
    """The step's observation: update norms (by plain name: `module_names`) against
    ``before`` (by ``named_parameters()``'s) and digests of the result."""
    with _own_work():
        names = [name for name, _ in named_parameters(model)]
        updates = [
            whole(
                torch.linalg.vector_norm(
                    p.detach() - before.params[n].to(p.device), dtype=torch.float64
                )
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


def whole(value: torch.Tensor) -> torch.Tensor:
    """A reduction of a sharded tensor (FSDP2's DTensor parameters and gradients, a partial
    norm) as the whole tensor's, the same on every rank of its mesh (a collective)."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            return value.full_tensor()
    return value


def gradient_norms(
    model: torch.nn.Module, parameters: list[tuple[str, torch.nn.Parameter]] | None = None
) -> dict[str, float]:
    """Each parameter's gradient norm now (one fused pass per device and one sync); a norm that
    overflows float32 is taken again in float64, so Inf means a NaN or an Inf is there.
    ``parameters``: the model's named parameters (plain names: `module_names`), when the
    caller keeps them."""
    parameters = list(named_parameters(model)) if parameters is None else parameters
    named = [(name, p.grad) for name, p in parameters if p.grad is not None]
    norms: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, grad in named:
        by_device.setdefault(grad.device, []).append((name, grad))
    with _own_work(), torch.no_grad():
        for group in by_device.values():
            values = torch._foreach_norm([grad for _, grad in group])
            fetched = torch.stack([whole(value).float() for value in values]).tolist()
            for (name, grad), value in zip(group, fetched):
                if not math.isfinite(value) and bool(whole(torch.isfinite(grad).all())):
                    value = float(whole(torch.linalg.vector_norm(grad, dtype=torch.float64)))
                norms[name] = value
    return norms


def gradient_result(model: torch.nn.Module, loss: torch.Tensor | None) -> tuple[str, ...]:
    """Digests of the loss and of every gradient as the optimizer is about to be given them:
    what a recompute judged before the update must reproduce."""
    with _own_work():
        digester = Digester()
        digester.add("loss", None if loss is None else loss.detach())
        for name, param in model.named_parameters():
            digester.add(name, param.grad)
        return tuple(digest for _, digest in digester.entries())


class BackwardLosses:
    """The losses handed to ``backward()`` in a step, summed: the step's loss as the optimizer's
    step begins (divided by a GradScaler's scale among ``state``, which multiplied it)."""

    def __init__(self, state: dict[str, Any]):
        self._scalers = [obj for obj in state.values() if isinstance(obj, torch.amp.GradScaler)]
        self.losses: list[torch.Tensor] = []

    @contextlib.contextmanager
    def observing(self) -> Iterator[None]:
        self.losses = []
        with observed_backward(lambda loss: self.losses.append(loss.detach()), lambda: None):
            yield

    def tensor(self) -> torch.Tensor | None:
        if not self.losses:
            return None
        with _own_work():
            total = torch.stack([loss.float().reshape(()) for loss in self.losses]).sum()
            for scaler in self._scalers:
                if scaler.is_enabled():
                    total = total / scaler.get_scale()
        return total

    def value(self) -> float | None:
        total = self.tensor()
        return None if total is None else float(total)


Sketch = dict[str, tuple[torch.Tensor, ...]]
"""Per parameter: its sums along its last dimension and along its first (a vector: its sum)."""


def update_sketch(named: list[tuple[str, torch.nn.Parameter]]) -> Sketch:
    """The parameters' sketch, in float32: its change between two updates is that of the
    update's rows' and columns' sums, which a corrupted element (or a burst along a row or a
    column) moves about as much as it moves the update itself, with no copy."""
    with _own_work(), torch.no_grad():
        return {name: _sums(p.detach()) for name, p in named}


def _sums(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if tensor.dim() < 2:
        return (tensor.sum(dtype=torch.float32).reshape(1),)
    return tensor.sum(dim=-1, dtype=torch.float32), tensor.sum(dim=0, dtype=torch.float32)


def sketch_distances(before: Sketch, after: Sketch) -> dict[str, float]:
    """The norm of each sketch's change: a parameter's update, measured on its sketch."""
    names = [
        name
        for name, sums in after.items()
        if name in before and [s.shape for s in before[name]] == [s.shape for s in sums]
    ]
    if not names:
        return {}
    with _own_work(), torch.no_grad():
        changes = [a - b for name in names for a, b in zip(after[name], before[name])]
        norms = [whole(norm) for norm in torch._foreach_norm(changes)]
        squares = torch.stack([norm.to(norms[0].device) for norm in norms]).square().tolist()
    distances, position = {}, 0
    for name in names:
        parts = len(after[name])
        distances[name] = math.sqrt(sum(squares[position : position + parts]))
        position += parts
    return distances


def learning_rates(
    optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]]
) -> dict[str, float]:
    """Each parameter's learning rate in its param group now."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    rates = {}
    for name, param in named:
        group = group_of.get(id(param))
        if group is not None and "lr" in group:
            rates[name] = float(group["lr"])
    return rates
