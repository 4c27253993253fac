"""Real training loops (tests/loops/loops.py, outside the package) record, verify, replay exactly.

Each loop feature is recorded twice: by a hand-written loop through ``Recorder`` and by
``sdcreplay record FILE.py:make_workload``. A clean replay on three replicas is correct, a
bitflip in one backward matmul of step 1 on cpu:1 makes cpu:1 alone persistent and bisect
names the operator; the same loop with the feature outside the workload's step is refused
while recording, naming the entry.
"""

from __future__ import annotations

import json
import struct
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import REPO, preserved_global_state

import sdcreplay
from sdcreplay import Bundle, WorkloadMismatchError, replay_devices
from sdcreplay.bisect.localize import bisect
from sdcreplay.errors import StructureError

sys.path.insert(0, str(REPO / "tests" / "loops"))
import loops  # noqa: E402

LOOPS = REPO / "tests" / "loops" / "loops.py"
REPLICAS = ["cpu:0", "cpu:1", "cpu:2"]
FAULT = "kind=bitflip,op=aten.mm,module=out,phase=backward,step=1,nth=0,index=0,bit=22,device=cpu:1"

OPTIMIZER_STEPS = {
    "scaler": [True, True, False, True],  # step 2's loss is inf: GradScaler skips the optimizer
    "accum_across": [False, True, False, True],
    "every_other": [False, True, False, True],
    "nan_skip": [False, True, True, True],  # step 0's loss is NaN: the loop drops the step
}

# The feature done by the loop but not by the workload's step -> what the Recorder names
OUTSIDE = {
    "clip": (
        "step_grad:inp.weight differs: every grad: matched: "
        "the loop changes gradients between backward()"
    ),
    "onecycle": "state:sched.last_epoch differs after the first step",
    "steplr": "state:sched.last_epoch differs after the first step",
    "scaler": "loss differs",
    "accum_inside": (
        "the loop's step has 'forward:inp#1' where the workload's step has 'hyper:0.lr'"
    ),
    "accum_across": (
        "the loop's step has '(end of step)' where the workload's step has 'hyper:0.lr'"
    ),
    "every_other": "the loop's step has '(end of step)' where the workload's step has 'hyper:0.lr'",
    "ema_buffer": "state_tensor:ema.shadow.inp.weight differs after the first step",
    "ema_model": "state_tensor:ema.n_averaged differs after the first step",
    "nan_skip": "the loop's step has '(end of step)' where the workload's step has 'loss'",
}


@pytest.fixture(scope="module")
def loop_bundles(tmp_path_factory) -> dict[str, Path]:
    """Every feature recorded once by the hand-written loop (verified while recording)."""
    folder = tmp_path_factory.mktemp("loops")
    with preserved_global_state():
        return {
            feature: loops.train(folder / f"{feature}.bundle", feature).path
            for feature in loops.FEATURES
        }


@pytest.mark.parametrize("feature", loops.FEATURES)
def test_hand_written_loop_replays_and_a_backward_bitflip_names_cpu1(loop_bundles, feature):
    bundle = Bundle.open(loop_bundles[feature])
    assert bundle.verification.to_json() == {"mode": "on", "status": "passed"}
    assert [s.optimizer_step for s in bundle.steps] == OPTIMIZER_STEPS.get(feature, [True] * 4)
    report = replay_devices(bundle.path, REPLICAS, inject=[FAULT])
    verdicts = {run.device: run.verdict for run in report.devices}
    assert verdicts == {"cpu:0": "match", "cpu:1": "persistent", "cpu:2": "match"}
    assert report.record_verdict == "match" and report.caveat is None
    assert (report.consensus.verdict, report.consensus.suspects) == ("persistent", ["cpu:1"])
    first = report.consensus.first_divergence
    assert (first.step, first.phase, first.name) == (1, "backward", "backward:out")
    found = bisect(
        bundle.path, suspect="cpu:1", reference="cpu:0", step=1, inject=[FAULT]
    ).to_json()
    assert (found["step"], found["phase"], found["module"], found["op"], found["isolated"]) == (
        1,
        "backward",
        "out",
        "aten.mm.default",
        "kernel",
    )
    assert found["elements"]["count"] >= 1


@pytest.mark.parametrize("feature", loops.FEATURES)
def test_sdcreplay_record_drives_train_step_and_replays_correct(cli, tmp_path, feature):
    out = tmp_path / "run.bundle"
    result = cli(
        "record",
        f"{LOOPS}:make_workload",
        "-a",
        f"feature={feature}",
        "--steps",
        "4",
        "--out",
        out,
        "--json",
    )
    assert result.exit_code == 0, result.output
    recorded = json.loads(result.stdout)
    assert recorded["verification"] == {"mode": "on", "status": "passed"}
    assert [s.optimizer_step for s in Bundle.open(out).steps] == OPTIMIZER_STEPS.get(
        feature, [True] * 4
    )
    args = [arg for device in REPLICAS for arg in ("-d", device)]
    result = cli("replay", out, *args, "--json", "--logs", tmp_path / "logs")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["consensus"]["verdict"] == "correct"
    assert report["verified"] is True and report["caveat"] is None
    assert [d["verdict"] for d in report["devices"]] == ["match"] * 3


@pytest.mark.parametrize("feature", loops.FEATURES)
def test_feature_outside_the_workloads_step_is_refused_at_the_first_step(tmp_path, feature):
    path = tmp_path / "run.bundle"
    with pytest.raises(WorkloadMismatchError) as caught:
        loops.train(path, feature, feature_in_step=False)
    assert OUTSIDE[feature] in caught.value.message
    assert "train_step" in caught.value.hint
    partial = Bundle.open(path)  # the steps before stay, as an incomplete bundle that says why
    assert not partial.complete and partial.step_indices == [0]
    assert partial.verification.status == "failed"
    assert OUTSIDE[feature] in partial.verification.problem


def test_state_objects_the_recorder_was_not_given_are_named(tmp_path):
    torch.manual_seed(0)
    model, optimizer, state = loops.build("steplr")
    step = loops.make_step(model, optimizer, state, "steplr")
    rec = sdcreplay.Recorder(
        tmp_path / "run.bundle",
        f"{LOOPS}:make_workload",
        model,
        optimizer,
        workload_kwargs={"feature": "steplr"},
    )
    with pytest.raises(
        WorkloadMismatchError,
        match=r"the workload's state objects are \['sched'\], "
        r"the Recorder was given \[\]",
    ):
        with rec:
            for index in range(2):
                with rec.step(loops.get_batch(index)):
                    step(loops.get_batch(index))


def test_a_change_between_later_steps_is_refused_at_that_step(tmp_path):
    """An edit of a parameter after step 1's block, outside any step, is named at step 2."""
    torch.manual_seed(0)
    model, optimizer, state = loops.build("clip")
    step = loops.make_step(model, optimizer, state, "clip")
    rec = sdcreplay.Recorder(
        tmp_path / "run.bundle",
        f"{LOOPS}:make_workload",
        model,
        optimizer,
        workload_kwargs={"feature": "clip"},
    )
    with pytest.raises(
        WorkloadMismatchError, match=r"param:inp\.weight changed between recorded steps 1 and 2"
    ):
        with rec:
            for index in range(4):
                with rec.step(loops.get_batch(index)):
                    step(loops.get_batch(index))
                if index == 1:
                    with torch.no_grad():
                        model.inp.weight.mul_(0.5)
    assert Bundle.open(tmp_path / "run.bundle").step_indices == [0, 1]


@pytest.mark.parametrize(("feature", "verdict"), [("clip", "undecided"), ("onecycle", None)])
def test_an_unverified_recording_never_blames_the_recorder(tmp_path, feature, verdict):
    """verify="warn" keeps the recording; its replay says the program may be why it differs,
    and accuses no device: the case against the recording device is not whole."""
    with pytest.warns(UserWarning, match="the workload cannot replay this recording"):
        rec = loops.train(tmp_path / "run.bundle", feature, feature_in_step=False, verify="warn")
    assert Bundle.open(rec.path).verification.status == "failed"
    if verdict is None:  # the scheduler differs first: the program, and no device, is named
        program = (
            r"the replayed program differs .* "
            r"record first differs at step 1 in state:sched\.last_epoch"
        )
        with pytest.raises(StructureError, match=program):
            replay_devices(rec.path, ["cpu:0", "cpu:1"])
        return
    report = replay_devices(rec.path, ["cpu:0", "cpu:1"])
    assert (report.consensus.verdict, report.consensus.suspects) == (verdict, [])
    assert report.consensus.missing[0].startswith("the recording is unverified")
    assert report.to_json()["caveat"].startswith("the recording was not verified")
    assert "step_grad:inp.weight differs" in report.caveat


def test_verify_off_is_recorded_and_shown(cli, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # off means no check and no warning
        rec = loops.train(tmp_path / "run.bundle", "clip", verify=False)
    result = cli("info", rec.path, "--json")
    assert json.loads(result.stdout)["verification"] == {"mode": "off", "status": "off"}
    result = cli("info", rec.path)
    assert "recorded without verification" in result.stderr
    result = cli("replay", rec.path, "--json", "--logs", tmp_path / "logs")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["verified"] is False
    assert "caveat: the recording was not verified" in " ".join(result.stderr.split())


def test_state_objects_are_saved_and_restored(loop_bundles):
    bundle = Bundle.open(loop_bundles["scaler"])
    assert bundle.state_object_names == ["scaler"]
    assert bundle.load_state_objects()["scaler"]["scale"] == 2.0**10
    entries = bundle.signature_log().steps
    scale = {step: dict(entries[step])["state:scaler.scale"] for step in entries}
    # The state entering each step: the skipped step 2 halved the scale, 1024 -> 512.
    assert scale == {
        0: "=float64:4090000000000000",
        1: "=float64:4090000000000000",
        2: "=float64:4090000000000000",
        3: "=float64:4080000000000000",
    }
    assert [s.grads for s in Bundle.open(loop_bundles["accum_across"]).steps] == [
        "none",
        "kept",
        "none",
        "kept",
    ]


def test_loss_fn_workload_accumulating_across_steps_replays_without_zeroing(tmp_path):
    """The older loop shape, optimizer every other step, a loss_fn-only workload: replay keeps the
    gradients where the loop kept them (it used to zero them after every step)."""
    from conftest import SMALL

    kwargs = dict(SMALL, seed=0)
    workload = sdcreplay.build_workload("builtin:tiny-llama", kwargs)
    model, optimizer = workload.model, workload.optimizer
    with sdcreplay.Recorder(
        tmp_path / "run.bundle", "builtin:tiny-llama", model, optimizer, workload_kwargs=kwargs
    ) as rec:
        for index in range(4):
            batch = workload.get_batch(index)
            with rec.step(batch):
                workload.loss_fn(model, batch).backward()
            if index % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
    bundle = Bundle.open(rec.path)
    assert bundle.verified
    assert [(s.optimizer_step, s.grads) for s in bundle.steps] == [
        (False, "none"),
        (True, "kept"),
        (False, "none"),
        (True, "kept"),
    ]
    assert sdcreplay.compare_logs(
        bundle.signature_log(), sdcreplay.replay_on_device(bundle, "cpu")
    ).identical


def test_state_objects_travel_beside_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    model, optimizer, state = loops.build("steplr")
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
    step = loops.make_step(model, optimizer, state, "steplr")
    with sdcreplay.Recorder(
        tmp_path / "run.bundle",
        f"{LOOPS}:make_workload",
        model,
        optimizer,
        state=state,
        workload_kwargs={"feature": "steplr"},
        checkpoint=checkpoint,
    ) as rec:
        for index in range(2):
            with rec.step(loops.get_batch(index)):
                step(loops.get_batch(index))
    bundle = Bundle.open(rec.path)
    assert bundle.manifest.state.kind == "checkpoint" and bundle.verified
    assert bundle.load_state_objects()["sched"]["last_epoch"] == 0
    assert sdcreplay.compare_logs(
        bundle.signature_log(), sdcreplay.replay_on_device(bundle, "cpu")
    ).identical


# ---------------------------------------------------------------------------
# Optimizer state in the signature (issue 15, item 1)

EXP_AVG_SQ_FLIP = (
    "kind=bitflip,op=aten.mul_,module=layers.0.attn.wq.weight,phase=optimizer,step=1,nth=1,"
    "device=cpu:1"
)
"""AdamW's second ``mul_`` of a parameter is ``exp_avg_sq.mul_(beta2)`` (the first: decay)."""


def test_an_exp_avg_sq_bitflip_on_the_last_step_is_detected_and_bisected(small_bundle):
    report = replay_devices(small_bundle, REPLICAS, inject=[EXP_AVG_SQ_FLIP])
    assert (report.consensus.verdict, report.consensus.suspects) == ("persistent", ["cpu:1"])
    first = report.consensus.first_divergence
    assert (first.step, first.phase, first.name) == (
        1,
        "optimizer",
        "optim:layers.0.attn.wq.weight.exp_avg_sq",
    )
    assert Bundle.open(small_bundle).step_indices[-1] == 1  # the last recorded step
    found = bisect(
        small_bundle, suspect="cpu:1", reference="cpu:0", step=1, inject=[EXP_AVG_SQ_FLIP]
    ).to_json()
    assert (found["phase"], found["module"], found["op"], found["isolated"]) == (
        "optimizer",
        "layers.0.attn.wq.weight",
        "aten.mul_.Tensor",
        "kernel",
    )
    assert found["elements"]["positions"][0] == [0, 0] and list(found["bits"]["histogram"]) == [
        "22"
    ]


def test_optimizer_state_entries_stay_complete_under_depth(tmp_path):
    from conftest import SMALL

    summary = sdcreplay.record(
        "builtin:tiny-llama", tmp_path / "b", steps=1, kwargs=dict(SMALL), max_depth=0
    )
    names = [name for name, _ in Bundle.open(summary.bundle).signature_log().steps[0]]
    params = [
        name
        for name, _ in sdcreplay.build_workload(
            "builtin:tiny-llama", SMALL
        ).model.named_parameters()
    ]
    assert [n for n in names if n.startswith("optim:")] == [
        f"optim:{p}.{key}" for p in params for key in ("step", "exp_avg", "exp_avg_sq")
    ]
    assert not any(n.startswith("forward:layers") for n in names)


# ---------------------------------------------------------------------------
# builtin:tiny-llama as a real loop


def test_builtin_tiny_llama_loop_options_record_verified_and_replay(cli, tmp_path):
    from conftest import SMALL_ARGS

    out = tmp_path / "loop.bundle"
    options = [
        "-a",
        "grad_clip=0.5",
        "-a",
        "warmup_steps=2",
        "-a",
        "schedule_steps=6",
        "-a",
        "accumulation=2",
        "-a",
        "autocast=bfloat16",
    ]
    result = cli(
        "record",
        "builtin:tiny-llama",
        *SMALL_ARGS,
        *options,
        "--steps",
        "3",
        "--out",
        out,
        "--json",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verification"]["status"] == "passed"
    bundle = Bundle.open(out)
    assert bundle.state_object_names == ["scheduler"]
    entries = bundle.signature_log().steps
    lr = [
        struct.unpack(">d", bytes.fromhex(dict(entries[s])["hyper:0.lr"].split(":")[1]))[0]
        for s in entries
    ]
    assert lr == [0.5e-3, 1e-3, 1e-3]  # warm-up 1/2, 2/2, then the cosine starts at 1
    assert [sum(name.split("#")[0] == "loss" for name, _ in entries[s]) for s in entries] == [
        2,
        2,
        2,
    ]
    assert any(name.startswith("step_grad:") for name, _ in entries[0])
    result = cli("replay", out, "-d", "cpu:0", "-d", "cpu:1", "--json", "--logs", tmp_path / "logs")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["consensus"]["verdict"] == "correct"


def test_builtin_defaults_keep_the_plain_step():
    from conftest import SMALL

    workload = sdcreplay.build_workload("builtin:tiny-llama", SMALL)
    assert workload.train_step is None and workload.state == {}


HIDDEN_STATE_WORKLOAD = """
from pathlib import Path

import torch
import sdcreplay

COUNTER = Path(__file__).parent / "steps.txt"  # a step counter in a file: not in the bundle


def make_workload(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(batch):
        n = int(COUNTER.read_text()) + 1 if COUNTER.exists() else 1
        COUNTER.write_text(str(n))
        loss = (model(batch) * n).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return sdcreplay.Workload(
        model, optimizer, lambda i: torch.ones(3, 4) * i, train_step=train_step
    )
"""


def test_record_refuses_a_step_that_depends_on_state_it_does_not_save(run_exe, cli, tmp_path):
    """A real process: exit 3, Error and Hint, no traceback, the steps so far kept as .partial."""
    source = tmp_path / "hidden.py"
    source.write_text(HIDDEN_STATE_WORKLOAD)
    done = run_exe(
        "record", f"{source}:make_workload", "--steps", "3", "--out", tmp_path / "run.bundle"
    )
    assert done.returncode == 3, done.stderr
    assert "Error: the workload cannot replay this recording: loss differs" in done.stderr
    assert "Hint: Put everything the loop does in a step" in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr
    assert Bundle.open(tmp_path / "run.bundle").verification.status == "failed"
    result = cli(
        "record",
        f"{source}:make_workload",
        "--steps",
        "3",
        "--out",
        tmp_path / "off.bundle",
        "--no-verify",
    )
    assert result.exit_code == 0, result.output
    assert Bundle.open(tmp_path / "off.bundle").verification.to_json() == {
        "mode": "off",
        "status": "off",
    }
