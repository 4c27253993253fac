"""The command line, in-process (CliRunner) and as the installed console script.

Contract (DESIGN.md): exit 0 success, 1 divergence, 2 usage error, 3 the tool
could not do its job, printed as ``Error: ...`` and ``Hint: ...`` on stderr
and never as a traceback; ``--json`` prints one object with a ``schema`` key.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import SMALL, SMALL_ARGS

from sdcreplay.bundle.manifest import MANIFEST, MANIFEST_DIGEST, manifest_digest
from sdcreplay.workload.definition import build_workload


def assert_tool_error(result, message: str) -> None:
    """Exit 3 with the Error/Hint pair on stderr, no traceback, nothing on stdout but the error
    object (with --json)."""
    output = f"{result.stdout}\n{result.stderr}"
    assert result.exit_code == 3, output
    assert "Traceback" not in output
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("Error: ")]
    hints = [line for line in lines if line.startswith("Hint: ")]
    assert len(errors) == 1 and len(hints) == 1, result.stderr
    assert message in errors[0], errors[0]
    assert len(hints[0]) > len("Hint: ") + 10
    assert lines.index(hints[0]) == lines.index(errors[0]) + 1
    if result.stdout:  # --json: the error object, and no result
        error = json.loads(result.stdout)
        assert error["schema"] == "sdcreplay.error/1" and error["exit_code"] == 3
        assert message in error["message"]


def edit_manifest(bundle: Path, edit) -> None:
    manifest = json.loads((bundle / MANIFEST).read_text())
    edit(manifest)
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=2))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


# --- happy path ---------------------------------------------------------------


def test_record_info_replay_json(tmp_path: Path, cli):
    bundle = tmp_path / "run.bundle"
    result = cli(
        "record", "builtin:tiny-llama", "--steps", "2", *SMALL_ARGS, "--out", bundle, "--json"
    )
    assert result.exit_code == 0, result.output
    recorded = json.loads(result.stdout)
    assert recorded["schema"] == "sdcreplay.record/1"
    assert recorded["bundle"] == str(bundle)
    assert recorded["workload"] == "builtin:tiny-llama"
    assert recorded["kwargs"] == {**SMALL, "seed": 0}
    assert (recorded["device"], recorded["steps"]) == ("cpu", 2)
    assert recorded["entries"] > 0 and recorded["size_bytes"] > 0
    assert isinstance(recorded["final_loss"], float)
    assert (
        f"Recorded 2 steps of builtin:tiny-llama on cpu: {recorded['entries']} signature entries"
        in result.stderr
    )
    # stderr is not a terminal here: the progress is one line per stage, with its count and time
    assert re.search(
        r"^recording builtin:tiny-llama: 2/2, loss \d+\.\d{4} \(\d+\.\d s\)$", result.stderr, re.M
    ), result.stderr

    result = cli("info", bundle, "--json")
    assert result.exit_code == 0, result.output
    about = json.loads(result.stdout)
    assert about["schema"] == "sdcreplay.info/1"
    assert about["integrity"] == "ok"
    assert about["complete"] is True
    assert about["workload"] == {"ref": "builtin:tiny-llama", "kwargs": {**SMALL, "seed": 0}}
    assert [step["index"] for step in about["steps"]] == [0, 1]
    assert about["entries"] == recorded["entries"]
    assert about["size_bytes"] == recorded["size_bytes"]

    result = cli("replay", bundle, "--json", "--logs", tmp_path / "logs")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["schema"] == "sdcreplay.replay/1"
    assert report["bundle"] == str(bundle)
    assert len(report["devices"]) == 1
    device = report["devices"][0]
    assert (device["device"], device["verdict"], device["first_divergence"]) == (
        "cpu",
        "match",
        None,
    )
    assert report["consensus"]["verdict"] == "correct"
    assert report["record"]["verdict"] == "match"
    assert all(Path(log).is_file() for log in device["logs"])
    assert re.search(r"^replaying: 1/1, all finished \(\d+\.\d s\)$", result.stderr, re.M)


def test_record_signature_boundary_and_info_shows_the_level(tmp_path: Path, cli):
    bundle = tmp_path / "b.bundle"
    recorded = cli(
        "record", "builtin:tiny-llama", "--steps", "2", *SMALL_ARGS, "--out", bundle,
        "--signature", "boundary", "--json",
    )  # fmt: skip
    assert recorded.exit_code == 0, recorded.output
    about = json.loads(cli("info", bundle, "--json").stdout)
    assert about["signature_level"] == "boundary"
    assert about["verification"]["status"] == "passed"
    assert about["entries"] == json.loads(recorded.stdout)["entries"]
    assert "boundary level" in cli("info", bundle).stderr
    refused = cli("record", "builtin:tiny-llama", "--signature", "every", "--out", tmp_path / "x")
    assert refused.exit_code == 2 and "every" in refused.output


def test_human_output_goes_to_stderr(small_bundle: Path, cli):
    result = cli("info", small_bundle)
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "builtin:tiny-llama" in result.stderr and "integrity" in result.stderr


def test_version_and_help(cli):
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.startswith("sdcreplay ")
    result = cli("--help")
    assert result.exit_code == 0
    for command in ("record", "replay", "info"):
        assert command in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["record"],
        ["replay"],
        ["record", "builtin:tiny-llama", "--steps", "0"],
        ["frobnicate"],
        ["record", "builtin:tiny-llama", "--arg", "no-equals-sign"],
    ],
    ids=["record-no-workload", "replay-no-bundle", "zero-steps", "unknown-command", "bad-arg"],
)
def test_usage_errors_exit_2(cli, args, tmp_path: Path):
    result = (
        cli(*args, "--out", tmp_path / "x.bundle")
        if args[0] == "record" and len(args) > 2
        else cli(*args)
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


# --- bad input: exit 3 with Error/Hint -----------------------------------------

RAISING_WORKLOAD = """
def make_workload(seed=0):
    raise RuntimeError("the data loader cannot reach the bucket")
"""


def _scenario(name: str, tmp_path: Path, small_bundle: Path) -> tuple[list, str]:
    """Set up one bad input; return the command line and the expected error text."""
    if name == "missing-bundle":
        return ["replay", tmp_path / "nope.bundle"], "nope.bundle does not exist"
    if name == "missing-bundle-info":
        return ["info", tmp_path / "nope.bundle", "--json"], "nope.bundle does not exist"
    if name == "truncated-step":
        truncate(small_bundle / "steps" / "000000.h5")
        return ["replay", small_bundle], "bundle file steps/000000.h5 is"
    if name == "truncated-state":
        truncate(small_bundle / "state.h5")
        return ["info", small_bundle], "bundle file state.h5 is"
    if name == "truncated-log":
        truncate(small_bundle / "signatures.jsonl.zst")
        return ["replay", small_bundle], "bundle file signatures.jsonl.zst is"
    if name == "garbage-manifest":
        (small_bundle / MANIFEST).write_text("{not json")
        return ["info", small_bundle], "is not valid JSON"
    if name == "wrong-schema":
        edit_manifest(small_bundle, lambda m: m.update(schema="sdcreplay.bundle/2"))
        return ["replay", small_bundle], "unsupported bundle schema 'sdcreplay.bundle/2'"
    if name == "wrong-sha256":
        edit_manifest(small_bundle, lambda m: m["files"]["state.h5"].update(sha256="f" * 64))
        return ["replay", small_bundle], "bundle file state.h5 does not match its SHA-256"
    if name == "hand-edited-manifest":
        manifest = json.loads((small_bundle / MANIFEST).read_text())
        manifest["steps"][0]["entries"] += 1
        (small_bundle / MANIFEST).write_text(json.dumps(manifest))
        return ["info", small_bundle], "the manifest does not match its own SHA-256"
    if name == "unknown-workload":
        return [
            "record",
            "builtin:nope",
            "--out",
            tmp_path / "x.bundle",
        ], "unknown built-in workload 'nope'"
    if name == "workload-raises":
        (tmp_path / "raising.py").write_text(textwrap.dedent(RAISING_WORKLOAD))
        return (
            ["record", f"{tmp_path / 'raising.py'}:make_workload", "--out", tmp_path / "x.bundle"],
            "raised RuntimeError: the data loader cannot reach the bucket",
        )
    if name == "workload-file-missing":
        return [
            "record",
            f"{tmp_path / 'nope.py'}:make_workload",
            "--out",
            tmp_path / "x.bundle",
        ], "does not exist"
    if name == "wrong-kwargs":
        return [
            "record",
            "builtin:tiny-llama",
            "-a",
            "colour=3",
            "--out",
            tmp_path / "x.bundle",
        ], "does not take these arguments"
    if name == "output-exists":
        return [
            "record",
            "builtin:tiny-llama",
            *SMALL_ARGS,
            "--out",
            small_bundle,
        ], "already exists"
    if name == "checkpoint-missing":
        return (
            [
                "record",
                "builtin:tiny-llama",
                "--checkpoint",
                tmp_path / "nope.pt",
                "--out",
                tmp_path / "x.bundle",
            ],
            "does not exist",
        )
    if name == "bad-device-label":
        return ["replay", small_bundle, "--device", "gpu0"], "unknown device label 'gpu0'"
    raise AssertionError(name)


BAD_INPUTS = [
    "missing-bundle",
    "missing-bundle-info",
    "truncated-step",
    "truncated-state",
    "truncated-log",
    "garbage-manifest",
    "wrong-schema",
    "wrong-sha256",
    "hand-edited-manifest",
    "unknown-workload",
    "workload-raises",
    "workload-file-missing",
    "wrong-kwargs",
    "output-exists",
    "checkpoint-missing",
    "bad-device-label",
]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_gives_error_and_hint(name: str, tmp_path: Path, small_bundle: Path, cli):
    args, message = _scenario(name, tmp_path, small_bundle)
    assert_tool_error(cli(*args), message)
    assert not (tmp_path / "x.bundle").exists() and not (tmp_path / "x.bundle.partial").exists()


@pytest.fixture
def changed_checkpoint_bundle(tmp_path: Path, cli) -> Path:
    """A bundle recorded from a checkpoint file that was overwritten afterwards."""
    workload = build_workload("builtin:tiny-llama", dict(SMALL, seed=0))
    checkpoint = tmp_path / "ckpt.pt"
    torch.save(
        {"model": workload.model.state_dict(), "optimizer": workload.optimizer.state_dict()},
        checkpoint,
    )
    bundle = tmp_path / "ckpt.bundle"
    result = cli(
        "record",
        "builtin:tiny-llama",
        "--steps",
        "1",
        *SMALL_ARGS,
        "--checkpoint",
        checkpoint,
        "--out",
        bundle,
    )
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        workload.model.tok_embeddings.weight[0, 0] += 1
    torch.save(
        {"model": workload.model.state_dict(), "optimizer": workload.optimizer.state_dict()},
        checkpoint,
    )
    return bundle


def assert_refused_in_the_replay_process(result, message: str) -> None:
    """Refused before any device process starts: exit 3 with Error/Hint, no traceback."""
    assert_tool_error(result, message)


def test_changed_checkpoint_is_refused(changed_checkpoint_bundle: Path, tmp_path: Path, cli):
    result = cli("replay", changed_checkpoint_bundle, "--logs", tmp_path / "logs")
    assert_refused_in_the_replay_process(result, "changed since the recording")


def test_conflicting_environment_is_refused(small_bundle: Path, tmp_path: Path, cli):
    """The replay process inherits CUBLAS_WORKSPACE_CONFIG=:16:8; determinism.apply refuses to
    override it."""
    result = cli(
        "replay",
        small_bundle,
        "--logs",
        tmp_path / "logs",
        env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"},
    )
    assert_refused_in_the_replay_process(
        result, "CUBLAS_WORKSPACE_CONFIG=':16:8' (recorded ':4096:8')"
    )


def test_error_text_is_printed_verbatim(tmp_path: Path, cli):
    (tmp_path / "brackets.py").write_text(
        'def make_workload(seed=0):\n    raise ValueError("shape [/batch] vs [red]")\n'
    )
    result = cli(
        "record", f"{tmp_path / 'brackets.py'}:make_workload", "--out", tmp_path / "x.bundle"
    )
    assert_tool_error(result, "raised ValueError: shape [/batch] vs [red]")


# --- the installed console script, in real processes -----------------------------


def test_console_script_record_and_replay(run_exe, tmp_path: Path):
    recorded = run_exe(
        "record", "builtin:tiny-llama", "--steps", "2", *SMALL_ARGS, "--out", "run.bundle", "--json"
    )
    assert recorded.returncode == 0, recorded.stderr
    assert json.loads(recorded.stdout)["schema"] == "sdcreplay.record/1"
    assert "Traceback" not in recorded.stderr
    replayed = run_exe("replay", "run.bundle", "--json")
    assert replayed.returncode == 0, replayed.stderr
    report = json.loads(replayed.stdout)
    assert report["devices"][0]["verdict"] == "match"
    assert report["devices"][0]["first_divergence"] is None


def test_console_script_bad_input(run_exe):
    done = run_exe("info", "missing.bundle")
    assert done.returncode == 3
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        "Error: the bundle missing.bundle does not exist",
        "Hint: Give the directory `sdcreplay record --out` wrote.",
    ]
