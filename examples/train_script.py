"""Record your own training script as it is (script mode): no factory, no copy of the step.

    python examples/train_script.py --out /tmp/run.bundle
    sdcreplay replay /tmp/run.bundle --device cpu:0 --device cpu:1 --device cpu:2

A realistic step: gradient accumulation over micro-batches under bf16 autocast, the next
micro-batch sampled inside the step, gradient clipping, AdamW, and a warm-up + cosine
learning rate set before each step. The Recorder is given no ``workload=``: the bundle names
this command, and replay runs this script again in replay mode, where ``rec.feed`` hands the
step the recorded micro-batches and the script ends after the recorded steps
(docs/porting.md). ``examples/train_loop.py`` is the same loop with a workload factory.
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


def sample_micro_batch(batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A random micro-batch of a synthetic data set (drawn from the global generator, as a
    sampler does; a real script would use its DataLoader)."""
    x = torch.randn(batch_size, FEATURES)
    return x, x[:, :CLASSES].argmax(dim=1)


def learning_rate(step: int, peak: float, warmup: int = 2, total: int = 20) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/run.bundle"), help="bundle to write")
    parser.add_argument("--steps", type=int, default=5, help="training steps to run and record")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Classifier(args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rec = sdcreplay.Recorder(args.out, model=model, optimizer=optimizer, overwrite=args.overwrite)
    with rec:
        batch = sample_micro_batch()
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.lr)
            with rec.step():
                total = 0.0
                for _ in range(args.micro_batches):
                    x, y = rec.feed(batch)
                    batch = sample_micro_batch()  # the next one, sampled inside the step
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = F.cross_entropy(model(x), y) / args.micro_batches
                    loss.backward()
                    total += loss.item()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if not sdcreplay.replaying():
                print(f"step {step}: loss {total:.4f}, lr {optimizer.param_groups[0]['lr']:.5f}")
    if not sdcreplay.replaying():
        print(f"Recorded {rec.steps_written} steps in {rec.path} (verified: replay runs them)")
        print(f"Replay them: sdcreplay replay {rec.path}")


if __name__ == "__main__":
    main()
