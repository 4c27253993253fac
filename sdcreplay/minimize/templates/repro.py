"""Reproduce a silent data corruption: one operator, its recorded inputs, a bit-for-bit check.

For a compiled kernel (inputs.h5 names one), the kernel's generated source beside this script
is compiled with Inductor's own compiler (g++ for a C++ kernel, Triton for a GPU one) and run.

Written by `sdcreplay minimize` next to inputs.h5 (the inputs, the expected
output computed on a healthy device, and the switches that decide which
kernel runs). Needs only torch and h5py; nothing is unpickled.

    python repro.py --device cuda:0 --trials 100000

Prints "failed F of N" and the first mismatching element (index, expected,
actual, XOR mask of the raw bits). Exit status:

    0  every trial's output equals the expected output bit for bit
    1  at least one trial's output differed (the failure reproduced)
    2  a usage error (an unknown option)
    3  it could not run here: the device is not on this machine, inputs.h5 is
       missing or unreadable, or the operator raised (printed as Error/Hint)

If sdcreplay is importable and SDCREPLAY_INJECT holds fault specs, they are
applied exactly as `sdcreplay minimize --inject` did, so the ticket can be
checked on a healthy machine (a drill: ticket.md gives the whole command);
without sdcreplay the script runs all the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

INPUTS = Path(__file__).resolve().with_name("inputs.h5")
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SOURCES = {"cpp": "kernel.cpp", "triton": "kernel.py"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda:0" if torch.cuda.is_available() else "cpu"
    parser.add_argument(
        "--device", default=default, help=f"cuda:N or cpu (cpu:N is the CPU); default {default}"
    )
    parser.add_argument(
        "--trials", type=int, default=1000, help="how many times to run the operator (default 1000)"
    )
    return parser.parse_args()


class CannotRun(Exception):
    """The reproducer cannot run here (exit 3): no finding either way."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


def torch_device(label: str) -> torch.device:
    """cpu:N names a virtual replica of the CPU (sdcreplay's test devices): it runs on the CPU.
    A GPU this machine does not have is refused before anything runs."""
    if label.split(":")[0] == "cpu":
        return torch.device("cpu")
    try:
        device = torch.device(label)
    except RuntimeError:
        raise CannotRun(f"unknown device {label!r}", "Use cuda:N or cpu.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise CannotRun(
            f"--device {label}: this machine has no CUDA device (torch {torch.__version__}, "
            f"{build})",
            "Run it on the machine with the suspect GPU, or give --device cpu.",
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise CannotRun(
            f"--device {label}: this machine has {torch.cuda.device_count()} CUDA device(s)",
            "Name one of them: cuda:0, cuda:1, ... (nvidia-smi lists them).",
        )
    return device


def apply_switches(switches: dict) -> None:
    """The determinism switches the expected output was computed with (they pick the kernels)."""
    for name, value in switches.get("env", {}).items():
        if value is not None:
            os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(switches["deterministic_algorithms"])
    torch.backends.cudnn.deterministic = switches["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = switches["cudnn_benchmark"]
    torch.backends.cuda.matmul.allow_tf32 = switches["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = switches["cudnn_allow_tf32"]
    torch.set_float32_matmul_precision(switches["float32_matmul_precision"])
    torch.set_num_threads(switches["num_threads"])


def read_tensor(dataset: h5py.Dataset) -> torch.Tensor:
    """Values in row-major order; dtypes numpy lacks (bfloat16...) are stored as integer words."""
    dtype = getattr(torch, dataset.attrs["dtype"])
    values = torch.from_numpy(np.ascontiguousarray(dataset[()]))
    if values.dtype != dtype:
        values = values.view(dtype)
    shape = [int(n) for n in dataset.attrs["shape"]]
    laid_out = torch.empty_strided(shape, [int(s) for s in dataset.attrs["stride"]], dtype=dtype)
    return laid_out.copy_(values.reshape(shape))


def read_tree(group: h5py.Group):
    """The nest of lists/dicts/values/tensors that sdcreplay's tensorio wrote (a JSON skeleton)."""

    def decode(node):
        ((kind, payload),) = node.items()
        if kind == "tensor":
            return read_tensor(group[payload])
        if kind == "dict":
            return {key: decode(value) for key, value in payload}
        if kind in ("list", "tuple"):
            items = [decode(item) for item in payload]
            return items if kind == "list" else tuple(items)
        if kind == "dtype":
            return getattr(torch, payload)
        if kind in ("layout", "memory_format"):
            return getattr(torch, payload)
        if kind == "device":
            return torch.device(payload)
        return payload

    return decode(json.loads(group.attrs["skeleton"]))


def resolve(name: str):
    namespace, _, rest = name.partition(".")
    packet, _, overload = rest.rpartition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def to_device(tree, device: torch.device):
    """Copies on the device, strides kept; a device named among the arguments follows."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device, copy=True)
    if isinstance(tree, torch.device):
        return device
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(item, device) for item in tree)
    if isinstance(tree, dict):
        return {key: to_device(value, device) for key, value in tree.items()}
    return tree


def results(op, args: list, out) -> list:
    """What the call produced: the arguments it wrote to (in-place/out= operators), else its
    outputs."""
    written = [
        args[i]
        for i, argument in enumerate(op._schema.arguments[: len(args)])
        if argument.alias_info is not None and argument.alias_info.is_write
    ]
    if written:
        return [
            t for item in written for t in (item if isinstance(item, (list, tuple)) else [item])
        ]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def optional_injection(label: str, handle: h5py.File, kernel: dict | None):
    """sdcreplay's injector for SDCREPLAY_INJECT, or None (no sdcreplay, or nothing to inject)."""
    if not os.environ.get("SDCREPLAY_INJECT"):
        return None
    try:
        from sdcreplay.capture.compiled_kernels import KernelSite
        from sdcreplay.capture.faults import Injector, parse_specs
        from sdcreplay.capture.operators import CallSite
    except ImportError:
        print(
            "SDCREPLAY_INJECT is set but sdcreplay is not importable: running without injection",
            file=sys.stderr,
        )
        return None
    where = json.loads(handle.attrs["site"])
    prior = Counter(
        {(op, module, phase): n for op, module, phase, n in json.loads(handle.attrs["prior"])}
    )
    # a job's call: the rank it ran on, so a drill's rank= spec fires as it did in the job
    rank = int(handle.attrs["rank"]) if "rank" in handle.attrs else None
    injector = Injector(parse_specs(), label, rank=rank)
    print(
        f"injecting {os.environ['SDCREPLAY_INJECT']!r} through sdcreplay "
        "(a drill, not a hardware fault)"
    )
    if kernel is not None:
        return lambda written: injector.on_isolated_kernel(KernelSite(**where), prior, written)
    return lambda out: injector.on_isolated_call(CallSite(**where), prior, out)


def compiled_kernel(kernel: dict):
    """The kernel from its generated source beside this script, compiled by Inductor as the
    training process compiled it: a callable taking the recorded arguments."""
    if kernel["kind"] == "extern":
        from torch._inductor.select_algorithm import extern_kernels

        return getattr(extern_kernels, kernel["name"].split(".", 1)[1])
    source = Path(__file__).resolve().with_name(SOURCES[kernel["kind"]]).read_text()
    if kernel["kind"] == "cpp":
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return CppPythonBindingsCodeCache.load_pybinding(list(kernel["argument_types"]), source)
    from torch._inductor.async_compile import AsyncCompile

    launcher = AsyncCompile().triton(kernel["name"], source)
    launcher = launcher.result() if hasattr(launcher, "result") else launcher
    return lambda *args, **kwargs: launcher.run(
        *args, **kwargs, stream=torch.cuda.current_stream().cuda_stream
    )


def written(kernel: dict, args: list, kwargs: dict) -> list:
    """What a kernel call wrote: its non-const pointers, or an extern kernel's out=."""
    if kernel["kind"] == "extern":
        return [kwargs["out"]]
    return [args[i] for i in kernel["written"]]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    word = WORDS.get(tensor.element_size())
    return tensor.view(word) if word is not None and tensor.dtype != word else tensor


def differs(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return not (
            isinstance(got, torch.Tensor)
            and got.shape == want.shape
            and got.dtype == want.dtype
            and torch.equal(bits(got), bits(want))
        )
    return got != want


def describe(output: int, got, want) -> str:
    """The first mismatching element: flat index, expected and actual values and raw bits, XOR
    mask."""
    if (
        not isinstance(want, torch.Tensor)
        or not isinstance(got, torch.Tensor)
        or got.shape != want.shape
    ):
        return f"output {output}: expected {want!r}, got {got!r}"
    flat_want, flat_got = bits(want).reshape(-1).cpu(), bits(got).reshape(-1).cpu()
    index = int(torch.nonzero(flat_want != flat_got)[0])
    width = 2 * want.element_size()
    mask = (1 << (8 * want.element_size())) - 1
    word_want, word_got = int(flat_want[index]) & mask, int(flat_got[index]) & mask
    value_want, value_got = want.reshape(-1)[index].item(), got.reshape(-1)[index].item()
    position = list(np.unravel_index(index, tuple(want.shape))) if want.dim() else []
    return (
        f"output {output}, element {index} (position {[int(p) for p in position]}): "
        f"expected {value_want!r} (0x{word_want:0{width}x}), "
        f"actual {value_got!r} (0x{word_got:0{width}x}), "
        f"XOR mask 0x{word_want ^ word_got:0{width}x}"
    )


def main() -> int:
    options = parse_args()
    try:
        return reproduce(options)
    except CannotRun as exc:
        print(f"Error: {exc}\nHint: {exc.hint}", file=sys.stderr)
        return 3


@dataclass
class Case:
    """What inputs.h5 holds: the operator, its inputs, the expected outputs, the generator
    states of a random operator, and the drill's injection (or None)."""

    op_name: str
    inputs: dict
    expected: list
    rng: dict | None
    inject: Callable | None
    kernel: dict | None = None  # a compiled kernel: name, kind, argument types, written


def read_case(options: argparse.Namespace) -> Case:
    try:
        handle = h5py.File(INPUTS, "r")
    except OSError as exc:
        why = str(exc) if INPUTS.exists() else "there is no such file"
        raise CannotRun(
            f"cannot read {INPUTS}: {why}", "Keep repro.py beside the ticket's inputs.h5."
        ) from None
    with handle:
        apply_switches(json.loads(handle.attrs["switches"]))
        kernel = json.loads(handle.attrs["kernel"]) if "kernel" in handle.attrs else None
        return Case(
            handle.attrs["op"],
            read_tree(handle["reference_inputs"]),
            read_tree(handle["reference_outputs"]),
            read_tree(handle["rng"]) if "rng" in handle else None,
            optional_injection(options.device, handle, kernel),
            kernel,
        )


def reproduce(options: argparse.Namespace) -> int:
    device = torch_device(options.device)
    case = read_case(options)
    try:
        return run_trials(options, device, case)
    except RuntimeError as exc:  # the operator raised: this run says nothing about its bits
        first_line = (str(exc).splitlines() or [""])[0]
        raise CannotRun(
            f"{case.op_name} raised on {options.device}: {type(exc).__name__}: {first_line}",
            "A CUDA error here can itself be the defect: keep this output with the ticket.",
        ) from None


def run_trials(options: argparse.Namespace, device: torch.device, case: Case) -> int:
    """Run the operator ``options.trials`` times; 1 if any output differed, else 0."""
    op_name, inputs, expected, rng, inject = (
        case.op_name, case.inputs, case.expected, case.rng, case.inject
    )  # fmt: skip
    if case.kernel is not None:
        return run_kernel_trials(options, device, case)
    op = resolve(op_name)
    args, kwargs = to_device((inputs["args"], inputs["kwargs"]), device)
    expected = to_device(expected, device)
    shapes = [list(t.shape) for t in args if isinstance(t, torch.Tensor)]
    print(
        f"{op_name} on {options.device} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
        f"inputs {shapes}, {options.trials} trials, torch {torch.__version__}"
    )
    failures, first = 0, None
    for trial in range(1, options.trials + 1):
        call_args, call_kwargs = (
            to_device((args, kwargs), device) if op._schema.is_mutable else (args, kwargs)
        )
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], device)
        out = op(*call_args, **call_kwargs)
        if inject is not None:
            inject(out)
        produced = results(op, call_args, out)
        wrong = [
            i for i, want in enumerate(expected) if i >= len(produced) or differs(produced[i], want)
        ]
        if wrong:
            failures += 1
            if first is None:
                index = wrong[0]
                got = produced[index] if index < len(produced) else None
                first = f"first failure at trial {trial}: {describe(index, got, expected[index])}"
    return verdict(failures, options.trials, first)


def verdict(failures: int, trials: int, first: str | None) -> int:
    print(f"failed {failures} of {trials}")
    if first:
        print(first)
    return 1 if failures else 0


def run_kernel_trials(options: argparse.Namespace, device: torch.device, case: Case) -> int:
    """Run the compiled kernel ``options.trials`` times on fresh copies of the recorded
    arguments (laid out as recorded: the kernel indexes memory with its own strides)."""
    assert case.kernel is not None
    kernel = compiled_kernel(case.kernel)
    expected = to_device(case.expected, device)
    print(
        f"{case.op_name} ({case.kernel['kind']} kernel, fusing "
        f"{', '.join(case.kernel['fused'])}) on {options.device}, {options.trials} trials, "
        f"torch {torch.__version__}"
    )
    failures, first = 0, None
    for trial in range(1, options.trials + 1):
        args, kwargs = to_device((case.inputs["args"], case.inputs["kwargs"]), device)
        kernel(*args, **kwargs)
        produced = written(case.kernel, args, kwargs)
        if case.inject is not None:
            case.inject(produced)
        wrong = [i for i, want in enumerate(expected) if differs(produced[i], want)]
        if wrong:
            failures += 1
            if first is None:
                index = wrong[0]
                wrong_output = describe(index, produced[index], expected[index])
                first = f"first failure at trial {trial}: {wrong_output}"
    return verdict(failures, options.trials, first)


if __name__ == "__main__":
    sys.exit(main())
