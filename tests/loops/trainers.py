"""The objects real trainers hand a Recorder, outside the package: Accelerate's wrapped
optimizer, TorchTitan's optimizer container over its model parts, several optimizers, and a
model whose state_dict hook builds tensors (TorchTitan's fused ``wqkv`` split into ``wq``,
``wk``, ``wv``).

``make_workload(form=...)`` is the entry point replay calls; ``train(...)`` is the loop that
records with ``sdcreplay.Recorder``, handing it the objects as the trainer holds them.
TorchTitan is not installed here: ``OptimizersContainer`` is a faithful small stand-in of
torchtitan 0.3.0's (``torchtitan.components.optimizer``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import sdcreplay

FORMS = ("fused", "accelerate", "container", "list")
DIM = 8


class FusedAttention(nn.Module):
    """Attention with one fused ``wqkv`` projection whose state_dict holds ``wq``, ``wk`` and
    ``wv`` (split by a state_dict post-hook, fused again by a load pre-hook), as TorchTitan's
    fused debug model keeps its checkpoints in the unfused names."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_state_dict_post_hook(_split_qkv)
        self.register_load_state_dict_pre_hook(_fuse_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        return x + self.wo(torch.softmax(scores, dim=-1) @ v)


def _split_qkv(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    fused = state_dict.pop(f"{prefix}wqkv.weight")
    for name, part in zip(("wq", "wk", "wv"), fused.chunk(3)):
        state_dict[f"{prefix}{name}.weight"] = part  # new tensors, no parameter's


def _fuse_qkv(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    parts = [state_dict.pop(f"{prefix}{name}.weight") for name in ("wq", "wk", "wv")]
    state_dict[f"{prefix}wqkv.weight"] = torch.cat(parts)


class Part(nn.Module):
    """A pipeline stage: a projection in, a fused attention block."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.attention = FusedAttention(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(torch.relu(self.proj(x)))


class OptimizersContainer(torch.optim.Optimizer):
    """torchtitan 0.3.0's container: one optimizer per model part at ``.optimizers``, stepped
    together; a torch Optimizer over all their parameters (for its hooks) whose state_dict is
    flat, keyed by parameter name (torch.distributed.checkpoint's flattened form)."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type, kwargs: dict):
        every: list[nn.Parameter] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.model_parts = model_parts
        for model in model_parts:
            params = [p for p in model.parameters() if p.requires_grad]
            self.optimizers.append(optimizer_cls(params, **kwargs))
            every.extend(params)
        torch.optim.Optimizer.__init__(self, every, kwargs)

    def step(self, *args: Any, **kwargs: Any) -> None:
        for optimizer in self.optimizers:
            optimizer.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        flat = functools.partial(
            get_optimizer_state_dict, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
        return {k: v for sd in map(flat, self.model_parts, self.optimizers) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load = functools.partial(
            set_optimizer_state_dict,
            optim_state_dict=state_dict,
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        list(map(load, self.model_parts, self.optimizers))


def build(form: str) -> tuple[Any, Any]:
    """The model and optimizer as the trainer of ``form`` holds them (seeded by the caller)."""
    if form == "fused":
        model = nn.Sequential(Part(), Part())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    if form == "accelerate":
        from accelerate import Accelerator

        model = nn.Sequential(Part(), Part())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return Accelerator(cpu=True).prepare(model, optimizer)
    parts = [Part(), Part()]  # a pipeline's stages on this rank: TorchTitan's model_parts
    if form == "container":
        return parts, OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    if form == "list":
        return parts, [
            torch.optim.AdamW(parts[0].parameters(), lr=1e-2),
            torch.optim.SGD(parts[1].parameters(), lr=1e-2, momentum=0.9),
        ]
    raise ValueError(form)


def get_batch(index: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    return {
        "x": torch.randn(2, 4, DIM, generator=generator),
        "y": torch.randn(2, 4, DIM, generator=generator),
    }


def forward(model: Any, x: torch.Tensor) -> torch.Tensor:
    for part in model if isinstance(model, list) else [model]:
        x = part(x)
    return x


def make_step(model: Any, optimizer: Any):
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = F.mse_loss(forward(model, batch["x"]), batch["y"])
        loss.backward()
        for each in optimizers:
            each.step()
            each.zero_grad()
        return loss.detach()

    return step


def make_workload(seed: int = 0, form: str = "fused") -> sdcreplay.Workload:
    torch.manual_seed(seed)
    model, optimizer = build(form)
    step = make_step(model, optimizer)
    return sdcreplay.Workload(
        model=model, optimizer=optimizer, get_batch=get_batch, train_step=step
    )


def recorder(
    path: Path, form: str, warmup: int = 0, **options: Any
) -> tuple[sdcreplay.Recorder, Any]:
    """A Recorder over the objects of ``form`` as the trainer hands them, created after
    ``warmup`` steps (so the optimizers' state is not empty), and the loop's step."""
    torch.manual_seed(0)
    model, optimizer = build(form)
    step = make_step(model, optimizer)
    for index in range(warmup):
        step(get_batch(index))
    rec = sdcreplay.Recorder(
        path,
        f"{Path(__file__).resolve()}:make_workload",
        model,
        optimizer,
        workload_kwargs={"seed": 0, "form": form},
        start_step=warmup,
        **options,
    )
    return rec, step


def train(rec: sdcreplay.Recorder, step: Any, steps: range) -> None:
    for index in steps:
        batch = get_batch(index)
        with rec.step(batch):
            step(batch)
