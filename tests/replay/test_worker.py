"""Replay on several devices through real worker processes, with injected faults as ground truth.

Every device label is its own process (forked from the forkserver, see
processes.py), and the first costs seconds to start (torch import), so the
scenarios share few ``replay_devices`` calls:

* one call replays a two-layer tiny-llama bundle on two healthy replicas and
  seven faulty ones, each with one fault kind. Each kind is then judged as
  "three replicas, the fault on one of them" by voting the record, the two
  healthy replicas and that faulty replica (the logs are the workers' own);
* tiny-moe with a fault in the expert scatter (``index_add_``);
* a bundle recorded *with* a fault, replayed through the CLI (``--json``);
* a device whose process is killed by SIGKILL next to an intermittent one
  (``p=0.3``, ten repeats) and two healthy ones;
* the process layer itself: a task names only a marked function of sdcreplay,
  its typed task and result, its environment, and a task run by hand.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import preserved_global_state

from sdcreplay import Bundle, ReplaySession, record, replay_devices, replay_on_device
from sdcreplay.capture.digest import tensor_digest
from sdcreplay.capture.faults import FaultSpec, Injector, corrupt
from sdcreplay.capture.operators import CallSite
from sdcreplay.capture.signature import read_signature_log
from sdcreplay.compare.logs import compare_logs, vote
from sdcreplay.replay import worker
from sdcreplay.replay.processes import run_device_processes
from sdcreplay.replay.session import run_replay_task
from sdcreplay.replay.worker import (
    DeviceFailure,
    DeviceResult,
    DeviceTask,
    TaskError,
    given_forms,
)

LLAMA = {"layers": 2, "dim": 32, "heads": 2, "seq_len": 8, "batch_size": 2, "vocab": 64}
MOE = {**LLAMA, "layers": 1, "experts": 2, "top_k": 1}
HEALTHY = ["cpu:0", "cpu:1"]

# label -> (fault on that label alone, the first divergent entry at step 1 that it must produce)
KINDS = {
    "cpu:2": (
        "kind=bitflip,op=aten.mm,module=layers.1.attn.wq,phase=forward,step=1,index=101",
        "forward:layers.1.attn.wq",
    ),
    "cpu:3": (
        "kind=bitflip,op=aten.mm,module=layers.0.mlp.w2,phase=backward,step=1,nth=1",
        "backward:layers.0.mlp.w2",
    ),
    "cpu:4": (
        "kind=pairflip,op=aten.mm,module=layers.0.attn.wk,phase=forward,step=1,index=35,count=64",
        "forward:layers.0.attn.wk",
    ),
    "cpu:5": (
        "kind=swap,op=aten.mm,module=layers.1.mlp.w3,phase=forward,step=1,index=66,count=1",
        "forward:layers.1.mlp.w3",
    ),
    "cpu:6": (
        "kind=bias,op=aten.mm,module=layers.0.attn.wo,phase=forward,step=1,index=64,count=8,scale=1e-4",
        "forward:layers.0.attn.wo",
    ),
    "cpu:7": (
        "kind=nan,op=aten.mm,module=layers.1.mlp.w1,phase=forward,step=1,index=97",
        "forward:layers.1.mlp.w1",
    ),
    "cpu:8": (
        "kind=memflip,param=layers.0.mlp.w3.weight,step=1,index=40,bit=20",
        "forward:layers.0.mlp.w3",
    ),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("worker")


@pytest.fixture(scope="module")
def llama(root) -> Path:
    with preserved_global_state():
        record("builtin:tiny-llama", root / "llama.bundle", steps=2, kwargs=dict(LLAMA))
    return root / "llama.bundle"


@pytest.fixture(scope="module")
def kinds(llama, root):
    """One replay: two healthy replicas and one replica per fault kind."""
    specs = [f"{spec},device={label}" for label, (spec, _) in KINDS.items()]
    return replay_devices(llama, HEALTHY + list(KINDS), inject=specs, log_dir=root / "kinds")


@pytest.fixture(scope="module")
def llama_record(llama):
    return _record_of(llama)


def three_replicas(report, record_log, faulty: str):
    """The vote of the record, the two healthy replicas and one faulty replica."""
    runs = {run.device: run.logs for run in report.devices}
    return vote(record_log, {label: runs[label] for label in (*HEALTHY, faulty)})


def _record_of(bundle: Path):
    return Bundle.open(bundle).signature_log()


# ---------------------------------------------------------------------------
# Each fault kind on one of three replicas


@pytest.mark.slow
@pytest.mark.parametrize(
    "label",
    list(KINDS),
    ids=[
        spec.split(",")[0].removeprefix("kind=") + "-" + label for label, (spec, _) in KINDS.items()
    ],
)
def test_each_kind_names_the_odd_device_step_and_layer(kinds, llama_record, label):
    _, entry = KINDS[label]
    consensus = three_replicas(kinds, llama_record, label)
    assert consensus.verdict == "persistent"
    assert consensus.suspects == [label]
    assert (consensus.first_divergence.step, consensus.first_divergence.name) == (1, entry)
    judged = consensus.voters[label]
    assert (judged.verdict, judged.runs, judged.divergent_runs) == ("persistent", 1, 1)
    assert all(consensus.voters[voter].verdict == "match" for voter in ("record", *HEALTHY))
    # and in the report of the nine-device replay itself
    run = next(run for run in kinds.devices if run.device == label)
    assert run.error is None
    assert run.verdict == "persistent"
    assert run.to_json()["first_divergence"] == {
        "step": 1,
        "phase": entry.split(":")[0],
        "name": entry,
    }
    assert run.to_json()["steps"]["0"] == 0


@pytest.mark.slow
def test_the_many_faulty_replay_report(kinds, root):
    """Seven of nine replicas faulty in different ways: the three that agree outvote seven that each
    differ."""
    assert kinds.consensus.verdict == "persistent"
    assert kinds.consensus.undecided_entries == 0
    assert kinds.consensus.suspects == list(KINDS)
    assert [run.verdict for run in kinds.devices] == ["match", "match"] + ["persistent"] * len(
        KINDS
    )
    assert kinds.exit_code == 1
    assert Path(kinds.log_dir) == root / "kinds"
    for run in kinds.devices:
        assert run.log_paths == [str(root / "kinds" / f"{run.device.replace(':', '-')}.r0.sig.zst")]
        assert Path(run.log_paths[0]).is_file()
        assert (root / "kinds" / f"replay-{run.device.replace(':', '-')}.stderr.txt").is_file()


@pytest.mark.slow
def test_two_replicas_that_disagree_with_the_record_are_undecided(kinds, llama_record):
    """cpu:4 goes wrong first, where the record and cpu:2 still agree: it is named. Downstream all
    three differ, so whether cpu:2 or the record is right at cpu:2's fault is a tie only another
    device decides."""
    runs = {run.device: run.logs for run in kinds.devices}
    consensus = vote(llama_record, {"cpu:2": runs["cpu:2"], "cpu:4": runs["cpu:4"]})
    assert consensus.verdict == "undecided"
    assert consensus.undecided_entries > 0
    assert consensus.suspects == ["cpu:4"]
    assert {voter: v.verdict for voter, v in consensus.voters.items()} == {
        "record": "undecided",
        "cpu:2": "undecided",
        "cpu:4": "persistent",
    }
    assert consensus.advice.startswith("record, cpu:2 are tied at ")


def _clean_outputs(bundle: Path, specs: list[str]) -> dict[str, torch.Tensor]:
    """The output each spec's call produced in a clean in-process replay (before any fault)."""
    parsed = {text: FaultSpec.parse(text) for text in specs}
    seen: dict[str, torch.Tensor] = {}

    class Keep:
        def on_call(self, site: CallSite, func, args, kwargs, out):
            for text, spec in parsed.items():
                if text not in seen and site.step == spec.step and spec.matches_key(*site.key):
                    seen[text] = out.detach().clone()
            return out

    session = ReplaySession(bundle, "cpu")
    try:
        for step in session.steps_until(1):
            session.run_step(step, observers=[Keep()])
    finally:
        session.close()
    return seen


@pytest.mark.slow
def test_pairflip_and_swap_would_be_missed_by_hash_tensor(kinds, llama):
    """The same corruption of the same output: torch.hash_tensor cannot see it, the digest does."""
    specs = [KINDS["cpu:4"][0], KINDS["cpu:5"][0]]
    for text, clean in _clean_outputs(llama, specs).items():
        corrupted = clean.clone()
        assert corrupt(FaultSpec.parse(text), corrupted) is not None
        assert not torch.equal(corrupted, clean)
        assert torch.hash_tensor(corrupted) == torch.hash_tensor(clean)
        assert tensor_digest(corrupted) != tensor_digest(clean)
    assert {run.device: run.verdict for run in kinds.devices}.get("cpu:4") == "persistent"
    assert {run.device: run.verdict for run in kinds.devices}.get("cpu:5") == "persistent"


def test_a_fault_the_network_masks_shows_only_at_its_own_entry(llama, llama_record):
    """Query position 0 attends only to itself: a flip there changes q and nothing downstream in
    forward.

    Its softmax row is exactly [1, 0, ...] whatever q is, so forward masks it on
    every machine. Backward is not asserted: the attention backward recomputes
    that row from a saved log-sum-exp and subtracts two dot products that are
    equal only up to the BLAS's summation order, which differs by CPU (MKL
    picks its kernels per CPU model), so whether the flip leaks there is a
    property of the machine, not of the network.
    """
    log = replay_on_device(
        llama,
        "cpu:9",
        inject=["kind=bitflip,op=aten.mm,module=layers.1.attn.wq,phase=forward,step=1,index=5"],
    )
    comparison = compare_logs(llama_record, log)
    assert comparison.first.brief() == {
        "step": 1,
        "phase": "forward",
        "name": "forward:layers.1.attn.wq",
    }
    forward = [(d.step, d.name) for d in comparison.divergences if d.phase == "forward"]
    assert forward == [(1, "forward:layers.1.attn.wq")]


def test_a_weight_gradient_fault_is_named_by_its_grad_entry(llama, llama_record):
    """In a Linear's backward the weight-gradient matmul runs first (nth=0), the input gradient
    second."""
    log = replay_on_device(
        llama,
        "cpu:9",
        inject=["kind=bitflip,op=aten.mm,module=layers.0.mlp.w2,phase=backward,step=1,nth=0"],
    )
    first = compare_logs(llama_record, log).first
    assert (first.step, first.name) == (1, "grad:layers.0.mlp.w2.weight")


# ---------------------------------------------------------------------------
# tiny-moe: the expert scatter


@pytest.mark.slow
def test_moe_expert_scatter_fault(root):
    bundle = root / "moe.bundle"
    with preserved_global_state():
        record("builtin:tiny-moe", bundle, steps=2, kwargs=dict(MOE))
    spec = (
        "kind=bitflip,op=aten.index_add_,module=layers.0.moe,phase=forward,step=1,nth=1,index=40,"
        "device=cpu:1"
    )
    report = replay_devices(
        bundle, ["cpu:0", "cpu:1", "cpu:2"], inject=[spec], log_dir=root / "moe"
    )
    assert report.consensus.verdict == "persistent"
    assert report.consensus.suspects == ["cpu:1"]
    assert report.consensus.first_divergence.brief() == {
        "step": 1,
        "phase": "forward",
        "name": "forward:layers.0.moe",
    }
    assert [run.verdict for run in report.devices] == ["match", "persistent", "match"]
    assert report.to_json()["consensus"]["first_divergence"] == {
        "step": 1,
        "phase": "forward",
        "name": "forward:layers.0.moe",
    }


# ---------------------------------------------------------------------------
# A fault at record time: the recording device is the suspect (through the CLI)

RECORD_FAULT = "kind=bitflip,op=aten.mm,module=layers.1.attn.wq,phase=forward,step=1,index=101"


@pytest.mark.slow
def test_fault_at_record_time_is_recording_suspect(root, cli):
    bundle = root / "recorded-bad.bundle"
    with preserved_global_state():
        record("builtin:tiny-llama", bundle, steps=2, kwargs=dict(LLAMA), inject=[RECORD_FAULT])
    # A drill, marked as one (its records never move a device's state); the verdict below is
    # still the evidence's: replay never reads the mark to judge.
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["injected_faults"] == [RECORD_FAULT]

    logs = root / "recorded-bad-logs"
    result = cli(
        "replay", bundle, "-d", "cpu:0", "-d", "cpu:1", "-d", "cpu:2", "--logs", logs, "--json"
    )
    assert result.exit_code == 1, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == "sdcreplay.replay/1"
    assert data["record"]["verdict"] == "persistent"
    assert data["record"]["identity"]["label"] == "cpu"  # the recording device, named
    assert data["consensus"]["verdict"] == "recording_suspect"
    assert data["consensus"]["suspects"] == ["record"]
    assert data["consensus"]["first_divergence"] == {
        "step": 1,
        "phase": "forward",
        "name": "forward:layers.1.attn.wq",
    }
    assert [
        (d["device"], d["verdict"], d["repeats"], d["divergent_repeats"], d["error"])
        for d in data["devices"]
    ] == [
        ("cpu:0", "match", 1, 0, None),
        ("cpu:1", "match", 1, 0, None),
        ("cpu:2", "match", 1, 0, None),
    ]
    assert data["log_dir"] == str(logs)
    assert all(Path(d["logs"][0]).parent == logs for d in data["devices"])
    assert "Verdict: recording_suspect" in result.stderr


# ---------------------------------------------------------------------------
# A process killed by a signal, next to an intermittent device

KILLER = '''
import os
import signal

from sdcreplay.workloads import tiny_llama


def make(**kwargs):
    """tiny-llama, except that the process replaying as cpu:1 dies in its first step."""
    workload = tiny_llama.make_workload(**kwargs)
    inner = workload.loss_fn

    def loss_fn(model, batch):
        if os.environ.get("SDCREPLAY_DEVICE") == "cpu:1":
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(model, batch)

    workload.loss_fn = loss_fn
    return workload
'''

FLAKY = (
    "kind=bitflip,op=aten.mm,module=layers.1.attn.wq,phase=forward,step=0,index=101,p=0.3,seed=7,"
    "device=cpu:3"
)
REPEATS = 10


def _expected_fires(spec: str, label: str, repeats: int) -> list[int]:
    """Repeats in which the intermittent fault fires (the injector is salted with the repeat)."""
    fired = []
    for repeat in range(repeats):
        injector = Injector([FaultSpec.parse(spec)], label, salt=repeat)
        injector.on_call(
            CallSite(0, "forward", "layers.1.attn.wq", "aten.mm.default", 0),
            None,
            (),
            {},
            torch.zeros(200),
        )
        if injector.fired:
            fired.append(repeat)
    return fired


@pytest.mark.slow
def test_killed_process_is_an_error_for_its_device_alone_and_p_is_intermittent(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("SDCREPLAY_DEVICE", raising=False)  # the workload must not kill this process
    workload = tmp_path / "killer.py"
    workload.write_text(textwrap.dedent(KILLER))
    bundle = tmp_path / "killer.bundle"
    with preserved_global_state():
        record(f"{workload}:make", bundle, steps=1, kwargs=dict(LLAMA))

    report = replay_devices(
        bundle,
        ["cpu:0", "cpu:1", "cpu:2", "cpu:3"],
        repeats=REPEATS,
        inject=[FLAKY],
        log_dir=tmp_path / "logs",
    )
    runs = {run.device: run for run in report.devices}

    killed = runs["cpu:1"]
    assert killed.verdict == "error"
    assert killed.error["message"] == "the cpu:1 process killed by signal SIGKILL"
    assert killed.error["exit_status"] == -signal.SIGKILL
    assert killed.error["hint"].startswith(
        "Killed from outside (out of memory, or a person/scheduler): retry alone"
    )
    assert killed.logs == [] and killed.to_json()["error"]["message"].endswith("SIGKILL")

    assert runs["cpu:0"].verdict == runs["cpu:2"].verdict == "match"
    assert len(runs["cpu:0"].logs) == len(runs["cpu:2"].logs) == REPEATS

    expected = _expected_fires(FLAKY, "cpu:3", REPEATS)
    assert 0 < len(expected) < REPEATS / 2  # seed 7 fires in a minority of the repeats
    flaky = runs["cpu:3"].to_json()
    assert (flaky["verdict"], flaky["repeats"], flaky["divergent_repeats"]) == (
        "intermittent",
        REPEATS,
        len(expected),
    )
    assert flaky["first_divergence"] == {
        "step": 0,
        "phase": "forward",
        "name": "forward:layers.1.attn.wq",
    }
    record_log = _record_of(bundle)
    diverged = [
        r for r, log in enumerate(runs["cpu:3"].logs) if not compare_logs(record_log, log).identical
    ]
    assert diverged == expected

    assert report.consensus.verdict == "transient"
    assert report.consensus.suspects == ["cpu:3"]
    assert report.exit_code == 1
    assert json.loads(json.dumps(report.to_json()))["devices"][1]["verdict"] == "error"


def test_repeats_are_salted_differently():
    assert _expected_fires(FLAKY, "cpu:3", REPEATS) != _expected_fires(
        FLAKY.replace("seed=7", "seed=8"), "cpu:3", REPEATS
    )
    assert _expected_fires(FLAKY, "cpu:0", REPEATS) == []  # another device's fault


def test_a_bad_fault_spec_is_refused_before_any_process_starts(llama, tmp_path):
    from sdcreplay.errors import FaultSpecError

    with pytest.raises(FaultSpecError, match="phase 'sideways' is not one of"):
        replay_devices(
            llama,
            ["cpu:0"],
            inject=["kind=bitflip,op=aten.mm,phase=sideways"],
            log_dir=tmp_path / "logs",
        )
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------
# The process layer: tasks name their function, typed task and result

EVIL = """
from pathlib import Path
Path({marker!r}).write_text("ran")
"""


def _run_task(tmp_path: Path, function: str, **arguments) -> tuple[int, dict]:
    """A hand-made task through worker.main, in this process: its exit status and result file."""
    task = DeviceTask(function, "cpu:0", str(tmp_path / "result.json"), arguments)
    (tmp_path / "task.json").write_text(json.dumps(task.to_json()))
    status = worker.main(["worker", str(tmp_path / "task.json")])
    return status, json.loads((tmp_path / "result.json").read_text())


def test_a_task_runs_only_a_function_sdcreplay_marked_as_a_device_task(tmp_path: Path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL.format(marker=str(marker)))
    status, result = _run_task(tmp_path, "os:system", command=f"touch {marker}")
    assert status == 3
    assert result["error"]["message"] == "task function 'os:system' is not one of sdcreplay's"
    # sdcreplay's own, but not a task: it would build (import) any workload, trusted or not
    status, result = _run_task(
        tmp_path, "sdcreplay.workload.definition:build_workload", ref=f"{evil}:make"
    )
    assert status == 3
    assert (
        result["error"]["message"]
        == "sdcreplay.workload.definition:build_workload is not a device task"
    )
    assert not marker.exists()
    status, result = _run_task(
        tmp_path, "sdcreplay.replay.session:run_replay_task", bundle="b", speed=2
    )
    assert status == 3
    assert result["error"]["message"].startswith(
        "sdcreplay.replay.session:run_replay_task does not take the task's arguments: "
    )
    with pytest.raises(TaskError, match="is not a device task"):
        run_device_processes("x", os.getcwd, ["cpu:0"], lambda _: {}, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_tasks_and_results_are_typed_json():
    task = DeviceTask(
        "sdcreplay.replay.session:run_replay_task",
        "cpu:1",
        "/r.json",
        {"repeats": 2},
        {"MKL_CBWR": "AVX2"},
        stderr="/e.txt",
        alive="/a",
    )
    assert DeviceTask.from_json(json.loads(json.dumps(task.to_json()))) == task
    error = DeviceFailure(
        "the cpu:1 process timed out", "give it more time", None, "/e.txt", "last", 3.0
    )
    for result in (DeviceResult(value={"logs": ["x"]}), DeviceResult(error=error)):
        assert DeviceResult.from_json(json.loads(json.dumps(result.to_json()))) == result
    assert DeviceResult(error=error).to_json()["error"] == {
        "message": "the cpu:1 process timed out",
        "hint": "give it more time",
        "exit_status": None,
        "log": "/e.txt",
        "stderr_tail": "last",
        "timed_out": 3.0,
        "kind": None,
    }
    with pytest.raises(TaskError, match="the device task has no 'function'"):
        DeviceTask.from_json({"device": "cpu", "result": "/r"})
    with pytest.raises(TaskError, match="the device task's 'arguments' is list"):
        DeviceTask.from_json({**task.to_json(), "arguments": []})
    with pytest.raises(TaskError, match=r"unknown fields \['kind'\]"):
        DeviceTask.from_json({**task.to_json(), "kind": "replay"})
    with pytest.raises(TaskError, match="'environment' holds a value that is not a string"):
        DeviceTask.from_json({**task.to_json(), "environment": {"MKL_CBWR": 1}})
    for written in (
        {},
        {"value": [1]},
        {"error": {"hint": "no message"}},
        [],
        {"error": {"message": "m", "signal": 9}},
    ):
        with pytest.raises(ValueError):
            DeviceResult.from_json(written)
    with pytest.raises(ValueError, match="not both or neither"):
        DeviceResult(value={}, error=error)


def test_a_task_runs_with_its_environment_in_force(small_bundle: Path, tmp_path: Path):
    """The environment is set before the task's first operator: ATen's kernel choice follows it."""
    results = run_device_processes(
        "replay",
        run_replay_task,
        ["cpu:0"],
        lambda label: {"bundle": str(small_bundle), "repeats": 1, "log_dir": str(tmp_path)},
        tmp_path,
        environment={"ATEN_CPU_CAPABILITY": "default"},
    )
    value = results["cpu:0"].value
    assert results["cpu:0"].error is None and value is not None
    assert value["fingerprint"]["cpu.capability"] == "DEFAULT"
    assert sorted(read_signature_log(Path(value["logs"][0])).steps) == [0, 1]
    written = json.loads((tmp_path / "replay-cpu-0.task.json").read_text())
    assert written["function"] == "sdcreplay.replay.session:run_replay_task"
    assert written["environment"] == {"ATEN_CPU_CAPABILITY": "default"}


def test_device_processes_start_under_a_temp_dir_too_deep_for_a_socket(
    small_bundle: Path, tmp_path: Path, run_exe
):
    """A batch scheduler's per-job TMPDIR can be longer than an AF_UNIX address allows under
    multiprocessing's socket names: the forkserver's sockets go elsewhere, the run goes on."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    done = run_exe("replay", small_bundle, "-d", "cpu:0", "--json", env={"TMPDIR": str(deep)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["consensus"]["verdict"] == "correct"


@pytest.mark.slow
def test_a_task_file_runs_by_hand(small_bundle: Path, tmp_path: Path):
    """``python -m sdcreplay.replay.worker TASK.json``: the task's function is found from
    __main__ too."""
    task = DeviceTask(
        "sdcreplay.replay.session:run_replay_task",
        "cpu:0",
        str(tmp_path / "result.json"),
        {"bundle": str(small_bundle), "repeats": 1, "log_dir": str(tmp_path)},
    )
    (tmp_path / "task.json").write_text(json.dumps(task.to_json()))
    command = [sys.executable, "-m", "sdcreplay.replay.worker"]
    done = subprocess.run(
        [*command, str(tmp_path / "task.json")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    value = json.loads((tmp_path / "result.json").read_text())["value"]
    assert value["logs"] == [str(tmp_path / "cpu-0.r0.sig.zst")]
    (tmp_path / "bad.json").write_text(json.dumps({"device": "cpu:0"}))
    done = subprocess.run(
        [*command, str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 3
    assert "Error: the device task has no 'function'" in done.stderr and "Hint:" in done.stderr
    assert "Traceback" not in done.stderr


INTERRUPTED_WORKLOAD = '''
"""tiny-llama whose step raises KeyboardInterrupt on the virtual replica cpu:1."""
import os

from sdcreplay import Workload
from sdcreplay.workload.tiny_llama import make_workload


def make(seed: int = 0) -> Workload:
    base = make_workload(seed=seed, **KWARGS)

    def loss_fn(model, batch):
        if os.environ.get("SDCREPLAY_DEVICE") == "cpu:1":
            raise KeyboardInterrupt
        return base.loss_fn(model, batch)

    return Workload(base.model, base.optimizer, base.get_batch, loss_fn)
'''


def test_a_workloads_keyboard_interrupt_is_an_interruption_of_its_device(tmp_path):
    """A KeyboardInterrupt inside a device process (the workload's own, or a ^C that reached
    only it) is said as an interruption with where it was, not "exited with status 1"."""
    from conftest import SMALL

    source = tmp_path / "interrupted.py"
    source.write_text(textwrap.dedent(INTERRUPTED_WORKLOAD).replace("KWARGS", repr(SMALL)))
    bundle = tmp_path / "interrupted.bundle"
    record(f"{source}:make", bundle, steps=1, seed=0)
    report = replay_devices(bundle, ["cpu:0", "cpu:1"], log_dir=tmp_path / "logs", ledger=False)
    by_device = {run.device: run for run in report.devices}
    assert by_device["cpu:0"].error is None
    error = by_device["cpu:1"].error
    assert error is not None and error["kind"] == "interrupted", error
    assert error["message"].startswith("the cpu:1 process was interrupted (SIGINT) at "), error
    assert error["exit_status"] == 130


def _raised(function) -> BaseException:
    try:
        function()
    except Exception as exc:  # noqa: BLE001 - the exception is what is judged
        return exc
    raise AssertionError("it did not raise")


def test_a_failure_is_the_tools_where_sdcreplays_own_code_raised_it(tmp_path: Path):
    """The innermost frame that is neither PyTorch nor the standard library decides: a torch
    call made by sdcreplay's code that fails is the tool's, one made by the workload's code the
    workload's."""
    user = tmp_path / "user_model.py"
    user.write_text(
        "import torch\ndef forward():\n    return torch.mm(torch.ones(2, 3), torch.ones(2, 3))\n"
    )
    spec = importlib.util.spec_from_file_location("user_model", user)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert worker.tool_frame(_raised(module.forward)) is None
    from sdcreplay.capture import memory

    frame = worker.tool_frame(_raised(lambda: memory.storage_position(None, 0)))
    assert frame is not None and frame.startswith("sdcreplay/capture/memory.py:")
    assert frame.endswith("(storage_layout)")  # the innermost of its frames
    from sdcreplay.workload.tiny_llama import Attention

    assert worker.tool_frame(_raised(lambda: Attention(5, 2, 4))) is None  # a built-in workload


def test_an_exception_in_sdcreplays_code_in_a_device_process_is_an_internal_error(
    small_bundle: Path, tmp_path: Path
):
    """Planted by SDCREPLAY_TEST_INTERNAL_ERROR as the device task starts: never "the workload
    failed", never a damaged bundle; the frame in sdcreplay and where to report it."""
    results = run_device_processes(
        "replay",
        run_replay_task,
        ["cpu:0"],
        lambda label: {"bundle": str(small_bundle), "repeats": 1, "log_dir": str(tmp_path)},
        tmp_path,
        environment={worker.PLANTED_FAILURE_VAR: "sdcreplay.replay.session:run_replay_task"},
    )
    error = results["cpu:0"].error
    assert error is not None and error.kind == "InternalError"
    assert error.message.startswith("internal error in sdcreplay at ")
    assert "sdcreplay/replay/worker.py:" in error.message and "(_call)" in error.message
    assert "workload" not in error.message and "damaged" not in error.hint
    assert "bug in sdcreplay" in error.hint and "`sdcreplay doctor`" in error.hint
    assert "replay-cpu-0" in error.hint  # the device's log file, with the traceback


def test_a_task_holds_absolute_paths_and_its_result_comes_back_as_typed(tmp_path, monkeypatch):
    """A device process moves to a script's recorded directory before it reads the bundle or
    writes its result: every path of its task is resolved where the command runs; what it
    returns names those paths as the command gave them."""
    monkeypatch.chdir(tmp_path)
    arguments = {"bundle": Path("b.bundle"), "nested": {"logs": [Path("../logs")]}, "ref": "x.py"}
    task = DeviceTask("m:f", "cpu:0", "r.json", arguments, stderr="e.txt", alive="a")
    assert (task.result, task.stderr, task.alive) == tuple(
        str(tmp_path / name) for name in ("r.json", "e.txt", "a")
    )
    assert task.arguments == {
        "bundle": str(tmp_path / "b.bundle"),
        "nested": {"logs": [str(tmp_path.parent / "logs")]},
        "ref": "x.py",  # a string is not a path: only what is given as one is resolved
    }
    assert DeviceTask.from_json(json.loads(json.dumps(task.to_json()))) == task
    returned = DeviceResult(
        value={"logs": [str(tmp_path.parent / "logs" / "cpu-0.sig")], "bundle": "/elsewhere"}
    )
    assert returned.in_given_form(given_forms(arguments)).value == {
        "logs": [os.path.join("..", "logs", "cpu-0.sig")],
        "bundle": "/elsewhere",
    }
