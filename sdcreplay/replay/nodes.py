"""A job replayed across nodes: ``sdcreplay replay JOB --nnodes K --nproc-per-node P
--rdzv-endpoint HOST:PORT --node-rank R [-d LABEL ...] [--same-batch]``, started once per node
(by hand, by ``srun``, by a Kubernetes indexed Job; docs/at-scale.md).

Each launch runs its node's P ranks (R*P .. R*P+P-1) under torch's elastic agent and c10d
rendezvous (`rendezvous`), the replay being the one a single host runs (`job.replay_job`,
`same_batch.replay_same_batch`); node 0 gathers what every rank found through the
rendezvous store, makes the report, writes the ledger's records once, and tells the others
its verdict: every node exits with its code. The job bundle is read at the same path on
every node (each node its own copy); nothing else is shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..bundle.job_bundle import JobBundle
from ..devices import validate_label
from ..errors import DeviceError, SdcReplayError
from ..ledger.identity import identify
from . import rendezvous
from .job import replay_job, require_own_gpus
from .job_report import JobReplayReport
from .rendezvous import NodeError, NodeLink, Nodes, NotReporting
from .same_batch import SameBatchReport, replay_same_batch


@dataclass
class NodeReport:
    """What a node other than node 0 says (``sdcreplay.replay-node/1``): its ranks and devices,
    and the verdict node 0 reached, whose exit code it exits with."""

    bundle: str
    nodes: Nodes
    devices: list[str]
    verdict: str
    exit_code: int

    def to_json(self) -> dict:
        return {
            "schema": "sdcreplay.replay-node/1",
            "bundle": self.bundle,
            "node_rank": self.nodes.node_rank,
            "nnodes": self.nodes.nnodes,
            "ranks": list(self.nodes.local_ranks),
            "devices": self.devices,
            "reported_by": 0,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
        }


def local_labels(job: JobBundle, nodes: Nodes, devices: Sequence[str] | None) -> list[str]:
    """This node's device per local rank: the ``-d`` labels, else ``KIND:LOCAL_RANK`` of the
    recorded device kind."""
    size = nodes.nproc_per_node
    if not devices:
        kind = job.ranks[0].device.split(":")[0]
        return [f"{kind}:{local}" for local in range(size)]
    labels = [validate_label(label) for label in devices]
    if len(labels) != size:
        raise DeviceError(
            f"{len(labels)} device labels for --nproc-per-node {size}",
            f"Give this node's {size} devices (-d LABEL once per local rank, local rank 0 "
            "first), or none for cpu:0.. / cuda:0.. .",
        )
    require_own_gpus(labels)
    return labels


def check_nodes(job: JobBundle, nodes: Nodes) -> None:
    if nodes.world_size != job.world_size:
        raise NodeError(
            f"--nnodes {nodes.nnodes} x --nproc-per-node {nodes.nproc_per_node} is "
            f"{nodes.world_size} ranks; the job has {job.world_size}",
            "Give K nodes of P ranks each with K x P = the job's ranks (`sdcreplay info JOB`).",
        )
    if not 0 <= nodes.node_rank < nodes.nnodes:
        raise NodeError(
            f"--node-rank {nodes.node_rank}: the nodes are 0..{nodes.nnodes - 1}",
            "Give each node its own --node-rank, 0..K-1 (node 0 at --rdzv-endpoint).",
        )


def replay_on_nodes(
    bundle: str | Path,
    nodes: Nodes,
    devices: Sequence[str] | None = None,
    *,
    same_batch: bool = False,
    from_rank: int | None = None,
    repeats: int = 1,
    inject: Sequence[str] = (),
    log_dir: str | Path | None = None,
    timeout: float | None = None,
    ledger: bool = True,
) -> JobReplayReport | SameBatchReport | NodeReport:
    """This node's part of a replay across nodes (module docstring): node 0 returns the
    report (`JobReplayReport` or `SameBatchReport`), the others a `NodeReport` once node 0
    has its verdict; a node lost or never come is a `NodeError` on every node left."""
    job = JobBundle.open(bundle)
    check_nodes(job, nodes)
    labels = local_labels(job, nodes, devices)
    link = NodeLink.open(nodes)
    try:
        return _replay_linked(link, job, labels, same_batch, from_rank, repeats, inject,
                              log_dir, timeout, ledger)  # fmt: skip
    finally:
        link.close()


def _replay_linked(
    link: NodeLink,
    job: JobBundle,
    labels: list[str],
    same_batch: bool,
    from_rank: int | None,
    repeats: int,
    inject: Sequence[str],
    log_dir: str | Path | None,
    timeout: float | None,
    ledger: bool,
) -> JobReplayReport | SameBatchReport | NodeReport:
    reporting = link.nodes.node_rank == 0
    report: JobReplayReport | SameBatchReport
    try:
        link.arrive(labels, [identify(label).to_json() for label in labels])
        with rendezvous.across(link):
            if same_batch:
                report = replay_same_batch(
                    job.path, link.labels, from_rank=from_rank, inject=inject,
                    log_dir=log_dir, timeout=timeout, ledger=ledger,
                )  # fmt: skip
            else:
                report = replay_job(
                    job.path, link.labels, repeats=repeats, inject=inject, log_dir=log_dir,
                    timeout=timeout, ledger=ledger,
                )  # fmt: skip
    except NotReporting:
        verdict = link.await_verdict()
        if verdict["error"] is not None:
            raise SdcReplayError(
                f"node 0 reports: {verdict['error']['message']}", verdict["error"]["hint"]
            ) from None
        return NodeReport(
            str(job.path), link.nodes, labels, verdict["verdict"], verdict["exit_code"]
        )
    except SdcReplayError as exc:
        if reporting:
            link.post_verdict(3, "error", exc)
        else:
            link.publish_failure(exc)
        raise
    failure = report.failure()
    link.post_verdict(3 if failure is not None else report.exit_code, report.verdict, failure)
    return report
