"""Nothing hangs, nothing the user owns is deleted, every failure is explained (issue #10).

One test per case a hostile or unlucky user found: hangs (a hung device, a
FIFO manifest), unbounded reads (/dev/zero), deleted user data (--overwrite, a
leftover .partial), reads outside the bundle (symlinks, HDF5 external data),
wrong answers (bisect of a step the bundle lacks, a dead device), and each
input that used to reach the catch-all; then a property test that mutates
bundles and a SIGKILL during a real recording.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import bundle_fuzz
import h5py
import numpy as np
import pytest
from conftest import SMALL_ARGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdcreplay.bundle.manifest import MANIFEST, manifest_digest
from sdcreplay.bundle.reader import Bundle
from sdcreplay.errors import BundleError, SdcReplayError, WorkloadError
from sdcreplay.replay.processes import STARTUP_SECONDS, STEP_FACTOR
from sdcreplay.replay.replicas import progress_timeout
from sdcreplay.replay.session import replay_on_device

MISBEHAVING = Path(__file__).resolve().parent / "misbehaving.py"
WORKLOAD = f"{MISBEHAVING}:make_workload"


def record_misbehaving(cli, out: Path, steps: int, **options):
    """Record the misbehaving workload (options become its keyword arguments) through the CLI."""
    pairs = [arg for key, value in options.items() for arg in ("-a", f"{key}={value}")]
    return cli("record", WORKLOAD, "--steps", str(steps), "--out", out, *SMALL_ARGS, *pairs)


def misbehaving_bundle(tmp_path: Path, cli, misbehave: str, at_step: int = 1) -> Path:
    """A 2-step recording of the misbehaving workload (it behaves while recording in this
    process)."""
    out = tmp_path / "mis.bundle"
    result = record_misbehaving(cli, out, 2, misbehave=misbehave, at_step=at_step)
    assert result.exit_code == 0, result.output
    return out


def assert_explained(result, *needles: str) -> None:
    """Exit 3 with Error and Hint lines, the needles in the error, and no traceback frame on the
    console."""
    assert result.exit_code == 3, result.output
    assert "Error:" in result.stderr and "Hint:" in result.stderr, result.output
    assert "Traceback" not in result.output and 'File "' not in result.output, result.output
    assert "unexpected" not in result.stderr, result.output
    for needle in needles:
        assert needle in result.stderr, result.output


# -- hangs -----------------------------------------------------------------------------------------


def test_a_hung_device_is_killed_and_the_verdict_comes_from_the_others(tmp_path: Path, cli):
    bundle = misbehaving_bundle(tmp_path, cli, "hang")
    started = time.time()
    result = cli(
        "replay",
        bundle,
        "-d",
        "cpu:0",
        "-d",
        "cpu:1",
        "--timeout",
        "3",
        "--logs",
        tmp_path / "logs",
        "--json",
        env={"COLUMNS": "250"},
    )  # the table's cells on one line each
    assert time.time() - started < 100
    assert_explained(result, "1 of 2 devices did not finish", "cpu:1", "timed out after 3 s")
    assert "error (timed out after 3 s)" in result.stderr
    assert "from the 1 of 2 devices that finished; 1 did not" in result.stderr
    report = json.loads(result.stdout)
    assert report["failed"] == ["cpu:1"] and report["finished"] == 1
    assert report["consensus"]["verdict"] == "correct"
    dead = report["devices"][1]
    assert dead["verdict"] == "error" and dead["error"]["timed_out"] == 3
    assert "at step 1 (repeat 0)" in dead["error"]["message"]


def test_the_timeout_is_derived_from_the_recorded_step_times(small_bundle: Path):
    seconds = [step.seconds for step in Bundle.open(small_bundle).steps]
    assert len(seconds) == 2 and all(0 < s < 60 for s in seconds)
    assert progress_timeout(Bundle.open(small_bundle)) == round(
        STARTUP_SECONDS + STEP_FACTOR * max(seconds), 1
    )


def test_a_fifo_manifest_is_refused_without_blocking(small_bundle: Path, run_exe):
    (small_bundle / MANIFEST).unlink()
    os.mkfifo(small_bundle / MANIFEST)
    result = run_exe("info", small_bundle, timeout=60)
    assert result.returncode == 3 and "is not a regular file (a FIFO)" in result.stderr, (
        result.stderr
    )


# -- unbounded reads -------------------------------------------------------------------------------


def test_a_manifest_symlinked_to_dev_zero_is_refused(small_bundle: Path, run_exe):
    (small_bundle / MANIFEST).unlink()
    (small_bundle / MANIFEST).symlink_to("/dev/zero")
    result = run_exe("info", small_bundle, timeout=60)
    assert (
        result.returncode == 3 and "manifest.json" in result.stderr and "symlink" in result.stderr
    ), result.stderr


def test_diff_against_dev_zero_is_refused(small_bundle: Path, run_exe):
    result = run_exe("diff", small_bundle, "/dev/zero", timeout=60)
    assert result.returncode == 3, result.stderr
    assert "/dev/zero is not a regular file (a character device)" in result.stderr


# -- deleted user data -----------------------------------------------------------------------------


def test_overwrite_never_deletes_a_directory_that_is_not_a_bundle(tmp_path: Path, cli):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    result = cli(
        "record", "builtin:tiny-llama", "--steps", "1", "--out", mine, "--overwrite", *SMALL_ARGS
    )
    assert_explained(result, "is not a bundle")
    assert (mine / "notes.txt").read_text() == "my notes"


def test_overwrite_replaces_a_bundle(tmp_path: Path, cli, small_bundle: Path):
    result = cli(
        "record",
        "builtin:tiny-llama",
        "--steps",
        "1",
        "--out",
        small_bundle,
        "--overwrite",
        *SMALL_ARGS,
    )
    assert result.exit_code == 0, result.output
    assert Bundle.open(small_bundle).step_indices == [0]


def test_a_leftover_partial_is_kept_and_named(tmp_path: Path, cli, small_bundle: Path):
    out = tmp_path / "run.bundle"
    partial = tmp_path / "run.bundle.partial"
    shutil.copytree(small_bundle, partial)
    result = cli("record", "builtin:tiny-llama", "--steps", "1", "--out", out, *SMALL_ARGS)
    assert_explained(result, "leftover partial recording", f"sdcreplay info {partial}")
    assert Bundle.open(partial).step_indices == [0, 1]
    result = cli(
        "record", "builtin:tiny-llama", "--steps", "1", "--out", out, "--overwrite", *SMALL_ARGS
    )
    assert result.exit_code == 0, result.output
    assert Bundle.open(out).step_indices == [0] and not partial.exists()


def test_demo_never_deletes_a_directory_it_did_not_write(tmp_path: Path, cli):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    result = cli("demo", "--out", mine)
    assert_explained(result, "was not written by `sdcreplay demo`")
    assert (mine / "notes.txt").read_text() == "my notes"


# -- reads outside the bundle ----------------------------------------------------------------------


def test_a_step_file_symlinked_outside_is_refused(tmp_path: Path, cli, small_bundle: Path):
    outside = tmp_path / "outside.h5"
    shutil.move(small_bundle / "steps" / "000000.h5", outside)
    (small_bundle / "steps" / "000000.h5").symlink_to(outside)
    assert_explained(cli("info", small_bundle), "steps/000000.h5", "symlink")


@pytest.mark.parametrize("kind", ["external link", "external storage"])
def test_hdf5_data_outside_the_bundle_is_refused(
    tmp_path: Path, cli, small_bundle: Path, kind: str
):
    text = _plant_outside(small_bundle, kind, tmp_path)
    assert_explained(cli("replay", small_bundle, "--logs", tmp_path / "logs"), text)
    assert_explained(cli("info", small_bundle), text)


def _plant_outside(bundle: Path, kind: str, tmp_path: Path) -> str:
    """Replace the batch tensor of step 0 by data that lives in a file outside the bundle."""
    with h5py.File(bundle / "steps/000000.h5", "a") as handle:
        bundle_fuzz.put_outside(handle, "batch/t0", tmp_path / "outside", kind)
    bundle_fuzz.rehash(bundle, "steps/000000.h5")
    return kind


# -- wrong answers ---------------------------------------------------------------------------------


def test_bisect_of_a_step_the_bundle_lacks_is_an_error(tmp_path: Path, cli, small_bundle: Path):
    result = cli("bisect", small_bundle, "--step", "99", "--out", tmp_path / "report")
    assert_explained(result, "the bundle has no step 99 (it has steps [0, 1])")


def test_devices_that_die_are_reported_and_excluded(tmp_path: Path, cli):
    """Three death modes at once (sys.exit, an exception, SIGKILL); cpu:0 finishes and gives the
    verdict."""
    bundle = misbehaving_bundle(tmp_path, cli, "cpu:1=exit,cpu:2=raise,cpu:3=kill")
    result = cli(
        "replay",
        bundle,
        *[arg for n in range(4) for arg in ("-d", f"cpu:{n}")],
        "--logs",
        tmp_path / "logs",
        "--json",
        env={"COLUMNS": "250"},
    )
    assert_explained(
        result,
        "3 of 4 devices did not finish",
        "called sys.exit(5) at step 1 (repeat 0)",
        "raised IndexError in step 1 on cpu:2: index out of range in self",
        "the cpu:3 process killed by signal SIGKILL",
    )
    assert "from the 1 of 4 devices that finished; 3 did not" in result.stderr
    for n in (1, 2):  # the frames are in the device's log file, not on the console
        log = tmp_path / "logs" / f"replay-cpu-{n}.stderr.txt"
        assert f"Log: {log}" in result.stderr and "Traceback" in log.read_text()
    report = json.loads(result.stdout)
    assert report["consensus"]["verdict"] == "correct" and report["failed"] == [
        "cpu:1",
        "cpu:2",
        "cpu:3",
    ]
    assert report["devices"][3]["error"]["exit_status"] == -signal.SIGKILL


def test_no_verdict_when_no_device_finishes(tmp_path: Path, cli):
    bundle = misbehaving_bundle(tmp_path, cli, "hang")
    result = cli("replay", bundle, "-d", "cpu:1", "--timeout", "2", "--logs", tmp_path / "logs")
    assert_explained(result, "every device failed: the cpu:1 process timed out after 2 s")


def test_workload_code_that_exits_while_recording_is_exit_3(tmp_path: Path, cli):
    result = record_misbehaving(cli, tmp_path / "x.bundle", 2, misbehave="exit", on_device="main")
    assert_explained(result, "the workload called sys.exit(5)")
    # the evidence so far is kept
    assert Bundle.open(tmp_path / "x.bundle.partial").step_indices == [0]


def test_device_type_must_match_the_signature_log(small_bundle: Path, cli):
    manifest = json.loads((small_bundle / MANIFEST).read_text())
    manifest["device_type"] = "cuda"
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (small_bundle / MANIFEST).write_text(json.dumps(manifest))
    assert_explained(
        cli("info", small_bundle),
        "signature log was made on device type 'cpu'",
        "the manifest says 'cuda'",
    )


# -- each input that used to reach the catch-all ---------------------------------------------------


def _edit_manifest(bundle: Path, path: list, value) -> None:
    manifest = json.loads((bundle / MANIFEST).read_text())
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # json needs it to write a 978-deep value
    try:
        manifest["manifest_sha256"] = manifest_digest(manifest)
        (bundle / MANIFEST).write_text(json.dumps(manifest))
    finally:
        sys.setrecursionlimit(limit)


def _deep(depth: int):
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (
            ["determinism", "num_threads"],
            2**31,
            "determinism.num_threads is 2147483648, expected an integer from 1",
        ),
        (["environment", "device"], "cpu", 'environment.device is "cpu", expected an object'),
        (
            ["determinism", "env", "CUBLAS_WORKSPACE_CONFIG"],
            "\ud800",
            "NUL or an unpaired surrogate",
        ),
        (["environment", "env", "OMP_NUM_THREADS"], "4\x00", "NUL or an unpaired surrogate"),
        (["workload", "kwargs", "dim"], _deep(978), "nests deeper than 32 levels"),
        (["workload", "kwargs", "dim"], _deep(40), "nests deeper than 32 levels"),
        (["workload", "kwargs", "seed"], 2**70, "workload.kwargs.seed is 1180591620717411303424"),
        (["steps", 0, "seconds"], -1.0, "steps[0].seconds is -1.0, expected"),
    ],
)
def test_hand_edited_manifest_values_are_named(small_bundle: Path, cli, path, value, needle):
    _edit_manifest(small_bundle, path, value)
    assert_explained(cli("info", small_bundle), "manifest", needle)


def _edit_step_file(bundle: Path, edit) -> None:
    name = "steps/000000.h5"
    with h5py.File(bundle / name, "a") as handle:
        edit(handle)
    bundle_fuzz.rehash(bundle, name)


def _replace_dataset(handle: h5py.File, name: str, data) -> None:
    attrs, _ = bundle_fuzz.take_dataset(handle, name)
    handle.create_dataset(name, data=data).attrs.update(attrs)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda h: h["batch/t0"].attrs.__setitem__("dtype", "qint8"),
            "has dtype 'qint8', which sdcreplay never stores",
        ),
        (
            lambda h: _replace_dataset(
                h, "batch/t0", np.zeros((2, 8), dtype=[("a", "i4"), ("b", "f4")])
            ),
            "is stored as HDF5 type",
        ),
        (
            lambda h: _replace_dataset(h, "rng/cpu", np.zeros(100, dtype=np.uint8)),
            "tensor /rng/cpu has shape [100], expected [5056]",
        ),
        (
            lambda h: (
                _replace_dataset(h, "rng/cpu", np.zeros(100, dtype=np.uint8)),
                h["rng/cpu"].attrs.__setitem__("shape", [100]),
            ),
            "RNG state in",
        ),
        (
            lambda h: _replace_dataset(h, "rng/numpy/keys", np.zeros(10, dtype=np.uint32)),
            "RNG state in",
        ),
        (
            lambda h: h["batch"].attrs.__setitem__("skeleton", "[" * 978 + "]" * 978),
            "nests deeper than 32 levels",
        ),
        (
            lambda h: h["batch"].attrs.__setitem__("skeleton", "[" * 40 + "]" * 40),
            "nests deeper than 32 levels",
        ),
    ],
)
def test_damaged_step_files_are_named(small_bundle: Path, edit, needle):
    _edit_step_file(small_bundle, edit)
    with pytest.raises(SdcReplayError, match=re.escape(needle)) as caught:
        replay_on_device(small_bundle, "cpu")
    assert "steps/000000.h5" in caught.value.message and caught.value.hint


def test_a_damaged_step_file_is_named_by_the_cli(tmp_path: Path, small_bundle: Path, cli):
    _edit_step_file(small_bundle, lambda h: h["batch/t0"].attrs.__setitem__("dtype", "qint8"))
    assert_explained(
        cli("replay", small_bundle, "--logs", tmp_path / "logs"),
        "every device failed: ",
        "steps/000000.h5: tensor /batch/t0 has dtype 'qint8', which sdcreplay never stores",
    )


def test_a_token_id_out_of_range_in_a_stored_batch_is_named(small_bundle: Path):
    def out_of_range(handle: h5py.File) -> None:
        handle["batch/t0"][0, 0] = 10**6

    _edit_step_file(small_bundle, out_of_range)
    with pytest.raises(
        WorkloadError, match="builtin:tiny-llama raised IndexError in step 0 on cpu"
    ) as caught:
        replay_on_device(small_bundle, "cpu")
    assert "stored batch or state does not fit" in caught.value.hint


@pytest.mark.parametrize("where", ["under-a-file", "proc", "too-long"])
def test_unwritable_out_and_logs_are_named(tmp_path: Path, cli, small_bundle: Path, where: str):
    (tmp_path / "file").write_text("")
    target = {
        "under-a-file": tmp_path / "file" / "x",
        "proc": Path("/proc/self/x"),
        "too-long": tmp_path / ("x" * 300),
    }[where]
    assert_explained(
        cli("record", "builtin:tiny-llama", "--steps", "1", "--out", target, *SMALL_ARGS),
        "cannot create the bundle directory",
    )
    assert_explained(
        cli("replay", small_bundle, "--logs", target), "cannot create the log directory"
    )
    assert_explained(
        cli("bisect", small_bundle, "--suspect", "cpu:1", "--step", "0", "--out", target),
        "cannot create the report directory",
    )


def test_a_seed_out_of_range_is_a_usage_error(tmp_path: Path, cli):
    result = cli(
        "record", "builtin:tiny-llama", "--seed", str(2**70), "--out", tmp_path / "x.bundle"
    )
    assert result.exit_code == 2 and "--seed" in result.stderr and "Traceback" not in result.output


def test_a_non_scalar_loss_is_named(tmp_path: Path, cli):
    result = record_misbehaving(cli, tmp_path / "x.bundle", 1, scalar_loss="false")
    assert_explained(result, "loss_fn returned [2], not a scalar tensor")


def test_a_signature_log_without_checksums_in_a_bundle_is_refused(small_bundle: Path, cli):
    rng = random.Random(0)
    while "checksum" not in bundle_fuzz.log_edit(small_bundle, rng):
        pass
    assert_explained(cli("info", small_bundle), "has no checksum")


@pytest.mark.parametrize(
    ("name", "signature", "raised"),
    [
        ("state.h5", b"TREE", "RuntimeError: Unable to get group info (wrong B-tree signature)"),
        ("steps/000001.h5", b"HEAP", "RuntimeError: Link iteration failed (bad local heap"),
    ],
)
def test_a_damaged_hdf5_file_the_manifest_vouches_for_is_named(
    small_bundle: Path, cli, name, signature, raised
):
    bundle_fuzz.unreadable_structures(small_bundle / name, signature)
    bundle_fuzz.rehash(small_bundle, name)
    assert_explained(cli("info", small_bundle), f"{small_bundle / name} is damaged: {raised}")


def test_a_step_file_whose_global_heap_libhdf5_would_walk_forever_is_refused_at_once(
    tmp_path: Path, small_bundle: Path, cli
):
    """Left to libhdf5, reading the batch's structure never returns (a device process would be
    killed as hung, a library replay would wait forever)."""
    bundle_fuzz.heap_object_grown(small_bundle / "steps/000001.h5")
    bundle_fuzz.rehash(small_bundle, "steps/000001.h5")
    assert_explained(
        cli("replay", small_bundle, "-d", "cpu:0", "--logs", tmp_path / "logs"),
        f"{small_bundle / 'steps/000001.h5'} is damaged: the global heap at byte ",
    )
    # which object the walk lands on depends on what else the step stores (its /around group)
    walked = r"the global heap at byte \d+ has an object of \d+ bytes"
    with pytest.raises(BundleError, match=walked):
        replay_on_device(small_bundle, "cpu")


def test_a_damaged_state_file_read_in_the_device_processes_is_named(
    tmp_path: Path, small_bundle: Path, cli
):
    """Walking state.h5 never reads its trees' structure (the global heap); each device process
    reads it when it loads the state, and says the bundle's file is damaged."""
    bundle_fuzz.unreadable_structures(small_bundle / "state.h5", b"GCOL")
    bundle_fuzz.rehash(small_bundle, "state.h5")
    result = cli("replay", small_bundle, "-d", "cpu:0", "-d", "cpu:1", "--logs", tmp_path / "l")
    assert_explained(
        result,
        f"every device failed: {small_bundle / 'state.h5'} is damaged: OSError: Can't "
        "synchronously read data (bad global heap collection signature)",
        "the manifest vouches for",
    )
    assert "failed at start-up" not in result.stderr


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("ratio", "compressed bytes (a decompression bomb)"),
        ("limit", "more than the manifest's step can hold"),
        ("lie", "does not inflate to the {text} bytes its header declares"),
    ],
)
def test_a_decompression_bomb_in_a_signature_log_is_refused_before_it_is_inflated(
    small_bundle: Path, cli, kind, needle
):
    path = small_bundle / "signatures.jsonl.zst"
    frames = bundle_fuzz._compressed_frames(path.read_bytes())
    text = bundle_fuzz._frames(frames[1])[0]  # step 0's entries
    frames[1] = bundle_fuzz.bomb_frame(kind, text.decode().splitlines(), random.Random(0))
    path.write_bytes(b"".join(frames))
    bundle_fuzz.rehash(small_bundle, "signatures.jsonl.zst")
    needle = needle.format(text=len(text))
    for command in (("info", small_bundle), ("replay", small_bundle, "-d", "cpu:0")):
        assert_explained(cli(*command), f"signature log {path} is damaged: frame 1 ", needle)


# -- properties ------------------------------------------------------------------------------------


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    mutation=st.sampled_from(sorted(bundle_fuzz.SEMANTIC) + ["raw_bytes"]),
    seed=st.integers(0, 2**32),
)
def test_mutated_bundles_give_a_specific_error_or_a_verdict(
    tmp_path_factory, _small_bundle_template, mutation: str, seed: int
):
    """Hash-valid semantic edits and raw damage: exit 3 with a specific message, or a verdict
    (unchanged for an edit that cannot matter); never a traceback, a catch-all message or a hang."""
    work = tmp_path_factory.mktemp("mutant")
    bundle = work / "small.bundle"
    shutil.copytree(_small_bundle_template, bundle)
    mutate = bundle_fuzz.raw_bytes if mutation == "raw_bytes" else bundle_fuzz.SEMANTIC[mutation]
    try:
        what = mutate(bundle, random.Random(seed))
    except RecursionError:
        return  # json could not even write that value
    outcome = bundle_fuzz.judge(bundle, _small_bundle_template)
    assert not outcome.is_bug, f"{what}: {outcome.kind}: {outcome.detail}"
    if mutation in bundle_fuzz.INERT:
        assert outcome == bundle_fuzz.Outcome("verdict", "identical"), what
    if mutation in ("raw_bytes", "h5_outside"):
        assert outcome.kind == "error", f"{what}: {outcome.detail}"
    shutil.rmtree(work)


# -- a recording killed mid-way --------------------------------------------------------------------


def test_sigkill_during_record_leaves_a_readable_partial(tmp_path: Path, sdcreplay_exe: str, cli):
    out = tmp_path / "killed.bundle"
    partial = tmp_path / "killed.bundle.partial"
    command = [
        sdcreplay_exe,
        "record",
        WORKLOAD,
        "--steps",
        "6",
        "--out",
        str(out),
        *SMALL_ARGS,
        "-a",
        "misbehave=hang",
        "-a",
        "on_device=main",
        "-a",
        "at_step=3",
    ]
    env = {**os.environ, "SDCREPLAY_DEVICE": "main"}
    process = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None:
            manifest = partial / MANIFEST
            if (
                manifest.is_file()
                and len(json.loads(manifest.read_text() or "{}").get("steps", [])) >= 3
            ):
                break
            time.sleep(0.1)
        assert process.poll() is None, process.stderr.read()
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait(30)
    assert process.returncode == -signal.SIGKILL
    bundle = Bundle.open(partial)
    assert not bundle.complete and bundle.step_indices == [0, 1, 2]
    assert sorted(bundle.signature_log().steps) == [0, 1, 2]
    result = cli("info", out)
    assert result.exit_code == 0 and "incomplete" in result.stderr, result.output
    result = cli("record", "builtin:tiny-llama", "--steps", "1", "--out", out, *SMALL_ARGS)
    assert_explained(result, "leftover partial recording")
    assert Bundle.open(partial).step_indices == [0, 1, 2]


def test_raw_damage_is_refused_by_the_library_too(small_bundle: Path):
    (small_bundle / "steps" / "000001.h5").write_bytes(b"")
    with pytest.raises(BundleError, match="steps/000001.h5 is 0 bytes, the manifest says"):
        Bundle.open(small_bundle)
