"""Step time of tiny-llama with and without the Recorder, measured side by side in one run.

    python bench/record_overhead.py                # layers=4 dim=256 seq_len=128 batch_size=8
    python bench/record_overhead.py --profile      # also: where the recorder's time goes (cProfile)

Both modes train the same model in the same process, in alternating blocks of
steps (plain, recorded, recorded, plain, ...), after a warm-up, so drift in
the machine's speed (other load, thermal, allocator state) hits both alike.
A recorded step is everything the Recorder adds to a training step: the RNG
capture and batch copy, the forward/backward hooks and digests, gradient and
parameter digests, and writing the step (HDF5 file, signature frame,
manifest) from the optimizer-step hook. Setting up a recording (embedding the
initial state) and closing it are not per-step costs and are not timed.

Verification (the default) adds a one-off cost, the re-execution of the first
step through the workload's step, timed on its own ("first-step check"), and a
per-step check that parameters and buffers did not change between steps: the
recorded steps are timed with verification on and off, side by side, so the
ratio shows what it adds to every later step.

Two clocks are reported: wall time, and the CPU time of the process (all its
threads), which on a shared machine is far less disturbed by other work than
wall time is (use --threads 1 there: spinning OpenMP threads that wait for a
core turn into both wall and CPU time).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sdcreplay.bundle.writer import BundleWriter
from sdcreplay.capture import determinism
from sdcreplay.capture import layers as capture_module
from sdcreplay.capture.digest import Digester
from sdcreplay.capture.layers import SignatureCapture
from sdcreplay.recording import recorder as recorder_module
from sdcreplay.recording.recorder import Recorder
from sdcreplay.storage.tensorio import map_tensors
from sdcreplay.workload.definition import build_workload


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=12, help="blocks per mode (alternating)")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per block")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each mode first")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument(
        "--depth", type=int, default=None, help="Recorder max_depth (default: every module)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the recorded steps and print the top functions",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (steps end in a sync)")
    return parser.parse_args()


class Bench:
    def __init__(self, args: argparse.Namespace, scratch: Path):
        self.kwargs = {
            "layers": args.layers,
            "dim": args.dim,
            "heads": args.heads,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "seed": 0,
        }
        self.workload = build_workload("builtin:tiny-llama", self.kwargs)
        device = torch.device(args.device)
        self.workload.model.to(device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.depth = args.depth
        self.batches = [
            map_tensors(self.workload.get_batch(i), lambda t: t.to(device)) for i in range(8)
        ]
        self.scratch = scratch
        self.recordings = 0
        self.step_index = 0
        self.check_seconds: list[float] = []

    def _batch(self):
        self.step_index += 1
        return self.batches[self.step_index % len(self.batches)]

    def plain_block(self, steps: int) -> list[tuple[float, float]]:
        model, optimizer, loss_fn = (
            self.workload.model,
            self.workload.optimizer,
            self.workload.loss_fn,
        )
        times = []
        for _ in range(steps):
            batch = self._batch()
            start, cpu = time.perf_counter(), time.process_time()
            loss = loss_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            self.sync()
            times.append((time.perf_counter() - start, time.process_time() - cpu))
        return times

    def recorded_block(
        self, steps: int, profiler: cProfile.Profile | None = None, verify: bool = True
    ) -> list[tuple[float, float]]:
        model, optimizer, loss_fn = (
            self.workload.model,
            self.workload.optimizer,
            self.workload.loss_fn,
        )
        self.recordings += 1
        path = self.scratch / f"run{self.recordings}.bundle"
        recorder = Recorder(
            path,
            "builtin:tiny-llama",
            model,
            optimizer,
            workload_kwargs=self.kwargs,
            max_depth=self.depth,
            verify=verify,
        )
        times = []
        for index in range(steps):
            batch = self._batch()
            if index == 1 and verify:  # the one-off first-step check, timed apart from the steps
                start = time.perf_counter()
                recorder.verify()
                self.check_seconds.append(time.perf_counter() - start)
            if profiler is not None:
                profiler.enable()
            start, cpu = time.perf_counter(), time.process_time()
            with recorder.step(batch):
                loss = loss_fn(model, batch)
                loss.backward()
            optimizer.step()  # the recorder writes the step from this hook
            optimizer.zero_grad()
            self.sync()
            times.append((time.perf_counter() - start, time.process_time() - cpu))
            if profiler is not None:
                profiler.disable()
        recorder.close()
        shutil.rmtree(path)
        return times


class OwnWork:
    """CPU time spent inside the recorder's own code (its hooks and step writing) during a step.

    On a shared VM a training step's time spreads by +-10% from one step to the
    next, more than the recorder adds; its own work is additive and can be
    timed exactly where it happens, so this is the steadier estimate.
    """

    HOOKS = (
        "_on_forward_begin",
        "_on_forward",
        "_on_input_grad",
        "record_loss",
        "record_gradients",
        "_on_optimizer_begin",
        "_on_optimizer_step",
        "begin_step",
        "end_step",
    )

    PARTS = {  # parts of the own work, timed apart: (owner, attribute)
        "digests (Digester.add)": (Digester, "add"),
        "backward edge walk (_input_edges)": (capture_module, "_input_edges"),
        "step writing (BundleWriter.add_step)": (BundleWriter, "add_step"),
        "state check (state_digests)": (recorder_module, "state_digests"),
    }

    def __init__(self) -> None:
        self.spent = 0.0
        self._depth = 0
        self.parts: dict[str, list[float]] = {name: [] for name in self.PARTS}
        self._part_spent = dict.fromkeys(self.PARTS, 0.0)

    def timed(self, function, part: str | None = None):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            self._depth += 1
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1
                spent = time.process_time() - start
                if part is not None:
                    self._part_spent[part] += spent
                elif self._depth == 0:
                    self.spent += spent

        return wrapper

    def measure(self, bench: Bench, steps: int) -> tuple[float, float]:
        """Median (recorded step, recorder's own work) CPU seconds over ``steps`` steps."""
        originals = {name: getattr(SignatureCapture, name) for name in self.HOOKS}
        finish, capture_rng = Recorder._finish_pending, recorder_module.determinism.capture_rng
        unchanged = Recorder._check_unchanged_since_last_step
        for name, function in originals.items():
            setattr(SignatureCapture, name, self.timed(function))
        parts = {part: getattr(owner, name) for part, (owner, name) in self.PARTS.items()}
        for part, (owner, name) in self.PARTS.items():
            setattr(owner, name, self.timed(parts[part], part))
        Recorder._finish_pending = self.timed(finish)
        Recorder._check_unchanged_since_last_step = self.timed(unchanged)
        recorder_module.determinism.capture_rng = self.timed(capture_rng)
        try:
            model, optimizer, loss_fn = (
                bench.workload.model,
                bench.workload.optimizer,
                bench.workload.loss_fn,
            )
            path = bench.scratch / "own-work.bundle"
            recorder = Recorder(
                path,
                "builtin:tiny-llama",
                model,
                optimizer,
                workload_kwargs=bench.kwargs,
                max_depth=bench.depth,
            )
            totals, own = [], []
            for _ in range(steps):
                recorder.verify()  # once, after the first step: timed apart (Bench.check_seconds)
                batch = bench._batch()
                self.spent = 0.0
                self._part_spent = dict.fromkeys(self.PARTS, 0.0)
                start = time.process_time()
                with recorder.step(batch):
                    loss_fn(model, batch).backward()
                optimizer.step()
                optimizer.zero_grad()
                totals.append(time.process_time() - start)
                own.append(self.spent)
                for part, spent in self._part_spent.items():
                    self.parts[part].append(spent)
            recorder.close()
            shutil.rmtree(path)
        finally:
            for name, function in originals.items():
                setattr(SignatureCapture, name, function)
            for part, (owner, name) in self.PARTS.items():
                setattr(owner, name, parts[part])
            Recorder._finish_pending, recorder_module.determinism.capture_rng = finish, capture_rng
            Recorder._check_unchanged_since_last_step = unchanged
        return statistics.median(totals), statistics.median(own)


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    determinism.enable()  # the recorder turns these on; the plain steps run under them too
    with tempfile.TemporaryDirectory(prefix="sdcreplay-bench-") as scratch:
        bench = Bench(args, Path(scratch))
        bench.plain_block(args.warmup)
        bench.recorded_block(args.warmup)
        bench.check_seconds.clear()
        plain: list[tuple[float, float]] = []
        recorded: list[tuple[float, float]] = []
        unverified: list[tuple[float, float]] = []
        for block in range(args.blocks):
            modes = [
                (plain, bench.plain_block),
                (recorded, bench.recorded_block),
                (unverified, functools.partial(bench.recorded_block, verify=False)),
            ]
            for times, run in modes if block % 2 == 0 else modes[::-1]:
                times += run(args.block_steps)
        own_work = OwnWork()
        step_seconds, own_seconds = own_work.measure(bench, args.blocks * args.block_steps // 2)
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:
            bench.recorded_block(args.block_steps * 2, profiler)

    sizes = ", ".join(f"{key}={value}" for key, value in bench.kwargs.items() if key != "seed")
    print(
        f"tiny-llama ({sizes}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{len(plain)} steps per mode in {args.blocks} alternating blocks"
    )
    print(f"{'clock':<6}{'mode':<18}{'median ms':>11}{'p10 ms':>10}{'p90 ms':>10}")
    ratios = {}
    for clock, column in (("wall", 0), ("cpu", 1)):
        medians = {}
        for name, times in (
            ("without recorder", plain),
            ("with recorder", recorded),
            ("verify off", unverified),
        ):
            values = [t[column] * 1e3 for t in times]
            deciles = statistics.quantiles(values, n=10)
            medians[name] = statistics.median(values)
            print(
                f"{clock:<6}{name:<18}{medians[name]:>11.2f}{deciles[0]:>10.2f}{deciles[-1]:>10.2f}"
            )
        ratios[clock] = medians["with recorder"] / medians["without recorder"]
        verify_ratio = medians["with recorder"] / medians["verify off"]
        print(
            f"{clock} later steps, verification on / off: ratio {verify_ratio:.3f} "
            f"({100 * (verify_ratio - 1):+.1f}% per step for the between-steps check)"
        )
    for clock, ratio in ratios.items():
        print(
            f"{clock} ratio {ratio:.3f} (overhead {100 * (ratio - 1):+.1f}%; target at most +3%: "
            f"{'met' if ratio <= 1.03 else 'NOT met'})"
        )
    check = statistics.median(bench.check_seconds) * 1e3
    step = statistics.median(t[0] for t in plain) * 1e3
    print(
        f"first-step check (once per recording: rebuild the workload, re-execute step 0, compare): "
        f"{check:.1f} ms = {check / step:.1f} plain steps"
    )
    own_ratio = step_seconds / (step_seconds - own_seconds)
    print(
        f"recorder's own work (CPU time inside its hooks and step writing): "
        f"{own_seconds * 1e3:.1f} ms of a "
        f"{step_seconds * 1e3:.1f} ms recorded step: overhead {100 * (own_ratio - 1):+.1f}%; "
        f"target at most +3%: "
        f"{'met' if own_ratio <= 1.03 else 'NOT met'}"
    )
    for part, seconds in own_work.parts.items():
        print(f"  of which {part}: median {statistics.median(seconds) * 1e3:.1f} ms")
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())


if __name__ == "__main__":
    main()
