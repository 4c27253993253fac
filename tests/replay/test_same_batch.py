"""Phase 1 and 2 at scale (docs/at-scale.md) on real 4-rank gloo jobs of tiny-llama: a fault
planted on rank 2 is named by its peers in one same-batch replay, under DDP and FSDP2; a clean
job is ``correct``; rank 2 replayed alone on two labels (FSDP2's all-gathers built from the
peers' shards in the bundle) names the one the fault is on, and bisected alone names the
operator, element and bit. A user's dp=2 x tp=2 script under torchrun
(tests/tp_dp_script.py): its layout is the mesh's, and with 2 peers per class the record
decides: --same-batch names the odd rank by its coordinates, and a clean job is correct.

Phase 1's --keep-state (a fault in step 1): a DCP checkpoint of the state entering step 1
from the healthy ranks, where bisect --alone --from-state starts and names the same call.

``SDCREPLAY_SCALE_CLEAN_RUNS=10`` repeats the clean same-batch and alone replays (the issue's
false accusation count; the suite runs one of each).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import SMALL, TESTS, run_torchrun
from typer.testing import CliRunner

from sdcreplay.bundle.job_bundle import JobBundle
from sdcreplay.cli import app
from sdcreplay.ledger.verdicts import records_for

FAULT = "kind=bitflip,op=aten.mm,phase=backward,step=0,rank=2,index=3,bit=20"
LABELS = [arg for rank in range(4) for arg in ("-d", f"cpu:{rank}")]
CLEAN_RUNS = int(os.environ.get("SDCREPLAY_SCALE_CLEAN_RUNS", "1"))


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def job(request, builtin_job) -> tuple[str, Path]:
    """The run's shared 4-rank job (conftest ``builtin_job``; the DDP one is
    tests/replay/test_distributed.py's too)."""
    return request.param, builtin_job(request.param, 4).out


def test_info_shows_the_layout(job, cli):
    parallel, bundle = job
    shown = json.loads(cli("info", bundle, "--json").stdout)["layout"]
    kind = "shard" if parallel == "fsdp2" else "replicate"
    assert [(d["size"], d["kind"]) for d in shown["dimensions"]] == [(4, kind)]
    assert shown["coordinates"] == [[0], [1], [2], [3]]


def test_same_batch_names_only_the_faulty_rank(job, cli, tmp_path: Path):
    _, bundle = job
    result = cli(
        "replay", bundle, "--same-batch", *LABELS, "--inject", FAULT, "--no-ledger",
        "--logs", tmp_path, "--json",
    )  # fmt: skip
    assert result.exit_code == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["mode"] == "same_batch" and report["verdict"] == "persistent"
    assert report["suspects"] == ["cpu:2"]
    assert [odd["rank"] for odd in report["odd_ranks"]] == [2]
    first = report["odd_ranks"][0]["first_divergent_entry"]
    assert (first["step"], first["agreeing"], first["peers"]) == (0, 3, 4)
    assert [rank["verdict"] for rank in report["ranks"]] == [
        "correct", "correct", "persistent", "correct",
    ]  # fmt: skip
    # the ledger's records (what `devices export` drains by): rank 2's device suspect
    records = {(r.label, r.rank): r.verdict for r in records_for(report)}
    assert records == {
        ("cpu:0", 0): "match", ("cpu:1", 1): "match", ("cpu:2", 2): "persistent",
        ("cpu:3", 3): "match",
    }  # fmt: skip


def test_a_clean_job_is_correct_in_a_same_batch_replay(job, cli, tmp_path: Path):
    _, bundle = job
    for run in range(CLEAN_RUNS):
        result = cli(
            "replay", bundle, "--same-batch", *LABELS, "--no-ledger", "--logs",
            tmp_path / str(run), "--json",
        )  # fmt: skip
        assert result.exit_code == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert (report["verdict"], report["suspects"]) == ("correct", [])


def test_rank_alone_on_two_labels_names_the_faulty_one(job, cli, tmp_path: Path):
    parallel, bundle = job
    result = cli(
        "replay", bundle, "--rank", "2", "--alone", "-d", "cpu:1", "-d", "cpu:2",
        "--inject", f"{FAULT},device=cpu:1", "--no-ledger", "--logs", tmp_path, "--json",
    )  # fmt: skip
    assert result.exit_code == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    verdicts = {row["device"]: row["verdict"] for row in report["devices"]}
    assert verdicts == {"cpu:1": "persistent", "cpu:2": "match"}
    first = report["devices"][0]["first_divergence"]
    # DDP's gradient all-reduce; FSDP2's after its three all-gathers: the reduce-scatter
    collective = "0#0:gloo:all_reduce" if parallel == "ddp" else "0#3:gloo:_reduce_scatter_base"
    assert (first["step"], first["name"]) == (0, f"collective:{collective}.input")


def test_a_clean_rank_alone_is_correct(job, cli, tmp_path: Path):
    """Under FSDP2 the all-gathers' outputs are built from the peers' shards in the bundle: in
    the first step they are the job's, to the digest."""
    parallel, bundle = job
    for run in range(CLEAN_RUNS):
        logs = tmp_path / str(run)
        result = cli(
            "replay", bundle, "--rank", "2", "--alone", "-d", "cpu:1", "-d", "cpu:2",
            "--no-ledger", "--logs", logs, "--json",
        )  # fmt: skip
        assert result.exit_code == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert (report["consensus"]["verdict"], report["consensus"]["suspects"]) == ("correct", [])
    replayed = json.loads(next((logs / "cpu-1").glob("*.messages.json")).read_text())
    recorded = JobBundle.open(bundle).rank(2).messages()[0]
    pairs = list(zip(replayed["steps"]["0"], recorded, strict=True))
    inputs = [mine["input_digest"] == theirs.input_digest for mine, theirs in pairs]
    outputs = [mine["output_digest"] == theirs.output_digest for mine, theirs in pairs]
    if parallel == "ddp":  # the all-reduce of a world of one keeps rank 2's own gradients
        assert (inputs, outputs) == ([True], [False])
    else:  # all-gathers as the job's; reduce-scatters: rank 2's own chunk
        assert (inputs, outputs) == ([True] * 5, [True, True, True, False, False])


def test_bisect_rank_alone_names_operator_element_and_bit(job, cli, tmp_path: Path):
    _, bundle = job
    result = cli(
        "bisect", bundle, "--rank", "2", "--alone", "--suspect", "cpu:1", "--reference",
        "cpu:2", "--step", "0", "--inject", f"{FAULT},device=cpu:1", "--out", tmp_path / "b",
        "--no-ledger", "--json",
    )  # fmt: skip
    assert result.exit_code == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert (report["alone"], report["rank"], report["verdict"]) == (True, 2, "divergence")
    assert (report["step"], report["phase"], report["module"]) == (0, "backward", "output")
    assert report["op"] == "aten.mm.default"
    assert report["elements"]["indices"] == [3]
    assert report["bits"]["histogram"] == {"20": 1}
    assert report["isolation"]["failures"] == report["isolation"]["runs"]


@pytest.fixture(scope="module")
def kept(job, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, dict]:
    """Phase 1 with --keep-state on a fault planted in step 1: the state entering it."""
    parallel, bundle = job
    directory = tmp_path_factory.mktemp(f"kept-{parallel}")
    fault = FAULT.replace("step=0", "step=1")
    result = CliRunner().invoke(
        app,
        [
            "replay", str(bundle), "--same-batch", *LABELS, "--inject", fault, "--no-ledger",
            "--logs", str(directory / "logs"), "--keep-state", str(directory / "state"), "--json",
        ],
        env={"SDCREPLAY_DEBUG": None},
    )  # fmt: skip
    assert result.exit_code == 1, result.stdout + result.stderr
    return parallel, bundle, json.loads(result.stdout)


def test_phase_1_keeps_the_state_entering_the_divergent_step(kept):
    parallel, bundle, report = kept
    assert report["suspects"] == ["cpu:2"]
    state = report["kept_state"]
    assert (state["step"], state["odd_ranks"], state["world_size"]) == (1, [2], 4)
    directory = Path(state["path"])
    written = sorted(path.name for path in directory.iterdir())
    checkpoint = [f"__{rank}_0.distcp" for rank in range(4)] + [".metadata"]
    assert written == sorted(checkpoint + state["ranks"] + ["sdcreplay-state.json"])
    # the checkpoint, loaded as a restarting job would (DCP, in this test), is the model the
    # ranks kept: FSDP2's shards side by side, DDP's replicas written by a healthy rank
    import torch
    import torch.distributed.checkpoint as dcp

    from sdcreplay.replay.kept_state import KeptState
    from sdcreplay.workload.definition import build_workload

    model = build_workload("builtin:tiny-llama", SMALL).model.state_dict()
    loaded = {name: torch.zeros_like(tensor) for name, tensor in model.items()}
    dcp.load({"model": loaded}, checkpoint_id=str(directory), no_dist=True)
    kept_state = KeptState.open(directory, JobBundle.open(bundle))
    ranks = [kept_state.model_state(rank) for rank in range(4)]
    for name, tensor in loaded.items():
        shards = [part[name] for part in ranks]
        expected = torch.cat(shards) if parallel == "fsdp2" else shards[0]
        assert torch.equal(tensor, expected), name


def test_phase_2_starts_at_the_kept_state(kept, cli, tmp_path: Path):
    """Bisect alone from the kept state: no replay of the window, step 1 named exactly."""
    _, bundle, report = kept
    fault = FAULT.replace("step=0", "step=1")
    result = cli(
        "bisect", bundle, "--rank", "2", "--alone", "--suspect", "cpu:1", "--reference",
        "cpu:2", "--from-state", report["kept_state"]["path"], "--inject",
        f"{fault},device=cpu:1", "--out", tmp_path / "b", "--no-ledger", "--json",
    )  # fmt: skip
    assert result.exit_code == 1, result.stdout + result.stderr
    found = json.loads(result.stdout)
    assert (found["step"], found["phase"], found["op"]) == (1, "backward", "aten.mm.default")
    assert (found["elements"]["indices"], found["bits"]["histogram"]) == ([3], {"20": 1})
    assert found["steps_run"]["replay"] == 0  # started at step 1, the window not replayed


def test_a_checkpoint_without_its_json_is_refused_unread(kept, cli, tmp_path: Path):
    """DCP's .metadata is a pickle: sdcreplay reads only the kept state's JSON and HDF5; and
    a state is never written over a directory that exists."""
    _, bundle, report = kept
    bare = tmp_path / "bare"
    shutil.copytree(report["kept_state"]["path"], bare)
    (bare / "sdcreplay-state.json").unlink()
    result = cli(
        "replay", bundle, "--rank", "2", "--alone", "-d", "cpu:1", "-d", "cpu:2",
        "--from-state", bare, "--no-ledger", "--logs", tmp_path / "logs",
    )  # fmt: skip
    assert result.exit_code == 3 and "its metadata is a pickle" in result.stderr
    assert "Hint:" in result.stderr and "Traceback" not in result.stderr
    again = cli("replay", bundle, "--same-batch", "--keep-state", bare, "--no-ledger")
    assert again.exit_code == 3 and "it exists already" in again.stderr  # before any replay


@pytest.fixture(scope="module")
def dp_by_tp_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's dp=2 x tp=2 script, recorded under torchrun."""
    directory = tmp_path_factory.mktemp("dp_by_tp")
    script = directory / "train.py"
    shutil.copy(TESTS / "tp_dp_script.py", script)
    done = run_torchrun(script, 4, str(directory / "job.bundle"), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return directory / "job.bundle"


def _dp_by_tp_replay(cli, bundle: Path, logs: Path, *inject: str):
    return cli(
        "replay",
        bundle,
        "--same-batch",
        "--trust-workload",
        *inject,
        "--no-ledger",
        "--logs",
        logs,
        "--timeout",
        "900",
        "--json",
    )  # fmt: skip  (a loaded 2-core machine starts 4 ranks slowly)


def test_dp_by_tp_job_names_the_odd_rank_by_its_coordinates(dp_by_tp_job: Path, cli, tmp_path):
    """Two peers per class: the record sides with the source group (dp=0), so the peer that
    left it is odd (compare/peers.py)."""
    layout = json.loads(cli("info", dp_by_tp_job, "--json").stdout)["layout"]
    assert [(d["name"], d["size"], d["kind"]) for d in layout["dimensions"]] == [
        ("dp", 2, "replicate"), ("tp", 2, "tensor"),
    ]  # fmt: skip
    assert layout["coordinates"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    fault = "kind=bitflip,op=aten.mm,phase=backward,step=0,rank=2,index=1,bit=20"
    result = _dp_by_tp_replay(cli, dp_by_tp_job, tmp_path, "--inject", fault)
    assert result.exit_code == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert (report["mode"], report["verdict"]) == ("same_batch", "persistent")
    assert report["same_batch"]["missing"] is None
    assert "2 data-parallel peers" in report["same_batch"]["tie_break"]
    [odd] = report["odd_ranks"]
    # its device: the one rank 2 recorded on (a CPU job under torchrun records "cpu")
    assert (odd["rank"], odd["where"], odd["device"]) == (2, "rank 2 (dp=1, tp=0)", "cpu")
    assert odd["first_divergent_entry"]["against"] == "record"
    assert report["suspects"] == ["cpu"]
    assert report["ranks"][2]["coordinates"] == {"dp": 1, "tp": 0}
    assert [rank["verdict"] for rank in report["ranks"]] == [
        "correct", "correct", "persistent", "correct",
    ]  # fmt: skip


def test_a_clean_dp_by_tp_job_is_correct(dp_by_tp_job: Path, cli, tmp_path: Path):
    for run in range(CLEAN_RUNS):
        result = _dp_by_tp_replay(cli, dp_by_tp_job, tmp_path / str(run))
        assert result.exit_code == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert (report["mode"], report["verdict"], report["suspects"]) == (
            "same_batch", "correct", [],
        )  # fmt: skip
