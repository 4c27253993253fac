"""Cost of `sdcreplay screen`: per ticket, per device, and where a budget goes.

Three tickets are made as tests/fleet make them (one bisect of a small tiny-llama bundle,
three minimize runs with planted faults: a [1, 1] x [1, n] matmul each), put in a corpus,
and screened through the real command line (a fresh process, as a Slurm prolog runs it):

- on 1 device and on 3 virtual replicas (each device its own process, all at once);
- with each ticket's own trials (1: a fault that fires every time) and with --trials 1000;

side by side with a bare loop of the same operator on the same inputs in this process
(the floor a trial can reach). Printed: the command's wall time, its start-up (process
start to the device processes' launch), each device process's time to its answer, the
mean seconds per ticket and per trial, and that per trial against the bare loop's.

    PYTHONPATH=. python bench/screen_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from sdcreplay.bisect.localize import bisect
from sdcreplay.bisect.operator_case import OperatorCase, resolve_op
from sdcreplay.fleet.corpus import add_tickets, read_corpus
from sdcreplay.minimize.driver import minimize
from sdcreplay.recording.drive import record

SMALL = {"layers": 1, "dim": 32, "heads": 2, "seq_len": 8, "batch_size": 2, "vocab": 64}
CALL = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1"
FAULTS = ["index=5,bit=22", "index=0,bit=3", "index=2,bit=30"]


def make_corpus(root: Path) -> Path:
    bundle = root / "run.bundle"
    record("builtin:tiny-llama", bundle, steps=2, seed=0, kwargs=dict(SMALL))
    found = bisect(
        bundle,
        suspect="cpu:1",
        reference="cpu:0",
        step=1,
        inject=[f"{CALL},{FAULTS[0]},device=cpu:1"],
        ledger=False,
    )
    tickets = [
        minimize(
            found.report,
            trials=20,
            good_trials=2,
            inject=[f"{CALL},{fault},device=cpu:1"],
            out=root / f"ticket-{n}",
            ledger=False,
        ).ticket
        for n, fault in enumerate(FAULTS)
    ]
    add_tickets(root / "corpus", tickets)
    return root / "corpus"


def run_screen(corpus: Path, devices: list[str], trials: int | None) -> dict:
    command = [shutil.which("sdcreplay") or str(Path(sys.executable).with_name("sdcreplay"))]
    command += ["screen", str(corpus), "--budget", "60", "--json", "--no-ledger"]
    for device in devices:
        command += ["-d", device]
    if trials:
        command += ["--trials", str(trials)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    tickets = [t for d in report["devices"] for t in d["tickets"]]
    return {
        "wall": wall,
        "startup": report["startup_s"],
        "device": statistics.mean(d["seconds"] for d in report["devices"]),
        "ticket": statistics.mean(t["seconds"] for t in tickets),
        "trials": statistics.mean(t["trials"] for t in tickets),
    }


def bare_loop(corpus: Path, trials: int) -> float:
    """Seconds per call of each ticket's operator on its inputs, in a plain loop."""
    per_call = []
    for entry in read_corpus(corpus):
        case = OperatorCase.read(corpus / entry.directory / "inputs.h5")
        op = resolve_op(case.op)
        started = time.perf_counter()
        for _ in range(trials):
            op(*case.args, **case.kwargs)
        per_call.append((time.perf_counter() - started) / trials)
    return statistics.mean(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(tempfile.mkdtemp(prefix="sdcreplay-screen-bench-"))
    os.environ["SDCREPLAY_HOME"] = str(root / "home")
    corpus = make_corpus(root)
    cases = {
        "1 device, own trials": (["cpu:0"], None),
        "3 devices, own trials": (["cpu:0", "cpu:1", "cpu:2"], None),
        "1 device, --trials 1000": (["cpu:0"], 1000),
    }
    measured: dict[str, list[dict]] = {name: [] for name in cases}
    bare = []
    for _ in range(rounds):  # interleaved: machine load hits every case alike
        for name, (devices, trials) in cases.items():
            measured[name].append(run_screen(corpus, devices, trials))
        bare.append(bare_loop(corpus, 1000))
    floor = statistics.median(bare)
    print(f"bare loop: {floor * 1e6:.1f} us per call (median of {rounds})")
    print(
        "| case | wall s | start-up s | device process s | per ticket s | per trial us | "
        "per trial / bare |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rows in measured.items():
        median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        per_trial = median["ticket"] / median["trials"]
        print(
            f"| {name} | {median['wall']:.2f} | {median['startup']:.2f} | "
            f"{median['device']:.2f} | {median['ticket']:.4f} | {per_trial * 1e6:.0f} | "
            f"{per_trial / floor:.1f} |"
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
