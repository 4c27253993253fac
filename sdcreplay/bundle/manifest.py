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
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import h5py
import numpy as np

from ..capture.collectives import Message
from ..capture.comparable import must_match
from ..capture.signature import SignatureLog, SignatureLogWriter, read_records, read_signature_log
from ..errors import BundleError, CheckpointError
from ..storage.safeio import (
    check_json_value,
    check_self_contained,
    read_limited,
    regular_file_inside,
)
from . import trust

if TYPE_CHECKING:  # torch, tensorio and RngState are imported where tensors are read or written,
    from ..capture.determinism import RngState  # so that `sdcreplay info` runs without torch

SCHEMA = "sdcreplay.bundle/1"
JOB_SCHEMA = "sdcreplay.job/1"
MANIFEST = "manifest.json"
SIGNATURES = "signatures.jsonl.zst"
MESSAGES = "messages.jsonl.zst"
STATE = "state.h5"
PARTIAL_SUFFIX = ".partial"
MANIFEST_DIGEST = "manifest_sha256"
RANKS = "ranks"
MAX_WORLD_SIZE = 1 << 20


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
    """SHA-256 of the manifest's canonical JSON (sorted keys, no spaces), without this digest
    itself.

    It makes an edit of any value in the manifest detectable, while formatting
    (indentation, key order) stays free.
    """
    body = {key: value for key, value in manifest.items() if key != MANIFEST_DIGEST}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _readable_json(obj: dict) -> str:
    """One line per top-level key and per item of a top-level list (a step of the manifest).

    The manifest is rewritten after every step and grows with the steps: ``json.dumps(indent=)``
    runs json's pure-Python encoder (about 4x slower); each line here is one C-encoder call.
    """

    def field(key: str, value: Any) -> str:
        if isinstance(value, list) and value:
            items = ",\n".join(f"    {json.dumps(item)}" for item in value)
            return f"  {json.dumps(key)}: [\n{items}\n  ]"
        return f"  {json.dumps(key)}: {json.dumps(value)}"

    return "{\n" + ",\n".join(field(key, value) for key, value in obj.items()) + "\n}"


def _write_json_atomic(path: Path, obj: Any, durable: bool) -> None:
    """Replace ``path`` in one rename; ``durable`` also waits for the disk (it costs ms per
    call)."""
    tmp = path.with_name(path.name + ".tmp")
    data = _readable_json(obj).encode()  # one write, not json.dump's many small ones
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        if durable:
            os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_rng(group: h5py.Group, rng: RngState) -> None:
    from ..storage import tensorio

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
    from ..capture.determinism import RngState
    from ..storage import tensorio

    try:
        numpy_group = group["numpy"]
        numpy_state = (
            str(numpy_group.attrs["kind"]),
            np.asarray(numpy_group["keys"][()], dtype=np.uint32),
            int(numpy_group.attrs["pos"]),
            int(numpy_group.attrs["has_gauss"]),
            float(numpy_group.attrs["cached_gaussian"]),
        )
        state = RngState(
            python=RngState.python_from_json(group.attrs["python"]),
            numpy=numpy_state,
            cpu=tensorio.read_tensor(group["cpu"]),
            accelerator=tensorio.read_tensor(group["accelerator"])
            if "accelerator" in group
            else None,
        )
    except (KeyError, ValueError, TypeError, OverflowError) as exc:
        raise BundleError(f"RNG state in {group.file.filename} is damaged: {exc}") from exc
    _check_rng(state, group.file.filename)
    return state


def _check_rng(state: RngState, filename: str) -> None:
    """Load the state into throwaway generators: a state of the wrong size or type is refused here,
    with the file named, instead of failing inside the step."""
    import torch

    try:
        random.Random().setstate(state.python)
        np.random.RandomState().set_state(state.numpy)
        torch.Generator().set_state(state.cpu)
        accelerator = state.accelerator
        if accelerator is not None and (accelerator.dtype != torch.uint8 or accelerator.dim() != 1):
            raise ValueError(
                f"the accelerator state is {accelerator.dtype} of shape "
                f"{list(accelerator.shape)}, expected a 1-D uint8 tensor"
            )
    except (ValueError, TypeError, RuntimeError, OverflowError, IndexError) as exc:
        raise BundleError(
            f"RNG state in {filename} is invalid: {str(exc).splitlines()[0][:200]}",
            "The bundle was damaged or edited; record it again or restore a copy.",
        ) from exc


def write_state(
    path: Path,
    model_state: dict | None,
    optimizer_state: dict | None,
    objects: dict[str, Any] | None = None,
) -> None:
    """Model, optimizer and named state objects' state dicts (a checkpoint bundle: objects only)."""
    from ..storage import tensorio

    with h5py.File(path, "w") as handle:
        if model_state is not None:
            tensorio.write_tree(handle.create_group("model"), model_state)
        if optimizer_state is not None:
            tensorio.write_tree(handle.create_group("optimizer"), optimizer_state)
        for name, state in (objects or {}).items():
            tensorio.write_tree(handle.require_group("objects").create_group(name), state)


_BUNDLE_ENTRIES = {MANIFEST, MANIFEST + ".tmp", SIGNATURES, MESSAGES, STATE, "steps"}


def written_by_us(path: Path) -> bool:
    """Whether ``path`` is a bundle directory (complete or not) that only sdcreplay's files fill.

    ``--overwrite`` deletes nothing else: a person's directory that happens to
    be named like the bundle keeps its files.
    """
    if path.is_symlink() or not path.is_dir():
        return False
    names = {entry.name for entry in path.iterdir()}
    if RANKS in names and names <= _JOB_ENTRIES:
        return _parts_written_by_us(path / RANKS)
    if not names <= _BUNDLE_ENTRIES:
        return False
    steps = path / "steps"
    if "steps" in names and (steps.is_symlink() or not steps.is_dir()):
        return False
    step_name = re.compile(r"\d{6}\.h5(\.tmp)?")
    return "steps" not in names or all(step_name.fullmatch(entry.name) for entry in steps.iterdir())


def _claim(path: Path, overwrite: bool, what: str, hint: str) -> None:
    """Refuse to write at ``path`` unless it is free, or a bundle ``overwrite`` may replace."""
    if not path.exists() and not path.is_symlink():
        return
    if not overwrite:
        raise BundleError(f"{path} already exists" + (f" ({what})" if what else ""), hint)
    if not written_by_us(path):
        raise BundleError(
            f"{path} exists and is not a bundle; "
            "--overwrite replaces only a bundle sdcreplay wrote",
            "Choose another --out, or move that file or directory away yourself.",
        )


_JOB_ENTRIES = {MANIFEST, MANIFEST + ".tmp", RANKS}


def _parts_written_by_us(ranks: Path) -> bool:
    """A job's ``ranks/`` holds only rank parts (``000000``, ``000001.partial``...)."""
    part_name = re.compile(r"\d{6}(\.partial)?")
    return (
        not ranks.is_symlink()
        and ranks.is_dir()
        and all(
            part_name.fullmatch(entry.name) and written_by_us(entry) for entry in ranks.iterdir()
        )
    )


STREAMS = (SIGNATURES, MESSAGES)
"""Append-only files: in a ``.partial`` bundle they may hold a frame the manifest does not list
yet."""

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
_PRECISIONS = ("highest", "high", "medium")
GRADS_ENTERING = ("none", "zero", "kept")
VERIFICATION_STATUS = ("pending", "passed", "failed", "off")
MAX_MANIFEST_BYTES = 64 << 20
MAX_JSON_DEPTH = 32
MAX_FILE_BYTES = 1 << 40
MAX_STEP_SECONDS = 7 * 24 * 3600.0


def step_file(index: int) -> str:
    return f"steps/{index:06d}.h5"


def part_dir(rank: int) -> str:
    """Where rank ``rank``'s part lives in a job bundle."""
    return f"{RANKS}/{rank:06d}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MISSING = object()


@dataclass(frozen=True)
class Check:
    """One manifest field's rule: a test of its value and the form it should have, in words."""

    test: Callable[[Any], bool]
    expected: str


def integer(low: int, high: int) -> Check:
    return Check(lambda v: _is_int(v) and low <= v <= high, f"an integer from {low} to {high}")


def number(low: float, high: float) -> Check:
    def test(v: Any) -> bool:
        return (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and low <= v <= high

    return Check(test, f"a number from {low} to {high}")


def text(limit: int = 4096, pattern: str | None = None) -> Check:
    regex = re.compile(pattern) if pattern else None
    form = f"a string of at most {limit} characters" + (f" matching {pattern}" if pattern else "")

    def test(v: Any) -> bool:
        return (
            isinstance(v, str)
            and len(v) <= limit
            and (regex is None or regex.fullmatch(v) is not None)
        )

    return Check(test, form)


def choice(*values: Any) -> Check:
    def test(v: Any) -> bool:  # True is not 1: the type must match too
        return any(v is value or (type(v) is type(value) and v == value) for value in values)

    return Check(test, "one of " + ", ".join(json.dumps(value) for value in values))


def optional(check: Check) -> Check:
    return Check(lambda v: v is _MISSING or v is None or check.test(v), f"null or {check.expected}")


def absent_or(check: Check) -> Check:
    """Absent, or ``check`` (not null: the reader's default stands in only for absence)."""
    return Check(lambda v: v is _MISSING or check.test(v), check.expected)


def nullable(check: Check) -> Check:
    """Present, and null or ``check``."""
    return Check(lambda v: v is None or check.test(v), f"null or {check.expected}")


def mapping(key: Check, value: Check) -> Check:
    def test(v: Any) -> bool:
        return isinstance(v, dict) and all(key.test(k) and value.test(x) for k, x in v.items())

    return Check(test, f"an object whose keys are {key.expected} and values {value.expected}")


BOOL = Check(lambda v: isinstance(v, bool), "true or false")
OBJECT = Check(lambda v: isinstance(v, dict), "an object")
OPTIONAL_OBJECT = Check(lambda v: v is _MISSING or isinstance(v, dict), "an object")
SHA256 = text(64, "[0-9a-f]{64}")
ENV_NAME = text(256, "[A-Za-z_][A-Za-z0-9_]*")


# --- the manifest, typed -----------------------------------------------------
#
# Format decisions (docs/bundle-format.md is the prose):
# - One dataclass per JSON object, a field's name is its JSON key. Manifest.from_json is the
#   one way in: it checks the whole document against the rules (the RULES of each class and
#   MANIFEST_FIELDS below) before any object is built, so no constructor sees a bad value and
#   every refusal names the field and the form expected.
# - to_json(from_json(x)) == x: an optional key that was absent stays absent (``absent``) and
#   a key this version does not know is kept (``extra``), so a manifest's own SHA-256 and its
#   signature still verify whichever sdcreplay wrote it.
# - The state is a union tagged by ``kind`` (STATE_KINDS). A kind not in it is refused by
#   name, never skipped: a replay from another state than the recorded one is no evidence.
# - Per-rank data (ranks, process groups) will be more fields of Manifest and more Records.

_BOOKKEEPING = ("extra", "absent")
_NAMES: dict[type, tuple[str, ...]] = {}
_R = TypeVar("_R", bound="Record")


@dataclass(kw_only=True)
class Record:
    """Base of the manifest's objects: the keys it does not know, the optional keys it lacked."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    absent: frozenset[str] = field(default=frozenset(), repr=False)

    RULES: ClassVar[dict[str, Check]] = {}
    """Rules of the object's own fields (empty: MANIFEST_FIELDS holds them, as dotted paths)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The JSON keys this type knows, in the order it writes them."""
        known = _NAMES.get(cls)
        if known is None:  # fields() is slow, and the writer serializes every step's record
            known = _NAMES[cls] = tuple(f.name for f in fields(cls) if f.name not in _BOOKKEEPING)
        return known

    @classmethod
    def _read(cls: type[_R], obj: dict[str, Any], **typed: Any) -> _R:
        """Build from a JSON object ``from_json`` validated; ``typed``: fields already converted."""
        names = cls.names()
        values = {name: typed.get(name, obj[name]) for name in names if name in obj}
        return cls(
            **values,
            extra={key: obj[key] for key in obj if key not in names},
            absent=frozenset(name for name in names if name not in obj),
        )

    def to_json(self) -> dict[str, Any]:
        absent = self.absent
        body = {name: _to_json(getattr(self, name)) for name in self.names() if name not in absent}
        if self.extra:
            body.update(_to_json(self.extra))
        return body

    def present(self, name: str, value: Any) -> None:
        """Set a field the writer now knows (an optional one is written from now on)."""
        setattr(self, name, value)
        self.absent = self.absent - {name}


def _to_json(value: Any) -> Any:
    """A fresh JSON value: a caller may change what it gets without changing the manifest."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    return value


@dataclass(kw_only=True)
class WorkloadRef(Record):
    """What replay calls to rebuild the model: ``ref`` (builtin:NAME, module:function or
    /file.py:function) with ``kwargs``; trust.py decides whether it may be imported."""

    ref: str
    kwargs: dict[str, Any]


@dataclass(kw_only=True)
class Environment(Record):
    """Where the recording ran (determinism.environment): for people and replay's warnings."""

    host: str
    platform: str
    python: str
    torch: str
    cuda: str | None
    cudnn: int | None
    numpy: str | None = None
    device: dict[str, Any]
    env: dict[str, str | None] | None = None


@dataclass(kw_only=True)
class Switches(Record):
    """The determinism switches replay puts in force and refuses to run without
    (determinism.apply takes their JSON)."""

    deterministic_algorithms: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    cuda_matmul_allow_tf32: bool
    cudnn_allow_tf32: bool
    float32_matmul_precision: str
    num_threads: int
    env: dict[str, str | None]


@dataclass(kw_only=True)
class CaptureSettings(Record):
    """What the signature log holds, so replay captures the same. Absent in the oldest
    bundles, which captured every module and no program entries (the defaults)."""

    max_depth: int | None = None  # forward/backward entries of modules at most this deep
    program: bool = False  # hyper:, step_grad:, optim:, state: entries


@dataclass(kw_only=True)
class Verification(Record):
    """Did the Recorder prove that the workload's step reproduces the loop's (recorder.py)?
    Absent in bundles older than the check: status "off"."""

    mode: str | None = None  # on | warn | off
    status: str  # pending | passed | failed | off
    problem: str | None = None  # with failed: the first differing entry and its likely cause

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(kw_only=True)
class Trigger(Record):
    """Why a ring buffer's bundle was written (``Recorder(ring=K).dump``): absent in a bundle
    recorded step by step."""

    REASON_LIMIT: ClassVar[int] = 4096
    RULES: ClassVar[dict[str, Check]] = {
        "reason": text(REASON_LIMIT),
        "source": text(64),
        "step": integer(0, 2**31 - 1),
        "ring": integer(1, 2**31 - 1),
    }
    reason: str  # what the alarm (or the person) said
    source: str  # who asked: "user", "ReplayCheck", "UpdateDetector", "record", ...
    step: int  # the last step in the bundle
    ring: int  # the ring's size K: the bundle holds at least the last K steps (or all)


@dataclass(kw_only=True)
class EmbeddedState(Record):
    """Model and optimizer state in the bundle's own ``state.h5``."""

    RULES: ClassVar[dict[str, Check]] = {"file": choice(STATE)}
    kind: str = "embedded"
    file: str = STATE


@dataclass(kw_only=True)
class CheckpointState(Record):
    """A ``torch.save``d checkpoint outside the bundle the recording started from, pinned by
    its SHA-256 (checked before every load)."""

    RULES: ClassVar[dict[str, Check]] = {
        "path": text(4096),
        "sha256": SHA256,
        "size": optional(integer(0, MAX_FILE_BYTES)),
    }
    kind: str = "checkpoint"
    path: str
    size: int | None = None
    sha256: str


StateRef = EmbeddedState | CheckpointState
STATE_KINDS: dict[str, type[EmbeddedState] | type[CheckpointState]] = {
    "embedded": EmbeddedState,
    "checkpoint": CheckpointState,
}


@dataclass(kw_only=True)
class FileMeta(Record):
    """A data file's size and SHA-256: what ``Bundle.verify_files`` holds it to."""

    RULES: ClassVar[dict[str, Check]] = {"size": integer(0, MAX_FILE_BYTES), "sha256": SHA256}
    size: int
    sha256: str


@dataclass(kw_only=True)
class StepRecord(Record):
    """One recorded step: its batch and RNG file, and how many signature entries it has."""

    RULES: ClassVar[dict[str, Check]] = {
        "index": integer(0, 2**31 - 1),
        "file": text(64),
        "entries": integer(0, 10_000_000),
        "optimizer_step": BOOL,
        "seconds": optional(number(0, MAX_STEP_SECONDS)),
        "grads": absent_or(choice(*GRADS_ENTERING)),
        "messages": absent_or(integer(0, 10_000_000)),
    }
    index: int
    file: str
    entries: int
    optimizer_step: bool  # the optimizer stepped in the step; replay does the same
    grads: str = "none"  # what the gradients held when the step began: none | zero | kept
    seconds: float | None = None  # how long it took when recorded: replay's hang timeout
    messages: int | None = None  # a job's rank part: the step's logged collective messages


@dataclass(kw_only=True)
class DistributedInfo(Record):
    """A rank's part of a job bundle: which rank of how many, and where its job manifest is."""

    RULES: ClassVar[dict[str, Check]] = {
        "rank": integer(0, MAX_WORLD_SIZE - 1),
        "world_size": integer(1, MAX_WORLD_SIZE),
        "backend": text(64, "[a-z0-9_:]+"),
        "job": choice("../.."),
        "ddp_iterations_before": optional(integer(0, 2)),
    }
    rank: int
    world_size: int
    backend: str
    job: str = "../.."  # the job bundle, relative to the part
    # The recorded DDP's iterations before the part's first step (2: two or more, its
    # buckets rebuilt); None: no DDP, or not known. Replay's fresh DDP runs as many first.
    ddp_iterations_before: int | None = None


@dataclass(kw_only=True)
class Manifest(Record):
    """``manifest.json``: what the bundle holds. Fields in the order the writer writes them."""

    schema: str = SCHEMA
    created: str | None = None
    complete: bool = False
    workload: WorkloadRef
    device: str
    device_type: str
    digest: str | None = None
    environment: Environment
    determinism: Switches
    fingerprint: dict[str, Any] | None = None  # determinism.fingerprint: property -> value
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    state: StateRef
    steps: list[StepRecord] = field(default_factory=list)
    files: dict[str, FileMeta] = field(default_factory=dict)
    state_objects: list[str] | None = None  # names of the state objects in state.h5
    distributed: DistributedInfo | None = None  # set in a job bundle's rank part
    signature: str | None = None  # trust.py: HMAC of the rest under the recording user's secret
    verification: Verification = field(
        default_factory=lambda: Verification(
            mode="off", status="off", absent=frozenset({"problem"})
        )
    )
    trigger: Trigger | None = None  # a ring buffer's dump: why it was written
    manifest_sha256: str | None = None  # manifest_digest of the rest

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        """The one way to read a manifest: every rule checked, then every object typed.

        A violation is a BundleError naming the field and the form expected.
        """
        _validate_manifest(obj)
        typed: dict[str, Any] = {
            "workload": WorkloadRef._read(obj["workload"]),
            "environment": Environment._read(obj["environment"]),
            "determinism": Switches._read(obj["determinism"]),
            "state": STATE_KINDS[obj["state"]["kind"]]._read(obj["state"]),
            "steps": [StepRecord._read(step) for step in obj["steps"]],
            "files": {name: FileMeta._read(meta) for name, meta in obj["files"].items()},
        }
        if "capture" in obj:
            typed["capture"] = CaptureSettings._read(obj["capture"])
        if "verification" in obj:
            typed["verification"] = Verification._read(obj["verification"])
        if "trigger" in obj:
            typed["trigger"] = Trigger._read(obj["trigger"])
        if "distributed" in obj:
            typed["distributed"] = DistributedInfo._read(obj["distributed"])
        return cls._read(obj, **typed)

    @property
    def state_object_names(self) -> list[str]:
        return list(self.state_objects or [])


# The rules of the manifest's top level and its singular objects: dotted path -> rule, checked
# in this order (a parent before its fields). The state, each file and each step are checked
# against their class's RULES. A new field is a line here (or in RULES), a field of its class
# above and a row in docs/bundle-format.md; cross-field rules live in _validate_manifest.
MANIFEST_FIELDS: dict[str, Check] = {
    "schema": choice(SCHEMA),
    MANIFEST_DIGEST: SHA256,
    "created": optional(text(64)),
    "complete": BOOL,
    "workload": OBJECT,
    "workload.ref": text(4096),
    "workload.kwargs": mapping(text(256), Check(lambda v: True, "any JSON value")),
    "workload.kwargs.seed": optional(integer(-(2**63), 2**64 - 1)),
    "device": text(64, r"[a-z]+(:\d{1,6})?"),
    "device_type": text(32, "[a-z]+"),
    "digest": optional(text(64)),
    "environment": OBJECT,
    "environment.host": text(256),
    "environment.platform": text(1024),
    "environment.python": text(64),
    "environment.torch": text(64),
    "environment.numpy": optional(text(64)),
    "environment.cuda": nullable(text(64)),
    "environment.cudnn": nullable(integer(0, 10**9)),
    "environment.device": OBJECT,
    "environment.device.name": optional(text(1024)),
    "environment.env": optional(mapping(ENV_NAME, optional(text(65536)))),
    "determinism": OBJECT,
    "determinism.deterministic_algorithms": BOOL,
    "determinism.cudnn_deterministic": BOOL,
    "determinism.cudnn_benchmark": BOOL,
    "determinism.cuda_matmul_allow_tf32": BOOL,
    "determinism.cudnn_allow_tf32": BOOL,
    "determinism.float32_matmul_precision": choice(*_PRECISIONS),
    "determinism.num_threads": integer(1, 4096),
    "determinism.env": mapping(ENV_NAME, optional(text(65536))),
    "capture": OPTIONAL_OBJECT,
    "capture.max_depth": optional(integer(0, 1024)),
    "capture.program": absent_or(BOOL),
    "state_objects": optional(
        Check(
            lambda v: (
                isinstance(v, list)
                and len(v) <= 4096
                and all(isinstance(n, str) and 0 < len(n) <= 256 for n in v)
            ),
            "a list of state object names",
        )
    ),
    "verification": OPTIONAL_OBJECT,
    "verification.status": absent_or(choice(*VERIFICATION_STATUS)),
    "verification.mode": optional(choice("on", "warn", "off")),
    "verification.problem": optional(text(65536)),
    "fingerprint": optional(
        mapping(
            text(256),
            optional(
                Check(
                    lambda v: (
                        isinstance(v, (str, int, float, bool))
                        and (not isinstance(v, str) or len(v) <= 4096)
                    ),
                    "a string, number or bool",
                )
            ),
        )
    ),
    "signature": optional(text(64, "[0-9a-f]{64}")),
    "trigger": OPTIONAL_OBJECT,
    "distributed": OPTIONAL_OBJECT,
    "state": OBJECT,
    "state.kind": choice(*STATE_KINDS),
    "files": mapping(text(256), OBJECT),
    "steps": Check(lambda v: isinstance(v, list) and len(v) <= 1_000_000, "a list of steps"),
}


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

# One line of a rank's messages.jsonl.zst (collectives.Message; docs/bundle-format.md).
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


def _lookup(obj: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _shown(value: Any) -> str:
    return "missing" if value is _MISSING else json.dumps(value)[:60]


def _check_fields(
    obj: Any, rules: dict[str, Check], where: str = "", document: str = "manifest"
) -> None:
    for path, check in rules.items():
        value = _lookup(obj, path)
        if not check.test(value):
            raise BundleError(
                f"{document} is malformed: {where}{path} is {_shown(value)}, "
                f"expected {check.expected}"
            )


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise BundleError(f"manifest is malformed: {what}")


def _validate_manifest(manifest: Any) -> None:
    _require(isinstance(manifest, dict), "not a JSON object")
    schema = manifest.get("schema")
    if schema != SCHEMA:
        raise BundleError(
            f"unsupported bundle schema {repr(schema)[:60]} (this sdcreplay reads {SCHEMA})",
            "Use the sdcreplay version that wrote the bundle, or record it again.",
        )
    check_json_value(manifest, MANIFEST, MAX_JSON_DEPTH)
    _check_fields(manifest, {MANIFEST_DIGEST: SHA256})
    if manifest[MANIFEST_DIGEST] != manifest_digest(manifest):
        raise BundleError(
            "the manifest does not match its own SHA-256 (damaged or edited by hand)",
            "Restore the bundle from a copy or record it again; "
            "a bundle is evidence and is not edited.",
        )
    _check_fields(manifest, MANIFEST_FIELDS)
    state = manifest["state"]
    _check_fields(state, STATE_KINDS[state["kind"]].RULES, "state.")
    if "trigger" in manifest:
        _check_fields(manifest["trigger"], Trigger.RULES, "trigger.")
    files = manifest["files"]
    for name, meta in files.items():
        _require(
            _SAFE_NAME.fullmatch(name) is not None and ".." not in name.split("/"),
            f"file name {name!r}",
        )
        _check_fields(meta, FileMeta.RULES, f"files[{name!r}].")
    if state["kind"] == "embedded":
        _require(STATE in files, f"files[{STATE!r}] is missing (the state is embedded)")
    previous = None
    for position, step in enumerate(manifest["steps"]):
        _check_fields(step, StepRecord.RULES, f"steps[{position}].")
        index = step["index"]
        _require(
            previous is None or index > previous,
            f"steps in increasing order (step {index} after {previous})",
        )
        _require(
            step["file"] == step_file(index),
            f"steps[{position}].file is {step['file']!r}, expected {step_file(index)!r}",
        )
        _require(
            step["file"] in files, f"steps[{position}].file {step['file']!r} is not listed in files"
        )
        previous = index
    for name in STREAMS:
        _require(name in files, f"files[{name!r}] is missing")
    _require(
        not manifest.get("state_objects") or STATE in files,
        f"files[{STATE!r}] is missing (the bundle has state objects)",
    )
    if "distributed" in manifest:
        distributed = manifest["distributed"]
        _check_fields(distributed, DistributedInfo.RULES, "distributed.")
        _require(
            distributed["rank"] < distributed["world_size"],
            f"distributed.rank {distributed['rank']} is not below its world_size "
            f"{distributed['world_size']}",
        )
        for position, step in enumerate(manifest["steps"]):
            _require("messages" in step, f"steps[{position}].messages is missing (a rank part)")
    _require(
        "verification" not in manifest or "status" in manifest["verification"],
        "verification.status is missing (expected one of "
        + ", ".join(json.dumps(status) for status in VERIFICATION_STATUS)
        + ")",
    )


def checkpoint_reference(path: Path) -> CheckpointState:
    path = Path(path).resolve()
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return CheckpointState(path=str(path), size=path.stat().st_size, sha256=sha256_file(path))


def verify_checkpoint(reference: CheckpointState) -> Path:
    """Refuse a checkpoint that is missing or whose SHA-256 changed since the recording."""
    path = Path(reference.path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} referenced by the bundle does not exist",
            "Restore the checkpoint at that path (the bundle holds its SHA-256 to check it).",
        )
    size = path.stat().st_size
    if reference.size is not None and size != reference.size:
        raise CheckpointError(
            f"checkpoint {path} changed since the recording "
            f"({size} bytes, recorded {reference.size})",
            "Replay needs the exact checkpoint the step was recorded from; restore it from backup.",
        )
    actual = sha256_file(path)
    if actual != reference.sha256:
        raise CheckpointError(
            f"checkpoint {path} changed since the recording (SHA-256 {actual[:16]}..., "
            f"recorded {reference.sha256[:16]}...)",
            "Replay needs the exact checkpoint the step was recorded from; restore it from backup.",
        )
    return path


def load_checkpoint(reference: CheckpointState) -> tuple[dict, dict | None]:
    """Verify the checkpoint is the recorded one, then load it without pickle."""
    import torch

    path = verify_checkpoint(reference)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from exc
    if isinstance(obj, dict) and "model" in obj:
        return obj["model"], obj.get("optimizer")
    return obj, None


def claim_output(final: Path, partial: Path, overwrite: bool) -> None:
    """Refuse to record at ``final`` unless it and its ``partial`` twin are free (or bundles
    ``overwrite`` may replace); a job launcher asks before starting its ranks."""
    _claim(
        final,
        overwrite,
        "",
        "Choose another --out, or pass --overwrite to replace the old bundle.",
    )
    _claim(
        partial,
        overwrite,
        "a leftover partial recording",
        "It may be the only evidence of a crash: "
        f"`sdcreplay info {partial}` shows what it holds; "
        "move it away, or pass --overwrite to replace it.",
    )


def _prepare_directory(final: Path, partial: Path, overwrite: bool, inner: str) -> None:
    """Claim ``final`` and its ``partial`` twin, and create ``partial/inner``."""
    try:
        claim_output(final, partial, overwrite)
        if partial.exists():
            shutil.rmtree(partial)
        (partial / inner).mkdir(parents=True)
    except OSError as exc:
        raise BundleError(
            f"cannot create the bundle directory {str(partial)[:200]}: {exc.strerror}",
            "Choose an --out in a writable directory (not under a file or /proc, "
            "each name at most 255 bytes).",
        ) from exc


def _save_signed(manifest: Manifest | JobManifest, directory: Path, durable: bool) -> None:
    """Write ``manifest`` into ``directory``; its signature and self-digest are made over the
    JSON as written."""
    body = manifest.to_json()
    body[trust.SIGNATURE] = manifest.signature = trust.sign(body)
    body[MANIFEST_DIGEST] = manifest.manifest_sha256 = manifest_digest(body)
    _write_json_atomic(directory / MANIFEST, body, durable)


def _move_into_place(partial: Path, final: Path, overwrite: bool) -> None:
    """Rename a closed recording to its final name (``overwrite``: replacing a bundle there)."""
    if final.exists() and overwrite:
        _claim(final, True, "", "")  # still a bundle: it may have changed since
        shutil.rmtree(final)
    os.replace(partial, final)


class BundleWriter:
    """Writes a bundle step by step; see the module docstring for crash safety.

    It fills a typed ``Manifest`` and writes its ``to_json``: what it writes is what
    ``Manifest.from_json`` reads, through the same types.
    """

    def __init__(
        self,
        path: Path,
        *,
        workload: WorkloadRef,
        device: str,
        device_type: str,
        digest: str,
        environment: Environment,
        determinism: Switches,
        fingerprint: dict[str, Any] | None = None,
        capture: CaptureSettings | None = None,
        overwrite: bool = False,
        distributed: DistributedInfo | None = None,
    ):
        self.final_path = Path(path)
        self.path = self.final_path.with_name(self.final_path.name + PARTIAL_SUFFIX)
        _prepare_directory(self.final_path, self.path, overwrite, "steps")
        self._overwrite = overwrite
        # Written only once embed_state or reference_checkpoint has set the state; the
        # optional parts not known yet stay out of the JSON until they are.
        unset = {"state_objects", "verification", "trigger"} | {
            name
            for name, value in (
                ("fingerprint", fingerprint),
                ("capture", capture),
                ("distributed", distributed),
            )
            if value is None
        }
        self.manifest = Manifest(
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            workload=workload,
            device=device,
            device_type=device_type,
            digest=digest,
            environment=environment,
            determinism=determinism,
            fingerprint=fingerprint,
            capture=capture or CaptureSettings(),
            distributed=distributed,
            state=EmbeddedState(),
            absent=frozenset(unset),
        )
        self._signatures = SignatureLogWriter(self.path / SIGNATURES, {"device_type": device_type})
        self._messages = SignatureLogWriter(self.path / MESSAGES, {"kind": "messages"})
        self._note_stream_files()

    def _note_file(self, name: str) -> None:
        file = self.path / name
        self.manifest.files[name] = FileMeta(size=file.stat().st_size, sha256=sha256_file(file))

    def _note_stream_files(self) -> None:
        for name, writer in ((SIGNATURES, self._signatures), (MESSAGES, self._messages)):
            self.manifest.files[name] = FileMeta(size=writer.size, sha256=writer.sha256)

    def embed_state(
        self, model_state: dict, optimizer_state: dict | None, objects: dict | None = None
    ) -> None:
        write_state(self.path / STATE, model_state, optimizer_state, objects)
        self._note_file(STATE)
        self.manifest.state = EmbeddedState()
        self.manifest.present("state_objects", list(objects or {}))
        self._save_manifest()

    def reference_checkpoint(self, reference: CheckpointState, objects: dict | None = None) -> None:
        """Model and optimizer come from a checkpoint; state objects still go in ``state.h5``."""
        self.manifest.state = reference
        self.manifest.present("state_objects", list(objects or {}))
        if objects:
            write_state(self.path / STATE, None, None, objects)
            self._note_file(STATE)
        self._save_manifest()

    def set_verification(self, mode: str, status: str, problem: str | None = None) -> None:
        """Did the Recorder prove that the workload's step reproduces the loop's (recorder.py)?"""
        verification = Verification(
            mode=mode,
            status=status,
            problem=problem,
            absent=frozenset() if problem else frozenset({"problem"}),
        )
        self.manifest.present("verification", verification)
        self._save_manifest()

    def set_trigger(self, trigger: Trigger) -> None:
        """Say why this bundle was written (a ring buffer's dump)."""
        self.manifest.present("trigger", trigger)
        self._save_manifest()

    def add_step(
        self,
        index: int,
        batch: Any,
        rng: RngState,
        entries: list[tuple[str, str]],
        optimizer_step: bool,
        grads: str = "none",
        seconds: float | None = None,
        messages: list[Message] | None = None,
    ) -> None:
        """``grads``: what the gradients held as the step began; ``seconds``: how long the step
        took while recording (replay's timeout comes from it); ``messages``: a rank's logged
        collectives (a job's part), one frame of the message log per step that has any."""
        from ..storage import tensorio

        name = step_file(index)
        with h5py.File(self.path / name, "w") as handle:
            tensorio.write_tree(handle.create_group("batch"), batch)
            write_rng(handle.create_group("rng"), rng)
        self._note_file(name)
        self._signatures.append_step(index, entries)
        if messages:
            self._messages.append_records([message.to_json() for message in messages])
        self._note_stream_files()
        unset = {"seconds"} if seconds is None else set()
        self.manifest.steps.append(
            StepRecord(
                index=index,
                file=name,
                entries=len(entries),
                optimizer_step=optimizer_step,
                grads=grads,
                seconds=None if seconds is None else round(float(seconds), 6),
                messages=None if messages is None else len(messages),
                absent=frozenset(unset | ({"messages"} if messages is None else set())),
            )
        )
        self._save_manifest()

    def _save_manifest(self, durable: bool = False) -> None:
        """Atomic after every step (a crashed process leaves a readable bundle); durable at
        close."""
        _save_signed(self.manifest, self.path, durable)

    def close(self) -> Path:
        """Mark the bundle complete and move it to its final name."""
        self.manifest.complete = True
        self._save_manifest(durable=True)
        _move_into_place(self.path, self.final_path, self._overwrite)
        return self.final_path

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


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
        """Check every listed file's size and SHA-256, and that HDF5 files hold all their data.

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
                self._open_h5(name).close()  # refuses data kept outside the file

    @property
    def workload_ref(self) -> str:
        return self.manifest.workload.ref

    @property
    def workload_kwargs(self) -> dict:
        return self.manifest.workload.kwargs

    @property
    def step_indices(self) -> list[int]:
        return [step.index for step in self.steps]

    def signature_log(self) -> SignatureLog:
        """The recorded log; it must hold exactly the manifest's steps and entry counts."""
        log = read_signature_log(
            regular_file_inside(self.path, SIGNATURES), size=self.manifest.files[SIGNATURES].size
        )
        if log.meta.get("device_type") != self.manifest.device_type:
            raise BundleError(
                "the signature log was made on device type "
                f"{str(log.meta.get('device_type'))[:32]!r}, "
                f"the manifest says {self.manifest.device_type!r}"
            )
        log.meta.update(source=str(self.path), device=self.manifest.device, role="record")
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

    def messages(self) -> dict[int, list[Message]]:
        """The logged collective messages per step (a job's rank part; empty in other bundles).

        Every step the manifest counts messages for must hold exactly that many, in issue order.
        """
        meta, records = read_records(
            regular_file_inside(self.path, MESSAGES), size=self.manifest.files[MESSAGES].size
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

    def load_step(self, index: int) -> tuple[Any, RngState]:
        from ..storage import tensorio

        record = next((step for step in self.steps if step.index == index), None)
        if record is None:
            raise BundleError(f"the bundle has no step {index} (it has {self.step_indices})")
        with self._open_h5(record.file) as handle:
            try:
                return tensorio.read_tree(handle["batch"]), read_rng(handle["rng"])
            except KeyError as exc:
                raise BundleError(f"{record.file} is damaged: {exc}") from exc
            except BundleError as exc:
                raise BundleError(f"{record.file}: {exc.message}", exc.hint) from exc

    def load_state(self) -> tuple[dict, dict | None]:
        """The model and optimizer state before the first recorded step."""
        import torch

        from ..storage import tensorio

        state = self.manifest.state
        if isinstance(state, CheckpointState):
            return load_checkpoint(state)
        with self._open_h5(STATE) as handle:
            try:
                model = tensorio.read_tree(handle["model"])
                optimizer = (
                    tensorio.read_tree(handle["optimizer"]) if "optimizer" in handle else None
                )
            except KeyError as exc:
                raise BundleError(f"{STATE} is damaged: {exc}") from exc
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
        with self._open_h5(STATE) as handle:
            try:
                return {name: tensorio.read_tree(handle["objects"][name]) for name in names}
            except KeyError as exc:
                raise BundleError(f"{STATE} is damaged: {exc}") from exc

    @property
    def verification(self) -> Verification:
        """Whether the workload's step was proved to reproduce the loop's (status "off": never)."""
        return self.manifest.verification

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


# --- job bundles: one part per rank under one job manifest -------------------------------------


@dataclass(kw_only=True)
class ProcessGroupRecord(Record):
    """A process group of the job: its id (creation order), name and member ranks."""

    RULES: ClassVar[dict[str, Check]] = {
        "pg_id": integer(0, MAX_WORLD_SIZE),
        "name": text(256),
        "ranks": Check(
            lambda v: (
                isinstance(v, list)
                and len(v) <= MAX_WORLD_SIZE
                and all(_is_int(r) and 0 <= r < MAX_WORLD_SIZE for r in v)
            ),
            "a list of ranks",
        ),
    }
    pg_id: int
    name: str
    ranks: list[int]


@dataclass(kw_only=True)
class RankRecord(Record):
    """A rank of the job: its device label, its part's directory, and (once the job closed)
    the SHA-256 its part's manifest has, which ties the part to this job."""

    RULES: ClassVar[dict[str, Check]] = {
        "rank": integer(0, MAX_WORLD_SIZE - 1),
        "device": text(64, r"[a-z]+(:\d{1,6})?"),
        "part": text(64, RANKS + r"/\d{6}"),
        MANIFEST_DIGEST: nullable(SHA256),
    }
    rank: int
    device: str
    part: str
    manifest_sha256: str | None = None


@dataclass(kw_only=True)
class JobManifest(Record):
    """A job bundle's ``manifest.json`` (schema ``sdcreplay.job/1``)."""

    schema: str = JOB_SCHEMA
    created: str | None = None
    complete: bool = False
    world_size: int
    backend: str
    process_groups: list[ProcessGroupRecord]
    ranks: list[RankRecord]
    workload: WorkloadRef
    signature: str | None = None
    manifest_sha256: str | None = None

    @classmethod
    def from_json(cls, obj: Any) -> JobManifest:
        _validate_job_manifest(obj)
        return cls._read(
            obj,
            workload=WorkloadRef._read(obj["workload"]),
            process_groups=[ProcessGroupRecord._read(group) for group in obj["process_groups"]],
            ranks=[RankRecord._read(rank) for rank in obj["ranks"]],
        )


def _list_of_objects(limit: int) -> Check:
    return Check(
        lambda v: isinstance(v, list) and len(v) <= limit and all(isinstance(x, dict) for x in v),
        f"a list of at most {limit} objects",
    )


JOB_FIELDS: dict[str, Check] = {
    "schema": choice(JOB_SCHEMA),
    MANIFEST_DIGEST: SHA256,
    "created": optional(text(64)),
    "complete": BOOL,
    "world_size": integer(1, MAX_WORLD_SIZE),
    "backend": text(64, "[a-z0-9_:]+"),
    "process_groups": _list_of_objects(1 << 16),
    "ranks": _list_of_objects(MAX_WORLD_SIZE),
    "workload": OBJECT,
    "workload.ref": MANIFEST_FIELDS["workload.ref"],
    "workload.kwargs": MANIFEST_FIELDS["workload.kwargs"],
    "signature": optional(text(64, "[0-9a-f]{64}")),
}


def _validate_job_manifest(manifest: Any) -> None:
    _require(isinstance(manifest, dict), "not a JSON object")
    check_json_value(manifest, MANIFEST, MAX_JSON_DEPTH)
    _check_fields(manifest, {"schema": choice(JOB_SCHEMA), MANIFEST_DIGEST: SHA256})
    if manifest[MANIFEST_DIGEST] != manifest_digest(manifest):
        raise BundleError(
            "the job manifest does not match its own SHA-256 (damaged or edited by hand)",
            "Restore the bundle from a copy or record it again; "
            "a bundle is evidence and is not edited.",
        )
    _check_fields(manifest, JOB_FIELDS)
    for position, group in enumerate(manifest["process_groups"]):
        _check_fields(group, ProcessGroupRecord.RULES, f"process_groups[{position}].")
    world_size = manifest["world_size"]
    for position, rank in enumerate(manifest["ranks"]):
        _check_fields(rank, RankRecord.RULES, f"ranks[{position}].")
        _require(rank["rank"] == position, f"ranks[{position}].rank is {rank['rank']}")
        _require(
            rank["part"] == part_dir(position),
            f"ranks[{position}].part is {rank['part']!r}, expected {part_dir(position)!r}",
        )
        _require(
            not manifest["complete"] or rank.get(MANIFEST_DIGEST) is not None,
            f"ranks[{position}].{MANIFEST_DIGEST} is null in a complete job",
        )
    _require(
        len(manifest["ranks"]) == world_size,
        f"{len(manifest['ranks'])} ranks listed for world_size {world_size}",
    )


def _read_manifest_json(path: Path) -> Any:
    if not os.path.lexists(path / MANIFEST):
        raise BundleError(f"{path} has no {MANIFEST}")
    manifest_path = regular_file_inside(path, MANIFEST)
    raw = read_limited(manifest_path, MAX_MANIFEST_BYTES, "manifest")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError as exc:
        raise BundleError(f"{manifest_path} nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:
        raise BundleError(f"{manifest_path} is not valid JSON: {str(exc)[:200]}") from exc


def _existing(path: str | Path) -> Path:
    """``path``, or its ``.partial`` twin where only a recording cut off left that."""
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    # os.path, not Path: no OSError for names too long or under a file
    if not os.path.exists(path) and os.path.exists(partial):
        return partial
    return path


def is_job_bundle(path: str | Path) -> bool:
    """Whether ``path`` (or its ``.partial``) is a job bundle: its manifest's schema says so."""
    found = _existing(path)
    try:
        manifest = _read_manifest_json(found) if os.path.isdir(found) else None
    except (BundleError, OSError):
        return False
    return isinstance(manifest, dict) and manifest.get("schema") == JOB_SCHEMA


@dataclass(frozen=True)
class RankPart:
    """A rank of a job bundle and where its part lies."""

    rank: int
    device: str
    part: Path


class JobBundle:
    """A validated job bundle: its manifest, and every rank part that exists, each validated
    as a bundle of its own and tied to the job (its rank, and its manifest's SHA-256 once the
    job closed). A ``.partial`` job reads the parts that exist, each with its completed steps.
    """

    def __init__(self, path: Path, manifest: JobManifest, parts: dict[int, Bundle]):
        self.path = path
        self.manifest = manifest
        self._parts = parts

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> JobBundle:
        found = _existing(path)
        if not os.path.isdir(found):
            raise BundleError(
                f"{str(found)[:300]} is not a bundle directory",
                "Give the directory `sdcreplay record --nproc N --out` wrote.",
            )
        manifest = JobManifest.from_json(_read_manifest_json(found))
        parts: dict[int, Bundle] = {}
        for entry in manifest.ranks:
            part_path = found / entry.part
            if not manifest.complete and not os.path.lexists(_existing(part_path) / MANIFEST):
                continue  # the job died before this rank wrote its part's manifest
            parts[entry.rank] = _open_part(part_path, manifest, entry, verify)
        return cls(found, manifest, parts)

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    @property
    def backend(self) -> str:
        return self.manifest.backend

    @property
    def process_groups(self) -> list[ProcessGroupRecord]:
        return self.manifest.process_groups

    @property
    def complete(self) -> bool:
        return self.manifest.complete

    @property
    def ranks(self) -> list[RankPart]:
        return [RankPart(r.rank, r.device, self.path / r.part) for r in self.manifest.ranks]

    @property
    def parts(self) -> dict[int, Bundle]:
        """The parts that exist, by rank (all of them in a complete job)."""
        return dict(self._parts)

    def rank(self, rank: int) -> Bundle:
        """Rank ``rank``'s part, validated as a bundle."""
        part = self._parts.get(rank)
        if part is None:
            raise BundleError(
                f"the job {self.path} has no part for rank {rank} "
                f"(it has {sorted(self._parts)} of world size {self.world_size})",
                "A job cut off before that rank wrote a step holds none of its data; "
                "record the job again.",
            )
        return part

    @property
    def trusted(self) -> bool:
        return trust.is_trusted(self.manifest.workload.ref, self.manifest.to_json())

    def require_trusted(self) -> None:
        trust.require_trusted(self.manifest.workload.ref, self.manifest.to_json())


def _open_part(path: Path, job: JobManifest, entry: RankRecord, verify: bool) -> Bundle:
    """A rank's part: a bundle whose ``distributed`` names this rank of this job."""
    part = Bundle.open(path, verify=verify)
    info = part.manifest.distributed
    if info is None or (info.rank, info.world_size) != (entry.rank, job.world_size):
        raise BundleError(
            f"{entry.part} is not rank {entry.rank} of a {job.world_size}-rank job "
            f"(its manifest says {None if info is None else info.to_json()})"
        )
    if entry.manifest_sha256 is not None and part.manifest.manifest_sha256 != entry.manifest_sha256:
        raise BundleError(
            f"{entry.part}'s manifest is not the one the job manifest lists "
            "(a part from another job, or edited)"
        )
    if (part.manifest.workload.ref, part.manifest.workload.kwargs) != (
        job.workload.ref,
        job.workload.kwargs,
    ):
        raise BundleError(f"{entry.part} names another workload than its job manifest")
    return part


class JobWriter:
    """Rank 0's side of a job bundle: the job manifest, written at the start (so a job cut off
    mid-step reads as the parts that exist) and at ``close`` (every part's manifest SHA-256).
    Each rank writes its own part with a ``BundleWriter`` at ``part_path(rank)``."""

    def __init__(
        self,
        path: Path,
        *,
        world_size: int,
        backend: str,
        process_groups: list[ProcessGroupRecord],
        devices: list[str],
        workload: WorkloadRef,
        overwrite: bool = False,
    ):
        self.final_path = Path(path)
        self.path = job_partial_path(self.final_path)
        self._overwrite = overwrite
        _prepare_directory(self.final_path, self.path, overwrite, RANKS)
        self.manifest = JobManifest(
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            world_size=world_size,
            backend=backend,
            process_groups=process_groups,
            ranks=[
                RankRecord(rank=rank, device=device, part=part_dir(rank))
                for rank, device in enumerate(devices)
            ],
            workload=workload,
        )
        self._save(durable=True)

    def _save(self, durable: bool = False) -> None:
        _save_signed(self.manifest, self.path, durable)

    def close(self) -> Path:
        """Tie every (closed) part to the job, mark it complete and give it its name."""
        for entry in self.manifest.ranks:
            part = Bundle.open(self.path / entry.part, verify=False)
            if not part.complete:
                raise BundleError(f"rank {entry.rank}'s part did not close; the job stays partial")
            entry.manifest_sha256 = part.manifest.manifest_sha256
        self.manifest.complete = True
        self._save(durable=True)
        _move_into_place(self.path, self.final_path, self._overwrite)
        return self.final_path


def job_partial_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


def part_path(job: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its part (``BundleWriter`` adds ``.partial`` until it
    closes) while the job at ``job`` is recorded."""
    return job_partial_path(Path(job)) / part_dir(rank)


@dataclass
class BundleInfo:
    """What ``sdcreplay info`` shows (``sdcreplay.info/1``); every file was verified first."""

    bundle: str
    bundle_schema: str
    complete: bool
    created: str | None
    workload: dict
    device: str
    device_type: str
    digest: str | None
    state: dict
    steps: list[dict]
    state_objects: list[str]
    verification: dict
    entries: int
    files: int
    size_bytes: int
    integrity: str
    environment: dict
    determinism: dict
    fingerprint: dict | None
    must_match: dict
    trusted: bool
    trigger: dict | None = None
    ranks: int | None = None  # a job bundle: its world size
    messages: int | None = None  # a job bundle: messages logged by all its ranks
    parts: list[dict] | None = None  # a job bundle: per rank its device, steps and messages

    exit_code = 0

    JOB_ONLY = ("ranks", "messages", "parts")

    def to_json(self) -> dict:
        body = {"schema": "sdcreplay.info/1", **vars(self)}
        if self.ranks is None:
            body = {key: value for key, value in body.items() if key not in self.JOB_ONLY}
        return body


def describe(path: str | Path) -> BundleInfo:
    """What ``sdcreplay info`` shows: every file is verified first. A job bundle is described
    by its first part, with the job's completeness, ranks, messages and parts."""
    if is_job_bundle(path):
        return _describe_job(JobBundle.open(path, verify=True))
    return _describe_bundle(Bundle.open(path, verify=True))


def _describe_job(job: JobBundle) -> BundleInfo:
    parts: list[dict[str, Any]] = []
    messages = 0
    for entry in job.ranks:
        part = job.parts.get(entry.rank)
        logged = sum(map(len, part.messages().values())) if part is not None else 0
        messages += logged
        parts.append(
            {
                "rank": entry.rank,
                "device": entry.device,
                "steps": len(part.steps) if part is not None else 0,
                "messages": logged,
                "complete": part is not None and part.complete,
            }
        )
    if not job.parts:
        raise BundleError(f"the job {job.path} holds no rank part yet")
    info = _describe_bundle(job.parts[min(job.parts)])
    info.bundle, info.bundle_schema, info.complete = str(job.path), JOB_SCHEMA, job.complete
    info.ranks, info.messages, info.parts = job.world_size, messages, parts
    info.trusted = job.trusted
    return info


def _describe_bundle(bundle: Bundle) -> BundleInfo:
    manifest = bundle.manifest
    log = bundle.signature_log()
    return BundleInfo(
        bundle=str(bundle.path),
        bundle_schema=manifest.schema,
        complete=manifest.complete,
        created=manifest.created,
        workload=manifest.workload.to_json(),
        device=manifest.device,
        device_type=manifest.device_type,
        digest=manifest.digest,
        state=manifest.state.to_json(),
        steps=[
            {
                "index": step.index,
                "entries": step.entries,
                "optimizer_step": step.optimizer_step,
                "grads": step.grads,
            }
            for step in bundle.steps
        ],
        state_objects=bundle.state_object_names,
        verification=manifest.verification.to_json(),
        entries=log.entry_count(),
        files=len(manifest.files),
        size_bytes=bundle.size_bytes(),
        integrity="ok",
        environment=manifest.environment.to_json(),
        determinism=manifest.determinism.to_json(),
        fingerprint=manifest.fingerprint,
        must_match=must_match(manifest.fingerprint or {}),
        trusted=bundle.trusted,
        trigger=None if manifest.trigger is None else manifest.trigger.to_json(),
    )
