"""A rank's collective messages as evidence: entries a vote judges, and the file a replay writes.

A job's rank is judged on what it sent and received as much as on what it
computed, so each step's messages (`capture.message.Message`) join its
signature entries (``collective:PG#OP_ID:NAME.input``/``.output``) before any
comparison. A replay's messages travel from the rank's process to the
replaying one as one JSON file per rank and repeat.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..bundle.reader import Bundle
from ..capture.message import Message
from ..capture.signature import SignatureLog
from ..errors import BundleError
from ..storage.safeio import check_json_value, read_limited

MESSAGES_SCHEMA = "sdcreplay.messages/1"
MAX_MESSAGE_LOG_BYTES = 256 * 1024 * 1024

Messages = dict[int, list[Message]]
"""One rank's messages, per step."""


def message_entries(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """A step's messages as signature entries (``collective:PG#OP_ID:NAME.input``), so the
    vote judges them with the layers' entries."""
    entries = []
    for message in messages:
        name = f"collective:{message.process_group}#{message.op_id}:{message.profiling_name}"
        entries.append((f"{name}.input", message.input_digest or "none"))
        entries.append((f"{name}.output", message.output_digest or "none"))
    return entries


def with_messages(log: SignatureLog, messages: Messages) -> SignatureLog:
    """``log`` with each step's messages after its entries."""
    steps = {
        step: list(entries) + message_entries(messages.get(step, []))
        for step, entries in log.steps.items()
    }
    return SignatureLog(meta=dict(log.meta), steps=steps)


def recorded_log(part: Bundle) -> SignatureLog:
    """A rank's recorded signature log with its messages among its entries (as a replay's)."""
    return with_messages(part.signature_log(), part.messages())


def write_messages(path: Path, rank: int, messages: Messages) -> None:
    document = {
        "schema": MESSAGES_SCHEMA,
        "rank": rank,
        "steps": {str(step): [m.to_json() for m in found] for step, found in messages.items()},
    }
    path.write_text(json.dumps(document))


def read_messages(path: Path) -> Messages:
    """A replay's message log; a damaged or foreign file is a BundleError (exit 3)."""
    try:
        document = json.loads(read_limited(path, MAX_MESSAGE_LOG_BYTES, "message log"))
        check_json_value(document, f"message log {path}")
        if not isinstance(document, dict) or document.get("schema") != MESSAGES_SCHEMA:
            raise ValueError(f"not a message log of schema {MESSAGES_SCHEMA}")
        return {
            int(step): [Message.from_json(m) for m in found]
            for step, found in document["steps"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BundleError(
            f"message log {path} is damaged: {exc}",
            "Give a replay's log directory as sdcreplay wrote it (or replay again).",
        ) from exc
