"""A record as a line of Megatron's result tracker, for tools that already parse those.

Megatron's RerunStateMachine appends one line per rejected result to its tracker file,
``ts=... node=... device=... jobID=... rank=... iteration=... status=... result=...
message='...'``; a record reads the same, field for field and in that order (``device`` is
the label, the message names the device's id). With ``SDCREPLAY_TRACKER=FILE`` every record
the ledger takes is appended there too; ``sdcreplay devices export --format tracker``
prints them from the ledger.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .schema import Record

TRACKER_ENV = "SDCREPLAY_TRACKER"


def _word(text: str) -> str:
    return "_".join(text.split()) or "-"


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
    message = f"sdcreplay {record.command}: {record.device_id}: {record.evidence}"
    return (
        f"ts={record.time} node={record.host} device={record.label} "
        f"jobID={_word(record.job or 'N/A')} rank={record.rank or 0} "
        f"iteration={-1 if record.iteration is None else record.iteration} "
        f"status={_word(record.verdict)} result={_word(result or record.verdict)} "
        f"message='{message.replace(chr(39), chr(34))}'"
    )


def append_tracker_lines(records: Sequence[Record]) -> None:
    """Append the records' lines to ``$SDCREPLAY_TRACKER`` when it is set."""
    path = os.environ.get(TRACKER_ENV)
    if not path:
        return
    with Path(path).open("a", encoding="utf-8") as handle:
        handle.write("".join(tracker_line(record) + "\n" for record in records))
