"""The trace bundle on disk: a directory with a JSON manifest and data files.

Writing goes to ``NAME.partial`` with the manifest rewritten atomically after
every completed step, and is renamed to ``NAME`` when the recording closes; a
recording cut off mid-write leaves a ``.partial`` bundle that reads as the
steps that completed. Reading validates the manifest and every file's SHA-256
and never unpickles. Format: docs/bundle-format.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from . import tensorio, trust
from .determinism import RngState, must_match
from .errors import BundleError, CheckpointError
from .signature import SignatureLog, SignatureLogWriter, read_signature_log

SCHEMA = "sdcreplay.bundle/1"
MANIFEST = "manifest.json"
SIGNATURES = "signatures.jsonl.zst"
MESSAGES = "messages.jsonl.zst"
STATE = "state.h5"
PARTIAL_SUFFIX = ".partial"
MANIFEST_DIGEST = "manifest_sha256"


def sha256_file(path: Path, limit: int | None = None) -> str:
    """SHA-256 of the file, or of its first ``limit`` bytes."""
    digest = hashlib.sha256()
    left = limit
    with open(path, "rb") as handle:
        while left is None or left > 0:
            block = handle.read(1 << 20 if left is None else min(1 << 20, left))
            if not block:
                break
            digest.update(block)
            if left is not None:
                left -= len(block)
    return digest.hexdigest()


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON (sorted keys, no spaces), without this digest itself.

    It makes an edit of any value in the manifest detectable, while formatting
    (indentation, key order) stays free.
    """
    body = {key: value for key, value in manifest.items() if key != MANIFEST_DIGEST}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _write_json_atomic(path: Path, obj: Any, durable: bool) -> None:
    """Replace ``path`` in one rename; ``durable`` also waits for the disk (it costs ms per call)."""
    tmp = path.with_name(path.name + ".tmp")
    data = json.dumps(obj, indent=2).encode()  # one write, not json.dump's many small ones
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        if durable:
            os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_rng(group: h5py.Group, rng: RngState) -> None:
    group.attrs["python"] = rng.python_json()
    numpy_group = group.create_group("numpy")
    kind, keys, pos, has_gauss, cached = rng.numpy
    numpy_group.create_dataset("keys", data=np.asarray(keys, dtype=np.uint32))
    numpy_group.attrs["kind"] = kind
    numpy_group.attrs["pos"] = int(pos)
    numpy_group.attrs["has_gauss"] = int(has_gauss)
    numpy_group.attrs["cached_gaussian"] = float(cached)
    tensorio.write_tensor(group, "cpu", rng.cpu)
    if rng.accelerator is not None:
        tensorio.write_tensor(group, "accelerator", rng.accelerator)


def read_rng(group: h5py.Group) -> RngState:
    try:
        numpy_group = group["numpy"]
        numpy_state = (
            str(numpy_group.attrs["kind"]),
            np.asarray(numpy_group["keys"][()], dtype=np.uint32),
            int(numpy_group.attrs["pos"]),
            int(numpy_group.attrs["has_gauss"]),
            float(numpy_group.attrs["cached_gaussian"]),
        )
        return RngState(
            python=RngState.python_from_json(group.attrs["python"]),
            numpy=numpy_state,
            cpu=tensorio.read_tensor(group["cpu"]),
            accelerator=tensorio.read_tensor(group["accelerator"]) if "accelerator" in group else None,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise BundleError(f"RNG state in {group.file.filename} is damaged: {exc}") from exc


def write_state(path: Path, model_state: dict | None, optimizer_state: dict | None,
                objects: dict[str, Any] | None = None) -> None:
    """Model, optimizer and named state objects' state dicts (a checkpoint bundle: objects only)."""
    with h5py.File(path, "w") as handle:
        if model_state is not None:
            tensorio.write_tree(handle.create_group("model"), model_state)
        if optimizer_state is not None:
            tensorio.write_tree(handle.create_group("optimizer"), optimizer_state)
        for name, state in (objects or {}).items():
            tensorio.write_tree(handle.require_group("objects").create_group(name), state)


def checkpoint_reference(path: Path) -> dict:
    path = Path(path).resolve()
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return {"kind": "checkpoint", "path": str(path), "size": path.stat().st_size, "sha256": sha256_file(path)}


def verify_checkpoint(reference: dict) -> Path:
    """Refuse a checkpoint that is missing or whose SHA-256 changed since the recording."""
    path = Path(reference["path"])
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} referenced by the bundle does not exist",
            "Restore the checkpoint at that path (the bundle holds its SHA-256 to check it).",
        )
    actual = sha256_file(path)
    if actual != reference["sha256"]:
        raise CheckpointError(
            f"checkpoint {path} changed since the recording (SHA-256 {actual[:16]}..., recorded {reference['sha256'][:16]}...)",
            "Replay needs the exact checkpoint the step was recorded from; restore it from backup.",
        )
    return path


def load_checkpoint(reference: dict) -> tuple[dict, dict | None]:
    """Verify the checkpoint is the recorded one, then load it without pickle."""
    path = verify_checkpoint(reference)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from exc
    if isinstance(obj, dict) and "model" in obj:
        return obj["model"], obj.get("optimizer")
    return obj, None


class BundleWriter:
    """Writes a bundle step by step; see the module docstring for crash safety."""

    def __init__(self, path: Path, header: dict, overwrite: bool = False):
        self.final_path = Path(path)
        if self.final_path.exists() and not overwrite:
            raise BundleError(
                f"{self.final_path} already exists",
                "Choose another --out, or remove the old bundle first.",
            )
        self.path = self.final_path.with_name(self.final_path.name + PARTIAL_SUFFIX)
        if self.path.exists():
            shutil.rmtree(self.path)
        (self.path / "steps").mkdir(parents=True)
        self._overwrite = overwrite
        self.manifest = {
            "schema": SCHEMA,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "complete": False,
            **header,
            "state": None,
            "steps": [],
            "files": {},
        }
        self._signatures = SignatureLogWriter(self.path / SIGNATURES, {"device_type": header["device_type"]})
        self._messages = SignatureLogWriter(self.path / MESSAGES, {"kind": "messages"})
        self._note_stream_files()

    def _note_file(self, name: str) -> None:
        file = self.path / name
        self.manifest["files"][name] = {"size": file.stat().st_size, "sha256": sha256_file(file)}

    def _note_stream_files(self) -> None:
        for name, writer in ((SIGNATURES, self._signatures), (MESSAGES, self._messages)):
            self.manifest["files"][name] = {"size": writer.size, "sha256": writer.sha256}

    def embed_state(self, model_state: dict, optimizer_state: dict | None,
                    objects: dict | None = None) -> None:
        write_state(self.path / STATE, model_state, optimizer_state, objects)
        self._note_file(STATE)
        self.manifest["state"] = {"kind": "embedded", "file": STATE}
        self.manifest["state_objects"] = list(objects or {})
        self._save_manifest()

    def reference_checkpoint(self, reference: dict, objects: dict | None = None) -> None:
        """Model and optimizer come from a checkpoint; state objects still go in ``state.h5``."""
        self.manifest["state"] = reference
        self.manifest["state_objects"] = list(objects or {})
        if objects:
            write_state(self.path / STATE, None, None, objects)
            self._note_file(STATE)
        self._save_manifest()

    def set_verification(self, verification: dict) -> None:
        """Did the Recorder prove that the workload's step reproduces the loop's (recorder.py)?"""
        self.manifest["verification"] = verification
        self._save_manifest()

    def add_step(self, index: int, batch: Any, rng: RngState, entries: list[tuple[str, str]],
                 optimizer_step: bool, grads: str = "none") -> None:
        name = f"steps/{index:06d}.h5"
        with h5py.File(self.path / name, "w") as handle:
            tensorio.write_tree(handle.create_group("batch"), batch)
            write_rng(handle.create_group("rng"), rng)
        self._note_file(name)
        self._signatures.append_step(index, entries)
        self._note_stream_files()
        self.manifest["steps"].append(
            {"index": index, "file": name, "entries": len(entries),
             "optimizer_step": optimizer_step, "grads": grads}
        )
        self._save_manifest()

    def _save_manifest(self, durable: bool = False) -> None:
        """Atomic after every step (a crashed process leaves a readable bundle); durable at close."""
        self.manifest.pop(MANIFEST_DIGEST, None)
        self.manifest[trust.SIGNATURE] = trust.sign(self.manifest)
        self.manifest[MANIFEST_DIGEST] = manifest_digest(self.manifest)
        _write_json_atomic(self.path / MANIFEST, self.manifest, durable)

    def close(self) -> Path:
        """Mark the bundle complete and move it to its final name."""
        self.manifest["complete"] = True
        self._save_manifest(durable=True)
        if self.final_path.exists() and self._overwrite:
            shutil.rmtree(self.final_path)
        os.replace(self.path, self.final_path)
        return self.final_path

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@dataclass
class StepRecord:
    index: int
    file: str
    entries: int
    optimizer_step: bool
    grads: str = "none"  # what the gradients held when the step began: none | zero | kept


STREAMS = (SIGNATURES, MESSAGES)
"""Append-only files: in a ``.partial`` bundle they may hold a frame the manifest does not list yet."""

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
_PRECISIONS = ("highest", "high", "medium")
GRADS_ENTERING = ("none", "zero", "kept")
VERIFICATION_STATUS = ("pending", "passed", "failed", "off")


def step_file(index: int) -> str:
    return f"steps/{index:06d}.h5"


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise BundleError(f"manifest is malformed: {what}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_manifest(manifest: Any) -> None:
    _require(isinstance(manifest, dict), "not a JSON object")
    schema = manifest.get("schema")
    if schema != SCHEMA:
        raise BundleError(
            f"unsupported bundle schema {schema!r} (this sdcreplay reads {SCHEMA})",
            "Use the sdcreplay version that wrote the bundle, or record it again.",
        )
    _require(isinstance(manifest.get(MANIFEST_DIGEST), str), MANIFEST_DIGEST)
    if manifest[MANIFEST_DIGEST] != manifest_digest(manifest):
        raise BundleError(
            "the manifest does not match its own SHA-256 (damaged or edited by hand)",
            "Restore the bundle from a copy or record it again; a bundle is evidence and is not edited.",
        )
    workload = manifest.get("workload")
    _require(isinstance(workload, dict) and isinstance(workload.get("ref"), str), "workload.ref")
    _require(isinstance(workload.get("kwargs"), dict), "workload.kwargs")
    _require(isinstance(manifest.get("device"), str), "device")
    _require(isinstance(manifest.get("device_type"), str), "device_type")
    switches = manifest.get("determinism")
    _require(isinstance(switches, dict), "determinism")
    for key in ("deterministic_algorithms", "cudnn_deterministic", "cudnn_benchmark",
                "cuda_matmul_allow_tf32", "cudnn_allow_tf32"):
        _require(isinstance(switches.get(key), bool), f"determinism.{key}")
    _require(switches.get("float32_matmul_precision") in _PRECISIONS, "determinism.float32_matmul_precision")
    _require(_is_int(switches.get("num_threads")) and switches["num_threads"] > 0, "determinism.num_threads")
    env = switches.get("env")
    _require(isinstance(env, dict) and all(isinstance(k, str) and (v is None or isinstance(v, str))
                                           for k, v in env.items()), "determinism.env")
    _require(isinstance(manifest.get("environment"), dict), "environment")
    capture = manifest.get("capture", {"max_depth": None})
    depth = capture.get("max_depth") if isinstance(capture, dict) else "?"
    _require(depth is None or (type(depth) is int and depth >= 0), "capture.max_depth")
    _require(isinstance(capture.get("program", False), bool), "capture.program")
    _require(isinstance(manifest.get("complete"), bool), "complete")
    state = manifest.get("state")
    _require(isinstance(state, dict) and state.get("kind") in ("embedded", "checkpoint"), "state.kind")
    if state["kind"] == "checkpoint":
        _require(isinstance(state.get("path"), str) and isinstance(state.get("sha256"), str), "state.path/sha256")
    else:
        _require(state.get("file") == STATE, "state.file")
    files = manifest.get("files")
    _require(isinstance(files, dict), "files")
    for name, meta in files.items():
        _require(_SAFE_NAME.fullmatch(name) is not None and ".." not in name.split("/"), f"file name {name!r}")
        _require(isinstance(meta, dict) and isinstance(meta.get("sha256"), str)
                 and _is_int(meta.get("size")) and meta["size"] >= 0, f"files[{name!r}]")
    if state["kind"] == "embedded":
        _require(STATE in files, f"files[{STATE!r}]")
    steps = manifest.get("steps")
    _require(isinstance(steps, list), "steps")
    previous = None
    for step in steps:
        _require(isinstance(step, dict) and _is_int(step.get("index")) and step["index"] >= 0, "steps[].index")
        index = step["index"]
        _require(previous is None or index > previous, f"steps in increasing order (step {index} after {previous})")
        _require(step.get("file") == step_file(index) and step["file"] in files, f"step {index} file")
        _require(_is_int(step.get("entries")) and step["entries"] >= 0, f"step {index} entries")
        _require(isinstance(step.get("optimizer_step"), bool), f"step {index} optimizer_step")
        _require(step.get("grads", "none") in GRADS_ENTERING, f"step {index} grads")
        previous = index
    for name in STREAMS:
        _require(name in files, f"files[{name!r}]")
    objects = manifest.get("state_objects", [])
    _require(isinstance(objects, list) and all(isinstance(n, str) and n for n in objects),
             "state_objects")
    _require(not objects or STATE in files, f"files[{STATE!r}] (state objects)")
    verification = manifest.get("verification", {"status": "off"})
    _require(isinstance(verification, dict) and verification.get("status") in VERIFICATION_STATUS,
             "verification.status")
    _validate_provenance(manifest)


def _validate_provenance(manifest: dict) -> None:
    """The fingerprint of the recording machine and the recorder's signature (both optional: older bundles)."""
    fingerprint = manifest.get("fingerprint", {})
    _require(isinstance(fingerprint, dict) and all(
        isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool))) for k, v in fingerprint.items()),
        "fingerprint")
    signature = manifest.get(trust.SIGNATURE)
    _require(signature is None or isinstance(signature, str), trust.SIGNATURE)


class Bundle:
    """A validated bundle; every file is checked against its SHA-256 on open."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        self.steps = [
            StepRecord(step["index"], step["file"], step["entries"], step["optimizer_step"],
                       step.get("grads", "none"))
            for step in manifest["steps"]
        ]

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> Bundle:
        path = Path(path)
        if not path.exists() and path.with_name(path.name + PARTIAL_SUFFIX).exists():
            path = path.with_name(path.name + PARTIAL_SUFFIX)
        if not path.is_dir():
            raise BundleError(
                f"{path} is not a bundle directory",
                "Give the directory `sdcreplay record --out` wrote.",
            )
        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise BundleError(f"{path} has no {MANIFEST}") from exc
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise BundleError(f"{path / MANIFEST} is not valid JSON: {exc}") from exc
        except OSError as exc:
            raise BundleError(f"cannot read {path / MANIFEST}: {exc}") from exc
        _validate_manifest(manifest)
        bundle = cls(path, manifest)
        if verify:
            bundle.verify_files()
        return bundle

    @property
    def complete(self) -> bool:
        return self.manifest["complete"]

    def verify_files(self) -> None:
        """Check every listed file's size and SHA-256.

        In an incomplete bundle an append-only log may be longer than listed
        (the recording died between appending a step and rewriting the
        manifest): only the bytes the manifest vouches for are checked and read.
        """
        for name, meta in self.manifest["files"].items():
            file = self.path / name
            if not file.is_file():
                raise BundleError(f"bundle file {name} is missing from {self.path}")
            size = file.stat().st_size
            growing = name in STREAMS and not self.complete
            if size < meta["size"] or (size > meta["size"] and not growing):
                raise BundleError(f"bundle file {name} is {size} bytes, the manifest says {meta['size']} (truncated or damaged)")
            try:
                actual = sha256_file(file, meta["size"] if growing else None)
            except OSError as exc:
                raise BundleError(f"cannot read bundle file {name}: {exc}") from exc
            if actual != meta["sha256"]:
                raise BundleError(f"bundle file {name} does not match its SHA-256 in the manifest (damaged or edited)")

    @property
    def workload_ref(self) -> str:
        return self.manifest["workload"]["ref"]

    @property
    def workload_kwargs(self) -> dict:
        return self.manifest["workload"]["kwargs"]

    @property
    def step_indices(self) -> list[int]:
        return [step.index for step in self.steps]

    def signature_log(self) -> SignatureLog:
        """The recorded log; it must hold exactly the manifest's steps and entry counts."""
        log = read_signature_log(self.path / SIGNATURES, size=self.manifest["files"][SIGNATURES]["size"])
        log.meta.update(source=str(self.path), device=self.manifest["device"], role="record")
        if list(log.steps) != self.step_indices:
            raise BundleError(
                f"the signature log holds steps {list(log.steps)}, the manifest lists {self.step_indices}"
            )
        for step in self.steps:
            if len(log.steps[step.index]) != step.entries:
                raise BundleError(
                    f"the signature log holds {len(log.steps[step.index])} entries for step {step.index}, "
                    f"the manifest says {step.entries}"
                )
        return log

    def _open_h5(self, name: str) -> h5py.File:
        try:
            return h5py.File(self.path / name, "r")
        except OSError as exc:
            raise BundleError(f"cannot read {name} in {self.path}: {exc}") from exc

    def load_step(self, index: int) -> tuple[Any, RngState]:
        record = next((step for step in self.steps if step.index == index), None)
        if record is None:
            raise BundleError(f"the bundle has no step {index} (it has {self.step_indices})")
        with self._open_h5(record.file) as handle:
            try:
                return tensorio.read_tree(handle["batch"]), read_rng(handle["rng"])
            except KeyError as exc:
                raise BundleError(f"{record.file} is damaged: {exc}") from exc

    def load_state(self) -> tuple[dict, dict | None]:
        """The model and optimizer state before the first recorded step."""
        state = self.manifest["state"]
        if state["kind"] == "checkpoint":
            return load_checkpoint(state)
        with self._open_h5(STATE) as handle:
            try:
                model = tensorio.read_tree(handle["model"])
                optimizer = tensorio.read_tree(handle["optimizer"]) if "optimizer" in handle else None
            except KeyError as exc:
                raise BundleError(f"{STATE} is damaged: {exc}") from exc
        return model, optimizer

    @property
    def state_object_names(self) -> list[str]:
        return list(self.manifest.get("state_objects", []))

    def load_state_objects(self) -> dict[str, Any]:
        """The named state objects' state dicts before the first recorded step."""
        names = self.state_object_names
        if not names:
            return {}
        with self._open_h5(STATE) as handle:
            try:
                return {name: tensorio.read_tree(handle["objects"][name]) for name in names}
            except KeyError as exc:
                raise BundleError(f"{STATE} is damaged: {exc}") from exc

    @property
    def verification(self) -> dict:
        """``status``: passed (the workload's step reproduced the loop's), failed, pending, off."""
        return self.manifest.get("verification", {"status": "off", "mode": "off"})

    @property
    def verified(self) -> bool:
        return self.verification["status"] == "passed"

    def size_bytes(self) -> int:
        return sum(meta["size"] for meta in self.manifest["files"].values()) + (self.path / MANIFEST).stat().st_size


def describe(path: str | Path) -> dict:
    """What ``sdcreplay info`` shows: every file is verified first."""
    bundle = Bundle.open(path, verify=True)
    manifest = bundle.manifest
    log = bundle.signature_log()
    return {
        "schema": "sdcreplay.info/1",
        "bundle": str(bundle.path),
        "bundle_schema": manifest["schema"],
        "complete": manifest["complete"],
        "created": manifest.get("created"),
        "workload": manifest["workload"],
        "device": manifest["device"],
        "device_type": manifest["device_type"],
        "digest": manifest.get("digest"),
        "state": {k: v for k, v in manifest["state"].items()},
        "steps": [
            {"index": step.index, "entries": step.entries, "optimizer_step": step.optimizer_step,
             "grads": step.grads}
            for step in bundle.steps
        ],
        "state_objects": bundle.state_object_names,
        "verification": bundle.verification,
        "entries": log.entry_count(),
        "files": len(manifest["files"]),
        "size_bytes": bundle.size_bytes(),
        "integrity": "ok",
        "environment": manifest["environment"],
        "determinism": manifest["determinism"],
        "fingerprint": manifest.get("fingerprint"),
        "must_match": must_match(manifest.get("fingerprint") or {}),
        "trusted": trust.is_trusted(manifest),
    }
