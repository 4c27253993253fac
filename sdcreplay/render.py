"""What a person sees: rich tables and progress on stderr, JSON on stdout.

Only the command-line layer imports this module (and rich).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape

__all__ = ["Output", "escape", "human_size", "styled"]
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import SdcReplayError

VERDICT_STYLE = {
    "match": "green", "correct": "green", "identical": "green",
    "persistent": "bold red", "divergent": "bold red", "recording_suspect": "bold red",
    "intermittent": "yellow", "transient": "yellow", "undecided": "yellow", "incomparable": "yellow",
    "error": "bold magenta",
}


def styled(word: str) -> str:
    style = VERDICT_STYLE.get(word)
    return f"[{style}]{word}[/]" if style else word


def human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


class Output:
    """One object that knows whether the person asked for JSON."""

    def __init__(self, json_mode: bool = False):
        self.json_mode = json_mode
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)

    def data(self, obj: dict) -> None:
        if self.json_mode:
            sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
            sys.stdout.flush()

    def say(self, text: str) -> None:
        self.console.print(text)

    def warn(self, text: str) -> None:
        self.console.print(f"[yellow]Warning:[/] {escape(text)}")

    def table(self, title: str | None, columns: list[str], rows: list[list[str]]) -> None:
        table = Table(title=title, title_justify="left", header_style="bold")
        for column in columns:
            table.add_column(column, overflow="fold")  # a device label or entry name is never cut short
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    def error(self, exc: SdcReplayError) -> None:
        self.console.print(f"[bold red]Error:[/] {escape(exc.message)}")
        self.console.print(f"[bold]Hint:[/] {escape(exc.hint)}")

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[callable]:
        """Yields ``advance(n=1, note=None)``; silent when stderr is not a terminal."""
        progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[note]}"), TimeElapsedColumn(),
            console=self.console, transient=True, disable=not self.console.is_terminal,
        )
        with progress:
            task = progress.add_task(description, total=total, note="")

            def advance(n: int = 1, note: str | None = None) -> None:
                progress.update(task, advance=n, **({"note": note} if note is not None else {}))

            yield advance
