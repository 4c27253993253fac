"""Training loops as users write them, outside the package: one small classifier, and the
everyday things a real step does (clipping, LR schedulers, GradScaler with a skipped step,
gradient accumulation, the optimizer every other step, EMA, skipping a NaN loss).

``make_workload(feature=...)`` is the entry point replay calls; ``train(...)`` is the
hand-written loop that records with ``sdcreplay.Recorder``. With ``feature_in_step=False``
the workload's step leaves the feature out while the loop still does it: the recording
cannot be replayed, and the Recorder must say so.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import sdcreplay

FEATURES = (
    "clip",
    "onecycle",
    "steplr",
    "scaler",
    "accum_inside",
    "accum_across",
    "every_other",
    "ema_buffer",
    "ema_model",
    "nan_skip",
)
POISONED_STEP = {"scaler": (2, float("inf")), "nan_skip": (0, float("nan"))}
"""The step whose loss a feature makes non-finite: GradScaler skips it, nan_skip drops it."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


class StepCounter:
    """Which micro-step of an accumulation window this is: state the loop keeps between steps."""

    def __init__(self):
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class EmaBuffers:
    """An exponential moving average of the weights, kept as plain tensors."""

    def __init__(self, model: nn.Module, decay: float = 0.9):
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            self.shadow[name].mul_(self.decay).add_(p, alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        for name, tensor in state["shadow"].items():
            self.shadow[name].copy_(tensor)


def get_batch(index: int, feature: str = "clip") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + index)
    x = torch.randn(4, 8, generator=generator)
    poisoned_step, value = POISONED_STEP.get(feature, (None, 1.0))
    return {
        "x": x,
        "y": x[:, :4].argmax(dim=1),
        "scale": torch.tensor(value if index == poisoned_step else 1.0),
    }


def build(feature: str):
    """The model, the optimizer and the state objects this feature needs."""
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict = {}
    if feature == "onecycle":
        state["sched"] = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=20)
    elif feature == "steplr":
        state["sched"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    elif feature == "scaler":
        state["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    elif feature in ("accum_across", "every_other"):
        state["counter"] = StepCounter()
    elif feature == "ema_buffer":
        state["ema"] = EmaBuffers(model)
    elif feature == "ema_model":
        state["ema"] = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    return model, optimizer, state


def make_step(model, optimizer, state, feature: str, with_feature: bool = True):
    """The whole training step as the loop runs it (``with_feature=False``: without the feature)."""
    feature = feature if with_feature else "none"

    def loss_of(batch) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["y"]) * batch["scale"]

    def train_step(batch) -> torch.Tensor:
        if feature == "accum_inside":  # two micro-batches, one optimizer step
            loss = sum(
                _backward(loss_of({k: v[part] if v.dim() else v for k, v in batch.items()}) / 2)
                for part in (slice(0, 2), slice(2, 4))
            )
        else:
            loss = loss_of(batch)
            if feature == "nan_skip" and not torch.isfinite(loss):
                optimizer.zero_grad()
                return loss
            _backward(state["scaler"].scale(loss) if feature == "scaler" else loss)
        if feature == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        if feature == "scaler":
            state["scaler"].step(optimizer)  # skipped when the gradients are not finite
            state["scaler"].update()
        elif feature in ("accum_across", "every_other"):
            state["counter"].count += 1
            if state["counter"].count % 2 == 1:
                if feature == "every_other":
                    optimizer.zero_grad()
                return loss
            optimizer.step()
        else:
            optimizer.step()
        if feature in ("onecycle", "steplr"):
            state["sched"].step()
        if feature in ("ema_buffer", "ema_model"):
            ema = state["ema"]
            ema.update(model) if feature == "ema_buffer" else ema.update_parameters(model)
        optimizer.zero_grad()
        return loss

    return train_step


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def make_workload(
    seed: int = 0, feature: str = "clip", feature_in_step: bool = True
) -> sdcreplay.Workload:
    torch.manual_seed(seed)
    model, optimizer, state = build(feature)
    return sdcreplay.Workload(
        model=model,
        optimizer=optimizer,
        get_batch=lambda index: get_batch(index, feature),
        train_step=make_step(model, optimizer, state, feature, feature_in_step),
        state=state,
    )


def train(
    path: Path,
    feature: str,
    steps: int = 4,
    *,
    feature_in_step: bool = True,
    verify: bool | str = True,
) -> sdcreplay.Recorder:
    """A hand-written loop: the loop's own step (always with the feature) inside ``rec.step``."""
    kwargs = {"seed": 0, "feature": feature, "feature_in_step": feature_in_step}
    torch.manual_seed(0)
    model, optimizer, state = build(feature)
    step = make_step(model, optimizer, state, feature)
    rec = sdcreplay.Recorder(
        path,
        f"{Path(__file__).resolve()}:make_workload",
        model,
        optimizer,
        state=state,
        workload_kwargs=kwargs,
        verify=verify,
    )
    with rec:
        for index in range(steps):
            batch = get_batch(index, feature)
            with rec.step(batch):
                step(batch)
    return rec
