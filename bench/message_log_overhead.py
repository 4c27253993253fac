"""Step time of 2-rank DDP tiny-llama with and without the collective message log, side by side.

    python bench/message_log_overhead.py            # layers=4 dim=256 seq_len=128 batch_size=8
    python bench/message_log_overhead.py --layers 2 --dim 64 --seq-len 32 --batch-size 4

The script starts itself on 2 ranks as torchrun does (gloo on this machine). Every rank
trains the same DDP model in alternating blocks of steps (plain, logged, logged, plain, ...)
after a warm-up, so drift in the machine's speed hits both modes alike. A logged step is
everything ``collectives.MessageLog`` adds to a step: the c10d kernels at the Autograd key,
the digest of each bucket before the all-reduce, the wait for its completion (the reducer
would wait for it a moment later anyway) and the digest after. The kernels are installed in
both modes (they stay installed for the process once a log opened), so the plain mode pays
their pass-through too, as any step outside a logged one does.

Rank 0 prints the medians per mode and their ratio (logged / plain), wall and CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=12, help="blocks per mode (alternating)")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def launch(argv: list[str]) -> int:
    """Start this script on 2 ranks (torchrun's launcher), each with one intra-op thread."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", __file__, "--rank", *argv]
    return subprocess.run(command, cwd=REPO, timeout=1800).returncode


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from sdcreplay import determinism
    from sdcreplay.collectives import MessageLog
    from sdcreplay.digest import algorithm_for
    from sdcreplay.workload import build_workload

    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    torch.set_num_threads(1)
    determinism.enable()
    kwargs = {
        "layers": args.layers,
        "dim": args.dim,
        "heads": args.heads,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "parallel": "ddp",
    }
    workload = build_workload("builtin:tiny-llama", kwargs)
    log = MessageLog(algorithm_for("cpu"))
    index = 0
    messages: list[int] = []

    def step(logged: bool) -> tuple[float, float]:
        nonlocal index, messages
        batch = workload.get_batch(index)
        index += 1
        wall, cpu = time.perf_counter(), time.process_time()
        if logged:
            log.begin_step(index)
        workload.run_step(batch)
        if logged:
            messages.append(len(log.end_step()))
        return time.perf_counter() - wall, time.process_time() - cpu

    for number in range(args.warmup):
        step(logged=number % 2 == 1)
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for block in range(args.blocks * 2):
        logged = block % 4 in (1, 2)  # plain, logged, logged, plain: ABBA
        times[logged].extend(step(logged) for _ in range(args.steps))
    if dist.get_rank() == 0:
        report = {"config": kwargs, "steps_per_mode": len(times[False])}
        for clock, position in (("wall", 0), ("cpu", 1)):
            plain = statistics.median(t[position] for t in times[False])
            logged_median = statistics.median(t[position] for t in times[True])
            report[clock] = {
                "plain_ms": round(plain * 1e3, 3),
                "logged_ms": round(logged_median * 1e3, 3),
                "ratio": round(logged_median / plain, 4),
            }
        report["messages_per_logged_step"] = sorted(set(messages))
        print(json.dumps(report, indent=1))
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.rank:
        run_rank(args)
    else:
        raise SystemExit(launch(sys.argv[1:]))


if __name__ == "__main__":
    main()
