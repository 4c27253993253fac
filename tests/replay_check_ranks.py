"""ReplayCheck on two gloo ranks with one faulty rank, as ``torchrun`` starts a user's script.

``python -m torch.distributed.run --standalone --nproc_per_node 2 replay_check_ranks.py OUT``:
each scenario runs one checked step on both ranks; rank 1 alone changes one value in its
replay (the second execution), and each rank writes what its ``SDCReplayMismatch`` said
to OUT/rank{r}.json. Scenarios (tests/online/test_parity.py asserts them):

- ``replicated``: a plain model on every rank, no collective in the step; in rank 1's
  replay sdcreplay's injector flips bit 22 of fc2's forward output element 0 (a fault in
  ``aten.mm``), so its loss differs while rank 0 matches locally and must stop anyway;
- ``dtensor-buffer``: an MLP split by DTensor's ``parallelize_module`` (fc1 column-wise,
  fc2 row-wise) with a DTensor buffer (``Shard(0)``) the step adds to; rank 1's replay flips
  bit 5 of element 1 of its shard;
- ``dtensor-grad``: the same MLP; rank 1's replay flips bit 9 of element 3 of its shard of
  fc1's weight gradient after backward.

Then ``element_forensics`` compares two DTensors whose rank-1 shards differ in one bit.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, bias=False)
        self.fc2 = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def flip(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip ``bit`` of element ``index`` of this rank's float32 storage of ``tensor``."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    local.view(-1).view(torch.int32)[index] ^= 1 << bit


def split_mlp():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    model = parallelize_module(MLP(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    model.register_buffer("seen", distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
    return model


FC2_FORWARD_REPLAY = "kind=bitflip,op=aten.mm,module=fc2,phase=forward,nth=1,index=0,bit=22"


def scenario(name: str, rank: int) -> dict:
    from sdcreplay.capture.faults import Injector, parse_specs
    from sdcreplay.capture.operators import OperatorMode
    from sdcreplay.online import ReplayCheck, SDCReplayMismatch

    torch.manual_seed(0)
    model = MLP() if name == "replicated" else split_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    executions = 0

    def train_step(x):
        nonlocal executions
        executions += 1
        faulty = rank == 1 and executions == 2
        loss = model(x).square().mean()
        loss.backward()
        if name != "replicated":
            with torch.no_grad():
                model.seen.add_(1.0)
        if name == "dtensor-buffer" and faulty:
            flip(model.seen, 1, 5)
        if name == "dtensor-grad" and faulty:
            flip(model.fc1.weight.grad, 3, 9)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))  # every rank's
    specs = [FC2_FORWARD_REPLAY] if name == "replicated" and rank == 1 else []
    injector = Injector(parse_specs(specs, include_env=False), "cpu")
    try:
        with (
            ReplayCheck(model=model, optimizer=optimizer, train_step=train_step) as check,
            OperatorMode(model, optimizer, [injector], 0),
        ):
            check.run_step(batch)
    except SDCReplayMismatch as mismatch:
        return {
            "rank": mismatch.rank,
            "ranks": mismatch.ranks,
            "entry": mismatch.entry,
            "elements": mismatch.elements,
            "bits": mismatch.bit_histogram,
            "shard_of": mismatch.shard_of,
            "message": mismatch.message,
            "executions": executions,
        }
    return {"entry": None, "executions": executions}


def dtensor_forensics(rank: int) -> dict:
    """Two DTensors (``Shard(0)`` of 8 elements) whose rank-1 shards differ in bit 4 of their
    element 2: compared on each rank's shard, without collectives."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from sdcreplay.compare.forensics import element_forensics

    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    expected = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    actual = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    if rank == 1:
        flip(actual, 2, 4)
    found = element_forensics(expected, actual)
    return {key: found.get(key) for key in ("count", "total", "indices", "bits", "local_shard")}


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    names = ("replicated", "dtensor-buffer", "dtensor-grad")
    results = {name: scenario(name, rank) for name in names}
    results["forensics"] = dtensor_forensics(rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    leave_without_teardown()


def leave_without_teardown() -> None:
    """Exit now, everything written: torch's teardown at interpreter exit, after gloo and an
    optimizer step, sometimes aborts (``terminate called without an active exception``; 1-3
    in 15 runs of a plain two-rank SGD loop on a loaded machine; none in 40 leaving so)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
