"""What the fleet commands tell a person: one line per screened device, the ledger's devices
and a device's history, and the lines that drain them (those on stdout: they are data)."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from .output import Output, escape, styled

if TYPE_CHECKING:
    from ..fleet.corpus import CorpusAddition
    from ..fleet.devices import DeviceHistory, DevicesListing
    from ..fleet.export import Export
    from ..fleet.screen import DeviceScreen, ScreenReport

STATE_STYLE = {
    "healthy": "green",
    "cleared": "green",
    "drill": "cyan",
    "suspect": "yellow",
    "confirmed": "bold red",
}


def _state(state: str) -> str:
    return f"[{STATE_STYLE.get(state, 'bold')}]{state}[/]"


def screen_line(device: DeviceScreen) -> str:
    status = device.status
    head = f"{device.device} ({device.identity.id}): "
    failure = device.failure
    if failure is not None:
        ticket = failure["ticket"]
        where = f"element {failure['element']}" if failure.get("element") is not None else ""
        bits = f" bit {failure['bits']}" if failure.get("bits") else ""
        mask = f" (XOR 0x{failure['xor']})" if failure.get("xor") else ""
        return (
            head + f"[bold red]FAILED[/] ticket {ticket['key']} {escape(ticket['op'])} at trial "
            f"{failure['trial']} of {failure['trials']}: {where}{bits}{mask}"
        )
    if status == "error":
        return head + f"{styled('error')}: {escape((device.error or {}).get('message', ''))}"
    passed, skipped = device.count("passed"), device.count("skipped")
    said = f"{passed} tickets passed" + (f", {skipped} skipped" if skipped else "")
    if status == "incomplete":
        return head + f"[yellow]incomplete[/]: {said} before the budget ran out"
    if status == "skipped":
        reasons = {ticket.get("reason", "") for ticket in device.tickets}
        return head + "[yellow]skipped[/]: no ticket applies (" + escape("; ".join(reasons)) + ")"
    return (
        head
        + f"[green]passed[/]: {said}"
        + (f" in {device.seconds:.1f} s" if device.seconds is not None else "")
    )


def render_screen(output: Output, report: ScreenReport) -> None:
    for device in report.devices:
        output.say(screen_line(device))
    data = report.to_json()
    output.say(
        f"{len(report.devices)} devices, {report.corpus_tickets} tickets, {data['seconds']:.1f} s "
        f"of a {report.budget:g} s budget" + (" (drill: injected faults)" if report.inject else "")
    )
    if report.drill_tickets and report.drill_tickets == report.corpus_tickets:
        output.warn(
            f"every ticket of {report.corpus} is a drill (made with injected faults): "
            "a pass says nothing about these devices; build a corpus from tickets of real "
            "findings"
        )
    elsewhere = f" (not in the corpus: {report.logs_elsewhere})" if report.logs_elsewhere else ""
    output.say(f"Logs: {escape(report.log_dir)}{escape(elsewhere)}")


def render_corpus(output: Output, addition: CorpusAddition) -> None:
    for ticket in addition.added:
        output.say(
            f"added {ticket.key}: {escape(ticket.op)} {ticket.shapes} {', '.join(ticket.dtypes)} "
            f"bits {ticket.bits or '-'} (from {escape(ticket.source)})"
            + (
                escape(
                    f" [drill: {'; '.join(ticket.drill_faults) or 'injected faults'}: it "
                    "tests the tooling, not a device]"
                )
                if ticket.drill
                else ""
            )
        )
    for duplicate in addition.duplicates:
        output.say(
            f"duplicate {duplicate['key']}: {escape(duplicate['ticket'])} tests what "
            f"{escape(duplicate['of'])} tests"
        )
    output.say(f"{addition.corpus}: {addition.tickets} tickets")


def render_devices(output: Output, listing: DevicesListing) -> None:
    output.say(f"ledger: {escape(listing.ledger)} ({listing.backend})")
    rows = [
        [
            escape(device.id),
            device.label,
            escape(device.host),
            _state(device.state),
            str(len(device.records)),
            escape(device.reason),
        ]
        for device in listing.devices
    ]
    output.table(None, ["id", "label", "host", "state", "records", "why"], rows)


def render_device(output: Output, history: DeviceHistory) -> None:
    device = history.device
    output.say(
        f"{escape(device.id)} ({device.label} on {escape(device.host)}, "
        f"{escape(device.model or 'unknown model')}): {_state(device.state)}: "
        f"{escape(device.reason)}"
    )
    rows = [
        [
            record.time[:19],
            record.command,
            record.verdict + (" (finding)" if record.finding else ""),
            escape(record.evidence),
            escape(record.job or "-"),
        ]
        for record in device.records
    ]
    output.table(None, ["time (UTC)", "command", "verdict", "evidence", "job"], rows)


def render_export(output: Output, exported: Export) -> None:
    if exported.format == "json":
        if not output.json_mode:
            sys.stdout.write(json.dumps(exported.to_json(), indent=2) + "\n")
        return
    if not output.json_mode:
        sys.stdout.write("".join(line + "\n" for line in exported.lines))
    if not exported.devices:
        output.say("no device in the ledger is in the states asked for: nothing to drain")
    refused = exported.refused()
    if refused:
        output.warn(
            f"{len(refused)} node(s) not exported: their host names are not valid "
            f"{exported.format} node names (the '# sdcreplay: not exported' lines say which)"
        )
