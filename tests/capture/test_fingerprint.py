"""Only comparable machines vote on a record: the fingerprint is recorded, pinned and compared.

A recording's kernel choices (ATen's CPU capability, MKL's CBWR branch) are
put in force in every device process; a property that cannot be (here: a
torch build the recording claims and this machine does not have) makes the
answer ``incomparable``, never ``recording_suspect`` or ``persistent``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import SMALL_ARGS

from sdcreplay.bundle.manifest import MANIFEST, MANIFEST_DIGEST, manifest_digest
from sdcreplay.capture import comparable, determinism
from sdcreplay.replay.doctor import doctor

# Kernel choices every machine can put in force, whatever its CPU: ATen's scalar kernels and
# MKL's compatible branch (ignored where torch has no MKL).
PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


@pytest.fixture(scope="module")
def _portable_template(tmp_path_factory, sdcreplay_exe: str) -> Path:
    """Recorded once, in its own process, under kernels any machine can put in force."""
    out = tmp_path_factory.mktemp("portable") / "portable.bundle"
    done = subprocess.run(
        [
            sdcreplay_exe,
            "record",
            "builtin:tiny-llama",
            "--steps",
            "2",
            *SMALL_ARGS,
            "--out",
            str(out),
        ],
        env={**os.environ, **PORTABLE},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def portable_bundle(_portable_template: Path, tmp_path: Path) -> Path:
    target = tmp_path / "portable.bundle"
    shutil.copytree(_portable_template, target)
    return target


def _replay(cli, bundle: Path, *args: str) -> tuple[int, dict, str]:
    unpinned = {name: None for name in PORTABLE}  # nothing pinned by hand: the tool must do it
    done = cli(
        "replay",
        bundle,
        "-d",
        "cpu:0",
        "-d",
        "cpu:1",
        "--json",
        "--logs",
        bundle.parent / "logs",
        *args,
        env=unpinned,
    )
    return done.exit_code, json.loads(done.stdout), done.stderr


def test_the_recorded_capability_is_put_in_force_on_every_replica(portable_bundle: Path, cli):
    recorded = json.loads((portable_bundle / MANIFEST).read_text())["fingerprint"]
    assert (recorded["cpu.capability"], recorded["cpu.blas_branch"]) == ("DEFAULT", "COMPATIBLE")
    code, report, _ = _replay(cli, portable_bundle)
    assert code == 0, report
    assert report["consensus"]["verdict"] == "correct"
    for device in report["devices"]:
        assert device["verdict"] == "match"
        assert (
            device["fingerprint"]["cpu.capability"],
            device["fingerprint"]["cpu.blas_branch"],
        ) == ("DEFAULT", "COMPATIBLE")
        assert device["fingerprint_differences"] == []


def _claim(bundle: Path, **properties) -> None:
    """Make the recording claim properties this machine cannot have (self-digest recomputed)."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["fingerprint"].update(properties)
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    (bundle / MANIFEST).write_text(json.dumps(manifest))


def test_a_property_that_cannot_be_put_in_force_is_incomparable_never_recording_suspect(
    portable_bundle: Path, cli
):
    """Both replicas disagree with the record (a fault on each): evidence against the record, were
    they comparable."""
    _claim(portable_bundle, **{"torch.git": "0" * 40})
    code, report, shown = _replay(
        cli,
        portable_bundle,
        "--inject",
        "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=0",
    )
    consensus = report["consensus"]
    assert code == 3
    assert (consensus["verdict"], consensus["suspects"]) == ("incomparable", [])
    assert report["record"]["verdict"] == "match"
    difference = f"torch.git: recorded {'0' * 40!r}, here {torch.version.git_version!r}"
    assert consensus["incomparable"] == {"cpu:0": [difference], "cpu:1": [difference]}
    assert [d["verdict"] for d in report["devices"]] == ["incomparable", "incomparable"]
    assert "torch.git" in consensus["advice"]
    assert "Verdict: incomparable" in shown
    assert f"cpu:0 did not vote on the record, its machine differs: {difference}" in " ".join(
        shown.split()
    )


def test_without_the_fault_the_same_replicas_would_have_accused_the_record(
    portable_bundle: Path, cli
):
    """The control for the test above: comparable replicas with a fault on each do blame the
    record."""
    code, report, _ = _replay(
        cli,
        portable_bundle,
        "--inject",
        "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=0",
    )
    assert (code, report["consensus"]["verdict"]) == (1, "recording_suspect")


def test_info_and_doctor_show_what_a_replay_must_match(small_bundle: Path, cli):
    about = json.loads(cli("info", small_bundle, "--json").stdout)
    here = determinism.fingerprint(torch.device("cpu"))
    assert about["fingerprint"]["cpu.capability"] == here["cpu.capability"]
    assert about["must_match"]["torch.git"] == torch.version.git_version
    assert "cpu.flags" in about["fingerprint"] and "cpu.flags" not in about["must_match"]
    shown = cli("info", small_bundle)
    assert "cpu.capability" in shown.stderr + shown.stdout
    checked = doctor("cpu", "builtin:tiny-llama", {"layers": 1, "dim": 32}).to_json()
    assert checked["must_match"] == comparable.must_match(here)
    assert checked["pinned"] == comparable.pinned_environment(here)


def test_pinning_leaves_a_variable_the_person_set(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert comparable.pinned_environment({"cpu.capability": "AVX2", "cpu.blas_branch": "AVX2"}) == {
        "MKL_CBWR": "AVX2"
    }
    assert comparable.fingerprint_differences(
        {"cpu.capability": "AVX2"}, {"cpu.capability": "DEFAULT"}
    ) == ["cpu.capability: recorded 'AVX2', here 'DEFAULT'"]
    # an older bundle without a fingerprint cannot be compared, and is not called different
    assert comparable.fingerprint_differences({}, {"cpu.capability": "DEFAULT"}) == []
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default"
