"""A job bundle's replays, dispatched from the replay command: replica after replica,
``--same-batch`` and ``--rank R --alone`` (the two phases of judging a large job), and either
of the first two across nodes (``--nnodes``; docs/at-scale.md)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from ..errors import SdcReplayError
from .output import Output


def at_scale_replay(
    output: Output,
    bundle: Path,
    device: list[str] | None,
    inject: list[str] | None,
    logs: Path | None,
    timeout: float | None,
    trust: AbstractContextManager,
    ledger: bool,
    *,
    same_batch: bool,
    from_rank: int | None,
    rank: int | None,
    alone: bool,
    keep_state: Path | None = None,
    from_state: Path | None = None,
):
    """Phase 1 (``--same-batch``) or phase 2 (``--rank R --alone``) on a job bundle."""
    from ..bundle.job_bundle import is_job_bundle

    if not is_job_bundle(bundle):
        raise SdcReplayError(
            f"--same-batch, --from-rank, --rank and --alone are for a job bundle; {bundle} is a "
            "single process's bundle",
            "Leave them out: a single process is replayed on each --device as it is.",
        )
    if same_batch == (alone or rank is not None) or (alone != (rank is not None)):
        raise SdcReplayError(
            "give either --same-batch [--from-rank R] (phase 1) or --rank R --alone (phase 2)",
            "Phase 1 judges every rank in one replay; phase 2 replays one rank's group alone "
            "(docs/at-scale.md).",
        )
    if (from_rank is not None or keep_state is not None) and not same_batch:
        raise SdcReplayError(
            "--from-rank and --keep-state are for --same-batch", "Add --same-batch."
        )
    if from_state is not None and not alone:
        raise SdcReplayError("--from-state is for --rank R --alone", "Add --rank R --alone.")
    with trust, output.stages() as progress:
        if same_batch:
            from ..replay.same_batch import replay_same_batch

            stage, note = "replaying the job on one batch", "every rank at once"
            progress.update(stage, 0, 1, note)
            report: object = replay_same_batch(
                bundle, device, from_rank=from_rank, inject=inject or [], log_dir=logs,
                timeout=timeout, ledger=ledger, keep_state=keep_state,
            )  # fmt: skip
        else:
            from ..replay.alone import replay_alone

            assert rank is not None
            stage, note = "replaying one rank alone", ", ".join(device or [])
            progress.update(stage, 0, 1, note)
            report = replay_alone(
                bundle, rank, device or [], inject=inject or [], log_dir=logs, timeout=timeout,
                ledger=ledger, from_state=from_state,
            )  # fmt: skip
        progress.update(stage, 1, 1, note)  # the line a log keeps says the stage is done
        return report


def job_replay(output: Output, bundle, device, repeats, inject, logs, timeout, trust, ledger):
    """Replay a job bundle, replica after replica (docs/distributed.md)."""
    from ..bundle.job_bundle import JobBundle
    from ..replay.job import replay_job

    replicas = max(1, len(device or []) // JobBundle.open(bundle, verify=False).world_size)
    with trust, output.stages() as progress:
        first = ", ".join(device[: len(device) // replicas]) if device else "recorded devices"
        progress.update("replaying the job's replicas", 0, replicas, first)
        return replay_job(
            bundle,
            device,
            repeats=repeats,
            inject=inject or [],
            log_dir=logs,
            timeout=timeout,
            on_done=lambda index, labels: progress.update(
                "replaying the job's replicas", index + 1, replicas, ", ".join(labels)
            ),
            ledger=ledger,
        )


def placement(
    bundle: Path,
    nnodes: int | None,
    nproc_per_node: int | None,
    endpoint: str | None,
    node_rank: int | None,
    rdzv_timeout: float | None,
):
    """This launch's place in a replay across nodes (`rendezvous.Nodes`)."""
    from ..bundle.job_bundle import is_job_bundle
    from ..replay.rendezvous import RDZV_TIMEOUT, Nodes

    if nnodes is None or nproc_per_node is None or endpoint is None:
        raise SdcReplayError(
            "--nnodes, --nproc-per-node and --rdzv-endpoint go together (--node-rank and "
            "--rdzv-timeout with them)",
            "Give all three, the same on every node (and each node its own --node-rank).",
        )
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SdcReplayError(
            f"--rdzv-endpoint {endpoint!r} is not HOST:PORT",
            "Give node 0's address and a free TCP port, e.g. --rdzv-endpoint node0:29500.",
        )
    if not is_job_bundle(bundle):
        raise SdcReplayError(
            f"--nnodes is for a job bundle; {bundle} is a single process's bundle",
            "Leave out --nnodes, --nproc-per-node and --rdzv-endpoint.",
        )
    return Nodes(nnodes, nproc_per_node, endpoint, node_rank or 0, rdzv_timeout or RDZV_TIMEOUT)


def nodes_replay(
    output: Output, bundle: Path, nodes, device: list[str] | None, repeats: int,
    inject: list[str] | None, logs: Path | None, timeout: float | None,
    trust: AbstractContextManager, ledger: bool, same_batch: bool, from_rank: int | None,
    incompatible: bool,
):  # fmt: skip
    """This node's part of a replay across nodes: node 0's report, the others' `NodeReport`."""
    from ..replay.nodes import replay_on_nodes

    if incompatible:
        raise SdcReplayError(
            "--rank, --alone, --keep-state and --from-state do not run across nodes yet",
            "Replay phase 2 (--rank R --alone) on one host, or leave out --nnodes.",
        )
    if from_rank is not None and not same_batch:
        raise SdcReplayError("--from-rank is for --same-batch", "Add --same-batch.")
    stage = f"replaying node {nodes.node_rank}'s ranks of {nodes.nnodes} nodes"
    with trust, output.stages() as progress:
        progress.update(stage, 0, 1, ", ".join(device or []))
        report = replay_on_nodes(
            bundle, nodes, device, same_batch=same_batch, from_rank=from_rank, repeats=repeats,
            inject=inject or [], log_dir=logs, timeout=timeout, ledger=ledger,
        )  # fmt: skip
        progress.update(stage, 1, 1, ", ".join(device or []))
        return report
