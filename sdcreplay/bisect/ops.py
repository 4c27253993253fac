"""Every operator call of a recorded step, named exactly as fault specs and bisect name them.

Writing a fault spec, or reading a bisect report against the model, needs the
step's calls as the dispatch mode sees them: in ``nn.MultiheadAttention`` the
output projection's matmul belongs to ``self_attn``, not ``self_attn.out_proj``.
The step is replayed once (with the steps before it, to reach its state) and
each call is listed with its position among calls of the same operator, module
and phase: the spec's ``nth``. A compiled step's Inductor kernel calls are listed too
(``kernels``: the generated name ``kernel=`` takes, the ATen operators fused, the outputs
``output=`` picks from).

On a job (``ops JOB --rank R --step N``) the listing runs in rank R's process, its peers
replaying their parts to serve the collectives as a job's bisect does (`rank.run_in_job`), or
with ``alone`` as rank R without peers (`alone.run_alone`: one process, whatever the job's
size); every spec then carries ``rank=R``, which is how ``replay JOB --inject`` and ``bisect
JOB --rank R --inject`` reach that rank's call.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from ..bundle.job_bundle import JobBundle, is_job_bundle, job_of_part
from ..bundle.reader import Bundle
from ..capture import comparable
from ..capture.compiled_kernels import KernelCall
from ..capture.faults import FaultSpec
from ..capture.layers import flatten_tensors
from ..capture.operators import CallSite
from ..errors import BundleError, SdcReplayError
from ..kinds import PhaseName
from ..replay.alone import check_alone
from ..replay.session import ReplaySession
from ..replay.worker import device_task
from ..storage.rundir import temporary_run_dir
from .alone import run_alone
from .rank import run_in_job

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

    def spec(self, step: int, rank: int | None = None) -> str:
        """A fault spec that selects exactly this call (on rank ``rank`` of a job)."""
        return (
            f"kind=bitflip,op={self.op},module={self.module},phase={self.phase},"
            f"step={step},nth={self.nth}" + _on_rank(rank)
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

    def spec(self, step: int, rank: int | None = None) -> str:
        """A fault spec that selects exactly this call (its first output, element 0; on rank
        ``rank`` of a job)."""
        return (
            f"kind=bitflip,kernel={self.kernel},phase={self.phase},step={step},nth={self.nth}"
            + _on_rank(rank)
        )


def _on_rank(rank: int | None) -> str:
    return "" if rank is None else f",rank={rank}"


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
    rank: int | None = None  # a job's rank whose calls these are (None: a single process)
    coordinates: str | None = None  # that rank in the job's mesh (`ParallelLayout.describe`)
    alone: bool = False  # listed as the rank without peers (its peers did not run)

    exit_code = 0

    def to_json(self) -> dict:
        job = (
            {"rank": self.rank, "coordinates": self.coordinates, "alone": self.alone}
            if self.rank is not None
            else {}
        )
        return {
            "schema": SCHEMA,
            "bundle": self.bundle,
            **job,
            "step": self.step,
            "device": self.device,
            "filters": self.filters,
            "total_calls": self.total_calls,
            "calls": [asdict(c) | {"spec": c.spec(self.step, self.rank)} for c in self.calls],
            "kernels": [asdict(k) | {"spec": k.spec(self.step, self.rank)} for k in self.kernels],
        }


def _selected(call: Call, phase: str | None, module: str | None, op: str | None) -> bool:
    probe = FaultSpec(kind="bitflip", op=op or call.op, module=module, phase=phase)
    return probe.matches_key(call.op, call.module, call.phase)


def list_calls(
    bundle: str | Path,
    step: int,
    *,
    device: str | None = None,
    phase: str | None = None,
    module: str | None = None,
    op: str | None = None,
    rank: int | None = None,
    alone: bool = False,
) -> OpsListing:
    """The calls of ``step`` (``sdcreplay.ops/1``), filtered as a fault spec's keys would select
    them. A job's (``rank``, or a rank's part given as ``bundle``): rank ``rank``'s calls, on
    ``device`` (default: its recorded device; a single process's: ``cpu``)."""
    job, rank = _job_and_rank(Path(bundle), rank, step, alone)
    if job is None:
        device = device or "cpu"
        path, coordinates = str(Bundle.open(bundle, verify=False).path), None
        calls, kernels = _step_calls(path, step, device)
    else:
        assert rank is not None
        device = device or job.ranks[rank].device
        calls, kernels = _rank_calls(job, rank, step, device, alone)
        path, coordinates = str(job.path), _coordinates(job, rank)
    return OpsListing(
        path,
        step,
        device,
        {"phase": phase, "module": module, "op": op},
        len(calls),
        [call for call in calls if _selected(call, phase, module, op)],
        [k for k in kernels if _kernel_selected(k, phase, module, op)],
        rank,
        coordinates,
        alone,
    )


def _step_calls(bundle: str, step: int, device: str) -> tuple[list[Call], list[KernelEntry]]:
    """Replay up to ``step`` in this process; every call of that step, and its kernel calls."""
    session = ReplaySession(bundle, device)
    try:
        _require_step(session.bundle, step)
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
    return lister.calls, kernels.calls


def _require_step(bundle: Bundle, step: int) -> None:
    if step not in bundle.step_indices:
        raise BundleError(
            f"the bundle has no step {step} (it has {bundle.step_indices})",
            "Pick one of the recorded steps (`sdcreplay info BUNDLE`).",
        )


@device_task
def run_ops_task(device: str, bundle: str, step: int) -> dict:
    """In rank R's process of a job (among its peers, or alone): the step's calls."""
    calls, kernels = _step_calls(bundle, step, device)
    return {"calls": [asdict(c) for c in calls], "kernels": [asdict(k) for k in kernels]}


def _rank_calls(
    job: JobBundle, rank: int, step: int, device: str, alone: bool
) -> tuple[list[Call], list[KernelEntry]]:
    """Rank ``rank``'s calls of ``step``, listed in its own process (module docstring)."""
    part = job.rank(rank)
    _require_step(part, step)
    run = partial(
        run_alone if alone else run_in_job,
        job=job,
        rank=rank,
        environment=comparable.pinned_environment(part.manifest.fingerprint),
    )
    work = temporary_run_dir("ops")
    value = run("ops", run_ops_task, device, {"bundle": part.path, "step": step}, work=work)
    shutil.rmtree(work, ignore_errors=True)  # kept where a rank failed: its error names its logs
    return [Call(**c) for c in value["calls"]], [KernelEntry(**k) for k in value["kernels"]]


def _job_and_rank(
    path: Path, rank: int | None, step: int, alone: bool
) -> tuple[JobBundle | None, int | None]:
    """The job whose rank is listed (a rank's part names its job and rank), or None."""
    if not is_job_bundle(path) and rank is None:
        part = Bundle.open(path, verify=False)
        job_path = job_of_part(part)
        if job_path is not None and part.manifest.distributed is not None:
            path, rank = job_path, part.manifest.distributed.rank
        elif not alone:
            return None, None
    if not is_job_bundle(path):
        raise SdcReplayError(
            f"--rank and --alone are for a job bundle (record --nproc); {path} is a single "
            "process's bundle",
            f"Leave them out: `sdcreplay ops {path} --step {step}`.",
            python_hint="Pass rank=None, alone=False.",
        )
    job = JobBundle.open(path)
    if rank is None and job.world_size == 1:  # a one-process torchrun run
        rank = 0
    if rank is None or not 0 <= rank < job.world_size:
        raise SdcReplayError(
            f"{path} is a job of {job.world_size} ranks: say whose calls to list"
            + ("" if rank is None else f" (it has no rank {rank})"),
            f"`sdcreplay ops {path} --rank R --step {step}`, R in 0..{job.world_size - 1} "
            "(e.g. the origin_rank `sdcreplay replay` named).",
            python_hint=f"Pass rank=R, R in 0..{job.world_size - 1}.",
        )
    if alone:
        check_alone(job, rank)
    return job, rank


def _coordinates(job: JobBundle, rank: int) -> str | None:
    return None if job.layout is None else job.layout.where(rank)


def _kernel_selected(entry: KernelEntry, phase: str | None, module: str | None, op: str | None):
    """``op`` selects the kernels that fused it (``aten.gelu``: every kernel with a gelu)."""
    probe = FaultSpec(kind="bitflip", kernel=entry.kernel, module=module, phase=phase)
    fused = op is None or any(f == op or f == op.rsplit(".", 1)[0] for f in entry.fused)
    return fused and probe.matches_kernel(entry.kernel, entry.module, entry.phase)
