"""A user's DDP training script that starts recording in the middle of training (tests copy
it into tmp_path and start it as torchrun does).

``python -m torch.distributed.run --standalone --nproc_per_node 2 midjob_script.py OUT WARM
GIVEN``: every rank trains ``WARM`` steps unrecorded (DDP rebuilds its gradient buckets in its
second iteration), then records 2 steps of a loop as users write it (clipping, a cosine
schedule, AdamW). ``GIVEN`` says how the Recorder learns of the DDP: ``model`` (the DDP is the
model), ``data_parallel`` (the plain module is the model, the DDP given beside it), ``none``
(the plain module only).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import sdcreplay


def make_workload(seed: int = 0, plain: bool = False, alone: bool = False) -> sdcreplay.Workload:
    """``alone``: no DDP, each rank trains its own model (as Accelerate does when started
    without its launcher)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4)
    )
    model = net if alone else DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
    rank = dist.get_rank()

    def get_batch(index: int) -> dict:
        generator = torch.Generator().manual_seed(1000 * index + rank)
        return {"x": torch.randn(8, 16, generator=generator), "y": torch.randint(0, 4, (8,))}

    def train_step(batch: dict) -> torch.Tensor:
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss.detach()

    return sdcreplay.Workload(
        net if plain else model,
        optimizer,
        get_batch,
        train_step=train_step,
        state={"scheduler": scheduler},
        data_parallel=model if plain else None,
    )


def main(out: str, warm: int, given: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    plain = given != "model"
    workload = make_workload(plain=plain)
    for index in range(warm):  # training before anyone thought of recording
        workload.train_step(workload.get_batch(index))
    recorder = sdcreplay.Recorder(
        out, f"{__file__}:make_workload", workload.model, workload.optimizer,
        state=workload.state, start_step=warm, workload_kwargs={"plain": plain},
        data_parallel=workload.data_parallel if given == "data_parallel" else None,
    )  # fmt: skip
    for index in range(warm, warm + 2):
        batch = workload.get_batch(index)
        with recorder.step(batch):
            workload.train_step(batch)
    recorder.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    # Everything is written: leave before torch's teardown, which after gloo sometimes aborts
    # ("terminate called without an active exception"; see tests/replay_check_ranks.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
