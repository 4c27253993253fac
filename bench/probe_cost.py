"""Cost of the kernel probe: once per bundle on the recording device, once per replica.

For ``builtin:tiny-llama`` at two sizes, measured side by side in one process and
interleaved (so machine load hits every figure alike), median over the rounds:

- step: one training step (``Workload.run_step``), the unit everything is a ratio of;
- collect: the same step with its distinct calls noted (the Recorder's verification
  re-execution does this, outside the loop's steps);
- record: running those calls on synthetic inputs and digesting them (the bundle's probe);
- replica: running a recorded probe and comparing it (each replica, before its replay).

Printed: seconds of each and its ratio to a step, the probe's calls, and its JSON size.

    PYTHONPATH=. python bench/probe_cost.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sdcreplay.capture.probe import collecting_calls, record_probe, run_probe
from sdcreplay.workload.definition import build_workload

SIZES = {
    "default": {},
    "layers=4 dim=256 seq=128 batch=8": {
        "layers": 4,
        "dim": 256,
        "seq_len": 128,
        "batch_size": 8,
    },
}
CPU = torch.device("cpu")


def _timed(function) -> tuple[float, object]:
    started = time.perf_counter()
    value = function()
    return time.perf_counter() - started, value


def measure(kwargs: dict, rounds: int) -> dict:
    workload = build_workload("builtin:tiny-llama", kwargs)
    batch = workload.get_batch(0)
    workload.run_step(batch)  # warm-up
    figures: dict[str, list[float]] = {"step": [], "collect": [], "record": [], "replica": []}
    probe = None
    for _ in range(rounds):
        figures["step"].append(_timed(lambda: workload.run_step(batch))[0])
        with collecting_calls(CPU) as collector:
            seconds, _ = _timed(lambda: workload.run_step(batch))
        figures["collect"].append(seconds)
        seconds, probe = _timed(lambda: record_probe(list(collector.calls.values()), CPU))
        figures["record"].append(seconds)
        seconds, outcome = _timed(lambda recorded=probe: run_probe(recorded, CPU))
        assert outcome.matched
        figures["replica"].append(seconds)
    medians = {name: statistics.median(values) for name, values in figures.items()}
    return {
        **medians,
        "calls": len(probe.calls),
        "skipped": probe.skipped,
        "json_bytes": len(json.dumps(probe.to_json())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| size | step s | collect (x step) | record probe (x step) | replica probe (x step) "
        "| calls | probe.json |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, kwargs in SIZES.items():
        m = measure(kwargs, args.rounds)
        step = m["step"]
        print(
            f"| {name} | {step:.3f} | {m['collect']:.3f} (x{m['collect'] / step:.2f}) "
            f"| {m['record']:.3f} (x{m['record'] / step:.2f}) "
            f"| {m['replica']:.3f} (x{m['replica'] / step:.2f}) "
            f"| {m['calls']} (+{m['skipped']} left out) | {m['json_bytes'] / 1024:.0f} KiB |"
        )


if __name__ == "__main__":
    main()
