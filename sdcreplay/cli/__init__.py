"""The command line: options to one library call, its result drawn for a person (rich) or
as JSON, and the exit code. The only package that imports typer and rich."""

# ``.app`` first: importing it registers the commands on the Typer app, and importing a
# submodule sets the package's attribute of its name, so the Typer app is bound after it.
from .app import main
from .boundary import app

# isort: split
# After the pipeline's commands, so `--help` lists them first.
from . import fleet_commands  # noqa: F401 (registers screen, devices and corpus)

__all__ = ["app", "main"]
