"""Record the steps of your own training loop with sdcreplay.Recorder.

    python examples/train_loop.py --out /tmp/run.bundle
    sdcreplay replay /tmp/run.bundle --device cpu:0 --device cpu:1

A realistic step: gradient accumulation over micro-batches under bf16 autocast,
gradient clipping, AdamW, and a warm-up + cosine learning-rate schedule.

The recorder needs one thing besides the loop: a *workload entry point* that
rebuilds the same model, optimizer, scheduler and step, so `sdcreplay replay`
can re-run the recorded steps in a fresh process. Here it is ``make_workload``
below, named in the bundle as ``/absolute/path/to/train_loop.py:make_workload``.
The loop calls the very ``train_step`` replay will run, inside ``rec.step``;
the Recorder re-executes the first step through it and refuses a loop that does
something else (WorkloadMismatchError).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sdcreplay

FEATURES, CLASSES = 16, 4


class Classifier(nn.Module):
    """A small MLP with dropout, so the recorded RNG state matters."""

    def __init__(self, hidden: int):
        super().__init__()
        self.inp = nn.Linear(FEATURES, hidden)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(F.gelu(self.inp(x))))


def get_batch(index: int, batch_size: int = 32) -> dict[str, torch.Tensor]:
    """Batch *index* of a synthetic data set (a real loop would use its DataLoader)."""
    generator = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(batch_size, FEATURES, generator=generator)
    y = x[:, :CLASSES].argmax(dim=1)
    return {"x": x, "y": y}


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def make_workload(
    seed: int = 0,
    hidden: int = 64,
    lr: float = 1e-2,
    micro_batches: int = 4,
    max_norm: float = 1.0,
    warmup: int = 2,
    total_steps: int = 20,
) -> sdcreplay.Workload:
    """The entry point replay calls, with the keyword arguments the Recorder was given."""
    torch.manual_seed(seed)
    model = Classifier(hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total_steps))

    def train_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` micro-batches, exactly as the loop runs it."""
        total = 0.0
        for x, y in zip(batch["x"].chunk(micro_batches), batch["y"].chunk(micro_batches)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y) / micro_batches
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return torch.tensor(total)

    return sdcreplay.Workload(
        model=model,
        optimizer=optimizer,
        get_batch=get_batch,
        train_step=train_step,
        state={"scheduler": scheduler},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/run.bundle"), help="bundle to write")
    parser.add_argument("--steps", type=int, default=5, help="training steps to run and record")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
    args = parser.parse_args()

    # Your own set-up: build (or load) the model, optimizer and scheduler as usual.
    kwargs = {"seed": args.seed, "hidden": args.hidden}
    workload = make_workload(**kwargs)
    loader = (get_batch(i) for i in range(args.steps))

    rec = sdcreplay.Recorder(
        args.out,
        workload=f"{Path(__file__).resolve()}:make_workload",
        workload_kwargs=kwargs,
        model=workload.model,
        optimizer=workload.optimizer,
        state=workload.state,  # the scheduler's state goes into the bundle too
        overwrite=args.overwrite,
    )
    with rec:
        for step, batch in enumerate(loader):
            with rec.step(batch):
                loss = workload.train_step(batch)
            lr = workload.state["scheduler"].get_last_lr()[0]
            print(f"step {step}: loss {loss.item():.4f}, lr {lr:.5f}")
    print(
        f"Recorded {rec.steps_written} steps in {rec.path} (verified: replay runs the loop's step)"
    )
    print(f"Replay them: sdcreplay replay {rec.path}")


if __name__ == "__main__":
    main()
