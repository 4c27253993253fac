"""Bisect's comparison at the kernel level: every Inductor kernel call's output digests, in
order, compared with a reference's as the step runs, and the first call that differs kept with
its inputs as they were before it ran (`compiled_kernels` sees the calls)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .compiled_kernels import Kernel, KernelCall, KernelSite, digests
from .operators import _own_work


@dataclass
class KernelRecord:
    site: KernelSite
    digests: list[str]  # one per tensor the call wrote


def records_to_json(records: Sequence[KernelRecord]) -> list:
    return [
        [r.site.phase, r.site.module, r.site.graph, r.site.kernel, r.site.nth, r.digests]
        for r in records
    ]


def records_from_json(rows: list, step: int) -> list[KernelRecord]:
    return [
        KernelRecord(KernelSite(step, phase, module, graph, kernel, index, nth), digests)
        for index, (phase, module, graph, kernel, nth, digests) in enumerate(rows)
    ]


def cpu_copy(value: Any) -> Any:
    """A CPU copy of a kernel argument in the same layout (the kernel reads memory with the
    strides it was generated for); numbers as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    with _own_work():
        value = value.detach()
        try:
            copy = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype)
            return copy.copy_(value)
        except RuntimeError:  # overlapping strides (an expand): a dense copy
            return value.to("cpu", copy=True)


def _blank(value: Any) -> Any:
    """What a call is given to write only (``out_ptr``): memory it never reads, whose contents
    before the call are whatever the allocator left; kept zeroed, the same on every device."""
    if not isinstance(value, torch.Tensor):
        return value
    with _own_work():
        return torch.zeros_like(cpu_copy(value))


def placed(value: Any, device: torch.device) -> Any:
    """A fresh copy of a kept argument on ``device``, in the same layout."""
    if not isinstance(value, torch.Tensor):
        return value
    copy = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=device)
    return copy.copy_(value)


def call_arguments(call: KernelCall) -> tuple[list, dict]:
    """What a re-run needs besides the kernel: its arguments, and keyword arguments without the
    launching stream (a re-run launches on the current one)."""
    return list(call.args), {k: v for k, v in call.kwargs.items() if k != "stream"}


class KernelLog:
    """A `KernelObserver`: a digest of every kernel call's outputs, in order.

    Given a reference device's records (``expected``), it compares as the step runs: the
    first call whose kernel differs is a structure error (other generated code, never a
    verdict on a device), the first whose outputs differ is kept with its inputs as they were
    before it ran (it may write into them: ``in_out_ptr``); given ``watch``, it keeps that
    call.
    """

    def __init__(self, expected: list[KernelRecord] | None = None, watch: int | None = None):
        self.records: list[KernelRecord] = []
        self.expected, self.watch = expected, watch
        self.structure_error: str | None = None
        self.divergent: KernelRecord | None = None
        self.kept: tuple[list, dict, list] | None = None  # args, kwargs, outputs on the CPU
        self.kernel: Kernel | None = None  # the kept call's kernel
        self.site: KernelSite | None = None  # ... and its site
        self.prior: Counter = Counter()  # (kernel, module, phase) -> calls before the kept one
        self._before: dict[int, Any] = {}

    def _keeping(self, call: KernelCall) -> bool:
        return self.kept is None and (
            (self.expected is not None and self.structure_error is None)
            or call.site.index == self.watch
        )

    def before_kernel(self, call: KernelCall) -> None:
        self._before = {}
        if self._keeping(call):
            # only what the call writes changes under it
            kernel = call.kernel
            self._before = {
                i: cpu_copy(call.args[i]) if kernel.reads(i) else _blank(call.args[i])
                for i in kernel.written
                if i < len(call.args)
            }
            out = call.kwargs.get("out")
            if isinstance(out, torch.Tensor):  # an extern kernel's out= is only written
                self._before[-1] = _blank(out)

    def on_kernel(self, call: KernelCall) -> None:
        site = call.site
        record = KernelRecord(site, digests(call))
        self.records.append(record)
        if not self._keeping(call):
            return
        if self.expected is None:
            self._keep(call)
            return
        theirs = self.expected[site.index] if site.index < len(self.expected) else None
        if theirs is None or theirs.site.kernel != site.kernel:
            self.structure_error = (
                f"kernel call {site.index}: {site.kernel} ({site.phase}) here, "
                + (
                    f"{theirs.site.kernel} ({theirs.site.phase}) on the reference"
                    if theirs
                    else "nothing on the reference"
                )
            )
        elif record.digests != theirs.digests:
            self.divergent = record
            self._keep(call)

    def _keep(self, call: KernelCall) -> None:
        args, kwargs = call_arguments(call)
        before = self._before
        inputs = [before[i] if i in before else cpu_copy(v) for i, v in enumerate(args)]
        kept = {
            k: before[-1] if k == "out" and -1 in before else cpu_copy(v) for k, v in kwargs.items()
        }
        self.kept = (inputs, kept, [cpu_copy(t) for t in call.outputs])
        self.kernel, self.site = call.kernel, call.site
        self.prior = Counter(
            (r.site.kernel, r.site.module, r.site.phase) for r in self.records[:-1]
        )

    def missing_calls(self) -> str | None:
        """The first reference call the suspect never made, when its calls were a strict prefix."""
        made = len(self.records)
        if self.expected is None or self.divergent is not None or made >= len(self.expected):
            return None
        theirs = self.expected[made].site
        return (
            f"kernel call {made}: nothing here, {theirs.kernel} ({theirs.phase}) on the reference"
        )


class KernelCount:
    """A `KernelObserver` that counts the calls: did the step run compiled code at all?"""

    def __init__(self) -> None:
        self.calls = 0

    def on_kernel(self, call: KernelCall) -> None:
        self.calls += 1
