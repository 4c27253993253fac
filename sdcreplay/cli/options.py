"""The command line's options, declared once: a flag shared by several commands reads and
parses the same in each (its name, its help, what it accepts).

A usage error here is typer's ``BadParameter`` (exit 2), raised before any library call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

BundleArg = Annotated[Path, typer.Argument(help="Bundle directory.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
InjectOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--inject", help="Fault spec to inject (repeatable); see docs/fault-injection.md."
    ),
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="Device label: cpu, cpu:N (a virtual replica) or cuda:N.")
]
ReferenceOpt = Annotated[str | None, typer.Option("--reference", help="Device label you trust.")]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Directory to write (its default is in the command's description)."),
]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace what is already at --out (a bundle, report or ticket sdcreplay wrote): "
        "the old one is moved aside to NAME.old-<time>-<pid>-<random>, never deleted.",
    ),
]
NoLedgerOpt = Annotated[
    bool,
    typer.Option(
        "--no-ledger",
        help="Do not append the verdict to the device ledger (SDCREPLAY_LEDGER; docs/fleet.md).",
    ),
]
TrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-workload",
        help="Run the workload the bundle names even though it was not recorded "
        "by you (it is code: read it first). Built-in workloads and your own bundles need no flag.",
    ),
]
TrustedWorkloadOpt = Annotated[
    str | None,
    typer.Option(
        "--workload", help="Trust this workload reference (it must be the one the bundle names)."
    ),
]


def trusting(bundle: Path, trust_workload: bool, workload: str | None):
    """Trust, while the command runs, the references given on its command line (reading the
    bundle runs nothing)."""
    from ..bundle.job_bundle import JobBundle, is_job_bundle
    from ..bundle.reader import Bundle
    from ..bundle.trust import granting

    refs = [workload] if workload else []
    if trust_workload and is_job_bundle(bundle):
        refs.append(JobBundle.open(bundle, verify=False).manifest.workload.ref)
    elif trust_workload:
        refs.append(Bundle.open(bundle, verify=False).workload_ref)
    return granting(refs)


WHAT_PATHS_ARE = {
    "bundle": "Give the directory `sdcreplay record --out` wrote.",
    "report": "Pass the report directory written by `sdcreplay bisect --out`.",
    "corpus": "Give the directory `sdcreplay corpus add CORPUS TICKET...` made.",
    "ticket": "Give a ticket directory `sdcreplay minimize` wrote (its --out).",
    "checkpoint": "Give the torch.save'd file (or checkpoint directory) to start from.",
    "workload file": "Name a workload as path/to/file.py:function with a file that exists.",
    "log": "Give a bundle directory or a replay log (*.sig.zst).",
}
"""What each kind of path a command reads is, said when one is missing."""


def require_paths(paths: dict[str, Iterable[Path | None]]) -> None:
    """Refuse a path that does not exist (``kind -> paths``; a bundle's ``.partial`` twin
    stands for it, as the reader takes it), before torch is imported: a typo costs a second."""
    from ..errors import BundleError, CheckpointError, ReportError, SdcReplayError, WorkloadError

    errors = {
        "bundle": BundleError,
        "report": ReportError,
        "checkpoint": CheckpointError,
        "workload file": WorkloadError,
    }
    for kind, given in paths.items():
        for path in given:
            if path is None or os.path.lexists(path):
                continue
            if kind == "bundle" and os.path.lexists(f"{path}.partial"):
                continue
            raise errors.get(kind, SdcReplayError)(
                f"the {kind} {str(path)[:300]} does not exist", WHAT_PATHS_ARE[kind]
            )


def workload_file(reference: str) -> Path | None:
    """The file a ``path/to/file.py:function`` reference names (None for the other forms)."""
    target = reference.rpartition(":")[0]
    return Path(target) if target.endswith(".py") else None


def preflight(
    inject: list[str] | None = None,
    devices: Iterable[str | None] = (),
    paths: dict[str, Iterable[Path | None]] | None = None,
) -> None:
    """Refuse a fault spec that does not parse (``--inject`` and ``SDCREPLAY_INJECT``), a
    device this machine cannot have and a path that does not exist, before the command imports
    torch or starts a device process: a typo costs a second, not a run. Exit 3 with
    Error/Hint, as the library would."""
    from ..capture.fault_spec import parse_specs
    from ..devices import require_available

    specs = parse_specs(inject or [])
    for label in devices:
        if label is not None:
            require_available(label)
    require_paths(paths or {})
    if specs:  # an operator's name needs torch's registry: checked last, and only then
        from ..capture.faults import check_operators

        check_operators(specs)


class DumpOn(str, Enum):
    """What may write a ring buffer's bundle (`record --ring K --dump-on ...`)."""

    update = "update"
    replay = "replay"
    end = "end"


class Signature(str, Enum):
    """What a recorded step's signature log holds (`record --signature`)."""

    layer = "layer"
    boundary = "boundary"


def parse_kwargs(pairs: list[str]) -> dict:
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--arg")
        try:
            kwargs[key] = json.loads(value)
        except ValueError:
            kwargs[key] = value
    return kwargs


def _seed_in_range(seed: int) -> int:
    """torch.manual_seed takes [-2**63, 2**64 - 1]: a larger seed is a usage error, not an
    overflow."""
    if not -(2**63) <= seed <= 2**64 - 1:
        raise typer.BadParameter(f"{seed} is outside [-2**63, 2**64 - 1], the seeds torch accepts")
    return seed


SameBatchOpt = Annotated[
    bool,
    typer.Option(
        "--same-batch",
        help="Job bundles, phase 1 at scale: one replay of the whole job, every data-parallel "
        "group fed one rank's batches; the peers vote (docs/at-scale.md).",
    ),
]
FromRankOpt = Annotated[
    int | None,
    typer.Option(
        "--from-rank",
        min=0,
        help="With --same-batch: whose batches every group is fed (default: the rank an "
        "alarm named, else 0).",
    ),
]
KeepStateOpt = Annotated[
    Path | None,
    typer.Option(
        "--keep-state",
        help="With --same-batch: write the state entering the first divergent step into this "
        "new directory (a torch.distributed.checkpoint, and the files --from-state reads).",
    ),
]
FromStateOpt = Annotated[
    Path | None,
    typer.Option(
        "--from-state",
        help="With --alone: start at a state `replay --same-batch --keep-state` kept, not at "
        "the window's start.",
    ),
]
AloneRankOpt = Annotated[
    int | None,
    typer.Option("--rank", min=0, help="With --alone: the rank to replay without its peers."),
]
AloneOpt = Annotated[
    bool,
    typer.Option(
        "--alone",
        help="Phase 2 at scale: rank R's group replays without its data-parallel peers, once "
        "per --device (docs/at-scale.md).",
    ),
]
InfoRankOpt = Annotated[
    int | None,
    typer.Option(
        "--rank",
        min=0,
        help="For a job bundle: describe rank R's part (its place in the mesh, steps, entries "
        "and messages), as info JOB/ranks/00000R does.",
    ),
]
OpsRankOpt = Annotated[
    int | None,
    typer.Option(
        "--rank",
        min=0,
        help="For a job bundle: the rank whose calls to list (its specs get rank=R). It runs on "
        "--device while the other ranks replay on their recorded devices to serve the "
        "collectives.",
    ),
]
OpsAloneOpt = Annotated[
    bool,
    typer.Option(
        "--alone",
        help="With --rank: list rank R's calls in one process without its peers, as "
        "`replay --rank R --alone` runs it (docs/at-scale.md).",
    ),
]
OpsDeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="Device label: cpu, cpu:N (a virtual replica) or cuda:N. Default: cpu, or a job "
        "rank's recorded device.",
    ),
]
NnodesOpt = Annotated[
    int | None,
    typer.Option(
        "--nnodes",
        min=1,
        help="Job bundles across nodes: the number of nodes, each started with the same command "
        "and its own --node-rank (torchrun's; docs/at-scale.md).",
    ),
]
NprocPerNodeOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc-per-node", min=1, help="With --nnodes: ranks per node (-d gives their devices)."
    ),
]
RdzvEndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--rdzv-endpoint",
        help="With --nnodes: HOST:PORT of node 0, which hosts torch's c10d rendezvous store.",
    ),
]
NodeRankOpt = Annotated[
    int | None,
    typer.Option(
        "--node-rank",
        min=0,
        help="With --nnodes: this node, 0..K-1 (default 0); it runs ranks R*P..R*P+P-1, and "
        "node 0 prints the report.",
    ),
]
RdzvTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--rdzv-timeout",
        min=1,
        help="With --nnodes: seconds to wait for every node to arrive (default 900, torchrun's).",
    ),
]
