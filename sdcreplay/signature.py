"""The signature log: ``name -> digest`` entries in execution order, per step.

Stored as zstd-compressed JSON lines, one zstd frame per step, so a log cut off
mid-write still yields every step whose frame is complete. The same format is
used inside a bundle and for a replay's own log, so ``diff`` takes either.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from .errors import BundleError

SCHEMA = "sdcreplay.signatures/1"


def phase_of(name: str) -> str:
    """forward / backward / optimizer / state, from the entry's name."""
    kind = name.split(":", 1)[0]
    return {
        "forward": "forward",
        "loss": "forward",
        "backward": "backward",
        "grad": "backward",
        "param": "optimizer",
        "buffer": "optimizer",
        "rng": "state",
        "collective": "collective",
    }.get(kind, "other")


def layer_of(name: str) -> str:
    """The module path an entry belongs to (``forward:layers.1.attn#1`` -> ``layers.1.attn``)."""
    _, _, rest = name.partition(":")
    return rest.split("#", 1)[0] if rest else name


@dataclass
class SignatureLog:
    meta: dict
    steps: dict[int, list[tuple[str, str]]] = field(default_factory=dict)

    def entry_count(self) -> int:
        return sum(len(entries) for entries in self.steps.values())


class SignatureLogWriter:
    """Appends one frame per step and keeps the file's SHA-256 as it grows."""

    def __init__(self, path: Path, meta: dict):
        self.path = Path(path)
        self._hash = hashlib.sha256()
        self.size = 0
        self._compressor = zstandard.ZstdCompressor(level=3)
        self.path.write_bytes(b"")
        self._append([{"schema": SCHEMA, **meta}])

    def append_step(self, step: int, entries: list[tuple[str, str]]) -> None:
        self._append([{"step": step, "name": name, "digest": digest} for name, digest in entries])

    def _append(self, lines: list[dict]) -> None:
        text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
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


def read_signature_log(path: Path) -> SignatureLog:
    path = Path(path)
    try:
        raw = path.read_bytes()
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True)
        text = io.TextIOWrapper(reader, encoding="utf-8").read()
    except FileNotFoundError as exc:
        raise BundleError(f"signature log {path} does not exist") from exc
    except (zstandard.ZstdError, UnicodeDecodeError, OSError) as exc:
        raise BundleError(f"signature log {path} is damaged: {exc}") from exc
    lines = text.splitlines()
    if not lines:
        raise BundleError(f"signature log {path} is empty")
    try:
        meta = json.loads(lines[0])
        if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
            raise BundleError(
                f"{path} is not a signature log of schema {SCHEMA} (found {str(meta)[:60]!r})",
                "Give a bundle directory or a replay log written by this version of sdcreplay.",
            )
        steps: dict[int, list[tuple[str, str]]] = {}
        for line in lines[1:]:
            entry = json.loads(line)
            step, name, digest = entry["step"], entry["name"], entry["digest"]
            if not (isinstance(step, int) and isinstance(name, str) and isinstance(digest, str)):
                raise ValueError(f"bad entry {line[:80]!r}")
            steps.setdefault(step, []).append((name, digest))
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"signature log {path} is damaged: {exc}") from exc
    return SignatureLog(meta=meta, steps=steps)
