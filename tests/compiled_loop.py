"""A user's training loop over a `torch.compile`d model (tests start it as a subprocess).

``python compiled_loop.py OUT --compile full|blocks --signature layer|boundary --steps 3``:
a tiny residual MLP (two blocks of Linear + LayerNorm + ReLU, a head), compiled whole
(``torch.compile(model)``) or block by block in place as TorchTitan does
(``block.compile()``), trained with SGD and momentum under a Recorder. ``--dynamic`` and
``--fullgraph`` pass on to the compile. Prints one JSON line: the bundle and its compiled
regions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import sdcreplay


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.fc(x)))


class Net(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def make_workload(
    compile: str = "full",
    dynamic: bool | None = None,
    fullgraph: bool = False,
    seed: int = 0,
    parallel: str | None = None,
) -> sdcreplay.Workload:
    """``parallel="ddp"`` (in a torch.distributed job, with ``compile="blocks"``): the step
    runs through a DistributedDataParallel over the block-compiled model, each rank on its
    own share of the batch."""
    torch.manual_seed(seed)
    net = Net()
    if compile == "blocks":
        for block in net.layers:
            block.compile(dynamic=dynamic, fullgraph=fullgraph)
        model: torch.nn.Module = net
    else:
        model = torch.compile(net, dynamic=dynamic, fullgraph=fullgraph)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    runs = model
    rank = 0
    if parallel == "ddp":
        runs = torch.nn.parallel.DistributedDataParallel(model)
        rank = torch.distributed.get_rank()

    def get_batch(index: int) -> dict:
        generator = torch.Generator().manual_seed(500 + 1000 * rank + index)
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator)
        return {"x": x, "y": y}

    def train_step(batch: dict) -> torch.Tensor:
        loss = F.mse_loss(runs(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return sdcreplay.Workload(
        model,
        optimizer,
        get_batch,
        train_step=train_step,
        data_parallel=runs if parallel == "ddp" else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--compile", choices=("full", "blocks"), default="full")
    parser.add_argument("--signature", choices=("layer", "boundary"), default="layer")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dynamic", action="store_true")
    parser.add_argument("--fullgraph", action="store_true")
    args = parser.parse_args()
    options = {
        "compile": args.compile,
        "dynamic": True if args.dynamic else None,
        "fullgraph": args.fullgraph,
    }
    workload = make_workload(**options)
    recorder = sdcreplay.Recorder(
        args.out,
        f"{Path(__file__).resolve()}:make_workload",
        workload.model,
        workload.optimizer,
        workload_kwargs=options,
        signature=args.signature,
    )
    for index in range(args.steps):
        batch = workload.get_batch(index)
        with recorder.step(batch):
            workload.train_step(batch)
    path = recorder.close()
    print(json.dumps({"bundle": str(path), "compiled": recorder.compiled_regions()}))


if __name__ == "__main__":
    main()
