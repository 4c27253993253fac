"""The fleet's commands: ``screen``, ``corpus add`` and ``devices list|show|clear|export``.

Registered on the same app as the pipeline's (``boundary.command``), each a library call of
`sdcreplay.fleet` rendered by `render_fleet`. ``--ledger`` names the ledger for one command
(default ``SDCREPLAY_LEDGER``, else the SQLite file in ``$SDCREPLAY_HOME``).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .boundary import app, command
from .options import InjectOpt, JsonOpt, NoLedgerOpt, preflight
from .output import Output
from .render_fleet import (
    render_corpus,
    render_device,
    render_devices,
    render_export,
    render_screen,
)

if TYPE_CHECKING:
    from ..replay.worker import DeviceResult

devices_app = typer.Typer(
    name="devices",
    help="The device ledger: every verdict per device, states, and the lines that drain them.",
    no_args_is_help=True,
)
corpus_app = typer.Typer(
    name="corpus", help="Screening corpora: tickets from real defects.", no_args_is_help=True
)
app.add_typer(devices_app)
app.add_typer(corpus_app)

LedgerOpt = Annotated[
    str | None,
    typer.Option(
        "--ledger",
        help="The ledger: a path, sqlite:///PATH or postgresql://... "
        "(default: SDCREPLAY_LEDGER, else $SDCREPLAY_HOME/ledger.sqlite).",
    ),
]
DeviceArg = Annotated[str, typer.Argument(help="Device id (devices list shows them) or label.")]


class StateName(str, Enum):
    healthy = "healthy"
    suspect = "suspect"
    confirmed = "confirmed"
    drill = "drill"
    cleared = "cleared"


class ExportFormatName(str, Enum):
    slurm = "slurm"
    kubernetes = "kubernetes"
    json = "json"
    tracker = "tracker"


@command(render_screen)
def screen(
    output: Output,
    corpus: Annotated[Path, typer.Argument(help="Corpus directory (`sdcreplay corpus add`).")],
    device: Annotated[
        list[str],
        typer.Option(
            "--device",
            "-d",
            help="Device label to screen (repeatable): cuda:N, cpu, or virtual replicas cpu:N; "
            "each in its own process, all at once.",
        ),
    ],
    budget: Annotated[
        float,
        typer.Option(
            min=1,
            help="Seconds the whole command may take, counted from its start (a Slurm prolog "
            "or HealthCheckProgram gets 60); it is never exceeded (docs/fleet.md).",
        ),
    ] = 60.0,
    trials: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Trials per ticket (default: each ticket's own, enough to see its measured "
            "rate fail with 99% probability).",
        ),
    ] = None,
    inject: InjectOpt = None,
    logs: Annotated[
        Path | None,
        typer.Option(
            help="Directory in which this run makes its own directory for the device processes' "
            "files (default CORPUS/.screen/; the system's temporary directory when the corpus "
            "cannot be written)."
        ),
    ] = None,
    no_ledger: NoLedgerOpt = False,
    json_mode: JsonOpt = False,
):
    """Run every ticket of CORPUS on every device; stop a device at its first failure.

    Exit 0 when every device passed, 1 when one failed a ticket, 3 when one could not be
    screened (skipped, out of budget, or its process failed).
    """
    preflight(paths={"corpus": [corpus]})
    from ..fleet.screen import process_started
    from ..fleet.screen import screen as run_screen

    with output.stages() as progress:

        def on_done(label: str, result: DeviceResult) -> None:
            progress.device_done("screening", label, result.error is not None, len(device))

        progress.update("screening", 0, len(device), ", ".join(device))
        return run_screen(
            corpus,
            device,
            budget=budget,
            trials=trials,
            inject=inject or [],
            log_dir=logs,
            started=process_started(),
            ledger=not no_ledger,
            on_done=on_done,
        )


@command(render_corpus, corpus_app)
def add(
    output: Output,
    corpus: Annotated[Path, typer.Argument(help="Corpus directory (created when absent).")],
    tickets: Annotated[
        list[Path], typer.Argument(help="Ticket directories written by `sdcreplay minimize`.")
    ],
    json_mode: JsonOpt = False,
):
    """Add tickets to a corpus; a ticket testing what one already there tests (same operator,
    shapes, dtypes and failing bits) is a duplicate and is left out."""
    preflight(paths={"ticket": tickets})
    from ..fleet.corpus import add_tickets

    return add_tickets(corpus, list(tickets))


@command(render_devices, devices_app, "list")
def list_devices(
    output: Output,
    state: Annotated[StateName | None, typer.Option(help="Only devices in this state.")] = None,
    ledger: LedgerOpt = None,
    json_mode: JsonOpt = False,
):
    """Every device the ledger names, with its state and the rule that decided it."""
    from ..fleet.devices import list_devices as listing

    return listing(ledger, state.value if state else None)


@command(render_device, devices_app)
def show(output: Output, device: DeviceArg, ledger: LedgerOpt = None, json_mode: JsonOpt = False):
    """A device's history: every record, oldest first, and its state."""
    from ..fleet.devices import show_device

    return show_device(device, ledger)


@command(render_device, devices_app)
def clear(
    output: Output,
    device: DeviceArg,
    reason: Annotated[str, typer.Option(help="Why it is cleared (RMA returned, diag passed).")],
    ledger: LedgerOpt = None,
    json_mode: JsonOpt = False,
):
    """Clear a device: its findings so far no longer count (a record says who and why)."""
    from ..fleet.devices import clear_device

    return clear_device(device, reason, ledger)


@command(render_export, devices_app)
def export(
    output: Output,
    format: Annotated[
        ExportFormatName,
        typer.Option(
            "--format",
            help="slurm (scontrol drain lines), kubernetes (kubectl taint lines), json, or "
            "tracker (Megatron's tracker lines).",
        ),
    ] = ExportFormatName.slurm,
    state: Annotated[
        list[StateName] | None,
        typer.Option(
            help="Devices in this state (repeatable; default suspect and confirmed, for tracker "
            "every state)."
        ),
    ] = None,
    ledger: LedgerOpt = None,
    json_mode: JsonOpt = False,
):
    """Print what a person would run to take suspect devices out of service; runs nothing."""
    from ..fleet.export import export as run_export

    states = tuple(choice.value for choice in state) if state else None
    return run_export(format.value, ledger, states)
