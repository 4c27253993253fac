"""How a person and a script each read a command: rich on stderr, JSON on stdout.

Every renderer draws through one ``Output``, so the rules hold for all of them: a table
never cuts a name mid-word, progress is live on a terminal and one line per stage in a
log, a failure reads ``Error:`` + ``Hint:``, ``--json`` alone writes to stdout, and no
control character that came with a message (a terminal escape sequence in torch's text, a
carriage return, a bell) reaches the terminal (`without_controls`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .. import leftovers
from ..errors import SdcReplayError, error_json, interrupt_exit_code, interrupt_signal

__all__ = ["Output", "escape", "human_size", "prints_to_stderr", "styled"]

VERDICT_STYLE = {
    "match": "green",
    "correct": "green",
    "identical": "green",
    "persistent": "bold red",
    "divergent": "bold red",
    "recording_suspect": "bold red",
    "intermittent": "yellow",
    "transient": "yellow",
    "undecided": "yellow",
    "incomparable": "yellow",
    "spread": "cyan",
    "error": "bold magenta",
}
LONGEST_UNBROKEN = 48  # a value column is never narrower than its longest word, up to this
FOLD_FLOOR = 8  # the narrowest a value column folds to where the console is too narrow


_CONTROLS = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: titles, hyperlinks
    r"|\x1b[@-_]?"  # any other escape
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"  # C0 but newline and tab, DEL, C1
)


def without_controls(text: str) -> str:
    """``text`` without terminal control sequences and control characters (newlines and tabs
    kept): what a message from torch, a workload or a file may carry is printed, never obeyed."""
    return _CONTROLS.sub("", text)


def styled(word: str) -> str:
    style = VERDICT_STYLE.get(word)
    return f"[{style}]{word}[/]" if style else word


def human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def say_moved_aside(output: Output, what: str, moved: str | None) -> None:
    """Where ``--overwrite`` put the old bundle, report or ticket (it is never deleted)."""
    if moved:
        output.say(f"The {what} that was there is now {escape(moved)}")


def _longest_word(cell: str) -> int:
    return max((len(word) for word in Text.from_markup(cell).plain.split()), default=0)


def _counts(done: int | None, total: int | None) -> str:
    """``7/10``; ``7`` where the total is not known (a shrink): never ``7/?``."""
    if done is None:
        return ""
    return f"{done}/{total}" if total is not None else str(done)


class Stages:
    """Progress through named stages, each with its own count and (when known) total.

    On a terminal: a live bar per stage. Elsewhere (a batch job, a CI log) the
    live display would be lost, so each stage leaves one line when it ends:
    its name, count, total, note and elapsed time.
    """

    def __init__(self, console: Console):
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[counts]}"),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not self.live,
        )
        self.tasks: dict[str, TaskID] = {}
        self.current: dict[str, Any] | None = None
        self.ended: dict[str, list[tuple[str, bool]]] = {}

    def update(
        self, stage: str, done: int | None = None, total: int | None = None, note: str = ""
    ) -> None:
        """``stage`` has reached ``done`` of ``total`` (None: no count, or no known total)."""
        if self.current is None or self.current["stage"] != stage:
            self._close_current()
            self.current = {"stage": stage, "started": time.perf_counter()}
            self.tasks[stage] = self.progress.add_task(
                without_controls(stage), total=total, counts="", note=""
            )
        self.current.update(done=done, total=total, note=note)
        self.progress.update(
            self.tasks[stage],
            completed=done or 0,
            total=total,
            counts=_counts(done, total),
            note=escape(without_controls(note)),
        )

    def device_done(self, stage: str, label: str, failed: bool, total: int) -> None:
        """One of ``total`` device processes ended. The stage's last line sums them up (which
        failed, else all finished) rather than naming whichever process the scheduler ended
        last, so a log says the same of the same run."""
        ended = self.ended.setdefault(stage, [])
        ended.append((label, failed))
        if len(ended) < total:
            self.update(stage, len(ended), total, f"{label} {'failed' if failed else 'finished'}")
            return
        failures = [name for name, did_fail in ended if did_fail]
        note = f"{', '.join(failures)} failed" if failures else "all finished"
        self.update(stage, total, total, note)

    def begin(self, stage: str, note: str = "") -> None:
        """A new stage, even one named as the last (bisect replays a step on each device)."""
        self._close_current()
        self.update(stage, note=note)

    def _close_current(self) -> None:
        current = self.current
        if current is None:
            return
        if current["total"] is not None and current["done"] is not None:
            self.progress.update(self.tasks[current["stage"]], completed=current["total"])
        if not self.live:
            seconds = time.perf_counter() - current["started"]
            said = ", ".join(
                part
                for part in (_counts(current["done"], current["total"]), current["note"])
                if part
            )
            line = f"{escape(current['stage'])}: {escape(said)} ({seconds:.1f} s)"
            self.console.print(without_controls(line), highlight=False)
        self.current = None

    def close(self) -> None:
        self._close_current()


@contextlib.contextmanager
def prints_to_stderr() -> Iterator[None]:
    """While open, whatever else prints to stdout goes to stderr: a workload's or a script's
    ``print`` (``sys.stdout``), and, where stdout is a file descriptor, what C code and the
    processes started meanwhile (device processes, ranks) write to descriptor 1. Around a
    command's library call, so stdout carries only what the command itself writes after it
    (the one JSON object of ``--json``, an export's lines)."""
    sys.stdout.flush()
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test runner's buffer)
        descriptor = None
    saved = os.dup(1) if descriptor == 1 else None
    if saved is not None:
        os.dup2(2, 1)
    python_stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stdout = python_stdout
        if saved is not None:
            _flush_c_stdout()
            os.dup2(saved, 1)
            os.close(saved)


def _flush_c_stdout() -> None:
    """What C code buffered for descriptor 1 goes out while it still means stderr."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


class Output:
    """One object that knows whether the person asked for JSON."""

    def __init__(self, json_mode: bool = False, console: Console | None = None):
        self.json_mode = json_mode
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.printed = False  # the one JSON object is on stdout

    def data(self, obj: dict) -> None:
        if self.json_mode and not self.printed:
            sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
            sys.stdout.flush()
            self.printed = True

    def say(self, text: str) -> None:
        self.console.print(without_controls(text))

    def warn(self, text: str) -> None:
        self.say(f"[yellow]Warning:[/] {escape(text)}")

    def table(
        self,
        title: str | None,
        columns: list[str],
        rows: list[list[str]],
        fold: Sequence[int] = (),
    ) -> None:
        """A table whose cells wrap between words only, so a name (an operator, a module path,
        an entry, a device label) is never cut. ``fold``: the positions of columns that hold
        values (a hash, shapes, a sentence), which give up width where the console is too
        narrow, down to `FOLD_FLOOR` cells; where the names alone are wider than the console,
        the table is printed as wide as they need (a narrower terminal wraps the line, and the
        name stays one string to copy)."""
        widths, squeezed, excess = self._unbroken_widths(columns, rows, fold)
        title = None if title is None else without_controls(title)
        table = Table(title=title, title_justify="left", header_style="bold")
        for position, (column, width) in enumerate(zip(columns, widths)):
            if position in squeezed:  # narrower than its longest word: held there, folding
                table.add_column(column, overflow="fold", width=width)
            else:
                table.add_column(column, overflow="fold", min_width=width)
        for row in rows:
            table.add_row(*map(without_controls, row))
        wider = self.console.width + excess if excess > 0 else None
        self.console.print(table, width=wider)

    def _unbroken_widths(
        self, columns: list[str], rows: list[list[str]], fold: Sequence[int]
    ) -> tuple[list[int], set[int], int]:
        """Each column at least as wide as its longest word (a value column up to
        `LONGEST_UNBROKEN`); where they cannot all fit the console, the value columns, widest
        first, give up the difference (folding their words) where that makes the table fit.
        Returns the widths, the columns that gave some up, and the cells still missing."""
        widths = [
            max([_longest_word(column)] + [_longest_word(row[position]) for row in rows])
            for position, column in enumerate(columns)
        ]
        widths = [
            min(LONGEST_UNBROKEN, width) if position in fold else width
            for position, width in enumerate(widths)
        ]
        excess = sum(widths) + 3 * len(widths) + 1 - self.console.width  # padding and borders
        squeezed: set[int] = set()
        if excess > sum(max(0, widths[position] - FOLD_FLOOR) for position in fold):
            return widths, squeezed, excess  # wider than the console anyway: no word is cut
        for position in sorted(fold, key=lambda index: -widths[index]):
            given = max(0, min(excess, widths[position] - FOLD_FLOOR))
            if given:
                widths[position] -= given
                excess -= given
                squeezed.add(position)
        return widths, squeezed, excess

    def error(self, exc: SdcReplayError, exit_code: int = 3) -> None:
        """``Error:`` + ``Hint:`` on stderr; with ``--json`` the error object on stdout."""
        self.say(f"[bold red]Error:[/] {escape(exc.message)}")
        self.say(f"[bold]Hint:[/] {escape(exc.hint)}")
        self.data(exc.to_json(exit_code))

    def interrupted(self, exc: KeyboardInterrupt) -> None:
        """A ^C or SIGTERM ended the command: what it left on disk and what to do with it."""
        name = interrupt_signal(exc).name
        left = leftovers.take()
        self.say(f"[bold yellow]Interrupted[/] ({name}): every process it started is stopped.")
        for leftover in left:
            self.say(f"[bold]Left behind:[/] {escape(str(leftover))}")
        hint = "Run the command again; " + (
            "what it left is named above." if left else "it left nothing to clean up."
        )
        obj = error_json(f"interrupted by {name}", hint, interrupt_exit_code(exc), "interrupted")
        self.data({**obj, "leftovers": [str(leftover.path) for leftover in left]})

    @contextlib.contextmanager
    def stages(self) -> Iterator[Stages]:
        """Progress on stderr: live on a terminal, one line per stage elsewhere."""
        stages = Stages(self.console)
        with stages.progress:
            try:
                yield stages
            finally:
                stages.close()
