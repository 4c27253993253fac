"""A screening corpus: a directory of tickets from real defects, one per defect class.

    CORPUS/
      corpus.json        sdcreplay.corpus/1: one entry per ticket, in the order added
      tickets/KEY/       a ticket directory as minimize wrote it (inputs.h5 with the inputs
                         and the healthy reference's expected output, ticket.json, repro.py)

A defect class is its operator, its minimal input shapes, their dtypes and the bits it
flips: two tickets alike in all four test the same thing, so the second is a duplicate
(``KEY`` is a digest of the four). Only reproduced tickets enter: a ticket whose suspect
never failed tests nothing. ``corpus.json`` is replaced atomically, so a reader never sees
half an update.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SdcReplayError
from ..ledger.schema import now
from ..minimize.ticket import INPUTS_FILE, JSON_FILE
from ..minimize.ticket import SCHEMA as TICKET_SCHEMA

SCHEMA = "sdcreplay.corpus/1"
CORPUS_FILE = "corpus.json"
TICKETS_DIR = "tickets"


class CorpusError(SdcReplayError):
    default_hint = (
        "A corpus is a directory made by `sdcreplay corpus add CORPUS TICKET...`; a ticket is "
        "a directory written by `sdcreplay minimize` (ticket.json, inputs.h5)."
    )


@dataclass(frozen=True)
class CorpusTicket:
    """One entry of corpus.json: what the ticket tests, and where its reference ran."""

    key: str
    op: str
    shapes: list
    dtypes: list[str]
    bits: list[int]
    reference: dict  # kind ("cpu"/"cuda") and model of the device the expected output is from
    recorded_on: dict  # kind and model of the device that failed it
    trials: int  # trials that see it fail with 99% probability at its measured rate
    rate: float
    drill: bool  # made with an injected fault (a test of the tooling)
    source: str
    added: str
    directory: str  # relative to the corpus
    incident: str | None = None  # the bundle the ticket was minimized from (its identity)
    injected_faults: tuple[str, ...] = ()  # a drill's faults
    recorded_faults: tuple[str, ...] = ()  # a drill's: its bundle was recorded with them

    @property
    def drill_faults(self) -> list[str]:
        """What makes it a drill, in words: the faults injected, and those recorded with."""
        return [*self.injected_faults, *(f"recorded with {s}" for s in self.recorded_faults)]

    def to_json(self) -> dict:
        return {
            **vars(self),
            "injected_faults": list(self.injected_faults),
            "recorded_faults": list(self.recorded_faults),
        }

    @classmethod
    def from_json(cls, data: dict) -> CorpusTicket:  # an entry of an older corpus lacks some
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        for name in ("injected_faults", "recorded_faults"):
            known[name] = tuple(known.get(name) or ())
        return cls(**known)


def defect_key(op: str, shapes: list, dtypes: list[str], bits: list[int]) -> str:
    """The defect class's name: the operator, minimal shapes, dtypes and failing bits."""
    text = json.dumps([op, shapes, dtypes, sorted(bits)], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _device(identity: dict) -> dict:
    return {"kind": identity.get("type"), "model": identity.get("name")}


def read_ticket(path: Path) -> CorpusTicket:
    """A minimize ticket directory as a corpus entry (not yet added: ``directory`` empty)."""
    try:
        doc = json.loads((path / JSON_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CorpusError(f"{path} is not a ticket directory ({JSON_FILE}: {exc})") from exc
    if not isinstance(doc, dict) or doc.get("schema") != TICKET_SCHEMA:
        raise CorpusError(f"{path / JSON_FILE} is not a ticket ({TICKET_SCHEMA})")
    if not (path / INPUTS_FILE).is_file():
        raise CorpusError(f"{path} has no {INPUTS_FILE} (the inputs and the expected output)")
    if doc.get("status") != "reproduced":
        raise CorpusError(
            f"{path} is a ticket that did not reproduce: it tests nothing",
            "Add tickets whose suspect failed (ticket.json status 'reproduced').",
        )
    try:
        op = doc["operator"]["op"]
        shapes = doc["shapes"]["minimal"]
        dtypes = list(doc["operator"]["dtypes"])
        bits = sorted(int(bit) for bit in (doc.get("bits") or {}).get("histogram", {}))
        rate = doc["minimal_rate"] or doc["rate"]
        trials = int(doc["acceptance"]["bad_trials"])
        reference, device = doc["reference"], doc["device"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CorpusError(f"{path / JSON_FILE} lacks what a corpus needs: {exc!r}") from exc
    return CorpusTicket(
        key=defect_key(op, shapes, dtypes, bits),
        op=op,
        shapes=shapes,
        dtypes=dtypes,
        bits=bits,
        reference=_device(reference),
        recorded_on=_device(device),
        trials=max(1, trials),
        rate=float(rate["rate"]),
        drill=bool(doc.get("drill")),
        source=str(path.resolve()),
        added=now(),
        directory="",
        incident=doc.get("incident"),
        injected_faults=tuple(doc.get("injected_faults") or ()),
        recorded_faults=tuple(doc.get("recorded_faults") or ()),
    )


def read_corpus(corpus: Path) -> list[CorpusTicket]:
    """The corpus's tickets in the order they were added (empty for a new directory)."""
    index = corpus / CORPUS_FILE
    if not index.exists():
        if corpus.is_dir() or not corpus.exists():
            return []
        raise CorpusError(f"{corpus} is not a directory")
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"schema {doc.get('schema')!r}, not {SCHEMA}")
        return [CorpusTicket.from_json(entry) for entry in doc["tickets"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorpusError(f"{index} is not a corpus index: {exc}") from exc


def _write_index(corpus: Path, tickets: list[CorpusTicket]) -> None:
    staging = corpus / f".{CORPUS_FILE}.{os.getpid()}"
    doc = {"schema": SCHEMA, "tickets": [ticket.to_json() for ticket in tickets]}
    staging.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    os.replace(staging, corpus / CORPUS_FILE)


@dataclass
class CorpusAddition:
    """What ``corpus add`` did: the tickets added, the duplicates (and of which entry)."""

    corpus: str
    added: list[CorpusTicket] = field(default_factory=list)
    duplicates: list[dict] = field(default_factory=list)  # ticket, key, of (its source)
    tickets: int = 0  # in the corpus now

    exit_code = 0

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "corpus": self.corpus,
            "added": [ticket.to_json() for ticket in self.added],
            "duplicates": self.duplicates,
            "tickets": self.tickets,
        }


def add_tickets(corpus: str | Path, tickets: list[str | Path]) -> CorpusAddition:
    """Add ticket directories to ``corpus`` (created when absent), skipping duplicates.

    Every ticket is read first: one that is not a reproduced ticket stops the command
    before anything is added."""
    corpus = Path(corpus)
    entries = read_corpus(corpus)
    candidates = [read_ticket(Path(ticket)) for ticket in tickets]
    corpus.mkdir(parents=True, exist_ok=True)
    by_key = {entry.key: entry for entry in entries}
    addition = CorpusAddition(str(corpus))
    for candidate in candidates:
        known = by_key.get(candidate.key)
        if known is not None:
            addition.duplicates.append(
                {"ticket": candidate.source, "key": candidate.key, "of": known.source}
            )
            continue
        directory = f"{TICKETS_DIR}/{candidate.key}"
        target = corpus / directory
        shutil.rmtree(target, ignore_errors=True)  # a copy left by an interrupted add
        shutil.copytree(candidate.source, target)
        entry = CorpusTicket.from_json({**candidate.to_json(), "directory": directory})
        entries.append(entry)
        by_key[entry.key] = entry
        addition.added.append(entry)
    _write_index(corpus, entries)
    addition.tickets = len(entries)
    return addition
