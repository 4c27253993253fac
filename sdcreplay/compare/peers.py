"""The peer vote of a same-batch replay: data-parallel peers fed one batch are each other's
oracle.

Every data-parallel rank of a job replayed with the batch and RNG of one source group computes
what its peers compute, bit for bit, at every entry that does not hold a shard of its own
(docs/at-scale.md). At each entry of each class of peers (the same model-parallel coordinates,
one rank per data-parallel group) the value a strict majority holds is the reference, and a
rank that holds another is odd there; an entry no majority agrees on (a shard under FSDP2) says
nothing. A rank is named at its first odd entry. Under tensor or pipeline parallelism a wrong
value also spreads to the other ranks of its group through their own collectives: within a
group, the rank odd at the earliest entry is the origin and the group's others spread from it.

The record is a voter too. Each rank fed the source group's batches is held to the record of
the rank it was fed from (`record_prefix_divergence`): in the window's first step its
collective inputs must be the record's, up to the first collective whose output the record does
not share (the first reduction over peers fed other batches). For the source group that is its
own record; for a peer it holds only where the parameters are replicated over the peers (their
state is the source's), so only then (`ParallelLayout.sharded` is false). That is what decides
between **two** peers, where no majority exists: the one that left the record is odd; peers
that differ where the record vouches for neither are ``undecided`` (a third group decides).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from ..bundle.layout import ParallelLayout
from ..capture.message import Message
from ..capture.signature import SignatureLog
from .messages import Messages

MAJORITY_PEERS = 3
"""Fewer peers than this have no majority: one against one names nobody but the record."""


@dataclass(frozen=True)
class OddEntry:
    """Where a rank first left its peers: the step, the entry's position and name, and how
    many peers held the majority's value against it."""

    step: int
    position: int
    entry: str
    agreeing: int
    peers: int
    against: str = "peers"  # or "record": the source group's own entries against the record

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "position": self.position,
            "entry": self.entry,
            "agreeing": self.agreeing,
            "peers": self.peers,
            "against": self.against,
        }


@dataclass(frozen=True)
class PeerVote:
    """Each odd rank's first odd entry; ``origins``: the odd ranks that went first in their
    model-parallel group (the others are ``spread_from`` an origin)."""

    odd: dict[int, OddEntry]
    origins: list[int]
    spread_from: dict[int, int]
    unjudged: int  # entries no majority of peers agreed on (shards)
    tied: bool = False  # replicated values no majority or record decided between

    @property
    def verdict(self) -> str:
        return "persistent" if self.origins else "undecided" if self.tied else "correct"


def _peer_name(entry: str) -> str:
    """An entry's name as its peers know it: a collective's process group differs between peers
    in a model-parallel dimension (each data-parallel group has its own tensor-parallel group),
    what it carries does not."""
    return _GROUP.sub("collective:#", entry, count=1)


_GROUP = re.compile(r"^collective:[^#]*#")


def first_odd_entries(
    layout: ParallelLayout, logs: dict[int, SignatureLog]
) -> tuple[dict[int, OddEntry], int]:
    """Per rank, the first entry where a strict majority of its peers holds another value;
    and how many entries no majority agreed on."""
    odd: dict[int, OddEntry] = {}
    unjudged = 0
    for peers in layout.peer_classes():
        present = [rank for rank in peers if rank in logs]
        steps = sorted(set.intersection(*(set(logs[rank].steps) for rank in present)))
        for step in steps:
            entries = {rank: logs[rank].steps[step] for rank in present}
            length = min(len(found) for found in entries.values())
            for position in range(length):
                names = {_peer_name(entries[rank][position][0]) for rank in present}
                values = Counter(entries[rank][position][1] for rank in present)
                value, count = values.most_common(1)[0]
                if len(names) != 1 or count * 2 <= len(present):
                    unjudged += 1
                    continue
                for rank in present:
                    name, mine = entries[rank][position]
                    if mine != value and rank not in odd:
                        odd[rank] = OddEntry(step, position, name, count, len(present))
    return odd, unjudged


def record_prefix_divergence(
    recorded: Messages, replayed: Messages, step: int
) -> tuple[int, Message] | None:
    """Where a rank that replayed its own batch left the record in ``step``: the first
    message, in issue order, whose input differs, looked at only up to the first message whose
    output the record does not share (the first reduction over peers fed another batch: after
    it, the replay legitimately computes other values). (position, the recorded message)."""
    for position, (mine, theirs) in enumerate(zip(recorded.get(step, []), replayed.get(step, []))):
        if mine.input_digest != theirs.input_digest:
            return position, mine
        if mine.output_digest != theirs.output_digest:
            return None
    return None


def peer_vote(
    layout: ParallelLayout,
    logs: dict[int, SignatureLog],
    against_record: dict[int, OddEntry] | None = None,
) -> PeerVote:
    """The vote (module docstring); ``against_record``: ranks whose own entries left the
    record, odd as well (their first divergence from it). Under a layout without shards, an
    entry no majority agreed on is a tie, not a shard: with no origin named the vote is
    ``undecided``."""
    odd, unjudged = first_odd_entries(layout, logs)
    for rank, entry in (against_record or {}).items():
        odd.setdefault(rank, entry)
    origins: list[int] = []
    spread: dict[int, int] = {}
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in odd:
        groups.setdefault(tuple(layout.model_parallel_group(rank)), []).append(rank)
    for members in groups.values():
        first = min((odd[r].step, odd[r].position) for r in members)
        starters = sorted(r for r in members if (odd[r].step, odd[r].position) == first)
        origins += starters
        for rank in members:
            if rank not in starters:
                spread[rank] = starters[0]
    return PeerVote(odd, sorted(origins), spread, unjudged, bool(unjudged) and not layout.sharded)
