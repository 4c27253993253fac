"""Start-up of the commands that only orchestrate, two installations side by side.

For each of two ``sdcreplay`` console scripts (``--before``: e.g. another checkout's venv;
``--after``: the one beside this Python), in turn, round after round (the machine's load
drifts: each round runs both, their order alternating):

- ``replay BUNDLE -d cpu:0``: from the command's start to its device process starting, i.e.
  the moment the process's first heartbeat (``LOGS/replay-cpu-0.alive``, written by
  `replay.worker.main` before it builds anything) appears on disk; and to the command's exit;
- ``info BUNDLE`` and ``diff LOG LOG`` (two replay logs): from start to exit.

The bundle is the tests' small tiny-llama (2 steps, 1 layer), recorded by ``--after``.
Printed: each figure's median (min-max) over the rounds, per installation.

    python bench/startup.py --before OTHER/.venv/bin/sdcreplay [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = {"layers": 1, "dim": 32, "heads": 2, "seq_len": 8, "batch_size": 2, "vocab": 64}
POLL = 0.002  # seconds between looks for the heartbeat file


def run(argv: list[str], marker: Path | None = None) -> tuple[float, float | None]:
    """(seconds to exit, seconds until ``marker`` appeared or None); fails on a non-zero exit."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen = None
    while process.poll() is None:
        if marker is not None and seen is None and marker.exists():
            seen = time.perf_counter() - start
        time.sleep(POLL)
    ended = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"{argv} exited {process.returncode}: {process.stderr.read().decode()}")
    return ended, seen


def prepare(exe: str, root: Path) -> tuple[Path, list[Path]]:
    bundle = root / "small.bundle"
    arguments = [arg for key, value in SMALL.items() for arg in ("-a", f"{key}={value}")]
    run([exe, "record", "builtin:tiny-llama", "--steps", "2", "--out", str(bundle), *arguments])
    logs = root / "logs"
    run([exe, "replay", str(bundle), "-d", "cpu:0", "-d", "cpu:1", "--logs", str(logs)])
    return bundle, [logs / "cpu-0.r0.sig.zst", logs / "cpu-1.r0.sig.zst"]


def measure(exe: str, bundle: Path, logs: list[Path], work: Path) -> dict[str, float]:
    work.mkdir()
    replay = [exe, "replay", str(bundle), "-d", "cpu:0", "--logs", str(work / "logs")]
    replay_exit, first_device = run(replay, marker=work / "logs" / "replay-cpu-0.alive")
    assert first_device is not None, "the device process never beat"
    return {
        "replay: first device": first_device,
        "replay: exit": replay_exit,
        "info: exit": run([exe, "info", str(bundle)])[0],
        "diff: exit": run([exe, "diff", *map(str, logs)])[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the sdcreplay console script to compare")
    parser.add_argument("--after", default=str(Path(sys.executable).parent / "sdcreplay"))
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="sdcreplay-startup-") as directory:
        root = Path(directory)
        os.environ["SDCREPLAY_HOME"] = str(root / "home")  # the bundle's secret, no ledger kept
        os.environ["SDCREPLAY_LEDGER"] = "off"
        bundle, logs = prepare(options.after, root)
        installations = {"before": options.before, "after": options.after}
        figures: dict[str, list[dict[str, float]]] = {name: [] for name in installations}
        for round_ in range(options.rounds):
            order = list(installations) if round_ % 2 == 0 else list(reversed(installations))
            for name in order:
                work = root / f"{name}-{round_}"
                figures[name].append(measure(installations[name], bundle, logs, work))
        print(f"{options.rounds} rounds, seconds: median (min-max)")
        for name, exe in installations.items():
            print(f"{name}: {exe}")
        print(f"{'':24}" + "".join(f"{name:>22}" for name in installations))
        for figure in figures["after"][0]:
            cells = []
            for name in installations:
                values = [run_[figure] for run_ in figures[name]]
                median = statistics.median(values)
                cells.append(f"{median:.2f} ({min(values):.2f}-{max(values):.2f})")
            print(f"{figure:24}" + "".join(f"{cell:>22}" for cell in cells))


if __name__ == "__main__":
    main()
