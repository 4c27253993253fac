"""The bundle's manifest: the bundle's layout, the manifest's typed objects and the rules every
manifest is held to before any of them is built.

Every other module reads the manifest through these types, never by key, so a change of the
format is made in this package (docs/bundle-format.md is the prose).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..capture.compiled import regions_problem
from ..errors import BundleError
from ..kinds import MODULE_NAMINGS, SIGNATURE_LEVELS
from ..storage.safeio import check_json_value
from .rules import (
    BOOL,
    ENV_NAME,
    OBJECT,
    OPTIONAL_OBJECT,
    SHA256,
    Check,
    Record,
    _check_fields,
    _require,
    absent_or,
    choice,
    integer,
    mapping,
    nullable,
    number,
    optional,
    text,
)

SCHEMA = "sdcreplay.bundle/1"
JOB_SCHEMA = "sdcreplay.job/1"
MANIFEST = "manifest.json"
SIGNATURES = "signatures.jsonl.zst"
MESSAGES = "messages.jsonl.zst"
STATE = "state.h5"
PROBE = "probe.json"  # the kernel probe of the recording device (capture/probe.py)
MAX_PROBE_BYTES = 16 << 20
PARTIAL_SUFFIX = ".partial"
MANIFEST_DIGEST = "manifest_sha256"
RANKS = "ranks"
MAX_WORLD_SIZE = 1 << 20

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


@dataclass(kw_only=True)
class WorkloadRef(Record):
    """What replay runs (if trust.py allows): a factory ``ref`` called with ``kwargs``, or, of
    ``kind`` "script", the ``command`` that ran the loop (replay/script.py)."""

    ref: str
    kwargs: dict[str, Any]
    kind: str = "factory"  # absent: a factory
    command: dict[str, Any] | None = None  # kind "script" only
    absent: frozenset[str] = frozenset({"kind", "command"})  # a factory's JSON as before

    @property
    def is_script(self) -> bool:
        return self.kind == "script"


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
    # What the record holds: every layer's entries, or the step's boundary only (program
    # entries included); replay captures every layer and votes the record at its entries.
    level: str = "layer"  # absent: "layer"
    # How entries name modules: "plain" (module_names), or "wrapped" (absent: recorded before)
    naming: str = "wrapped"


@dataclass(kw_only=True)
class Verification(Record):
    """Did the Recorder prove that the workload's step reproduces the loop's (verification.py)?
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
        "anchor": absent_or(choice("snapshot", "checkpoint")),
        "note": absent_or(text(REASON_LIMIT)),
    }
    reason: str  # what the alarm (or the person) said
    source: str  # who asked: "user", "ReplayCheck", "UpdateDetector", "record", ...
    step: int  # the last step in the bundle
    ring: int  # the ring's size K: the bundle holds at least the last K steps (or all)
    # where the window starts: a copy of the state, or the loop's own checkpoint (the state
    # names it); absent in bundles older than checkpoint anchors: "snapshot"
    anchor: str = "snapshot"
    note: str | None = None  # what the window holds, in words, where it is not the last K


@dataclass(kw_only=True)
class EmbeddedState(Record):
    """Model and optimizer state in the bundle's own ``state.h5``."""

    RULES: ClassVar[dict[str, Check]] = {"file": choice(STATE)}
    kind: str = "embedded"
    file: str = STATE


CHECKPOINT_FORMATS = ("torch", "hf", "dcp")

_CHECKPOINT_FILE = re.compile(r"\.?[A-Za-z0-9_][A-Za-z0-9_.=-]{0,254}")
"""A file directly in a checkpoint directory (``model.safetensors``, ``.metadata``)."""


def _checks(obj: dict, rules: dict[str, Check]) -> bool:
    return set(obj) >= set(rules) and all(rule.test(obj[key]) for key, rule in rules.items())


@dataclass(kw_only=True)
class CheckpointState(Record):
    """A checkpoint outside the bundle the recording started from, pinned by its SHA-256
    (checked before every load): a ``torch.save`` file, or (``format``) a Hugging Face
    Trainer checkpoint directory or a torch.distributed.checkpoint directory, whose ``files``
    replay reads each have their own and ``sha256`` is that of their listing
    (bundle/checkpoints.py)."""

    RULES: ClassVar[dict[str, Check]] = {
        "path": text(4096),
        "sha256": SHA256,
        "size": optional(integer(0, MAX_FILE_BYTES)),
        "format": absent_or(choice(*CHECKPOINT_FORMATS)),
        "files": absent_or(
            Check(
                lambda v: (
                    isinstance(v, dict)
                    and 0 < len(v) <= 100_000
                    and all(
                        isinstance(name, str)
                        and _CHECKPOINT_FILE.fullmatch(name) is not None
                        and isinstance(meta, dict)
                        and _checks(meta, FileMeta.RULES)
                        for name, meta in v.items()
                    )
                ),
                "an object of file names in the checkpoint's directory -> {size, sha256}",
            )
        ),
    }
    kind: str = "checkpoint"
    path: str
    size: int | None = None
    sha256: str
    format: str | None = None  # absent: "torch", a torch.save file
    files: dict[str, FileMeta] | None = None  # a directory's files replay reads


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
        "stopped": absent_or(BOOL),
    }
    index: int
    file: str
    entries: int
    optimizer_step: bool  # the optimizer stepped in the step; replay does the same
    grads: str = "none"  # what the gradients held when the step began: none | zero | kept
    seconds: float | None = None  # how long it took when recorded: replay's hang timeout
    messages: int | None = None  # a job's rank part: the step's logged collective messages
    # A detector stopped the step at its optimizer's step, before the update (its entries end
    # with what the optimizer was given); replay stops it there too. Absent: false.
    stopped: bool = False


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
    # The compiled regions and their generated code's digests (capture/compiled.py's JSON);
    # absent: the step ran no compiled code the Recorder watched.
    compiled: list[dict[str, Any]] | None = None
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
    # The fault specs injected into the recording device (a drill: every verdict made from the
    # bundle is one, never evidence); absent: none (and in a bundle older than the field).
    injected_faults: list[str] | None = None
    manifest_sha256: str | None = None  # manifest_digest of the rest

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        """The one way to read a manifest: every rule checked (a violation is a BundleError
        naming the field and the form expected), then every object typed."""
        _validate_manifest(obj)
        typed: dict[str, Any] = {
            "workload": WorkloadRef._read(obj["workload"]),
            "environment": Environment._read(obj["environment"]),
            "determinism": Switches._read(obj["determinism"]),
            "state": _read_state(obj["state"]),
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


def _read_state(obj: dict) -> StateRef:
    if obj["kind"] == "checkpoint" and "files" in obj:
        files = {name: FileMeta._read(meta) for name, meta in obj["files"].items()}
        return CheckpointState._read(obj, files=files)
    return STATE_KINDS[obj["kind"]]._read(obj)


def _strings(v: Any, least: int = 0) -> bool:
    return isinstance(v, list) and len(v) >= least and all(isinstance(a, str) for a in v)


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
    "workload.kind": absent_or(choice("factory", "script")),
    "workload.command": absent_or(OBJECT),
    "workload.command.python": absent_or(text(4096)),
    "workload.command.argv": absent_or(Check(lambda v: _strings(v, 1), "strings, script first")),
    "workload.command.cwd": absent_or(text(4096)),
    "workload.command.env": absent_or(mapping(ENV_NAME, text(65536))),
    "workload.command.module": optional(text(1024)),
    "workload.command.world_size": optional(integer(1, MAX_WORLD_SIZE)),
    "workload.command.env_watched": optional(Check(_strings, "names or NAME* patterns")),
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
    "capture.level": absent_or(choice(*SIGNATURE_LEVELS)),
    "capture.naming": absent_or(choice(*MODULE_NAMINGS)),
    "compiled": optional(
        Check(lambda v: regions_problem(v) is None, "a list of compiled regions (bundle-format.md)")
    ),
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
    "injected_faults": optional(
        Check(
            lambda v: (
                isinstance(v, list)
                and 0 < len(v) <= 256
                and all(isinstance(s, str) and 0 < len(s) <= 4096 for s in v)
            ),
            "a list of fault specs",
        )
    ),
    "trigger": OPTIONAL_OBJECT,
    "distributed": OPTIONAL_OBJECT,
    "state": OBJECT,
    "state.kind": choice(*STATE_KINDS),
    "files": mapping(text(256), OBJECT),
    "steps": Check(lambda v: isinstance(v, list) and len(v) <= 1_000_000, "a list of steps"),
}


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
    capture = manifest.get("capture") or {}
    _require(
        capture.get("level", "layer") == "layer" or capture.get("program") is True,
        "capture.program is true at capture.level 'boundary' (its program entries are its "
        "boundary)",
    )
    workload = manifest["workload"]
    _require(
        (workload.get("kind") == "script")
        == all(key in workload.get("command", {}) for key in ("python", "argv", "cwd", "env")),
        "workload.command (python, argv, cwd, env) is given for a workload of kind 'script', "
        "and only for one",
    )
    state = manifest["state"]
    _check_fields(state, STATE_KINDS[state["kind"]].RULES, "state.")
    _require(
        state["kind"] != "checkpoint"
        or ("files" in state) == (state.get("format", "torch") in ("hf", "dcp")),
        "state.files lists a directory checkpoint's files (format hf or dcp), and only those",
    )
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
        _require(
            not (step.get("stopped") and step["optimizer_step"]),
            f"steps[{position}] is stopped before its optimizer step, yet took it",
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
