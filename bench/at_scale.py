"""At scale (docs/at-scale.md): the two phases against today's path, on CPU ranks (gloo).

For each size N: a DDP job of a tiny tiny-llama (1 layer, dim 16) recorded on N ranks, 2
steps; a bit flip planted in the replays on rank 11 (rank N-3 when N <= 11) in step 0's
backward. Side by side:

- phase 1: ``replay --same-batch`` (one replay of N ranks);
- phase 2: ``bisect --rank R --alone --suspect cpu:1 --reference cpu:2 --step 0``;
- today: ``replay`` with two whole-job replicas (2N ranks, one after the other), then
  ``bisect --rank R --suspect cpu:1 --reference cpu:2 --step 0`` (every stage a job of N).

Per path: the verdict and what it named (rank; operator, element, bit), the device processes
started (counted: every process leaves a ``*.task.json`` in its work directory), the
device-steps (steps replayed, summed over processes: a serving peer's steps included) and the
wall time. One run per size on this machine, all paths in the same minutes.

    PYTHONPATH=. python bench/at_scale.py --sizes 8 16 [--out results.json]
    PYTHONPATH=. python bench/at_scale.py --sizes 32 --phases-only
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from sdcreplay.bisect.localize import bisect
from sdcreplay.recording.job import record_job
from sdcreplay.replay.job import replay_job
from sdcreplay.replay.same_batch import replay_same_batch

TINY = {"layers": 1, "dim": 16, "heads": 2, "seq_len": 8, "batch_size": 2, "vocab": 32}
STEPS = 2


def fault(rank: int, device: str | None = None) -> str:
    spec = f"kind=bitflip,op=aten.mm,phase=backward,step=0,rank={rank},index=3,bit=20"
    return spec + (f",device={device}" if device else "")


def processes(directory: Path) -> int:
    return sum(1 for _ in directory.rglob("*.task.json"))


def timed(call, root: Path):
    """(value, seconds, device processes it started under ``root``)."""
    before = processes(root)
    started = time.perf_counter()
    value = call()
    return value, time.perf_counter() - started, processes(root) - before


def measure(size: int, root: Path, today: bool = True) -> dict:
    rank = 11 if size > 11 else size - 3
    job = root / f"job{size}.bundle"
    _, recorded, _ = timed(
        lambda: record_job(
            "builtin:tiny-llama", job, nproc=size, steps=STEPS, kwargs={**TINY, "parallel": "ddp"}
        ),
        root,
    )
    labels = [f"cpu:{r}" for r in range(size)]
    rows = {}

    logs = root / f"phase1-{size}"
    report, seconds, started = timed(
        lambda: replay_same_batch(job, labels, inject=[fault(rank)], log_dir=logs, ledger=False),
        root,
    )
    named = [odd["rank"] for odd in report.to_json()["odd_ranks"]]
    rows["phase 1: replay --same-batch"] = {
        "named": f"ranks {named}", "processes": started, "device_steps": size * STEPS,
        "seconds": seconds,
    }  # fmt: skip

    out = root / f"phase2-{size}"
    result, seconds, started = timed(
        lambda: bisect(
            job, rank=rank, suspect="cpu:1", reference="cpu:2", step=0,
            inject=[fault(rank, "cpu:1")], out=out, ledger=False, alone=True,
        ),
        root,
    )  # fmt: skip
    body = result.to_json()
    rows["phase 2: bisect --rank --alone"] = {
        "named": _named(body), "processes": started,
        "device_steps": body["steps_run"]["total"], "seconds": seconds,
    }  # fmt: skip

    if not today:
        return {"size": size, "rank": rank, "record_seconds": recorded, "rows": rows}
    logs = root / f"today-replay-{size}"
    two = [f"cpu:{r}" for r in range(2 * size)]
    report, replay_seconds, replayed = timed(
        lambda: replay_job(
            job, two, inject=[fault(rank, f"cpu:{rank}")], log_dir=logs, ledger=False
        ),
        root,
    )
    out = root / f"today-bisect-{size}"
    result, bisect_seconds, bisected = timed(
        lambda: bisect(
            job, rank=rank, suspect="cpu:1", reference="cpu:2", step=0,
            inject=[fault(rank, "cpu:1")], out=out, ledger=False,
        ),
        root,
    )  # fmt: skip
    body = result.to_json()
    stages = bisected // size
    rows["today: 2 replicas + bisect --rank"] = {
        "named": f"origin rank {report.origin.origin_rank}; {_named(body)}",
        "processes": replayed + bisected,
        # every in-job stage: rank R's steps plus each serving peer's steps up to step 0
        "device_steps": 2 * size * STEPS + body["steps_run"]["total"] + stages * (size - 1),
        "seconds": replay_seconds + bisect_seconds,
    }
    return {"size": size, "rank": rank, "record_seconds": recorded, "rows": rows}


def _named(body: dict) -> str:
    bits = ",".join((body.get("bits") or {}).get("histogram", {}))
    elements = (body.get("elements") or {}).get("indices")
    return f"{body.get('op')} {body.get('phase')} element {elements} bit {bits}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--phases-only", action="store_true", help="leave out today's path (its 2N + 6N processes)"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="at-scale-"))
    results = []
    try:
        for size in args.sizes:
            results.append(measure(size, root, today=not args.phases_only))
            row = results[-1]
            print(
                f"N={size} (fault on rank {row['rank']}; recorded in {row['record_seconds']:.0f} s)"
            )
            for path, found in row["rows"].items():
                print(
                    f"  {path:36} {found['processes']:4} processes {found['device_steps']:5} "
                    f"device-steps {found['seconds']:7.1f} s  {found['named']}"
                )
            if args.out:
                args.out.write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
