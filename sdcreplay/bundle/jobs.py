"""A rank's share of recording a job bundle under ``torch.distributed``.

Every rank writes its own part (a complete bundle) into the job's directory; rank 0 writes the
job manifest, at the start (so a job killed mid-step reads as the parts that exist) and at the
end, once every rank closed its part. The ranks agree through the process group's key-value
store, not through collectives: nothing here appears in a rank's message log or waits behind
NCCL work, and every wait has a timeout. The job's directory must be one all ranks see (a
shared filesystem when the job spans machines).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..errors import BundleError, SdcReplayError
from .job_bundle import JobWriter, job_partial_path, part_path
from .job_manifest import ProcessGroupRecord
from .layout import ParallelLayout
from .manifest import DistributedInfo, WorkloadRef

CLOSE_TIMEOUT = timedelta(minutes=10)
"""How long the ranks wait for each other at the start and at close (a rank still computing
its last step holds the others that long, a dead rank fails the close then)."""

_recordings = itertools.count()
"""Job recordings started in this process: the ranks create them in the same order, so the
n-th one's store keys are the same on every rank."""

_OK = "ok"


def distributed_job() -> bool:
    """Is this process a rank of an initialized ``torch.distributed`` job?"""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def process_groups() -> list[ProcessGroupRecord]:
    """The job's process groups in creation order (``pg_id``, as the message log numbers them)."""
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    return [
        ProcessGroupRecord(pg_id=pg_id, name=name, ranks=dist.get_process_group_ranks(group))
        for pg_id, (group, name) in enumerate(world.pg_names.items())
    ]


def ddp_buckets_rebuilt(model: Any) -> bool | None:
    """Has this DistributedDataParallel rebuilt its gradient buckets (in its second iteration,
    with two broadcasts; once)? None: the model is no DDP."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    return bool(getattr(model, "_has_rebuilt_buckets", False))


def ddp_iterations_before(rebuilt_at_start: bool | None, rebuilt_after: bool | None) -> int | None:
    """How many iterations a DDP had run before a step, capped at 2 (from then on its buckets
    are as they stay): rebuilt before the step, 2; during it (its second iteration), 1; not
    even after it, 0 (its first)."""
    if rebuilt_at_start is None or rebuilt_after is None:
        return None
    return 2 if rebuilt_at_start else 1 if rebuilt_after else 0


class RankExchange:
    """Words the ranks tell each other through the process group's key-value store, under
    ``prefix`` (the same on every rank: things the ranks do in the same order number their
    prefixes alike), each wait with a timeout; ``hint`` says what to do when a rank gives no
    word."""

    def __init__(self, prefix: str, hint: str):
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._store = dist.distributed_c10d._get_default_store()
        self._prefix, self._hint = prefix, hint

    def set(self, name: str, value: str) -> None:
        self._store.set(self._prefix + name, value)

    def get(self, name: str) -> str:
        self.wait([name], f"waiting for {name!r}")
        return self._store.get(self._prefix + name).decode()

    def gather(self, name: str, value: str) -> list[str]:
        """Every rank's ``value`` under ``name``, by rank (each rank calls it)."""
        self.set(f"{name}/{self.rank}", value)
        return [self.get(f"{name}/{rank}") for rank in range(self.world_size)]

    def wait(self, names: list[str], what: str) -> None:
        keys = [self._prefix + name for name in names]
        try:
            self._store.wait(keys, CLOSE_TIMEOUT)
        except (RuntimeError, ValueError) as exc:  # the store's timeout or a dead rank
            missing = [name for name, key in zip(names, keys) if not self._store.check([key])]
            raise SdcReplayError(
                f"rank {self.rank} gave up {what} after {CLOSE_TIMEOUT}: no word of {missing}",
                self._hint,
            ) from exc


class JobRecording:
    """This rank's part of the job bundle at ``path``: ``part_path`` for its BundleWriter,
    ``distributed`` for its manifest, ``close()`` once its part closed. ``name()``: the path rank 0
    picks instead of ``path`` (a ring's later dumps: a name not taken yet), told the others."""

    def __init__(
        self,
        path: Path,
        workload: WorkloadRef,
        device: str,
        overwrite: bool,
        name: Callable[[], Path] | None = None,
        layout: ParallelLayout | None = None,
    ):
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.distributed = DistributedInfo(
            rank=self.rank, world_size=self.world_size, backend=self.backend
        )
        self._words = RankExchange(
            f"sdcreplay/job{next(_recordings)}/",
            "Every rank creates and closes its Recorder, and calls a ring's dump() at the "
            "same step (a job bundle has one part per rank); otherwise a rank died or hangs, "
            "and each part keeps the steps it completed "
            f"(`sdcreplay info {job_partial_path(Path(path))}`).",
        )
        self._words.set(f"device/{self.rank}", device)
        self._writer: JobWriter | None = None
        self.layout = layout
        if self.rank == 0:
            self._create(Path(path), name, workload, overwrite)
        problem = self._words.get("created")
        if problem != _OK:
            raise BundleError(f"rank 0 could not create the job bundle {path}: {problem}")
        self.final_path = Path(self._words.get("path"))
        self.path = job_partial_path(self.final_path)
        self.part_path = part_path(self.final_path, self.rank)

    def gather(self, name: str, value: str) -> list[str]:
        """Every rank's ``value`` under ``name``, by rank (each rank calls it; through the
        store, with the timeout)."""
        return self._words.gather(name, value)

    def _create(
        self,
        path: Path,
        name: Callable[[], Path] | None,
        workload: WorkloadRef,
        overwrite: bool,
    ) -> None:
        devices = [self._words.get(f"device/{rank}") for rank in range(self.world_size)]
        try:
            final_path = path if name is None else name()
            self._writer = JobWriter(
                final_path,
                world_size=self.world_size,
                backend=self.backend,
                process_groups=process_groups(),
                devices=devices,
                workload=workload,
                layout=self.layout,
                overwrite=overwrite,
            )
        except Exception as exc:  # the other ranks wait for word of it: tell them, then raise
            self._words.set("created", getattr(exc, "message", None) or repr(exc))
            raise
        self._words.set("path", str(final_path))
        self._words.set("created", _OK)

    @property
    def moved_aside(self) -> list[Path]:
        """What ``overwrite`` moved away from the job's name (rank 0 knows)."""
        return [] if self._writer is None else self._writer.moved_aside

    def close(self) -> Path:
        """After this rank's part closed: rank 0 waits for every part (with a timeout), ties
        them to the job and renames it; the others wait for that. Returns the job's path."""
        self._words.set(f"closed/{self.rank}", _OK)
        if self._writer is not None:
            ranks = [f"closed/{rank}" for rank in range(self.world_size)]
            self._words.wait(ranks, "waiting for every rank to close its part")
            self._writer.manifest.process_groups = process_groups()
            try:
                self._writer.close()
            except Exception as exc:
                self._words.set("closed", getattr(exc, "message", None) or repr(exc))
                raise
            self._words.set("closed", _OK)
        problem = self._words.get("closed")
        if problem != _OK:
            raise BundleError(
                f"rank 0 could not close the job bundle {self.path}: {problem}",
                "Every part keeps its steps; `sdcreplay info` on the .partial job shows them.",
            )
        return self.final_path


def shard_like(saved: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """A rank's saved shards (plain tensors) as DTensors laid out like ``live``'s (FSDP2's
    parameters), so that ``load_state_dict`` takes them; other entries unchanged. No
    communication: each rank loads what it saved."""
    from torch.distributed.tensor import DTensor

    def like(name: str, value: Any) -> Any:
        reference = live.get(name)
        if not isinstance(reference, DTensor) or isinstance(value, DTensor):
            return value
        return DTensor.from_local(
            value.to(reference.to_local().device),
            reference.device_mesh,
            reference.placements,
            run_check=False,
            shape=reference.shape,
            stride=reference.stride(),
        )

    return {name: like(name, value) for name, value in saved.items()}


def shard_optimizer_state_like(saved: dict, optimizer: Any) -> dict:
    """An optimizer state_dict whose per-parameter tensors shaped like a DTensor parameter's
    shard become DTensors laid out like it (FSDP2's AdamW moments)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state = {
        index: shard_like(
            values,
            {
                name: params[index]
                for name, value in values.items()
                if index < len(params) and _same_shape_as_shard(value, params[index])
            },
        )
        for index, values in saved["state"].items()
    }
    return {**saved, "state": state}


def _same_shape_as_shard(value: Any, param: Any) -> bool:
    to_local = getattr(param, "to_local", None)
    return to_local is not None and getattr(value, "shape", None) == to_local().shape
