"""Writing a bundle so that a crash leaves evidence and an overwrite destroys nothing else.

Writing goes to ``NAME.partial`` with the manifest rewritten atomically after
every completed step, and is renamed to ``NAME`` when the recording closes; a
recording cut off mid-write leaves a ``.partial`` bundle that reads as the
steps that completed. ``--overwrite`` replaces only a directory that holds
sdcreplay's files alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import leftovers
from ..capture.message import Message
from ..capture.signature import SignatureLogWriter
from ..errors import BundleError, SdcReplayError
from ..storage.rundir import replacing_refused, set_aside
from . import trust
from .job_manifest import JobManifest
from .manifest import (
    MANIFEST,
    MANIFEST_DIGEST,
    MESSAGES,
    PARTIAL_SUFFIX,
    PROBE,
    RANKS,
    SIGNATURES,
    STATE,
    CaptureSettings,
    CheckpointState,
    DistributedInfo,
    EmbeddedState,
    Environment,
    FileMeta,
    Manifest,
    StepRecord,
    Switches,
    Trigger,
    Verification,
    WorkloadRef,
    manifest_digest,
    sha256_file,
    step_file,
)
from .state import write_rng, write_state

if TYPE_CHECKING:  # torch, h5py, tensorio and RngState: imported where tensors are read or
    # written, so that `sdcreplay info`, `diff` and `replay`'s own process load none of them
    from ..capture.determinism import RngState


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


_BUNDLE_ENTRIES = {MANIFEST, MANIFEST + ".tmp", SIGNATURES, MESSAGES, STATE, PROBE, "steps"}


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


def _claim(path: Path, overwrite: bool, refusal: SdcReplayError) -> None:
    """Refuse to write at ``path`` unless it is free, or a bundle ``overwrite`` may replace."""
    if not path.exists() and not path.is_symlink():
        return
    if not overwrite:
        raise refusal
    if not written_by_us(path):
        raise BundleError(
            f"{path} exists and is not a bundle; "
            "--overwrite replaces only a bundle sdcreplay wrote",
            "Choose another --out, or move that file or directory away yourself.",
            python_hint="Choose another out=, or move that file or directory away yourself.",
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


def claim_output(final: Path, partial: Path, overwrite: bool) -> None:
    """Refuse to record at ``final`` unless it and its ``partial`` twin are free (or bundles
    ``overwrite`` may replace); a job launcher asks before starting its ranks."""
    _claim(final, overwrite, replacing_refused(final, "", BundleError))
    leftover = replacing_refused(partial, "a leftover partial recording", BundleError)
    leftover.hint = f"It may be the only evidence of a crash: `sdcreplay info {partial}` shows "
    leftover.hint += "what it holds; move it away, or pass --overwrite to move it aside."
    leftover.python_hint = (
        "It may be the only evidence of a crash: "
        f"sdcreplay.Bundle.open({str(partial)!r}, verify=False) reads what it holds; "
        "move it away, or pass overwrite=True to move it aside."
    )
    _claim(partial, overwrite, leftover)


def _prepare_directory(final: Path, partial: Path, overwrite: bool, inner: str) -> list[Path]:
    """Claim ``final`` and its ``partial`` twin, and create ``partial/inner`` (``partial`` in
    one ``mkdir``: two recordings never share it); a leftover partial is moved aside, and
    where it went is returned."""
    moved = []
    try:
        claim_output(final, partial, overwrite)
        if partial.exists() or partial.is_symlink():
            moved.append(set_aside(partial))
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.mkdir()
        (partial / inner).mkdir(parents=True)
    except FileExistsError as exc:
        if not partial.parent.is_dir():  # its parent is a file: not a race with a recording
            raise _uncreatable(partial, exc) from exc
        raise BundleError(
            f"{partial} is being written by another recording",
            "Give each recording its own --out.",
            python_hint="Give each recording its own out=.",
        ) from exc
    except OSError as exc:
        raise _uncreatable(partial, exc) from exc
    return moved


def _uncreatable(partial: Path, exc: OSError) -> BundleError:
    return BundleError(
        f"cannot create the bundle directory {str(partial)[:200]}: {exc.strerror}",
        "Choose an --out in a writable directory (not under a file or /proc, "
        "each name at most 255 bytes).",
        python_hint="Choose an output path in a writable directory (not under a file or "
        "/proc, each name at most 255 bytes).",
    )


def _save_signed(manifest: Manifest | JobManifest, directory: Path, durable: bool) -> None:
    """Write ``manifest`` into ``directory``; its signature and self-digest are made over the
    JSON as written."""
    body = manifest.to_json()
    body[trust.SIGNATURE] = manifest.signature = trust.sign(body)
    body[MANIFEST_DIGEST] = manifest.manifest_sha256 = manifest_digest(body)
    _write_json_atomic(directory / MANIFEST, body, durable)


def _move_into_place(partial: Path, final: Path, overwrite: bool) -> list[Path]:
    """Rename a closed recording to its final name (``overwrite``: moving a bundle there
    aside, returned)."""
    moved = []
    if (final.exists() or final.is_symlink()) and overwrite:
        _claim(final, True, BundleError(""))  # still a bundle: it may have changed since
        moved.append(set_aside(final))
    try:
        os.rename(partial, final)  # never onto a bundle another run put there meanwhile
    except OSError as exc:
        raise BundleError(
            f"{final} was written by another recording while this one ran; this one is in "
            f"{partial}",
            "Give each recording its own --out.",
            python_hint="Give each recording its own out=.",
        ) from exc
    return moved


UNFINISHED = (
    "`sdcreplay info` on it lists the steps it holds (it replays as those); record again with "
    "--overwrite (overwrite=True) to replace it, or delete it"
)


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
        injected_faults: Sequence[str] = (),
    ):
        self.final_path = Path(path)
        self.path = self.final_path.with_name(self.final_path.name + PARTIAL_SUFFIX)
        self.moved_aside = _prepare_directory(self.final_path, self.path, overwrite, "steps")
        leftovers.begin(self.path, "an unfinished bundle", UNFINISHED)
        self._overwrite = overwrite
        # Written only once embed_state or reference_checkpoint has set the state; the
        # optional parts not known yet stay out of the JSON until they are.
        unset = {"state_objects", "verification", "trigger", "compiled"} | {
            name
            for name, value in (
                ("fingerprint", fingerprint),
                ("capture", capture),
                ("distributed", distributed),
                ("injected_faults", injected_faults or None),
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
            injected_faults=list(injected_faults) or None,
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
        """Did the Recorder prove the workload's step reproduces the loop's (verification.py)?"""
        verification = Verification(
            mode=mode,
            status=status,
            problem=problem,
            absent=frozenset() if problem else frozenset({"problem"}),
        )
        self.manifest.present("verification", verification)
        self._save_manifest()

    def set_probe(self, probe: dict) -> None:
        """Keep the recording device's kernel probe (``sdcreplay.probe/1``) beside the steps."""
        (self.path / PROBE).write_text(json.dumps(probe, separators=(",", ":")))
        self._note_file(PROBE)
        self._save_manifest()

    def set_compiled(self, regions: list[dict]) -> None:
        """Keep the compiled regions and their code digests (capture/compiled.py), as far as
        the recording has seen them generated."""
        if regions != self.manifest.compiled:
            self.manifest.present("compiled", regions)
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
        stopped: bool = False,
        around: dict | None = None,
    ) -> None:
        """``grads``: what the gradients held as the step began; ``seconds``: how long the step
        took while recording (replay's timeout comes from it); ``messages``: a rank's logged
        collectives (a job's part), one frame of the message log per step that has any;
        ``stopped``: a detector stopped the step before its optimizer's update; ``around``: what
        the loop set around the step (capture/around.py: hyperparameters, restore points)."""
        import h5py

        from ..storage import tensorio

        name = step_file(index)
        with h5py.File(self.path / name, "w") as handle:
            tensorio.write_tree(handle.create_group("batch"), batch)
            write_rng(handle.create_group("rng"), rng)
            if around is not None:
                tensorio.write_tree(handle.create_group("around"), around)
        self._note_file(name)
        self._signatures.append_step(index, entries)
        if messages:
            self._messages.append_records([message.to_json() for message in messages])
        self._note_stream_files()
        unset = ({"seconds"} if seconds is None else set()) | (set() if stopped else {"stopped"})
        self.manifest.steps.append(
            StepRecord(
                index=index,
                file=name,
                entries=len(entries),
                optimizer_step=optimizer_step,
                grads=grads,
                seconds=None if seconds is None else round(float(seconds), 6),
                messages=None if messages is None else len(messages),
                stopped=stopped,
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
        self.moved_aside += _move_into_place(self.path, self.final_path, self._overwrite)
        leftovers.end(self.path)
        return self.final_path

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        leftovers.end(self.path)
