"""One logged collective call, as a bundle stores it and a vote or an origin search reads it.

The record type is apart from the log that hooks the ``c10d`` operators
(``collectives.MessageLog``) so that reading a bundle's messages (``info``,
the comparisons) needs neither the hooks nor torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Message:
    """One logged call; field names as PyTorch's flight recorder names them."""

    step: int
    record_id: int  # 0.. per rank and step, in issue order
    pg_id: int  # the process group's position in creation order (0: the default group)
    process_group: str  # its name
    collective_seq_id: int | None  # per process group and step, collectives only
    p2p_seq_id: int | None  # per process group and step, send/recv only
    op_id: int  # per process group and step, every call
    profiling_name: str  # backend:collective, e.g. gloo:all_reduce
    input_sizes: list[list[int]]
    input_dtypes: list[str]
    output_sizes: list[list[int]]
    output_dtypes: list[str]
    input_digest: str | None  # the rank's input before the call (None: it has none)
    output_digest: str | None  # its output after completion (None: it has none)
    peer: int | None = None  # send/recv: the other rank (in the group)

    STRUCTURE = (
        "profiling_name",
        "pg_id",
        "process_group",
        "input_sizes",
        "input_dtypes",
        "output_sizes",
        "output_dtypes",
        "peer",
    )
    """What must be equal for a replay to run the recorded program (digests may differ)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Message:
        """From a validated JSON object (bundle/reader.py checks it against MESSAGE_FIELDS)."""
        names = [f.name for f in fields(cls)]
        return cls(**{name: obj[name] for name in names if name in obj})

    def structure(self) -> tuple:
        return tuple(repr(getattr(self, name)) for name in self.STRUCTURE)

    def brief(self) -> str:
        """``gloo:all_reduce on process group 0 of float32[16736]`` (the input, else output)."""
        sizes, dtypes = (
            (self.input_sizes, self.input_dtypes)
            if self.input_sizes
            else (self.output_sizes, self.output_dtypes)
        )
        tensors = ", ".join(f"{dtype}{list(size)}" for size, dtype in zip(sizes, dtypes))
        peer = "" if self.peer is None else f" with peer {self.peer}"
        of = f" of {tensors}" if tensors else ""
        return f"{self.profiling_name} on process group {self.process_group}{peer}{of}"
