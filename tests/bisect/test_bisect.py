"""Bisect: from a divergent step to the operator call, the elements and the bits.

Fault injection is the ground truth: each test injects a known corruption on
the suspect ``cpu:1`` and asserts that bisect names exactly the call where it
fired (the injector records the call's index independently, in an in-process
replay) and exactly the elements and bits it flipped.

Every bisect starts 1-6 worker processes (forked from the forkserver, see
worker.py), so each run happens once per module (``runs``) and several tests
read its report; ``--step`` is given wherever the test is not about finding
the step.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import sdcreplay
from sdcreplay.bisect.divergent_step import _first_divergence
from sdcreplay.bisect.localize import _sequence_hint, bisect
from sdcreplay.bisect.operator_case import OPERATOR_FILE, OperatorCase, place, resolve_op
from sdcreplay.bisect.report import REPORT_FILE, BisectResult
from sdcreplay.bisect.tasks import _check_reproduced, run_oplog_task
from sdcreplay.capture import determinism
from sdcreplay.capture.operators import OperatorLog, OperatorMode
from sdcreplay.compare.forensics import element_forensics
from sdcreplay.errors import SdcReplayError

LLAMA = {"layers": 2, "dim": 32, "heads": 2, "seq_len": 8, "batch_size": 2, "vocab": 64}
MOE = {**LLAMA, "experts": 2, "top_k": 1}
STEPS = 3

# One fault per place in the step; all fire in step 1 on cpu:1 only.
FORWARD = (
    "kind=bitflip,op=aten.mm,module=layers.1.attn.wq,phase=forward,step=1,index=5,bit=13,"
    "device=cpu:1"
)
BACKWARD = (
    "kind=pairflip,op=aten.mm,module=layers.0.mlp.w2,phase=backward,step=1,nth=0,index=9,bit=17,"
    "device=cpu:1"
)
OPTIMIZER = (
    "kind=bitflip,op=aten.addcdiv_,module=layers.1.attn.wk.weight,phase=optimizer,step=1,index=40,"
    "bit=3,device=cpu:1"
)
MOE_SCATTER = (
    "kind=bitflip,op=aten.index_add_,module=layers.0.moe,phase=forward,step=1,nth=1,index=6,bit=21,"
    "device=cpu:1"
)
MOE_GATHER = (
    "kind=bitflip,op=aten.index_select,module=layers.1.moe,phase=forward,step=1,nth=0,index=3,bit=11,"
    "device=cpu:1"
)
MEMFLIP = "kind=memflip,param=layers.0.mlp.w1.weight,step=1,index=7,bit=20,device=cpu:1"
# seed=13: the draw of repeat 0 misses (p=0.2), a later repeat's hits.
INTERMITTENT = (
    "kind=bitflip,op=aten.mm,module=layers.1.mlp.w3,phase=forward,step=1,nth=0,index=2,bit=19,"
    "p=0.2,seed=13,device=cpu:1"
)
# Memory corrupted at rest (a fault on a view corrupts the memory it aliases): the gradient of
# layers.0.mlp.w2.weight after the backward mm made it, and RMSNorm's rsqrt before the mul reads it.
AT_REST_BACKWARD = (
    "kind=bitflip,op=aten.detach,module=layers.0.mlp.w2,phase=backward,step=1,"
    "nth=0,index=3,bit=30,device=cpu:1"
)
AT_REST_FORWARD = (
    "kind=bitflip,op=aten.detach.default,module=layers.1.ffn_norm,phase=forward,"
    "step=1,nth=0,index=5,bit=31,device=cpu:1"
)
RECORDED = "kind=bitflip,op=aten.mm,module=layers.1.attn.wq,phase=forward,step=1,index=5"

JSON_KEYS = {
    "schema",
    "verdict",
    "step",
    "phase",
    "module",
    "op",
    "op_index",
    "kernels",
    "isolated",
    "elements",
    "bits",
    "pattern",
    "suspect",
    "reference",
    "repeats_run",
    "report",
}


def _has_plot() -> bool:
    return importlib.util.find_spec("sdcreplay.compare.plot") is not None


# ---------------------------------------------------------------------------
# Bundles (one of each per module) and the bisect runs of this module.


@pytest.fixture(scope="module")
def llama_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama") / "llama.bundle"
    sdcreplay.record("builtin:tiny-llama", out, steps=STEPS, seed=0, kwargs=dict(LLAMA))
    return out


@pytest.fixture(scope="module")
def moe_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "moe.bundle"
    sdcreplay.record("builtin:tiny-moe", out, steps=STEPS, seed=0, kwargs=dict(MOE))
    return out


@pytest.fixture(scope="module")
def faulty_bundle(tmp_path_factory) -> Path:
    """Recorded on a 'defective' device: the fault fired during the recording itself."""
    out = tmp_path_factory.mktemp("faulty") / "faulty.bundle"
    sdcreplay.record(
        "builtin:tiny-llama", out, steps=STEPS, seed=0, kwargs=dict(LLAMA), inject=[RECORDED]
    )
    return out


STRUCTURAL_WORKLOAD = '''
"""tiny-llama whose step runs other operators on some device labels."""
import os

import torch

from sdcreplay import Workload
from sdcreplay.workload.tiny_llama import make_workload


class AdamWThenTouch(torch.optim.AdamW):
    """AdamW; its zero_grad (the step's last call) runs one more operator, except on cpu:2."""

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        if os.environ.get("SDCREPLAY_DEVICE") != "cpu:2":
            with torch.no_grad():
                self.param_groups[0]["params"][0].mul_(1.0)


def make(seed: int = 0) -> Workload:
    base = make_workload(seed=seed, **KWARGS)

    def loss_fn(model, batch):
        loss = base.loss_fn(model, batch)
        if os.environ.get("SDCREPLAY_DEVICE") == "cpu:1":
            loss = loss * 1.0  # one more operator on cpu:1: a different program, same values
        return loss

    optimizer = AdamWThenTouch(base.model.parameters(), lr=1e-3)

    def train_step(batch):
        loss_fn(base.model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    return Workload(base.model, optimizer, base.get_batch, loss_fn, train_step=train_step)
'''


@pytest.fixture(scope="module")
def structural_bundle(tmp_path_factory, monkeypatch_module) -> Path:
    folder = tmp_path_factory.mktemp("structural")
    source = folder / "per_device.py"
    source.write_text(textwrap.dedent(STRUCTURAL_WORKLOAD).replace("KWARGS", repr(LLAMA)))
    monkeypatch_module.delenv("SDCREPLAY_DEVICE", raising=False)
    out = folder / "per_device.bundle"
    sdcreplay.record(f"{source}:make", out, steps=2, seed=0)
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


# name -> (bundle fixture, bisect keyword arguments); every fault in step 1.
RUNS: dict[str, tuple[str, dict]] = {
    "backward": ("llama_bundle", {"suspect": "cpu:1", "step": 1, "inject": [BACKWARD]}),
    # No --step: the run also finds the step (a replay on both devices first).
    "optimizer": ("llama_bundle", {"suspect": "cpu:1", "inject": [OPTIMIZER]}),
    "moe_scatter": ("moe_bundle", {"suspect": "cpu:1", "step": 1, "inject": [MOE_SCATTER]}),
    "moe_gather": ("moe_bundle", {"suspect": "cpu:1", "step": 1, "inject": [MOE_GATHER]}),
    "memflip": ("llama_bundle", {"suspect": "cpu:1", "step": 1, "inject": [MEMFLIP]}),
    "intermittent": (
        "llama_bundle",
        {"suspect": "cpu:1", "step": 1, "repeats": 20, "inject": [INTERMITTENT]},
    ),
    # No --step: the report's phase must agree with the first divergent signature entry.
    "at_rest_backward": ("llama_bundle", {"suspect": "cpu:1", "inject": [AT_REST_BACKWARD]}),
    "at_rest_forward": (
        "llama_bundle",
        {"suspect": "cpu:1", "step": 1, "inject": [AT_REST_FORWARD]},
    ),
    "clean": ("llama_bundle", {"suspect": "cpu:1"}),
    "clean_recording_at_step": ("llama_bundle", {"step": 1}),
    "faulty_record_clean_suspect": ("faulty_bundle", {"suspect": "cpu:1"}),
}


class Runs:
    """The module's bisect runs, each made the first time a test asks for it."""

    def __init__(self, bundles: dict[str, Path], reports: Path):
        self.bundles, self.reports = bundles, reports
        self.done: dict[str, BisectResult | Exception] = {}

    def get(self, name: str) -> BisectResult:
        if name not in self.done:
            bundle, kwargs = RUNS[name]
            try:
                self.done[name] = bisect(self.bundles[bundle], out=self.reports / name, **kwargs)
            except Exception as exc:  # every test that reads the run sees it fail
                self.done[name] = exc
        if isinstance(self.done[name], Exception):
            raise self.done[name]
        return self.done[name]


@pytest.fixture(scope="module")
def runs(llama_bundle, moe_bundle, faulty_bundle, tmp_path_factory) -> Runs:
    bundles = {
        "llama_bundle": llama_bundle,
        "moe_bundle": moe_bundle,
        "faulty_bundle": faulty_bundle,
    }
    return Runs(bundles, tmp_path_factory.mktemp("reports"))


def injected(bundle: Path, spec: str, repeat: int = 0) -> list[dict]:
    """Where ``spec`` fires in an in-process replay of steps 0-1 on cpu:1 (the injector's own
    record)."""
    log = sdcreplay.replay_on_device(bundle, "cpu:1", inject=[spec], last_step=1, repeat=repeat)
    return log.meta["injected"]


def only_fired(bundle: Path, spec: str) -> dict:
    return only_fired_at(bundle, spec, 0)


def only_fired_at(bundle: Path, spec: str, repeat: int) -> dict:
    fired = injected(bundle, spec, repeat)
    assert len(fired) == 1, fired
    return fired[0]


# ---------------------------------------------------------------------------
# Command-line runs.


@pytest.fixture(scope="module")
def forward_cli(llama_bundle, tmp_path_factory) -> dict:
    """``sdcreplay bisect --json`` on a forward bitflip (and --plot when plot.py is there)."""
    from typer.testing import CliRunner

    from sdcreplay.cli import app

    out = tmp_path_factory.mktemp("forward") / "report"
    args = [
        "bisect",
        str(llama_bundle),
        "--suspect",
        "cpu:1",
        "--reference",
        "cpu:0",
        "--step",
        "1",
        "--inject",
        FORWARD,
        "--out",
        str(out),
        "--json",
    ]
    plot = out.parent / "heatmap.png"
    if _has_plot():
        args += ["--plot", str(plot)]
    result = CliRunner().invoke(app, args)
    return {"result": result, "out": out, "plot": plot}


def test_forward_bitflip_names_the_call_elements_and_bit(forward_cli, llama_bundle):
    result = forward_cli["result"]
    assert result.exit_code == 1, result.stderr
    phases = re.findall(r"^(\w+): .* \(\d+\.\d s\)$", result.stderr, re.M)  # one line per phase
    assert phases == ["oplog", "oplog", "fetch", "isolate", "done"], result.stderr
    report = json.loads(result.stdout)
    fired = only_fired(llama_bundle, FORWARD)
    assert (report["verdict"], report["step"], report["phase"], report["module"], report["op"]) == (
        "divergence",
        1,
        "forward",
        "layers.1.attn.wq",
        "aten.mm.default",
    )
    assert report["op_index"] == fired["op_index"]
    assert report["isolated"] == "kernel"
    assert report["isolation"] == {"runs": 3, "failures": 3, "first_failure": 0}
    assert report["kernels"] == []  # a CPU names no kernels
    assert report["elements"]["indices"] == fired["elements"] == [5]
    assert report["elements"]["count"] == 1
    assert report["elements"]["xor"] == [f"{1 << 13:08x}"]
    assert report["bits"]["histogram"] == {"13": 1}
    assert report["pattern"] == "single element"
    assert report["state"] == []
    assert report["inputs_match_reference"] is True
    assert "operator" in result.stderr and "layers.1.attn.wq" in result.stderr  # the human summary


def test_json_has_the_contract_keys_and_equals_report_json(forward_cli):
    report = json.loads(forward_cli["result"].stdout)
    assert JSON_KEYS <= report.keys()
    assert report["schema"] == "sdcreplay.bisect/1"
    assert {"count", "indices", "max_abs_diff"} <= report["elements"].keys()
    assert "histogram" in report["bits"]
    assert (report["suspect"], report["reference"], report["repeats_run"]) == ("cpu:1", "cpu:0", 1)
    assert report["report"] == str(forward_cli["out"])
    assert json.loads((forward_cli["out"] / REPORT_FILE).read_text()) == report


def test_operator_file_reproduces_the_reference_output(forward_cli):
    case = OperatorCase.read(forward_cli["out"] / OPERATOR_FILE)
    assert (case.site.step, case.site.phase, case.site.module, case.op) == (
        1,
        "forward",
        "layers.1.attn.wq",
        "aten.mm.default",
    )
    op = resolve_op(case.op)
    args, kwargs = place((list(case.args), case.kwargs), torch.device("cpu"))
    out = op(*args, **kwargs)
    (expected,), (actual,) = case.expected, case.actual
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    xor = (expected.view(torch.int32) ^ actual.view(torch.int32)).flatten()
    assert torch.nonzero(xor).flatten().tolist() == [5]
    assert int(xor[5]) == 1 << 13
    assert case.suspect_args is not None and all(
        torch.equal(a, b) for a, b in zip(case.args, case.suspect_args)
    )


def test_plot_heatmap_is_written(forward_cli):
    if not _has_plot():
        pytest.skip(
            "sdcreplay/plot.py is not in this tree yet (another change adds it); "
            "--plot was not passed"
        )
    result = forward_cli["result"]
    assert result.exit_code == 1, result.stderr
    plot = forward_cli["plot"]
    assert plot.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(result.stdout)["plot"] == str(plot)
    assert f"Plot: {plot}" in result.stderr  # where the PNG went


OPERATOR_CASES = {
    # case: (bundle fixture, spec, (phase, module, op), pattern, bits flipped per element)
    "backward": (
        "llama_bundle",
        BACKWARD,
        ("backward", "layers.0.mlp.w2", "aten.mm.default"),
        "two elements, same bit",
    ),
    "optimizer": (
        "llama_bundle",
        OPTIMIZER,
        ("optimizer", "layers.1.attn.wk.weight", "aten.addcdiv_.default"),
        "single element",
    ),
    "moe_scatter": (
        "moe_bundle",
        MOE_SCATTER,
        ("forward", "layers.0.moe", "aten.index_add_.default"),
        "single element",
    ),
    "moe_gather": (
        "moe_bundle",
        MOE_GATHER,
        ("forward", "layers.1.moe", "aten.index_select.default"),
        "single element",
    ),
}


@pytest.mark.parametrize("case", list(OPERATOR_CASES))
def test_fault_on_a_named_call_is_named_exactly(case, runs, request):
    bundle_fixture, spec, (phase, module, op), pattern = OPERATOR_CASES[case]
    bundle = request.getfixturevalue(bundle_fixture)
    fired = only_fired(bundle, spec)
    report = runs.get(case).to_json()
    assert report["verdict"] == "divergence"
    assert (report["step"], report["phase"], report["module"], report["op"]) == (
        1,
        phase,
        module,
        op,
    )
    assert (fired["phase"], fired["module"], fired["op"]) == (phase, module, op)
    assert report["op_index"] == fired["op_index"]
    assert report["isolated"] == "kernel"
    assert report["isolation"]["failures"] == report["isolation"]["runs"] == 3
    assert report["elements"]["indices"] == fired["elements"]
    assert report["elements"]["count"] == len(fired["elements"])
    assert report["bits"]["histogram"] == {str(fired["bit"]): len(fired["elements"])}
    assert report["pattern"] == pattern
    assert report["state"] == []
    assert runs.get(case).exit_code == 1
    assert (Path(report["report"]) / OPERATOR_FILE).is_file()


def test_pairflip_in_backward_reports_both_elements_and_the_bit(runs, llama_bundle):
    report = runs.get("backward").to_json()
    assert report["elements"]["indices"] == [9, 10]
    assert report["bits"]["histogram"] == {"17": 2}
    assert report["elements"]["xor"] == [f"{1 << 17:08x}"] * 2
    assert report["pattern"] == "two elements, same bit"


def test_without_step_the_first_divergent_step_is_found(runs):
    report = runs.get("optimizer").to_json()
    assert report["step"] == 1
    assert report["first_entry"] == {
        "step": 1,
        "phase": "optimizer",
        "name": "param:layers.1.attn.wk.weight",
    }
    assert report["replay"]["consensus"]["suspects"] == ["cpu:1"]


def test_memflip_is_state_entering_the_step_and_upstream(runs, llama_bundle):
    # The first call that reads the weight: the first mm under layers.0.mlp.w1 in the forward
    # (its transpose is a view and computes nothing); a marker fault finds its index.
    reader = only_fired(
        llama_bundle, "kind=bitflip,op=aten.mm,module=layers.0.mlp.w1,phase=forward,step=1,nth=0"
    )
    report = runs.get("memflip").to_json()
    assert report["verdict"] == "divergence" and report["step"] == 1
    [state] = report["state"]
    assert state["tensor"] == "param:layers.0.mlp.w1.weight"
    assert (state["count"], state["indices"], state["bits"]["histogram"]) == (1, [7], {"20": 1})
    assert state["pattern"] == "single element"
    assert (report["phase"], report["module"], report["op"]) == (
        "forward",
        "layers.0.mlp.w1",
        "aten.mm.default",
    )
    assert report["op_index"] == reader["op_index"]
    assert report["isolated"] == "upstream"
    assert report["isolation"]["failures"] == 0
    assert report["inputs_match_reference"] is False
    upstream = report["upstream"]  # entered the step wrong: the state's evidence, not "at rest"
    assert (upstream["at_rest"], upstream["producer"]) == (False, None)
    assert upstream["state"] == "param:layers.0.mlp.w1.weight"
    assert (upstream["input"]["name"], upstream["elements"]["count"]) == ("mat2", 1)


@pytest.mark.parametrize(
    "case, producer_spec, producer, reader, first_input, element_bit",
    [
        (
            "at_rest_backward",
            "kind=bitflip,op=aten.mm,module=layers.0.mlp.w2,phase=backward,step=1,nth=0",
            ("aten.mm.default", "layers.0.mlp.w2", "backward"),
            ("aten.lerp_.Scalar", "layers.0.mlp.w2.weight", "optimizer"),
            (1, "end"),
            (3, 30),
        ),
        (
            "at_rest_forward",
            "kind=bitflip,op=aten.rsqrt,module=layers.1.ffn_norm,phase=forward,step=1",
            ("aten.rsqrt.default", "layers.1.ffn_norm", "forward"),
            ("aten.mul.Tensor", "layers.1.ffn_norm", "forward"),
            (1, "other"),
            (5, 31),
        ),
    ],
)
def test_memory_corrupted_at_rest_names_the_producer_and_the_reader(
    case, producer_spec, producer, reader, first_input, element_bit, runs, llama_bundle
):
    made = only_fired(llama_bundle, producer_spec)  # where the producing call runs, by the injector
    fault = only_fired(llama_bundle, RUNS[case][1]["inject"][0])  # the view call that corrupted it
    report = runs.get(case).to_json()  # no replay process died: bisect raises if one does
    upstream = report["upstream"]
    assert report["isolated"] == "upstream" and upstream["at_rest"] is True
    assert upstream["producer"] == {
        "index": made["op_index"],
        "op": producer[0],
        "module": producer[1],
        "phase": producer[2],
        "matched_reference": True,
    }
    assert made["op_index"] < fault["op_index"] < report["op_index"]
    seen_reader = upstream["reader"]
    assert (seen_reader["op"], seen_reader["module"], seen_reader["phase"]) == reader
    assert upstream["reader"]["index"] == report["site"]["index"] == report["op_index"]
    assert (upstream["input"]["position"], upstream["input"]["name"]) == first_input
    # The report's phase and module are the producer's: where the corruption is first seen.
    assert (report["phase"], report["module"]) == (producer[2], producer[1])
    index, bit = element_bit
    changed = upstream["elements"]
    assert (changed["indices"], changed["xor"]) == ([index], [f"{1 << bit:08x}"])
    assert upstream["summary"].startswith("memory corrupted at rest: ")
    assert f"call {made['op_index']} ({producer[0]}" in upstream["summary"]


def test_at_rest_in_the_backward_agrees_with_the_first_divergent_entry(runs):
    report = runs.get("at_rest_backward").to_json()
    assert report["first_entry"] == {
        "step": 1,
        "phase": "backward",
        "name": "grad:layers.0.mlp.w2.weight",
    }
    assert report["phase"] == report["first_entry"]["phase"] == "backward"
    assert report["site"]["phase"] == "optimizer"  # the reader, kept in the JSON


def test_intermittent_fault_found_within_repeats(runs, llama_bundle):
    assert injected(llama_bundle, INTERMITTENT, repeat=0) == []  # the first repeat is clean
    first_hit = next(r for r in range(20) if injected(llama_bundle, INTERMITTENT, repeat=r))
    fired = only_fired_at(llama_bundle, INTERMITTENT, first_hit)
    report = runs.get("intermittent").to_json()
    assert report["verdict"] == "divergence"
    assert 1 < report["repeats_run"] <= 20
    assert report["repeats_run"] == first_hit + 1
    assert (report["phase"], report["module"], report["op"]) == (
        "forward",
        "layers.1.mlp.w3",
        "aten.mm.default",
    )
    assert report["op_index"] == fired["op_index"]
    assert report["elements"]["indices"] == [2] and report["bits"]["histogram"] == {"19": 1}
    # Alone, the call is re-run 20 times; a p=0.2 fault may or may not fire there.
    assert report["isolation"]["runs"] == 20
    assert report["inputs_match_reference"] is True
    assert report["isolated"] == ("kernel" if report["isolation"]["failures"] else "intermittent")


def test_clean_bundle_has_no_divergence(runs):
    result = runs.get("clean")
    report = result.to_json()
    assert (report["verdict"], report["step"], result.exit_code) == ("no_divergence", None, 0)
    assert json.loads((Path(report["report"]) / REPORT_FILE).read_text()) == json.loads(
        json.dumps(report, default=str)
    )


def test_clean_recording_with_step_and_no_suspect_has_no_divergence(runs):
    result = runs.get("clean_recording_at_step")
    assert (result.to_json()["verdict"], result.exit_code) == ("no_divergence", 0)


def test_no_suspect_names_the_first_divergent_entry_and_what_to_run_next(faulty_bundle, tmp_path):
    from typer.testing import CliRunner

    from sdcreplay.cli import app

    result = CliRunner().invoke(
        app,
        [
            "bisect",
            str(faulty_bundle),
            "--reference",
            "cpu:0",
            "--out",
            str(tmp_path / "report"),
            "--json",
        ],
    )
    assert result.exit_code == 1, result.stderr
    report = json.loads(result.stdout)
    assert (report["verdict"], report["suspect"], report["step"], report["phase"]) == (
        "divergence",
        "record",
        1,
        "forward",
    )
    assert (report["entry"], report["module"], report["op"]) == (
        "forward:layers.1.attn.wq",
        "layers.1.attn.wq",
        None,
    )
    assert "--suspect" in report["next"] and "cpu" in report["next"]
    assert "--suspect" in result.stderr


def test_structural_difference_stops_with_exit_3(structural_bundle, tmp_path):
    from typer.testing import CliRunner

    from sdcreplay.cli import app

    result = CliRunner().invoke(
        app,
        [
            "bisect",
            str(structural_bundle),
            "--suspect",
            "cpu:1",
            "--step",
            "0",
            "--out",
            str(tmp_path / "report"),
        ],
    )
    assert result.exit_code == 3
    assert "Error:" in result.stderr and "Hint:" in result.stderr
    assert "different sequence of operators" in result.stderr
    assert "aten.mul.Tensor" in result.stderr  # the extra call is named
    # Both are this CPU with this torch: no kernel choice, the step's own path differs.
    assert "cpu:1 and cpu:0 are the same kind of device with the same torch" in result.stderr
    assert "the step takes another path from run to run" in result.stderr
    assert "Traceback" not in result.output + result.stderr


def test_suspect_running_fewer_operators_is_a_structural_difference(
    structural_bundle, tmp_path, monkeypatch
):
    """cpu:2 skips the step's last call: its calls are a strict prefix of the reference's.

    The two operator-level replays run here, in this process (the device
    label reaches the workload through SDCREPLAY_DEVICE, as in a worker).
    """
    task = {"bundle": str(structural_bundle), "step": 0, "inject": [], "work_dir": str(tmp_path)}
    monkeypatch.setenv("SDCREPLAY_DEVICE", "cpu:0")
    reference = run_oplog_task(**task, device="cpu:0")
    monkeypatch.setenv("SDCREPLAY_DEVICE", "cpu:2")
    suspect = run_oplog_task(**task, device="cpu:2", expected_log=reference["oplog"], repeats=1)
    made = reference["operators"] - 1
    assert suspect.pop("environment")["device"] == reference["environment"]["device"]
    assert suspect == {
        "structure_error": f"operator call {made}: nothing here, aten.mul_.Tensor under <outside> "
        "(forward) on the reference",
        "repeat": 0,
        "steps_run": 1,
    }


def test_suspect_that_reproduces_the_reference_points_at_the_recording(runs):
    result = runs.get("faulty_record_clean_suspect")
    report = result.to_json()
    assert (report["verdict"], report["step"], result.exit_code) == ("no_divergence", None, 0)
    assert report["record_first_entry"] == {
        "step": 1,
        "phase": "forward",
        "name": "forward:layers.1.attn.wq",
    }
    assert "the device that recorded (cpu on" in report["next"] and "--suspect" in report["next"]


@pytest.mark.slow
def test_bisect_from_a_plain_python_script(llama_bundle, tmp_path):
    """The library is callable from Python: a script calling bisect() at top level works."""
    script = tmp_path / "plain_script.py"
    script.write_text(
        textwrap.dedent(f"""
        from sdcreplay.bisect.localize import _sequence_hint, bisect

        print("script body ran")
        result = bisect(
            {str(llama_bundle)!r}, suspect="cpu:1", step=1, out={str(tmp_path / "report")!r}
        )
        print("verdict", result.to_json()["verdict"])
    """)
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("script body ran") == 1
    assert "verdict no_divergence" in done.stdout


def test_first_divergence_is_against_the_trusted_reference(faulty_bundle):
    """The recording and one replay have no majority; the reference is trusted, not outvoted."""
    trusted = sdcreplay.replay_on_device(faulty_bundle, "cpu:0")
    recording = sdcreplay.Bundle.open(faulty_bundle).signature_log()
    later = sdcreplay.replay_on_device(
        faulty_bundle, "cpu:1", inject=[OPTIMIZER]
    )  # step 1, optimizer
    earlier = sdcreplay.replay_on_device(
        faulty_bundle, "cpu:1", inject=[OPTIMIZER.replace("step=1", "step=0")]
    )
    assert _first_divergence(trusted, [trusted]) is None
    assert _first_divergence(trusted, [recording]).brief() == {
        "step": 1,
        "phase": "forward",
        "name": "forward:layers.1.attn.wq",
    }
    for logs in (
        [later, recording],
        [recording, later],
    ):  # earliest in execution order, whichever log
        assert _first_divergence(trusted, logs).name == "forward:layers.1.attn.wq"
    assert _first_divergence(trusted, [recording, later, earlier]).brief() == {
        "step": 0,
        "phase": "optimizer",
        "name": "param:layers.1.attn.wk.weight",
    }


# ---------------------------------------------------------------------------
# element_forensics: what the damage looks like.


def _flip(tensor: torch.Tensor, indices: list[int], bit: int) -> torch.Tensor:
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    flipped = tensor.clone()
    flat = flipped.view(words).view(-1)
    mask = torch.tensor(1, dtype=torch.int64).bitwise_left_shift(bit).to(words)
    for index in indices:
        flat[index] ^= mask
    return flipped


def test_forensics_single_element():
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    actual = _flip(expected, [5], 22)  # 5.0 -> 7.0
    report = element_forensics(expected, actual)
    assert (report["count"], report["total"], report["indices"], report["positions"]) == (
        1,
        12,
        [5],
        [[1, 1]],
    )
    assert report["xor"] == ["00400000"]
    assert (report["expected"], report["actual"]) == ([5.0], [7.0])
    assert report["bits"] == {"width": 32, "histogram": {"22": 1}}
    assert report["max_abs_diff"] == 2.0 and report["max_rel_diff"] == 0.4
    assert (report["pattern"], report["dtype"], report["shape"]) == (
        "single element",
        "float32",
        [3, 4],
    )


def test_forensics_identical_tensors():
    tensor = torch.randn(4, 4)
    report = element_forensics(tensor, tensor.clone())
    assert (report["count"], report["indices"], report["pattern"], report["max_abs_diff"]) == (
        0,
        [],
        "none",
        0.0,
    )


def test_forensics_pair_with_the_same_bit():
    expected = torch.arange(1, 13, dtype=torch.float32).reshape(3, 4)
    report = element_forensics(expected, _flip(expected, [2, 9], 3))
    assert report["indices"] == [2, 9]
    assert report["bits"]["histogram"] == {"3": 2}
    assert report["pattern"] == "two elements, same bit"


def test_forensics_swap():
    expected = torch.arange(1, 13, dtype=torch.float32).reshape(3, 4)
    actual = expected.clone()
    actual[0, 1], actual[2, 3] = expected[2, 3], expected[0, 1]
    report = element_forensics(expected, actual)
    assert (report["count"], report["indices"], report["pattern"]) == (
        2,
        [1, 11],
        "two elements swapped",
    )
    assert (report["expected"], report["actual"]) == ([2.0, 12.0], [12.0, 2.0])


@pytest.mark.parametrize(
    ("shape", "region", "pattern"),
    [
        ((4, 8), (1, slice(2, 6)), "row segment"),
        ((4, 8), (slice(0, 4), 5), "column segment"),
        ((4, 8), (slice(1, 3), slice(2, 5)), "block 2x3"),
        ((4, 8), ([1, 1], [0, 6]), "scattered in one row"),
        ((4, 8), ([0, 3], [2, 2]), "scattered in one column"),
        ((4, 8), ([0, 1, 3], [1, 6, 2]), "scattered"),
        ((32,), slice(3, 32, 7), "strided (every 7 elements)"),
        ((4, 8), None, "strided (every 3 elements)"),
    ],
)
def test_forensics_pattern_shapes(shape, region, pattern):
    expected = torch.arange(1, 33, dtype=torch.float32).reshape(shape)
    actual = expected.clone()
    if region is None:
        actual.view(-1)[1:32:3] *= 3  # 1, 4, 7, ...: across rows, every 3 elements
    else:
        actual[region] = actual[region] * 3 + 1  # other bits in every element
    assert element_forensics(expected, actual)["pattern"] == pattern


def test_forensics_nan_is_compared_bitwise():
    expected = torch.tensor([1.0, float("nan"), 3.0])
    same = element_forensics(expected, expected.clone())
    assert same["count"] == 0  # the same NaN bits are no difference
    actual = expected.clone()
    actual[2] = float("nan")
    report = element_forensics(expected, actual)
    assert (report["count"], report["indices"], report["expected"], report["actual"]) == (
        1,
        [2],
        [3.0],
        ["nan"],
    )
    assert report["max_abs_diff"] == "nan"
    other_payload = _flip(expected, [1], 0)  # still a NaN, other bits
    assert torch.isnan(other_payload[1])
    assert element_forensics(expected, other_payload)["indices"] == [1]


def test_forensics_sign_bit_of_a_negative_float32():
    expected = torch.tensor([-1.5, 2.0])
    report = element_forensics(expected, _flip(expected, [0], 31))
    assert (report["xor"], report["bits"]["histogram"], report["actual"]) == (
        ["80000000"],
        {"31": 1},
        [1.5],
    )
    assert report["max_abs_diff"] == 3.0


def test_forensics_bfloat16():
    expected = torch.tensor([[1.0, -2.0], [3.0, 0.5]], dtype=torch.bfloat16)
    report = element_forensics(expected, _flip(expected, [1, 2], 15))
    assert (report["dtype"], report["bits"]["width"], report["xor"]) == (
        "bfloat16",
        16,
        ["8000", "8000"],
    )
    assert report["bits"]["histogram"] == {"15": 2}
    assert (report["expected"], report["actual"]) == ([-2.0, 3.0], [2.0, -3.0])
    report = element_forensics(expected, _flip(expected, [3], 6))
    assert (report["xor"], report["bits"]["histogram"], report["max_abs_diff"]) == (
        ["0040"],
        {"6": 1},
        0.25,
    )


@pytest.mark.parametrize(
    ("dtype", "bit", "xor"),
    [
        (torch.int64, 63, "8000000000000000"),
        (torch.int32, 31, "80000000"),
        (torch.int8, 7, "80"),
        (torch.uint8, 4, "10"),
    ],
)
def test_forensics_integer_dtypes(dtype, bit, xor):
    expected = torch.tensor([5, 6, 7, 8], dtype=dtype)
    report = element_forensics(expected, _flip(expected, [2], bit))
    assert (report["count"], report["indices"], report["xor"]) == (1, [2], [xor])
    assert report["bits"] == {"width": 8 * expected.element_size(), "histogram": {str(bit): 1}}
    assert report["expected"] == [7]
    assert isinstance(report["actual"][0], int)
    assert report["max_abs_diff"] == float(abs(report["actual"][0] - 7))
    assert "max_rel_diff" not in report


def test_forensics_max_abs_and_rel_diff():
    expected = torch.tensor([1.0, 2.0, 4.0, 8.0])
    actual = torch.tensor([1.0, 3.0, 4.5, 8.0])
    report = element_forensics(expected, actual)
    assert (report["indices"], report["max_abs_diff"], report["max_rel_diff"]) == ([1, 2], 1.0, 0.5)


def test_forensics_shows_the_first_elements_and_counts_all():
    expected = torch.zeros(100)
    actual = expected + 1
    report = element_forensics(expected, actual, shown=4)
    assert (report["count"], report["indices"], len(report["xor"]), report["pattern"]) == (
        100,
        [0, 1, 2, 3],
        4,
        "row segment",
    )


def test_forensics_shape_or_dtype_mismatch_is_a_note():
    report = element_forensics(torch.zeros(3), torch.zeros(4))
    assert report["count"] is None and "shape/dtype differ" in report["note"]


@pytest.mark.slow
def test_random_operator_alone_draws_the_numbers_it_drew_in_the_step(llama_bundle, tmp_path):
    """A fault in dropout's random mask (aten.bernoulli_): re-run alone with the step's generator
    state, the reference reproduces its recorded output bit for bit, so the suspect's failures are
    the fault's, not fresh random numbers."""
    from sdcreplay.minimize.driver import minimize

    spec = (
        "kind=bitflip,op=aten.bernoulli_,module=layers.0.attn_dropout,phase=forward,step=1,index=3,"
        "bit=20,device=cpu:1"
    )
    fired = only_fired(llama_bundle, spec)
    report = bisect(
        llama_bundle,
        suspect="cpu:1",
        reference="cpu:0",
        step=1,
        inject=[spec],
        out=tmp_path / "rep",
    )
    found = report.to_json()
    assert (found["op"], found["module"], found["op_index"]) == (
        "aten.bernoulli_.float",
        "layers.0.attn_dropout",
        fired["op_index"],
    )
    assert found["isolated"] == "kernel"
    assert found["elements"]["indices"] == [3]
    assert OperatorCase.read(tmp_path / "rep" / "operator.h5").rng is not None
    ticket = minimize(tmp_path / "rep", inject=[spec], trials=20, out=tmp_path / "ticket").to_json()
    assert ticket["reproduced"] and ticket["reference_failures"] == 0


def test_a_fault_on_a_view_the_backward_reads_never_kills_a_replay(tmp_path):
    """The campaign's crash: the bitflip bumped the version counter of rsqrt's output, which
    autograd saved, and killed cpu:1 ("output 0 of Rsqrt is at version 1"). Default size."""
    spec = (
        "kind=bitflip,op=aten.detach.default,module=layers.1.ffn_norm,phase=forward,step=1,"
        "nth=0,index=38,bit=31,device=cpu:1"
    )
    bundle = tmp_path / "default.bundle"
    sdcreplay.record("builtin:tiny-llama", bundle, steps=2, seed=0)
    report = sdcreplay.replay_devices(
        bundle, ["cpu:0", "cpu:1"], inject=[spec], log_dir=tmp_path / "logs"
    )
    runs = {run.device: run for run in report.devices}
    assert [run.error for run in report.devices] == [None, None]
    assert (runs["cpu:0"].verdict, runs["cpu:1"].verdict) == ("match", "persistent")
    [[fired]] = runs["cpu:1"].injected[0:1]
    assert (fired["op"], fired["module"], fired["elements"], fired["bit"]) == (
        "aten.detach.default",
        "layers.1.ffn_norm",
        [38],
        31,
    )
    first = runs["cpu:1"].judgement.first_divergence
    assert (first.step, first.name) == (1, "forward:layers.1.ffn_norm")


def test_a_step_started_from_the_saved_entry_state_matches_the_window(llama_bundle, tmp_path):
    """The reference replays steps 0-1, saves the state entering step 2, runs step 2 on from the
    window and again from the saved state (they must agree); a run loading it (no window) makes
    every operator call of step 2 bit for bit as the reference did."""
    task = {"bundle": str(llama_bundle), "step": 2, "inject": [], "work_dir": str(tmp_path)}
    entry = tmp_path / "entry.h5"
    reference = run_oplog_task(**task, device="cpu:0", save_entry=str(entry))
    assert reference["steps_run"] == 4 and entry.is_file()
    loaded = run_oplog_task(
        **task, device="cpu:1", entry_state=str(entry), expected_log=reference["oplog"], repeats=2
    )
    assert loaded == {"divergent": False, "repeats_run": 2, "steps_run": 2}


@pytest.mark.parametrize(
    "case, steps",
    [
        # --step 1 of 3: the reference replays step 0, runs step 1 on from it (the continuation the
        # saved state must reproduce) and again from the saved state; the suspect and fetch run 1
        # only
        (
            "backward",
            {"replay": 0, "oplog_reference": 3, "oplog_suspect": 1, "fetch": 1, "total": 5},
        ),
        # no --step: first both devices replay all 3 steps
        (
            "optimizer",
            {"replay": 6, "oplog_reference": 3, "oplog_suspect": 1, "fetch": 1, "total": 11},
        ),
    ],
)
def test_only_the_reference_replays_the_window(case, steps, runs):
    report = runs.get(case).to_json()
    assert report["steps_run"] == steps
    assert (Path(report["report"]) / "work" / "state-entering-step.h5").is_file()


class FakeKernelProfile:
    """A stand-in for torch.profiler on a CPU: the operators run under it become fake CUDA kernels.

    Each operator call yields a host-side event (dropped) and two device-side
    launches of the same kernel (named once), as the CUDA profiler reports them.
    """

    def __init__(self, device):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = []

        class Seen(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode = Seen()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self.mode.__exit__(*exc_info)

    def events(self):
        from types import SimpleNamespace

        def event(name, kind):
            return SimpleNamespace(name=name, device_type=SimpleNamespace(name=kind))

        return [
            e
            for op in self.ops
            for e in (
                event(op, "CPU"),
                event(f"sm90_gemm<{op}>", "CUDA"),
                event(f"sm90_gemm<{op}>", "CUDA"),
            )
        ]


def test_isolated_rerun_names_the_kernels_the_profiler_saw(forward_cli, llama_bundle, monkeypatch):
    from sdcreplay.bisect import kernels
    from sdcreplay.bisect.tasks import run_isolate_task

    monkeypatch.setattr(kernels, "KERNEL_PROFILERS", {"cpu": FakeKernelProfile})
    result = run_isolate_task(
        device="cpu:1",
        bundle=str(llama_bundle),
        case_file=str(forward_cli["out"] / OPERATOR_FILE),
        runs=1,
    )
    assert result["kernels"] == ["sm90_gemm<aten.mm.default>"]
    assert (result["runs"], result["failures"]) == (1, 0)  # no fault here: alone, the call is right


def test_device_kernels_reads_real_profiler_events_and_keeps_only_device_ones():
    """The event fields used (name, device_type.name) are torch's own: a real CPU profile has
    host events only, so no kernel is named."""
    from torch.profiler import ProfilerActivity, profile

    from sdcreplay.bisect.kernels import device_kernels

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(torch.ones(4, 4), torch.ones(4, 4))
    events = prof.events()
    assert "aten::mm" in [event.name for event in events]
    assert {event.device_type.name for event in events} == {"CPU"}
    assert device_kernels(events) == []


HIDDEN_STATE_WORKLOAD = '''
"""tiny-llama whose loss is scaled by how many steps it ran (COUNTER: per workload built, or per
process): state outside the model and the workload's state objects."""
import builtins
from sdcreplay import Workload
from sdcreplay.workload.tiny_llama import make_workload


def make(seed: int = 0) -> Workload:
    base = make_workload(seed=seed, **KWARGS)
    calls = COUNTER

    def loss_fn(model, batch):
        calls[0] += 1
        return base.loss_fn(model, batch) * calls[0]

    return Workload(base.model, base.optimizer, base.get_batch, loss_fn)
'''


def _hidden_state_bundle(tmp_path: Path, counter: str, verify: bool = True) -> Path:
    source = tmp_path / "hidden.py"
    code = textwrap.dedent(HIDDEN_STATE_WORKLOAD).replace("KWARGS", repr(LLAMA))
    source.write_text(code.replace("COUNTER", counter))
    bundle = tmp_path / "hidden.bundle"
    sdcreplay.record(f"{source}:make", bundle, steps=2, seed=0, verify=verify)
    return bundle


def test_a_step_the_saved_state_does_not_reproduce_is_bisected_from_the_windows_start(tmp_path):
    """The later runs start from the saved model and optimizer state; a step that also depends on
    something else (a counter each built workload starts at 0) does not reproduce from there, but
    from the window's start, as replay runs it: every later run starts there, said in the report
    in the workload's words."""
    bundle = _hidden_state_bundle(tmp_path, "[0]")
    report = bisect(bundle, suspect="cpu:1", step=1, out=tmp_path / "report", ledger=False)
    assert (report.verdict, report.step) == ("no_divergence", 1)
    assert report.findings["start"] == {
        "from": "window",
        "steps_before": 1,
        "reason": "its signature entry loss differs",
    }
    (warning,) = report.findings["warnings"]
    assert "give it to the workload as a state object (docs/recording.md)" in warning


def test_a_step_no_run_of_the_window_reproduces_is_refused(tmp_path, monkeypatch):
    """A counter that lives as long as the process (not reset when the workload is built again)
    makes every run of step 1 in the reference's process another step: neither the saved state
    nor the window's start reproduces it, and the reference says so (exit 3). The reference's
    task runs here, in this process (the recording, in this process too, is not checked: its
    first-step check would find step 0 another step already)."""
    counter = "builtins.__dict__.setdefault('sdcreplay_test_calls', [0])"
    bundle = _hidden_state_bundle(tmp_path, counter, verify=False)
    monkeypatch.setenv("SDCREPLAY_DEVICE", "cpu:0")
    with pytest.raises(SdcReplayError) as caught:
        run_oplog_task(
            device="cpu:0", bundle=str(bundle), step=1, work_dir=str(tmp_path),
            save_entry=str(tmp_path / "entry.h5"),
        )  # fmt: skip
    assert caught.value.message == (
        "the reference does not reproduce its own step 1 from the window's start: its signature "
        "entry forward:tok_embeddings differs (and from the state saved entering it, its "
        "signature entry loss differs)"
    )
    assert "outside the model, optimizer and the workload's state objects" in caught.value.hint


def test_two_kinds_of_device_running_other_operators_are_told_to_take_a_like_reference():
    cpu = determinism.environment(torch.device("cpu"))
    gpu = {**cpu, "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}}
    hint = _sequence_hint("cuda:0", "cpu:0", gpu, cpu)
    assert hint.startswith(f"cuda:0 (NVIDIA H100 80GB HBM3, torch {torch.__version__}) and cpu:0")
    assert "choose other kernels or decompositions" in hint
    assert "a reference of the suspect's model and software" in hint
    assert "same kind" in _sequence_hint("cpu:1", "cpu:0", cpu, cpu)


def test_a_reference_that_runs_other_operators_from_its_saved_state_names_the_call():
    """The reference's run from the saved state (fetch) is checked against its first run call
    for call: another operator is the step's own path changing, not the saved state."""
    oplog = OperatorLog()
    with OperatorMode(torch.nn.Linear(2, 2), None, [oplog], step=1):
        torch.ones(3).add(1).mul(2)
    first_run = [[r.site.phase, r.site.module, r.site.op, r.digests] for r in oplog.records]
    expected = {"state": {}, "operators": first_run}
    _check_reproduced(expected, {}, oplog, 1)  # the same run: nothing to say
    first_run[1][2] = "aten.sub.Tensor"
    with pytest.raises(SdcReplayError) as caught:
        _check_reproduced(expected, {}, oplog, 1)
    assert caught.value.message == (
        "the reference does not run the same operators twice in step 1: operator call 1: "
        "aten.add.Tensor under <outside> (forward) now, aten.sub.Tensor under <outside> "
        "(forward) the first time"
    )
    assert caught.value.hint.startswith("No kernel choice differs between two runs on one device")
    with pytest.raises(SdcReplayError, match=r"saved entering it: the state entering it is not "):
        _check_reproduced({"state": {"param:w": "1"}, "operators": []}, {"param:w": "2"}, oplog, 1)


# ---------------------------------------------------------------------------
# Realistic fault models: multi-bit masks and bursts, named as such.


@pytest.mark.parametrize(
    ("spec", "model"),
    [
        ("kind=mask,op=x,index=5,mask=0x00f00000", "multi-bit XOR mask 0x00f00000 on 1 element"),
        (
            "kind=bitflip,op=x,index=5,bit=3",
            "single-bit flip of bit 3 (mask 0x00000008) on 1 element",
        ),
        (
            "kind=burst,op=x,index=24,count=8,mask=0x00f00000",
            "burst: 8 neighbouring elements of row 3, same mask 0x00f00000",
        ),
        (
            "kind=burst,op=x,index=27,count=8,bit=22",  # clipped at the end of row 3
            "burst: 5 neighbouring elements of row 3, same mask 0x00400000 (bit 22)",
        ),
        (
            "kind=pairflip,op=x,index=5,count=9,bit=3",
            "single-bit flip of bit 3 (mask 0x00000008) on 2 elements (two elements, same bit)",
        ),
        ("kind=swap,op=x,index=3", "two elements swapped (values exchanged, no bit error)"),
        (
            "kind=bias,op=x,index=8,count=4,scale=0.5",
            "burst: 4 neighbouring elements of row 1, different XOR masks",
        ),
    ],
)
def test_forensics_names_the_fault_model(spec, model):
    from sdcreplay.capture.faults import FaultSpec, corrupt

    expected = torch.arange(1, 49, dtype=torch.float32).reshape(6, 8) / 7
    actual = expected.clone()
    corrupt(FaultSpec.parse(spec), actual)
    assert element_forensics(expected, actual)["fault_model"] == model


def test_forensics_fault_model_of_other_shapes_and_dtypes():
    expected = torch.zeros(2, 3, 4, dtype=torch.int64)
    actual = expected.clone()
    actual[1, 2, 1:3] ^= -(1 << 63) | 1  # bit 63 and bit 0 of two neighbours
    assert element_forensics(expected, actual)["fault_model"] == (
        "burst: 2 neighbouring elements of row [1, 2], same mask 0x8000000000000001"
    )
    flat = torch.zeros(10, dtype=torch.bfloat16)
    hit = flat.clone()
    hit[4:7] = 1.0
    assert element_forensics(flat, hit)["fault_model"] == (
        "burst: 3 neighbouring elements, same mask 0x3f80"
    )
    assert element_forensics(flat, flat.clone())["fault_model"] == "none"


# The session's SMALL tiny-llama bundle (conftest): attention outputs [16, 32], the MLP's w1
# [16, 88], weight gradients of w2 [32, 88]. One fault per run, on cpu:1 only.
MASK_BACKWARD = (
    "kind=mask,op=aten.mm,module=layers.0.mlp.w2,phase=backward,step=1,nth=0,index=40,"
    "mask=0x00f00000,device=cpu:1"
)
BURST_FORWARD = (  # row 3 of w1's output starts at element 264; given via SDCREPLAY_INJECT
    "kind=burst,op=aten.mm,module=layers.0.mlp.w1,phase=forward,step=1,index=266,count=8,"
    "mask=0x00f00000,device=cpu:1"
)
BURST_ENDING_A_ROW = (  # 4 of the 8 elements fit in row 2 of wq's output (64..95)
    "kind=burst,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=92,count=8,"
    "bit=21,device=cpu:1"
)


@pytest.fixture(scope="module")
def fault_model_cli(_small_bundle_template, tmp_path_factory) -> dict:
    """``sdcreplay bisect --json`` on each realistic fault (burst: from SDCREPLAY_INJECT)."""
    from typer.testing import CliRunner

    from sdcreplay.cli import app

    root = tmp_path_factory.mktemp("fault-models")
    runs = {}
    for name, inject, env in (
        ("mask", ["--inject", MASK_BACKWARD], {}),
        ("burst", [], {"SDCREPLAY_INJECT": BURST_FORWARD}),
        ("burst_row_end", ["--inject", BURST_ENDING_A_ROW], {}),
    ):
        args = ["bisect", str(_small_bundle_template), "--suspect", "cpu:1", "--step", "1"]
        args += [*inject, "--out", str(root / name), "--json"]
        runs[name] = CliRunner().invoke(app, args, env={"COLUMNS": "200", **env})
    return runs


@pytest.mark.parametrize(
    ("name", "spec", "where", "elements", "xor", "histogram", "pattern", "model"),
    [
        (
            "mask",
            MASK_BACKWARD,
            ("backward", "layers.0.mlp.w2"),
            [40],
            ["00f00000"],
            {"20": 1, "21": 1, "22": 1, "23": 1},
            "single element",
            "multi-bit XOR mask 0x00f00000 on 1 element",
        ),
        (
            "burst",
            BURST_FORWARD,
            ("forward", "layers.0.mlp.w1"),
            list(range(266, 274)),
            ["00f00000"] * 8,
            {"20": 8, "21": 8, "22": 8, "23": 8},
            "row segment",
            "burst: 8 neighbouring elements of row 3, same mask 0x00f00000",
        ),
        (
            "burst_row_end",
            BURST_ENDING_A_ROW,
            ("forward", "layers.0.attn.wq"),
            [92, 93, 94, 95],
            ["00200000"] * 4,
            {"21": 4},
            "row segment",
            "burst: 4 neighbouring elements of row 2, same mask 0x00200000 (bit 21)",
        ),
    ],
)
def test_bisect_names_the_mask_and_burst_planted(
    fault_model_cli,
    _small_bundle_template,
    name,
    spec,
    where,
    elements,
    xor,
    histogram,
    pattern,
    model,
):
    result = fault_model_cli[name]
    assert result.exit_code == 1, result.stderr
    report = json.loads(result.stdout)
    fired = only_fired(_small_bundle_template, spec)
    assert fired["elements"] == elements
    assert (report["verdict"], report["step"], report["phase"], report["module"]) == (
        "divergence",
        1,
        *where,
    )
    assert (report["op"], report["op_index"]) == ("aten.mm.default", fired["op_index"])
    assert report["isolated"] == "kernel"
    assert report["elements"]["indices"] == elements
    assert report["elements"]["count"] == len(elements)
    assert report["elements"]["xor"] == xor
    assert report["bits"]["histogram"] == histogram
    assert (report["pattern"], report["fault_model"]) == (pattern, model)
    assert f"│ fault model   │ {model}" in result.stderr  # the human summary names it too
