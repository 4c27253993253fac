"""A user's sharded training script as ``torchrun`` starts it (the tests copy it into tmp_path).

``python -m torch.distributed.run --standalone --nproc_per_node N sharded_script.py OUT
PARALLEL``: every rank records two steps of a two-block MLP with a Recorder, sharded as
PARALLEL says:

- ``fsdp2``: ``fully_shard`` per block and at the root (N ranks, each its own batches);
- ``tp``: ``parallelize_module`` with fc1 column-wise and fc2 row-wise on a 1-D mesh (every
  rank the same batch);
- ``fsdp2+tp``: both on ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``,
  TP on "tp" and FSDP2 on "dp" (4 ranks; the batch by the dp coordinate).

AdamW steps every parameter. ``make_workload`` is the workload ``sdcreplay replay`` and
``bisect`` rebuild (with the recorded keyword arguments).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

WIDTH, HIDDEN, ROWS = 8, 16, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def shard(model: Model, parallel: str) -> tuple[Model, int, int]:
    """The model sharded as ``parallel`` says; (its data-parallel rank, how many there are)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if parallel == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, dist.get_rank(), world
    if parallel == "tp":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            parallelize_module(block, mesh, plan)
        return model, 0, 1
    if parallel == "fsdp2+tp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, mesh["dp"].get_local_rank(), 2
    raise ValueError(f"parallel={parallel!r}")


def make_workload(seed: int = 0, parallel: str = "fsdp2"):
    from sdcreplay import Workload

    torch.manual_seed(seed)
    model, dp_rank, dp_size = shard(Model(), parallel)

    def get_batch(index: int) -> dict:
        generator = torch.Generator().manual_seed(100 + index * dp_size + dp_rank)
        return {"x": torch.randn(ROWS, WIDTH, generator=generator)}

    def loss_fn(model, batch):
        return model(batch["x"]).pow(2).mean()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Workload(model=model, optimizer=optimizer, get_batch=get_batch, loss_fn=loss_fn)


def main(out: str, parallel: str) -> None:
    import sdcreplay

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    kwargs = {"seed": 0, "parallel": parallel}
    workload = make_workload(**kwargs)
    recorder = sdcreplay.Recorder(
        out, f"{__file__}:make_workload", workload.model, workload.optimizer,
        workload_kwargs=kwargs,
    )  # fmt: skip
    for index in range(2):
        batch = workload.get_batch(index)
        with recorder.step(batch):
            workload.run_step(batch)
    recorder.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Everything is written: leave before torch's teardown, which after gloo sometimes aborts
    # ("terminate called without an active exception"; see tests/replay_check_ranks.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
