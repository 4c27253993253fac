"""FSDP2's all-gathers for a rank replayed alone (`replay.alone`): the peers' chunks built
from what the job bundle holds.

Under FSDP2 a rank holds one shard of each parameter and all-gathers the others' before each
use. Alone, it has no peers to gather from, but the job bundle has every rank's part, and
each part holds that rank's shards of the window's starting state. So the output of an
all-gather is laid out as FSDP2 lays it: chunk ``k`` is rank ``k``'s all-gather input, each
of the group's parameters' shard padded to FSDP2's padded shard size and cast to the dtype
this rank's input has, one after the other in the group's order; chunk R is this rank's own
input, as computed. In the window's first step, before the first reduce-scatter, this is the
job's output, and the record's output digest says so; from the second step on, the peers'
chunks are still their starting shards (the bundle has nothing later), so the replicas agree
with each other, not with the job (docs/at-scale.md). Started from a kept state
(``--from-state``), the peers' chunks are their shards entering its step.

FSDP2 names the parameters of an all-gather only to its ``foreach_all_gather``: that one
function is wrapped, in this process only (a rank alone's process is its own), to say which
parameters the next all-gather carries.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..bundle.job_bundle import JobBundle
from ..errors import SdcReplayError
from .kept_state import KeptState


class PeerShards:
    """Every other rank's shards of the window's starting state, by parameter name; or of a
    kept state's (`kept_state`: every rank's, entering its step)."""

    def __init__(self, job: JobBundle, rank: int, kept: KeptState | None = None):
        self.rank = rank
        self.world_size = job.world_size
        self.shards: dict[int, dict[str, torch.Tensor]] = {
            peer: job.rank(peer).load_state()[0] if kept is None else kept.model_state(peer)
            for peer in range(job.world_size)
            if peer != rank
        }
        self._gathering: list[Any] = []  # FSDPParams of the all-gather about to be issued

    def install(self) -> None:
        """Learn each all-gather's parameters from FSDP2 (module docstring)."""
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        original = _fsdp_param_group.foreach_all_gather
        if getattr(original, "_sdcreplay_alone", False):
            return

        @functools.wraps(original)
        def foreach_all_gather(fsdp_params: list, *args: Any, **kwargs: Any) -> Any:
            self._gathering = list(fsdp_params)
            return original(fsdp_params, *args, **kwargs)

        foreach_all_gather._sdcreplay_alone = True  # type: ignore[attr-defined]
        _fsdp_param_group.foreach_all_gather = foreach_all_gather

    def fill(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """An all-gather's output: each peer's chunk from the bundle, this rank's its input."""
        params, self._gathering = self._gathering, []
        chunks = output.view(self.world_size, -1)
        if not params:
            raise SdcReplayError(
                "rank alone: an all-gather that FSDP2's foreach_all_gather did not issue "
                f"({tuple(input.shape)} {input.dtype}); its peers' data is not known",
                "Bisect this rank among its peers: `sdcreplay bisect JOB --rank R --suspect D "
                "--reference D2` (docs/distributed.md).",
            )
        for peer in range(self.world_size):
            if peer == self.rank:
                chunks[peer].copy_(input.view(-1))
            else:
                chunks[peer].copy_(self._chunk(peer, params, output.dtype, input.numel()))

    def _chunk(self, peer: int, params: list, dtype: torch.dtype, numel: int) -> torch.Tensor:
        parts = []
        for param in params:
            local = param._sharded_local_tensor
            if hasattr(local, "fsdp_pre_all_gather"):
                raise SdcReplayError(
                    f"rank alone: {param._param_fqn} has its own all-gather "
                    "(fsdp_pre_all_gather); its peers' inputs cannot be rebuilt from shards",
                    "Bisect this rank among its peers (`bisect JOB --rank R` without --alone).",
                )
            shard = self.shards[peer][param._param_fqn]
            padded = torch.zeros(param.padded_sharded_param_size, dtype=shard.dtype)
            padded[: shard.shape[0]] = shard
            cast = padded.to(param.param_dtype or local.dtype).view(-1)
            parts.append(cast.view(torch.uint8) if dtype == torch.uint8 else cast)
        chunk = torch.cat(parts)
        if chunk.numel() != numel:
            raise SdcReplayError(
                f"rank alone: rank {peer}'s shards make {chunk.numel()} elements where the "
                f"all-gather's input has {numel}",
                "Bisect this rank among its peers (`bisect JOB --rank R` without --alone).",
            )
        return chunk.to(self._device(params))

    @staticmethod
    def _device(params: list) -> torch.device:
        return params[0]._sharded_local_tensor.device
