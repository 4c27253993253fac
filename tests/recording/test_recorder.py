"""The Recorder inside a user's own training loop, and what it writes."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMALL, SMALL_ARGS, tiny_llama_recorder

import sdcreplay
from sdcreplay import Bundle, Recorder, compare_logs, replay_on_device
from sdcreplay.bundle.manifest import STATE
from sdcreplay.capture.around import RestorePoints
from sdcreplay.capture.layers import state_digests
from sdcreplay.errors import (
    BundleError,
    CheckpointError,
    SdcReplayError,
    WorkloadError,
    WorkloadMismatchError,
)
from sdcreplay.workload.definition import build_workload
from sdcreplay.workload.loop_objects import loop_model

sys.path.insert(0, str(REPO / "tests" / "loops"))
import trainers  # noqa: E402

KIND_ORDER = [
    "rng",
    "forward",
    "loss",
    "backward",
    "grad",
    "hyper",
    "step_grad",
    "optim",
    "param",
    "buffer",
]


def kind(name: str) -> str:
    return name.split(":", 1)[0]


def exact_float32(value: torch.Tensor) -> str:
    bits = struct.unpack("<I", struct.pack("<f", value.item()))[0]
    return f"=float32:{bits:08x}"


def user_loop(
    path: Path, steps: int = 3, *, skip_optimizer_at: int | None = None, **recorder_kwargs
):
    """The loop from the README, on a 1-layer tiny-llama; returns the Recorder and the losses."""
    workload, rec = tiny_llama_recorder(path, **recorder_kwargs)
    model, opt = workload.model, workload.optimizer
    losses = []
    for index in range(steps):
        batch = workload.get_batch(index)
        with rec.step(batch):
            loss = workload.loss_fn(model, batch)
            loss.backward()
        if index != skip_optimizer_at:
            opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    rec.close()
    return rec, losses


def assert_replays_identically(path: Path, steps: list[int]) -> None:
    bundle = Bundle.open(path)
    record_log = bundle.signature_log()
    comparison = compare_logs(record_log, replay_on_device(bundle, "cpu"))
    assert comparison.steps == steps
    assert comparison.divergences == []
    assert comparison.entries == record_log.entry_count() > 0


def test_user_loop_records_a_bundle_that_replays_identically(tmp_path: Path):
    rec, losses = user_loop(tmp_path / "run.bundle", steps=3)
    assert rec.path == tmp_path / "run.bundle"
    assert rec.steps_written == 3
    bundle = Bundle.open(rec.path)
    assert bundle.complete
    assert bundle.workload_ref == "builtin:tiny-llama"
    assert bundle.workload_kwargs == dict(SMALL, seed=0)
    assert bundle.manifest.state.to_json() == {"kind": "embedded", "file": STATE}
    assert [s.optimizer_step for s in bundle.steps] == [True, True, True]
    log = bundle.signature_log()
    assert rec.entries_written == log.entry_count()
    params = [
        name for name, _ in build_workload("builtin:tiny-llama", SMALL).model.named_parameters()
    ]
    for index, entries in log.steps.items():
        names = [name for name, _ in entries]
        # The loss is whatever tensor went to backward, kept exactly.
        assert dict(entries)["loss"] == exact_float32(losses[index])
        assert names.count("loss") == 1
        ranks = [KIND_ORDER.index(kind(name)) for name in names]
        assert ranks == sorted(ranks), (
            "entries are not in the order rng, forward, loss, backward, grad, param"
        )
        assert {kind(name) for name in names} == set(KIND_ORDER)
        assert names[:3] == ["rng:python", "rng:numpy", "rng:cpu"]
        assert [n for n in names if kind(n) == "grad"] == [f"grad:{p}" for p in params]
        assert [n for n in names if kind(n) == "param"] == [f"param:{p}" for p in params]
        assert "forward:layers.0.attn.wq" in names and "backward:layers.0.attn.wq" in names
    assert_replays_identically(rec.path, [0, 1, 2])


def test_batches_and_rng_are_stored_exactly(tmp_path: Path):
    rec, _ = user_loop(tmp_path / "run.bundle", steps=2)
    workload = build_workload("builtin:tiny-llama", SMALL)
    bundle = Bundle.open(rec.path)
    for index in (0, 1):
        batch, rng = bundle.load_step(index)
        assert torch.equal(batch["tokens"], workload.get_batch(index)["tokens"])
        assert rng.cpu.dtype == torch.uint8 and rng.accelerator is None


def test_micro_batches_handed_over_one_by_one_are_the_steps_batch(tmp_path: Path):
    """A trainer shows each micro-batch only as its forward begins: the step opens with the
    first, the others join it; the stored batch is the list, copied as each one came."""
    workload, rec = tiny_llama_recorder(tmp_path / "run.bundle", verify=False)
    model, opt = workload.model, workload.optimizer
    parts = [workload.get_batch(i) for i in range(2)]
    with pytest.raises(SdcReplayError, match="needs an open step"):
        rec.extend_batch(parts[1])
    with rec.step([parts[0]]):
        workload.loss_fn(model, parts[0]).backward()
        rec.extend_batch(parts[1])
        parts[1]["tokens"].add_(1)  # the loop's tensor changes later: the copy does not
        workload.loss_fn(model, parts[1]).backward()
    opt.step()
    opt.zero_grad()
    with rec.step(parts[0]), pytest.raises(SdcReplayError, match="a list of micro-batches"):
        rec.extend_batch(parts[1])
    rec.close()
    stored, _ = Bundle.open(rec.path).load_step(0)
    assert isinstance(stored, list) and len(stored) == 2
    assert torch.equal(stored[0]["tokens"], workload.get_batch(0)["tokens"])
    assert torch.equal(stored[1]["tokens"], workload.get_batch(1)["tokens"])


def test_start_step_numbers_the_steps(tmp_path: Path):
    rec, _ = user_loop(tmp_path / "run.bundle", steps=2, start_step=500)
    bundle = Bundle.open(rec.path)
    assert bundle.step_indices == [500, 501]
    assert [s.file for s in bundle.steps] == ["steps/000500.h5", "steps/000501.h5"]
    assert_replays_identically(rec.path, [500, 501])


def test_a_step_without_optimizer_step_is_recorded_as_such(tmp_path: Path):
    rec, _ = user_loop(tmp_path / "run.bundle", steps=3, skip_optimizer_at=1)
    bundle = Bundle.open(rec.path)
    assert [s.optimizer_step for s in bundle.steps] == [True, False, True]
    names = [name for name, _ in bundle.signature_log().steps[1]]
    assert not any(kind(name) in ("param", "buffer") for name in names)
    assert_replays_identically(rec.path, [0, 1, 2])


def test_a_step_that_raises_is_not_recorded(tmp_path: Path):
    kwargs = dict(SMALL, seed=0)
    workload = build_workload("builtin:tiny-llama", kwargs)
    model, opt = workload.model, workload.optimizer
    with Recorder(
        tmp_path / "run.bundle", "builtin:tiny-llama", model, opt, workload_kwargs=kwargs
    ) as rec:
        for index in range(3):
            batch = workload.get_batch(index)
            try:
                with rec.step(batch):
                    loss = workload.loss_fn(model, batch)
                    if index == 1:
                        raise RuntimeError("simulated OOM")
                    loss.backward()
            except RuntimeError:
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
    bundle = Bundle.open(tmp_path / "run.bundle")
    assert bundle.step_indices == [0, 1]  # the failed step left no record and no gap
    assert torch.equal(bundle.load_step(1)[0]["tokens"], workload.get_batch(2)["tokens"])
    assert_replays_identically(tmp_path / "run.bundle", [0, 1])


def test_recorder_with_a_checkpoint_references_it(tmp_path: Path):
    kwargs = dict(SMALL, seed=0)
    workload = build_workload("builtin:tiny-llama", kwargs)
    checkpoint = tmp_path / "ckpt.pt"
    torch.save(
        {"model": workload.model.state_dict(), "optimizer": workload.optimizer.state_dict()},
        checkpoint,
    )
    rec = Recorder(
        tmp_path / "run.bundle",
        "builtin:tiny-llama",
        workload.model,
        workload.optimizer,
        workload_kwargs=kwargs,
        checkpoint=checkpoint,
    )
    batch = workload.get_batch(0)
    with rec.step(batch):
        workload.loss_fn(workload.model, batch).backward()
    workload.optimizer.step()
    workload.optimizer.zero_grad()
    rec.close()
    bundle = Bundle.open(tmp_path / "run.bundle")
    assert bundle.manifest.state.kind == "checkpoint"
    assert bundle.manifest.state.path == str(checkpoint.resolve())
    assert STATE not in bundle.manifest.files
    assert_replays_identically(tmp_path / "run.bundle", [0])


def test_recorder_refuses_a_checkpoint_the_model_was_not_loaded_from(tmp_path: Path):
    workload = build_workload("builtin:tiny-llama", dict(SMALL, seed=0))
    other = build_workload("builtin:tiny-llama", dict(SMALL, seed=1))
    torch.save({"model": other.model.state_dict()}, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="differs from checkpoint"):
        Recorder(
            tmp_path / "run.bundle",
            "builtin:tiny-llama",
            workload.model,
            workload.optimizer,
            checkpoint=tmp_path / "ckpt.pt",
        )


def test_recorder_refuses_to_overwrite_and_then_moves_the_old_bundle_aside(tmp_path: Path):
    path = tmp_path / "run.bundle"
    user_loop(path, steps=1)
    with pytest.raises(BundleError, match="already exists") as info:
        user_loop(path, steps=1)
    assert "overwrite=True" in info.value.python_hint and "--" not in info.value.python_hint
    rec, _ = user_loop(path, steps=2, overwrite=True)
    assert Bundle.open(rec.path).step_indices == [0, 1]
    [moved] = rec.moved_aside
    assert moved.name.startswith("run.bundle.old-") and Bundle.open(moved).step_indices == [0]


def test_record_over_a_bundle_refuses_without_overwrite_and_moves_it_aside_with(
    tmp_path: Path, cli, small_bundle: Path
):
    args = ["record", "builtin:tiny-llama", "--steps", "1", "--out", small_bundle, *SMALL_ARGS]
    manifest = (small_bundle / "manifest.json").read_bytes()
    refused = cli(*args)
    assert refused.exit_code == 3 and "Traceback" not in refused.output
    said = " ".join(refused.stderr.split())
    assert f"Error: {small_bundle} already exists" in said
    assert (
        "Hint: Pass --overwrite to replace it (the old one is moved aside to small.bundle.old-"
        in (said)
    )
    assert (small_bundle / "manifest.json").read_bytes() == manifest
    with pytest.raises(BundleError) as info:  # the Python API says it for Python
        sdcreplay.record("builtin:tiny-llama", small_bundle, steps=1, kwargs=dict(SMALL))
    assert info.value.python_hint.startswith("Pass overwrite=True to replace it")

    done = cli(*args, "--overwrite", "--json")
    assert done.exit_code == 0, done.output
    [moved] = json.loads(done.stdout)["moved_aside"]
    assert Path(moved).parent == tmp_path and Path(moved).name.startswith("small.bundle.old-")
    assert (Path(moved) / "manifest.json").read_bytes() == manifest
    assert Bundle.open(moved).step_indices == [0, 1] and Bundle.open(small_bundle).step_indices == [
        0
    ]
    assert f"The bundle that was there is now {moved}" in " ".join(done.stderr.split())


def test_record_api_summary(tmp_path: Path):
    summary = sdcreplay.record(
        "builtin:tiny-moe", tmp_path / "moe.bundle", steps=2, seed=5, kwargs={**SMALL, "experts": 2}
    )
    bundle = Bundle.open(summary.bundle)
    assert summary.bundle == tmp_path / "moe.bundle"
    assert summary.steps == 2 and bundle.step_indices == [0, 1]
    assert summary.kwargs == {**SMALL, "experts": 2, "seed": 5}
    assert bundle.workload_kwargs == summary.kwargs
    assert summary.entries == bundle.signature_log().entry_count()
    assert summary.size_bytes == bundle.size_bytes()
    assert isinstance(summary.final_loss, float)


KILLED_SCRIPT = """
import sys, time
import sdcreplay
from sdcreplay.workload.definition import build_workload

kwargs = {kwargs!r}
workload = build_workload("builtin:tiny-llama", kwargs)
model, opt = workload.model, workload.optimizer
rec = sdcreplay.Recorder(sys.argv[1], "builtin:tiny-llama", model, opt, workload_kwargs=kwargs)
for index in range(4):
    batch = workload.get_batch(index)
    with rec.step(batch):
        loss = workload.loss_fn(model, batch)
        loss.backward()
    if index == 3:
        break  # the fourth step is mid-way: backward done, no optimizer step yet
    opt.step()
    opt.zero_grad()
print("ready", flush=True)
time.sleep(120)
"""


def test_a_recording_killed_mid_write_reads_as_the_completed_steps(tmp_path: Path):
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_SCRIPT.format(kwargs=dict(SMALL, seed=0))))
    process = subprocess.Popen(
        [sys.executable, str(script), "run.bundle"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.strip() == "ready", process.stderr.read()
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not (tmp_path / "run.bundle").exists()
    bundle = Bundle.open(tmp_path / "run.bundle")
    assert bundle.path == tmp_path / "run.bundle.partial"
    assert bundle.complete is False
    assert bundle.step_indices == [0, 1, 2]
    assert sdcreplay.describe(tmp_path / "run.bundle").complete is False
    assert_replays_identically(tmp_path / "run.bundle", [0, 1, 2])


def test_example_train_loop_records_a_replayable_bundle(tmp_path: Path):
    example = REPO / "examples" / "train_loop.py"
    done = subprocess.run(
        [
            sys.executable,
            str(example),
            "--out",
            str(tmp_path / "run.bundle"),
            "--steps",
            "3",
            "--hidden",
            "16",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"sdcreplay replay {tmp_path / 'run.bundle'}" in done.stdout
    bundle = Bundle.open(tmp_path / "run.bundle")
    assert bundle.workload_ref == f"{example.resolve()}:make_workload"
    assert bundle.workload_kwargs == {"seed": 0, "hidden": 16}
    assert bundle.step_indices == [0, 1, 2]
    assert bundle.verified and bundle.state_object_names == ["scheduler"]
    names = [name for name, _ in bundle.signature_log().steps[0]]
    assert names.count("loss") == 1 and "loss#3" in names  # four micro-batches, one step
    assert_replays_identically(tmp_path / "run.bundle", [0, 1, 2])


def test_a_loop_that_raises_leaves_an_incomplete_bundle(tmp_path: Path):
    kwargs = dict(SMALL, seed=0)
    workload = build_workload("builtin:tiny-llama", kwargs)
    model, opt = workload.model, workload.optimizer
    with pytest.raises(RuntimeError, match="simulated CUDA error"):
        with Recorder(
            tmp_path / "run.bundle", "builtin:tiny-llama", model, opt, workload_kwargs=kwargs
        ) as rec:
            for index in range(3):
                batch = workload.get_batch(index)
                with rec.step(batch):
                    if index == 2:
                        raise RuntimeError("simulated CUDA error")
                    workload.loss_fn(model, batch).backward()
                opt.step()
                opt.zero_grad()
    bundle = Bundle.open(tmp_path / "run.bundle")
    assert bundle.step_indices == [0, 1]
    assert bundle.complete is False


def test_max_depth_captures_fewer_modules_and_replays_identically(tmp_path: Path):
    """A shallower signature (cheaper to record) still replays bit for bit and still names the
    layer."""
    summary = sdcreplay.record(
        "builtin:tiny-llama", tmp_path / "shallow.bundle", steps=2, kwargs=dict(SMALL), max_depth=2
    )
    bundle = Bundle.open(summary.bundle)
    assert bundle.manifest.capture.to_json() == {"max_depth": 2, "program": True, "naming": "plain"}
    names = {name for entries in bundle.signature_log().steps.values() for name, _ in entries}
    modules = {
        name.split(":", 1)[1].split("[")[0]
        for name in names
        if name.startswith(("forward:", "backward:"))
    }
    assert (
        "layers.0" in modules
        and "layers.0.attn" not in modules
        and "layers.0.attn.wq" not in modules
    )
    assert any(
        name.startswith("grad:layers.0.attn.wq") for name in names
    )  # gradients and parameters stay complete
    assert compare_logs(bundle.signature_log(), replay_on_device(bundle, "cpu")).identical
    spec = "kind=bitflip,op=aten.mm,module=layers.0.mlp.w1,phase=forward,step=1,index=101"
    first = compare_logs(
        bundle.signature_log(), replay_on_device(bundle, "cpu", inject=[spec])
    ).first
    assert (first.step, first.name) == (1, "forward:layers.0")


def _tiny_llama_loop(path: Path, **recorder_kwargs):
    workload, rec = tiny_llama_recorder(path, **recorder_kwargs)
    weight = dict(workload.model.named_parameters())["layers.0.attn.wq.weight"]
    return workload, rec, weight


def test_an_edit_after_the_optimizer_hook_is_named_though_the_step_entries_are_reused(
    tmp_path: Path,
):
    """The step ends at the optimizer's hook: the between-steps check starts from the step's own
    param: entries, and an edit after it (through .data: no version counter moves) is named."""
    workload, rec, weight = _tiny_llama_loop(tmp_path / "run.bundle")
    model, opt = workload.model, workload.optimizer
    with pytest.raises(
        WorkloadMismatchError,
        match=r"param:layers\.0\.attn\.wq\.weight changed "
        r"between recorded steps 1 and 2",
    ):
        for index in range(3):
            batch = workload.get_batch(index)
            with rec.step(batch):
                workload.loss_fn(model, batch).backward()
            opt.step()
            assert rec._capture.updated_state == state_digests(model)
            opt.zero_grad()
            if index == 1:
                weight.data[0, 0] += 1.0
    rec.abandon()


def test_an_edit_inside_the_block_after_the_optimizer_step_is_part_of_the_step(tmp_path: Path):
    """With the optimizer step inside the block the step ends at the block's exit: the state
    after the edit (not the param: entries) is what the next step must start from."""
    workload, rec, weight = _tiny_llama_loop(tmp_path / "run.bundle")
    model, opt = workload.model, workload.optimizer
    for index in range(3):
        batch = workload.get_batch(index)
        with rec.step(batch):
            workload.loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
            if index == 1:
                weight.data[0, 0] += 1.0
    rec.close()
    assert Bundle.open(tmp_path / "run.bundle").step_indices == [0, 1, 2]


def test_updated_state_is_the_step_entries_of_the_last_optimizer_step(tmp_path: Path):
    workload, rec, _ = _tiny_llama_loop(tmp_path / "run.bundle", verify=False)
    model, opt = workload.model, workload.optimizer
    batch = workload.get_batch(0)
    with rec.step(batch):
        workload.loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
        workload.loss_fn(model, batch).backward()
        opt.step()
        expected = state_digests(model)
        opt.zero_grad()
    capture_entries = dict(rec._capture.updated_state)
    rec.close()
    entries = dict(Bundle.open(tmp_path / "run.bundle").signature_log().steps[0])
    assert capture_entries == expected
    assert all(entries[f"{name}#1"] == digest for name, digest in expected.items())


class _Mix(torch.nn.Module):
    def forward(self, x, y):
        return x * 3.0 + y * 5.0


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = _Mix()

    def forward(self, a):
        return self.mix(a.exp(), a.sin()).sum()


def test_backward_entries_are_the_gradients_each_input_edge_hands_back():
    """The edge walk numbers the inputs of ``mix`` breadth-first from its output (x is [0]);
    each entry is logged when autograd hands that input its gradient (y's first)."""
    from sdcreplay.capture.determinism import capture_rng
    from sdcreplay.capture.digest import tensor_digest
    from sdcreplay.capture.layers import SignatureCapture

    model = _TwoInputs()
    capture = SignatureCapture(model)
    a = torch.linspace(-1.0, 1.0, 12, requires_grad=True)
    capture.begin_step(capture_rng(torch.device("cpu")))
    with capture.backward_capture():
        model(a).backward()
    entries = capture.end_step()
    capture.close()
    backward = [(name, digest) for name, digest in entries if name.startswith("backward:")]
    assert backward == [
        ("backward:mix[1]", tensor_digest(torch.full((12,), 5.0))),
        ("backward:mix[0]", tensor_digest(torch.full((12,), 3.0))),
    ]


BACKWARD_FAULT = "kind=bitflip,op=aten.mm,phase=backward,step=1,nth=2,index=3,bit=20"


def test_a_boundary_recording_holds_the_step_boundary_and_replays_at_every_layer(tmp_path: Path):
    """signature="boundary": the record keeps the losses, what the optimizer is given and the
    parameters it produced; a replay computes every layer, votes with it at the boundary, and
    a replica with a fault is named at the layer where it went wrong."""
    rec, _ = user_loop(tmp_path / "b.bundle", signature="boundary")
    bundle = Bundle.open(rec.path)
    assert (bundle.manifest.capture.level, bundle.verified) == ("boundary", True)
    log = bundle.signature_log()
    assert log.level == "boundary"
    assert {kind(name) for name, _ in log.steps[0]} == {
        "rng",
        "loss",
        "hyper",
        "step_grad",
        "param",
        "buffer",
    }
    replayed = replay_on_device(bundle, "cpu:0")
    assert replayed.level == "layer"
    assert {"forward", "backward", "grad", "optim"} <= {kind(n) for n, _ in replayed.steps[0]}
    comparison = compare_logs(log, replayed)
    assert comparison.identical and comparison.entries == log.entry_count()
    faulty = replay_on_device(bundle, "cpu:1", inject=[BACKWARD_FAULT + ",device=cpu:1"])
    consensus = sdcreplay.vote(log, {"cpu:0": [replayed], "cpu:1": [faulty]})
    assert (consensus.verdict, consensus.suspects) == ("persistent", ["cpu:1"])
    assert consensus.first_divergence.brief() == {
        "step": 1,
        "phase": "backward",
        "name": "grad:layers.0.mlp.w2.weight",
    }


def test_a_fault_while_recording_at_the_boundary_level_accuses_the_record(tmp_path: Path):
    summary = sdcreplay.record(
        "builtin:tiny-llama",
        tmp_path / "b.bundle",
        steps=2,
        kwargs=dict(SMALL),
        inject=[BACKWARD_FAULT],
        signature="boundary",
    )
    bundle = Bundle.open(summary.bundle)
    logs = {label: [replay_on_device(bundle, label)] for label in ("cpu:0", "cpu:1")}
    consensus = sdcreplay.vote(bundle.signature_log(), logs)
    assert (consensus.verdict, consensus.suspects) == ("recording_suspect", ["record"])
    assert consensus.first_divergence.brief() == {
        "step": 1,
        "phase": "optimizer",
        "name": "step_grad:layers.0.mlp.w2.weight",
    }


def test_an_unknown_signature_level_is_refused_before_anything_is_written(tmp_path: Path):
    with pytest.raises(SdcReplayError, match="signature='every' is not one of layer, boundary"):
        tiny_llama_recorder(tmp_path / "b.bundle", signature="every")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("form", ["accelerate", "container", "list"])
def test_the_recorder_takes_the_optimizers_and_model_parts_a_trainer_hands_it(
    tmp_path: Path, form: str
):
    """Accelerate's wrapped optimizer (``prepare``'s AcceleratedOptimizer), TorchTitan's
    container over its model parts (a torch Optimizer with a flat state_dict keyed by name),
    an AdamW and an SGD with momentum in a list (tests/loops/trainers.py): recorded from a
    state where every optimizer has its own, verified, kept as one optimizer state_dict in
    torch's form, and replayed ``correct`` on two replicas from it."""
    rec, step = trainers.recorder(tmp_path / "run.bundle", form, warmup=2)
    with rec:
        trainers.train(rec, step, range(2, 4))
    bundle = Bundle.open(rec.path)
    assert bundle.verified and bundle.step_indices == [2, 3]
    _, optimizer = bundle.load_state()
    assert [group["params"] for group in optimizer["param_groups"]] == (
        [list(range(8))] if form == "accelerate" else [list(range(4)), list(range(4, 8))]
    )  # 4 parameters a part; the second optimizer's numbered after the first's
    assert sorted(optimizer["state"]) == list(range(8))
    second = "momentum_buffer" if form == "list" else "exp_avg"
    assert set(optimizer["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert second in optimizer["state"][7]
    names = [name for name, _ in bundle.signature_log().steps[2]]
    assert "param:1.attention.wqkv.weight" in names and "optim:0.proj.bias.step" in names
    assert ("hyper:1.momentum" in names) == (form == "list")
    logs = {label: [replay_on_device(bundle, label)] for label in ("cpu:0", "cpu:1")}
    assert sdcreplay.vote(bundle.signature_log(), logs).verdict == "correct"


class FlatState(torch.optim.SGD):
    """An optimizer whose state_dict is keyed by parameter name, with no optimizers inside."""

    def state_dict(self):
        return {"weight.momentum_buffer": None}


def test_what_the_recorder_cannot_take_is_refused_as_it_is_created(tmp_path: Path):
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    refusals = {
        "optimizer=object is not a torch optimizer, nor a wrapper or container of one": {
            "optimizer": object()
        },
        "optimizer= holds no optimizer": {"optimizer": []},
        "FlatState.state_dict() gives ['weight.momentum_buffer'], not torch's optimizer "
        "state_dict (state, param_groups), which a bundle keeps": {
            "optimizer": FlatState(model.parameters(), lr=0.1)
        },
        "model=str is not a torch.nn.Module nor a list of them": {"model": "model"},
        "model=Identity has no parameters": {"model": torch.nn.Identity()},
    }
    for message, given in refusals.items():
        objects = {"model": model, "optimizer": sgd, **given}
        with pytest.raises(WorkloadError) as refused:
            Recorder(tmp_path / "run.bundle", "builtin:tiny-llama", **objects)
        assert refused.value.message == f"Recorder: {message}"
        hint = "at .optimizers" if "optimizer" in message else "Pass the module"
        assert hint in refused.value.hint
    assert list(tmp_path.iterdir()) == []


def test_model_parts_are_one_module_whose_parts_forward_entries_are_restore_points():
    """A list of model parts is recorded as one module named by each part's place; it runs
    no forward of its own, so each part's forward entry is a point where script mode puts the
    torch RNG back (as the single model's is)."""
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    model = loop_model(parts)
    assert list(dict(model.named_parameters())) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert loop_model(parts[:1]) is parts[0]
    points = RestorePoints(torch.device("cpu"), model)
    points.begin_recording()
    hidden = parts[0](torch.randn(1, 2))
    torch.rand(1)  # a draw between the parts
    parts[1](hidden)
    noted = points.end()
    points.close()
    assert len(noted) == 2 and not torch.equal(noted[0]["cpu"], noted[1]["cpu"])
