"""Replay reproduces the record bit for bit, and names the first divergence when it does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMALL, SMALL_MOE

import sdcreplay
from sdcreplay import Bundle, compare_logs, replay_on_device
from sdcreplay.capture.signature import write_signature_log
from sdcreplay.errors import CheckpointError, DeterminismError

WORKLOADS = {"tiny-llama": SMALL, "tiny-moe": SMALL_MOE}


def flip_bit(tensor: torch.Tensor, index: int = 0, bit: int = 22) -> None:
    """Flip one bit of one float32 element in place (bit 22: the top mantissa bit)."""
    with torch.no_grad():
        words = tensor.view(-1).view(torch.int32)
        words[index] ^= 1 << bit


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_record_then_replay_matches_bit_for_bit(tmp_path: Path, cli, name: str):
    summary = sdcreplay.record(
        f"builtin:{name}", tmp_path / "run.bundle", steps=4, seed=0, kwargs=WORKLOADS[name]
    )
    bundle = Bundle.open(summary.bundle)
    record_log = bundle.signature_log()
    assert sorted(record_log.steps) == [0, 1, 2, 3]
    log = replay_on_device(bundle, "cpu")
    comparison = compare_logs(record_log, log)
    assert comparison.identical
    assert comparison.steps == [0, 1, 2, 3]
    assert comparison.entries == record_log.entry_count() == summary.entries
    assert log.steps == record_log.steps
    names = [entry for entry, _ in record_log.steps[0]]
    if name == "tiny-moe":
        assert (
            "forward:layers.0.moe.router" in names and "forward:layers.0.moe.experts.1.w2" in names
        )

    if name == "tiny-llama":
        return  # its CLI replay (record, info, replay --json) is in test_cli.py
    result = cli("replay", summary.bundle, "--json", "--logs", tmp_path / "logs")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["schema"] == "sdcreplay.replay/1"
    assert [(d["device"], d["verdict"], d["first_divergence"]) for d in report["devices"]] == [
        ("cpu", "match", None)
    ]


def test_one_flipped_parameter_bit_diverges_at_its_layer(small_bundle: Path):
    bundle = Bundle.open(small_bundle)

    def corrupt(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        flip_bit(model.get_parameter("layers.0.attn.wq.weight"), index=5)

    log = replay_on_device(bundle, "cpu", after_load=corrupt)
    record_log = bundle.signature_log()
    comparison = compare_logs(record_log, log)
    first = comparison.first
    assert (first.step, first.name, first.phase, first.layer) == (
        0,
        "forward:layers.0.attn.wq",
        "forward",
        "layers.0.attn.wq",
    )
    names = [name for name, _ in record_log.steps[0]]
    position = names.index("forward:layers.0.attn.wq")
    # Everything computed before the corrupted layer matches; the rest of the step follows it.
    assert record_log.steps[0][:position] == log.steps[0][:position]
    assert all(d.step > 0 or names.index(d.name) >= position for d in comparison.divergences)
    assert {
        "forward:layers.0.attn",
        "loss",
        "grad:layers.0.attn.wq.weight",
        "param:layers.0.attn.wq.weight",
    } <= {d.name for d in comparison.divergences if d.step == 0}
    assert comparison.per_step()[1] > 0  # the corruption persists into the next step


def test_a_flip_in_the_last_layer_is_named_there(small_bundle: Path):
    bundle = Bundle.open(small_bundle)
    log = replay_on_device(
        bundle, "cpu", after_load=lambda model, _: flip_bit(model.get_parameter("output.weight"))
    )
    first = compare_logs(bundle.signature_log(), log).first
    assert (first.step, first.name) == (0, "forward:output")


def test_another_learning_rate_is_a_program_difference(small_bundle: Path, cli, tmp_path: Path):
    """A hyper-parameter the loop changed shows first as its own program entry, then the update."""
    bundle = Bundle.open(small_bundle)

    def bump_lr(model, optimizer):
        """The lr as each step begins is the recorded one (set back there): the program differs
        where the optimizer is then given another."""

        def double(optimizer, args, kwargs):
            optimizer.param_groups[0]["lr"] *= 2

        optimizer.register_step_pre_hook(double)

    bumped = replay_on_device(bundle, "cpu", after_load=bump_lr)
    comparison = compare_logs(bundle.signature_log(), bumped)
    first = comparison.first
    assert (first.step, first.name, first.phase) == (0, "hyper:0.lr", "program")
    assert comparison.program_differs
    names = [d.name for d in comparison.divergences]
    assert names[1] == "param:tok_embeddings.weight"  # then the update it drove
    write_signature_log(tmp_path / "bumped.sig.zst", bumped)
    result = cli("diff", small_bundle, tmp_path / "bumped.sig.zst", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["program_differs"] is True
    assert "It is a program entry" in result.stderr


def test_last_step_limits_the_replay(small_bundle: Path):
    bundle = Bundle.open(small_bundle)
    log = replay_on_device(bundle, "cpu", last_step=0)
    assert sorted(log.steps) == [0]
    assert compare_logs(bundle.signature_log(), log, steps=[0]).identical


def test_replay_log_meta(small_bundle: Path):
    log = replay_on_device(small_bundle, "cpu:1")
    assert log.meta["device"] == "cpu:1"
    assert log.meta["device_type"] == "cpu"
    assert log.meta["role"] == "replay"
    assert log.meta["warnings"] == []


def test_replay_refuses_a_conflicting_environment(
    small_bundle: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with pytest.raises(DeterminismError, match="CUBLAS_WORKSPACE_CONFIG=':16:8'"):
        replay_on_device(small_bundle, "cpu")


def test_replay_without_applying_switches_refuses_when_they_differ(small_bundle: Path):
    torch.use_deterministic_algorithms(False)
    with pytest.raises(
        DeterminismError, match="deterministic_algorithms: recorded True, now False"
    ):
        replay_on_device(small_bundle, "cpu", apply_switches=False)


def test_checkpoint_bundle_replays_and_a_changed_checkpoint_is_refused(tmp_path: Path):
    workload = sdcreplay.build_workload("builtin:tiny-llama", dict(SMALL, seed=0))
    checkpoint = tmp_path / "ckpt.pt"
    torch.save(
        {"model": workload.model.state_dict(), "optimizer": workload.optimizer.state_dict()},
        checkpoint,
    )
    summary = sdcreplay.record(
        "builtin:tiny-llama", tmp_path / "run.bundle", steps=2, kwargs=SMALL, checkpoint=checkpoint
    )
    bundle = Bundle.open(summary.bundle)
    assert bundle.manifest.state.kind == "checkpoint"
    assert compare_logs(bundle.signature_log(), replay_on_device(bundle, "cpu")).identical
    with torch.no_grad():
        workload.model.output.weight[0, 0] += 1
    torch.save(
        {"model": workload.model.state_dict(), "optimizer": workload.optimizer.state_dict()},
        checkpoint,
    )
    with pytest.raises(CheckpointError, match="changed since the recording"):
        replay_on_device(summary.bundle, "cpu")


def test_committed_trace_replays(tmp_path: Path, cli):
    """traces/tiny.bundle was recorded by an earlier build, on some x86-64 machine, before
    kernel probes existed: a format change that breaks it fails here, and whatever this
    machine is (its CPU's vendor, model, ISA, cores), the replay accuses no one."""
    trace = REPO / "traces" / "tiny.bundle"
    if not trace.is_dir():
        pytest.fail("traces/tiny.bundle is missing: run `make traces`")
    before = sorted(str(path) for path in trace.parent.rglob("*"))
    result = cli("replay", trace, "-d", "cpu:0", "-d", "cpu:1", "--json", "--logs", tmp_path / "l")
    report = json.loads(result.stdout)
    verdicts = {device["verdict"] for device in report["devices"]}
    if report["consensus"]["verdict"] == "incomparable":
        # Another CPU model (no probe says it computes alike) or kernels it cannot put in force.
        assert result.exit_code == 3, result.output
        assert verdicts == {"incomparable"}
        assert all(device["fingerprint_differences"] for device in report["devices"])
    else:
        assert (result.exit_code, report["consensus"]["verdict"]) == (0, "correct"), result.output
        assert verdicts == {"match"}
    assert report["consensus"]["suspects"] == []
    assert (
        sorted(str(path) for path in trace.parent.rglob("*")) == before
    )  # replay writes nothing there
