"""minimize: trials and their interval, the acceptance rule, delta debugging, the command.

The report minimize starts from is built the way bisect builds one: tiny-llama's
forward runs under the operator-level dispatch mode, the inputs and output of
the ``layers.0.attn.wq`` matmul are kept, and the suspect's output is what the
injected fault makes of it. The fault is the ground truth every assertion
checks against.
"""

from __future__ import annotations

import json
import random
import re
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import SMALL

from sdcreplay import build_workload
from sdcreplay.bisect.operator_case import OPERATOR_FILE, OperatorCase, resolve_op
from sdcreplay.bisect.report import REPORT_FILE
from sdcreplay.bisect.report import SCHEMA as BISECT_SCHEMA
from sdcreplay.capture.faults import Injector, parse_specs
from sdcreplay.capture.operators import CallSite, OperatorLog, OperatorMode
from sdcreplay.errors import DeterminismError, SdcReplayError, Terminated
from sdcreplay.minimize.ddmin import ddmin
from sdcreplay.minimize.driver import minimize
from sdcreplay.minimize.shrink import Shrinker, shrink_axes
from sdcreplay.minimize.statistics import Z95, wilson_interval
from sdcreplay.minimize.ticket import staged_ticket
from sdcreplay.minimize.trials import Acceptance, TrialRunner
from sdcreplay.storage.tensorio import raw_bits

MODULE = "layers.0.attn.wq"
STICKY = f"kind=bitflip,op=aten.mm,module={MODULE},phase=forward,step=1,index=5,bit=22,device=cpu:1"


def capture_call(op: str = "aten.mm.default", module: str = MODULE, step: int = 1) -> OperatorCase:
    """The inputs and outputs of the first ``op`` call under ``module`` in tiny-llama's forward."""
    workload = build_workload("builtin:tiny-llama", dict(SMALL))
    model = workload.model.eval()
    batch = workload.get_batch(step)

    def forward(observer: OperatorLog) -> OperatorLog:
        with torch.no_grad(), OperatorMode(model, workload.optimizer, [observer], step):
            workload.loss_fn(model, batch)
        return observer

    index = next(
        r.site.index
        for r in forward(OperatorLog()).records
        if r.site.key == (op, module, "forward")
    )
    log = forward(OperatorLog(watch=index))
    args, kwargs, outputs = log.kept
    prior = Counter(record.site.key for record in log.records[:index])
    return OperatorCase(
        log.records[index].site, prior, args, kwargs, outputs, [t.clone() for t in outputs]
    )


def write_report(directory: Path, case: OperatorCase, inject: str) -> Path:
    """A bisect report (report.json + operator.h5) naming ``case`` as corrupted by ``inject`` on
    cpu:1."""
    Injector(parse_specs([inject], include_env=False), "cpu:1").on_isolated_call(
        case.site, case.prior, case.actual
    )
    directory.mkdir(parents=True)
    case.write(directory / OPERATOR_FILE)
    site = case.site
    (directory / REPORT_FILE).write_text(
        json.dumps(
            {
                "schema": BISECT_SCHEMA,
                "verdict": "divergence",
                "step": site.step,
                "phase": site.phase,
                "module": site.module,
                "op": site.op,
                "op_index": site.index,
                "kernels": [],
                "isolated": "kernel",
                "suspect": "cpu:1",
                "reference": "cpu:0",
                "repeats_run": 1,
                "report": str(directory),
                "bundle": str(directory.parent / "absent.bundle"),
                "inject": [inject],
                "workload": {"ref": "builtin:tiny-llama", "kwargs": dict(SMALL)},
                "environment": {
                    "suspect": {"device": {"type": "cpu"}},
                    "reference": {"device": {"type": "cpu"}},
                },
                "commands": [f"sdcreplay bisect absent.bundle --suspect cpu:1 --inject {inject}"],
            }
        )
    )
    return directory


def unfaulted(call: OperatorCase) -> OperatorCase:
    """``call`` with the suspect's outputs a fresh copy of the expected ones (not yet faulted)."""
    return OperatorCase(
        call.site,
        call.prior,
        call.args,
        call.kwargs,
        call.expected,
        [t.clone() for t in call.expected],
    )


@pytest.fixture(scope="session")
def wq_call() -> OperatorCase:
    return capture_call()


@pytest.fixture
def report(tmp_path: Path, wq_call: OperatorCase, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("SDCREPLAY_INJECT", raising=False)
    case = unfaulted(wq_call)
    return write_report(tmp_path / "report", case, STICKY)


@pytest.fixture(scope="session")
def sticky_result(tmp_path_factory: pytest.TempPathFactory, wq_call: OperatorCase):
    """One minimize of the sticky bitflip, shared by the tests that only read it."""
    from conftest import preserved_global_state

    directory = tmp_path_factory.mktemp("sticky") / "report"
    case = unfaulted(wq_call)
    write_report(directory, case, STICKY)
    with preserved_global_state(), pytest.MonkeyPatch.context() as patch:
        patch.delenv("SDCREPLAY_INJECT", raising=False)
        return minimize(directory, trials=300, inject=[STICKY])


def test_wilson_interval_known_values():
    assert wilson_interval(0, 10) == (0.0, pytest.approx(Z95**2 / (10 + Z95**2)))
    low, high = wilson_interval(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    assert wilson_interval(10, 10) == (pytest.approx(10 / (10 + Z95**2)), 1.0)


def test_ddmin_finds_a_1_minimal_subset():
    needed = {3, 11, 17}
    tested = []

    def test(subset: tuple) -> bool:
        tested.append(subset)
        return needed <= set(subset)

    assert ddmin(range(40), test) == (3, 11, 17)
    assert () not in tested


def test_shrinker_keeps_the_best_when_interrupted(wq_call: OperatorCase):
    axes, _ = shrink_axes(wq_call.op, resolve_op(wq_call.op), wq_call.args, wq_call.expected)
    verdicts = iter([False, True, False, True])

    def accepts(args, kwargs) -> bool:
        verdict = next(verdicts, None)
        if verdict is None:
            raise KeyboardInterrupt
        return verdict

    shrinker = Shrinker(wq_call.args, wq_call.kwargs, axes, accepts)
    with pytest.raises(KeyboardInterrupt):
        shrinker.run()
    # rows: first half refused, second half kept (8 rows); then its first quarter refused, the
    # second kept
    assert [len(kept) for kept in shrinker.best] == [4, 32, 32]
    assert shrinker.best[0] == (12, 13, 14, 15)


def test_shrink_axes_by_operator_family():
    a, b, bias = torch.ones(4, 3), torch.ones(3, 5), torch.ones(5)
    mm = resolve_op("aten.addmm.default")
    axes, _ = shrink_axes("aten.addmm.default", mm, [bias, a, b], [torch.ones(4, 5)])
    assert [(axis.name, axis.size, axis.members) for axis in axes] == [
        ("rows", 4, ((1, 0),)),
        ("cols", 5, ((2, 1), (0, 0))),
        ("inner", 3, ((1, 1), (2, 0))),
    ]
    x, weight = torch.ones(2, 6, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    norm = resolve_op("aten._fused_rms_norm.default")
    axes, _ = shrink_axes(
        "aten._fused_rms_norm.default",
        norm,
        [x, [8], weight, 1e-6],
        list(norm(x, [8], weight, 1e-6)),
    )
    assert [(axis.name, axis.members) for axis in axes] == [
        ("dim 0", ((0, 0),)),
        ("dim 1", ((0, 1),)),
    ]
    mul = resolve_op("aten.mul.Tensor")
    axes, _ = shrink_axes("aten.mul.Tensor", mul, [x, weight], [x * weight])
    assert [(axis.name, axis.members) for axis in axes] == [
        ("dim 0", ((0, 0),)),
        ("dim 1", ((0, 1),)),
        ("dim 2", ((0, 2), (1, 0))),
    ]
    sort = resolve_op("aten.sort.default")
    axes, reason = shrink_axes("aten.sort.default", sort, [x], list(sort(x)))
    assert axes == [] and "does not apply" in reason


def test_sticky_bitflip_fails_every_trial(sticky_result):
    data = sticky_result.to_json()
    assert data["schema"] == "sdcreplay.minimize/1"
    assert (data["trials"], data["failures"], data["rate"]) == (300, 300, 1.0)
    assert data["ci95"] == [pytest.approx(300 / (300 + Z95**2)), 1.0]
    assert data["trials_to_first_failure"] == 1
    assert (data["reference_trials"], data["reference_failures"]) == (300, 0)
    assert data["first_mismatch"]["index"] == 5 and data["first_mismatch"]["xor"] == "00400000"
    assert data["bits"]["histogram"] == {"22": 1}
    assert data["data_dependent"] is False
    assert sticky_result.exit_code == 1


def test_minimal_inputs_are_smaller_still_fail_and_are_1_minimal(
    sticky_result, wq_call: OperatorCase
):
    data = sticky_result.to_json()
    assert data["input_shapes_original"] == [[16, 32], [32, 32]]
    # the fault flips element 5 of the output: one row, six columns, one inner element are enough
    assert data["input_shapes_minimal"] == [[1, 1], [1, 6]]
    assert data["shrink"]["status"] == "shrunk"
    assert data["minimal"]["failures"] == data["minimal"]["trials"] == 300
    minimal = OperatorCase.read(Path(data["ticket"]) / "inputs.h5")
    a, b = minimal.args
    specs = parse_specs([STICKY], include_env=False)
    op = resolve_op(wq_call.op)
    runners = [
        TrialRunner(op, wq_call.site, wq_call.prior, label, specs) for label in ("cpu:1", "cpu:0")
    ]
    acceptance = Acceptance(*runners, good_trials=10, bad_trials=1)
    assert acceptance.holds([a, b], {})
    for column in range(b.shape[1]):  # rows and inner already have one element each
        kept = [c for c in range(b.shape[1]) if c != column]
        assert not acceptance.holds([a, b[:, kept].contiguous()], {})


def test_intermittent_fault_rate_interval_contains_p(report: Path):
    spec = f"kind=bitflip,op=aten.mm,module={MODULE},step=1,index=5,p=0.05,seed=7,device=cpu:1"
    data = minimize(report, trials=2000, inject=[spec]).to_json()
    draws = random.Random("7:0:0")  # the injector's stream for the first block of suspect trials
    assert data["failures"] == sum(draws.random() < 0.05 for _ in range(2000))
    low, high = data["ci95"]
    assert low < 0.05 < high
    # --bad-trials defaults to what sees a failure at the measured rate with 99% probability
    assert (
        (1 - data["rate"]) ** data["acceptance"]["bad_trials"]
        <= 0.01
        < (1 - data["rate"]) ** (data["acceptance"]["bad_trials"] - 1)
    )


def test_fault_that_does_not_reproduce_gives_a_not_reproduced_ticket(report: Path):
    result = minimize(
        report, trials=200
    )  # the report was made with an injection; none is given here
    data = result.to_json()
    assert (data["reproduced"], data["failures"], result.exit_code) == (False, 0, 0)
    assert data["ci95"] == [0.0, pytest.approx(Z95**2 / (200 + Z95**2))]
    assert data["input_shapes_minimal"] == data["input_shapes_original"]
    assert data["data_dependent"] is None
    assert any("--inject" in warning for warning in data["warnings"])
    ticket = json.loads((Path(data["ticket"]) / "ticket.json").read_text())
    assert ticket["status"] == "not reproduced"
    assert ticket["drill"] is True and ticket["injected_faults"] == [
        STICKY
    ]  # bisect found it by injection
    assert "rate below 1.88%" in ticket["title"]


def test_cli_json_and_exit_codes(cli, report: Path, tmp_path: Path):
    result = cli(
        "minimize", report, "--inject", STICKY, "--trials", "50", "--out", tmp_path / "t", "--json"
    )
    assert result.exit_code == 1, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == "sdcreplay.minimize/1"
    assert (data["op"], data["device"], data["reference"]) == ("aten.mm.default", "cpu:1", "cpu:0")
    assert (data["trials"], data["failures"]) == (50, 50)
    assert data["ticket"] == str(tmp_path / "t")
    assert (tmp_path / "t" / "repro.py").is_file()
    # stderr is not a terminal here: each stage leaves one line with its count, total and time
    for stage in (
        r"suspect: 50/50, 50 failed",
        r"reference: 50/50, 0 failed",
        r"shrink: [1-9]\d*, [1-9]\d* kept",
        r"random data: [1-3]/3, [01] failed",
        r"minimal: 50/50, 50 failed",
    ):
        assert re.search(rf"^{stage} \(\d+\.\d s\)$", result.stderr, re.M), (stage, result.stderr)
    healthy = cli("minimize", report, "--trials", "50", "--json")
    assert healthy.exit_code == 0, healthy.stderr
    assert json.loads(healthy.stdout)["failures"] == 0
    assert "not reproduced" in healthy.stderr


def test_a_ticket_is_replaced_only_when_asked_and_then_moved_aside(cli, report: Path):
    ticket = report / "ticket"
    first = minimize(report, trials=20, good_trials=2, inject=[STICKY], ledger=False)
    assert first.ticket == str(ticket) and first.moved_aside is None
    before = (ticket / "ticket.json").read_bytes()
    message = f"{ticket} already exists (a minimize ticket)"

    with pytest.raises(SdcReplayError) as info:  # the Python API, refused before any trial
        minimize(report, trials=20, inject=[STICKY], ledger=False)
    assert info.value.message == message and "overwrite=True" in info.value.python_hint
    args = ["minimize", report, "--trials", "20", "--good-trials", "2", "--inject", STICKY]
    refused = cli(*args, "--no-ledger")
    assert refused.exit_code == 3 and "Traceback" not in refused.output
    said = " ".join(refused.stderr.split())
    assert f"Error: {message}" in said and "Hint: Pass --overwrite to replace it" in said
    assert "suspect:" not in refused.stderr  # no trial ran
    assert (ticket / "ticket.json").read_bytes() == before

    done = cli(*args, "--no-ledger", "--overwrite", "--json")
    assert done.exit_code == 1, done.output
    moved = Path(json.loads(done.stdout)["moved_aside"])
    assert moved.parent == report and moved.name.startswith("ticket.old-")
    assert (moved / "ticket.json").read_bytes() == before and (ticket / "repro.py").is_file()
    assert f"The ticket that was there is now {moved}" in " ".join(done.stderr.split())
    assert sorted(p.name for p in report.iterdir()) == sorted(
        [OPERATOR_FILE, REPORT_FILE, "ticket", moved.name]
    )


def test_cli_missing_or_damaged_report(cli, report: Path, tmp_path: Path):
    missing = cli("minimize", tmp_path / "nowhere")
    assert missing.exit_code == 3
    assert "Error:" in missing.stderr and "Hint:" in missing.stderr
    (report / OPERATOR_FILE).write_bytes(b"not hdf5 at all")
    damaged = cli("minimize", report, "--json")
    assert damaged.exit_code == 3
    assert "operator.h5" in damaged.stderr and "Hint:" in damaged.stderr
    error = json.loads(damaged.stdout)  # --json: the error object, no result
    assert error["schema"] == "sdcreplay.error/1" and "operator.h5" in error["message"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_trials_count_every_failure_with_one_sync_per_block(wq_call: OperatorCase):
    op = resolve_op(wq_call.op)
    spec = "kind=bitflip,op=aten.mm,step=1,index=5,p=0.5,seed=3,device=cuda:0"
    expected = TrialRunner(op, wq_call.site, wq_call.prior, "cuda:0", []).outputs(
        wq_call.args, wq_call.kwargs
    )
    runner = TrialRunner(
        op, wq_call.site, wq_call.prior, "cuda:0", parse_specs([spec], include_env=False)
    )
    measured = runner.measure(wq_call.args, wq_call.kwargs, expected, 500)
    draws = random.Random("3:0:0")
    fired = [draws.random() < 0.5 for _ in range(500)]
    assert measured.failures == sum(fired)
    assert measured.trials_to_first_failure == fired.index(True) + 1
    assert measured.first_failure["indices"] == [5]


def test_reference_that_disagrees_with_the_record_stops(tmp_path: Path, wq_call: OperatorCase):
    recorded = [t.clone() for t in wq_call.expected]
    recorded[0].view(-1)[0] += 1.0  # not what this reference computes from these inputs
    case = OperatorCase(
        wq_call.site,
        wq_call.prior,
        wq_call.args,
        wq_call.kwargs,
        recorded,
        [t.clone() for t in recorded],
    )
    with pytest.raises(DeterminismError, match="does not reproduce the recorded output"):
        minimize(write_report(tmp_path / "report", case, STICKY), trials=5)


def test_accelerator_verdicts_stay_on_the_device_until_one_fetch():
    """The comparison a GPU runs (a flag per trial, fetched per block), exercised on CPU tensors."""
    from sdcreplay.minimize.trials import _device_flag, _fetch
    from sdcreplay.storage.tensorio import raw_bits

    expected = torch.tensor([1.0, -0.0, float("nan")])
    wanted = [raw_bits(expected), 3]
    flipped = expected.clone()
    flipped.view(torch.int32)[1] ^= 1 << 31  # -0.0 -> +0.0: equal as floats, not as bits
    flags = [
        _device_flag([expected.clone(), 3], wanted),
        _device_flag([flipped, 3], wanted),
        _device_flag([expected.clone(), 4], wanted),
        _device_flag([expected[:2].clone(), 3], wanted),
    ]
    assert isinstance(flags[0], torch.Tensor) and isinstance(flags[1], torch.Tensor)
    assert _fetch(flags) == [False, True, True, True]


def test_ticket_names_the_failing_element_in_both_coordinates(sticky_result, wq_call: OperatorCase):
    """The fault flips flat element 5 of whatever output the call makes: [0, 5] of the
    original [16, 32] output, and [0, 5] of the minimal [1, 6] one, which is another
    element of the original."""
    data = sticky_result.to_json()
    kept = data["shrink"]["kept"]
    (row,), columns, inner = kept["rows"], kept["cols"], kept["inner"]
    coordinates = data["coordinates"]
    assert coordinates["minimal"] == {"output": 0, "index": 5, "position": [0, 5]}
    assert coordinates["original"] == {"output": 0, "position": [row, columns[5]]}
    assert coordinates["original_first_mismatch"] == {"output": 0, "index": 5, "position": [0, 5]}
    # the mapping is true of the data: the minimal inputs are those rows, columns and inner terms
    a, b = OperatorCase.read(Path(data["ticket"]) / "inputs.h5").args
    left, right = wq_call.args
    assert torch.equal(a, left[[row]][:, inner]) and torch.equal(b, right[inner][:, columns])
    why = coordinates["why"]
    assert (
        f"element [0, 5] of the minimal output is element [{row}, {columns[5]}] "
        "of the original output"
    ) in why
    assert f"computed from {len(inner)} of 32 inner terms" in why
    assert "the original inputs fail first at element [0, 5]" in why
    assert "both are flat index 5" in why


def test_trials_of_a_view_operator_never_write_the_case_inputs():
    """An output that is a view of an input is flipped in place by the injector: every trial
    must start from a fresh copy, or a flip would reach the case and the next trial would flip
    it back."""
    op = resolve_op("aten.t.default")
    site = CallSite(1, "forward", MODULE, "aten.t.default", 0)
    spec = f"kind=bitflip,op=aten.t,module={MODULE},phase=forward,step=1,index=2,bit=3,device=cpu:1"
    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    original = matrix.clone()
    runner = TrialRunner(op, site, Counter(), "cpu:1", parse_specs([spec], include_env=False))
    assert runner.writes_inputs
    measured = runner.measure([matrix], {}, [original.t()], 5)
    assert measured.failures == 5
    assert torch.equal(raw_bits(matrix), raw_bits(original))


# ---------------------------------------------------------------------------
# Realistic fault models: minimize and its ticket name the mask and the burst.

BURST = (  # row 3 of w1's [16, 88] output starts at element 264
    "kind=burst,op=aten.mm,module=layers.0.mlp.w1,phase=forward,step=1,index=266,count=8,"
    "mask=0x00f00000,device=cpu:1"
)
MASK = f"kind=mask,op=aten.mm,module={MODULE},phase=forward,step=1,index=37,mask=0x81,device=cpu:1"


def _expected_model(index: int, count: int, columns: int, mask: str) -> str:
    """forensics' words for a burst of ``count`` from flat ``index`` in rows of ``columns``."""
    row, hit = index // columns, min(count, columns - index % columns)
    if hit == 1:
        return f"multi-bit XOR mask {mask} on 1 element"
    return f"burst: {hit} neighbouring elements of row {row}, same mask {mask}"


def test_minimize_from_a_real_bisect_names_the_burst(
    cli, _small_bundle_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("SDCREPLAY_INJECT", raising=False)
    bisected = cli(
        "bisect", _small_bundle_template, "--suspect", "cpu:1", "--step", "1",
        "--inject", BURST, "--out", tmp_path / "report", "--json",
    )  # fmt: skip
    assert bisected.exit_code == 1, bisected.stderr
    result = cli(
        "minimize", tmp_path / "report", "--inject", BURST, "--trials", "20",
        "--out", tmp_path / "ticket", "--json",
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 1, result.stderr
    data = json.loads(result.stdout)
    assert (data["op"], data["site"]["module"], data["failures"]) == (
        "aten.mm.default",
        "layers.0.mlp.w1",
        20,
    )
    original = "burst: 8 neighbouring elements of row 3, same mask 0x00f00000"
    assert json.loads(bisected.stdout)["fault_model"] == original
    # the minimal inputs keep the element the burst starts at; the burst fires from there
    rows, columns = data["input_shapes_minimal"][0][0], data["input_shapes_minimal"][1][1]
    assert rows * columns > 266
    minimal = _expected_model(266, 8, columns, "0x00f00000")
    assert data["fault_model"] == {"original": original, "minimal": minimal}
    assert (data["first_mismatch"]["index"], data["first_mismatch"]["xor"]) == (266, "00f00000")
    assert f"│ fault model       │ {original}" in result.stderr
    ticket = json.loads((tmp_path / "ticket" / "ticket.json").read_text())
    assert ticket["fault_model"] == data["fault_model"]
    assert ticket["bisect"]["fault_model"] == original
    markdown = (tmp_path / "ticket" / "ticket.md").read_text()
    assert f"| fault model | {original} (original inputs) |" in markdown


def test_minimize_names_a_multi_bit_mask(cli, tmp_path: Path, wq_call: OperatorCase):
    case = unfaulted(wq_call)
    report = write_report(tmp_path / "report", case, MASK)
    result = cli("minimize", report, "--inject", MASK, "--trials", "20", "--json")
    assert result.exit_code == 1, result.stderr
    data = json.loads(result.stdout)
    assert data["fault_model"] == {
        "original": "multi-bit XOR mask 0x00000081 on 1 element",
        "minimal": "multi-bit XOR mask 0x00000081 on 1 element",
    }
    assert (data["first_mismatch"]["index"], data["first_mismatch"]["xor"]) == (37, "00000081")
    assert data["bits"]["histogram"] == {"0": 1, "7": 1}
    markdown = (Path(data["ticket"]) / "ticket.md").read_text()
    assert "| fault model | multi-bit XOR mask 0x00000081 on 1 element (original inputs) |" in (
        markdown
    )
    assert "fault model, minimal inputs" not in markdown  # the same: said once


def test_minimize_refuses_a_reference_that_computes_unlike_the_suspect(
    cli, _small_bundle_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The report's bundle holds a kernel probe: a reference whose kernels give other bits than
    the suspect's (another kind of machine) cannot tell a defect from a model difference."""
    monkeypatch.delenv("SDCREPLAY_INJECT", raising=False)
    bisected = cli(
        "bisect", _small_bundle_template, "--suspect", "cpu:1", "--step", "1",
        "--inject", BURST, "--out", tmp_path / "report",
    )  # fmt: skip
    assert bisected.exit_code == 1, bisected.stderr
    result = cli(
        "minimize", tmp_path / "report", "--inject", BURST, "--trials", "5",
        "--out", tmp_path / "ticket",
        env={"SDCREPLAY_OTHER_MACHINE": "aten.mm.default@cpu:0"},
    )  # fmt: skip
    assert result.exit_code == 3, result.stderr
    assert "Error: the reference cpu:0 does not compute like cpu:1: probe: aten.mm" in result.stderr
    assert not (tmp_path / "ticket").exists()


@pytest.mark.parametrize("interruption", [KeyboardInterrupt(), Terminated(signal.SIGTERM)])
def test_an_interrupted_shrink_writes_a_partial_ticket_then_ends_the_call(
    report: Path, interruption: KeyboardInterrupt
):
    """^C or SIGTERM in the shrink (here from the progress callback, after 3 candidates): the
    ticket of the smallest inputs accepted so far is written, marked partial, and the
    interruption ends the call with that ticket in its notes; nothing measured is lost."""
    from sdcreplay import leftovers

    def on_progress(stage: str, done: int, total: int | None, failures: int) -> None:
        if stage == "shrink" and done == 3:
            raise interruption

    with pytest.raises(KeyboardInterrupt) as raised:
        minimize(report, trials=50, good_trials=2, inject=[STICKY], on_progress=on_progress)
    assert raised.value is interruption
    ticket = report / "ticket"
    name = "SIGINT" if type(interruption) is KeyboardInterrupt else "SIGTERM"
    (left,) = leftovers.take()
    assert left.path == ticket and "a partial ticket" in left.what
    assert f"Left behind: {left}" in raised.value.__notes__
    doc = json.loads((ticket / "ticket.json").read_text())
    assert (doc["status"], doc["partial"], doc["interrupted"]) == ("reproduced", True, name)
    assert (doc["rate"]["failures"], doc["rate"]["trials"], doc["minimal_rate"]) == (50, 50, None)
    assert doc["shapes"]["shrink"]["status"] == "interrupted"
    assert doc["shapes"]["shrink"]["tests"] == 3
    assert doc["shapes"]["minimal"] != doc["shapes"]["original"]  # the best so far was kept
    assert (
        f"> **Partial:** the shrink was interrupted ({name}) after 3 tests"
        in (ticket / "ticket.md").read_text()
    )


def test_a_ticket_that_fails_while_written_leaves_no_staging(tmp_path: Path, wq_call: OperatorCase):
    """Only an interruption leaves something of a minimize behind (docs/commands.md)."""
    with pytest.raises(OSError, match="disk full"):
        with staged_ticket(tmp_path / "ticket", wq_call, {"switches": {}}) as (staging, _):
            assert staging.name.endswith(".partial") and (staging / "inputs.h5").is_file()
            raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []
