"""A user's training loop whose step runs compiled (tests start it as a subprocess).

``python compiled_function_loop.py OUT --steps 2``: a tiny MLP whose activation block is
``torch.compile``d with the default Inductor backend (C++ kernels on a CPU), SGD, recorded by
a Recorder at the boundary level without the first-step check. The compiled block is a
function the model calls, so the Recorder's hooks stay outside the compiled code. Its shapes
are fixed, so Inductor's on-disk caches make every process after the first compile in seconds.
Prints one JSON line: the bundle.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import sdcreplay


@torch.compile
def gated(h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Inductor fuses this into one kernel forward and one backward (plus a reduction)."""
    return torch.nn.functional.gelu(h) * torch.sigmoid(gate) + h * 0.5


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.gate = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 16))
        self.down = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gated(self.up(x), self.gate))


def make_workload(seed: int = 0) -> sdcreplay.Workload:
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def get_batch(index: int) -> dict:
        generator = torch.Generator().manual_seed(500 + index)
        return {
            "x": torch.randn(4, 8, generator=generator),
            "y": torch.randn(4, 4, generator=generator),
        }

    def train_step(batch: dict) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return sdcreplay.Workload(model, optimizer, get_batch, train_step=train_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    workload = make_workload()
    recorder = sdcreplay.Recorder(
        args.out,
        f"{Path(__file__).resolve()}:make_workload",
        workload.model,
        workload.optimizer,
        signature="boundary",
        verify=False,
    )
    with recorder:
        for step in range(args.steps):
            with recorder.step(workload.get_batch(step)):
                workload.run_step(workload.get_batch(step))
    print(json.dumps({"bundle": str(args.out)}))


if __name__ == "__main__":
    main()
