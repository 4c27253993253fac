"""A bundle is data: no command runs a workload it names unless the person trusts it.

Each untrusted manifest names code with a visible side effect (a marker file);
every command must leave the marker absent and, where it would need the code,
exit 3 naming the reference with the flag in its hint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, SMALL, preserved_global_state
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcreplay import record, replay_on_device
from sdcreplay.bundle import trust
from sdcreplay.bundle.manifest import MANIFEST, MANIFEST_DIGEST, manifest_digest
from sdcreplay.bundle.reader import Bundle
from sdcreplay.errors import UntrustedWorkloadError
from sdcreplay.replay import worker

WORKLOAD_FILE = """
from pathlib import Path
Path({marker!r}).write_text("imported")
from sdcreplay.workload.tiny_llama import make_workload
def make(**kwargs):
    return make_workload(**kwargs)
"""


def _rewrite(bundle: Path, workload: dict) -> None:
    """Edit the manifest as anyone can: a new workload, its self-digest recomputed."""
    path = bundle / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["workload"] = workload
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


@pytest.fixture(params=["subprocess", "file", "module"])
def hostile(request, small_bundle: Path, tmp_path: Path, monkeypatch) -> tuple[Path, str, Path]:
    """(bundle, reference, marker): the bundle names code that would create the marker."""
    marker = tmp_path / "marker"
    if request.param == "subprocess":
        ref, kwargs = "subprocess:run", {"args": ["touch", str(marker)]}
    else:
        source = tmp_path / "evil_workload.py"
        source.write_text(WORKLOAD_FILE.format(marker=str(marker)))
        kwargs = dict(SMALL)
        if request.param == "file":
            ref = f"{source}:make"
        else:
            monkeypatch.syspath_prepend(str(tmp_path))
            monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
            ref = "evil_workload:make"
    _rewrite(small_bundle, {"ref": ref, "kwargs": kwargs})
    yield small_bundle, ref, marker
    sys.modules.pop("evil_workload", None)


def _refused(result, ref: str) -> None:
    assert result.exit_code == 3, result.output
    assert f"names workload {ref!r}" in result.stderr
    assert "Hint:" in result.stderr and "--trust-workload" in result.stderr


def test_no_command_runs_an_untrusted_workload(hostile, cli, tmp_path: Path):
    bundle, ref, marker = hostile
    info = cli("info", bundle, "--json")
    assert info.exit_code == 0, info.output
    assert json.loads(info.stdout)["trusted"] is False
    assert cli("diff", bundle, bundle).exit_code == 0
    _refused(cli("replay", bundle, "-d", "cpu:0", "--logs", tmp_path / "logs"), ref)
    _refused(cli("bisect", bundle, "--suspect", "cpu:1", "--out", tmp_path / "report"), ref)
    _refused(
        cli("replay", bundle, "--workload", "builtin:tiny-llama", "--logs", tmp_path / "logs"), ref
    )
    assert (
        cli("minimize", bundle).exit_code == 3
    )  # minimize reads a bisect report; it never builds a workload
    assert not marker.exists()
    assert ref not in sys.modules and "evil_workload" not in sys.modules


def test_a_hand_made_task_cannot_skip_the_check(hostile, tmp_path: Path):
    bundle, ref, marker = hostile
    task = {
        "function": "sdcreplay.replay.session:run_replay_task",
        "device": "cpu:0",
        "result": str(tmp_path / "result.json"),
        "arguments": {"bundle": str(bundle), "repeats": 1, "log_dir": str(tmp_path / "logs")},
    }
    (tmp_path / "task.json").write_text(json.dumps(task))
    with preserved_global_state():
        assert worker.main(["worker", str(tmp_path / "task.json")]) == 3
    error = json.loads((tmp_path / "result.json").read_text())["error"]
    assert ref in error["message"] and "--trust-workload" in error["hint"]
    assert not marker.exists()


def _record_file_workload(tmp_path: Path) -> tuple[Path, str, Path]:
    marker = tmp_path / "imported"
    source = tmp_path / "my_workload.py"
    source.write_text(WORKLOAD_FILE.format(marker=str(marker)))
    bundle = tmp_path / "mine.bundle"
    with preserved_global_state():
        record(f"{source}:make", bundle, steps=1, kwargs=dict(SMALL))
    marker.unlink()
    return bundle, f"{source}:make", marker


def test_a_bundle_recorded_here_replays_without_a_flag_and_a_strangers_needs_one(
    tmp_path: Path, monkeypatch
):
    bundle, ref, marker = _record_file_workload(tmp_path)
    with preserved_global_state():
        log = replay_on_device(bundle, "cpu")
    assert sorted(log.steps) == [0] and marker.exists()
    marker.unlink()
    monkeypatch.setenv(trust.HOME_ENV, str(tmp_path / "another-user"))  # someone else's secret
    with (
        preserved_global_state(),
        pytest.raises(UntrustedWorkloadError, match="not recorded by this user"),
    ):
        replay_on_device(bundle, "cpu")
    assert not marker.exists()
    with preserved_global_state(), trust.granting([ref]):
        assert sorted(replay_on_device(bundle, "cpu").steps) == [0]
    assert marker.exists()
    secret = tmp_path / "another-user" / "secret"
    assert not secret.exists()  # checking a signature never creates a secret


def test_the_secret_is_private_and_made_once(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(trust.HOME_ENV, str(tmp_path / "home"))
    first = trust.sign({"workload": {"ref": "x:y", "kwargs": {}}})
    assert (tmp_path / "home" / "secret").stat().st_mode & 0o777 == 0o600
    assert trust.sign({"workload": {"ref": "x:y", "kwargs": {}}}) == first


def test_a_secret_two_processes_make_at_once_is_one_whole_secret(tmp_path: Path, monkeypatch):
    """Another process signs while this one makes the secret: neither reads it half-written
    (unsigned) nor signs with a secret that lost the race."""
    monkeypatch.setenv(trust.HOME_ENV, str(tmp_path / "home"))
    document = {"workload": {"ref": "x:y", "kwargs": {}}}
    token_hex = trust.secrets.token_hex
    meanwhile: list[str | None] = []

    def while_making(size: int) -> str:
        if not meanwhile:
            meanwhile.append(None)
            meanwhile[0] = trust.sign(document)
        return token_hex(size)

    monkeypatch.setattr(trust.secrets, "token_hex", while_making)
    signed = trust.sign(document)
    assert meanwhile[0] is not None and signed == meanwhile[0]
    assert [path.name for path in (tmp_path / "home").iterdir()] == ["secret"]


def test_a_secret_is_made_on_a_filesystem_without_hard_links(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(trust.HOME_ENV, str(tmp_path / "home"))

    def no_link(source, target):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(trust.os, "link", no_link)
    document = {"workload": {"ref": "x:y", "kwargs": {}}}
    signed = trust.sign(document)
    assert signed is not None and trust.signed_here({**document, trust.SIGNATURE: signed})
    assert [path.name for path in (tmp_path / "home").iterdir()] == ["secret"]


workloads = st.fixed_dictionaries(
    {
        "ref": st.text(min_size=1, max_size=40),
        "kwargs": st.dictionaries(
            st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8)), max_size=3
        ),
    }
)


@settings(max_examples=60, deadline=None)
@given(signed=workloads, swapped=workloads)
def test_only_builtins_and_the_signed_workload_are_trusted(signed, swapped):
    """A signature vouches for the workload it was made over and no other; nothing is imported to
    decide."""
    manifest = {"schema": "sdcreplay.bundle/1", "workload": signed}
    manifest[trust.SIGNATURE] = trust.sign(manifest)
    assert trust.is_trusted(signed["ref"], manifest)
    edited = {**manifest, "workload": swapped}
    modules = set(sys.modules)
    if swapped == signed or swapped["ref"].startswith("builtin:"):
        assert trust.is_trusted(swapped["ref"], edited)
    else:
        with pytest.raises(UntrustedWorkloadError) as refused:
            trust.require_trusted(swapped["ref"], edited)
        assert repr(swapped["ref"]) in refused.value.message
        assert "--trust-workload" in refused.value.hint
    assert set(sys.modules) == modules


def test_trusting_a_module_name_trusts_the_file_a_recording_stored(tmp_path: Path, monkeypatch):
    """A recording stores `mytrain:make_workload` (found only through its directory) as the
    file; the same name given with --workload from that directory trusts that file, and from
    anywhere else trusts nothing the bundle names. Nothing is imported."""
    (tmp_path / "mytrain_trusted.py").write_text("raise SystemExit('imported')\n")
    stored = f"{(tmp_path / 'mytrain_trusted.py').resolve()}:make_workload"
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with trust.granting(["mytrain_trusted:make_workload"]):
        assert stored in trust.granted()
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    with trust.granting(["mytrain_trusted:make_workload"]):
        assert stored not in trust.granted()
    assert "mytrain_trusted" not in sys.modules


def test_a_bundle_without_steps_is_refused(small_bundle: Path, cli, tmp_path: Path):
    """A .partial bundle from a loop that died before its first step holds nothing to replay."""
    manifest = json.loads((small_bundle / MANIFEST).read_text())
    for step in manifest["steps"]:
        del manifest["files"][step["file"]]
    manifest["steps"], manifest["complete"] = [], False
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    (small_bundle / MANIFEST).write_text(json.dumps(manifest))
    assert Bundle.open(small_bundle, verify=False).steps == []
    result = cli("replay", small_bundle, "--logs", tmp_path / "logs")
    assert result.exit_code == 3
    assert "holds no steps" in result.stderr and "Hint: There is nothing to replay" in result.stderr
