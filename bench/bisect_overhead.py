"""Cost of bisect: operator-level capture over the plain step, and bisect end to end.

1. One tiny-llama training step (forward, backward, AdamW) three ways, the
   timings interleaved in one run (median of --repeats each, after a warm-up),
   every timed step starting from the same saved state so that all of them
   run the same step (wall time, and the process's CPU time, which a loaded
   machine disturbs less):

   - plain: no capture at all;
   - reference: under an ``OperatorMode`` with an ``OperatorLog`` observer,
     every operator call named and its outputs digested (the reference run);
   - suspect: the same, comparing each call with the reference's log as it
     goes (the suspect run; the step matches throughout, the worst case).

2. ``sdcreplay bisect`` on a small tiny-llama bundle with an injected fault, in
   a real subprocess, with and without ``--step``: wall time and the number of
   worker processes it started.

3. Cost against the step's position: ``sdcreplay bisect`` on a 24-step bundle
   with the fault in the first and in the last step, with and without
   ``--step``: the training steps it executed (``steps_run`` in the report)
   and wall time. Only the reference replays the window, so the last step
   should cost about one window replay more than the first, not four.

Run from the repository root:

    PYTHONPATH=. python bench/bisect_overhead.py
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from sdcreplay.capture import determinism
from sdcreplay.capture.operators import OperatorLog, OperatorMode
from sdcreplay.workload.definition import build_workload

FAULT = "kind=bitflip,op=aten.mm,module=layers.1.attn.wq,phase=forward,step=1,index=5,device=cpu:1"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--repeats", type=int, default=9, help="timed steps of each kind; the median counts"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--skip-end-to-end", action="store_true", help="time only the step")
    parser.add_argument("--window-steps", type=int, default=24, help="bundle steps in part 3")
    parser.add_argument("--skip-position", action="store_true", help="leave out part 3")
    parser.add_argument(
        "--baseline", help="part 3 also with the sdcreplay of this source tree (e.g. /work/main)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile one captured step (suspect mode)"
    )
    return parser.parse_args()


class Step:
    """One workload, one batch, one saved state: every call runs the very same step."""

    def __init__(self, kwargs: dict):
        self.workload = build_workload("builtin:tiny-llama", kwargs)
        self.batch = self.workload.get_batch(0)
        self.model, self.optimizer = self.workload.model, self.workload.optimizer
        self.run(None)  # creates the optimizer state, so the saved state is a steady-state step
        self.saved = copy.deepcopy((self.model.state_dict(), self.optimizer.state_dict()))
        self.rng = torch.get_rng_state()

    def reset(self) -> None:
        self.model.load_state_dict(self.saved[0])
        # A copy: load_state_dict keeps the saved "step" tensors, which AdamW then increments.
        self.optimizer.load_state_dict(copy.deepcopy(self.saved[1]))
        torch.set_rng_state(self.rng)

    def run(self, observer) -> None:
        mode = (
            OperatorMode(self.model, self.optimizer, [observer], 0)
            if observer is not None
            else None
        )
        if mode is not None:
            mode.__enter__()
        try:
            loss = self.workload.loss_fn(self.model, self.batch)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)


def time_step(step: Step, repeats: int) -> dict:
    step.reset()
    reference = OperatorLog()
    step.run(reference)  # also the warm-up of the captured path
    kinds = {
        "plain": lambda: None,
        "reference": OperatorLog,
        "suspect": lambda: OperatorLog(expected=reference.records),
    }
    for make in kinds.values():  # warm-up of each
        step.reset()
        step.run(make())
    wall: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    last = {}
    for _ in range(repeats):
        for kind, make in kinds.items():
            observer = make()
            step.reset()
            start, start_cpu = time.perf_counter(), time.process_time()
            step.run(observer)
            wall[kind].append(time.perf_counter() - start)
            cpu[kind].append(time.process_time() - start_cpu)
            last[kind] = observer
    suspect = last["suspect"]
    assert suspect.divergent is None and suspect.structure_error is None, (
        "the timed steps must be the same step"
    )
    return {
        "operators": len(reference.records),
        "wall_ms": {kind: statistics.median(values) * 1e3 for kind, values in wall.items()},
        "cpu_ms": {kind: statistics.median(values) * 1e3 for kind, values in cpu.items()},
    }


def profile_step(step: Step) -> None:
    import cProfile
    import pstats

    step.reset()
    reference = OperatorLog()
    step.run(reference)
    step.reset()
    observer = OperatorLog(expected=reference.records)
    profiler = cProfile.Profile()
    profiler.runcall(step.run, observer)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def _console_script() -> str:
    beside = Path(sys.executable).parent / "sdcreplay"
    return str(beside) if beside.is_file() else "sdcreplay"


def _record(bundle: Path, steps: int, size: dict) -> None:
    arguments = [part for key, value in size.items() for part in ("-a", f"{key}={value}")]
    subprocess.run(
        [
            _console_script(),
            "record",
            "builtin:tiny-llama",
            "--steps",
            str(steps),
            "--out",
            str(bundle),
            *arguments,
        ],
        check=True,
        capture_output=True,
    )


def _bisect(
    bundle: Path, fault: str, out: Path, extra: list[str], source: str | None = None
) -> tuple[dict, float]:
    """``sdcreplay bisect --json`` as a person runs it (``source``'s code): report, wall time."""
    env = {**os.environ, "PYTHONPATH": source} if source else None
    start = time.perf_counter()
    done = subprocess.run(
        [
            _console_script(),
            "bisect",
            str(bundle),
            "--suspect",
            "cpu:1",
            "--reference",
            "cpu:0",
            "--inject",
            fault,
            "--out",
            str(out),
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - start
    if done.returncode != 1:
        raise SystemExit(f"bisect exited {done.returncode}:\n{done.stderr}")
    return json.loads(done.stdout), wall


def end_to_end(folder: Path) -> list[dict]:
    """``sdcreplay bisect`` on a 3-step, 2-layer bundle with a forward bitflip, as a person runs
    it."""
    bundle = folder / "bench.bundle"
    _record(bundle, 3, {"layers": 2, "dim": 64, "seq_len": 32, "batch_size": 4})
    rows = []
    for label, extra in (("with --step 1", ["--step", "1"]), ("without --step", [])):
        out = folder / f"report-{len(rows)}"
        report, wall = _bisect(bundle, FAULT, out, extra)
        workers = len(list((out / "work").rglob("*.task.json")))
        rows.append(
            {
                "run": label,
                "wall_s": wall,
                "workers": workers,
                "found": f"{report['op']} under {report['module']}, call {report['op_index']}",
            }
        )
    return rows


POSITION_SIZE = {"layers": 2, "dim": 256, "seq_len": 128, "batch_size": 8}


def position_cost(folder: Path, steps: int, baseline: str | None) -> list[dict]:
    """Bisect a fault in the first and in the last step of a ``steps``-step bundle.

    With ``baseline`` (another source tree), each bisect also runs with that
    tree's sdcreplay right after, for a side-by-side wall time.
    """
    bundle = folder / "window.bundle"
    _record(bundle, steps, POSITION_SIZE)
    rows = []
    for given in (True, False):
        for step in (0, steps - 1):
            extra = ["--step", str(step)] if given else []
            fault = FAULT.replace("step=1", f"step={step}")
            report, wall = _bisect(bundle, fault, folder / f"position-{len(rows)}", extra)
            assert report["step"] == step, report["step"]
            row = {"step": step, "given": given, "wall_s": wall, "steps_run": report["steps_run"]}
            if baseline:
                before = folder / f"baseline-{len(rows)}"
                old, row["baseline_wall_s"] = _bisect(bundle, fault, before, extra, baseline)
                assert old["step"] == step and old["op_index"] == report["op_index"]
            rows.append(row)
    return rows


def print_position_cost(rows: list[dict], steps: int) -> None:
    print()
    print(f"tiny-llama {POSITION_SIZE}, {steps} steps: divergence at the first and the last step")
    baseline = "baseline_wall_s" in rows[0]
    print(
        "| bisect | divergent step | step executions | wall s |"
        + (" baseline wall s |" if baseline else "")
    )
    print("| --- | ---: | ---: | ---: |" + (" ---: |" if baseline else ""))
    for row in rows:
        detail = ", ".join(f"{k} {v}" for k, v in row["steps_run"].items() if k != "total" and v)
        print(
            f"| {'with' if row['given'] else 'without'} --step | {row['step']} "
            f"| {row['steps_run']['total']} ({detail}) | {row['wall_s']:.1f} |"
            + (f" {row['baseline_wall_s']:.1f} |" if baseline else "")
        )
    for given in (True, False):
        first, last = (row for row in rows if row["given"] is given)
        print(
            f"{'with' if given else 'without'} --step: last/first = "
            f"{last['steps_run']['total'] / first['steps_run']['total']:.2f}x step executions "
            f"(+{last['steps_run']['total'] - first['steps_run']['total']}), "
            f"{last['wall_s'] / first['wall_s']:.2f}x wall "
            f"(+{last['wall_s'] - first['wall_s']:.1f} s)"
            + (
                f"; baseline +{last['baseline_wall_s'] - first['baseline_wall_s']:.1f} s"
                if baseline
                else ""
            )
        )


def main() -> None:
    args = parse_args()
    determinism.enable(num_threads=args.threads)
    kwargs = {
        "layers": args.layers,
        "dim": args.dim,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
    }
    step = Step(kwargs)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"cpu count {os.cpu_count()}; "
        f"tiny-llama {kwargs}"
    )
    if args.profile:
        profile_step(step)
        return
    result = time_step(step, args.repeats)
    wall, cpu = result["wall_ms"], result["cpu_ms"]
    print(
        f"operator calls per step: {result['operators']}; median of {args.repeats} after a warm-up"
    )
    print("| step | wall ms | ratio | CPU ms | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind in ("plain", "reference", "suspect"):
        print(
            f"| {kind} | {wall[kind]:.1f} | {wall[kind] / wall['plain']:.2f}x "
            f"| {cpu[kind]:.1f} | {cpu[kind] / cpu['plain']:.2f}x |"
        )
    if not args.skip_end_to_end:
        with tempfile.TemporaryDirectory() as folder:
            rows = end_to_end(Path(folder))
        print()
        print("| bisect | wall s | worker processes | found |")
        print("| --- | ---: | ---: | --- |")
        for row in rows:
            print(f"| {row['run']} | {row['wall_s']:.1f} | {row['workers']} | {row['found']} |")
    if not args.skip_position:
        with tempfile.TemporaryDirectory() as folder:
            rows = position_cost(Path(folder), args.window_steps, args.baseline)
            print_position_cost(rows, args.window_steps)


if __name__ == "__main__":
    main()
