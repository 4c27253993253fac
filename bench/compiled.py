"""A `torch.compile`d training step: what recording it costs, and what replaying it costs.

Copies of one block-compiled residual MLP (same seed, same batches; every block compiled in
place with ``block.compile()``, as TorchTitan does) train in one process, their steps
interleaved (the order rotated every step) so that machine load hits them alike; one
intra-op thread (Inductor's C++ kernels run on it):

- compiled: the compiled step without the tool;
- ring boundary: ``Recorder(ring=8, signature="boundary")`` over the same compiled step
  (copies every 8; its watch of the compiled regions included);
- ring layer: ``Recorder(ring=8)``, the layer level (the compiled regions' boundaries).

Per configuration: the median CPU time of the training thread per step as a ratio to
compiled, and the mean's (the ring's copy every 8 steps is in the mean). Then the compiled
replay: a 3-step bundle recorded from the same model, replayed in this process by a
``ReplaySession`` after ``torch._dynamo.reset()``: its first step compiles again (Inductor's
on-disk caches warm, as on a replay machine that replayed before; ``--cold`` empties them
first), its later steps run the generated code; the compile time is the first step's excess
over the median of the others.

    PYTHONPATH=. python bench/compiled.py --steps 60 --width 256 --depth 4 --batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sdcreplay
from sdcreplay.bundle import trust
from sdcreplay.replay.session import ReplaySession

RING = 8


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def make_workload(width: int = 256, depth: int = 4, batch: int = 64) -> sdcreplay.Workload:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(width) for _ in range(depth)))
    for block in model:
        block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def get_batch(index: int) -> dict:
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(batch, width, generator=generator)
        return {"x": x, "y": torch.randn(batch, width, generator=generator)}

    def train_step(data: dict) -> torch.Tensor:
        loss = F.mse_loss(model(data["x"]), data["y"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return sdcreplay.Workload(model, optimizer, get_batch, train_step=train_step)


REF = f"{Path(__file__).resolve()}:make_workload"


def measure_recording(steps: int, sizes: dict, work: Path) -> dict[str, dict]:
    copies = {name: make_workload(**sizes) for name in ("compiled", "ring boundary", "ring layer")}
    recorders = {
        name: sdcreplay.Recorder(
            work / f"{name.replace(' ', '-')}.bundle",
            REF,
            copies[name].model,
            copies[name].optimizer,
            workload_kwargs=sizes,
            ring=RING,
            signature=signature,
            ledger=False,
        )
        for name, signature in (("ring boundary", "boundary"), ("ring layer", "layer"))
    }
    times: dict[str, list[float]] = {name: [] for name in copies}
    names = list(copies)
    for index in range(steps + 2):  # the first two compile (and warm up): not timed
        batch = copies["compiled"].get_batch(index)
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            recorder = recorders.get(name)
            started = time.thread_time()
            if recorder is None:
                copies[name].train_step(batch)
            else:
                with recorder.step(batch):
                    copies[name].train_step(batch)
            if index >= 2:
                times[name].append(time.thread_time() - started)
    for recorder in recorders.values():
        recorder.close()
    base_median = statistics.median(times["compiled"])
    base_mean = statistics.mean(times["compiled"])
    return {
        name: {
            "median_ms": round(1e3 * statistics.median(values), 3),
            "median_ratio": round(statistics.median(values) / base_median, 4),
            "mean_ratio": round(statistics.mean(values) / base_mean, 4),
        }
        for name, values in times.items()
    }


def measure_replay(sizes: dict, work: Path) -> dict:
    workload = make_workload(**sizes)
    recorder = sdcreplay.Recorder(
        work / "replay.bundle", REF, workload.model, workload.optimizer, workload_kwargs=sizes
    )
    recorded = []
    for index in range(4):
        batch = workload.get_batch(index)
        started = time.perf_counter()
        with recorder.step(batch):
            workload.train_step(batch)
        recorded.append(time.perf_counter() - started)
    path = recorder.close()
    torch._dynamo.reset()  # the replay compiles again, as a fresh device process does
    with trust.granting([REF]):
        session = ReplaySession(path, "cpu")
    replayed = []
    for record in session.bundle.steps:
        started = time.perf_counter()
        session.run_step(record)
        replayed.append(time.perf_counter() - started)
    regions = session.compiled.regions()
    session.close()
    steady = statistics.median(replayed[1:])
    return {
        "recorded_step_s": [round(t, 4) for t in recorded],
        "replayed_step_s": [round(t, 4) for t in replayed],
        "compile_s": round(replayed[0] - steady, 3),
        "replay_steady_vs_recorded": round(steady / statistics.median(recorded[1:]), 4),
        "graphs_regenerated": sum(len(region.graphs) for region in regions),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cold", action="store_true", help="empty Inductor's caches first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = {"width": args.width, "depth": args.depth, "batch": args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        if args.cold:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        work = Path(tmp)
        result = {
            "sizes": sizes,
            "steps": args.steps,
            "recording": measure_recording(args.steps, sizes, work),
            "replay": measure_replay(sizes, work),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
