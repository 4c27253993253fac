"""The bundle on disk: written atomically, read back exactly, refused when damaged.

The fuzz test is the promise of DESIGN.md's "Reliability and security": a
flipped byte or a truncation anywhere in a bundle gives a BundleError (exit 3
in the CLI), or, when the byte changed nothing (JSON whitespace), the very
same data; never any other exception, never other data.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import REPO, rewrite_manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sdcreplay
from sdcreplay.bundle.info import describe
from sdcreplay.bundle.job_bundle import JobBundle, is_job_bundle
from sdcreplay.bundle.job_manifest import JOB_FIELDS, JobManifest, ProcessGroupRecord, RankRecord
from sdcreplay.bundle.manifest import (
    MANIFEST,
    MANIFEST_DIGEST,
    MANIFEST_FIELDS,
    MESSAGES,
    SCHEMA,
    SIGNATURES,
    STATE,
    STATE_KINDS,
    CaptureSettings,
    DistributedInfo,
    EmbeddedState,
    Environment,
    FileMeta,
    Manifest,
    StepRecord,
    Switches,
    Verification,
    WorkloadRef,
    manifest_digest,
)
from sdcreplay.bundle.reader import MESSAGE_FIELDS, Bundle, workload_named
from sdcreplay.bundle.writer import BundleWriter, _readable_json, written_by_us
from sdcreplay.capture import determinism
from sdcreplay.errors import BundleError, SdcReplayError


def header() -> dict:
    """The writer's arguments: what a recording states before its first step."""
    return {
        "workload": WorkloadRef(ref="builtin:tiny-llama", kwargs={"layers": 1}),
        "device": "cpu",
        "device_type": "cpu",
        "digest": "xxh3-64",
        "environment": Environment(**determinism.environment(torch.device("cpu"))),
        "determinism": Switches(**determinism.current_switches()),
    }


def rng_state() -> determinism.RngState:
    torch.manual_seed(0)
    return determinism.capture_rng(torch.device("cpu"))


def write_bundle(path: Path, steps: int = 2, close: bool = True) -> BundleWriter:
    writer = BundleWriter(path, **header())
    model = torch.nn.Linear(3, 2)
    writer.embed_state(model.state_dict(), torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
    for index in range(steps):
        batch = {"x": torch.full((2, 3), float(index)), "meta": (index, "text")}
        entries = [
            ("rng:cpu", f"=uint8:{index:02x}"),
            ("forward:<root>", f"{index:016x}"),
            ("loss", "=float32:3f800000"),
        ]
        writer.add_step(index, batch, rng_state(), entries, optimizer_step=True)
    if close:
        writer.close()
    return writer


def canonical(value):
    """Tensors and arrays as (dtype, shape, bytes), so == compares bits."""
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            str(value.dtype),
            tuple(value.shape),
            value.contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
        )
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, dict):
        return {key: canonical(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [canonical(item) for item in value])
    return value


def evidence(path: Path) -> dict:
    """Everything a reader can get out of a bundle: info, every step, the state, the log."""
    bundle = Bundle.open(path)
    about = describe(path).to_json()
    steps = {}
    for index in bundle.step_indices:
        batch, rng = bundle.load_step(index)
        steps[index] = canonical([batch, rng.python, rng.numpy, rng.cpu, rng.accelerator])
    log = bundle.signature_log()
    log.meta.pop("source")  # where this copy lies
    return {
        "info": {key: value for key, value in about.items() if key not in ("bundle", "size_bytes")},
        "manifest": bundle.manifest.to_json(),
        "steps": steps,
        "state": canonical(bundle.load_state()),
        "log": (log.meta, log.steps),
    }


# --- writing -----------------------------------------------------------------


def test_writer_builds_in_partial_and_renames_on_close(tmp_path: Path):
    path = tmp_path / "run.bundle"
    writer = write_bundle(path, close=False)
    assert writer.path == tmp_path / "run.bundle.partial"
    assert not path.exists()
    partial = json.loads((writer.path / MANIFEST).read_text())
    assert partial["complete"] is False and len(partial["steps"]) == 2
    assert writer.close() == path
    assert not writer.path.exists()
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["complete"] is True
    assert sorted(os.listdir(path)) == sorted(
        [MANIFEST, SIGNATURES, "messages.jsonl.zst", STATE, "steps"]
    )
    assert sorted(os.listdir(path / "steps")) == ["000000.h5", "000001.h5"]
    assert not list(path.rglob("*.tmp"))


def test_manifest_layout(tmp_path: Path):
    path = tmp_path / "run.bundle"
    write_bundle(path)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["schema"] == SCHEMA == "sdcreplay.bundle/1"
    assert manifest["workload"] == {"ref": "builtin:tiny-llama", "kwargs": {"layers": 1}}
    assert manifest["state"] == {"kind": "embedded", "file": STATE}
    assert manifest["steps"] == [
        {
            "index": 0,
            "file": "steps/000000.h5",
            "entries": 3,
            "optimizer_step": True,
            "grads": "none",
        },
        {
            "index": 1,
            "file": "steps/000001.h5",
            "entries": 3,
            "optimizer_step": True,
            "grads": "none",
        },
    ]
    assert set(manifest["files"]) == {
        SIGNATURES,
        "messages.jsonl.zst",
        STATE,
        "steps/000000.h5",
        "steps/000001.h5",
    }
    for name, meta in manifest["files"].items():
        data = (path / name).read_bytes()
        assert meta["size"] == len(data)
        assert meta["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest[MANIFEST_DIGEST] == manifest_digest(manifest)


def test_round_trip_of_steps_and_state(tmp_path: Path):
    path = tmp_path / "run.bundle"
    write_bundle(path)
    bundle = Bundle.open(path)
    assert bundle.step_indices == [0, 1]
    batch, rng = bundle.load_step(1)
    assert torch.equal(batch["x"], torch.full((2, 3), 1.0))
    assert batch["meta"] == (1, "text")
    assert torch.equal(rng.cpu, rng_state().cpu)
    model_state, optimizer_state = bundle.load_state()
    assert set(model_state) == {"weight", "bias"}
    assert optimizer_state["param_groups"][0]["lr"] == 0.1
    assert bundle.signature_log().steps[1][1] == ("forward:<root>", "0000000000000001")
    with pytest.raises(BundleError, match="has no step 5"):
        bundle.load_step(5)


def test_writer_refuses_an_existing_bundle_unless_overwrite(tmp_path: Path):
    path = tmp_path / "run.bundle"
    write_bundle(path)
    with pytest.raises(BundleError, match="already exists"):
        BundleWriter(path, **header())
    writer = BundleWriter(path, **header(), overwrite=True)
    writer.embed_state({"w": torch.zeros(1)}, None)
    writer.close()
    assert Bundle.open(path).steps == []
    assert Bundle.open(path).load_state() == ({"w": torch.zeros(1)}, None)


def test_abort_leaves_nothing(tmp_path: Path):
    writer = write_bundle(tmp_path / "run.bundle", close=False)
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_open_falls_back_to_the_partial_bundle(tmp_path: Path):
    write_bundle(tmp_path / "run.bundle", close=False)
    bundle = Bundle.open(tmp_path / "run.bundle")
    assert bundle.path == tmp_path / "run.bundle.partial"
    assert bundle.complete is False
    assert bundle.step_indices == [0, 1]
    assert describe(tmp_path / "run.bundle").complete is False


def test_partial_bundle_with_a_half_written_step_reads_as_the_completed_steps(tmp_path: Path):
    """Killed after appending step 2's frame and file but before the manifest said so."""
    writer = write_bundle(tmp_path / "run.bundle", close=False)
    before = evidence(tmp_path / "run.bundle")
    with (writer.path / SIGNATURES).open("ab") as handle:
        handle.write(b"\x28\xb5\x2f\xfd\x24\x00 half a frame")
    (writer.path / "steps" / "000002.h5").write_bytes(b"\x89HDF half a file")
    (writer.path / "manifest.json.tmp").write_text('{"schema": "sdcreplay.bun')
    assert evidence(tmp_path / "run.bundle") == before


def test_a_complete_bundle_with_trailing_bytes_in_its_log_is_refused(tmp_path: Path):
    write_bundle(tmp_path / "run.bundle")
    with (tmp_path / "run.bundle" / SIGNATURES).open("ab") as handle:
        handle.write(b"extra")
    with pytest.raises(BundleError, match="the manifest says"):
        Bundle.open(tmp_path / "run.bundle")


def test_describe(small_bundle: Path):
    about = describe(small_bundle).to_json()
    assert about["schema"] == "sdcreplay.info/1"
    assert about["bundle_schema"] == SCHEMA
    assert about["integrity"] == "ok"
    assert about["complete"] is True
    assert about["workload"]["ref"] == "builtin:tiny-llama"
    assert [step["index"] for step in about["steps"]] == [0, 1]
    assert about["entries"] == sum(step["entries"] for step in about["steps"])
    assert about["size_bytes"] == sum(
        f.stat().st_size for f in small_bundle.rglob("*") if f.is_file()
    )
    json.dumps(about)


# --- the typed manifest ------------------------------------------------------


def _read_manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def test_a_recorded_manifest_survives_from_json_and_to_json(small_bundle: Path):
    """What the recorder wrote comes back exactly, key order included, through the types."""
    raw = _read_manifest(small_bundle)
    manifest = Manifest.from_json(raw)
    assert manifest.to_json() == raw and list(manifest.to_json()) == list(raw)
    assert _readable_json(manifest.to_json()) == (small_bundle / MANIFEST).read_text()
    assert isinstance(manifest.state, EmbeddedState) and manifest.state.file == STATE
    assert [type(step) for step in manifest.steps] == [StepRecord, StepRecord]
    assert manifest.steps[1].index == 1 and manifest.steps[1].file == "steps/000001.h5"
    assert manifest.files[STATE].size == (small_bundle / STATE).stat().st_size
    assert manifest.workload.ref == "builtin:tiny-llama" and manifest.workload.kwargs["seed"] == 0
    assert manifest.capture.to_json() == {"max_depth": None, "program": True, "naming": "plain"}
    assert manifest.capture.level == "layer"  # the default, not written
    assert manifest.verification.status == "passed" and manifest.verification.passed


def test_an_old_manifest_round_trips_without_gaining_keys():
    """traces/tiny.bundle predates grads, capture.program and verification: absent stays absent,
    and the readers see the defaults."""
    raw = _read_manifest(REPO / "traces" / "tiny.bundle")
    manifest = Manifest.from_json(raw)
    assert manifest.to_json() == raw
    assert "grads" not in raw["steps"][0] and manifest.steps[0].grads == "none"
    assert "verification" not in raw
    assert manifest.verification.to_json() == {"mode": "off", "status": "off"}
    assert "program" not in raw["capture"] and manifest.capture.program is False
    assert "naming" not in raw["capture"] and manifest.capture.naming == "wrapped"


def test_keys_this_version_does_not_know_are_kept(small_bundle: Path):
    """A newer writer's additions survive a read, so the digest and signature still verify."""

    def add(m):
        m["ranks"] = [{"rank": 0}]
        m["steps"][0]["note"] = "added by a later version"
        m["state"]["compression"] = None
        m["files"][STATE]["mtime"] = 1

    rewrite_manifest(small_bundle, add)
    raw = _read_manifest(small_bundle)
    manifest = Bundle.open(small_bundle).manifest
    assert manifest.to_json() == raw
    assert manifest.extra == {"ranks": [{"rank": 0}]}
    assert manifest.steps[0].extra == {"note": "added by a later version"}


def test_the_writer_and_the_reader_hold_the_same_manifest(tmp_path: Path):
    """BundleWriter fills the very types Manifest.from_json gives back: they cannot drift."""
    writer = write_bundle(tmp_path / "run.bundle", close=False)
    writer.set_verification("on", "failed", "loss differs")
    assert Manifest.from_json(_read_manifest(writer.path)) == writer.manifest
    writer.close()
    read = Bundle.open(tmp_path / "run.bundle").manifest
    assert read == writer.manifest and read.verification.problem == "loss differs"


def test_an_unknown_state_kind_is_refused_by_name(small_bundle: Path):
    rewrite_manifest(small_bundle, _set(["state"], {"kind": "pickle", "file": STATE}))
    with pytest.raises(BundleError) as refused:
        Bundle.open(small_bundle)
    assert refused.value.message == (
        'manifest is malformed: state.kind is "pickle", expected one of "embedded", "checkpoint"'
    )


def test_every_typed_field_has_a_validation_rule():
    """A field added to a type without a rule would reach readers unchecked."""
    tables = {
        Manifest: "",
        WorkloadRef: "workload.",
        Environment: "environment.",
        Switches: "determinism.",
        CaptureSettings: "capture.",
        Verification: "verification.",
    }
    missing = [
        f"{prefix}{name}"
        for cls, prefix in tables.items()
        for name in cls.names()
        if f"{prefix}{name}" not in MANIFEST_FIELDS
    ]
    missing += [
        f"{cls.__name__}.{name}"
        for cls in (
            *STATE_KINDS.values(),
            FileMeta,
            StepRecord,
            DistributedInfo,
            RankRecord,
            ProcessGroupRecord,
        )
        for name in cls.names()
        if name not in cls.RULES and name != "kind"
    ]
    missing += [
        f"JobManifest.{name}"
        for name in JobManifest.names()
        if name not in JOB_FIELDS and name != MANIFEST_DIGEST
    ]
    assert missing == []


def manifest_key_reads(source: str) -> list[str]:
    """Places in ``source`` that index, or call a dict method on, something named manifest,
    or name the manifest file itself: reading the manifest without its types."""
    found = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Subscript):
            target = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and (node.func.attr in ("get", "items", "keys", "values", "pop", "setdefault"))
        ):
            target = node.func.value
        elif isinstance(node, ast.Constant) and node.value == MANIFEST:
            found.append(f"{node.lineno}: {MANIFEST!r}")
        if target is not None and "manifest" in ast.unparse(target).lower():
            found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_manifest_key_reads_are_found():
    assert manifest_key_reads(
        'a = bundle.manifest["device"]\nb = opened.manifest.get("capture") or {}\n'
        'c = json.loads((path / "manifest.json").read_text())\nd = bundle.manifest.device\n'
    ) == ["1: bundle.manifest['device']", "2: opened.manifest.get('capture')", "3: 'manifest.json'"]


def test_no_module_but_bundle_reads_manifest_keys():
    """Changing the format touches the bundle package, its doc and its tests only."""
    package = Path(sdcreplay.__file__).parent
    offenders = [
        f"{path.relative_to(package)}:{place}"
        for path in sorted(package.rglob("*.py"))
        if not path.is_relative_to(package / "bundle")
        for place in manifest_key_reads(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


# --- refusing -----------------------------------------------------------------


def test_missing_bundle(tmp_path: Path):
    with pytest.raises(BundleError, match="is not a bundle directory"):
        Bundle.open(tmp_path / "nope.bundle")


def test_a_file_is_not_a_bundle(tmp_path: Path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(BundleError, match="is not a bundle directory"):
        Bundle.open(tmp_path / "file")


def test_directory_without_manifest(tmp_path: Path):
    (tmp_path / "empty.bundle").mkdir()
    with pytest.raises(BundleError, match="has no manifest.json"):
        Bundle.open(tmp_path / "empty.bundle")


def test_a_folder_of_bundles_is_named_as_such(small_bundle: Path, tmp_path: Path, cli):
    """`info traces/`: the folder's bundles, not "incomplete or damaged"."""
    folder = tmp_path / "traces"
    folder.mkdir()
    for name in ("b.bundle", "a.bundle"):
        shutil.copytree(small_bundle, folder / name)
    (folder / "notes").mkdir()
    result = cli("info", folder)
    assert result.exit_code == 3
    assert result.stderr.splitlines() == [
        f"Error: {folder} is a folder holding 2 bundles (a.bundle, b.bundle), not a bundle itself",
        f"Hint: Name one of them, e.g. {folder / 'a.bundle'}.",
    ]
    with pytest.raises(BundleError) as info:
        Bundle.open(folder / "notes")
    assert info.value.message == f"{folder / 'notes'} has no manifest.json: it is not a bundle"


@pytest.mark.parametrize("name", ["steps/000000.h5", STATE, SIGNATURES, "messages.jsonl.zst"])
def test_truncated_data_file(small_bundle: Path, name: str):
    file = small_bundle / name
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(BundleError, match=f"bundle file {name} is .* bytes, the manifest says"):
        Bundle.open(small_bundle)


def test_missing_data_file(small_bundle: Path):
    (small_bundle / "steps" / "000001.h5").unlink()
    with pytest.raises(BundleError, match="steps/000001.h5 is missing"):
        Bundle.open(small_bundle)


def test_flipped_byte_in_a_data_file(small_bundle: Path):
    file = small_bundle / STATE
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="does not match its SHA-256"):
        Bundle.open(small_bundle)
    # Without verification the bytes are read, and they are wrong: the check matters.
    assert Bundle.open(small_bundle, verify=False).path == small_bundle


def test_wrong_schema_version(small_bundle: Path):
    rewrite_manifest(small_bundle, lambda m: m.update(schema="sdcreplay.bundle/99"))
    with pytest.raises(BundleError) as info:
        Bundle.open(small_bundle)
    assert (
        info.value.message == "unsupported bundle schema 'sdcreplay.bundle/99' "
        "(this sdcreplay reads sdcreplay.bundle/1)"
    )
    assert "sdcreplay version that wrote the bundle" in info.value.hint


def test_wrong_file_sha256_in_manifest(small_bundle: Path):
    rewrite_manifest(small_bundle, lambda m: m["files"]["steps/000000.h5"].update(sha256="0" * 64))
    with pytest.raises(BundleError, match="steps/000000.h5 does not match its SHA-256"):
        Bundle.open(small_bundle)


def test_edited_value_without_rehash(small_bundle: Path):
    rewrite_manifest(small_bundle, lambda m: m["workload"]["kwargs"].update(layers=2), rehash=False)
    with pytest.raises(BundleError, match="does not match its own SHA-256"):
        Bundle.open(small_bundle)


def test_reformatted_manifest_is_still_valid(small_bundle: Path):
    before = evidence(small_bundle)
    manifest = json.loads((small_bundle / MANIFEST).read_text())
    (small_bundle / MANIFEST).write_text(json.dumps(dict(reversed(list(manifest.items())))))
    assert evidence(small_bundle) == before


def test_manifest_without_its_digest_is_refused(small_bundle: Path):
    rewrite_manifest(small_bundle, lambda m: m.pop(MANIFEST_DIGEST), rehash=False)
    with pytest.raises(BundleError, match="manifest is malformed: manifest_sha256"):
        Bundle.open(small_bundle)


def _set(path: list, value):
    def edit(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _delete(path: list):
    def edit(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return edit


HAND_EDITS = {
    "empty-object": (lambda m: m.clear(), "unsupported bundle schema None"),
    "steps-not-a-list": (_set(["steps"], {"0": "steps/000000.h5"}), "steps"),
    "index-a-string": (_set(["steps", 0, "index"], "0"), "steps\\[0\\].index"),
    "index-a-bool": (_set(["steps", 0, "index"], False), "steps\\[0\\].index"),
    "index-negative": (_set(["steps", 0, "index"], -1), "steps\\[0\\].index"),
    "entries-a-float": (_set(["steps", 0, "entries"], 3.0), "steps\\[0\\].entries"),
    "optimizer-step-an-int": (
        _set(["steps", 0, "optimizer_step"], 1),
        "steps\\[0\\].optimizer_step",
    ),
    "steps-out-of-order": (lambda m: m["steps"].reverse(), "increasing order"),
    "step-duplicated": (lambda m: m["steps"].append(m["steps"][0]), "increasing order"),
    "step-file-elsewhere": (_set(["steps", 1, "file"], "steps/000000.h5"), "steps\\[1\\].file"),
    "step-file-not-listed": (_delete(["files", "steps/000001.h5"]), "steps\\[1\\].file"),
    "state-file-not-listed": (_delete(["files", STATE]), "files\\['state.h5'\\]"),
    "log-not-listed": (_delete(["files", SIGNATURES]), "files\\['signatures.jsonl.zst'\\]"),
    "files-not-a-dict": (_set(["files"], []), "files"),
    "size-a-string": (_set(["files", STATE, "size"], "100"), "files\\['state.h5'\\]"),
    "sha-missing": (_delete(["files", STATE, "sha256"]), "files\\['state.h5'\\]"),
    "path-traversal": (
        lambda m: m["files"].update({"../outside": {"size": 1, "sha256": "0"}}),
        "file name",
    ),
    "absolute-path": (
        lambda m: m["files"].update({"/etc/passwd": {"size": 1, "sha256": "0"}}),
        "file name",
    ),
    "state-kind": (_set(["state", "kind"], "pickle"), "state.kind"),
    "state-file": (_set(["state", "file"], "other.h5"), "state.file"),
    "checkpoint-without-sha": (
        _set(["state"], {"kind": "checkpoint", "path": "/x.pt"}),
        "state.sha256 is missing",
    ),
    "workload-missing": (_delete(["workload"]), "workload is missing"),
    "kwargs-a-list": (_set(["workload", "kwargs"], []), "workload.kwargs"),
    "workload-kind-unknown": (_set(["workload", "kind"], "shell"), "workload.kind"),
    "script-without-command": (
        _set(["workload", "kind"], "script"),
        "workload.command \\(python, argv, cwd, env\\) is given for a workload of kind 'script'",
    ),
    "command-of-a-factory": (
        _set(["workload", "command"], {"python": "p", "argv": ["t.py"], "cwd": "/", "env": {}}),
        "and only for one",
    ),
    "script-argv-empty": (
        lambda m: m["workload"].update(
            kind="script", command={"python": "p", "argv": [], "cwd": "/", "env": {}}
        ),
        "workload.command.argv",
    ),
    "switch-a-string": (
        _set(["determinism", "deterministic_algorithms"], "true"),
        "determinism.deterministic_algorithms",
    ),
    "threads-zero": (_set(["determinism", "num_threads"], 0), "determinism.num_threads"),
    "precision-unknown": (
        _set(["determinism", "float32_matmul_precision"], "fast"),
        "float32_matmul_precision",
    ),
    "env-not-strings": (
        _set(["determinism", "env"], {"CUBLAS_WORKSPACE_CONFIG": 4096}),
        "determinism.env",
    ),
    "complete-a-string": (_set(["complete"], "yes"), "complete"),
    "digest-not-a-string": (_set([MANIFEST_DIGEST], 0), MANIFEST_DIGEST),
    "grads-unknown": (_set(["steps", 0, "grads"], "some"), r"steps\[0\]\.grads"),
    "state-objects-a-string": (_set(["state_objects"], "sched"), "state_objects"),
    "verification-status-unknown": (
        _set(["verification"], {"status": "trusted"}),
        "verification.status",
    ),
    "capture-program-a-string": (_set(["capture", "program"], "yes"), "capture.program"),
    "grads-null": (_set(["steps", 0, "grads"], None), r"steps\[0\]\.grads is null, expected one"),
    "verification-status-null": (
        _set(["verification", "status"], None),
        "verification.status is null",
    ),
    "capture-a-list": (_set(["capture"], []), "capture is \\[\\], expected an object"),
    "capture-level-unknown": (_set(["capture", "level"], "every"), "capture.level"),
    "capture-naming-unknown": (_set(["capture", "naming"], "short"), "capture.naming"),
    "capture-boundary-without-program": (
        lambda m: m["capture"].update(level="boundary", program=False),
        "capture.program is true at capture.level 'boundary'",
    ),
}


@pytest.mark.parametrize("edit", sorted(HAND_EDITS))
def test_hand_edited_manifests_raise_bundle_error(small_bundle: Path, edit: str):
    change, message = HAND_EDITS[edit]
    if edit == "digest-not-a-string":
        rewrite_manifest(small_bundle, change, rehash=False)
    else:
        rewrite_manifest(small_bundle, change)
    with pytest.raises(BundleError, match=message):
        evidence(small_bundle)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set(["steps", 1, "entries"], 5), "holds .* entries for step 1, the manifest says 5"),
        (
            lambda m: m["steps"].pop(),
            "the signature log holds steps \\[0, 1\\], the manifest lists \\[0\\]",
        ),
    ],
    ids=["entry-count", "step-dropped"],
)
def test_manifest_must_agree_with_the_signature_log(small_bundle: Path, edit, message: str):
    rewrite_manifest(small_bundle, edit)
    with pytest.raises(BundleError, match=message):
        describe(small_bundle)


def test_unknown_keys_in_a_step_are_ignored(small_bundle: Path):
    rewrite_manifest(small_bundle, lambda m: m["steps"][0].update(note="added by a later version"))
    assert Bundle.open(small_bundle).step_indices == [0, 1]


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '"a string"', "\xff\xfe", "[" * 100000])
def test_manifest_that_is_not_a_json_object(small_bundle: Path, text: str):
    (small_bundle / MANIFEST).write_bytes(
        text.encode("latin-1") if text == "\xff\xfe" else text.encode()
    )
    with pytest.raises(BundleError):
        Bundle.open(small_bundle)


# --- fuzz ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_original(_small_bundle_template: Path) -> tuple[Path, dict, list[str]]:
    files = sorted(
        str(f.relative_to(_small_bundle_template))
        for f in _small_bundle_template.rglob("*")
        if f.is_file()
    )
    return _small_bundle_template, evidence(_small_bundle_template), files


def _check_damaged(template: Path, original: dict, name: str, damage) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "fuzz.bundle"
        shutil.copytree(template, path)
        file = path / name
        data = bytearray(file.read_bytes())
        file.write_bytes(bytes(damage(data)))
        try:
            got = evidence(path)
        except SdcReplayError:
            return "refused"
        # Any other exception propagates and fails the test.
        assert got == original, f"{name} damaged, read back as different data"
        return "same"


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzz_flipped_or_truncated_files(fuzz_original, data):
    template, original, files = fuzz_original
    name = data.draw(st.sampled_from(files), label="file")
    size = (template / name).stat().st_size
    if data.draw(st.booleans(), label="truncate"):
        length = data.draw(st.integers(0, size - 1), label="length")
        assert _check_damaged(template, original, name, lambda b: b[:length]) == "refused"
    else:
        position = data.draw(st.integers(0, size - 1), label="position")
        mask = data.draw(st.integers(1, 255), label="mask")

        def flip(b: bytearray) -> bytearray:
            b[position] ^= mask
            return b

        outcome = _check_damaged(template, original, name, flip)
        if name != MANIFEST:
            assert outcome == "refused"  # every data file is covered by its SHA-256


def test_sweep_of_manifest_byte_flips(fuzz_original):
    """Deterministic companion of the fuzz test: flips spread over the whole manifest."""
    template, original, _ = fuzz_original
    size = (template / MANIFEST).stat().st_size
    outcomes = []
    for position in range(0, size, max(1, size // 60)):
        for mask in (0x01, 0x20):

            def flip(b: bytearray, position=position, mask=mask) -> bytearray:
                b[position] ^= mask
                return b

            outcomes.append(_check_damaged(template, original, MANIFEST, flip))
    assert outcomes.count("refused") > 0.8 * len(outcomes)


def test_state_is_hdf5_with_plain_datasets(small_bundle: Path):
    """Readable with h5py alone; nothing in a bundle is a pickle."""
    with h5py.File(small_bundle / STATE, "r") as handle:
        assert set(handle) == {"model", "optimizer"}
        skeleton = json.loads(handle["model"].attrs["skeleton"])
        name, node = skeleton["dict"][0]
        assert name == "tok_embeddings.weight"
        dataset = handle["model"][node["tensor"]]
        assert dataset.dtype == np.float32 and dataset.attrs["dtype"] == "float32"
    magic = {".json": b"{", ".h5": b"\x89HDF\r\n\x1a\n", ".zst": b"\x28\xb5\x2f\xfd"}
    for file in small_bundle.rglob("*"):
        if file.is_file():
            assert file.read_bytes().startswith(magic[file.suffix]), file.name


def test_the_manifest_is_written_one_line_per_step(tmp_path: Path):
    """Rewritten after every step, the manifest is encoded line by line (json's C encoder)."""
    writer = write_bundle(tmp_path / "run.bundle", steps=3)
    text = (writer.final_path / MANIFEST).read_text()
    assert json.loads(text) == writer.manifest.to_json()
    step_lines = [line for line in text.splitlines() if line.startswith('    {"index": ')]
    assert [json.loads(line.rstrip(","))["index"] for line in step_lines] == [0, 1, 2]


# --- job bundles (one part per rank; recorded once per session by tests/job_script.py) -------


@pytest.fixture
def job(tmp_path: Path, ddp_job: tuple[Path, Path]) -> Path:
    """A private copy of the session's 2-rank DDP job bundle, free to damage."""
    target = tmp_path / "job.bundle"
    shutil.copytree(ddp_job[0], target)
    return target


def retie(job: Path, rank: int) -> None:
    """Make the job manifest vouch for rank ``rank``'s part as it is now."""
    part = json.loads((job / f"ranks/{rank:06d}" / MANIFEST).read_text())
    rewrite_manifest(job, _set(["ranks", rank, MANIFEST_DIGEST], part[MANIFEST_DIGEST]))


def test_a_job_bundle_is_a_job_manifest_over_complete_rank_parts(job: Path):
    assert sorted(p.name for p in job.iterdir()) == [MANIFEST, "ranks"]
    assert sorted(p.name for p in (job / "ranks").iterdir()) == ["000000", "000001"]
    manifest = json.loads((job / MANIFEST).read_text())
    assert list(manifest) == [
        "schema",
        "created",
        "complete",
        "world_size",
        "backend",
        "process_groups",
        "ranks",
        "workload",
        "layout",
        "signature",
        MANIFEST_DIGEST,
    ]
    assert manifest["layout"]["dimensions"] == [{"name": "dp", "size": 2, "kind": "replicate"}]
    assert (manifest["schema"], manifest["world_size"], manifest["backend"]) == (
        "sdcreplay.job/1",
        2,
        "gloo",
    )
    assert manifest["process_groups"] == [{"pg_id": 0, "name": "0", "ranks": [0, 1]}]
    assert JobManifest.from_json(manifest).to_json() == manifest
    for rank in (0, 1):
        part = json.loads((job / f"ranks/{rank:06d}" / MANIFEST).read_text())
        assert manifest["ranks"][rank] == {
            "rank": rank,
            "device": "cpu",
            "part": f"ranks/{rank:06d}",
            MANIFEST_DIGEST: part[MANIFEST_DIGEST],
        }
        assert part["schema"] == SCHEMA
        assert part["distributed"] == {
            "rank": rank,
            "world_size": 2,
            "backend": "gloo",
            "job": "../..",
            "ddp_iterations_before": 0,  # its DDP's first iteration is the first step
        }
        assert [step["messages"] for step in part["steps"]] == [3, 5]
        assert part["workload"] == manifest["workload"]
    assert is_job_bundle(job)
    assert written_by_us(job)


def test_a_part_opens_alone_and_a_job_is_not_a_single_bundle(job: Path, small_bundle: Path):
    with pytest.raises(BundleError, match="is a job bundle") as refused:
        Bundle.open(job)
    assert "ranks/000000" in refused.value.hint
    part = Bundle.open(job / "ranks/000001")
    assert [len(messages) for messages in part.messages().values()] == [3, 5]
    assert not is_job_bundle(small_bundle)
    assert not is_job_bundle(job / "missing")
    assert Bundle.open(small_bundle).messages() == {0: [], 1: []}


def test_overwrite_replaces_only_a_job_bundle_sdcreplay_wrote(job: Path):
    (job / "ranks" / "notes.txt").write_text("mine")
    assert not written_by_us(job)


JOB_EDITS = {
    "world-size": (_set(["world_size"], 3), "2 ranks listed for world_size 3"),
    "part-elsewhere": (_set(["ranks", 1, "part"], "ranks/000000"), r"ranks\[1\]\.part"),
    "rank-numbering": (_set(["ranks", 1, "rank"], 0), r"ranks\[1\]\.rank is 0"),
    "complete-untied": (
        _set(["ranks", 0, MANIFEST_DIGEST], None),
        r"ranks\[0\]\.manifest_sha256 is null in a complete job",
    ),
    "part-digest-missing": (_delete(["ranks", 0, MANIFEST_DIGEST]), "manifest_sha256 is missing"),
    "part-of-another-job": (
        lambda m: m["ranks"][0].update({MANIFEST_DIGEST: m["ranks"][1][MANIFEST_DIGEST]}),
        "ranks/000000's manifest is not the one the job manifest lists",
    ),
    "backend-a-number": (_set(["backend"], 5), "backend is 5"),
    "groups-not-a-list": (_set(["process_groups"], {}), "process_groups"),
    "group-ranks-strings": (
        _set(["process_groups", 0, "ranks"], ["0"]),
        r"process_groups\[0\]\.ranks",
    ),
    "device-label": (_set(["ranks", 0, "device"], "tpu:x"), r"ranks\[0\]\.device"),
    "another-workload": (
        _set(["workload", "kwargs", "seed"], 1),
        "ranks/000000 names another workload than its job manifest",
    ),
    "schema": (_set(["schema"], "sdcreplay.job/2"), "unsupported bundle schema"),
}


@pytest.mark.parametrize("edit", sorted(JOB_EDITS))
def test_hand_edited_job_manifests_raise_bundle_error(job: Path, edit: str):
    change, message = JOB_EDITS[edit]
    rewrite_manifest(job, change)
    with pytest.raises(BundleError, match=message):
        describe(job)


PART_EDITS = {
    "rank-swapped": (
        _set(["distributed", "rank"], 0),
        r"ranks/000001 is not rank 1 of a 2-rank job",
    ),
    "rank-beyond-world": (
        _set(["distributed", "rank"], 5),
        "distributed.rank 5 is not below its world_size 2",
    ),
    "job-elsewhere": (_set(["distributed", "job"], "/"), "distributed.job"),
    "messages-uncounted": (
        _delete(["steps", 0, "messages"]),
        r"steps\[0\]\.messages is missing \(a rank part\)",
    ),
    "messages-miscounted": (
        _set(["steps", 0, "messages"], 4),
        r"holds 8 messages in steps \[0, 1\], the manifest counts 9 in \[0, 1\]",
    ),
}


@pytest.mark.parametrize("edit", sorted(PART_EDITS))
def test_hand_edited_rank_parts_raise_bundle_error(job: Path, edit: str):
    change, message = PART_EDITS[edit]
    rewrite_manifest(job / "ranks/000001", change)
    retie(job, 1)
    with pytest.raises(BundleError, match=message):
        describe(job)


def test_a_message_with_a_field_of_the_wrong_form_is_refused_by_name(job: Path):
    import bundle_fuzz

    part = job / "ranks/000000"
    frames = [
        text.decode().splitlines() for text in bundle_fuzz._frames((part / MESSAGES).read_bytes())
    ]
    record = json.loads(frames[1][0])
    record["profiling_name"] = "all_reduce with no backend"
    frames[1][0] = json.dumps(record)
    compressor = bundle_fuzz.zstandard.ZstdCompressor(write_checksum=True)
    (part / MESSAGES).write_bytes(
        b"".join(compressor.compress(("\n".join(f) + "\n").encode()) for f in frames)
    )
    bundle_fuzz.rehash(part, MESSAGES)
    retie(job, 0)
    with pytest.raises(BundleError, match="malformed: line 1: profiling_name is"):
        JobBundle.open(job).rank(0).messages()
    assert set(MESSAGE_FIELDS) == {f for f in record}


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1))
def test_fuzz_job_bundles_never_give_a_traceback(ddp_job, seed: int):
    import random

    import bundle_fuzz

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "job.bundle"
        shutil.copytree(ddp_job[0], path)
        what = bundle_fuzz.job_edit(path, random.Random(seed))
        outcome = bundle_fuzz.judge_job(path)
        assert not outcome.is_bug, f"{what}: {outcome.detail}"


def test_a_partial_job_reads_the_parts_that_have_a_manifest(job: Path):
    def cut_off(manifest: dict) -> None:
        manifest["complete"] = False
        for rank in manifest["ranks"]:
            rank[MANIFEST_DIGEST] = None

    rewrite_manifest(job, cut_off)
    partial = job.with_name("job.bundle.partial")
    job.rename(partial)
    (partial / "ranks/000001" / MANIFEST).unlink()  # rank 1 died before writing its manifest
    opened = JobBundle.open(job)
    assert (opened.path, opened.complete, sorted(opened.parts)) == (partial, False, [0])
    with pytest.raises(BundleError, match="has no part for rank 1") as refused:
        opened.rank(1)
    assert "holds none of its data" in refused.value.hint
    about = describe(job)
    assert (about.complete, about.ranks, about.messages) == (False, 2, 8)
    assert [(p["rank"], p["steps"], p["complete"]) for p in about.parts or []] == [
        (0, 2, True),
        (1, 0, False),
    ]


def test_a_job_is_trusted_through_its_signature_as_a_bundle_is(job: Path):
    from sdcreplay.errors import UntrustedWorkloadError

    opened = JobBundle.open(job)
    assert opened.manifest.workload.ref.endswith("train.py:make_workload")  # code: needs trust
    assert opened.trusted
    opened.require_trusted()
    rewrite_manifest(job, _set(["created"], "2020-01-01T00:00:00+00:00"))  # signed, then edited
    edited = JobBundle.open(job)
    assert not edited.trusted
    with pytest.raises(UntrustedWorkloadError):
        edited.require_trusted()


# --- compiled regions (capture/compiled.py; docs/compiled.md) ---------------------------------


def test_a_manifests_compiled_regions_are_read_typed_and_a_malformed_list_is_refused(
    small_bundle,
):
    region = {
        "path": "layers.0",
        "backend": "inductor",
        "mode": None,
        "options": {},
        "dynamic": None,
        "fullgraph": False,
        "modules": ["layers.0", "layers.0.fc"],
        "settings": {"(cpu vector isa)": "avx2"},
        "code_digest": "e" * 64,
        "graphs": [{"kind": "forward", "digest": "f" * 64, "kernels": ["cpp_fused_0"]}],
    }
    rewrite_manifest(small_bundle, lambda manifest: manifest.__setitem__("compiled", [region]))
    (read,) = sdcreplay.Bundle.open(small_bundle).compiled_regions
    assert (read.path, read.graphs[0].kind, read.graphs[0].kernels) == (
        "layers.0",
        "forward",
        ("cpp_fused_0",),
    )
    assert describe(small_bundle).to_json()["compiled"] == [region]

    def damage(manifest: dict) -> None:
        manifest["compiled"][0]["graphs"][0]["digest"] = "$(reboot)"

    rewrite_manifest(small_bundle, damage)
    with pytest.raises(BundleError, match=r"compiled is .*expected null or a list of compiled"):
        sdcreplay.Bundle.open(small_bundle)


def test_a_script_workload_is_named_by_its_recorded_command():
    """Errors and `info` name a script-mode bundle's workload as the command that ran it."""
    command = {"python": "/usr/bin/python3", "cwd": "/w", "env": {}}
    script = {**command, "argv": ["/w/train.py", "--lr", "3e-4", "--name", "a b"]}
    module = {**command, "argv": ["/w/pkg/train.py", "--lr", "3e-4"], "module": "pkg.train"}
    assert [
        workload_named(
            WorkloadRef(ref=f"script:{c['argv'][0]}", kwargs={}, kind="script", command=c)
        )
        for c in (script, module)
    ] == ["script /w/train.py --lr 3e-4 --name 'a b'", "script -m pkg.train --lr 3e-4"]
    factory = WorkloadRef(ref="builtin:tiny-llama", kwargs={"layers": 1})
    assert workload_named(factory) == "builtin:tiny-llama"
