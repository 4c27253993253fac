"""Trials per second of minimize's trial loop against a bare loop of the same operator.

Ours is ``TrialRunner.measure``: call the operator, compare every output with
the expected one bit for bit, count. The bare loop only calls the operator.
Both run on the same placed inputs, interleaved round by round (best of
--repeats each), so a noisy machine slows both alike. Run from the repository root:

    PYTHONPATH=. python bench/minimize_throughput.py --device cpu

Cases: a 256x256 and a 4096x4096 float32 matmul (``aten.mm.default``), and a
bfloat16 RMSNorm of 4096 tokens of width 4096 as ``aten._fused_rms_norm.default``:
the one operator ``F.rms_norm`` calls on a GPU, so the one a bisect there names.
(On a CPU it decomposes into pow/mean/add/rsqrt/mul, each a cheaper
element-wise operator of the same size; the fused one is the harder case for
the loop's comparison.)
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable

import torch

from sdcreplay.bisect.operator_case import place, resolve_op
from sdcreplay.capture import determinism
from sdcreplay.capture.operators import CallSite
from sdcreplay.minimize.trials import TrialRunner

# name -> (operator, input maker, trials per round on a CPU, on a GPU)
CASES: dict[str, tuple[str, Callable[[], list], int, int]] = {
    "mm 256x256 float32": (
        "aten.mm.default",
        lambda: [torch.randn(256, 256), torch.randn(256, 256)],
        100,
        20000,
    ),
    "mm 4096x4096 float32": (
        "aten.mm.default",
        lambda: [torch.randn(4096, 4096), torch.randn(4096, 4096)],
        1,
        100,
    ),
    "rms_norm 4096x4096 bfloat16": (
        "aten._fused_rms_norm.default",
        lambda: [
            torch.randn(4096, 4096).to(torch.bfloat16),
            [4096],
            torch.randn(4096).to(torch.bfloat16),
            1e-6,
        ],
        6,
        2000,
    ),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--repeats", type=int, default=9, help="rounds of each loop; the best counts"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every case's trials per round"
    )
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    return parser.parse_args()


def best_rates(
    runner: TrialRunner,
    args: list,
    expected: list,
    trials: int,
    repeats: int,
    sync: Callable[[], None],
) -> tuple[float, float]:
    """Trials per second of (ours, bare), alternating the two each round."""
    op = runner.op
    placed = place(args, runner.device)

    def ours() -> None:
        measured = runner.measure(args, {}, expected, trials)
        assert measured.failures == 0, (
            "a healthy device failed: the benchmark's expected output is wrong"
        )

    def bare() -> None:
        for _ in range(trials):
            op(*placed)
        sync()

    best = [float("inf"), float("inf")]
    ours(), bare()  # warm-up: allocator, kernels, page faults
    for _ in range(repeats):
        for slot, loop in enumerate((ours, bare)):
            start = time.perf_counter()
            loop()
            best[slot] = min(best[slot], time.perf_counter() - start)
    return trials / best[0], trials / best[1]


def _shown(rate: float) -> str:
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def main() -> None:
    options = parse_args()
    determinism.enable()
    label = options.device if options.device != "cuda" else "cuda:0"
    gpu = label.startswith("cuda")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    name = (
        torch.cuda.get_device_name(torch.device(label))
        if gpu
        else determinism.device_description(torch.device("cpu"))["name"]
    )
    print(f"device={label} ({name}) threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| case | trials per round | ours trials/s | bare trials/s | ours/bare |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for case in options.cases.split(","):
        op_name, make_inputs, cpu_trials, gpu_trials = CASES[case]
        trials = max(1, round((gpu_trials if gpu else cpu_trials) * options.scale))
        op = resolve_op(op_name)
        runner = TrialRunner(op, CallSite(0, "forward", "bench", op_name, 0), Counter(), label, [])
        args = make_inputs()
        expected = runner.outputs(args, {})
        ours, bare = best_rates(runner, args, expected, trials, options.repeats, sync)
        print(f"| {case} | {trials} | {_shown(ours)} | {_shown(bare)} | {ours / bare:.2f} |")


if __name__ == "__main__":
    main()
