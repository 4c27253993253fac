"""TorchTitan 0.3.0's own Trainer (``torchtitan.trainer.Trainer``, the llama3 debug model as
it ships: fused wqkv split by a state_dict hook, selective activation checkpointing, per-block
compile of the model and the compiled loss, its OptimizersContainer and
LRSchedulersContainer, FSDP2 on its own device mesh) recorded through
``sdcreplay.integrations.torchtitan`` by a user's three-line script under ``torchrun``, in a
directory of the user's with relative paths, then replayed, listed and bisected from another
directory. What the tests need to run TorchTitan on CPU with gloo is titan_cpu.py (copied
beside the script, as a user's own module), and the files its config reads titan_assets.py.

Each used to go wrong: TorchTitan's default compile failed the first-step check (the compiled
loss ran from Dynamo's cache unseen; activation checkpointing's higher-order operator failed
the check's dispatch mode, and the script's own ``close()`` hid that error), the container was
refused a step late, the update detector raised into the loop on DTensor gradients, and the
Trainer's step count, kept outside the step, made replays of later steps differ.
``SDCREPLAY_TITAN_FULL=1`` also bisects the FSDP job's rank 1, minimizes its fault and
replays the job ``--same-batch`` (minutes more)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import json_from_elsewhere

pytestmark = pytest.mark.slow
pytest.importorskip("torchtitan")

from titan_assets import write_assets  # noqa: E402

from sdcreplay.bundle.reader import Bundle  # noqa: E402

FULL = os.environ.get("SDCREPLAY_TITAN_FULL") == "1"
HERE = Path(__file__).parent
DEBUG_MODEL = (
    "--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "64",
    "--training.local_batch_size", "2",
)  # fmt: skip
SCRIPT = """\
import titan_cpu  # noqa: F401  (TorchTitan on this machine's CPUs)
from sdcreplay.integrations.torchtitan import main

main()
"""
KERNEL = "cpp_fused__unsafe_view_mul_silu_5"  # layers.1's SwiGLU product, bf16


def shell() -> dict[str, str]:
    return {n: v for n, v in os.environ.items() if n not in ("SDCREPLAY_DEBUG", "SDCREPLAY_INJECT")}


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A user's directory: the debug model's assets, the training script and the CPU shim."""
    root = tmp_path_factory.mktemp("titan")
    write_assets(root)
    (root / "train.py").write_text(SCRIPT)
    shutil.copy(HERE / "titan_cpu.py", root / "titan_cpu.py")
    return root


def trained(root: Path, processes: int, steps: int, *options: str, env: dict | None = None) -> str:
    """``torchrun --nproc-per-node P train.py`` on the debug model, in ``root``; its output."""
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            str(processes),
            "train.py",
            *DEBUG_MODEL,
            "--training.steps",
            str(steps),
            *options,
        ],  # fmt: skip
        cwd=root,
        env={**shell(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


def sdcreplay(elsewhere: Path, *args: str, code: int) -> dict:
    """The console script from another directory, with --json."""
    return json_from_elsewhere(elsewhere, *args, code=code, env=shell())


def test_a_detector_without_a_ring_is_refused_before_training_with_error_and_hint(user_dir):
    done = subprocess.run(
        [sys.executable, "train.py", *DEBUG_MODEL, "--sdcreplay.bundle", "a.bundle",
         "--sdcreplay.detect"],
        cwd=user_dir, env=shell(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Error: --sdcreplay.detect dumps the steps a ring keeps" in done.stderr
    assert "Hint: Give --sdcreplay.bundle PATH and --sdcreplay.ring K" in done.stderr
    assert "Traceback" not in done.stderr


def test_recorded_takes_a_registrys_trainer_config_and_refuses_another_trainers():
    from torchtitan.models.flux.config_registry import flux_debugmodel
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from sdcreplay.errors import SdcReplayError
    from sdcreplay.integrations.torchtitan import RecordingTrainer, recorded

    config = recorded(llama3_debugmodel(), bundle="run.bundle", ring=8, detect=True)
    assert isinstance(config, RecordingTrainer.Config)
    assert (config.sdcreplay.bundle, config.sdcreplay.ring, config.sdcreplay.detect) == (
        "run.bundle", 8, True,
    )  # fmt: skip
    assert config.training.steps == llama3_debugmodel().training.steps
    with pytest.raises(SdcReplayError, match="FluxTrainer.Config"):
        recorded(flux_debugmodel())


@pytest.fixture(scope="module")
def compiled(user_dir) -> Path:
    """TorchTitan's default compile (each block and the loss), recorded with the check on."""
    trained(user_dir, 1, 3, "--compile.enable", "--sdcreplay.bundle", "compiled.bundle")
    return user_dir / "compiled.bundle"


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """Another directory of the user's, from which bundles are named relatively."""
    place = tmp_path / "investigation"
    place.mkdir()
    return place


def relative(bundle: Path, elsewhere: Path) -> str:
    return os.path.relpath(bundle, elsewhere)


def test_the_compiled_trainer_is_verified_and_replays_correct_on_three_replicas(
    compiled, elsewhere
):
    part = Bundle.open(compiled / "ranks" / "000000")
    assert part.verified
    regions = {region.path: region for region in part.compiled_regions}
    assert [f"layers.{i}" for i in range(6)] == [p for p in regions if p.startswith("layers.")]
    assert all(region.graphs for region in regions.values())
    assert "<outside>" in regions  # the compiled loss
    report = sdcreplay(
        elsewhere, "replay", relative(compiled, elsewhere), "-d", "cpu:0", "-d", "cpu:1",
        "-d", "cpu:2", "--no-ledger", code=0,
    )  # fmt: skip
    assert report["verdict"] == "correct"


def test_ops_lists_the_kernel_calls_of_every_compiled_block_with_their_specs(compiled, elsewhere):
    listed = sdcreplay(
        elsewhere, "ops", relative(compiled, elsewhere), "--step", "1", "--phase", "forward",
        code=0,
    )  # fmt: skip
    kernels = listed["kernels"]
    blocks = {k["module"].split(".")[1] for k in kernels if k["module"].startswith("layers.")}
    assert blocks == {str(i) for i in range(6)}
    (silu,) = [k for k in kernels if k["module"] == "layers.1" and k["kernel"] == KERNEL]
    assert silu["spec"] == f"kind=bitflip,kernel={KERNEL},phase=forward,step=1,nth=1,rank=0"


def test_bisect_names_the_compiled_kernel_output_element_and_bit_of_a_planted_fault(
    compiled, elsewhere
):
    fault = f"kind=bitflip,kernel={KERNEL},phase=forward,step=1,nth=1,output=0,index=3,bit=12"
    report = sdcreplay(
        elsewhere, "bisect", relative(compiled, elsewhere), "--suspect", "cpu:1", "--reference",
        "cpu:0", "--step", "1", "--inject", f"{fault},device=cpu:1", "--out", "k.bisect",
        "--no-ledger", code=1,
    )  # fmt: skip
    assert (report["step"], report["level"], report["phase"]) == (1, "kernel", "forward")
    assert (report["module"], report["kernel"]["name"], report["kernel"]["nth"]) == (
        "layers.1", KERNEL, 1,
    )  # fmt: skip
    assert report["output_index"] == 0 and report["elements"]["indices"] == [3]
    assert report["bits"]["histogram"] == {"12": 1}
    assert (elsewhere / "k.bisect").is_dir()


def test_a_drills_alarm_dumps_the_ring_training_goes_on_and_the_record_is_suspect(
    user_dir, elsewhere
):
    """A ring of 3 steps and the update detector on TorchTitan's eager step (DTensor
    gradients: the detector's norms used to raise into the loop); a bit-14 flip (bf16's top
    exponent bit) in layers.1's backward at step 13 alarms; training runs to step 16."""
    fault = (
        "kind=bitflip,op=aten.mm,module=layers.1.feed_forward.w1,phase=backward,step=13,nth=0,"
        "index=5,bit=14"
    )
    output = trained(
        user_dir, 1, 16, "--sdcreplay.bundle", "alarm.bundle", "--sdcreplay.ring", "3",
        "--sdcreplay.detect", env={"SDCREPLAY_INJECT": fault},
    )  # fmt: skip
    assert "step: 16" in output
    part = Bundle.open(user_dir / "alarm.bundle" / "ranks" / "000000")
    assert part.step_indices[-1] == 13 and len(part.step_indices) <= 5
    assert part.manifest.trigger is not None and part.manifest.trigger.step == 13
    report = sdcreplay(
        elsewhere, "replay", relative(user_dir / "alarm.bundle", elsewhere), "-d", "cpu:0",
        "-d", "cpu:1", "--no-ledger", code=1,
    )  # fmt: skip
    assert report["verdict"] == "recording_suspect"


@pytest.fixture(scope="module")
def fsdp_job(user_dir) -> Path:
    """Two ranks: FSDP2 over TorchTitan's own mesh (dp_shard 2), eager. The default SPMD
    backend (spmd_types) needs a torch newer than 2.13 (its FSDP2 refuses plain parameters):
    TorchTitan's own DTensor backend for data parallelism is chosen instead."""
    trained(
        user_dir, 2, 3, "--parallelism.spmd_backend", "partial_dtensor", "--sdcreplay.bundle",
        "job.bundle",
    )  # fmt: skip
    return user_dir / "job.bundle"


JOB_FAULT = (
    "kind=bitflip,op=aten.mm,module=layers.1.feed_forward.w1,phase=forward,step=1,index=3,"
    "bit=12,rank=1,device=cpu:1"
)


def test_the_fsdp_jobs_layout_is_data_parallel_and_a_fault_names_its_origin_rank(
    fsdp_job, elsewhere
):
    info = sdcreplay(elsewhere, "info", relative(fsdp_job, elsewhere), code=0)
    assert info["layout"]["dimensions"] == [{"name": "fsdp", "size": 2, "kind": "shard"}]
    report = sdcreplay(
        elsewhere, "replay", relative(fsdp_job, elsewhere), "-d", "cpu:0", "-d", "cpu:1",
        "--inject", JOB_FAULT, "--no-ledger", code=1,
    )  # fmt: skip
    assert (report["verdict"], report["origin_rank"]) == ("undecided", 1)


@pytest.fixture(scope="module")
def rank_report(fsdp_job, tmp_path_factory) -> tuple[Path, dict]:
    """``bisect JOB --rank 1`` of the planted fault, from another directory: its report."""
    elsewhere = tmp_path_factory.mktemp("bisect")
    report = sdcreplay(
        elsewhere, "bisect", relative(fsdp_job, elsewhere), "--rank", "1", "--suspect", "cpu:1",
        "--reference", "cpu:0", "--step", "1", "--inject", JOB_FAULT, "--out", "r.bisect",
        "--no-ledger", code=1,
    )  # fmt: skip
    return elsewhere, report


@pytest.mark.skipif(not FULL, reason="SDCREPLAY_TITAN_FULL=1 bisects the job's rank (minutes)")
def test_bisect_of_the_jobs_rank_names_the_planted_element_and_bit(rank_report):
    _, report = rank_report
    assert (report["rank"], report["step"], report["phase"]) == (1, 1, "forward")
    assert report["module"] == "layers.1.feed_forward.w1" and report["op"] == "aten.mm.default"
    assert report["elements"]["indices"] == [3] and report["bits"]["histogram"] == {"12": 1}


@pytest.mark.skipif(not FULL, reason="SDCREPLAY_TITAN_FULL=1 minimizes the rank's fault")
def test_minimize_measures_the_planted_faults_failure_rate_in_a_ticket(rank_report):
    elsewhere, _ = rank_report
    result = sdcreplay(
        elsewhere, "minimize", "r.bisect", "--inject", JOB_FAULT, "--trials", "5", "--out",
        "ticket", "--no-ledger", code=1,
    )  # fmt: skip
    assert (result["failures"], result["trials"], result["reference_failures"]) == (5, 5, 0)
    assert (result["job"]["rank"], result["job"]["world_size"]) == (1, 2)
    assert (elsewhere / "ticket" / "ticket.md").is_file()


@pytest.mark.skipif(not FULL, reason="SDCREPLAY_TITAN_FULL=1 replays the job --same-batch")
def test_same_batch_runs_on_the_fsdp_job(fsdp_job, elsewhere):
    report = sdcreplay(
        elsewhere, "replay", relative(fsdp_job, elsewhere), "--same-batch", "-d", "cpu:0",
        "-d", "cpu:1", "--no-ledger", code=0,
    )  # fmt: skip
    assert report["verdict"] == "correct"
