"""A user's training script as ``torchrun`` starts it (the tests copy it into tmp_path).

``python -m torch.distributed.run --standalone --nproc_per_node 2 job_script.py OUT RESULTS
PARALLEL [die_at_step]``: every rank records two steps of data-parallel tiny-llama with a
Recorder (each step also averages the loss and counts tokens with two explicit all_reduce
calls, as training loops do for logging), then replays its own part of the job bundle in
the same ranks, and replays it again with the two all_reduce calls swapped. Each rank writes
what it saw to RESULTS/rank{r}.json. With ``die_at_step`` rank 1 exits in the middle of that
step (a job killed mid-step).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

SMALL = {"layers": 1, "dim": 32, "heads": 2, "seq_len": 8, "batch_size": 2, "vocab": 64}


def logging_step(workload, swapped: bool):
    """The loop's step: the loss through DDP/FSDP2, then two all_reduce calls for logging."""

    def train_step(batch):
        loss = workload.loss(batch)
        loss.backward()
        stats = [loss.detach().reshape(1), torch.tensor([batch["tokens"].numel()])]
        for tensor in reversed(stats) if swapped else stats:
            dist.all_reduce(tensor)
        workload.optimizer.step()
        workload.optimizer.zero_grad()
        return loss

    return train_step


class OperatorNamespaces:
    """An operator observer (as bisect's log is): which operator namespaces it is shown."""

    def __init__(self):
        self.seen: set[str] = set()

    def on_call(self, site, func, args, kwargs, out):
        self.seen.add(func.namespace)
        return out


def make_workload(seed: int = 0, parallel: str = "ddp"):
    from sdcreplay.workloads.tiny_llama import make_workload as tiny_llama

    workload = tiny_llama(seed=seed, parallel=parallel, **SMALL)
    workload.train_step = logging_step(workload, swapped=False)
    return workload


def main(out: str, results: str, parallel: str, die_at_step: int | None) -> None:
    import sdcreplay
    from sdcreplay.bundle import JobBundle
    from sdcreplay.errors import MessageOrderError
    from sdcreplay.replay import ReplaySession

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    kwargs = {"seed": 0, "parallel": parallel}
    workload = make_workload(**kwargs)
    recorder = sdcreplay.Recorder(
        out, f"{__file__}:make_workload", workload.model, workload.optimizer, workload_kwargs=kwargs
    )
    for index in range(2 if die_at_step is None else die_at_step + 1):
        batch = workload.get_batch(index)
        with recorder.step(batch):
            if index == die_at_step and rank == 1:
                os._exit(17)
            workload.run_step(batch)
    job = recorder.close()
    part = JobBundle.open(job).rank(rank)
    recorded = part.signature_log().steps
    session = ReplaySession(part)
    replayed, operators = {}, OperatorNamespaces()
    for step in part.steps:
        same = session.run_step(step, observers=[operators]) == recorded[step.index]
        messages = [message.to_json() for message in session.last_messages]
        replayed[step.index] = {"signatures_equal": same, "messages": messages}
    session.close()
    swapped = ReplaySession(part)
    swapped.workload.train_step = logging_step(swapped.workload, swapped=True)
    try:
        swapped.run_step(part.steps[0])
        order_error = None
    except MessageOrderError as exc:
        order_error = exc.message
    swapped.close()
    report = {
        "job": str(job),
        "replayed": replayed,
        "order_error": order_error,
        "operator_namespaces": sorted(operators.seen),
    }
    Path(results, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        sys.argv[3],
        int(sys.argv[4]) if len(sys.argv) > 4 else None,
    )
