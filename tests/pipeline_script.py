"""A user's pipeline-parallel training script as ``torchrun`` starts it (the tests copy it into
tmp_path).

``python -m torch.distributed.run --standalone --nproc_per_node N pipeline_script.py OUT
SCHEDULE``: every rank records two steps of a two-stage pipeline of a four-block MLP with
``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe`` or ``Schedule1F1B``
as SCHEDULE says, 2 microbatches) and a Recorder. Stage s holds blocks 2s and 2s+1 (the
module names a fault spec and bisect use: ``blocks.0`` ... on stage 0, ``blocks.2`` ... on
stage 1). With N=4 the job is pp=2 x dp=2: ranks (0, 1) and (2, 3) are two pipelines of
their own batches, and each stage's gradients are averaged over its data-parallel pair with
an all_reduce before AdamW steps. ``make_workload`` is the workload replay and bisect
rebuild.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

WIDTH, HIDDEN, ROWS, MICROBATCHES, STAGES = 8, 16, 4, 2, 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Stage(torch.nn.Module):
    """This stage's blocks, named as in the whole model."""

    def __init__(self, first: int):
        super().__init__()
        torch.manual_seed(0)
        every = [Block() for _ in range(2 * STAGES)]  # the same weights whichever the stage
        self.blocks = torch.nn.ModuleDict({str(i): every[i] for i in (first, first + 1)})

    def forward(self, x):
        for block in self.blocks.values():
            x = block(x)
        return x


def mean_square(output, target):
    return (output - target).pow(2).mean()


def make_workload(seed: int = 0, schedule: str = "gpipe"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from sdcreplay import Workload

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // STAGES, STAGES), mesh_dim_names=("dp", "pp"))
    stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = Stage(2 * stage_index)
    pp_group = mesh["pp"].get_group()
    # Static shapes: no shape inference messages in the first step a session runs (a bisect's
    # session starts at the bisected step).
    example = torch.zeros(ROWS // MICROBATCHES, WIDTH, requires_grad=True)
    stage = PipelineStage(
        model, stage_index, STAGES, torch.device("cpu"), example, example, group=pp_group
    )
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    # Every stage is given the loss (the last computes it; it tells the others to run backward).
    pipeline = kind(stage, n_microbatches=MICROBATCHES, loss_fn=mean_square)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_group = mesh["dp"].get_group() if world > STAGES else None

    def get_batch(index: int) -> dict:
        generator = torch.Generator().manual_seed(100 + index * (world // STAGES) + dp_rank)
        x = torch.randn(ROWS, WIDTH, generator=generator)
        return {"x": x, "y": torch.randn(ROWS, WIDTH, generator=generator)}

    def train_step(batch):
        losses: list[torch.Tensor] = []
        if stage_index == 0:
            pipeline.step(batch["x"])
        else:
            pipeline.step(target=batch["y"], losses=losses)
        if dp_group is not None:
            for param in model.parameters():
                dist.all_reduce(param.grad, group=dp_group)
                param.grad.div_(world // STAGES)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).mean().detach() if losses else None

    return Workload(model=model, optimizer=optimizer, get_batch=get_batch, train_step=train_step)


def main(out: str, schedule: str) -> None:
    import sdcreplay

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    kwargs = {"seed": 0, "schedule": schedule}
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
