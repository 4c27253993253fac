"""A user's tensor-parallel training script as ``torchrun`` starts it (the tests copy it into
tmp_path).

``python -m torch.distributed.run --standalone --nproc_per_node 2 tp_script.py OUT RESULTS``:
every rank records two steps of an MLP (Linear -> GELU -> Linear) split over the two ranks by
DTensor's ``parallelize_module`` (fc1 column-wise, fc2 row-wise: the forward's functional
all_reduce sums fc2's partial outputs; the loop then sums the loss and the row count with two
more, for logging) with a Recorder, then replays the first step again with the two logging
all_reduces swapped and with a third (other programs), then logs one call of each other
functional collective (one left unwaited) and two calls of a compiled function that sums.
Each rank writes what it saw to RESULTS/rank{r}.json; ``make_workload`` is the workload
``sdcreplay replay`` rebuilds.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

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


def get_batch(index: int) -> dict:
    """The same batch on every rank (tensor parallelism splits the weights, not the data)."""
    generator = torch.Generator().manual_seed(100 + index)
    return {"x": torch.randn(ROWS, WIDTH, generator=generator)}


def loss_fn(model, batch):
    return model(batch["x"]).pow(2).mean()


def make_workload(seed: int = 0):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from sdcreplay import Workload

    torch.manual_seed(seed)
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    model = parallelize_module(MLP(), mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    workload = Workload(model=model, optimizer=optimizer, get_batch=get_batch, loss_fn=loss_fn)
    workload.train_step = logging_step(workload)
    return workload


def logging_step(workload, variant: str = "recorded"):
    """The loop's step: the loss through the split model, then two functional all_reduces for
    logging (the loss, the row count). Another program: ``swapped`` issues them in the other
    order, ``extra`` adds a third."""
    from torch.distributed import _functional_collectives as funcol

    def train_step(batch):
        loss = workload.loss(batch)
        loss.backward()
        stats = [loss.detach().reshape(1), torch.tensor([batch["x"].shape[0]])]
        stats = {"recorded": stats, "swapped": stats[::-1], "extra": [*stats, torch.zeros(2)]}
        for tensor in stats[variant]:
            funcol.all_reduce(tensor, "sum", dist.group.WORLD).wait()
        workload.optimizer.step()
        workload.optimizer.zero_grad()
        return loss

    return train_step


def functional_calls() -> list[dict]:
    """One logged step of the other functional collectives on ``arange(4) + rank``; the last
    all_reduce is never waited for (the step's end waits for it)."""
    from sdcreplay.capture.collectives import MessageLog

    ops, group, rank = torch.ops._c10d_functional, dist.group.WORLD.group_name, dist.get_rank()
    x = torch.arange(4.0) + rank
    log = MessageLog("exact")
    log.begin_step(0)
    in_place = x.clone()
    outputs = [
        ops.all_gather_into_tensor(x, 2, group),
        ops.reduce_scatter_tensor(x, "sum", 2, group),
        ops.all_to_all_single(x, [1 + 2 * rank] * 2, [1, 3], group),  # rank 0 gets 2, 1 gets 6
        ops.all_reduce_(in_place, "sum", group),
        *ops.all_reduce_coalesced([x, x[:2] * 2], "sum", group),
        ops.broadcast(x, 1, group),
    ]
    for tensor in outputs:
        ops.wait_tensor(tensor)
    ops.all_reduce(x, "max", group)
    return [message.to_json() for message in log.end_step()]


def compiled_calls() -> list[dict]:
    """A logged step calling a torch.compile'd all_reduce twice: the calls dynamo and AOT
    autograd make on fake tensors while tracing move nothing and are not logged."""
    from torch.distributed import _functional_collectives as funcol

    from sdcreplay.capture.collectives import MessageLog

    @torch.compile(backend="aot_eager")
    def doubled_sum(x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    log = MessageLog("exact")
    log.begin_step(0)
    for _ in range(2):
        doubled_sum(torch.ones(3))
    return [message.to_json() for message in log.end_step()]


def main(out: str, results: str) -> None:
    import sdcreplay
    from sdcreplay.bundle.job_bundle import JobBundle

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    workload = make_workload()
    recorder = sdcreplay.Recorder(
        out, f"{__file__}:make_workload", workload.model, workload.optimizer
    )
    for index in range(2):
        batch = workload.get_batch(index)
        with recorder.step(batch):
            workload.run_step(batch)
    part = JobBundle.open(recorder.close()).rank(rank)
    from job_script import replay_order_errors  # copied beside this script

    order_errors = replay_order_errors(part, logging_step, ("swapped", "extra"))
    report = {
        "order_errors": order_errors,
        "functional": functional_calls(),
        "compiled": compiled_calls(),
    }
    Path(results, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Everything is written: leave before torch's teardown, which after gloo sometimes aborts
    # ("terminate called without an active exception"; see tests/replay_check_ranks.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
