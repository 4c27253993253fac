"""The signature log: ``name -> digest`` entries in execution order, per step.

Stored as zstd-compressed JSON lines, one zstd frame per step, so a log cut off
mid-write still yields every step whose frame is complete. The same format is
used inside a bundle and for a replay's own log, so ``diff`` takes either.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from ..errors import BundleError
from ..kinds import SIGNATURE_LEVELS, ModuleNaming, SignatureLevel
from ..storage.safeio import check_json_value, read_limited

SCHEMA = "sdcreplay.signatures/1"
MAX_LOG_BYTES = 1 << 30
MAX_TEXT_BYTES = 8 << 30
MAX_ENTRIES = 100_000_000
MAX_RATIO = 256
"""A frame may declare at most this many bytes of text per compressed byte (plus
``RATIO_SLACK``): the JSON lines sdcreplay writes hold digests and compress about 6:1; a frame
that claims far more is a decompression bomb, refused before it is inflated."""
RATIO_SLACK = 64 << 10
MAX_HEADER_BYTES = 64 << 10
"""A bundle's log header (its first frame): a schema and a device type or a kind."""
MAX_ENTRY_BYTES = 4 << 10
"""One signature entry's line at most (a step's frame in a bundle may declare its manifest's
entry count times this)."""
MAX_MESSAGE_BYTES = 4 << 20
"""One collective message's line at most (the tensor sizes of a coalesced call)."""


PROGRAM = "program"
"""The phase of entries that describe the program rather than a device's arithmetic
(hyper-parameters, state objects' numbers): a divergence there is a different program."""


def entry_kind(name: str) -> str:
    """``forward``, ``grad``, ``loss``, ... : what an entry is, from its name."""
    return name.split(":", 1)[0].split("#", 1)[0]


def phase_of(name: str) -> str:
    """forward / backward / optimizer / state / program, from the entry's name."""
    kind = entry_kind(name)
    return {
        "forward": "forward",
        "loss": "forward",
        "backward": "backward",
        "grad": "backward",
        "step_grad": "optimizer",
        "param": "optimizer",
        "buffer": "optimizer",
        "optim": "optimizer",
        "hyper": PROGRAM,
        "state": PROGRAM,
        "state_tensor": "state",
        "rng": "state",
        "collective": "collective",
    }.get(kind, "other")


def is_program_entry(name: str) -> bool:
    return phase_of(name) == PROGRAM


BOUNDARY_KINDS = frozenset(
    {"rng", "state", "state_tensor", "loss", "hyper", "step_grad", "param", "buffer", "collective"}
)
"""The entries of the ``boundary`` level: what the step starts from (RNG, state objects), the
loss of every backward, what the optimizer is given (hyper-parameters, gradients), what it
produced (parameters, buffers) and a job's messages. The ``layer`` level has every entry."""


def at_level(name: str, level: SignatureLevel) -> bool:
    """Does a log of ``level`` hold the entry ``name``?"""
    return level == "layer" or entry_kind(name) in BOUNDARY_KINDS


def coarser(first: SignatureLevel, second: SignatureLevel) -> SignatureLevel:
    """The level two logs can be compared at: the one holding fewer entries."""
    return max(first, second, key=SIGNATURE_LEVELS.index)


def layer_of(name: str) -> str:
    """The module an entry belongs to: ``backward:layers.1.attn#1[0]`` and
    ``grad:layers.1.attn.wq.weight`` belong to ``layers.1.attn`` / ``layers.1.attn.wq``."""
    kind, _, rest = name.partition(":")
    if not rest:
        return name
    path = rest.split("#", 1)[0].split("[", 1)[0]
    if kind in ("grad", "step_grad", "param", "buffer"):
        path = path.rpartition(".")[0] or "<root>"
    elif kind == "optim":  # optim:layers.0.attn.wq.weight.exp_avg_sq -> layers.0.attn.wq
        path = path.rsplit(".", 2)[0] if path.count(".") >= 2 else "<root>"
    elif kind in ("hyper", "state", "state_tensor"):  # hyper:0.lr -> hyper:0 (param group 0)
        path = f"{kind}:{path.split('.', 1)[0]}"
    return path


@dataclass
class SignatureLog:
    meta: dict
    steps: dict[int, list[tuple[str, str]]] = field(default_factory=dict)

    def entry_count(self) -> int:
        return sum(len(entries) for entries in self.steps.values())

    @property
    def level(self) -> SignatureLevel:
        """What the log holds (``meta["level"]``; logs older than levels hold every layer)."""
        level = self.meta.get("level", "layer")
        return level if level in SIGNATURE_LEVELS else "layer"

    @property
    def naming(self) -> ModuleNaming:
        """How its entries name modules (``meta["naming"]``; logs older than plain names name
        them as ``named_modules()`` does: capture/module_names.py)."""
        return "plain" if self.meta.get("naming") == "plain" else "wrapped"

    def at(self, level: SignatureLevel) -> SignatureLog:
        """This log as a log of ``level`` holds it: the entries of a coarser level only."""
        if level == self.level or level == "layer":
            return self
        steps = {
            step: [(name, digest) for name, digest in entries if at_level(name, level)]
            for step, entries in self.steps.items()
        }
        return SignatureLog(meta={**self.meta, "level": level}, steps=steps)


_json_string = json.encoder.encode_basestring_ascii
"""A str as json.dumps quotes it (ASCII escapes)."""


class SignatureLogWriter:
    """Appends one frame per step and keeps the file's SHA-256 as it grows."""

    def __init__(self, path: Path, meta: dict):
        self.path = Path(path)
        self._hash = hashlib.sha256()
        self.size = 0
        # The frame checksum lets a reader tell a damaged standalone log (a
        # replay log has no manifest SHA-256 to guard it) from a valid one.
        self._compressor = zstandard.ZstdCompressor(level=3, write_checksum=True)
        self.path.write_bytes(b"")
        self.append_records([{"schema": SCHEMA, **meta}])

    def append_step(self, step: int, entries: list[tuple[str, str]]) -> None:
        # The bytes json.dumps(..., separators=(",", ":")) writes, a few times faster.
        prefix, quoted = f'{{"step":{int.__repr__(step)},"name":', _json_string
        self._append_text(
            "".join(
                f'{prefix}{quoted(name)},"digest":{quoted(digest)}}}\n' for name, digest in entries
            )
        )

    def append_records(self, lines: list[dict]) -> None:
        """One frame of JSON objects, one a line (a step's collective messages, a header)."""
        self._append_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))

    def _append_text(self, text: str) -> None:
        frame = self._compressor.compress(text.encode())
        with self.path.open("ab") as handle:
            handle.write(frame)
            handle.flush()
        self._hash.update(frame)
        self.size += len(frame)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


def write_signature_log(path: Path, log: SignatureLog) -> None:
    writer = SignatureLogWriter(path, {k: v for k, v in log.meta.items() if k != "schema"})
    for step, entries in log.steps.items():
        writer.append_step(step, entries)


def read_signature_log(
    path: Path, size: int | None = None, frame_limits: Sequence[int] | None = None
) -> SignatureLog:
    """Read a log; ``size`` limits it to its first bytes (what a manifest vouches for), and
    ``frame_limits`` the text each frame may declare, header first (what the manifest's steps
    can hold: ``bundle_frame_limits``).

    Every frame must be complete: a log cut off mid-frame is damaged, never
    read as fewer entries.
    """
    path = Path(path)
    lines = _read_lines(path, size, frame_limits)
    try:
        meta = read_header(path, lines)
        steps: dict[int, list[tuple[str, str]]] = {}
        for line in lines[1:]:
            entry = json.loads(line)
            step, name, digest = entry["step"], entry["name"], entry["digest"]
            if not (type(step) is int and isinstance(name, str) and isinstance(digest, str)):
                raise ValueError(f"bad entry {line[:80]!r}")
            steps.setdefault(step, []).append((name, digest))
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise BundleError(f"signature log {path} is damaged: {exc}") from exc
    return SignatureLog(meta=meta, steps=steps)


def bundle_frame_limits(counts: Sequence[int], line_bytes: int) -> list[int]:
    """The text each frame of a bundle's log may declare: the header, then one frame per step
    of ``counts`` lines (entries, or messages) of at most ``line_bytes`` each."""
    return [MAX_HEADER_BYTES, *(count * line_bytes for count in counts)]


def _read_lines(path: Path, size: int | None, frame_limits: Sequence[int] | None) -> list[str]:
    """The log's lines, header first; ``size``: only the first bytes (what a manifest vouches
    for)."""
    limit = MAX_LOG_BYTES if size is None else size
    raw = read_limited(path, limit, "signature log", prefix=size is not None)
    if size is not None and len(raw) < size:
        raise BundleError(
            f"signature log {path} is {len(raw)} bytes, expected at least {size} (truncated)"
        )
    text = _decompress_frames(path, raw, frame_limits)
    lines = text.split("\n")[:-1] if text else []
    if len(lines) > MAX_ENTRIES:
        raise BundleError(f"signature log {path} holds more than {MAX_ENTRIES} entries")
    if not lines:
        raise BundleError(f"signature log {path} is empty")
    return lines


def read_header(path: Path, lines: list[str]) -> dict:
    """The first line: the log's schema and metadata (ValueError where it is not JSON)."""
    meta = json.loads(lines[0])
    check_json_value(meta, f"the header of signature log {path}")
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        raise BundleError(
            f"{path} is not a signature log of schema {SCHEMA} (found {str(meta)[:60]!r})",
            "Give a bundle directory or a replay log written by this version of sdcreplay.",
        )
    return meta


def read_records(
    path: Path, size: int | None = None, frame_limits: Sequence[int] | None = None
) -> tuple[dict, list[dict]]:
    """A log of JSON objects (a bundle's message log): its header and the objects after it
    (``size``, ``frame_limits``: as for ``read_signature_log``)."""
    lines = _read_lines(Path(path), size, frame_limits)
    try:
        meta = read_header(path, lines)
        records = [json.loads(line) for line in lines[1:]]
        for record in records:
            check_json_value(record, f"a record of {path}")
    except (ValueError, RecursionError) as exc:
        raise BundleError(f"log {path} is damaged: {exc}") from exc
    if not all(isinstance(record, dict) for record in records):
        raise BundleError(f"log {path} is damaged: a line is not a JSON object")
    return meta, records


def _decompress_frames(path: Path, raw: bytes, frame_limits: Sequence[int] | None) -> str:
    """The frames' text, in order; each frame whole, with its checksum, ending with a newline.

    The writer puts the content size and a checksum in every frame header; a frame without
    them is not one sdcreplay wrote. Before a frame is inflated, the size its header declares
    is checked against its compressed length (``MAX_RATIO``), what the manifest's steps can
    hold (``frame_limits``) and ``MAX_TEXT_BYTES`` in all; it is then inflated into exactly
    that many bytes, so a frame holding more than it declares stops there.
    """
    decompressor = zstandard.ZstdDecompressor()
    parts: list[str] = []
    total, start, view = 0, 0, memoryview(raw)

    def damaged(what: str) -> BundleError:
        return BundleError(f"signature log {path} is damaged: {what}")

    try:
        while start < len(raw):
            number = len(parts)
            header = zstandard.get_frame_parameters(view[start:])
            if not header.has_checksum:
                raise damaged(f"frame {number} has no checksum")
            end = _frame_end(view, start, header.has_checksum)
            if end is None:
                raise damaged("it ends in the middle of a frame (truncated)")
            declared = header.content_size
            if declared == zstandard.CONTENTSIZE_UNKNOWN:
                raise damaged(f"frame {number} declares no size")
            _check_declared(path, number, declared, end - start, frame_limits)
            total += declared
            if total > MAX_TEXT_BYTES:
                raise damaged(f"its frames declare more than {MAX_TEXT_BYTES} bytes of text")
            try:  # into exactly the declared size: a frame holding more stops there
                inflated = decompressor.decompress(view[start:end])
            except zstandard.ZstdError as exc:
                raise damaged(
                    f"frame {number} does not inflate to the {declared} bytes its header "
                    f"declares ({exc})"
                ) from exc
            if len(inflated) != declared:
                raise damaged(
                    f"frame {number} holds {len(inflated)} bytes, its header says {declared}"
                )
            text = inflated.decode("utf-8")
            if not text.endswith("\n"):
                raise damaged("a frame does not end with a complete line")
            parts.append(text)
            start = end
    except (zstandard.ZstdError, UnicodeDecodeError) as exc:
        raise BundleError(f"signature log {path} is damaged: {exc}") from exc
    return "".join(parts)


def _check_declared(
    path: Path, number: int, declared: int, compressed: int, frame_limits: Sequence[int] | None
) -> None:
    """Refuse a frame that declares more text than it could hold, before it is inflated."""
    hint = (
        "sdcreplay never writes such a frame: the log was damaged or made to exhaust the memory "
        "of whoever reads it; take an intact copy from where it was recorded."
    )
    if declared > MAX_RATIO * compressed + RATIO_SLACK:
        raise BundleError(
            f"signature log {path} is damaged: frame {number} declares {declared} bytes of text "
            f"in {compressed} compressed bytes (a decompression bomb)",
            hint,
        )
    if frame_limits is None:
        return
    # A frame past the manifest's steps may hold what its largest step can: the log is then
    # refused for the step the manifest does not list, naming it.
    steps = frame_limits[1:] or frame_limits
    limit = frame_limits[number] if number < len(frame_limits) else max(steps)
    if declared > limit:
        raise BundleError(
            f"signature log {path} is damaged: frame {number} declares {declared} bytes of text, "
            f"more than the manifest's step can hold ({limit})",
            hint,
        )


_BLOCK_HEADER_BYTES = 3
_RLE_BLOCK, _RESERVED_BLOCK = 1, 3
_CHECKSUM_BYTES = 4


def _frame_end(view: memoryview, start: int, has_checksum: bool) -> int | None:
    """Where the zstd frame at ``start`` ends, read from its block headers (nothing inflated),
    or None when the data ends first."""
    position = start + zstandard.frame_header_size(view[start:])
    while True:
        if position + _BLOCK_HEADER_BYTES > len(view):
            return None
        block = int.from_bytes(view[position : position + _BLOCK_HEADER_BYTES], "little")
        last, kind, length = block & 1, (block >> 1) & 3, block >> 3
        if kind == _RESERVED_BLOCK:
            raise zstandard.ZstdError(f"a block of the reserved type at byte {position}")
        position += _BLOCK_HEADER_BYTES + (1 if kind == _RLE_BLOCK else length)
        if last:
            break
    position += _CHECKSUM_BYTES if has_checksum else 0
    return position if position <= len(view) else None
