"""Cost of the ring (and the update detector) on TorchTitan's own compiled Trainer, per step.

TorchTitan 0.3.0's llama3 debug model as it ships (fused ``wqkv``, activation checkpointing,
each block and the loss compiled: ``--compile.enable``, FSDP2 over a world of one), run by
``sdcreplay.integrations.torchtitan.main`` under ``torchrun --nproc-per-node 1``, in five
variants, one process each, started together:

- plain: no ``--sdcreplay.*`` option (TorchTitan's Trainer, nothing recorded);
- plain, grads None: the same, its gradients set to None before each step as a recorded
  ``RecordingTrainer`` sets them (TorchTitan's own step zeroes them in place);
- ring: ``--sdcreplay.bundle B --sdcreplay.ring K`` (the last K steps in memory, nothing
  written);
- ring + detect: the same and ``--sdcreplay.detect`` (the update detector judges each step);
- ring, boundary: the ring with ``--sdcreplay.signature boundary`` (each step's signature
  holds the step's boundary, not every module's output and gradient).

Each process times its ``train_step`` (the recorded step: the batch fed, the step's block,
what TorchTitan does in it) in wall and process CPU time. The first ``--warmup`` steps (the
compiling ones) run freely; from then on the variants take turns step by step, the order
rotated each step, so the machine's load hits them alike and only one trains at a time.
Printed: per variant the median wall and CPU time of the timed steps, the median of each
step's ratio to plain's same step (the two ran one after the other), the ratio of the mean
wall times (every K-th step opens a window: the ring's snapshot of model and optimizer),
the CPU time of those steps and of the others apart, each process's peak RSS, the ring's
memory (``Recorder.ring_nbytes`` after each step) against the model's and optimizer's bytes,
and the alarms raised (an alarm would dump a bundle: none expected).

    .venv/bin/python bench/titan_ring.py [--steps 64] [--warmup 4] [--ring 8]

Needs TorchTitan (``sdcreplay[torchtitan]``); on a CPU-only machine it trains through the
tests' shim ``tests/integrations/titan_cpu.py`` and their assets (``titan_assets.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HELPERS = ROOT / "tests" / "integrations"
CHILD = "SDCREPLAY_TITAN_BENCH"  # the variant's folder, set in a variant's process
POLL = 0.001  # seconds between looks for a turn's file


def turn_of(step: int, variant: int, count: int) -> int:
    """The turn (from 0) of ``variant`` at timed step ``step``: steps in order, the variants'
    order within a step rotated by one each step."""
    return step * count + (variant - step) % count


def wait_for(path: Path, limit: float = 900.0) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} in {limit:.0f} s: another variant stopped")
        time.sleep(POLL)


def child() -> None:
    """A variant's process: TorchTitan's entry point with ``train_step`` timed, taking turns."""
    sys.path.insert(0, str(HELPERS))
    import titan_cpu  # noqa: F401  (before TorchTitan: its device module)

    from sdcreplay.integrations.torchtitan import RecordingTrainer, main

    folder = Path(os.environ[CHILD])
    variant, count = int(os.environ["BENCH_VARIANT"]), int(os.environ["BENCH_VARIANTS"])
    warmup = int(os.environ["BENCH_WARMUP"])
    turns = folder.parent / "turns"
    results: dict = {"wall": [], "cpu": [], "ring_nbytes": [], "rise": [], "alarms": 0}
    untimed = RecordingTrainer.train_step
    set_to_none = bool(os.environ.get("BENCH_SET_TO_NONE"))

    def train_step(self: RecordingTrainer, data_iterator):  # type: ignore[no-untyped-def]
        timed = self.step - 1 - warmup  # train() counts the step before it calls train_step
        if timed >= 0:
            wait_for(turns / str(turn_of(timed, variant, count)))
        held = 0 if self.recorder is None else self.recorder.ring_nbytes
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            if set_to_none:
                self.optimizers.zero_grad(set_to_none=True)
            untimed(self, data_iterator)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            if timed >= 0:
                (turns / str(turn_of(timed, variant, count) + 1)).touch()
        if "state_nbytes" not in results:  # the optimizer's state exists after its first step
            results["state_nbytes"] = state_nbytes(self)
        if timed >= 0:
            results["wall"].append(wall)
            results["cpu"].append(cpu)
        if timed >= 0 and self.recorder is not None:
            results["ring_nbytes"].append(self.recorder.ring_nbytes)
            results["rise"].append(self.recorder.ring_nbytes - held)
        if self.detector is not None:
            results["alarms"] = len(self.detector.alarms)

    RecordingTrainer.train_step = train_step  # type: ignore[method-assign]
    main()
    results["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (folder / "result.json").write_text(json.dumps(results))


def state_nbytes(trainer: Any) -> int:
    """Bytes of the model's parameters and the optimizers' state."""
    import torch

    tensors = [p for part in trainer.model_parts for p in part.parameters()]
    for optimizer in trainer.optimizers.optimizers:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_variants(
    variants: dict[str, tuple[list[str], bool]],
    common: list[str],
    root: Path,
    warmup: int,
    threads: int,
) -> dict[str, dict]:
    """Starts every variant's torchrun at once and waits for them all; their results."""
    torchrun = Path(sys.executable).parent / "torchrun"
    (root / "turns").mkdir()
    (root / "turns" / "0").touch()
    processes: dict[str, tuple[subprocess.Popen, Path]] = {}
    for index, (name, (options, set_to_none)) in enumerate(variants.items()):
        folder = root / f"variant-{index}"
        folder.mkdir()
        env = {
            **os.environ,
            CHILD: str(folder),
            "BENCH_VARIANT": str(index),
            "BENCH_VARIANTS": str(len(variants)),
            "BENCH_WARMUP": str(warmup),
            "OMP_NUM_THREADS": str(threads),
            "SDCREPLAY_HOME": str(root / "home"),
            "SDCREPLAY_LEDGER": "off",
            "BENCH_SET_TO_NONE": "1" if set_to_none else "",
        }
        argv = [str(torchrun), "--standalone", "--nproc-per-node", "1", __file__]
        argv += common + [arg.replace("BUNDLE", str(folder / "alarm.bundle")) for arg in options]
        with (folder / "log.txt").open("w") as log:
            process = subprocess.Popen(argv, cwd=root, env=env, stdout=log, stderr=log)
        processes[name] = (process, folder)
    while any(process.poll() is None for process, _ in processes.values()):
        if any(process.poll() for process, _ in processes.values()):
            break
        time.sleep(0.5)
    failed = [name for name, (process, _) in processes.items() if process.poll()]
    if failed:  # the others would wait for its turns: stop them (torchrun stops its worker)
        for process, _ in processes.values():
            if process.poll() is None:
                process.terminate()
                process.wait()
        process, folder = processes[failed[0]]
        log = (folder / "log.txt").read_text()[-3000:]
        raise SystemExit(f"{failed[0]} exited {process.returncode}; its log ends:\n{log}")
    return {
        name: {**json.loads((folder / "result.json").read_text()), "dumped": dumps(folder)}
        for name, (_, folder) in processes.items()
    }


def dumps(folder: Path) -> int:
    return len([path for path in folder.iterdir() if path.name.startswith("alarm")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=4, help="untimed first steps (compiling)")
    parser.add_argument("--ring", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="TorchTitan's local_batch_size")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each variant")
    options = parser.parse_args()
    common = [
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--training.steps", str(options.warmup + options.steps),
        "--training.seq_len", str(options.seq_len),
        "--training.local_batch_size", str(options.batch),
        "--compile.enable",
    ]  # fmt: skip
    ring = ["--sdcreplay.bundle", "BUNDLE", "--sdcreplay.ring", str(options.ring)]
    detect = [*ring, "--sdcreplay.detect"]
    boundary = [*ring, "--sdcreplay.signature", "boundary"]
    variants = {
        "plain": ([], False),
        "plain, grads None": ([], True),
        f"ring {options.ring}": (ring, False),
        "ring + detect": (detect, False),
        "ring, boundary": (boundary, False),
    }
    sys.path.insert(0, str(HELPERS))
    from titan_assets import write_assets

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sdcreplay-titan-ring-") as directory:
        root = Path(directory)
        write_assets(root)
        results = run_variants(variants, common, root, options.warmup, options.threads)
    report(results, options, time.perf_counter() - started)


def report(results: dict[str, dict], options: argparse.Namespace, seconds: float) -> None:
    """Medians per variant, and ratios to plain: the median of each timed step's ratio to
    plain's same step (run next to it), and the ratio of the means (window openings in)."""
    print(
        f"TorchTitan llama3 debugmodel, compiled, seq_len {options.seq_len}, batch "
        f"{options.batch}, {options.threads} thread(s); {options.steps} timed steps per variant "
        f"after {options.warmup}, in turns ({seconds:.0f} s in all)"
    )
    plain = results["plain"]
    print(
        f"{'':18} {'wall ms':>8} {'ratio':>6} {'cpu ms':>8} {'ratio':>6} {'mean':>6} "
        f"{'RSS MiB':>8} {'opening cpu ms':>15} {'others':>7}"
    )
    for name, result in results.items():
        cells = ""
        for key in ("wall", "cpu"):
            paired = [mine / theirs for mine, theirs in zip(result[key], plain[key])]
            cells += f" {1000 * statistics.median(result[key]):8.1f}"
            cells += f" {statistics.median(paired):6.3f}"
        cells += f" {sum(result['wall']) / sum(plain['wall']):6.3f}"
        cells += f" {result['peak_rss'] / 2**20:8.0f}"
        opened = [rise > result["state_nbytes"] / 2 for rise in result["rise"]]  # a snapshot
        if any(opened) and not all(opened):
            opening = [cpu for cpu, snapshot in zip(result["cpu"], opened) if snapshot]
            others = [cpu for cpu, snapshot in zip(result["cpu"], opened) if not snapshot]
            cells += f" {1000 * statistics.median(opening):15.1f}"
            cells += f" {1000 * statistics.median(others):7.1f}"
        print(f"{name:18}{cells}")
    for name, result in results.items():
        held = result["ring_nbytes"]
        if not held:
            continue
        steady = held[2 * options.ring :] or held
        rises = result["rise"]
        snapshot = [rise for rise in rises if rise > result["state_nbytes"] / 2]
        step = [rise for rise in rises if 0 <= rise <= result["state_nbytes"] / 2]
        print(
            f"{name}: ring memory after a step {min(steady) / 2**20:.2f}-"
            f"{max(steady) / 2**20:.2f} MiB (peak {max(held) / 2**20:.2f}); a window's first "
            f"step adds {statistics.median(snapshot or [0]) / 2**20:.2f} MiB, another "
            f"{statistics.median(step or [0]) / 2**10:.1f} KiB; model and optimizer state "
            f"{result['state_nbytes'] / 2**20:.2f} MiB; alarms {result['alarms']}, bundles "
            f"dumped {result['dumped']}"
        )


if __name__ == "__main__":
    if CHILD in os.environ:
        child()
    else:
        main()
