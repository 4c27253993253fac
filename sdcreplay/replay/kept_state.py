"""A kept state: the state entering the first divergent step of a same-batch replay
(``replay JOB --same-batch --keep-state DIR``), where phase 2 can start (``--from-state DIR``).

Phase 1 names the odd rank and its first divergent step S; the job is then replayed once more,
same-batch, up to S, and every rank writes the state entering S into DIR twice:

- as a ``torch.distributed.checkpoint`` directory, sharded as the job was (`get_state_dict`:
  ``model`` and ``optim``), for the job to restart from: the odd ranks write only the shards
  no other rank holds (their own under FSDP2), every replicated value comes from a healthy
  rank;
- as one HDF5 file per rank (``rank000002.h5``: model, optimizer, state objects, gradients, as
  bisect's entry state is) and ``sdcreplay-state.json``, which is what sdcreplay reads.

sdcreplay never reads the checkpoint's own files: DCP's ``.metadata`` is a pickle and each of
its tensors a ``torch.save`` archive, and loading what a bundle brought never unpickles
(docs/trust-and-comparability.md). A DCP directory without the JSON is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..bundle.job_bundle import JobBundle
from ..bundle.layout import ParallelLayout
from ..capture import comparable
from ..errors import BundleError, SdcReplayError
from ..storage.safeio import check_json_value, read_limited
from .job import this_rank
from .job_report import ranks_failure
from .launch import run_ranks
from .replicas import progress_timeout
from .session import ReplaySession, _run_workload_step
from .worker import device_task

KEPT_STATE_FILE = "sdcreplay-state.json"
KEPT_STATE_SCHEMA = "sdcreplay.kept_state/1"
MAX_KEPT_STATE_BYTES = 1024 * 1024


def rank_file(rank: int) -> str:
    return f"rank{rank:06d}.h5"


@dataclass(frozen=True)
class KeptState:
    """What ``sdcreplay-state.json`` says: the step it enters, whose job, who wrote it."""

    path: Path
    step: int
    incident: str
    world_size: int
    odd_ranks: list[int]

    def rank_state(self, rank: int) -> Path:
        return self.path / rank_file(rank)

    def model_state(self, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s model entering the step (its shards under FSDP2), from its HDF5."""
        import h5py

        from ..storage.tensorio import read_tree

        with h5py.File(self.rank_state(rank), "r") as handle:
            return read_tree(handle["model"])

    def to_json(self) -> dict:
        return {
            "schema": KEPT_STATE_SCHEMA,
            "path": str(self.path),
            "step": self.step,
            "incident": self.incident,
            "world_size": self.world_size,
            "odd_ranks": self.odd_ranks,
            "ranks": [rank_file(rank) for rank in range(self.world_size)],
            "checkpoint": "torch.distributed.checkpoint (model, optim); odd ranks wrote only "
            "their own shards",
        }

    def write(self) -> None:
        (self.path / KEPT_STATE_FILE).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def open(cls, path: str | Path, job: JobBundle) -> KeptState:
        """A kept state of ``job``, read from its JSON alone (module docstring)."""
        path = Path(path)
        described = path / KEPT_STATE_FILE
        if not described.is_file():
            pickled = (path / ".metadata").is_file()
            raise SdcReplayError(
                f"--from-state {path}: "
                + (
                    "a torch.distributed.checkpoint directory without sdcreplay's "
                    f"{KEPT_STATE_FILE}: its metadata is a pickle, which sdcreplay never loads"
                    if pickled
                    else f"no {KEPT_STATE_FILE} (not a state `replay --same-batch "
                    "--keep-state` wrote)"
                ),
                f"Keep the state with `sdcreplay replay {job.path} --same-batch --keep-state "
                "DIR` and give that DIR, or start at the window's start (no --from-state).",
            )
        try:
            document = json.loads(read_limited(described, MAX_KEPT_STATE_BYTES, "kept state"))
            check_json_value(document, f"kept state {described}")
            if document.get("schema") != KEPT_STATE_SCHEMA:
                raise ValueError(f"not of schema {KEPT_STATE_SCHEMA}")
            kept = cls(
                path,
                int(document["step"]),
                str(document["incident"]),
                int(document["world_size"]),
                [int(rank) for rank in document["odd_ranks"]],
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BundleError(
                f"kept state {described} is damaged: {exc}",
                "Keep the state again (`replay --same-batch --keep-state DIR`).",
            ) from exc
        incident = job.rank(0).manifest.manifest_sha256 or ""
        if kept.incident != incident or kept.world_size != job.world_size:
            raise SdcReplayError(
                f"--from-state {path} was kept from another job bundle than {job.path}",
                "Give the state kept from this bundle (its sdcreplay-state.json names it).",
            )
        if kept.step not in job.rank(0).step_indices or any(
            not kept.rank_state(rank).is_file() for rank in range(job.world_size)
        ):
            raise BundleError(
                f"kept state {path} is incomplete: it needs step {kept.step} of the job and "
                f"{', '.join(rank_file(r) for r in range(job.world_size))}",
                "Keep the state again (`replay --same-batch --keep-state DIR`).",
            )
        return kept


def unusable_directory(directory: Path, why: str) -> SdcReplayError:
    """--keep-state's directory cannot take the state (checked before phase 1 runs, too)."""
    return SdcReplayError(
        f"--keep-state {directory}: {why}",
        "Give a directory that does not exist yet (the state is written there).",
        python_hint="Give keep_state= a directory that does not exist yet.",
    )


def _own_shards(value: Any) -> Any:
    """What an odd rank writes into the checkpoint: only its DTensors (its own shards)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        kept = {key: _own_shards(item) for key, item in value.items()}
        return {key: item for key, item in kept.items() if item is not None}
    return value if isinstance(value, DTensor) else None


def write_checkpoint(model: torch.nn.Module, optimizer: Any, directory: Path, odd: bool) -> None:
    """This rank's part of the checkpoint (a collective over the job's ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict = {"model": model_state, "optim": optimizer_state}
    if odd:
        state = _own_shards(state)
    dcp.save(state, checkpoint_id=str(directory))


@device_task
def run_keep_state_task(
    device: str,
    job: str,
    step: int,
    feed_from: list[int],
    out: str,
    odd: list[int],
    inject: list[str],
) -> dict:
    """One rank: its part replayed same-batch up to ``step`` (not into it), then the state
    entering it written (module docstring)."""
    opened = JobBundle.open(job)
    rank = this_rank()
    feed = opened.rank(feed_from[rank])
    session = ReplaySession(opened.rank(rank), device, inject=inject, feed=feed)
    try:
        for record in session.steps_until(step - 1):
            _run_workload_step(session, record)
        session.save_state(Path(out) / rank_file(rank))
        write_checkpoint(session.model, session.optimizer, Path(out), rank in odd)
    finally:
        session.close()
    return {"rank": rank}


def keep_state(
    job: JobBundle,
    layout: ParallelLayout,
    source: int,
    labels: list[str],
    step: int,
    odd: list[int],
    directory: Path,
    log_dir: Path,
    timeout: float | None,
    inject: list[str],
) -> KeptState:
    """The state entering ``step`` of a same-batch replay fed ``source``'s batches, in
    ``directory`` (one more replay of the job up to it, on the same labels)."""
    try:
        directory.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        raise unusable_directory(directory, exc.strerror or str(exc)) from exc
    arguments = {
        "job": job.path,
        "step": step,
        "feed_from": [layout.counterpart(rank, source) for rank in range(job.world_size)],
        "out": directory,
        "odd": odd,
        "inject": inject,
    }
    first = job.rank(0)
    results = run_ranks(
        "keep-state",
        run_keep_state_task,
        labels,
        lambda _: arguments,
        log_dir / "keep-state",
        environment=comparable.pinned_environment(first.manifest.fingerprint),
        timeout=timeout or max(progress_timeout(job.rank(r.rank)) for r in job.ranks),
    )
    failure = ranks_failure("keeping the state", results)
    if failure is not None:
        raise failure
    kept = KeptState(
        directory.resolve(), step, first.manifest.manifest_sha256 or "", job.world_size, odd
    )
    kept.write()
    return kept
