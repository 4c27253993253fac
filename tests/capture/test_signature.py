"""The signature log: zstd frames of JSON lines, one frame per step, read back exactly or
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zstandard
from bundle_fuzz import declaring

from sdcreplay.capture.signature import (
    MAX_ENTRY_BYTES,
    SCHEMA,
    SignatureLog,
    SignatureLogWriter,
    bundle_frame_limits,
    layer_of,
    phase_of,
    read_signature_log,
    write_signature_log,
)
from sdcreplay.errors import BundleError

STEPS = {
    0: [
        ("rng:cpu", "=uint8:00"),
        ("forward:layers.0.attn", "0123456789abcdef"),
        ("loss", "=float32:40b966f1"),
    ],
    1: [
        ("rng:cpu", "=uint8:01"),
        ("forward:layers.0.attn", "fedcba9876543210"),
        ("loss", "=float32:40a00000"),
    ],
    2: [
        ("rng:cpu", "=uint8:02"),
        ("forward:layers.0.attn", "00000000000000ff"),
        ("loss", "=float32:3f800000"),
    ],
}


def write_log(path: Path, steps=STEPS) -> list[int]:
    """Write the log; return the file size after the header and after each step's frame."""
    writer = SignatureLogWriter(path, {"device_type": "cpu", "device": "cpu:1"})
    boundaries = [writer.size]
    for step, entries in steps.items():
        writer.append_step(step, entries)
        boundaries.append(writer.size)
    return boundaries


def test_round_trip(tmp_path: Path):
    path = tmp_path / "log.zst"
    write_log(path)
    log = read_signature_log(path)
    assert log.meta == {"schema": SCHEMA, "device_type": "cpu", "device": "cpu:1"}
    assert log.steps == STEPS
    assert log.entry_count() == 9


def test_write_signature_log_round_trip(tmp_path: Path):
    log = SignatureLog(
        meta={"schema": SCHEMA, "device_type": "cpu", "role": "replay"}, steps=dict(STEPS)
    )
    write_signature_log(tmp_path / "replay.sig.zst", log)
    back = read_signature_log(tmp_path / "replay.sig.zst")
    assert back.meta == log.meta and back.steps == log.steps


def test_one_frame_per_step_of_plain_json_lines(tmp_path: Path):
    path = tmp_path / "log.zst"
    boundaries = write_log(path)
    raw = path.read_bytes()
    assert len(raw) == boundaries[-1]
    frames = [raw[a:b] for a, b in zip([0, *boundaries[:-1]], boundaries, strict=True)]
    texts = [zstandard.ZstdDecompressor().decompress(frame).decode() for frame in frames]
    assert json.loads(texts[0]) == {"schema": SCHEMA, "device_type": "cpu", "device": "cpu:1"}
    lines = texts[2].splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "name": name, "digest": digest} for name, digest in STEPS[1]
    ]


def test_writer_tracks_size_and_sha256(tmp_path: Path):
    import hashlib

    path = tmp_path / "log.zst"
    writer = SignatureLogWriter(path, {"device_type": "cpu"})
    writer.append_step(0, STEPS[0])
    assert writer.size == path.stat().st_size
    assert writer.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_truncated_mid_frame_raises(tmp_path: Path):
    path = tmp_path / "log.zst"
    boundaries = write_log(path)
    raw = path.read_bytes()
    cut_path = tmp_path / "cut.zst"
    for cut in range(1, len(raw)):
        if cut in boundaries:
            continue
        cut_path.write_bytes(raw[:cut])
        with pytest.raises(BundleError):
            read_signature_log(cut_path)


def test_cut_at_a_frame_boundary_reads_the_complete_steps(tmp_path: Path):
    path = tmp_path / "log.zst"
    boundaries = write_log(path)
    raw = path.read_bytes()
    cut_path = tmp_path / "cut.zst"
    for complete, cut in enumerate(boundaries):
        cut_path.write_bytes(raw[:cut])
        assert read_signature_log(cut_path).steps == {s: STEPS[s] for s in list(STEPS)[:complete]}


def test_size_limit_reads_only_the_vouched_prefix(tmp_path: Path):
    path = tmp_path / "log.zst"
    boundaries = write_log(path)
    with path.open("ab") as handle:
        handle.write(b"\x28\xb5\x2f\xfd half a frame")
    with pytest.raises(BundleError):
        read_signature_log(path)
    assert read_signature_log(path, size=boundaries[2]).steps == {0: STEPS[0], 1: STEPS[1]}
    with pytest.raises(BundleError, match="truncated"):
        read_signature_log(path, size=len(path.read_bytes()) + 1)


def test_every_single_byte_flip_is_refused_or_harmless(tmp_path: Path):
    path = tmp_path / "log.zst"
    write_log(path)
    raw = path.read_bytes()
    original = read_signature_log(path)
    flipped = tmp_path / "flipped.zst"
    refused = 0
    for position in range(len(raw)):
        for mask in (0x01, 0x80):
            damaged = bytearray(raw)
            damaged[position] ^= mask
            flipped.write_bytes(bytes(damaged))
            try:
                log = read_signature_log(flipped)
            except BundleError:
                refused += 1
                continue
            # Only bits zstd ignores (reserved header bits) may pass, and then nothing changed.
            assert (log.meta, log.steps) == (original.meta, original.steps), (position, mask)
    assert refused > 0.9 * 2 * len(raw)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"not zstd at all", "is damaged"),
        (
            zstandard.ZstdCompressor(write_checksum=True).compress(b'{"schema": "other/1"}\n'),
            "is not a signature log",
        ),
        (
            zstandard.ZstdCompressor(write_checksum=True).compress(b"[1, 2]\n"),
            "is not a signature log",
        ),
        (zstandard.ZstdCompressor(write_checksum=True).compress(b"\xff\xfe\n"), "is damaged"),
        (
            zstandard.ZstdCompressor(write_checksum=True).compress(
                b'{"schema": "sdcreplay.signatures/1"}'
            ),
            "complete line",
        ),
        (
            zstandard.ZstdCompressor(write_checksum=True).compress(
                b'{"schema": "sdcreplay.signatures/1"}\n{"step": "0", "name": "a", "digest": "b"}\n'
            ),
            "bad entry",
        ),
        (
            zstandard.ZstdCompressor(write_checksum=True).compress(
                b'{"schema": "sdcreplay.signatures/1"}\n'
                b'{"step": true, "name": "a", "digest": "b"}\n'
            ),
            "bad entry",
        ),
        (
            zstandard.ZstdCompressor(write_checksum=True).compress(
                b'{"schema": "sdcreplay.signatures/1"}\n{"step": 0, "name": "a"}\n'
            ),
            "is damaged",
        ),
        (
            zstandard.ZstdCompressor(write_checksum=True).compress(
                b'{"schema": "sdcreplay.signatures/1"}\n["step", 0]\n'
            ),
            "is damaged",
        ),
        (
            zstandard.ZstdCompressor(write_checksum=True).compress(
                b'{"schema": "sdcreplay.signatures/1"}\n'
                b'{"step": 0, "name": "a", "digest": "b"}\n{oops\n'
            ),
            "is damaged",
        ),
    ],
    ids=[
        "empty",
        "garbage",
        "other-schema",
        "not-an-object",
        "not-utf8",
        "no-newline",
        "step-str",
        "step-bool",
        "missing-digest",
        "entry-list",
        "bad-json",
    ],
)
def test_damaged_logs_raise_bundle_error(tmp_path: Path, content: bytes, message: str):
    path = tmp_path / "bad.zst"
    path.write_bytes(content)
    with pytest.raises(BundleError, match=message):
        read_signature_log(path)


def test_missing_log_raises_bundle_error(tmp_path: Path):
    with pytest.raises(BundleError, match="does not exist"):
        read_signature_log(tmp_path / "nope.zst")


def test_a_frame_without_checksum_is_refused(tmp_path: Path):
    """The format promises a checksum on every frame: a log without one was not written by
    sdcreplay."""
    text = (
        b'{"schema": "sdcreplay.signatures/1"}\n'
        b'{"step": 0, "name": "loss", "digest": "=float32:00000000"}\n'
    )
    path = tmp_path / "plain.zst"
    path.write_bytes(zstandard.ZstdCompressor(write_checksum=False).compress(text))
    with pytest.raises(BundleError, match="frame 0 has no checksum"):
        read_signature_log(path)


@pytest.mark.parametrize(
    ("name", "phase", "layer"),
    [
        ("forward:layers.1.attn", "forward", "layers.1.attn"),
        ("forward:layers.1.attn#2", "forward", "layers.1.attn"),
        ("backward:layers.0.mlp.w2", "backward", "layers.0.mlp.w2"),
        ("backward:layers.1.attn#1[0]", "backward", "layers.1.attn"),
        ("grad:layers.1.attn.wq.weight", "backward", "layers.1.attn.wq"),
        ("param:norm.weight", "optimizer", "norm"),
        ("param:bias", "optimizer", "<root>"),
        ("buffer:layers.0.attn.rope_cos", "optimizer", "layers.0.attn"),
        ("loss", "forward", "loss"),
        ("rng:cpu", "state", "cpu"),
        ("collective:7", "collective", "7"),
        ("something", "other", "something"),
    ],
)
def test_phase_and_layer_of_entry_names(name: str, phase: str, layer: str):
    assert phase_of(name) == phase
    assert layer_of(name) == layer


def test_step_frames_hold_the_bytes_json_dumps_writes(tmp_path: Path):
    """append_step formats its lines by hand (the recorder's hot path): same bytes as json."""
    entries = [
        ("forward:a", "0123456789abcdef"),
        ('odd"name\\with\tcontrol\x01', "=float32:3f800000"),
        ("grad:w\u00e9ights.\u4e2d", "none"),
    ]
    writer = SignatureLogWriter(tmp_path / "log.zst", {"kind": "t"})
    header_size = writer.size
    writer.append_step(12, entries)
    frame = (tmp_path / "log.zst").read_bytes()[header_size:]
    lines = zstandard.ZstdDecompressor().decompress(frame).decode().splitlines(keepends=True)
    assert lines == [
        json.dumps({"step": 12, "name": name, "digest": digest}, separators=(",", ":")) + "\n"
        for name, digest in entries
    ]
    assert read_signature_log(tmp_path / "log.zst").steps == {12: entries}


# ---------------------------------------------------------------------------
# Decompression bombs: a frame's declared size is checked before it is inflated.


def _log_with_frame(tmp_path: Path, frame: bytes) -> Path:
    """A real log of step 0, then ``frame`` as step 1's."""
    path = tmp_path / "log.zst"
    writer = SignatureLogWriter(path, {"device_type": "cpu"})
    writer.append_step(0, STEPS[0])
    path.write_bytes(path.read_bytes() + frame)
    return path


LINE = b'{"step":1,"name":"loss","digest":"=float32:3f800000"}\n'


def test_a_frame_declaring_far_more_text_than_it_compresses_is_refused_before_inflating(tmp_path):
    bomb = zstandard.ZstdCompressor(write_checksum=True).compress(LINE * ((64 << 20) // len(LINE)))
    path = _log_with_frame(tmp_path, bomb)
    declared = zstandard.get_frame_parameters(bomb).content_size
    with pytest.raises(BundleError) as caught:
        read_signature_log(path)
    assert caught.value.message == (
        f"signature log {path} is damaged: frame 2 declares {declared} bytes of text in "
        f"{len(bomb)} compressed bytes (a decompression bomb)"
    )
    assert "exhaust the memory" in caught.value.hint


def test_a_frame_holding_more_than_its_header_declares_is_never_inflated_past_it(tmp_path):
    lying = declaring(zstandard.ZstdCompressor(write_checksum=True).compress(LINE * 4000), 54)
    assert zstandard.get_frame_parameters(lying).content_size == len(LINE) == 54
    refused = "is damaged: frame 2 does not inflate to the 54 bytes its header declares"
    with pytest.raises(BundleError, match=refused):
        read_signature_log(_log_with_frame(tmp_path, lying))


def test_frames_over_what_the_manifest_lists_are_refused_before_inflating(tmp_path):
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(LINE * 3)
    path = _log_with_frame(tmp_path, frame)
    log = read_signature_log(path, None, bundle_frame_limits([3, 3], MAX_ENTRY_BYTES))
    assert {step: len(entries) for step, entries in log.steps.items()} == {0: 3, 1: 3}
    over = r"frame 2 declares 162 bytes of text, more than the manifest's step can hold \(0\)"
    with pytest.raises(BundleError, match=over):
        read_signature_log(path, None, bundle_frame_limits([3, 0], MAX_ENTRY_BYTES))
    # A frame past the manifest's steps may hold what its largest step can (step 0's: 4 lines
    # of 54 bytes here; the bundle then refuses the step it does not list).
    assert len(read_signature_log(path, None, bundle_frame_limits([4], 54)).steps) == 2
    longer = _log_with_frame(
        tmp_path, zstandard.ZstdCompressor(write_checksum=True).compress(LINE * 5)
    )
    with pytest.raises(BundleError, match=r"frame 2 declares 270 bytes .* can hold \(216\)"):
        read_signature_log(longer, None, bundle_frame_limits([4], 54))
