"""A record as a line of Megatron's result tracker, for tools that already parse those.

Megatron's RerunStateMachine appends one line per rejected result to its tracker file,
``ts=... node=... device=... jobID=... rank=... iteration=... status=... result=...
message='...'``, and reads it back with ``ts=.+ node=.+ device=.+ jobID=.+ rank=(.+)
iteration=(.+) status=(.+) .+`` (``int`` of rank and iteration). A record of every kind (a
clearing included) reads the same, field for field and in that order: each field one word,
rank and iteration integers, and the message one line in which no other field's name can
be mistaken for a field (``device`` is the label, the message names the device's id). With
``SDCREPLAY_TRACKER=FILE`` every record the ledger takes is appended there too; ``sdcreplay
devices export --format tracker`` prints them from the ledger.
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path

from .schema import Record

TRACKER_ENV = "SDCREPLAY_TRACKER"
FIELDS = ("ts", "node", "device", "jobID", "rank", "iteration", "status", "result", "message")
_FIELD_IN_TEXT = re.compile(rf"(\s)({'|'.join(FIELDS)})=")


def one_line(text: str) -> str:
    """``text`` without control, format or line-separator characters (a newline, an escape
    code, a right-to-left override), its whitespace runs one space: it cannot split or
    disguise the line it is put in."""
    kept = "".join(
        " " if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp") else char for char in text
    )
    return " ".join(kept.split())


def _word(text: str) -> str:
    return "_".join(one_line(text).split()) or "-"


def tracker_line(record: Record) -> str:
    result = ":".join(
        part
        for part in (
            record.operator,
            f"element={record.element}" if record.element is not None else None,
            f"bits={record.bits}" if record.bits else None,
            f"rate={record.rate:.6g}" if record.rate is not None else None,
        )
        if part
    )
    message = one_line(f"sdcreplay {record.command}: {record.device_id}: {record.evidence}")
    message = _FIELD_IN_TEXT.sub(r"\1\2:", message).replace("'", '"')
    return (
        f"ts={_word(record.time)} node={_word(record.host)} device={_word(record.label)} "
        f"jobID={_word(record.job or 'N/A')} rank={int(record.rank or 0)} "
        f"iteration={-1 if record.iteration is None else int(record.iteration)} "
        f"status={_word(record.verdict)} result={_word(result or record.verdict)} "
        f"message='{message}'"
    )


def append_tracker_lines(records: Sequence[Record]) -> None:
    """Append the records' lines to ``$SDCREPLAY_TRACKER`` when it is set."""
    path = os.environ.get(TRACKER_ENV)
    if not path:
        return
    with Path(path).open("a", encoding="utf-8") as handle:
        handle.write("".join(tracker_line(record) + "\n" for record in records))
