"""Record the steps of your own training loop with sdcreplay.Recorder.

    python examples/train_loop.py --out /tmp/run.bundle
    sdcreplay replay /tmp/run.bundle

The recorder needs one thing besides the loop: a *workload entry point* that
rebuilds the same model and optimizer, so `sdcreplay replay` can re-run the
recorded steps in a fresh process. Here it is ``make_workload`` below, named
in the bundle as ``/absolute/path/to/train_loop.py:make_workload``.
"""

from __future__ import annotations

import argparse
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


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def make_workload(seed: int = 0, hidden: int = 64, lr: float = 1e-2) -> sdcreplay.Workload:
    """The entry point replay calls, with the keyword arguments the Recorder was given."""
    torch.manual_seed(seed)
    model = Classifier(hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return sdcreplay.Workload(model=model, optimizer=optimizer, get_batch=get_batch, loss_fn=loss_fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/run.bundle"), help="bundle to write")
    parser.add_argument("--steps", type=int, default=5, help="training steps to run and record")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
    args = parser.parse_args()

    # Your own set-up: build (or load) the model and optimizer as usual.
    kwargs = {"seed": args.seed, "hidden": args.hidden}
    workload = make_workload(**kwargs)
    model, optimizer = workload.model, workload.optimizer
    loader = (get_batch(i) for i in range(args.steps))

    rec = sdcreplay.Recorder(
        args.out,
        workload=f"{Path(__file__).resolve()}:make_workload",
        workload_kwargs=kwargs,
        model=model,
        optimizer=optimizer,
        overwrite=args.overwrite,
    )
    for step, batch in enumerate(loader):
        with rec.step(batch):
            loss = loss_fn(model, batch)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    path = rec.close()
    print(f"Recorded {rec.steps_written} steps in {path}")
    print(f"Replay them: sdcreplay replay {path}")


if __name__ == "__main__":
    main()
