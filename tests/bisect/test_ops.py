"""`sdcreplay ops` lists a step's calls as fault specs name them; a spec that selects none is an
error."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import SMALL

from sdcreplay import replay_on_device
from sdcreplay.bisect.ops import list_calls

ROWS = SMALL["batch_size"] * SMALL["seq_len"]


def test_ops_json_names_each_call_as_a_spec_selects_it(small_bundle: Path, cli):
    result = cli(
        "ops",
        small_bundle,
        "--step",
        "1",
        "--op",
        "aten.mm",
        "--module",
        "layers.0.attn.wq",
        "--json",
    )
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    assert listing["schema"] == "sdcreplay.ops/1"
    assert [
        (c["phase"], c["module"], c["op"], c["nth"], c["outputs"]) for c in listing["calls"]
    ] == [
        (
            "forward",
            "layers.0.attn.wq",
            "aten.mm.default",
            0,
            [{"shape": [ROWS, 32], "dtype": "float32"}],
        ),
        (
            "backward",
            "layers.0.attn.wq",
            "aten.mm.default",
            0,
            [{"shape": [32, 32], "dtype": "float32"}],
        ),
        (
            "backward",
            "layers.0.attn.wq",
            "aten.mm.default",
            1,
            [{"shape": [ROWS, 32], "dtype": "float32"}],
        ),
    ]
    assert listing["total_calls"] > len(listing["calls"])
    # the listed index and spec are the call the injector fires on
    weight_grad = listing["calls"][1]
    log = replay_on_device(small_bundle, "cpu", last_step=1, inject=[weight_grad["spec"]])
    assert [(i["step"], i["op_index"]) for i in log.meta["injected"]] == [(1, weight_grad["index"])]


def test_ops_filters_by_phase_and_prints_a_table(small_bundle: Path, cli):
    """AdamW's update of one parameter: every call is under that parameter, nth counts each op's
    calls."""
    listing = list_calls(
        small_bundle, 0, phase="optimizer", module="layers.0.attn.wq.weight"
    ).to_json()
    calls = listing["calls"]
    assert calls and {(c["phase"], c["module"]) for c in calls} == {
        ("optimizer", "layers.0.attn.wq.weight")
    }
    for op in {c["op"] for c in calls}:
        assert [c["nth"] for c in calls if c["op"] == op] == list(
            range(sum(c["op"] == op for c in calls))
        )
    assert [c["index"] for c in calls] == sorted(c["index"] for c in calls)
    result = cli(
        "ops",
        small_bundle,
        "--step",
        "0",
        "--phase",
        "optimizer",
        "--module",
        "layers.0.attn.wq.weight",
    )
    assert result.exit_code == 0, result.output
    assert (
        f"Step 0: {len(calls)} of {listing['total_calls']} operator calls"
        in result.stderr + result.stdout
    )


def test_ops_refuses_a_step_the_bundle_does_not_hold(small_bundle: Path, cli):
    result = cli("ops", small_bundle, "--step", "7")
    assert result.exit_code == 3
    assert "has no step 7" in result.stderr and "Hint:" in result.stderr


def test_a_fault_spec_that_matches_no_call_names_the_closest(
    small_bundle: Path, cli, tmp_path: Path
):
    """`out_proj` is a common guess for the attention's output projection; this model calls it
    `wo`."""
    spec = "kind=bitflip,op=aten.mm,module=layers.0.attn.out_proj,phase=forward,step=1"
    result = cli(
        "replay", small_bundle, "-d", "cpu:0", "--inject", spec, "--logs", tmp_path / "logs"
    )
    assert result.exit_code == 3, result.output
    assert f"fault spec {spec!r} matches no operator call of the replayed steps" in result.stderr
    hint = result.stderr.split("Hint:", 1)[1]
    assert "Closest calls: aten.mm.default under layers.0.attn.wo (forward), step 1" in " ".join(
        hint.split()
    )
    assert f"`sdcreplay ops {small_bundle} --step 1` lists them all." in " ".join(hint.split())


def test_record_with_a_fault_spec_that_matches_nothing_says_so(tmp_path: Path, cli):
    from conftest import SMALL_ARGS

    spec = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=optimizer,step=0"
    result = cli(
        "record",
        "builtin:tiny-llama",
        "--steps",
        "1",
        *SMALL_ARGS,
        "--out",
        tmp_path / "b.bundle",
        "--inject",
        spec,
    )
    assert result.exit_code == 3
    assert f"fault spec {spec!r} matches no operator call of the recorded steps" in result.stderr
    hint = " ".join(result.stderr.split("Hint:", 1)[1].split())
    assert hint.startswith(
        "Closest calls: aten.mm.default under layers.0.attn.wq (backward), step 0; "
        "aten.mm.default under layers.0.attn.wq (forward), step 0;"
    )
    assert hint.endswith(f"`sdcreplay ops {tmp_path / 'b.bundle'} --step 0` lists them all.")
