"""Every operator call of a recorded step, named exactly as fault specs and bisect name them.

Writing a fault spec, or reading a bisect report against the model, needs the
step's calls as the dispatch mode sees them: in ``nn.MultiheadAttention`` the
output projection's matmul belongs to ``self_attn``, not ``self_attn.out_proj``.
The step is replayed once (with the steps before it, to reach its state) and
each call is listed with its position among calls of the same operator, module
and phase: the spec's ``nth``. A compiled step's Inductor kernel calls are listed too
(``kernels``: the generated name ``kernel=`` takes, the ATen operators fused, the outputs
``output=`` picks from).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..capture.compiled_kernels import KernelCall
from ..capture.faults import FaultSpec
from ..capture.layers import flatten_tensors
from ..capture.operators import CallSite
from ..errors import BundleError
from ..kinds import PhaseName
from ..replay.session import ReplaySession

SCHEMA = "sdcreplay.ops/1"


@dataclass
class Call:
    index: int  # position among all calls of the step (bisect's op_index)
    phase: PhaseName
    module: str
    op: str
    nth: int  # position among the step's calls with the same op, module and phase
    outputs: list[dict]  # shape and dtype of each output tensor
    recompute: bool = False  # the forward run again in backward (activation checkpointing)

    def spec(self, step: int) -> str:
        """A fault spec that selects exactly this call."""
        return (
            f"kind=bitflip,op={self.op},module={self.module},phase={self.phase},"
            f"step={step},nth={self.nth}"
        )


class _Lister:
    """An OperatorMode observer that keeps every call's site and output layout."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._counts: Counter[tuple[str, str, str]] = Counter()

    def on_call(self, site: CallSite, func, args, kwargs, out):
        nth = self._counts[site.key]
        self._counts[site.key] += 1
        outputs = [
            {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for t in flatten_tensors(out)
        ]
        call = Call(site.index, site.phase, site.module, site.op, nth, outputs, site.recompute)
        self.calls.append(call)
        return out


@dataclass
class KernelEntry:
    """One Inductor kernel call of a compiled step (``kernel=`` fault specs name it)."""

    index: int  # position among the step's kernel calls
    phase: str
    module: str  # the module the compiled region ran under
    graph: str  # the compiled graph, e.g. 0_forward
    kernel: str  # its generated name
    nth: int  # position among the step's calls of this kernel
    fused: list[str]  # the ATen operators it was generated from
    outputs: list[dict]  # shape and dtype of each tensor it writes (output=)

    def spec(self, step: int) -> str:
        """A fault spec that selects exactly this call (its first output, element 0)."""
        return f"kind=bitflip,kernel={self.kernel},phase={self.phase},step={step},nth={self.nth}"


class _KernelLister:
    """A kernel observer that keeps every kernel call's site and output layout."""

    def __init__(self) -> None:
        self.calls: list[KernelEntry] = []

    def on_kernel(self, call: KernelCall) -> None:
        site = call.site
        outputs = [
            {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for t in call.outputs
        ]
        self.calls.append(
            KernelEntry(
                site.index,
                site.phase,
                site.module,
                site.graph,
                site.kernel,
                site.nth,
                list(call.kernel.fused),
                outputs,
            )
        )


@dataclass
class OpsListing:
    """A step's operator calls, filtered (``sdcreplay.ops/1``)."""

    bundle: str
    step: int
    device: str
    filters: dict[str, str | None]  # phase, module, op as given
    total_calls: int  # calls of the step before filtering
    calls: list[Call]
    kernels: list[KernelEntry] = field(default_factory=list)  # compiled code's kernel calls

    exit_code = 0

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "bundle": self.bundle,
            "step": self.step,
            "device": self.device,
            "filters": self.filters,
            "total_calls": self.total_calls,
            "calls": [asdict(call) | {"spec": call.spec(self.step)} for call in self.calls],
            "kernels": [asdict(k) | {"spec": k.spec(self.step)} for k in self.kernels],
        }


def _selected(call: Call, phase: str | None, module: str | None, op: str | None) -> bool:
    probe = FaultSpec(kind="bitflip", op=op or call.op, module=module, phase=phase)
    return probe.matches_key(call.op, call.module, call.phase)


def list_calls(
    bundle: str | Path,
    step: int,
    *,
    device: str = "cpu",
    phase: str | None = None,
    module: str | None = None,
    op: str | None = None,
) -> OpsListing:
    """The calls of ``step`` (``sdcreplay.ops/1``), filtered as a fault spec's keys would select
    them."""
    session = ReplaySession(bundle, device)
    try:
        if step not in session.bundle.step_indices:
            raise BundleError(
                f"the bundle has no step {step} (it has {session.bundle.step_indices})",
                "Pick one of the recorded steps (`sdcreplay info BUNDLE`).",
            )
        lister, kernels = _Lister(), _KernelLister()
        for record in session.steps_until(step):
            chosen = record.index == step
            session.run_step(
                record,
                observers=[lister] if chosen else (),
                kernel_observers=[kernels] if chosen else (),
            )
    finally:
        session.close()
    calls = [call for call in lister.calls if _selected(call, phase, module, op)]
    return OpsListing(
        str(session.bundle.path),
        step,
        device,
        {"phase": phase, "module": module, "op": op},
        len(lister.calls),
        calls,
        [k for k in kernels.calls if _kernel_selected(k, phase, module, op)],
    )


def _kernel_selected(entry: KernelEntry, phase: str | None, module: str | None, op: str | None):
    """``op`` selects the kernels that fused it (``aten.gelu``: every kernel with a gelu)."""
    probe = FaultSpec(kind="bitflip", kernel=entry.kernel, module=module, phase=phase)
    fused = op is None or any(f == op or f == op.rsplit(".", 1)[0] for f in entry.fused)
    return fused and probe.matches_kernel(entry.kernel, entry.module, entry.phase)
