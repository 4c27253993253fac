"""Cost of a ring Recorder per training step, its memory, and the time of a dump.

Three copies of ``builtin:tiny-llama`` (same seed) train side by side on the same
batches, their steps interleaved in one run so machine load hits them alike:

- plain: ``Workload.run_step``;
- Recorder writing every step to disk (the default, verification on);
- Recorder(ring=K) holding the last K steps in memory (nothing written).

Printed: median wall time per step as a ratio to plain, the ring's memory
(``ring_nbytes``: its peak after a step, the snapshot and per-step parts), the
bytes the on-disk bundle grew by per step, and the time ``dump()`` takes
(bundle written, its first step re-executed as the verification).

    PYTHONPATH=. python bench/ring_overhead.py [--steps 40] [--ring 8]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sdcreplay import Bundle, Recorder
from sdcreplay.capture import determinism
from sdcreplay.workload.definition import build_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--ring", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    determinism.enable(1)
    work = Path(tempfile.mkdtemp(prefix="ring-bench-"))
    workloads = [build_workload("builtin:tiny-llama", {"seed": 0}) for _ in range(3)]
    disk = Recorder(
        work / "disk.bundle", "builtin:tiny-llama", workloads[1].model, workloads[1].optimizer,
        workload_kwargs={"seed": 0},
    )  # fmt: skip
    ring = Recorder(
        work / "ring.bundle", "builtin:tiny-llama", workloads[2].model, workloads[2].optimizer,
        workload_kwargs={"seed": 0}, ring=args.ring,
    )  # fmt: skip
    recorders = {"plain": None, "Recorder (disk)": disk, f"Recorder(ring={args.ring})": ring}
    wall: dict[str, list[float]] = {name: [] for name in recorders}
    held = []
    for step in range(args.warmup + args.steps):
        batch = workloads[0].get_batch(step)
        for (name, recorder), workload in zip(recorders.items(), workloads):
            started = time.perf_counter()
            if recorder is None:
                workload.run_step(batch)
            else:
                with recorder.step(batch):
                    workload.run_step(batch)
            if step >= args.warmup:
                wall[name].append(time.perf_counter() - started)
        held.append(ring.ring_nbytes)
    started = time.perf_counter()
    dumped = ring.dump("benchmark")
    dump_seconds = time.perf_counter() - started
    disk_path = disk.close()
    ring.close()
    steps_on_disk = len(Bundle.open(disk_path).steps)
    disk_per_step = Bundle.open(disk_path).size_bytes() / steps_on_disk
    window = Bundle.open(dumped)
    base = statistics.median(wall["plain"])
    print(f"tiny-llama (default size), {args.steps} timed steps, 1 thread")
    print(f"{'':28} {'ms/step':>8} {'ratio':>6}")
    for name, times in wall.items():
        median = statistics.median(times)
        print(f"{name:28} {1000 * median:8.2f} {median / base:6.2f}")
    print(
        f"ring memory: peak {max(held) / 2**20:.2f} MiB after a step, steady state "
        f"{min(held[3 * args.ring :]) / 2**20:.2f}-{max(held[3 * args.ring :]) / 2**20:.2f} MiB"
    )
    print(
        f"dump of {len(window.steps)} steps: {dump_seconds:.2f} s, "
        f"{window.size_bytes() / 2**20:.2f} MiB on disk (the disk recorder's bundle: "
        f"{disk_per_step / 2**10:.0f} KiB per step, its start state included)"
    )
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
