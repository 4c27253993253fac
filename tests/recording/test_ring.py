"""Recorder(ring=K): the last K steps in bounded memory, written as a bundle only on demand."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, SMALL, SMALL_ARGS, tiny_llama_recorder

import sdcreplay
from sdcreplay import Bundle, Recorder
from sdcreplay.bundle.writer import BundleWriter
from sdcreplay.capture.snapshot import TrainingSnapshot
from sdcreplay.errors import SdcReplayError
from sdcreplay.recording.ring import RingSnapshot
from sdcreplay.recording.ring_mode import DumpFailedWarning
from sdcreplay.storage.tensorio import map_tensors
from sdcreplay.workload.definition import build_workload

sys.path.insert(0, str(REPO / "tests" / "loops"))
import trainers  # noqa: E402

K = 4
TINY = {**SMALL, "dim": 16, "seq_len": 4, "batch_size": 1}  # 200 steps in a few seconds
# Recorded on the "defective" device itself (no device= key: it fires while recording).
PLANTED = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=7,index=5,bit=13"


def ring_loop(path: Path, steps: int, kwargs: dict = TINY, **recorder_kwargs):
    """A user's loop under a ring Recorder; returns it (open) and ring_nbytes after each step."""
    workload, rec = tiny_llama_recorder(path, kwargs, ring=K, **recorder_kwargs)
    held = []
    for index in range(steps):
        batch = workload.get_batch(index)
        with rec.step(batch):
            workload.run_step(batch)
        held.append(rec.ring_nbytes)
    return rec, workload, held


def tensor_bytes(nest) -> int:
    sizes: list[int] = []
    map_tensors(nest, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


def step_bytes(bundle: Bundle, index: int) -> int:
    """What the ring holds for a step, from the bundle it wrote: batch and RNG tensors, NumPy's
    key words, the signature's characters."""
    batch, rng = bundle.load_step(index)
    entries = bundle.signature_log().steps[index]
    return (
        tensor_bytes(batch)
        + rng.cpu.nbytes
        + np.asarray(rng.numpy[1]).nbytes
        + sum(len(name) + len(digest) for name, digest in entries)
    )


def test_memory_is_bounded_over_200_steps_by_two_snapshots_and_2k_minus_1_steps(tmp_path):
    rec, workload, held = ring_loop(tmp_path / "ring.bundle", 199)
    assert not (tmp_path / "ring.bundle").exists()  # nothing written without a dump
    assert not list(tmp_path.iterdir())
    # Windows open at steps 0, 4, 8...: after step 198 they are 192-195 and 196-198.
    assert rec.ring_steps == list(range(192, 199))
    # Periodic once both windows start after step 0 (with Adam's state): it stops growing.
    assert held[3 * K :] == held[2 * K : len(held) - K]
    path = rec.dump("bound check")
    rec.close()
    bundle = Bundle.open(path)
    assert bundle.step_indices == list(range(192, 199))
    # A snapshot: parameters, buffers (once each), the optimizer's state tensors.
    model, optimizer = workload.model, workload.optimizer
    snapshot = (
        tensor_bytes(list(model.parameters()))
        + tensor_bytes(list(model.buffers()))
        + tensor_bytes(optimizer.state_dict()["state"])
    )
    steps = [step_bytes(bundle, index) for index in bundle.step_indices]
    assert held[-1] == max(held) == 2 * snapshot + sum(steps)
    assert max(held[:K]) < snapshot + K * steps[0]  # the first window: before Adam's state
    assert min(held[2 * K :]) == snapshot + K * steps[0]  # right after the old window is dropped


def test_dump_replays_bit_for_bit_and_says_why(tmp_path, cli):
    rec, _, _ = ring_loop(tmp_path / "run.bundle", 10, kwargs=SMALL)
    first = rec.dump("loss spike at step 9", source="UpdateDetector")
    second = rec.dump("asked again")
    rec.close()
    assert (first, second) == (tmp_path / "run.bundle", tmp_path / "run-2.bundle")
    assert rec.dumps == [first, second]
    info = cli("info", first, "--json")
    assert info.exit_code == 0, info.stderr
    about = json.loads(info.stdout)
    assert about["trigger"] == {
        "reason": "loss spike at step 9",
        "source": "UpdateDetector",
        "step": 9,
        "ring": K,
    }
    assert [step["index"] for step in about["steps"]] == [4, 5, 6, 7, 8, 9]
    assert about["complete"] and about["trusted"]
    assert about["verification"]["status"] == "passed"  # step 4 re-executed from the snapshot
    shown = cli("info", first).stderr
    assert "written because" in shown and "loss spike at step 9" in shown
    assert "UpdateDetector" in shown
    replayed = cli("replay", first, "--json")
    assert replayed.exit_code == 0, replayed.stderr
    assert json.loads(replayed.stdout)["consensus"]["verdict"] == "correct"
    assert Bundle.open(second).manifest.trigger.reason == "asked again"


def test_a_dump_before_k_steps_holds_every_step(tmp_path):
    rec, _, _ = ring_loop(tmp_path / "early.bundle", 2, kwargs=SMALL)
    path = rec.dump("early")
    rec.close()
    bundle = Bundle.open(path)
    assert bundle.step_indices == [0, 1]
    assert bundle.manifest.trigger.to_json() == {
        "reason": "early",
        "source": "user",
        "step": 1,
        "ring": K,
    }
    assert sdcreplay.compare_logs(
        bundle.signature_log(), sdcreplay.replay_on_device(bundle, "cpu")
    ).identical


def test_dump_refuses_without_a_ring_or_a_completed_step(tmp_path):
    workload = build_workload("builtin:tiny-llama", dict(SMALL, seed=0))
    plain = Recorder(
        tmp_path / "plain.bundle",
        "builtin:tiny-llama",
        workload.model,
        workload.optimizer,
        workload_kwargs=dict(SMALL, seed=0),
    )
    with pytest.raises(SdcReplayError, match="needs a ring buffer"):
        plain.dump("no ring")
    plain.abandon()
    ring = Recorder(
        tmp_path / "ring.bundle",
        "builtin:tiny-llama",
        workload.model,
        workload.optimizer,
        ring=2,
    )
    with pytest.warns(DumpFailedWarning, match="no completed step yet"):
        assert ring.dump("too early") is None  # an alarm at the first step: the loop goes on
    failed = tmp_path / "ring.bundle.dump-failed.txt"
    assert ring.dumps == []
    assert "(user: too early) failed: SdcReplayError: the ring holds no completed step" in (
        failed.read_text()
    )
    ring.close()
    with pytest.raises(SdcReplayError, match="not a number of steps"):
        Recorder(
            tmp_path / "x.bundle", "builtin:tiny-llama", workload.model, workload.optimizer, ring=0
        )


def test_planted_fault_inside_the_window_is_localized_by_bisect(tmp_path, cli):
    """`record --ring` on a defective device: the bundle written at the end holds the faulty step
    7, replay disagrees there, and bisect names the operator, element and bit."""
    out = tmp_path / "ring.bundle"
    recorded = cli(
        "record", "builtin:tiny-llama", *SMALL_ARGS, "--steps", "10", "--out", out,
        "--ring", str(K), "--dump-on", "end", "--inject", PLANTED, "--json",
    )  # fmt: skip
    assert recorded.exit_code == 0, recorded.stderr
    summary = json.loads(recorded.stdout)
    assert summary["bundle"] == str(out)
    assert summary["ring"]["size"] == K
    assert summary["ring"]["dumps"] == [
        {
            "bundle": str(out),
            "trigger": {"reason": "the run ended", "source": "record", "step": 9, "ring": K},
        }
    ]
    assert Bundle.open(out).step_indices == [4, 5, 6, 7, 8, 9]
    replayed = cli("replay", out, "--json")
    assert replayed.exit_code == 1, replayed.stderr
    first = json.loads(replayed.stdout)["devices"][0]["first_divergence"]
    assert (first["step"], first["name"]) == (7, "forward:layers.0.attn.wq")
    bisected = cli(
        "bisect", out, "--suspect", "cpu:1", "--reference", "cpu:0", "--step", "7",
        "--inject", PLANTED + ",device=cpu:1", "--out", tmp_path / "report", "--json",
    )  # fmt: skip
    assert bisected.exit_code == 1, bisected.stderr
    report = json.loads(bisected.stdout)
    assert (report["step"], report["module"], report["op"]) == (
        7,
        "layers.0.attn.wq",
        "aten.mm.default",
    )
    assert report["elements"]["indices"] == [5]
    assert report["bits"]["histogram"] == {"13": 1}


def test_record_ring_without_an_alarm_writes_nothing_and_says_so(tmp_path, cli):
    out = tmp_path / "quiet.bundle"
    recorded = cli(
        "record", "builtin:tiny-llama", *SMALL_ARGS, "--steps", "6", "--out", out,
        "--ring", "3", "--json",
    )  # fmt: skip
    assert recorded.exit_code == 0, recorded.stderr
    assert "no alarm: nothing written" in recorded.stderr  # the UpdateDetector watched
    summary = json.loads(recorded.stdout)
    assert (summary["bundle"], summary["steps"], summary["size_bytes"]) == (None, 6, 0)
    assert summary["ring"]["dumps"] == [] and summary["ring"]["stopped"] is None
    assert not list(tmp_path.iterdir())


def test_record_ring_with_a_detector_writes_the_alarm_bundle(tmp_path, cli):
    """--inject plants a NaN in step 5's first execution only: the UpdateDetector alarms, its
    recompute is clean (transient) and the run goes on; the bundle ends with the alarmed step."""
    out = tmp_path / "alarm.bundle"
    spec = "kind=nan,op=aten.mm,module=layers.0.mlp.w1,phase=forward,step=5,nth=0,index=5"
    recorded = cli(
        "record", "builtin:tiny-llama", *SMALL_ARGS, "--steps", "8", "--out", out,
        "--ring", str(K), "--dump-on", "update", "--inject", spec, "--json",
    )  # fmt: skip
    assert recorded.exit_code == 1, recorded.stderr  # an alarm is a finding
    summary = json.loads(recorded.stdout)
    assert (summary["bundle"], summary["steps"]) == (str(out), 8)
    (dump,) = summary["ring"]["dumps"]
    trigger = dump["trigger"]
    assert (trigger["source"], trigger["step"], trigger["ring"]) == ("UpdateDetector", 5, K)
    assert trigger["reason"].startswith("UpdateDetector: step 5 nonfinite:loss")
    assert trigger["reason"].endswith("(transient)")
    assert Bundle.open(out).step_indices == [0, 1, 2, 3, 4, 5]
    replayed = cli("replay", out, "--json")
    assert replayed.exit_code == 1, replayed.stderr
    first = json.loads(replayed.stdout)["devices"][0]["first_divergence"]
    assert (first["step"], first["name"]) == (5, "forward:layers.0.mlp.w1")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--dump-on", "end"], "--dump-on needs --ring"),
        (["--ring", "2", "--dump-on", "update", "--dump-on", "replay"], "together"),
        (
            ["--ring", "2", "--inject", "kind=memflip,param=output.weight,step=1,index=0,bit=3"],
            "memflip",
        ),
    ],
)
def test_record_refuses_dump_on_combinations_that_cannot_work(tmp_path, cli, options, message):
    out = tmp_path / "refused.bundle"
    result = cli("record", "builtin:tiny-llama", *SMALL_ARGS, "--out", out, *options)
    assert result.exit_code == 3, result.stderr
    assert message in result.stderr and "Hint:" in result.stderr
    assert not out.exists()


def test_a_step_stopped_before_the_optimizer_keeps_the_ring_one_that_changed_state_clears_it(
    tmp_path,
):
    rec, workload, _ = ring_loop(tmp_path / "stopped.bundle", 6, kwargs=SMALL)
    batch = workload.get_batch(6)
    with pytest.raises(RuntimeError), rec.step(batch):
        workload.loss(batch).backward()
        raise RuntimeError("a detector stopped the step before the optimizer")
    workload.optimizer.zero_grad()  # as a detector leaves it: no gradient carried in
    with rec.step(batch):  # the same step again, under the same index
        workload.run_step(batch)
    assert rec.ring_steps == list(range(7))  # windows 0-3 and 4-6
    bundle = Bundle.open(rec.dump("after a stopped step"))
    assert sdcreplay.compare_logs(
        bundle.signature_log(), sdcreplay.replay_on_device(bundle, "cpu")
    ).identical
    batch = workload.get_batch(7)
    with pytest.raises(RuntimeError), rec.step(batch):
        workload.run_step(batch)  # the optimizer stepped: the state moved on
        raise RuntimeError("failed after the optimizer step")
    with rec.step(batch):
        workload.run_step(batch)
    assert rec.ring_steps == [7]  # nothing before it leads to the state it began from
    rec.close()


def test_rewind_takes_back_the_last_step_to_record_its_recompute(tmp_path):
    rec, workload, _ = ring_loop(tmp_path / "rewind.bundle", 5, kwargs=SMALL)
    before = TrainingSnapshot.take(workload.model, workload.optimizer, workload.state)
    batch = workload.get_batch(5)
    with rec.step(batch):
        workload.run_step(batch)
    alarmed = Bundle.open(rec.dump("alarm at step 5"))
    before.restore()  # the detector rolls back ...
    rec.rewind()  # ... and the ring forgets the step it rolled back
    assert rec.ring_steps == [0, 1, 2, 3, 4]
    with rec.step(batch):  # the recompute, recorded as step 5
        workload.run_step(batch)
    recomputed = Bundle.open(rec.dump("after the recompute"))
    rec.close()
    assert alarmed.step_indices == recomputed.step_indices == list(range(6))
    assert alarmed.signature_log().steps == recomputed.signature_log().steps  # same device
    with pytest.raises(SdcReplayError, match="no completed step"):
        fresh = Recorder(
            tmp_path / "fresh.bundle", "builtin:tiny-llama", workload.model, workload.optimizer,
            ring=2,
        )  # fmt: skip
        fresh.rewind()


def test_a_ring_under_torch_distributed_writes_nothing_until_its_dump_writes_a_job(tmp_path):
    """In a process group (one gloo rank here; tests/recording/test_ring_job.py runs two), the
    ring holds its steps and creates no job until dump(), which writes a job bundle with the
    rank's part and refuses to run inside a step's block (the ranks' verification needs
    collectives)."""
    import torch.distributed as dist

    from sdcreplay.bundle.job_bundle import JobBundle

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        rec, workload, _ = ring_loop(tmp_path / "r.bundle", 5)
        assert sorted(path.name for path in tmp_path.iterdir()) == ["store"]
        batch = workload.get_batch(5)
        with rec.step(batch):
            workload.run_step(batch)
            with pytest.raises(SdcReplayError, match="inside a step's block") as refused:
                rec.dump("inside")
        assert "after the step's block ended" in refused.value.hint
        path = rec.dump("alarm", source="test")
        rec.close()
    finally:
        dist.destroy_process_group()
    assert path == tmp_path / "r.bundle" and rec.dumps == [path]
    job = JobBundle.open(path)
    assert job.complete and job.world_size == 1
    part = job.rank(0)
    assert part.verified and part.step_indices == [0, 1, 2, 3, 4, 5]
    assert (part.manifest.trigger.reason, part.manifest.trigger.step) == ("alarm", 5)
    assert part.manifest.distributed.ddp_iterations_before is None  # no DDP


def test_a_dump_from_inside_a_step_leaves_that_step_out_and_untouched(tmp_path):
    rec, workload, _ = ring_loop(tmp_path / "inside.bundle", 5, kwargs=SMALL)
    batch = workload.get_batch(5)
    with rec.step(batch):
        workload.run_step(batch)
        inside = Bundle.open(rec.dump("alarm raised inside step 5"))  # re-executes step 0 too
    after = Bundle.open(rec.dump("after the step"))
    rec.close()
    assert inside.step_indices == [0, 1, 2, 3, 4]  # step 5 was still open
    assert inside.manifest.trigger.step == 4 and inside.verification.status == "passed"
    assert after.step_indices == [0, 1, 2, 3, 4, 5]
    # Step 5's signature holds the loop's step only, not the verification's backward.
    assert sdcreplay.compare_logs(
        after.signature_log(), sdcreplay.replay_on_device(after, "cpu")
    ).identical


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update(step=-1), "trigger.step is -1"),
        (lambda t: t.pop("reason"), "trigger.reason is missing"),
        (lambda t: t.update(ring=0), "trigger.ring is 0"),
        (lambda t: t.update(source=7), "trigger.source is 7"),
    ],
)
def test_a_malformed_trigger_is_refused_by_name(small_bundle, edit, message):
    from conftest import rewrite_manifest

    from sdcreplay.errors import BundleError

    trigger = {"reason": "why", "source": "user", "step": 2, "ring": 4}
    rewrite_manifest(small_bundle, lambda manifest: manifest.update(trigger=trigger))
    assert Bundle.open(small_bundle).manifest.trigger.to_json() == trigger  # well formed
    rewrite_manifest(small_bundle, lambda manifest: edit(manifest["trigger"]))
    with pytest.raises(BundleError, match=message):
        Bundle.open(small_bundle)


# A bit of the fused projection's output in the last step, on the recording device itself.
FUSED_DRILL = "kind=bitflip,op=aten.mm,module=1.attention.wqkv,phase=forward,step=3,index=5,bit=20"


@pytest.mark.parametrize("drill", [False, True])
def test_a_state_dict_hook_that_builds_tensors_is_dumped_as_it_returns_them(tmp_path, drill):
    """TorchTitan's fused ``wqkv``, split into ``wq``/``wk``/``wv`` by a state_dict hook
    (tests/loops/trainers.py): the ring keeps the state as ``state_dict()`` returned it as its
    window began, the dump replays ``correct`` on two replicas, and a fault planted on the
    recording device is ``recording_suspect``."""
    rec, step = trainers.recorder(
        tmp_path / "r.bundle", "fused", ring=2, inject=[FUSED_DRILL] if drill else []
    )
    trainers.train(rec, step, range(2))
    entering = {name: t.clone() for name, t in rec.model.state_dict().items()}  # step 2's
    trainers.train(rec, step, range(2, 4))
    path = rec.dump("alarm")
    rec.close()
    bundle = Bundle.open(path)
    assert path == tmp_path / "r.bundle" and bundle.step_indices == [2, 3] and bundle.verified
    model_state, _ = bundle.load_state()
    assert list(model_state) == list(entering)
    assert "1.attention.wq.weight" in model_state and "1.attention.wqkv.weight" not in model_state
    assert all(torch.equal(model_state[name], entering[name]) for name in entering)
    logs = {label: [sdcreplay.replay_on_device(bundle, label)] for label in ("cpu:0", "cpu:1")}
    consensus = sdcreplay.vote(bundle.signature_log(), logs)
    assert consensus.verdict == ("recording_suspect" if drill else "correct")
    assert consensus.suspects == (["record"] if drill else [])


def test_a_dump_that_fails_warns_writes_why_beside_and_training_goes_on(tmp_path, monkeypatch):
    """Neither a failure while the dump writes its bundle nor one while the ring copies the
    state reaches the loop: each is warned about; a failed dump is written beside the
    bundle's name (nothing at it), a failed copy lets the held steps go on from the last one,
    and the next dump, once it can, is the bundle."""
    rec, step = trainers.recorder(tmp_path / "r.bundle", "fused", ring=2, verify=False)
    trainers.train(rec, step, range(2))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(BundleWriter, "add_step", full)
    with pytest.warns(DumpFailedWarning, match="No space left on device"):
        assert rec.dump("loss spike") is None
    failed = tmp_path / "r.bundle.dump-failed.txt"
    assert rec.dumps == []
    said = failed.read_text()
    assert said.splitlines()[0].endswith(
        "dump before step 2 (user: loss spike) failed: OSError: [Errno 28] No space left on device"
    )
    assert "in full" in said  # the traceback, down to where it failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.bundle.dump-failed.txt"]
    monkeypatch.undo()

    def broken(*args, **kwargs):
        raise RuntimeError("a state_dict hook broke")

    monkeypatch.setattr(RingSnapshot, "copy", broken)
    with pytest.warns(DumpFailedWarning, match="could not copy the state as step 2 began"):
        trainers.train(rec, step, range(2, 4))  # the window wanted a copy at each
    assert rec.ring_steps == [0, 1, 2, 3]  # on from the last copy, before step 0
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spike = rec.dump("loss spike again")
        trainers.train(rec, step, range(4, 6))  # training went on; copies work again
        path = rec.dump("once it can")
    rec.close()
    assert (spike, path) == (tmp_path / "r.bundle", tmp_path / "r-2.bundle") == tuple(rec.dumps)
    assert Bundle.open(spike).step_indices == [0, 1, 2, 3]
    assert Bundle.open(path).step_indices == [4, 5]

    # No copy at all yet (the first step's failed): the alarm's dump says why, and its rewind
    # takes the step back all the same.
    monkeypatch.setattr(RingSnapshot, "copy", broken)
    first, step = trainers.recorder(tmp_path / "first.bundle", "fused", ring=2, verify=False)
    with pytest.warns(DumpFailedWarning, match="could not copy the state as step 0 began"):
        trainers.train(first, step, range(1))
    with pytest.warns(DumpFailedWarning, match="its copy of the state failed: RuntimeError"):
        assert first.dump("alarm at step 0") is None
    nothing = tmp_path / "first.bundle.dump-failed.txt"
    first.rewind()
    assert (first.ring_steps, first.steps_written) == ([], 0)
    first.close()
    assert (
        nothing.read_text()
        .splitlines()[0]
        .endswith(
            "failed: SdcReplayError: the ring holds no completed step yet: there is nothing to "
            "write (its copy of the state failed: RuntimeError: a state_dict hook broke)"
        )
    )
