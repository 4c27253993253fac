"""The device kernels one operator call launches, named by the profiler.

An aten op name says what was asked; the kernel name says which implementation ran, what a
driver or vendor report needs. Bisect's isolated re-run and minimize both ask; the
profiler of each device type is a table (`KERNEL_PROFILERS`) so a test can stand one in on
a CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .operator_case import OperatorCase, place


def _cuda_profile(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA])


KERNEL_PROFILERS: dict[str, Callable] = {"cuda": _cuda_profile}
"""Device type -> a profiler context for one call (its ``events()`` name the kernels)."""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_names(op, case: OperatorCase, device: torch.device) -> list[str]:
    """The device kernels one call launches, from the profiler (none on a CPU)."""
    profiler = KERNEL_PROFILERS.get(device.type)
    if profiler is None:
        return []
    args, kwargs = place((list(case.args), case.kwargs), device)
    _synchronize(device)
    with profiler(device) as prof:
        op(*args, **kwargs)
        _synchronize(device)
    return device_kernels(prof.events())


def device_kernels(events) -> list[str]:
    """Names of the profiler events that ran on the device (CUDA activity), in order, once each."""
    names: list[str] = []
    for event in events:
        if event.device_type.name == "CUDA" and event.name not in names:
            names.append(event.name)
    return names
