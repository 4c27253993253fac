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


def logging_step(workload, variant: str = "recorded"):
    """The loop's step: the loss through DDP/FSDP2, then two all_reduce calls for logging
    (the loss, the token count). Another program: ``swapped`` issues them in the other order,
    ``missing`` leaves out the second, ``extra`` adds a third."""

    def train_step(batch):
        loss = workload.loss(batch)
        loss.backward()
        stats = [loss.detach().reshape(1), torch.tensor([batch["tokens"].numel()])]
        stats = {
            "recorded": stats,
            "swapped": stats[::-1],
            "missing": stats[:1],
            "extra": [*stats, torch.zeros(2)],
        }[variant]
        for tensor in stats:
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


def resume_at_step_1(part, state_file: Path):
    """Replay step 0, hand the state over in a file (as bisect does between processes), and
    replay step 1 in a fresh session: True when it matches the record, else the error."""
    from sdcreplay.errors import MessageOrderError
    from sdcreplay.replay.session import ReplaySession

    first = ReplaySession(part)
    first.run_step(part.steps[0])
    first.save_state(state_file)
    first.close()
    second = ReplaySession(part)
    second.load_state(state_file)
    try:
        same = second.run_step(part.steps[1]) == part.signature_log().steps[1]
    except MessageOrderError as exc:
        same = exc.message
    second.close()
    return same


def replay_order_errors(part, variant_step, variants) -> dict[str, str]:
    """The MessageOrderError of the part's first step replayed with each variant of the
    loop's step (``variant_step(workload, variant)``); tests/tp_script.py uses it too."""
    from sdcreplay.errors import MessageOrderError
    from sdcreplay.replay.session import ReplaySession

    errors = {}
    for variant in variants:
        other = ReplaySession(part)
        other.workload.train_step = variant_step(other.workload, variant)
        try:
            other.run_step(part.steps[0])
        except MessageOrderError as exc:
            errors[variant] = exc.message
        other.close()
    return errors


def make_workload(seed: int = 0, parallel: str = "ddp"):
    from sdcreplay.workload.tiny_llama import make_workload as tiny_llama

    workload = tiny_llama(seed=seed, parallel=parallel, **SMALL)
    workload.train_step = logging_step(workload)
    return workload


def main(out: str, results: str, parallel: str, die_at_step: int | None) -> None:
    import sdcreplay
    from sdcreplay.bundle.job_bundle import JobBundle
    from sdcreplay.errors import BundleError
    from sdcreplay.replay.session import ReplaySession

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    kwargs = {"seed": 0, "parallel": parallel}
    workload = make_workload(**kwargs)
    recorder = sdcreplay.Recorder(
        out, f"{__file__}:make_workload", workload.model, workload.optimizer,
        workload_kwargs=kwargs, data_parallel=workload.data_parallel,
    )  # fmt: skip
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
    resumed = resume_at_step_1(part, Path(results, f"state{rank}.h5"))
    order_errors = replay_order_errors(part, logging_step, ("swapped", "missing", "extra"))
    try:  # the job exists now: rank 0 refuses to write over it, and tells the others
        sdcreplay.Recorder(out, "builtin:tiny-llama", workload.model, workload.optimizer)
        existing = None
    except BundleError as exc:
        existing = exc.message
    report = {
        "job": str(job),
        "existing_refused": existing,
        "replayed": replayed,
        "order_errors": order_errors,
        "resumed_step_1": resumed,
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
    # Everything is written: leave before torch's teardown, which after gloo sometimes aborts
    # ("terminate called without an active exception"; see tests/replay_check_ranks.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
