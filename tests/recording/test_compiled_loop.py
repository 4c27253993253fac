"""A user's loop over a `torch.compile`d model, as a subprocess: recorded, replayed on cpu:0..2,
a fault planted for cpu:1 found and bisected, and a replay that generates other code refused.

The whole model's fault is a bit flipped in one fused Inductor kernel's output (``kernel=``),
found by the replay and named by bisect's kernel stage; the block-compiled model's is a bit
flipped in a parameter's memory before step 1 (``memflip``), which the compiled kernels read;
the 2-rank DDP job's is a kernel fault on rank 1, its origin rank named, then bisected on that
rank. CPU Inductor compiles cost seconds each on a loaded machine; the suite runs the whole
model at the layer level, the block-compiled model at the boundary level and the DDP job, and
replays a planted fault on cpu:0 and cpu:1; ``SDCREPLAY_COMPILED_FULL=1`` adds the other
levels, ``dynamic=True`` and ``fullgraph=True``, and cpu:2 to the fault's replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sdcreplay.bundle import trust
from sdcreplay.bundle.reader import Bundle
from sdcreplay.cli import app
from sdcreplay.replay.job import replay_job
from sdcreplay.replay.replicas import replay_devices

LOOP = Path(__file__).resolve().parents[1] / "compiled_loop.py"
FULL = os.environ.get("SDCREPLAY_COMPILED_FULL") == "1"
DEVICES = ["cpu:0", "cpu:1", "cpu:2"]
pytestmark = pytest.mark.slow


def _record(tmp_path: Path, *args: str) -> tuple[Path, list[dict]]:
    done = subprocess.run(
        [sys.executable, str(LOOP), "run.bundle", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return tmp_path / result["bundle"], result["compiled"]


def _replay(bundle: Path, tmp_path: Path, name: str, devices=DEVICES, **options):
    with trust.granting([f"{LOOP}:make_workload"]):
        return replay_devices(bundle, devices, log_dir=tmp_path / name, ledger=False, **options)


def _the_shells_setting_is_not_used(bundle: Path, sdcreplay_exe: str) -> None:
    """``TORCHINDUCTOR_SIZE_ASSERTS=0`` in the investigator's shell would make Inductor generate
    other code than the record's: no device process takes it, the verdict is the same."""
    done = subprocess.run(
        [sdcreplay_exe, "replay", str(bundle), "--device", "cpu:0", "--trust-workload", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TORCHINDUCTOR_SIZE_ASSERTS": "0", "SDCREPLAY_LEDGER": "off"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["consensus"]["verdict"] == "correct"
    assert [device["verdict"] for device in report["devices"]] == ["match"]


def _planted_fault_is_found(bundle: Path, tmp_path: Path, spec: str, region: str) -> None:
    """``spec`` planted for cpu:1: persistent, cpu:1 accused (cpu:0..2 under
    SDCREPLAY_COMPILED_FULL; in the suite cpu:0 and cpu:1, a compile less)."""
    devices = DEVICES if FULL else DEVICES[:2]
    report = _replay(bundle, tmp_path, "fault", devices, inject=[spec])
    assert report.exit_code == 1
    assert (report.consensus.verdict, report.consensus.suspects) == ("persistent", ["cpu:1"])
    verdicts = {run.device: run.verdict for run in report.devices}
    assert verdicts == {label: "persistent" if label == "cpu:1" else "match" for label in devices}
    (suspect,) = [run.to_json() for run in report.devices if run.device == "cpu:1"]
    assert suspect["first_divergence"]["step"] == 1
    assert suspect["first_divergence_in"].startswith(f"compiled region {region} (inductor, ")


def _each_replica_ran_the_recorded_code(report, regions: list[dict]) -> None:
    recorded = {r["path"]: [g["digest"] for g in r["graphs"]] for r in regions}
    for run in report.devices:
        assert {r.path: [g.digest for g in r.graphs] for r in run.compiled} == recorded


def test_a_whole_compiled_model_records_replays_and_names_the_faulty_replica(
    tmp_path, sdcreplay_exe, cli
):
    bundle, regions = _record(tmp_path, "--compile", "full", "--signature", "layer")
    assert [(r["path"], [g["kind"] for g in r["graphs"]]) for r in regions] == [
        ("<root>", ["forward", "backward"])
    ]
    opened = Bundle.open(bundle)
    assert opened.verified and opened.manifest.capture.level == "layer"
    report = _replay(bundle, tmp_path, "correct")
    assert (report.exit_code, report.consensus.verdict) == (0, "correct")
    _each_replica_ran_the_recorded_code(report, regions)
    # the blocks' fused forward kernel (one definition, called once per block): the second call
    (forward,) = [g for g in regions[0]["graphs"] if g["kind"] == "forward"]
    kernel = forward["kernels"][0]
    spec = (
        f"kind=bitflip,kernel={kernel},phase=forward,step=1,nth=1,output=2,index=13,bit=20,"
        "device=cpu:1"
    )
    _planted_fault_is_found(bundle, tmp_path, spec, "<root>")
    _bisect_names_the_kernel(bundle, tmp_path, spec, cli, kernel)
    _the_shells_setting_is_not_used(bundle, sdcreplay_exe)


def _bisect_names_the_kernel(bundle: Path, tmp_path: Path, spec: str, cli, kernel: str) -> None:
    found = cli(
        "bisect", bundle, "--suspect", "cpu:1", "--reference", "cpu:0", "--trust-workload",
        "--inject", spec, "--out", tmp_path / "r.bisect", "--json",
        env={"SDCREPLAY_LEDGER": "off"},
    )  # fmt: skip
    assert found.exit_code == 1, found.output
    report = json.loads(found.stdout)
    assert (report["step"], report["level"], report["phase"]) == (1, "kernel", "forward")
    assert (report["kernel"]["name"], report["kernel"]["nth"]) == (kernel, 1)
    assert {"aten.native_layer_norm", "aten.relu"} <= set(report["kernel"]["fused"])
    assert report["output_index"] == 2 and report["elements"]["indices"] == [13]
    assert report["bits"]["histogram"] == {"20": 1} and report["isolated"] == "kernel"


def test_a_block_compiled_model_at_the_boundary_level(tmp_path, sdcreplay_exe):
    bundle, regions = _record(tmp_path, "--compile", "blocks", "--signature", "boundary")
    assert [r["path"] for r in regions] == ["layers.0", "layers.1"]
    assert Bundle.open(bundle).verified
    memflip = "kind=memflip,param=layers.1.fc.weight,step=1,index=3,bit=20,device=cpu:1"
    _planted_fault_is_found(bundle, tmp_path, memflip, "layers.1")
    if FULL:  # the whole model's test refuses other code in the suite
        _the_shells_setting_is_not_used(bundle, sdcreplay_exe)


@pytest.mark.skipif(not FULL, reason="SDCREPLAY_COMPILED_FULL=1 runs every variant")
@pytest.mark.parametrize(
    "args",
    [
        ("--compile", "full", "--signature", "boundary", "--dynamic"),
        ("--compile", "full", "--signature", "layer", "--fullgraph"),
        ("--compile", "blocks", "--signature", "layer", "--dynamic", "--fullgraph"),
        ("--compile", "blocks", "--signature", "boundary"),
    ],
)
def test_every_variant_replays_correct(tmp_path, args):
    bundle, regions = _record(tmp_path, *args)
    assert all(region["graphs"] for region in regions)
    report = _replay(bundle, tmp_path, "correct")
    assert (report.exit_code, report.consensus.verdict) == (0, "correct")
    _each_replica_ran_the_recorded_code(report, regions)


@pytest.fixture(scope="module")
def ddp_job(compiled_job) -> tuple[Path, str]:
    """The run's 2-rank DDP job over the block-compiled model (conftest ``compiled_job``), and
    a fault planted for rank 1 on cpu:1 in the second block's fused forward kernel."""
    part = Bundle.open(compiled_job / "ranks" / "000001")
    assert part.verified
    assert [r.path for r in part.compiled_regions] == ["layers.0", "layers.1"]
    assert all(r.graphs for r in part.compiled_regions)
    block = part.compiled_regions[1]
    (forward,) = [g for g in block.graphs if g.kind == "forward"]
    (kernel,) = forward.kernels  # Linear's GEMM is an extern call; the rest is fused in one
    fault = (
        f"kind=bitflip,kernel={kernel},module=layers.1,phase=forward,step=1,output=2,"
        "index=13,bit=20,rank=1,device=cpu:1"
    )
    return compiled_job, fault


def test_a_ddp_job_with_compiled_blocks_names_the_origin_rank(ddp_job, tmp_path):
    job, fault = ddp_job
    with trust.granting([f"{LOOP}:make_workload"]):
        report = replay_job(
            job, ["cpu:0", "cpu:1"], inject=[fault], log_dir=tmp_path / "replay", ledger=False
        )
    data = report.to_json()
    assert (data["origin_rank"], data["spread_ranks"]) == (1, [0])
    rank0 = data["ranks"][0]["devices"][0]
    assert rank0["first_divergence_in"].startswith("compiled region layers.0 (inductor, backward")
    (injected,) = data["ranks"][1]["devices"][0]["injected"][0]
    assert (injected["module"], injected["elements"], injected["bit"]) == ("layers.1", [13], 20)


@pytest.fixture(scope="module")
def kernel_report(ddp_job, tmp_path_factory) -> dict:
    """bisect --rank 1 of the job, once for the module: its report."""
    job, fault = ddp_job
    found = CliRunner().invoke(
        app,
        [
            "bisect", str(job), "--rank", "1", "--suspect", "cpu:1", "--reference", "cpu:0",
            "--step", "1", "--trust-workload", "--inject", fault, "--out",
            str(tmp_path_factory.mktemp("kernel") / "r.bisect"), "--json",
        ],
        env={"SDCREPLAY_LEDGER": "off", "SDCREPLAY_DEBUG": None},
    )  # fmt: skip
    assert found.exit_code == 1, found.output
    return json.loads(found.stdout)


def test_bisect_on_the_origin_rank_names_the_compiled_kernel_element_and_bit(
    ddp_job, kernel_report
):
    """The kernel stage on a job's rank: every run is the whole job, rank 1 on the device
    under test, rank 0 serving the collectives."""
    _, fault = ddp_job
    report = kernel_report
    assert (report["rank"], report["step"], report["level"]) == (1, 1, "kernel")
    assert (report["phase"], report["module"]) == ("forward", "layers.1")
    kernel = report["kernel"]
    assert fault.startswith(f"kind=bitflip,kernel={kernel['name']},")
    assert kernel["name"].startswith("cpp_fused_") and kernel["nth"] == 1
    assert {"aten.native_layer_norm", "aten.relu", "aten.add"} <= set(kernel["fused"])
    assert report["output_index"] == 2 and report["elements"]["indices"] == [13]
    assert report["elements"]["positions"] == [[1, 5]] and report["elements"]["xor"] == ["00100000"]
    assert report["bits"]["histogram"] == {"20": 1}
    assert report["isolated"] == "kernel" and report["isolation"]["failures"] == 3


def test_ops_on_the_jobs_rank_lists_the_kernel_call_bisect_names_with_a_rank_spec(ddp_job, cli):
    """``ops JOB --rank 1`` runs rank 1 among its peers: the fused kernel the fixture's fault
    names is listed in layers.1's forward, its spec ready with rank=1 (the same kernel runs in
    layers.0 first: nth 1, as bisect names it)."""
    job, fault = ddp_job
    listed = cli(
        "ops", job, "--rank", "1", "--step", "1", "--module", "layers.1", "--phase", "forward",
        "--trust-workload", "--json",
    )  # fmt: skip
    assert listed.exit_code == 0, listed.output
    kernels = json.loads(listed.stdout)["kernels"]
    # the block's fused kernels, and its extern matmul named by the Linear it ran in
    # (capture/graph_modules.py)
    assert {k["module"] for k in kernels} == {"layers.1", "layers.1.fc"}
    (kernel,) = [k for k in kernels if fault.startswith(f"kind=bitflip,kernel={k['kernel']},")]
    assert kernel["nth"] == 1 and len(kernel["outputs"]) > 2  # the fault's output=2
    assert kernel["spec"] == (
        f"kind=bitflip,kernel={kernel['kernel']},phase=forward,step=1,nth=1,rank=1"
    )


def test_minimize_on_the_ranks_kernel_report_writes_a_ticket_that_fails_where_planted(
    ddp_job, kernel_report, cli, tmp_path
):
    """The kernel compiled by rank 1 alone (a process that is rank 1 of the job without
    peers, replaying its window: the job's bisect saves no state), measured on both devices;
    the ticket names the job and the rank, and its repro.py compiles and runs the kernel."""
    _, fault = ddp_job
    ticket = tmp_path / "ticket"
    measured = cli(
        "minimize", kernel_report["report"], "--inject", fault, "--trials", "10", "--out",
        ticket, "--no-ledger", "--json",
    )  # fmt: skip
    assert measured.exit_code == 1, measured.output
    result = json.loads(measured.stdout)
    assert (result["level"], result["kernel"]["name"]) == (
        "kernel",
        kernel_report["kernel"]["name"],
    )
    assert (result["failures"], result["trials"], result["reference_failures"]) == (10, 10, 0)
    assert (result["job"]["rank"], result["job"]["world_size"]) == (1, 2)
    assert result["job"]["collectives"] == kernel_report["collectives"]
    assert "## In the job" in (ticket / "ticket.md").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDCREPLAY")}
    env |= {"PYTHONPATH": str(LOOP.parents[1]), "OMP_NUM_THREADS": "1", "SDCREPLAY_INJECT": fault}
    for device, code, failed in (("cpu:1", 1, "failed 3 of 3"), ("cpu:0", 0, "failed 0 of 3")):
        run = subprocess.run(
            [sys.executable, "repro.py", "--device", device, "--trials", "3"],
            cwd=ticket, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == code, run.stdout + run.stderr[-2000:]
        assert failed in run.stdout
