"""Reading a bundle as evidence: the manifest and every file's SHA-256 are checked before
anything in it is used, HDF5 data must lie inside the bundle, and nothing is ever unpickled.
Format: docs/bundle-format.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..capture import environment
from ..capture.compiled import CompiledRegion
from ..capture.message import Message
from ..capture.signature import (
    MAX_ENTRY_BYTES,
    MAX_MESSAGE_BYTES,
    SignatureLog,
    bundle_frame_limits,
    read_records,
    read_signature_log,
)
from ..errors import BundleError
from ..storage.safeio import (
    check_global_heaps,
    check_json_value,
    check_self_contained,
    damaged_hdf5,
    read_limited,
    regular_file_inside,
)
from . import trust
from .checkpoints import load_checkpoint
from .manifest import (
    JOB_SCHEMA,
    MANIFEST,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    MAX_PROBE_BYTES,
    MAX_WORLD_SIZE,
    MESSAGES,
    PARTIAL_SUFFIX,
    PROBE,
    RANKS,
    SIGNATURES,
    STATE,
    STREAMS,
    CheckpointState,
    Manifest,
    StepRecord,
    Verification,
    WorkloadRef,
    sha256_file,
)
from .rules import Check, _check_fields, _is_int, integer, nullable, optional, text
from .state import read_rng

if TYPE_CHECKING:  # torch, h5py, tensorio and RngState: imported where tensors are read or
    # written, so that `sdcreplay info`, `diff` and `replay`'s own process load none of them
    import h5py

    from ..capture.determinism import RngState


def _sizes(v: Any) -> bool:
    return (
        isinstance(v, list)
        and len(v) <= 65536
        and all(
            isinstance(size, list) and len(size) <= 64 and all(_is_int(n) and n >= 0 for n in size)
            for size in v
        )
    )


def _dtypes(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 65536 and all(text(64).test(d) for d in v)


SEQUENCE = nullable(integer(0, 2**62))
DIGEST = nullable(text(128))

# One line of a rank's messages.jsonl.zst (message.Message; docs/bundle-format.md).
MESSAGE_FIELDS: dict[str, Check] = {
    "step": integer(0, 2**31 - 1),
    "record_id": integer(0, 2**62),
    "pg_id": integer(-1, MAX_WORLD_SIZE),
    "process_group": text(256),
    "collective_seq_id": SEQUENCE,
    "p2p_seq_id": SEQUENCE,
    "op_id": integer(0, 2**62),
    "profiling_name": text(128, r"[A-Za-z0-9_]+:[A-Za-z0-9_]+"),
    "input_sizes": Check(_sizes, "a list of tensor sizes"),
    "input_dtypes": Check(_dtypes, "a list of dtype names"),
    "output_sizes": Check(_sizes, "a list of tensor sizes"),
    "output_dtypes": Check(_dtypes, "a list of dtype names"),
    "input_digest": DIGEST,
    "output_digest": DIGEST,
    "peer": optional(integer(0, MAX_WORLD_SIZE - 1)),
}


def _read_manifest_json(path: Path) -> Any:
    if not os.path.lexists(path / MANIFEST):
        raise _without_manifest(path)
    manifest_path = regular_file_inside(path, MANIFEST)
    raw = read_limited(manifest_path, MAX_MANIFEST_BYTES, "manifest")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError as exc:
        raise BundleError(f"{manifest_path} nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:
        raise BundleError(f"{manifest_path} is not valid JSON: {str(exc)[:200]}") from exc


def _without_manifest(path: Path) -> BundleError:
    """What a directory without a manifest is, said as such: a folder of bundles (named),
    another directory, or a bundle that lost its manifest."""
    try:
        children = sorted(os.scandir(path), key=lambda entry: entry.name)
    except OSError:
        children = []
    held = [
        entry.name
        for entry in children
        if entry.is_dir(follow_symlinks=False) and os.path.isfile(Path(entry.path, MANIFEST))
    ]
    if held:
        shown = ", ".join(held[:10]) + (f", ... ({len(held) - 10} more)" if len(held) > 10 else "")
        return BundleError(
            f"{path} is a folder holding {len(held)} bundle{'s' * (len(held) != 1)} ({shown}), "
            "not a bundle itself",
            f"Name one of them, e.g. {path / held[0]}.",
        )
    if not any(entry.name in (*STREAMS, "steps", "state.h5") for entry in children):
        return BundleError(
            f"{path} has no {MANIFEST}: it is not a bundle",
            "Give the directory `sdcreplay record --out` wrote (it holds manifest.json).",
            python_hint="Give the directory record(workload, out) or a Recorder wrote (it holds "
            "manifest.json).",
        )
    return BundleError(f"{path} has no {MANIFEST}")  # a bundle's files without it: damaged


def _existing(path: str | Path) -> Path:
    """``path``, or its ``.partial`` twin where only a recording cut off left that."""
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    # os.path, not Path: no OSError for names too long or under a file
    if not os.path.exists(path) and os.path.exists(partial):
        return partial
    return path


def workload_named(workload: WorkloadRef) -> str:
    """A workload as a person knows it: a script's recorded command (``script /path/train.py
    --lr 3e-4``, ``script -m pkg.train ...``), a factory's reference."""
    if not workload.is_script:
        return workload.ref
    command = workload.command or {}
    argv = [str(word) for word in command.get("argv", [])]
    module = command.get("module")
    return "script " + shlex.join(["-m", str(module), *argv[1:]] if module else argv)


def ignored_environment(workload: WorkloadRef) -> list[str]:
    """The variables of this (the investigator's) shell that no replay process of a bundle
    whose workload is ``workload`` takes although they could change its result
    (`environment.ignored`): said to the person, never used. None for a factory: it is
    rebuilt from its arguments, and its check replayed without the shell's variables."""
    if not workload.is_script:
        return []
    command = workload.command or {}
    kept = {str(name): str(value) for name, value in dict(command.get("env", {})).items()}
    return environment.ignored(os.environ, kept, tuple(command.get("env_watched", ())))


class Bundle:
    """A validated bundle; every file is checked against its SHA-256 on open."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest

    @property
    def steps(self) -> list[StepRecord]:
        return self.manifest.steps

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> Bundle:
        path = _existing(path)
        if not os.path.isdir(path):
            raise BundleError(
                f"{str(path)[:300]} is not a bundle directory",
                "Give the directory `sdcreplay record --out` wrote.",
                python_hint="Give the directory record(workload, out) or a Recorder wrote.",
            )
        manifest = _read_manifest_json(path)
        if isinstance(manifest, dict) and manifest.get("schema") == JOB_SCHEMA:
            raise BundleError(
                f"{path} is a job bundle (one part per rank), not a single-process bundle",
                f"Open one rank's part ({path}/{RANKS}/000000) or the job with JobBundle.open.",
            )
        bundle = cls(path, Manifest.from_json(manifest))
        if verify:
            bundle.verify_files()
        return bundle

    @property
    def complete(self) -> bool:
        return self.manifest.complete

    def verify_files(self) -> None:
        """Check every listed file's size and SHA-256, and that HDF5 files hold all their data
        and can be read safely.

        In an incomplete bundle an append-only log may be longer than listed
        (the recording died between appending a step and rewriting the
        manifest): only the bytes the manifest vouches for are checked and read.
        """
        for name, meta in self.manifest.files.items():
            file = regular_file_inside(self.path, name)
            size = file.stat().st_size
            growing = name in STREAMS and not self.complete
            if size < meta.size or (size > meta.size and not growing):
                raise BundleError(
                    f"bundle file {name} is {size} bytes, the manifest says "
                    f"{meta.size} (truncated or damaged)"
                )
            try:
                actual = sha256_file(file, meta.size)
            except OSError as exc:
                raise BundleError(f"cannot read bundle file {name}: {exc}") from exc
            if actual != meta.sha256:
                raise BundleError(
                    f"bundle file {name} does not match its SHA-256 in the manifest "
                    "(damaged or edited)"
                )
            if name.endswith(".h5"):
                check_global_heaps(file)  # before libhdf5 reads a heap it would loop in
                self._open_h5(name).close()  # refuses data kept outside the file

    @property
    def workload_ref(self) -> str:
        return self.manifest.workload.ref

    @property
    def workload_named(self) -> str:
        """The workload as errors name it (`workload_named`: a script by its command)."""
        return workload_named(self.manifest.workload)

    @property
    def workload_kwargs(self) -> dict:
        return self.manifest.workload.kwargs

    @property
    def step_indices(self) -> list[int]:
        return [step.index for step in self.steps]

    def signature_log(self) -> SignatureLog:
        """The recorded log; it must hold exactly the manifest's steps and entry counts."""
        log = read_signature_log(
            regular_file_inside(self.path, SIGNATURES),
            size=self.manifest.files[SIGNATURES].size,
            frame_limits=bundle_frame_limits([s.entries for s in self.steps], MAX_ENTRY_BYTES),
        )
        if log.meta.get("device_type") != self.manifest.device_type:
            raise BundleError(
                "the signature log was made on device type "
                f"{str(log.meta.get('device_type'))[:32]!r}, "
                f"the manifest says {self.manifest.device_type!r}"
            )
        log.meta.update(
            source=str(self.path),
            device=self.manifest.device,
            role="record",
            level=self.manifest.capture.level,
            naming=self.manifest.capture.naming,
        )
        if list(log.steps) != self.step_indices:
            raise BundleError(
                f"the signature log holds steps {list(log.steps)}, "
                f"the manifest lists {self.step_indices}"
            )
        for step in self.steps:
            if len(log.steps[step.index]) != step.entries:
                raise BundleError(
                    f"the signature log holds {len(log.steps[step.index])} entries "
                    f"for step {step.index}, "
                    f"the manifest says {step.entries}"
                )
        return log

    @property
    def compiled_regions(self) -> list[CompiledRegion]:
        """The compiled regions the recording ran, with their code digests (capture/compiled.py);
        empty for a step that ran no compiled code."""
        return [CompiledRegion.from_json(region) for region in self.manifest.compiled or []]

    @property
    def has_probe(self) -> bool:
        return PROBE in self.manifest.files

    def probe(self) -> dict | None:
        """The recording device's kernel probe (``sdcreplay.probe/1``), or None when the bundle
        was written without one (before probes existed)."""
        meta = self.manifest.files.get(PROBE)
        if meta is None:
            return None
        data = read_limited(
            regular_file_inside(self.path, PROBE), min(meta.size, MAX_PROBE_BYTES), PROBE
        )
        try:
            probe = json.loads(data)
        except ValueError as exc:
            raise BundleError(f"{PROBE} in {self.path} is not JSON: {exc}") from exc
        check_json_value(probe, f"{PROBE} in {self.path}")
        if not isinstance(probe, dict) or probe.get("schema") != "sdcreplay.probe/1":
            raise BundleError(f"{PROBE} in {self.path} is not an sdcreplay.probe/1 object")
        return probe

    def messages(self) -> dict[int, list[Message]]:
        """The logged collective messages per step (a job's rank part; empty in other bundles).

        Every step the manifest counts messages for must hold exactly that many, in issue order.
        """
        counts = [step.messages for step in self.steps if step.messages]
        meta, records = read_records(
            regular_file_inside(self.path, MESSAGES),
            size=self.manifest.files[MESSAGES].size,
            frame_limits=bundle_frame_limits(counts, MAX_MESSAGE_BYTES),
        )
        if meta.get("kind") != "messages":
            raise BundleError(f"{MESSAGES} in {self.path} is not a message log")
        found: dict[int, list[Message]] = {}
        for position, record in enumerate(records):
            _check_fields(
                record, MESSAGE_FIELDS, f"line {position + 1}: ", f"{MESSAGES} in {self.path}"
            )
            message = Message.from_json(record)
            step = found.setdefault(message.step, [])
            if message.record_id != len(step):
                raise BundleError(
                    f"{MESSAGES} in {self.path} is malformed: step {message.step} has "
                    f"record_id {message.record_id} at position {len(step)}"
                )
            step.append(message)
        counted = {step.index: step.messages for step in self.steps if step.messages}
        if {step: len(messages) for step, messages in found.items()} != counted:
            raise BundleError(
                f"{MESSAGES} holds {sum(map(len, found.values()))} messages in steps "
                f"{sorted(found)}, the manifest counts {sum(counted.values())} in {sorted(counted)}"
            )
        return {step.index: found.get(step.index, []) for step in self.steps}

    def _open_h5(self, name: str) -> h5py.File:
        """Open a listed HDF5 file, refusing one whose data lives outside it (external data)."""
        import h5py  # here: reading the manifest and the logs needs not load it

        file = regular_file_inside(self.path, name)
        try:
            handle = h5py.File(file, "r")
        except OSError as exc:
            raise BundleError(f"cannot read {name} in {self.path}: {exc}") from exc
        try:
            check_self_contained(handle)
        except BaseException:
            handle.close()
            raise
        return handle

    def _damaged(self, name: str) -> contextlib.AbstractContextManager[None]:
        """h5py's errors while reading the bundle's HDF5 file ``name`` (a group missing, a
        damaged structure) as the file being damaged, named in the bundle."""
        return damaged_hdf5(self.path / name)

    def load_step(self, index: int) -> tuple[Any, RngState]:
        from ..storage import tensorio

        record = next((step for step in self.steps if step.index == index), None)
        if record is None:
            raise BundleError(f"the bundle has no step {index} (it has {self.step_indices})")
        with self._open_h5(record.file) as handle, self._damaged(record.file):
            try:
                return tensorio.read_tree(handle["batch"]), read_rng(handle["rng"])
            except BundleError as exc:
                raise BundleError(f"{record.file}: {exc.message}", exc.hint) from exc

    def load_around(self, index: int) -> dict | None:
        """What the loop set around step ``index`` (capture/around.py), None in a bundle that
        does not hold it (recorded before it was)."""
        from ..storage import tensorio

        record = next(step for step in self.steps if step.index == index)
        with self._open_h5(record.file) as handle, self._damaged(record.file):
            if "around" not in handle:
                return None
            around = tensorio.read_tree(handle["around"])
        if not isinstance(around, dict):
            raise BundleError(f"{record.file}: 'around' is not a group of named values")
        return around

    def load_state(self) -> tuple[dict, dict | None]:
        """The model and optimizer state before the first recorded step."""
        import torch

        from ..storage import tensorio

        state = self.manifest.state
        if isinstance(state, CheckpointState):
            return load_checkpoint(state)
        with self._open_h5(STATE) as handle, self._damaged(STATE):
            model = tensorio.read_tree(handle["model"])
            optimizer = tensorio.read_tree(handle["optimizer"]) if "optimizer" in handle else None
        if not (
            isinstance(model, dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items())
        ):
            raise BundleError(f"{STATE}: the model state is not a mapping of names to tensors")
        if optimizer is not None and not (
            isinstance(optimizer, dict)
            and set(optimizer) == {"state", "param_groups"}
            and isinstance(optimizer["param_groups"], list)
        ):
            raise BundleError(
                f"{STATE}: the optimizer state is not an optimizer state_dict (state, param_groups)"
            )
        return model, optimizer

    @property
    def state_object_names(self) -> list[str]:
        return self.manifest.state_object_names

    def load_state_objects(self) -> dict[str, Any]:
        """The named state objects' state dicts before the first recorded step."""
        from ..storage import tensorio

        names = self.state_object_names
        if not names:
            return {}
        with self._open_h5(STATE) as handle, self._damaged(STATE):
            return {name: tensorio.read_tree(handle["objects"][name]) for name in names}

    @property
    def verification(self) -> Verification:
        """Whether the workload's step was proved to reproduce the loop's (status "off": never)."""
        return self.manifest.verification

    @property
    def injected_faults(self) -> list[str]:
        """The faults injected into the recording device: a drill bundle (empty: none)."""
        return list(self.manifest.injected_faults or [])

    @property
    def verified(self) -> bool:
        return self.manifest.verification.passed

    @property
    def trusted(self) -> bool:
        """May this bundle's workload be imported (trust.py)?"""
        return trust.is_trusted(self.manifest.workload.ref, self.manifest.to_json())

    def require_trusted(self) -> None:
        """Refuse, before anything is imported, to run a workload the person has not trusted."""
        trust.require_trusted(self.manifest.workload.ref, self.manifest.to_json())

    def size_bytes(self) -> int:
        return (
            sum(meta.size for meta in self.manifest.files.values())
            + (self.path / MANIFEST).stat().st_size
        )
