"""Step time of 2-rank DDP tiny-llama with and without the collective message log, side by side.

    python bench/message_log_overhead.py            # layers=4 dim=256 seq_len=128 batch_size=8
    python bench/message_log_overhead.py --layers 2 --dim 64 --seq-len 32 --batch-size 4
    python bench/message_log_overhead.py --parallel tp   # tensor parallelism: functional ops

``--parallel tp`` trains an MLP of ``--layers`` blocks (Linear dim->4*dim column-parallel,
GELU, Linear 4*dim->dim row-parallel, DTensor's ``parallelize_module``) on the same batch of
``batch_size*seq_len`` rows on both ranks: its collectives are the functional all_reduces of
the row-parallel layers (forward) and of the column-parallel inputs' gradients (backward).
Modes plain and logged only (a dispatch mode under DTensor measures DTensor's own dispatch).

The script starts itself on 2 ranks as torchrun does (gloo on this machine). Every rank
trains the same DDP model in alternating blocks of steps (plain, logged, dispatch_mode,
dispatch_mode, logged, plain, ...) after a warm-up, so drift in the machine's speed hits
every mode alike. A logged step is
everything ``collectives.MessageLog`` adds to a step: the c10d kernels at the Autograd key,
the digest of each bucket before the all-reduce, the wait for its completion (the reducer
would wait for it a moment later anyway) and the digest after. The kernels are installed in
both modes (they stay installed for the process once a log opened), so the plain mode pays
their pass-through too, as any step outside a logged one does.

A third mode runs the step under a pass-through ``TorchDispatchMode`` (it only calls each
operator): what intercepting the collectives with a dispatch mode would cost at the least,
since every aten call of the step would enter Python.

Rank 0 prints the medians per mode and their ratios to plain, wall and CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=8, help="blocks per mode (alternating)")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--parallel", choices=("ddp", "tp"), default="ddp")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


MODES = ("plain", "logged", "dispatch_mode")


class PassThrough(TorchDispatchMode):
    """Calls every operator and does nothing else."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def launch(argv: list[str]) -> int:
    """Start this script on 2 ranks (torchrun's launcher), each with one intra-op thread."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", __file__, "--rank", *argv]
    return subprocess.run(command, cwd=REPO, timeout=1800).returncode


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from sdcreplay.capture import determinism
    from sdcreplay.capture.collectives import MessageLog
    from sdcreplay.capture.digest import algorithm_for
    from sdcreplay.workload.definition import build_workload

    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    torch.set_num_threads(1)
    determinism.enable()
    kwargs = {
        "layers": args.layers,
        "dim": args.dim,
        "heads": args.heads,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "parallel": args.parallel,
    }
    if args.parallel == "tp":
        workload = tensor_parallel_mlp(args)
        modes: tuple[str, ...] = MODES[:2]
    else:
        workload = build_workload("builtin:tiny-llama", kwargs)
        modes = MODES
    log = MessageLog(algorithm_for("cpu"))
    index = 0
    messages: list[int] = []

    def step(mode: str) -> tuple[float, float]:
        nonlocal index
        batch = workload.get_batch(index)
        index += 1
        wall, cpu = time.perf_counter(), time.process_time()
        if mode == "logged":
            log.begin_step(index)
        with PassThrough() if mode == "dispatch_mode" else contextlib.nullcontext():
            workload.run_step(batch)
        if mode == "logged":
            messages.append(len(log.end_step()))
        return time.perf_counter() - wall, time.process_time() - cpu

    for number in range(args.warmup):
        step(modes[number % len(modes)])
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    order = [*modes, *reversed(modes)]  # plain, logged, dispatch_mode, dispatch_mode, ...
    for block in range(args.blocks * len(modes)):
        mode = order[block % len(order)]
        times[mode].extend(step(mode) for _ in range(args.steps))
    if dist.get_rank() == 0:
        report: dict = {"config": kwargs, "steps_per_mode": len(times["plain"])}
        for clock, position in (("wall", 0), ("cpu", 1)):
            medians = {mode: statistics.median(t[position] for t in times[mode]) for mode in modes}
            report[clock] = {f"{mode}_ms": round(value * 1e3, 3) for mode, value in medians.items()}
            for mode in modes[1:]:
                report[clock][f"{mode}_ratio"] = round(medians[mode] / medians["plain"], 4)
        report["messages_per_logged_step"] = sorted(set(messages))
        print(json.dumps(report, indent=1))
    dist.destroy_process_group()


def tensor_parallel_mlp(args: argparse.Namespace):
    """The --parallel tp model: blocks split across the 2 ranks by DTensor, the same weights
    and the same batches on both."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from sdcreplay.workload.definition import Workload

    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(
            torch.nn.Linear(args.dim, 4 * args.dim),
            torch.nn.GELU(),
            torch.nn.Linear(4 * args.dim, args.dim),
        )
        for _ in range(args.layers)
    ]
    model = torch.nn.Sequential(*blocks)
    mesh = init_device_mesh("cpu", (2,))
    plan = {}
    for number in range(args.layers):
        plan[f"{number}.0"] = ColwiseParallel()
        plan[f"{number}.2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = args.batch_size * args.seq_len

    def get_batch(index: int) -> tuple:
        generator = torch.Generator().manual_seed(index)
        inputs = torch.randn(rows, args.dim, generator=generator, requires_grad=True)
        return inputs, torch.randn(rows, args.dim, generator=generator)

    def train_step(batch: tuple) -> torch.Tensor:
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return Workload(model, optimizer, get_batch, train_step=train_step)


def main() -> None:
    args = parse_args()
    if args.rank:
        run_rank(args)
    else:
        raise SystemExit(launch(sys.argv[1:]))


if __name__ == "__main__":
    main()
