"""A workload that misbehaves on purpose on one device label: hangs, exits, dies or raises.

Used by tests/test_reliability.py to prove a device process that stops or dies
is reported (not waited for) and that workload code exiting maps to exit 3.
The device a process replays on is in ``SDCREPLAY_DEVICE``; a recording in the
test's own process sees ``main``.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

from sdcreplay.workloads import tiny_llama

from sdcreplay import Workload


def _hang() -> None:
    time.sleep(3600)


def _exit() -> None:
    sys.exit(5)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _raise() -> None:
    raise IndexError("index out of range in self")


def _os_exit() -> None:
    os._exit(7)


MISBEHAVIOURS = {"hang": _hang, "exit": _exit, "kill": _kill, "raise": _raise, "os_exit": _os_exit}
SWAP = "swap"  # not a misbehaviour of its own: the two collectives of ``collective`` swap order


def _all_reduce_ones(swap: bool) -> None:
    """Two collectives the ranks of a job must all reach, a tensor of ones of size 1 then one of
    size 2 (``swap``: the other way round); the first sum on stdout, the rank's log."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        ones = [torch.ones(1), torch.ones(2)]
        for tensor in reversed(ones) if swap else ones:
            dist.all_reduce(tensor)
        print(f"all_reduce of ones: {ones[0].item():g}", flush=True)


def make_workload(
    seed: int = 0,
    misbehave: str = "none",
    on_device: str = "cpu:1",
    at_step: int = 1,
    scalar_loss: bool = True,
    collective: bool = False,
    **small,
) -> Workload:
    """tiny-llama whose ``at_step``-th loss call on ``on_device`` misbehaves (counted from 0).

    ``misbehave`` is one of MISBEHAVIOURS, or ``DEVICE=KIND,...`` for one kind per device.
    ``collective``: every loss call all-reduces two tensors of ones across the job's ranks
    (after misbehaving, so the other ranks wait in them for the one that misbehaves; ``swap``
    issues them in the other order).
    """
    workload = tiny_llama.make_workload(seed=seed, **small)
    calls = itertools.count()
    if "=" in misbehave:
        plan = dict(pair.split("=") for pair in misbehave.split(","))
    else:
        plan = {on_device: misbehave}

    def loss_fn(model, batch):
        call = next(calls)
        kind = plan.get(os.environ.get("SDCREPLAY_DEVICE", "main"))
        if kind in MISBEHAVIOURS and call >= at_step:
            MISBEHAVIOURS[kind]()
        if collective:
            _all_reduce_ones(swap=kind == SWAP and call >= at_step)
        loss = workload.loss_fn(model, batch)
        return loss if scalar_loss else loss.expand(2)

    return Workload(workload.model, workload.optimizer, workload.get_batch, loss_fn)
