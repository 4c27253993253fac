"""What the update detector saw in one execution of a step, and what it made of it.

Apart from the detector because the exceptions that stop training, the second
opinion and the trainer callbacks (``integrations/watch.py``) all speak of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..capture.digest import Digester
from ..capture.operators import _own_work
from ..capture.snapshot import TrainingSnapshot

Classification = Literal["correct", "transient", "persistent"]


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
