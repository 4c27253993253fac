"""One check of the GPU path on a machine with one GPU, in at most 8 minutes (``make gpu-check``).

It runs, on ``cuda:0``, every part the GPU path has and prints one table:

- the ``gpu``-marked tests;
- the device digest (one compiled pass) against ``torch.hash_tensor``, float32
  and bfloat16, 1 to 256 MiB (bench/digest.py);
- the recorder's overhead on tiny-llama at the small default size and at one
  large enough that the GPU, not kernel launches, bounds the step
  (bench/record_overhead.py);
- bisect's operator-capture factor: a step under the operator-level capture
  against the plain step (bench/bisect_overhead.py's step);
- minimize's trials per second against a bare loop (bench/minimize_throughput.py);
- end to end: record on cuda:0, replay on cuda:0 bit for bit, bisect an injected fault.

Every part runs in its own process with its share of the time budget; its
output goes to a log, and the table and logs are written under ``$OUT/gpu-check``
when ``OUT`` is set (else ``./gpu-check``). Where there is no GPU, the parts a
CPU can check run on the CPU at small sizes, the table says so, and the exit
status is 0 unless a part failed. ``--quick`` runs the CPU parts at their
smallest and leaves out the recorder overhead and the end-to-end part (what
the test suite runs). Run from the repository root:

    PYTHONPATH=. python bench/gpu_check.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BUDGET_SECONDS = 8 * 60
FAULT_MODULE = "layers.0.attn.wq"


@dataclass
class Settings:
    """Sizes and time shares of each part: the GPU run, the CPU run, the quick CPU run."""

    gpu: bool
    quick: bool
    logs: Path
    deadline: float = float("inf")  # time.perf_counter() by which every part must be done

    @property
    def device(self) -> str:
        return "cuda:0" if self.gpu else "cpu"


@dataclass
class Row:
    part: str
    status: str  # ok, failed, skipped
    figures: str


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the CPU parts at their smallest (for the test suite)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run the CPU parts even where a GPU is present"
    )
    return parser.parse_args()


def run_logged(
    settings: Settings, name: str, command: list[str], timeout: float
) -> tuple[int, str]:
    """Run one part's command; its output goes to ``name.log``; (exit status, stdout)."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.perf_counter()
    timeout = max(1.0, min(timeout, settings.deadline - started))  # the 8 minutes hold
    try:
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, stdout = 124, _text(exc.stdout)
        stderr = f"{_text(exc.stderr)}\ntimed out after {timeout:.0f} s"
    seconds = time.perf_counter() - started
    (settings.logs / f"{name}.log").write_text(
        f"$ {' '.join(command)}\n# exit {code} after {seconds:.1f} s\n{stdout}\n# stderr\n{stderr}",
        encoding="utf-8",
    )
    return code, stdout


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def python(*arguments: str) -> list[str]:
    return [sys.executable, *arguments]


def sdcreplay(*arguments: str) -> list[str]:
    """The CLI of this checkout, whatever is installed."""
    return python(
        "-c",
        "import sys; from sdcreplay.cli import main; sys.argv[0] = 'sdcreplay'; main()",
        *arguments,
    )


def gpu_tests(settings: Settings) -> Row:
    if not settings.gpu:
        return Row("gpu-marked tests", "skipped", "no GPU: they skip on a CPU")
    code, output = run_logged(
        settings,
        "gpu-tests",
        python("-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"),
        180,
    )
    summary = output.strip().splitlines()[-1] if output.strip() else "no output"
    return Row("gpu-marked tests", "ok" if code == 0 else "failed", summary)


def table_rows(output: str, first_cell: str) -> list[list[str]]:
    """The cells of a bench script's markdown rows whose first cell starts with ``first_cell``."""
    rows = []
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(first_cell):
            rows.append(cells)
    return rows


def table_part(
    part: str, code: int, rows: list[list[str]], shown: Callable[[list[str]], str]
) -> Row:
    """A part whose figures are rows of a bench script's table: ok when it exited 0 with rows."""
    figures = "; ".join(shown(cells) for cells in rows)
    return Row(part, "ok" if code == 0 and rows else "failed", figures or "no table")


def digest_vs_hash_tensor(settings: Settings) -> Row:
    sizes = "1,16,64,256" if settings.gpu else "1" if settings.quick else "1,16"
    device = "cuda" if settings.gpu else "cpu"
    code, output = run_logged(
        settings,
        "digest",
        python(
            "bench/digest.py",
            "--device",
            device,
            "--sizes",
            sizes,
            "--repeats",
            "3" if settings.quick else "5",
        ),
        90,
    )
    rows = table_rows(output, "float32") + table_rows(output, "bfloat16")
    return table_part(
        f"digest vs torch.hash_tensor ({device})",
        code,
        rows,
        lambda cells: f"{cells[0]} {cells[1]} MiB ours/hash_tensor {cells[4]}",
    )


def recorder_overhead(settings: Settings, size: str) -> Row:
    shapes = {
        "small": ["--layers", "4", "--dim", "256"],
        "large": [
            "--layers",
            "8",
            "--dim",
            "2048",
            "--heads",
            "16",
            "--seq-len",
            "1024",
            "--batch-size",
            "8",
        ],
    }[size]
    steps = (
        ["--blocks", "6", "--block-steps", "5", "--warmup", "3"]
        if settings.gpu
        else ["--blocks", "2", "--block-steps", "3", "--warmup", "1"]
    )
    code, output = run_logged(
        settings,
        f"record-overhead-{size}",
        python(
            "bench/record_overhead.py",
            "--device",
            settings.device,
            "--threads",
            "1",
            *shapes,
            *steps,
        ),
        150,
    )
    ratios = re.findall(r"^(wall|cpu) ratio ([0-9.]+)", output, flags=re.MULTILINE)
    figures = ", ".join(f"{clock} x{ratio}" for clock, ratio in ratios)
    return Row(
        f"recorder overhead, tiny-llama {size} ({settings.device})",
        "ok" if code == 0 and ratios else "failed",
        figures or "no ratios",
    )


def capture_factor(settings: Settings) -> Row:
    """bisect's operator-level capture against the plain step, on the device (in a child)."""
    shape = (
        "dict(layers=1, dim=32, seq_len=8, batch_size=2, heads=2)"
        if settings.quick
        else "dict(layers=4, dim=256, seq_len=128, batch_size=8)"
    )
    script = f"""
import json, sys, torch
sys.path.insert(0, "bench")
from bisect_overhead import Step, time_step
from sdcreplay.capture import determinism
from sdcreplay.storage.tensorio import map_tensors
torch.set_num_threads(1)
determinism.enable()
step = Step({shape})
device = torch.device("{settings.device}")
step.model.to(device)
step.batch = map_tensors(step.batch, lambda t: t.to(device))
if device.type == "cuda":  # dropout draws from the GPU's generator: every run the same numbers
    cuda_rng, reset = torch.cuda.get_rng_state(device), step.reset
    step.reset = lambda: (reset(), torch.cuda.set_rng_state(cuda_rng, device))
step.reset()  # loads the optimizer state onto the parameters' device
print(json.dumps(time_step(step, {2 if settings.quick else 5})))
"""
    code, output = run_logged(settings, "capture-factor", python("-c", script), 150)
    try:
        timed = json.loads(output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Row(f"bisect operator capture ({settings.device})", "failed", "no timings")
    wall = timed["wall_ms"]
    return Row(
        f"bisect operator capture ({settings.device})",
        "ok" if code == 0 else "failed",
        f"{timed['operators']} operators; reference x{wall['reference'] / wall['plain']:.2f}, "
        f"suspect x{wall['suspect'] / wall['plain']:.2f} of the plain step "
        f"({wall['plain']:.1f} ms)",
    )


def minimize_throughput(settings: Settings) -> Row:
    extra = (
        ["--scale", "0.2", "--repeats", "3"]
        if settings.gpu
        else [
            "--cases",
            "mm 256x256 float32",
            "--scale",
            "0.05" if settings.quick else "0.5",
            "--repeats",
            "1" if settings.quick else "3",
        ]
    )
    code, output = run_logged(
        settings,
        "minimize-throughput",
        python("bench/minimize_throughput.py", "--device", settings.device, *extra),
        150,
    )
    rows = table_rows(output, "mm") + table_rows(output, "rms_norm")
    return table_part(
        f"minimize trials/s ({settings.device})",
        code,
        rows,
        lambda cells: f"{cells[0]}: {cells[2]} trials/s, x{cells[4]} of bare",
    )


def end_to_end(settings: Settings) -> Row:
    """record, replay bit for bit, bisect an injected fault: through the CLI, in real processes."""
    recorder, suspect, reference = (
        ("cuda:0", "cuda:0", "cuda") if settings.gpu else ("cpu:0", "cpu:1", "cpu:0")
    )
    small = [
        "-a",
        "layers=1",
        "-a",
        "dim=32",
        "-a",
        "seq_len=8",
        "-a",
        "batch_size=2",
        "-a",
        "heads=2",
    ]
    fault = (
        f"kind=bitflip,op=aten.mm,module={FAULT_MODULE},phase=forward,step=1,index=5,bit=22,"
        f"device={suspect}"
    )
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        bundle, report = Path(scratch) / "run.bundle", Path(scratch) / "report"
        steps: list[tuple[str, list[str], int]] = [
            (
                "record",
                sdcreplay(
                    "record",
                    "builtin:tiny-llama",
                    "--steps",
                    "3",
                    "--device",
                    recorder,
                    *small,
                    "--out",
                    str(bundle),
                    "--json",
                ),
                0,
            ),
            ("replay", sdcreplay("replay", str(bundle), "-d", recorder, "--json"), 0),
            (
                "bisect",
                sdcreplay(
                    "bisect",
                    str(bundle),
                    "--suspect",
                    suspect,
                    "--reference",
                    reference,
                    "--inject",
                    fault,
                    "--out",
                    str(report),
                    "--json",
                ),
                1,
            ),
        ]
        said = []
        for name, command, expected in steps:
            code, output = run_logged(settings, f"end-to-end-{name}", command, 120)
            if code != expected:
                return Row(
                    f"record, replay, bisect ({recorder})",
                    "failed",
                    f"{name} exited {code}, expected {expected} (see end-to-end-{name}.log)",
                )
            said.append(_said(name, output))
    replayed, found = [device.get("verdict") for device in said[1].get("devices", [])], said[2]
    named = found.get("module") == FAULT_MODULE and found.get("op") == "aten.mm.default"
    return Row(
        f"record, replay, bisect ({recorder})",
        "ok" if named and replayed == ["match"] else "failed",
        f"replay on {recorder}: {', '.join(map(str, replayed))} (bit for bit); bisect named step "
        f"{found.get('step')} {found.get('module')} {found.get('op')} "
        f"(isolated: {found.get('isolated')})",
    )


def _said(name: str, stdout: str) -> dict:
    """The --json object a command printed on stdout."""
    try:
        said = json.loads(stdout)
    except ValueError:
        said = None
    return said if isinstance(said, dict) else {"error": f"{name} printed no JSON object"}


def render(rows: list[Row], settings: Settings, seconds: float) -> str:
    where = (
        torch.cuda.get_device_name(0)
        if settings.gpu
        else "no GPU: the CPU-checkable parts ran on the CPU"
    )
    lines = [
        f"gpu-check on {where}; torch {torch.__version__}; {seconds:.0f} s",
        "",
        "| part | status | figures |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {row.part} | {row.status} | {row.figures} |" for row in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    options = parse_args()
    out = Path(os.environ["OUT"]) / "gpu-check" if os.environ.get("OUT") else REPO / "gpu-check"
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings(
        gpu=torch.cuda.is_available() and not options.cpu and not options.quick,
        quick=options.quick,
        logs=out,
    )
    parts: list[Callable[[Settings], Row]] = [
        gpu_tests,
        digest_vs_hash_tensor,
        # --quick leaves out the parts that take the longest on a CPU (the suite runs the rest)
        *([] if settings.quick else [lambda s: recorder_overhead(s, "small")]),
        *([lambda s: recorder_overhead(s, "large")] if settings.gpu else []),
        capture_factor,
        minimize_throughput,
        *([] if settings.quick else [end_to_end]),
    ]
    started = time.perf_counter()
    settings.deadline = started + BUDGET_SECONDS
    rows = []
    for part in parts:
        if time.perf_counter() > settings.deadline:
            rows.append(
                Row(getattr(part, "__name__", "part"), "skipped", "the 8-minute budget was spent")
            )
            continue
        rows.append(part(settings))
        print(f"{rows[-1].part}: {rows[-1].status}", file=sys.stderr, flush=True)
    table = render(rows, settings, time.perf_counter() - started)
    (out / "table.md").write_text(table, encoding="utf-8")
    print(table)
    if not settings.gpu:
        print(
            "No GPU here: only the parts a CPU can check ran; "
            "run `make gpu-check` on a GPU machine for the table."
        )
    return 1 if any(row.status == "failed" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
