"""Cost of the online detectors per training step, as ratios to the plain step.

Five copies of ``builtin:tiny-llama`` (same seed) train side by side on the same
batches; their steps are interleaved in one run, so machine load hits them alike:

- plain: ``Workload.run_step``;
- ReplayCheck(num_steps=-1): every step replayed once (2 executions + digests);
- ReplayCheck(num_steps=-1, num_replays=2);
- UpdateDetector: judged before the update, nothing copied (the default);
- UpdateDetector(after_update): snapshot before the step, grad/update norms and result digests
  after (the copy-based rule).

The medians of wall time (and of the process's CPU time) after a warm-up, and
the snapshot's size next to the parameters'. No alarm fires on these clean steps
(the script checks), so recompute costs are not in it: a recompute is one more step.

    PYTHONPATH=. python bench/online_overhead.py [--steps 30] [--accumulation 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sdcreplay.capture import determinism
from sdcreplay.capture.snapshot import TrainingSnapshot
from sdcreplay.online.replay_check import ReplayCheck
from sdcreplay.online.update_detector import UpdateDetector
from sdcreplay.workload.definition import build_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--accumulation", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    determinism.enable(1)
    kwargs = {"accumulation": args.accumulation}
    workloads = [build_workload("builtin:tiny-llama", kwargs) for _ in range(5)]
    copied = UpdateDetector(workloads[4], when="after_update")
    runners = {
        "plain": workloads[0].run_step,
        "ReplayCheck x1": ReplayCheck(workloads[1], num_steps=-1).run_step,
        "ReplayCheck x2": ReplayCheck(workloads[2], num_steps=-1, num_replays=2).run_step,
        "UpdateDetector": (detector := UpdateDetector(workloads[3])).run_step,
        "UpdateDetector(after_update)": copied.run_step,
    }
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(args.warmup + args.steps):
        batch = workloads[0].get_batch(step)
        for name, run in runners.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            run(batch)
            if step >= args.warmup:
                wall[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - started_cpu)
    for watched in (detector, copied):
        assert watched.alarms == [], [alarm.describe() for alarm in watched.alarms]
    base_wall, base_cpu = statistics.median(wall["plain"]), statistics.median(cpu["plain"])
    print(f"tiny-llama (default size), accumulation {args.accumulation}, {args.steps} steps")
    print("| step | wall ms | wall ratio | cpu ratio |")
    print("| --- | --- | --- | --- |")
    for name in runners:
        median_wall, median_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"| {name} | {1000 * median_wall:.1f} | x{median_wall / base_wall:.2f} "
            f"| x{median_cpu / base_cpu:.2f} |"
        )
    model, optimizer = workloads[4].model, workloads[4].optimizer
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    snapshot = TrainingSnapshot.take(model, optimizer, workloads[4].state)
    print(
        f"UpdateDetector(after_update) snapshot: {snapshot.nbytes / params:.2f}x the "
        "parameters' bytes"
    )


if __name__ == "__main__":
    main()
