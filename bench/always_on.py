"""Always-on recording and detection: what each costs per training step, side by side.

Copies of ``builtin:tiny-llama`` (same seed, same batches) train in one process, their steps
interleaved (each step of every copy before the next step of any, the order rotated every
step) so that machine load hits them alike; one intra-op thread:

- plain: ``Workload.run_step``;
- ring boundary, checkpoint-anchored: ``Recorder(ring=8, signature="boundary")`` told of a
  checkpoint every ``--every`` steps (``checkpoint_saved``; the ``torch.save`` itself is the
  job's cost and is not timed, the announcement is);
- the same with ``verify=False``: without the check that the parameters did not change between
  two steps (one more pass over them per step; its bundles are unverified, so this is a
  measurement of that pass, not a setting to run with);
- ring boundary, copies every 8: the same without checkpoints (a ``TrainingSnapshot`` every
  K steps, the copy's cost spread over them);
- UpdateDetector: the default (judged before the update, nothing copied);
- UpdateDetector(when="after_update"): the copy-based rule (a copy before every step);
- both: the checkpoint-anchored boundary ring under the UpdateDetector;
- ring layer: ``Recorder(ring=8)`` at the layer level, copies every 8 (the forensic level).

Per configuration: the median CPU time of the training thread per step as a ratio to plain,
the mean's (amortized: a copy every K steps, a checkpoint's announcement every ``--every``,
which the median leaves out), the process's median (it adds the checkpoint's SHA-256
thread), and the memory held
(``ring_nbytes`` at its peak, and per held step without the copies). No alarm fires on these
clean steps (checked). ``--runs`` repeats the whole measurement with fresh copies.

    PYTHONPATH=. python bench/always_on.py --size issue     # layers=4 dim=256 seq 128 batch 8
    PYTHONPATH=. python bench/always_on.py --size default   # tiny-llama's defaults
    PYTHONPATH=. python bench/always_on.py --device cuda:0  # digests on the device
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from sdcreplay import Recorder
from sdcreplay.capture import determinism
from sdcreplay.online.update_detector import UpdateDetector
from sdcreplay.storage.tensorio import map_tensors
from sdcreplay.workload.definition import Workload, build_workload

SIZES = {
    "issue": {"layers": 4, "dim": 256, "seq_len": 128, "batch_size": 8},
    "default": {},
}
RING = 8


class Config:
    """One copy of the workload and how its loop runs a step under it."""

    def __init__(
        self,
        name: str,
        workload: Workload,
        recorder: Recorder | None = None,
        detector: UpdateDetector | None = None,
        checkpoints: Path | None = None,
    ):
        self.name, self.workload = name, workload
        self.recorder, self.detector, self.checkpoints = recorder, detector, checkpoints
        self.thread: list[float] = []
        self.process: list[float] = []
        self.peak = 0
        self.per_step: list[float] = []

    def run(self, step: int, batch: Any, every: int, timed: bool, clock: Any) -> None:
        if self.checkpoints is not None and step % every == 0:  # the job saves: not timed
            path = self.checkpoints / f"{self.name.replace(' ', '-')}-{step}.pt"
            torch.save(
                {
                    "model": self.workload.model.state_dict(),
                    "optimizer": self.workload.optimizer.state_dict(),
                },
                path,
            )
        started_thread, started_process = clock(), time.process_time()
        if self.checkpoints is not None and step % every == 0:
            assert self.recorder is not None
            self.recorder.checkpoint_saved(path)
        if self.detector is not None:
            self.detector.run_step(batch)
        elif self.recorder is not None:
            with self.recorder.step(batch):
                self.workload.run_step(batch)
        else:
            self.workload.run_step(batch)
        if timed:
            self.thread.append(clock() - started_thread)
            self.process.append(time.process_time() - started_process)
        if self.recorder is not None:
            held = self.recorder.ring_nbytes
            self.peak = max(self.peak, held)
            ring = self.recorder._ring
            steps = ring.steps if ring is not None else []
            if steps:
                self.per_step.append(sum(s.nbytes for s in steps) / len(steps))

    def close(self) -> None:
        if self.detector is not None:
            assert self.detector.alarms == [], [a.describe() for a in self.detector.alarms]
            self.detector.close()
        if self.recorder is not None:
            self.recorder.close()


def configurations(kwargs: dict, scratch: Path, device: str) -> list[Config]:
    def fresh() -> Workload:
        workload = build_workload("builtin:tiny-llama", dict(kwargs, seed=0))
        workload.model.to(device)
        return workload

    def ring(workload: Workload, name: str, **options) -> Recorder:
        return Recorder(
            scratch / f"{name}.bundle",
            "builtin:tiny-llama",
            workload.model,
            workload.optimizer,
            state=workload.state,
            workload_kwargs=dict(kwargs, seed=0),
            ring=RING,
            **options,
        )

    made: list[Config] = [Config("plain", fresh())]
    anchored = fresh()
    made.append(
        Config(
            "ring boundary, checkpoint-anchored",
            anchored,
            ring(anchored, "anchored", signature="boundary"),
            checkpoints=scratch,
        )
    )
    unchecked = fresh()
    made.append(
        Config(
            "the same, verify=False (no check between steps)",
            unchecked,
            ring(unchecked, "unchecked", signature="boundary", verify=False),
            checkpoints=scratch,
        )
    )
    copied = fresh()
    made.append(
        Config(
            f"ring boundary, copies every {RING}",
            copied,
            ring(copied, "copied", signature="boundary"),
        )
    )
    detected = fresh()
    made.append(Config("UpdateDetector", detected, detector=UpdateDetector(detected)))
    copying = fresh()
    made.append(
        Config(
            "UpdateDetector(when='after_update')",
            copying,
            detector=UpdateDetector(copying, when="after_update"),
        )
    )
    both = fresh()
    both_ring = ring(both, "both", signature="boundary")
    made.append(
        Config(
            "both (anchored ring + detector)",
            both,
            both_ring,
            UpdateDetector(both, recorder=both_ring),
            checkpoints=scratch,
        )
    )
    layer = fresh()
    made.append(Config(f"ring layer, copies every {RING}", layer, ring(layer, "layer")))
    return made


def measure(args: argparse.Namespace, kwargs: dict) -> dict[str, dict]:
    scratch = Path(tempfile.mkdtemp(prefix="always-on-"))
    try:
        configs = configurations(kwargs, scratch, args.device)
        batches = configs[0].workload
        clock = time.thread_time
        if args.device.startswith("cuda"):  # a GPU's step: wall time once it is done

            def clock() -> float:
                torch.cuda.synchronize(args.device)
                return time.perf_counter()

        for step in range(args.warmup + args.steps):
            batch = map_tensors(batches.get_batch(step), lambda t: t.to(args.device))
            order = configs[step % len(configs) :] + configs[: step % len(configs)]
            for config in order:
                config.run(step, batch, args.every, timed=step >= args.warmup, clock=clock)
        for config in configs:
            config.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    plain_thread = statistics.median(configs[0].thread)
    plain_process = statistics.median(configs[0].process)
    return {
        config.name: {
            "thread_ms": 1000 * statistics.median(config.thread),
            "thread_ratio": statistics.median(config.thread) / plain_thread,
            "amortized_ratio": statistics.mean(config.thread) / statistics.mean(configs[0].thread),
            "process_ratio": statistics.median(config.process) / plain_process,
            "peak_bytes": config.peak,
            "bytes_per_step": statistics.median(config.per_step) if config.per_step else 0,
        }
        for config in configs
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="issue")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every run's numbers here")
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda:N (then wall time per step, synchronized)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    determinism.enable(1)
    kwargs = SIZES[args.size]
    params = sum(p.numel() for p in build_workload("builtin:tiny-llama", kwargs).model.parameters())
    runs: list[dict[str, dict]] = []
    for run in range(args.runs):
        started = time.perf_counter()
        runs.append(measure(args, kwargs))
        print(f"run {run + 1}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(
        f"tiny-llama {args.size} size ({params / 1e6:.2f}M parameters), {args.steps} timed steps "
        f"per configuration and run, {args.runs} runs, one thread, a checkpoint every "
        f"{args.every} steps"
    )
    print()
    print(
        "| in the loop | thread CPU per step | median ratio to plain (runs) | amortized (mean) "
        "ratio (runs) | process CPU, median ratio (runs) | ring held, peak | per held step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in runs[0]:
        rows = [run[name] for run in runs]

        def shown(key: str, rows: list[dict] = rows) -> str:
            return ", ".join(f"x{row[key]:.3f}" for row in rows)

        milliseconds = statistics.median(row["thread_ms"] for row in rows)
        peak = max(row["peak_bytes"] for row in rows)
        per_step = statistics.median(row["bytes_per_step"] for row in rows)
        print(
            f"| {name} | {milliseconds:.1f} ms | {shown('thread_ratio')} | "
            f"{shown('amortized_ratio')} | {shown('process_ratio')} | {peak / 2**20:.1f} MiB | "
            f"{per_step / 2**10:.1f} KiB |"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
