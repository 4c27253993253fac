"""Script mode on a loop shaped like a real one: tests/loops/nanogpt_train.py, a flat script in
nanoGPT's style (globals overridden from argv, accumulation with the next batch prefetched
inside the step by a get_batch that draws torch.randint, lr set before the step by
get_lr(iter_num), dropout, a GradScaler, clipping), recorded with the Recorder, rec.step() and
rec.feed only, no factory and no copy of its step.

Run as a plain process, it replays `correct` on three replicas; a bit planted in one matmul on
cpu:1 is named, bisected to its operator, module, element and bit, and minimized to a ticket.
Under torchrun (2 gloo ranks, DDP) it replays `correct` and the origin rank of a fault is named;
with torch.compile it replays `correct` and a fault in one generated kernel is found.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sdcreplay.bundle.job_bundle import JobBundle
from sdcreplay.bundle.reader import Bundle
from sdcreplay.compare.logs import compare_logs
from sdcreplay.replay.session import replay_on_device
from tests.conftest import TESTS, tiny_llama_recorder

LOOP = TESTS / "loops" / "nanogpt_train.py"
DEVICES = ["--device", "cpu:0", "--device", "cpu:1", "--device", "cpu:2"]
MODULE = "transformer.h.0.mlp.c_proj"  # the plain model's name, as the script's author reads it
SPEC = f"kind=bitflip,op=aten.mm,module={MODULE},phase=forward,step=1,nth=1,index=5,bit=20"
NO_LEDGER = {"SDCREPLAY_LEDGER": "off"}
pytestmark = pytest.mark.slow


def _record(folder: Path, *overrides: str) -> Path:
    """``python nanogpt_train.py --bundle=... OVERRIDES`` in ``folder``, as a person runs it."""
    bundle = folder / "run.bundle"
    done = subprocess.run(
        [sys.executable, str(LOOP), f"--bundle={bundle}", *overrides],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == [
        "iter 0",
        "iter 1",
        "iter 2",
    ]
    return bundle


@pytest.fixture(scope="module")
def flat(tmp_path_factory) -> Path:
    bundle = _record(tmp_path_factory.mktemp("flat"))
    opened = Bundle.open(bundle)
    assert opened.manifest.workload.is_script and opened.trusted and opened.verified
    assert opened.probe()["calls"]  # the first-step check ran the step's calls in its thread
    assert opened.manifest.workload.command["argv"] == [str(LOOP), f"--bundle={bundle}"]
    return bundle


def test_the_flat_script_replays_correct_on_three_replicas(flat, cli):
    done = cli("replay", flat, *DEVICES, "--json", env=NO_LEDGER)
    assert done.exit_code == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["consensus"]["verdict"] == "correct"
    assert [(d["device"], d["verdict"]) for d in report["devices"]] == [
        ("cpu:0", "match"),
        ("cpu:1", "match"),
        ("cpu:2", "match"),
    ]


def test_a_fault_on_cpu1_is_named_bisected_and_minimized(flat, cli, tmp_path):
    spec = f"{SPEC},device=cpu:1"
    done = cli("replay", flat, *DEVICES, "--inject", spec, "--json", env=NO_LEDGER)
    assert done.exit_code == 1, done.stderr
    report = json.loads(done.stdout)
    assert (report["consensus"]["verdict"], report["consensus"]["suspects"]) == (
        "persistent",
        ["cpu:1"],
    )
    (suspect,) = [d for d in report["devices"] if d["device"] == "cpu:1"]
    assert suspect["first_divergence"]["step"] == 1
    assert suspect["first_divergence"]["name"] == f"forward:{MODULE}#1"  # the 2nd micro-batch

    out = tmp_path / "r.bisect"
    found = cli(
        "bisect", flat, "--suspect", "cpu:1", "--reference", "cpu:0", "--inject", spec,
        "--out", out, "--json", env=NO_LEDGER,
    )  # fmt: skip
    assert found.exit_code == 1, found.stderr
    bisect = json.loads(found.stdout)
    assert (bisect["step"], bisect["phase"], bisect["module"], bisect["op"]) == (
        1,
        "forward",
        MODULE,
        "aten.mm.default",
    )
    assert bisect["elements"]["indices"] == [5] and bisect["bits"]["histogram"] == {"20": 1}
    assert bisect["isolated"] == "kernel"

    ticket = tmp_path / "ticket"
    shrunk = cli(
        "minimize", out, "--inject", spec, "--trials", "20", "--out", ticket, "--json",
        env=NO_LEDGER,
    )  # fmt: skip
    assert shrunk.exit_code == 1, shrunk.stderr
    data = json.loads(shrunk.stdout)
    assert (data["op"], data["device"], data["trials"], data["failures"]) == (
        "aten.mm.default",
        "cpu:1",
        20,
        20,
    )
    assert {"repro.py", "inputs.h5", "ticket.json", "ticket.md"} <= {
        path.name for path in ticket.iterdir()
    }


@pytest.fixture(scope="module")
def ddp_job(script_job) -> Path:
    """The same script under torchrun: 2 gloo ranks, DDP (the run's, conftest ``script_job``)."""
    opened = JobBundle.open(script_job)
    assert opened.world_size == 2
    return script_job


def test_under_torchrun_with_ddp_the_job_replays_correct(ddp_job, run_exe, tmp_path):
    """From another directory than the recorded one, with relative paths (its ranks run in the
    recorded directory)."""
    job = os.path.relpath(ddp_job, tmp_path)
    devices = ["--device", "cpu:0", "--device", "cpu:1"]
    done = run_exe("replay", job, *devices, "--logs", "logs", "--json", env=NO_LEDGER)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["verdict"], report["bundle"], report["log_dir"]) == ("correct", job, "logs")
    assert (tmp_path / "logs" / "replica0" / "rank1.r0.sig.zst").is_file()


def test_under_torchrun_a_fault_names_its_origin_rank_by_the_plain_module_name(ddp_job, cli):
    spec = f"{SPEC},rank=1,device=cpu:1"
    done = cli(
        "replay", ddp_job, "--device", "cpu:0", "--device", "cpu:1", "--inject", spec, "--json",
        env=NO_LEDGER,
    )  # fmt: skip
    assert done.exit_code == 1, done.stderr
    report = json.loads(done.stdout)
    assert (report["origin_rank"], report["spread_ranks"]) == (1, [0])


def test_with_torch_compile_it_replays_correct_and_finds_a_kernel_fault(tmp_path, cli):
    bundle = _record(tmp_path, "--compile=True")
    opened = Bundle.open(bundle)
    assert opened.verified
    ((region, forward),) = [
        (r.path, g) for r in opened.compiled_regions for g in r.graphs if g.kind == "forward"
    ]
    assert region == "<root>"
    (kernel,) = [name for name in forward.kernels if "gelu" in name]  # writes the MLP's GELU
    spec = f"kind=bitflip,kernel={kernel},phase=forward,step=1,index=3,bit=20,device=cpu:1"
    done = cli(
        "replay", bundle, "--device", "cpu:0", "--device", "cpu:1", "--inject", spec, "--json",
        env=NO_LEDGER,
    )  # fmt: skip
    assert done.exit_code == 1, done.stderr
    report = json.loads(done.stdout)
    verdicts = {d["device"]: d["verdict"] for d in report["devices"]}
    assert verdicts == {"cpu:0": "match", "cpu:1": "persistent"}
    (suspect,) = [d for d in report["devices"] if d["device"] == "cpu:1"]
    assert suspect["first_divergence"]["step"] == 1
    fired = suspect["injected"][0]  # once per micro-batch
    assert [(f["op"], f["elements"], f["bit"]) for f in fired] == [(kernel, [3], 20)] * 2


def test_a_factory_loop_that_sets_lr_before_each_step_verifies_and_replays(tmp_path):
    """The factory path too: the lr a loop sets before each step (a schedule outside the
    workload's step) is recorded as the step begins and set back on replay."""
    path = tmp_path / "lr.bundle"
    workload, rec = tiny_llama_recorder(path)
    for index, lr in enumerate([1e-3, 3e-3]):
        for group in workload.optimizer.param_groups:
            group["lr"] = lr
        batch = workload.get_batch(index)
        with rec.step(batch):
            workload.run_step(batch)
    bundle = Bundle.open(rec.close())
    assert bundle.verified
    log = replay_on_device(bundle, "cpu")
    assert compare_logs(bundle.signature_log(), log).identical


def test_the_script_mode_example_records_and_a_changed_script_is_named(tmp_path, run_exe):
    """examples/train_script.py as its docstring runs it: verified (its first step re-executed
    by running it again in replay mode, in the recording process); edited afterwards, its
    replay still runs and says the script changed."""
    example = tmp_path / "train_script.py"
    shutil.copy(TESTS.parent / "examples" / "train_script.py", example)
    out = tmp_path / "run.bundle"
    done = subprocess.run(
        [sys.executable, str(example), "--out", str(out), "--steps", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Recorded 2 steps in {out}" in done.stdout
    bundle = Bundle.open(out)
    assert bundle.manifest.workload.ref == f"script:{example}" and bundle.verified
    example.write_text(example.read_text() + "# edited after the recording\n")
    replayed = run_exe("replay", out, "--device", "cpu:0", "--json", env=NO_LEDGER, timeout=600)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    (device,) = json.loads(replayed.stdout)["devices"]
    assert device["verdict"] == "match"
    assert f"the recorded script {example} changed since the recording" in device["warnings"][0]


def test_a_replayed_scripts_close_while_an_error_unwinds_lets_the_error_end_the_script():
    """A trainer closes its Recorder in its ``except`` (TorchTitan's ``main``): replayed,
    ``close()`` used to park the script as if the step had ended, so the replay read an empty
    step and blamed the program; the step's own error must end the script instead."""
    import torch

    from sdcreplay.recording.script import ReplayingRecorder
    from sdcreplay.replay.script import Handoff, ReplayEnded

    handoff = Handoff()
    handoff.to_script.put(("go", None))
    model = torch.nn.Linear(2, 2)
    rec = ReplayingRecorder(handoff, model, torch.optim.SGD(model.parameters()), None, None)
    assert handoff.to_replay.get_nowait()[0] == "objects"
    handoff.to_script.put(("end", None))  # what a replay answers a parked script at the end
    with pytest.raises(ValueError, match="the step failed"):
        try:
            raise ValueError("the step failed")
        except ValueError:
            rec.close()
            raise
    assert handoff.to_replay.empty()  # not parked
    with pytest.raises(ReplayEnded):
        rec.close()  # a loop that closes it as it ends parks, and is ended there
