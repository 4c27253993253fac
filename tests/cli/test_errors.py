"""Errors for scripts and Python users: the error object --json prints, the hint in a library
exception's str(), paths refused before torch loads, no control character on the terminal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import sdcreplay
from sdcreplay.errors import ERROR_SCHEMA, BundleError, SdcReplayError, message_of
from tests.conftest import SMALL

# Runs the command line in a fresh interpreter and says on stderr whether torch was imported.
ENTRY = """
import sys
from sdcreplay.cli import main
sys.argv = ["sdcreplay", *sys.argv[1:]]
try:
    main()
finally:
    print("torch imported" if "torch" in sys.modules else "torch not imported", file=sys.stderr)
"""

MISSING = {
    "info": (["info", "{missing}"], "the bundle {missing} does not exist"),
    "replay": (["replay", "{missing}"], "the bundle {missing} does not exist"),
    "bisect": (
        ["bisect", "{missing}", "--suspect", "cpu:1"],
        "the bundle {missing} does not exist",
    ),
    "ops": (["ops", "{missing}", "--step", "0"], "the bundle {missing} does not exist"),
    "doctor": (["doctor", "--against", "{missing}"], "the bundle {missing} does not exist"),
    "minimize": (["minimize", "{missing}"], "the report {missing} does not exist"),
    "diff": (["diff", "{missing}", "{missing}"], "the log {missing} does not exist"),
    "screen": (["screen", "{missing}", "-d", "cpu:0"], "the corpus {missing} does not exist"),
    "corpus add": (["corpus", "add", "C", "{missing}"], "the ticket {missing} does not exist"),
    "record --checkpoint": (
        ["record", "builtin:tiny-llama", "--checkpoint", "{missing}"],
        "the checkpoint {missing} does not exist",
    ),
    "record FILE.py:fn": (["record", "{missing}.py:make"], "the workload file {missing}.py does"),
}


def run_entry(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", ENTRY, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", list(MISSING))
def test_a_missing_path_is_refused_before_torch_loads(command, tmp_path):
    words, said = MISSING[command]
    missing = "no-such-$(touch PWNED)"
    args = [word.format(missing=missing) for word in words]
    ended = run_entry(*args, "--json", cwd=tmp_path)
    assert ended.returncode == 3, ended.stderr
    lines = ended.stderr.splitlines()
    assert lines[0].startswith(f"Error: {said.format(missing=missing)}"), ended.stderr
    assert lines[1].startswith("Hint: ") and lines[-1] == "torch not imported", ended.stderr
    error = json.loads(ended.stdout)
    assert error["schema"] == ERROR_SCHEMA and error["exit_code"] == 3
    assert error["message"].startswith(said.format(missing=missing))
    assert error["hint"] == lines[1].removeprefix("Hint: ")
    assert not (tmp_path / "PWNED").exists()


def test_a_failure_with_json_prints_the_error_object_and_nothing_else(small_bundle, cli):
    result = cli("replay", small_bundle, "--device", "cuda:7", "--json")
    assert result.exit_code == 3
    error = json.loads(result.stdout)
    assert set(error) == {"schema", "kind", "message", "hint", "exit_code"}
    assert error["kind"] == "DeviceError" and error["exit_code"] == 3
    assert "cuda:7" in error["message"] and error["hint"]


def test_a_usage_error_with_json_is_an_error_object_too(tmp_path):
    ended = run_entry("replay", "--json", "--repeats", "zero", cwd=tmp_path)
    assert ended.returncode == 2
    error = json.loads(ended.stdout)
    assert error["kind"] == "usage" and error["exit_code"] == 2
    assert error["message"].startswith("Invalid value for '--repeats'")
    assert "--help" in error["hint"]
    assert "Usage:" in ended.stderr  # typer's own message for the person stays


def test_a_library_error_says_its_hint_in_python_words(tmp_path):
    """The issue's case: a Python caller recording over a leftover partial recording reads why
    and what to pass, in Python (overwrite=True), not the CLI's --overwrite."""
    out = tmp_path / "run.bundle"
    (tmp_path / "run.bundle.partial").mkdir()
    with pytest.raises(BundleError) as caught:
        sdcreplay.record("builtin:tiny-llama", out, steps=1, kwargs=dict(SMALL))
    error = caught.value
    assert error.message == f"{out}.partial already exists (a leftover partial recording)"
    assert str(error) == f"{error.message}\nHint: {error.python_hint}"
    assert "overwrite=True" in str(error) and "--overwrite" not in str(error)
    assert "--overwrite" in error.hint  # what the command line prints


def test_an_error_quoted_in_another_message_says_its_hint_once():
    inner = BundleError("the manifest is damaged", "Record it again.")
    outer = SdcReplayError(f"replay failed: {message_of(inner)}", "Look at the bundle.")
    assert str(outer) == "replay failed: the manifest is damaged\nHint: Look at the bundle."
    assert message_of(ValueError("plain")) == "plain"


def test_hints_that_name_a_flag_have_python_words():
    """Every default hint naming a command-line flag has its Python wording beside it."""
    import inspect

    from sdcreplay import errors

    for _, kind in inspect.getmembers(errors, inspect.isclass):
        if issubclass(kind, SdcReplayError) and "--" in kind.default_hint:
            assert kind.default_python_hint and "--" not in kind.default_python_hint, kind


def test_control_characters_in_a_message_never_reach_the_terminal(cli, tmp_path):
    """A message carrying a terminal escape (as torch's checkpoint messages do) is printed
    without it, on the Error line and in the JSON's reader-facing text alike."""
    name = tmp_path / "a\x1b[31mred\x1b[0m\rbundle\x07"
    result = cli("replay", name)
    assert result.exit_code == 3
    first = result.stderr.splitlines()[0]
    assert first.startswith("Error: the bundle ") and "ared" in first and "bundle" in first
    assert not any(ord(char) < 32 or 127 <= ord(char) < 160 for char in first), repr(first)
