"""The one error boundary: every command is registered through ``command``, which renders
its result, prints its JSON and maps failures to exit codes, so no command body prints a
traceback or picks an exit status itself.

Exit codes: 0 nothing diverged, 1 a finding (a divergence, a device that cannot
reproduce itself), 2 usage error, 3 the tool could not do its job (printed as
``Error:`` + ``Hint:``), 128 + N ended by signal N (130 ^C, 143 SIGTERM; `interrupts`).
With ``--json`` a failure is an ``sdcreplay.error/1`` object on stdout.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from .. import interrupts
from ..errors import SdcReplayError, WorkloadError, error_json, interrupt_exit_code
from .output import Output, prints_to_stderr

USAGE_HINT = "Run the command with --help for its arguments and options."


class _FlagsTakeNoValue:
    """--help shows no ``<bool>`` beside a flag (``--json``, ``--overwrite/--no-overwrite``,
    ``--help``): a flag takes no value, and the column is for the values options take.
    A usage error on a command line that asks for ``--json`` is also an error object on
    stdout (exit 2); typer prints it for the person as ever."""

    def get_params(self, ctx):
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params

    def make_context(self, info_name, args, parent=None, **extra):
        given = list(args)
        try:
            return super().make_context(info_name, args, parent=parent, **extra)  # type: ignore[misc]
        except typer.TyperException as exc:  # a usage error (typer's own click: exit 2)
            if "--json" in given and getattr(exc, "exit_code", None) == 2:
                Output(json_mode=True).data(
                    error_json(exc.format_message(), USAGE_HINT, 2, "usage")  # type: ignore[attr-defined]
                )
            raise


class Command(_FlagsTakeNoValue, TyperCommand):
    pass


class Group(_FlagsTakeNoValue, TyperGroup):
    def main(self, *args: Any, **kwargs: Any) -> Any:
        """A ^C or SIGTERM outside a command's body (while the command line is parsed) exits
        128 + the signal too, said as in a command (typer would exit 130, or 1, silently)."""
        try:
            return super().main(*args, **kwargs)
        except SystemExit as exc:  # typer's Abort or Exit(130), raised from the interrupt
            interrupt = getattr(exc.__context__, "__cause__", None)
            if isinstance(interrupt, KeyboardInterrupt):
                Output("--json" in sys.argv[1:]).interrupted(interrupt)
                sys.exit(interrupt_exit_code(interrupt))
            raise


app = typer.Typer(
    cls=Group,
    name="sdcreplay",
    help="Forensic replay of silent data corruption in PyTorch training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    add_completion=False,
)


def _exit_code(output: Output, action: Callable[[], int]) -> int:
    """Run a command; a tool failure becomes exit 3 with Error/Hint lines, never a traceback."""
    debug = os.environ.get("SDCREPLAY_DEBUG") == "1"
    try:
        return action()
    except (typer.TyperException, typer.Exit, typer.Abort):
        raise  # usage errors (exit 2) are typer's to print
    except KeyboardInterrupt as exc:
        output.interrupted(exc)
        return interrupt_exit_code(exc)
    except Exception as exc:
        if debug:
            raise
        output.error(
            exc
            if isinstance(exc, SdcReplayError)
            else SdcReplayError(
                f"unexpected {type(exc).__name__}: {exc}",
                "This is a bug in sdcreplay or the workload; rerun with SDCREPLAY_DEBUG=1 and "
                "report the traceback.",
            )
        )
    except SystemExit as exc:  # workload code called sys.exit(): the tool could not do its job
        if debug:
            raise
        output.error(
            WorkloadError(
                f"the workload called sys.exit({exc.code!r})",
                "Workload code must return or raise, not exit the process.",
            )
        )
    return 3


def command(
    renderer: Callable[[Output, Any], None],
    group: typer.Typer | None = None,
    name: str | None = None,
):
    """Register ``body(output, **options) -> result`` as a command rendered by ``renderer``
    (on ``group``, e.g. ``devices``, else on the app; named ``name``, else as the body).

    The result's ``to_json()`` is what ``--json`` prints and its ``exit_code``
    the exit status. A ledger that cannot take a verdict is said as ``Warning:``.
    """

    def register(body: Callable[..., Any]):
        @functools.wraps(body)
        def invoke(**options: Any) -> None:
            output = Output(options.get("json_mode", False))

            def action() -> int:
                from ..ledger.notes import warnings_to

                with warnings_to(output.warn), prints_to_stderr():
                    result = body(output, **options)
                if output.json_mode:  # first: a result the renderer says as an Error (an
                    output.data(result.to_json())  # incomparable replay) keeps its own JSON
                renderer(output, result)
                return result.exit_code

            with interrupts.handled():
                code = _exit_code(output, action)
            raise typer.Exit(code)

        signature = inspect.signature(body, eval_str=True)
        invoke.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=list(signature.parameters.values())[1:]
        )  # options only: not ``output``
        return (group or app).command(name, cls=Command)(invoke)

    return register
