"""The liveness signal of the process this code runs in, below every stage.

A device process's task beats through it wherever it makes progress (a replay's
step, a collective the message log sees issued), and the parent that watches
the process reads it; the code that beats knows nothing of the parent.
"""

from __future__ import annotations

from pathlib import Path


class Heartbeat:
    """The liveness signal: the task touches its ``alive`` file whenever it makes progress.

    The parent kills a process whose file stays untouched longer than the
    timeout; the file's first line says where the task got to, for the report,
    and its second how many collectives the rank has issued: in a stuck job the
    rank the others wait for is the one that issued fewest (the time of a beat
    cannot tell: a slow rank may beat last and then stall before its call).
    """

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.where = "start-up"
        self.collectives = 0

    def beat(self, where: str) -> None:
        self.where = where
        if self.path is not None:
            self.path.write_text(f"{where}\n{self.collectives}")

    def issuing(self, where: str) -> None:
        """A collective about to be issued: it counts as progress past the ranks behind it."""
        self.collectives += 1
        self.beat(where)


HEARTBEAT = Heartbeat(None)
