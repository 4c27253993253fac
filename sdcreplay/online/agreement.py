"""Agreement between ranks under torch.distributed: every rank takes the same decision.

A detector whose ranks decided differently would run different executions, and
their collectives would part ways; these few collectives (issued outside any
recording's message log) are how the detectors agree, and how a replay check
names the rank that went wrong first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..capture.collectives import unlogged
from ..capture.operators import _own_work
from .execution import Difference


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: Any) -> int:
    return dist.get_rank(group) if _distributed(group) else 0


def _highest(value: int, group: Any) -> int:
    """The largest of every rank's ``value`` (an all-reduce MAX; the value itself alone)."""
    if not _distributed(group):
        return value
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # its collectives take device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    with _own_work(), unlogged():  # not the step's collectives: a recording logs none
        flag = torch.tensor([value], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


def _first_rank(local: dict | None, group: Any) -> dict | None:
    """The mismatch every rank reports. Where a collective's input differs (from the same
    rank's reference execution): the rank whose input differs at the earliest collective, as
    the job replay's origin rule; else the one whose first differing entry comes first in the
    step (a forward fault changes the loss of its own rank before any all-reduce). ``ranks``:
    every rank at that place; more than one means no rank can be named (``rank`` is then only
    the one that shares its details)."""
    if not _distributed(group):
        return None if local is None else {**local, "rank": 0, "ranks": [0]}
    if not _highest(0 if local is None else 1, group):
        return None
    with _own_work():
        summary = (
            None
            if local is None
            else {
                "replay": local["replay"],
                "message": local["message"],
                **vars(local["difference"]),
            }
        )
        gathered: list[Any] = [None] * dist.get_world_size(group)
        with unlogged():
            dist.all_gather_object(gathered, summary, group=group)
    differing = [(r, s) for r, s in enumerate(gathered) if s is not None]
    by_message = [(r, s) for r, s in differing if s["message"] is not None]
    if by_message:
        rank, chosen = min(by_message, key=lambda item: (item[1]["message"], item[0]))
        place: tuple[str, ...] = ("replay", "message")
    else:
        rank, chosen = min(differing, key=lambda item: (item[1]["position"], item[0]))
        place = ("replay", "position", "entry")
    tied = [
        r
        for r, s in enumerate(gathered)
        if s is not None and all(s[key] == chosen[key] for key in place)
    ]
    replay = chosen.pop("replay")
    chosen.pop("message")
    kept = local["kept"] if local is not None and rank == _rank(group) else None
    return {
        "rank": rank,
        "ranks": tied,
        "replay": replay,
        "difference": Difference(**chosen),
        "kept": kept,
    }


def _shared(value: dict | None, owner: int, group: Any) -> dict | None:
    """``owner``'s value on every rank."""
    if not _distributed(group):
        return value
    with _own_work(), unlogged():
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, owner) if group else owner)
    return box[0]
