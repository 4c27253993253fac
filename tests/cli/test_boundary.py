"""Every command is registered through the one boundary: what --help shows for each option."""

from __future__ import annotations

import pytest

COMMANDS = ["record", "info", "replay", "diff", "ops", "bisect", "minimize", "doctor", "demo"]


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_flags_show_no_value_in_help(command: str | None, cli):
    """A flag takes no value, so its row has none (typer would show ``<bool>``); options that
    take one keep it."""
    result = cli(*([command] if command else []), "--help", env={"COLUMNS": "150"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.stdout
    rows = [line for line in result.stdout.splitlines() if "--help" in line]
    assert rows and "Show this message and exit." in rows[0]
    if command == "bisect":
        assert any("--out" in line and "<path>" in line for line in result.stdout.splitlines())


def test_a_flag_still_parses_as_one(small_bundle, cli):
    assert cli("info", small_bundle, "--json").stdout.startswith("{")
