"""Time sdcreplay's tensor digest against torch.hash_tensor on the same tensors.

On the CPU ours is ``tensor_digest`` (xxh3-64); on CUDA it is ``mix64`` in one
compiled pass. ``--digest mix64`` or ``mix64-eager`` times the device digest
itself (compiled, or its eager definition) on any device, the CPU included.
The two timings are interleaved in one run (best of --repeats each), so a
noisy machine slows both alike; the first call (the compile) is timed apart.
Run from the repository root:

    PYTHONPATH=. python bench/digest.py --device cpu
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from sdcreplay.capture.digest import mix64, one_pass_status, tensor_digest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="1,16,64,256", help="tensor sizes in MiB, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timings of each; the best counts")
    parser.add_argument("--device", default="cpu", choices=devices, help="where the tensors live")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated")
    parser.add_argument(
        "--digest",
        default="auto",
        choices=["auto", *DIGESTS],
        help="auto: what a recording on --device uses",
    )
    return parser.parse_args()


DIGESTS: dict[str, Callable[[torch.Tensor], object]] = {
    "tensor_digest": tensor_digest,
    "mix64": partial(mix64, one_pass=True),
    "mix64-eager": partial(mix64, one_pass=False),
}


def best_times_ms(
    ours: Callable[[], object], theirs: Callable[[], object], repeats: int, sync: Callable[[], None]
) -> tuple[float, float]:
    """Best wall time of each, alternating the two so that both see the same machine load."""
    best = [float("inf"), float("inf")]
    ours(), theirs(), sync()  # warm-up: allocator, kernels, page faults
    for _ in range(repeats):
        for slot, function in enumerate((ours, theirs)):
            start = time.perf_counter()
            function()
            sync()
            best[slot] = min(best[slot], time.perf_counter() - start)
    return best[0] * 1e3, best[1] * 1e3


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    ours_name = args.digest
    if ours_name == "auto":
        ours_name = "tensor_digest" if device.type == "cpu" else "mix64"
    digest = DIGESTS[ours_name]
    started = time.perf_counter()
    digest(torch.ones(1024, device=device))
    sync()
    print(
        f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} "
        f"first call {time.perf_counter() - started:.1f} s ({one_pass_status()})"
    )
    print(
        f"| dtype | MiB | {ours_name} ms | hash_tensor ms | ratio ours/hash_tensor "
        f"| {ours_name} GB/s | hash_tensor GB/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for mib in (int(size) for size in args.sizes.split(",")):
            numel = mib * 2**20 // dtype.itemsize
            tensor = torch.randn(numel, device=device).to(dtype)
            ours, theirs = partial(digest, tensor), partial(torch.hash_tensor, tensor)
            ours_ms, theirs_ms = best_times_ms(ours, theirs, args.repeats, sync)
            nbytes = tensor.numel() * tensor.element_size()
            print(
                f"| {dtype_name} | {mib} | {ours_ms:.2f} | {theirs_ms:.2f} "
                f"| {ours_ms / theirs_ms:.2f} | {nbytes / ours_ms / 1e6:.1f} "
                f"| {nbytes / theirs_ms / 1e6:.1f} |"
            )


if __name__ == "__main__":
    main()
