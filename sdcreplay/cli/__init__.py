"""The command line: options to one library call, its result drawn for a person (rich) or
as JSON, and the exit code. The only package that imports typer and rich."""

from .app import app, main

__all__ = ["app", "main"]
