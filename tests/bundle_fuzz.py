"""Bundle mutations and the oracle that judges what sdcreplay does with them.

Two kinds of mutation: *raw* (bytes flipped or cut, hashes left alone: the
integrity check must refuse them) and *semantic* (a value changed where the
tool will read it, with every SHA-256 recomputed, so the validators and the
code behind them are what is tested). The oracle runs ``info`` and ``diff``
through the CLI in this process and replays the bundle with the library, and
classifies the outcome: a specific ``Error:`` (exit 3), a verdict, or a bug
(a traceback, a catch-all "unexpected ..." message, a hang).

Used by tests/test_reliability.py (a few hundred mutations under hypothesis)
and bench/fuzz_bundles.py (thousands, counts in docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import zstandard
from conftest import preserved_global_state
from typer.testing import CliRunner

from sdcreplay.bundle.job_bundle import JobBundle
from sdcreplay.bundle.manifest import (
    MANIFEST,
    MANIFEST_DIGEST,
    MESSAGES,
    SIGNATURES,
    manifest_digest,
)
from sdcreplay.bundle.reader import MESSAGE_FIELDS, Bundle
from sdcreplay.capture.signature import read_signature_log
from sdcreplay.cli import app
from sdcreplay.compare.logs import compare_logs
from sdcreplay.errors import SdcReplayError
from sdcreplay.replay.session import replay_on_device


def _deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


POOL: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    2**31,
    2**63,
    2**70,
    -(2**70),
    0.5,
    -0.0,
    float("nan"),
    float("inf"),
    "",
    "x",
    "x" * 5000,
    "\ud800",
    "a\x00b",
    "cuda:0",
    "float32",
    "../etc/passwd",
    [],
    [1, 2],
    {},
    {"a": 1},
    _deep(978),
]


def pool_value(rng: random.Random) -> Any:
    return POOL[rng.randrange(len(POOL))]


# -- hashes ----------------------------------------------------------------------------------------


def load_manifest(bundle: Path) -> dict:
    return json.loads((bundle / MANIFEST).read_text())


def save_manifest(bundle: Path, manifest: dict) -> None:
    """Write the manifest with a valid self-digest (the point: the validators, not the hash, must
    catch it)."""
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=1))


def rehash(bundle: Path, name: str) -> None:
    """Make the manifest vouch for the file ``name`` as it is now."""
    manifest = load_manifest(bundle)
    data = (bundle / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    save_manifest(bundle, manifest)


# -- semantic mutations ----------------------------------------------------------------------------


def _containers(node: Any, path: tuple = ()) -> list[tuple]:
    """Every (path, container) in a JSON value."""
    found = []
    if isinstance(node, (dict, list)):
        found.append((path, node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            found.extend(_containers(value, (*path, key)))
    return found


def manifest_value(bundle: Path, rng: random.Random) -> str:
    manifest = load_manifest(bundle)
    candidates = [
        (path, node, key)
        for path, node in _containers(manifest)
        for key in (node if isinstance(node, dict) else range(len(node)))
        if key != MANIFEST_DIGEST
    ]
    path, node, key = rng.choice(candidates)
    node[key] = pool_value(rng)
    save_manifest(bundle, manifest)
    return f"manifest {'.'.join(map(str, (*path, key)))} = {str(node[key])[:30]}"


def manifest_delete(bundle: Path, rng: random.Random) -> str:
    manifest = load_manifest(bundle)
    dicts = [
        (path, node) for path, node in _containers(manifest) if isinstance(node, dict) and node
    ]
    path, node = rng.choice(dicts)
    key = rng.choice([k for k in node if k != MANIFEST_DIGEST] or list(node))
    del node[key]
    save_manifest(bundle, manifest)
    return f"manifest del {'.'.join(map(str, (*path, key)))}"


def manifest_steps(bundle: Path, rng: random.Random) -> str:
    manifest = load_manifest(bundle)
    steps = manifest["steps"]
    edit = rng.choice(["reverse", "duplicate", "drop", "index", "seconds"])
    if edit == "reverse":
        steps.reverse()
    elif edit == "duplicate":
        steps.append(dict(steps[0]))
    elif edit == "drop":
        steps.pop(rng.randrange(len(steps)))
    elif edit == "index":
        rng.choice(steps)["index"] = rng.choice([5, 99, -1, 2**40])
    else:
        rng.choice(steps)["seconds"] = rng.choice([0, 1e-9, 1e9, -1.0, float("nan"), "1"])
    save_manifest(bundle, manifest)
    return f"manifest steps {edit}"


def manifest_inert(bundle: Path, rng: random.Random) -> str:
    """An edit that must not change anything a replay does."""
    manifest = load_manifest(bundle)
    manifest["created"] = f"2020-01-0{rng.randint(1, 9)}T00:00:00+00:00"
    manifest["environment"]["host"] = f"host-{rng.randrange(1000)}"
    save_manifest(bundle, manifest)
    return "manifest inert"


def _h5_files(bundle: Path) -> list[str]:
    return sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*.h5"))


def _objects(handle: h5py.File) -> list[str]:
    names: list[str] = []
    handle.visit(names.append)
    return names


def h5_attr(bundle: Path, rng: random.Random) -> str:
    name = rng.choice(_h5_files(bundle))
    with h5py.File(bundle / name, "a") as handle:
        target = handle[rng.choice(_objects(handle))]
        attrs = list(target.attrs)
        key = (
            rng.choice(attrs)
            if attrs and rng.random() < 0.9
            else rng.choice(["dtype", "shape", "skeleton"])
        )
        value = rng.choice(
            [
                json.dumps(_deep(rng.choice([10, 100, 978]))),
                "bogus",
                "qint8",
                "complex32",
                "float8_e4m3fn",
                "bfloat16",
                "Tensor",
                "int64",
                [2**40],
                [-1],
                [3, 3],
                [],
                np.array([1.5]),
                2**62,
                -5,
                "{}",
                '{"tensor": "t0"}',
                '{"dict": [[[1], {"value": 1}]]}',
                '{"list": [{"tensor": "nope"}]}',
                '{"device": "cuda:99"}',
                '{"dtype": "qint8"}',
                "[1, 2]",
                "null",
                "MT19937",
                "PCG64",
            ]
        )
        with contextlib.suppress(TypeError, ValueError):
            target.attrs[key] = value
    rehash(bundle, name)
    return f"{name} {target.name}.attrs[{key}] = {str(value)[:30]}"


def take_dataset(handle: h5py.File, target: str) -> tuple[dict, np.ndarray]:
    """Remove a dataset, returning its attributes and values (to put back changed)."""
    old = handle[target]
    attrs, data = dict(old.attrs), np.asarray(old[()])
    del handle[target]
    return attrs, data


def _random_dataset(handle: h5py.File, rng: random.Random) -> str:
    return rng.choice([n for n in _objects(handle) if isinstance(handle[n], h5py.Dataset)])


def h5_data(bundle: Path, rng: random.Random) -> str:
    name = rng.choice(_h5_files(bundle))
    with h5py.File(bundle / name, "a") as handle:
        target = _random_dataset(handle, rng)
        attrs, data = take_dataset(handle, target)
        edit = rng.choice(["values", "dtype", "shape", "strings", "compound", "big"])
        if edit == "values" and np.size(data):
            data = np.array(data, copy=True)
            flat = data.reshape(-1)
            extreme = {
                "i": [np.iinfo(flat.dtype).max, np.iinfo(flat.dtype).min, 10**6]
                if flat.dtype.kind == "i"
                else [0],
                "u": [np.iinfo(flat.dtype).max] if flat.dtype.kind == "u" else [0],
                "f": [np.nan, np.inf, -1e30],
            }.get(flat.dtype.kind, [0])
            flat[rng.randrange(flat.size)] = rng.choice(extreme)
        elif edit == "dtype":
            data = np.asarray(data).astype(
                rng.choice([np.int8, np.float16, np.float64, np.uint32, np.int64])
            )
        elif edit == "shape":
            data = np.asarray(data).reshape(-1)[: max(0, np.size(data) - 1)]
        elif edit == "strings":
            data = np.array([b"abc", b"def"])
        elif edit == "compound":
            data = np.zeros(3, dtype=[("a", "i4"), ("b", "f4")])
        else:
            data = np.zeros(rng.choice([10**5, 2 * 10**6]), dtype=np.int64)
        handle.create_dataset(target, data=data).attrs.update(attrs)
    rehash(bundle, name)
    return f"{name} {target} {edit}"


def h5_delete(bundle: Path, rng: random.Random) -> str:
    name = rng.choice(_h5_files(bundle))
    with h5py.File(bundle / name, "a") as handle:
        target = rng.choice(_objects(handle))
        del handle[target]
    rehash(bundle, name)
    return f"{name} del {target}"


def h5_bytes(bundle: Path, rng: random.Random) -> str:
    """A few bits of an HDF5 file flipped (mostly in its structure: object headers, B-trees,
    heaps), the manifest vouching for the file as it is then."""
    name = rng.choice(_h5_files(bundle))
    data = bytearray((bundle / name).read_bytes())
    for _ in range(rng.randint(1, 8)):
        span = min(len(data), 4096) if rng.random() < 0.7 else len(data)
        data[rng.randrange(span)] ^= 1 << rng.randrange(8)
    (bundle / name).write_bytes(bytes(data))
    rehash(bundle, name)
    return f"{name} bits flipped"


def unreadable_structures(path: Path, signature: bytes) -> None:
    """Every structure of an HDF5 file marked ``signature`` (HDF5's own tags: TREE a B-tree
    node, HEAP a local heap, SNOD a symbol table node, GCOL the global heap of variable-length
    strings) made unreadable, as a flipped bit would."""
    data = path.read_bytes()
    assert signature in data
    path.write_bytes(data.replace(signature, b"X" + signature[1:]))


def heap_object_grown(path: Path, by: int = 128) -> None:
    """The size of the first object of the file's first global heap collection (where
    variable-length strings live) grown by ``by`` bytes: libhdf5, walking the collection, then
    lands in its zeroed free space on an object of size 0 and never leaves it."""
    data = bytearray(path.read_bytes())
    size_at = data.index(b"GCOL\x01\x00\x00\x00") + 16 + 8  # collection header, object header
    size = int.from_bytes(data[size_at : size_at + 8], "little")
    data[size_at : size_at + 8] = (size + by).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def h5_outside(bundle: Path, rng: random.Random) -> str:
    """Data that lives outside the file: an external link or external raw storage (read outside the
    bundle)."""
    name = rng.choice(_h5_files(bundle))
    outside = bundle.parent / f"outside-{rng.randrange(10**6)}"
    kind = rng.choice(["external link", "external storage"])
    with h5py.File(bundle / name, "a") as handle:
        target = _random_dataset(handle, rng)
        put_outside(handle, target, outside, kind)
    rehash(bundle, name)
    return f"{name} {target} {kind}"


def put_outside(handle: h5py.File, target: str, outside: Path, kind: str) -> None:
    """Move a dataset's values to ``outside`` (+ .h5 or .raw), leaving an external link or external
    storage."""
    attrs, data = take_dataset(handle, target)
    if kind == "external link":
        with h5py.File(f"{outside}.h5", "w") as other:
            other.create_dataset("data", data=data).attrs.update(attrs)
        handle[target] = h5py.ExternalLink(f"{outside}.h5", "data")
    else:
        Path(f"{outside}.raw").write_bytes(data.tobytes())
        handle.create_dataset(
            target,
            shape=data.shape,
            dtype=data.dtype,
            external=[(f"{outside}.raw", 0, h5py.h5f.UNLIMITED)],
        ).attrs.update(attrs)


def _frames(raw: bytes) -> list[bytes]:
    """The decompressed text of each frame."""
    texts = []
    while raw:
        obj = zstandard.ZstdDecompressor().decompressobj()
        texts.append(obj.decompress(raw))
        raw = obj.unused_data
    return texts


def _edit_log(bundle: Path, name: str, fields: list[str], rng: random.Random) -> str:
    """Edit the zstd frames of one of a bundle's JSON-line logs, then make the manifest vouch
    for the file as it is now."""
    path = bundle / name
    frames = [text.decode().splitlines() for text in _frames(path.read_bytes())]
    edit = rng.choice(["meta", "entry", "checksum", "drop", "merge"])
    if len(frames) < 2 and edit in ("entry", "drop"):
        edit = "meta"
    if edit == "meta":
        meta = json.loads(frames[0][0])
        meta[rng.choice(["device_type", "schema", "kind", "extra"])] = pool_value(rng)
        frames[0][0] = json.dumps(meta)
    elif edit == "entry":
        frame = rng.choice(frames[1:])
        position = rng.randrange(len(frame))
        entry = json.loads(frame[position])
        entry[rng.choice(fields)] = pool_value(rng)
        frame[position] = json.dumps(entry)
    elif edit == "drop":
        frame = rng.choice(frames[1:])
        frame.pop(rng.randrange(len(frame)))
    elif edit == "merge":
        frames = [frames[0], [line for frame in frames[1:] for line in frame]]
    compressor = zstandard.ZstdCompressor(write_checksum=edit != "checksum")
    path.write_bytes(
        b"".join(
            compressor.compress(("\n".join(lines) + "\n").encode()) for lines in frames if lines
        )
    )
    rehash(bundle, name)
    return f"{name} {edit}"


def _compressed_frames(raw: bytes) -> list[bytes]:
    """The compressed bytes of each frame."""
    frames = []
    while raw:
        obj = zstandard.ZstdDecompressor().decompressobj()
        obj.decompress(raw)
        frames.append(raw[: len(raw) - len(obj.unused_data)])
        raw = obj.unused_data
    return frames


def declaring(frame: bytes, size: int) -> bytes:
    """``frame`` with its header's content size set to ``size`` (a 4-byte size field, as in a
    frame of 64 KiB or more; its checksum left as it was)."""
    descriptor = frame[4]
    assert descriptor >> 6 == 2, "a frame with a 4-byte content size"
    start = 5 + (0 if descriptor & 0x20 else 1) + (0, 1, 2, 4)[descriptor & 3]
    return frame[:start] + size.to_bytes(4, "little") + frame[start + 4 :]


def bomb_frame(kind: str, lines: list[str], rng: random.Random) -> bytes:
    """A frame of a log's lines that expands hugely: ``ratio``: its lines repeated to 64 MiB
    (a few KiB compressed); ``limit``: a step's signature entries padded past what the
    manifest's entry count allows, within the ratio a frame may declare; ``lie``: a header that
    declares less than the frame holds."""
    compressor = zstandard.ZstdCompressor(write_checksum=True)
    text = ("\n".join(lines) + "\n").encode()
    if kind == "ratio":
        return compressor.compress(text * ((64 << 20) // len(text) + 1))
    if kind == "limit":
        pad = rng.randbytes(2600).hex()  # 5200 characters per entry: more than 4 KiB
        padded = [line[:-1] + f', "pad": "{pad}{index}"}}' for index, line in enumerate(lines)]
        return compressor.compress(("\n".join(padded) + "\n").encode())
    frame = compressor.compress(text * ((128 << 10) // len(text) + 1))
    return declaring(frame, len(text))


def log_bomb(bundle: Path, rng: random.Random) -> str:
    """One frame of the signature log, or of a job part's message log, replaced by a
    decompression bomb made of its own lines, the manifest vouching for the file as it is
    then."""
    messages = _compressed_frames((bundle / MESSAGES).read_bytes())
    name = MESSAGES if len(messages) > 1 and rng.random() < 0.5 else SIGNATURES  # any read
    path = bundle / name
    frames = _compressed_frames(path.read_bytes())
    position = rng.randrange(len(frames))
    lines = _frames(frames[position])[0].decode().splitlines()
    kind = rng.choice(
        ["ratio", "limit", "lie"] if name == SIGNATURES and position else ["ratio", "lie"]
    )
    frames[position] = bomb_frame(kind, lines, rng)
    path.write_bytes(b"".join(frames))
    rehash(bundle, name)
    return f"{name} frame {position} {kind} bomb"


def log_edit(bundle: Path, rng: random.Random) -> str:
    return _edit_log(bundle, SIGNATURES, ["step", "name", "digest"], rng)


def messages_edit(bundle: Path, rng: random.Random) -> str:
    """A rank part's message log (a job bundle)."""
    return _edit_log(bundle, MESSAGES, sorted(MESSAGE_FIELDS), rng)


SEMANTIC: dict[str, Callable[[Path, random.Random], str]] = {
    "manifest_value": manifest_value,
    "manifest_delete": manifest_delete,
    "manifest_steps": manifest_steps,
    "manifest_inert": manifest_inert,
    "h5_attr": h5_attr,
    "h5_data": h5_data,
    "h5_delete": h5_delete,
    "h5_outside": h5_outside,
    "h5_bytes": h5_bytes,
    "log_edit": log_edit,
    "log_bomb": log_bomb,
}
INERT = {"manifest_inert"}


# -- raw mutations ---------------------------------------------------------------------------------


def raw_bytes(bundle: Path, rng: random.Random) -> str:
    """Flip, cut or extend a file's bytes without fixing any hash."""
    files = sorted(p for p in bundle.rglob("*") if p.is_file())
    target = rng.choice(files)
    data = bytearray(target.read_bytes())
    edit = rng.choice(["flip", "truncate", "append", "empty"])
    if edit == "flip" and data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif edit == "truncate":
        del data[rng.randrange(len(data) + 1) :]
    elif edit == "append":
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        data = bytearray()
    target.write_bytes(bytes(data))
    return f"raw {edit} {target.relative_to(bundle)}"


# -- the oracle ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    # "error" (exit 3, specific message), "verdict", or a bug: "traceback", "catch_all", "hang"
    kind: str
    detail: str

    @property
    def is_bug(self) -> bool:
        return self.kind in ("traceback", "catch_all", "hang")


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    def expire(*_):
        raise Hang()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


CATCH_ALL = "unexpected "


def _cli(runner: CliRunner, *args: str) -> Outcome | None:
    """None when the command succeeded; an Outcome when it refused (or failed badly)."""
    result = runner.invoke(app, list(args), env={"SDCREPLAY_DEBUG": None})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return Outcome(
            "traceback", f"{args[0]}: {type(result.exception).__name__}: {result.exception}"
        )
    if "Traceback" in result.output:
        return Outcome("traceback", f"{args[0]}: traceback on the console")
    if result.exit_code == 3:
        error = next((line for line in result.stderr.splitlines() if line.startswith("Error:")), "")
        if not error or CATCH_ALL in error or "Hint:" not in result.stderr:
            return Outcome("catch_all", f"{args[0]}: {error or result.stderr[-200:]}")
        return Outcome("error", f"{args[0]}: {error}")
    if result.exit_code not in (0, 1):
        return Outcome("traceback", f"{args[0]}: exit {result.exit_code}")
    return None


def judge(bundle: Path, original: Path, seconds: int = 60) -> Outcome:
    """What sdcreplay does with ``bundle``: info, diff against the original, and a replay."""
    runner = CliRunner()
    try:
        with time_limit(seconds):
            for args in (("info", str(bundle), "--json"), ("diff", str(original), str(bundle))):
                refused = _cli(runner, *args)
                if refused is not None:
                    return refused
            with preserved_global_state():
                try:
                    log = replay_on_device(bundle, "cpu")
                    identical = compare_logs(Bundle.open(bundle).signature_log(), log).identical
                except SdcReplayError as exc:
                    if exc.message.startswith(CATCH_ALL) or not exc.hint:
                        return Outcome("catch_all", f"replay: {exc.message}")
                    return Outcome("error", f"replay: {exc.message}")
                except Hang:
                    raise
                except Exception as exc:  # the bug this oracle exists to find
                    return Outcome("traceback", f"replay: {type(exc).__name__}: {str(exc)[:200]}")
            return Outcome("verdict", "identical" if identical else "divergent")
    except Hang:
        return Outcome("hang", f"no answer within {seconds} s")


def original_verdict(original: Path) -> str:
    with preserved_global_state():
        log = replay_on_device(original, "cpu")
    return (
        "identical"
        if compare_logs(read_signature_log(original / SIGNATURES), log).identical
        else "divergent"
    )


# -- job bundles -----------------------------------------------------------------------------------


def job_edit(job: Path, rng: random.Random) -> str:
    """A semantic mutation of the job manifest, or of one rank's part; a part's new manifest
    SHA-256 is written into the job manifest, so the job still vouches for it."""
    if rng.random() < 0.3:
        return "job " + rng.choice([manifest_value, manifest_delete])(job, rng)
    manifest = load_manifest(job)
    rank = rng.randrange(len(manifest["ranks"]))
    part = job / manifest["ranks"][rank]["part"]
    what = rng.choice([*SEMANTIC.values(), messages_edit])(part, rng)
    manifest["ranks"][rank][MANIFEST_DIGEST] = load_manifest(part).get(MANIFEST_DIGEST)
    save_manifest(job, manifest)
    return f"rank {rank}: {what}"


def judge_job(job: Path, seconds: int = 60) -> Outcome:
    """What sdcreplay does with a job bundle: ``info --json``, then every part's messages."""
    try:
        with time_limit(seconds):
            refused = _cli(CliRunner(), "info", str(job), "--json")
            if refused is not None:
                return refused
            try:
                opened = JobBundle.open(job)
                for rank in opened.parts.values():
                    rank.messages()
            except SdcReplayError as exc:
                return Outcome("error", f"messages: {exc.message}")
            except Exception as exc:  # the bug this oracle exists to find
                return Outcome("traceback", f"messages: {type(exc).__name__}: {str(exc)[:200]}")
            return Outcome("verdict", "read")
    except Hang:
        return Outcome("hang", f"no answer within {seconds} s")
