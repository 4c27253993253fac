"""A user's 2-D parallel training script (data-parallel x tensor-parallel) as ``torchrun``
starts it (tests/replay/test_same_batch.py copies it into tmp_path).

``python -m torch.distributed.run --standalone --nproc_per_node 4 tp_dp_script.py OUT``: a
``dp=2 x tp=2`` device mesh; an MLP split over each tensor-parallel pair by
``parallelize_module`` (fc1 column-wise, fc2 row-wise), each data-parallel group on its own
batches, the gradients averaged over the data-parallel dimension by hand (as a loop without
DDP does); two steps recorded with a Recorder, whose layout comes from the mesh.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

WIDTH, HIDDEN, ROWS = 8, 16, 4


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def device_mesh():
    """One mesh per process: the Recorder's check rebuilds the workload (from this file, a
    module of its own), and new process groups would be other groups than the record's."""
    from torch.distributed.device_mesh import init_device_mesh

    if not hasattr(dist, "_tp_dp_test_mesh"):
        dist._tp_dp_test_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return dist._tp_dp_test_mesh


def make_workload(seed: int = 0):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from sdcreplay import Workload

    torch.manual_seed(seed)
    mesh = device_mesh()
    model = parallelize_module(
        MLP(), mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()

    def get_batch(index: int) -> dict:
        generator = torch.Generator().manual_seed(100 + 2 * index + dp_rank)
        return {"x": torch.randn(ROWS, WIDTH, generator=generator)}

    def train_step(batch):
        loss = model(batch["x"]).pow(2).mean()
        loss.backward()
        for param in model.parameters():
            local = param.grad.to_local()
            dist.all_reduce(local, group=dp_group)
            local.div_(2)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    workload = Workload(
        model=model, optimizer=optimizer, get_batch=get_batch,
        loss_fn=lambda m, b: m(b["x"]).pow(2).mean(),
    )  # fmt: skip
    workload.train_step = train_step
    return workload


def main(out: str) -> None:
    import sdcreplay

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    workload = make_workload()
    recorder = sdcreplay.Recorder(
        out, f"{__file__}:make_workload", workload.model, workload.optimizer
    )
    for index in range(2):
        batch = workload.get_batch(index)
        with recorder.step(batch):
            workload.run_step(batch)
    recorder.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()  # leave before torch's teardown (see tests/job_script.py)
    sys.stderr.flush()
    os._exit(0)
