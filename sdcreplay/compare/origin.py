"""The origin rule: which rank's computation went wrong first in a multi-rank job.

The gradient all-reduce spreads one rank's wrong value to every rank within a
step, so the rank whose signatures differ is not the answer. The first
message, in step and issue order, whose *input* digest differs on one rank
while the other ranks' inputs match names the rank whose computation went
wrong before it (`origin_rank`); every rank that differs after that is
`spread_ranks` (docs/distributed.md). Both a job's replay and a diff of two
jobs ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capture.message import Message
from .messages import Messages


@dataclass(frozen=True)
class Origin:
    """Where a replica (or a second log) first leaves the record, rank by rank."""

    origin_rank: int | None
    first_divergent_message: dict | None
    spread_ranks: list[int]

    @property
    def diverged(self) -> bool:
        return self.origin_rank is not None or bool(self.spread_ranks)

    def to_json(self) -> dict:
        return {
            "origin_rank": self.origin_rank,
            "first_divergent_message": self.first_divergent_message,
            "spread_ranks": self.spread_ranks,
        }


NO_ORIGIN = Origin(None, None, [])


def find_origin(
    recorded: dict[int, Messages], replayed: dict[int, Messages], diverged: set[int]
) -> Origin:
    """The origin rule (module docstring). ``diverged``: ranks whose signatures differ.

    Messages are matched per step by process group and ``op_id`` (the same call on every
    rank of the group) and taken in step, then issue order. The first one that differs
    anywhere is the first divergent message: when only inputs differ there and on exactly
    one rank, that rank is the origin; several at once, or outputs alone (the collective
    itself delivered something else), name no origin. Without any message difference, a
    single rank whose signatures differ is the origin (its corruption reached no message).
    """
    slots: dict[tuple[int, int, int], dict[int, tuple[Message, Message]]] = {}
    for rank, steps in recorded.items():
        for step, messages in steps.items():
            for mine, theirs in zip(messages, replayed.get(rank, {}).get(step, [])):
                slots.setdefault((step, mine.pg_id, mine.op_id), {})[rank] = (mine, theirs)

    def issue_order(key: tuple[int, int, int]) -> tuple:
        return (key[0], min(pair[0].record_id for pair in slots[key].values()), key[1], key[2])

    differing = set(diverged)
    first: tuple[int | None, dict] | None = None
    for key in sorted(slots, key=issue_order):
        pairs = slots[key]
        inputs = sorted(r for r, (a, b) in pairs.items() if a.input_digest != b.input_digest)
        outputs = sorted(r for r, (a, b) in pairs.items() if a.output_digest != b.output_digest)
        differing.update(inputs + outputs)
        if first is None and (inputs or outputs):
            ranks = inputs or outputs
            origin = inputs[0] if len(inputs) == 1 else None
            first = (origin, _message_json(pairs[ranks[0]][0], ranks[0], inputs, outputs))
    if first is None:
        origin = next(iter(diverged)) if len(diverged) == 1 else None
        return Origin(origin, None, sorted(differing - {origin}))
    return Origin(first[0], first[1], sorted(differing - {first[0]}))


def _message_json(message: Message, rank: int, inputs: list[int], outputs: list[int]) -> dict:
    return {
        "rank": rank,
        "step": message.step,
        "record_id": message.record_id,
        "collective_seq_id": message.collective_seq_id,
        "p2p_seq_id": message.p2p_seq_id,
        "op_id": message.op_id,
        "profiling_name": message.profiling_name,
        "process_group": message.process_group,
        "pg_id": message.pg_id,
        "which": "input" if inputs else "output",
        "input_differs": inputs,
        "output_differs": outputs,
    }
