"""``sdcreplay devices list|show|clear``: the ledger's devices, their states and histories.

Reading or clearing is the command's whole job, so a ledger that cannot be opened here is
an error (exit 3), not the warning a verdict's bookkeeping gets. Reading only reads: a
ledger on a read-only mount is listed, and one that does not exist is refused, not created.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SdcReplayError, message_of
from ..ledger.identity import host_name
from ..ledger.schema import Record
from ..ledger.store import Ledger, LedgerError
from .states import CLEAR_COMMAND, DeviceState, by_device, judge

LIST_SCHEMA = "sdcreplay.devices/1"
DEVICE_SCHEMA = "sdcreplay.device/1"


def _open(location: str | None, read_only: bool = True) -> Ledger:
    try:
        return Ledger.open(location, read_only=read_only)
    except LedgerError:
        raise
    except Exception as exc:  # sqlite3 / psycopg errors while migrating
        said = f"{type(exc).__name__}: {message_of(exc)}"
        raise LedgerError(f"cannot read the ledger: {said}") from exc


@dataclass
class DevicesListing:
    ledger: str
    backend: str
    devices: list[DeviceState]

    exit_code = 0

    def to_json(self) -> dict:
        return {
            "schema": LIST_SCHEMA,
            "ledger": self.ledger,
            "backend": self.backend,
            "devices": [device.to_json() for device in self.devices],
        }


def list_devices(location: str | None = None, state: str | None = None) -> DevicesListing:
    """Every device the ledger names (only those in ``state``, when given)."""
    with _open(location) as ledger:
        devices = by_device(ledger.records())
        listing = DevicesListing(ledger.location, ledger.backend, devices)
    if state is not None:
        listing.devices = [device for device in devices if device.state == state]
    return listing


@dataclass
class DeviceHistory:
    ledger: str
    device: DeviceState
    cleared: Record | None = None  # the record `clear` appended

    exit_code = 0

    def to_json(self) -> dict:
        return {
            "schema": DEVICE_SCHEMA,
            "ledger": self.ledger,
            **self.device.to_json(),
            "records": [record.to_json() for record in self.device.records],
            "cleared": self.cleared.to_json() if self.cleared else None,
        }


def _find(ledger: Ledger, name: str) -> list[Record]:
    """The records of the device ``name`` names: its id, or its label on this host (or on
    the only host that has it)."""
    records = ledger.records(name)
    if records:
        return records
    labelled = [record for record in ledger.records() if record.label == name]
    ids = {record.device_id for record in labelled}
    here = {record.device_id for record in labelled if record.host == host_name()}
    chosen = here if len(here) == 1 else ids
    if len(chosen) == 1:
        return [record for record in labelled if record.device_id in chosen]
    if not chosen:
        raise SdcReplayError(
            f"the ledger {ledger.location} has no device {name!r}",
            "Name a device by the id or label `sdcreplay devices list` shows.",
        )
    raise SdcReplayError(
        f"{name!r} names several devices: {', '.join(sorted(chosen))}",
        "Name the device by its id.",
    )


def show_device(name: str, location: str | None = None) -> DeviceHistory:
    with _open(location) as ledger:
        return DeviceHistory(ledger.location, judge(_find(ledger, name)))


def clear_device(name: str, reason: str, location: str | None = None) -> DeviceHistory:
    """Append a clearing record: findings before it no longer count (docs/fleet.md)."""
    if not reason.strip():
        raise SdcReplayError(
            "a clearing needs a reason", 'Say why: --reason "RMA returned, fieldiag passed"'
        )
    with _open(location) as reader:  # it exists, and names the device
        last = _find(reader, name)[-1]
    with _open(location, read_only=False) as ledger:
        record = Record(
            device_id=last.device_id,
            label=last.label,
            host=last.host,
            command=CLEAR_COMMAND,
            verdict="cleared",
            evidence=f"cleared: {reason.strip()}",
            identity=last.identity,
        )
        ledger.append([record])
        return DeviceHistory(ledger.location, judge(ledger.records(last.device_id)), record)
