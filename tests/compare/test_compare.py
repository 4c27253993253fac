"""compare.py and `sdcreplay diff`: structure first, then values, then the vote.

One small two-layer tiny-llama bundle is recorded per module; a clean replay
and a replay with one injected bit flip (step 1, ``layers.1.attn.wq``) are made
in this process, so no test here starts a device process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import preserved_global_state

from sdcreplay import Bundle, record, replay_on_device
from sdcreplay.capture.signature import SignatureLog, layer_of, write_signature_log
from sdcreplay.compare.logs import Divergence, compare_logs, load_log, vote
from sdcreplay.errors import StructureError

KWARGS = {"layers": 2, "dim": 32, "heads": 2, "seq_len": 8, "batch_size": 2, "vocab": 64}
ARGS = [arg for key, value in KWARGS.items() for arg in ("-a", f"{key}={value}")]
FAULT = "kind=bitflip,op=aten.mm,module=layers.1.attn.wq,phase=forward,step=1,index=101"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, Path]:
    """a.bundle (2 steps), a clean replay log and a replay log with FAULT."""
    root = tmp_path_factory.mktemp("compare")
    with preserved_global_state():
        record("builtin:tiny-llama", root / "a.bundle", steps=2, kwargs=dict(KWARGS))
        write_signature_log(root / "clean.sig.zst", replay_on_device(root / "a.bundle", "cpu:0"))
        write_signature_log(
            root / "faulty.sig.zst", replay_on_device(root / "a.bundle", "cpu:1", inject=[FAULT])
        )
    return {
        "bundle": root / "a.bundle",
        "clean": root / "clean.sig.zst",
        "faulty": root / "faulty.sig.zst",
    }


@pytest.fixture
def paths(recorded, tmp_path) -> dict[str, Path]:
    """Private copies (tests may write next to them)."""
    copies = {}
    for key, path in recorded.items():
        copies[key] = tmp_path / path.name
        (shutil.copytree if path.is_dir() else shutil.copy)(path, copies[key])
    return copies


# ---------------------------------------------------------------------------
# compare_logs on real logs


def test_identical_logs(recorded):
    reference, replayed = load_log(recorded["bundle"]), load_log(recorded["clean"])
    comparison = compare_logs(reference, replayed)
    assert comparison.identical and comparison.first is None
    assert comparison.steps == [0, 1]
    assert comparison.entries == reference.entry_count() == replayed.entry_count()
    assert comparison.per_step() == {0: 0, 1: 0}
    assert comparison.per_layer() == {}
    assert comparison.to_json() == {
        "schema": "sdcreplay.diff/1",
        "identical": True,
        "program_differs": False,
        "steps": [0, 1],
        "entries": comparison.entries,
        "first_divergence": None,
        "divergent_entries": 0,
        "per_step": {"0": 0, "1": 0},
        "per_layer": {},
    }


def test_value_divergence_names_the_first_entry_and_counts_the_spread(recorded):
    reference, faulty = load_log(recorded["bundle"]), load_log(recorded["faulty"])
    comparison = compare_logs(reference, faulty)
    names = [name for name, _ in reference.steps[1]]
    first = comparison.first
    assert (first.step, first.phase, first.name, first.layer) == (
        1,
        "forward",
        "forward:layers.1.attn.wq",
        "layers.1.attn.wq",
    )
    assert first.expected == dict(reference.steps[1])["forward:layers.1.attn.wq"]
    assert first.actual == dict(faulty.steps[1])["forward:layers.1.attn.wq"]
    # exactly the entries whose digests differ, in execution order, none before the first
    expected = [
        (name, a) for (name, a), (_, b) in zip(reference.steps[1], faulty.steps[1]) if a != b
    ]
    assert [(d.name, d.expected) for d in comparison.divergences] == expected
    assert all(
        names.index(d.name) >= names.index("forward:layers.1.attn.wq")
        for d in comparison.divergences
    )
    per_step = comparison.per_step()
    assert per_step == {0: 0, 1: len(comparison.divergences)}
    per_layer = comparison.per_layer()
    assert sum(sum(counts.values()) for counts in per_layer.values()) == len(comparison.divergences)
    assert next(iter(per_layer)) == "layers.1.attn.wq"
    # optimizer: the gradient AdamW is given, its exp_avg and exp_avg_sq, the parameter
    assert per_layer["layers.1.attn.wq"] == {"forward": 1, "backward": 2, "optimizer": 4}
    # upstream layers compute the same forward, but their gradients and updates are hit
    for layer in ("tok_embeddings", "layers.0.attn.wq", "layers.0.mlp.w2"):
        assert "forward" not in per_layer[layer]
        assert per_layer[layer]["optimizer"] == 4
    assert not any(d.name.startswith("rng:") for d in comparison.divergences)
    as_json = comparison.to_json()
    assert as_json["first_divergence"] == {
        "step": 1,
        "phase": "forward",
        "name": "forward:layers.1.attn.wq",
        "expected": first.expected,
        "actual": first.actual,
    }
    assert as_json["divergent_entries"] == len(comparison.divergences)


def _log(values: dict[int, list[tuple[str, str]]], **meta) -> SignatureLog:
    return SignatureLog(
        meta={"device_type": "cpu", "digest": "mix64+xxh3", **meta},
        steps={step: list(entries) for step, entries in values.items()},
    )


NAMES = [
    "rng:cpu",
    "forward:l0",
    "forward:l0.a",
    "forward:l1",
    "loss",
    "backward:l1",
    "backward:l0",
    "grad:l0.a.weight",
    "grad:l1.weight",
    "param:l0.a.weight",
    "param:l1.weight",
]


def _clean(steps=(0, 1, 2)) -> SignatureLog:
    return _log({step: [(name, f"{step}-{i}") for i, name in enumerate(NAMES)] for step in steps})


def _with(log: SignatureLog, changes: dict[tuple[int, str], str]) -> SignatureLog:
    out = _log(
        {
            step: [(n, changes.get((step, n), v)) for n, v in entries]
            for step, entries in log.steps.items()
        },
        **log.meta,
    )
    return out


def test_per_step_and_per_layer_counts_are_exact():
    clean = _clean()
    bad = _with(
        clean,
        {
            (1, "forward:l1"): "x",
            (1, "loss"): "x",
            (1, "backward:l0"): "x",
            (1, "grad:l0.a.weight"): "x",
            (2, "param:l0.a.weight"): "x",
            (2, "param:l1.weight"): "x",
        },
    )
    comparison = compare_logs(clean, bad)
    assert comparison.entries == 3 * len(NAMES)
    assert [(d.step, d.name) for d in comparison.divergences] == [
        (1, "forward:l1"),
        (1, "loss"),
        (1, "backward:l0"),
        (1, "grad:l0.a.weight"),
        (2, "param:l0.a.weight"),
        (2, "param:l1.weight"),
    ]
    assert comparison.first == Divergence(1, "forward:l1", "1-3", "x")
    assert comparison.per_step() == {0: 0, 1: 4, 2: 2}
    assert comparison.per_layer() == {
        "l1": {"forward": 1, "optimizer": 1},
        "loss": {"forward": 1},
        "l0": {"backward": 1},
        "l0.a": {"backward": 1, "optimizer": 1},
    }


@pytest.mark.parametrize(
    "name, layer",
    [
        ("forward:layers.1.attn", "layers.1.attn"),
        ("backward:layers.1.attn#1[0]", "layers.1.attn"),
        ("grad:layers.1.attn.wq.weight", "layers.1.attn.wq"),
        ("param:norm.weight", "norm"),
        ("buffer:bias", "<root>"),
        ("loss", "loss"),
        ("rng:cpu", "cpu"),
    ],
)
def test_layer_of(name, layer):
    assert layer_of(name) == layer


# ---------------------------------------------------------------------------
# Structure first


def test_other_layers_are_a_structural_difference_naming_step_and_entry(recorded, small_bundle):
    two_layers = Bundle.open(recorded["bundle"]).signature_log()
    one_layer = Bundle.open(small_bundle).signature_log()
    names = [name for name, _ in two_layers.steps[0]]
    position = names.index("forward:layers.1.attention_norm")
    assert [name for name, _ in one_layer.steps[0]][position] == "forward:norm"
    with pytest.raises(StructureError) as caught:
        compare_logs(two_layers, one_layer)
    assert caught.value.message == (
        f"the logs describe different programs: step 0, entry {position}: "
        f"'forward:layers.1.attention_norm' vs 'forward:norm' "
        f"({len(two_layers.steps[0])} vs {len(one_layer.steps[0])} entries)"
    )
    assert "not silent data corruption" in caught.value.hint


def test_other_workload_settings_are_a_structural_difference(recorded, small_bundle):
    """Same entry names, other sizes: the manifest's workload tells the programs apart."""
    with pytest.raises(
        StructureError,
        match=r"different programs: workload builtin:tiny-llama with layers=2 vs layers=1",
    ):
        compare_logs(load_log(recorded["bundle"]), load_log(small_bundle))


def test_workload_settings_compare_with_the_builtin_defaults_filled_in():
    def logged(ref, **kwargs):
        return _log(_clean().steps, workload={"ref": ref, "kwargs": kwargs})

    default = logged("builtin:tiny-llama", seed=0)
    assert compare_logs(
        default, logged("builtin:tiny-llama", seed=0, dim=64)
    ).identical  # 64 is the default
    with pytest.raises(
        StructureError,
        match=r"workload builtin:tiny-llama with dim=64, layers=2 vs dim=96, layers=3\n",
    ):
        compare_logs(default, logged("builtin:tiny-llama", seed=0, dim=96, layers=3))
    with pytest.raises(StructureError, match=r"workload builtin:tiny-llama vs builtin:tiny-moe\n"):
        compare_logs(default, logged("builtin:tiny-moe", seed=0))
    # a factory diff does not import: only the arguments both sides name are compared
    assert compare_logs(
        logged("train.py:make", lr=0.1), logged("train.py:make", lr=0.1, depth=4)
    ).identical
    with pytest.raises(StructureError, match=r"with lr=0.1 vs lr=0.2\n"):
        compare_logs(logged("train.py:make", lr=0.1), logged("train.py:make", lr=0.2))
    assert compare_logs(default, _clean()).identical  # a log without workload meta


def test_missing_steps_reordered_and_extra_entries():
    clean = _clean()
    with pytest.raises(
        StructureError, match=r"the logs hold different steps: \[0, 1, 2\] vs \[0, 1\]"
    ):
        compare_logs(clean, _clean(steps=(0, 1)))
    with pytest.raises(StructureError, match="step 2 is missing from the second log"):
        compare_logs(clean, _clean(steps=(0, 1)), steps=[0, 1, 2])
    assert compare_logs(clean, _clean(steps=(0, 1)), steps=[0, 1]).identical
    swapped = _clean()
    swapped.steps[1][3], swapped.steps[1][4] = swapped.steps[1][4], swapped.steps[1][3]
    with pytest.raises(
        StructureError, match=r"step 1, entry 3: 'forward:l1' vs 'loss' \(11 vs 11 entries\)"
    ):
        compare_logs(clean, swapped)
    longer = _clean()
    longer.steps[0].append(("param:extra", "z"))
    with pytest.raises(
        StructureError,
        match=r"step 0, entry 11: '\(end of step\)' vs 'param:extra' \(11 vs 12 entries\)",
    ):
        compare_logs(clean, longer)


def test_different_device_type_or_digest_is_refused():
    with pytest.raises(StructureError, match="different device type: cpu vs cuda") as caught:
        compare_logs(_clean(), _log(_clean().steps, device_type="cuda"))
    assert "device type the record was made on" in caught.value.hint
    with pytest.raises(StructureError, match="different digest: mix64\\+xxh3 vs other"):
        compare_logs(_clean(), _log(_clean().steps, digest="other"))


# ---------------------------------------------------------------------------
# vote(): the record is one voter, each device votes with its modal value


def test_vote_correct():
    consensus = vote(
        _clean(), {"cpu:0": [_clean()], "cpu:1": [_clean()], "cpu:2": [_clean(), _clean()]}
    )
    assert (consensus.verdict, consensus.suspects, consensus.first_divergence) == (
        "correct",
        [],
        None,
    )
    assert {
        voter: (v.verdict, v.runs, v.divergent_runs) for voter, v in consensus.voters.items()
    } == {
        "record": ("match", 1, 0),
        "cpu:0": ("match", 1, 0),
        "cpu:1": ("match", 1, 0),
        "cpu:2": ("match", 2, 0),
    }
    assert consensus.to_json() == {
        "verdict": "correct",
        "suspects": [],
        "first_divergence": None,
        "undecided_entries": 0,
        "incomparable": {},
        "missing": [],
        "advice": None,
    }


def test_vote_persistent_names_the_odd_device():
    bad = _with(_clean(), {(1, "forward:l0.a"): "x", (2, "loss"): "y"})
    consensus = vote(_clean(), {"cpu:0": [_clean()], "cpu:1": [bad, bad], "cpu:2": [_clean()]})
    assert (consensus.verdict, consensus.suspects) == ("persistent", ["cpu:1"])
    assert consensus.first_divergence.brief() == {
        "step": 1,
        "phase": "forward",
        "name": "forward:l0.a",
    }
    cpu1 = consensus.voters["cpu:1"]
    assert (cpu1.verdict, cpu1.runs, cpu1.divergent_runs) == ("persistent", 2, 2)
    assert cpu1.per_step == {0: 0, 1: 1, 2: 1}


def test_vote_intermittent_is_transient_and_the_modal_value_votes():
    bad = _with(_clean(), {(1, "forward:l1"): "x"})
    consensus = vote(
        _clean(), {"cpu:0": [_clean()], "cpu:1": [_clean(), bad, _clean()], "cpu:2": [_clean()]}
    )
    assert (consensus.verdict, consensus.suspects) == ("transient", ["cpu:1"])
    cpu1 = consensus.voters["cpu:1"]
    assert (cpu1.verdict, cpu1.runs, cpu1.divergent_runs) == ("intermittent", 3, 1)
    assert cpu1.first_divergence.name == "forward:l1"
    # a device whose corrupted value is its most frequent one still loses to the others
    consensus = vote(_clean(), {"cpu:0": [_clean()], "cpu:1": [bad, bad, _clean()]})
    assert (consensus.verdict, consensus.voters["cpu:1"].divergent_runs) == ("transient", 2)


def test_vote_recording_suspect():
    bad_record = _with(_clean(), {(0, "backward:l1"): "x"})
    consensus = vote(bad_record, {"cpu:0": [_clean()], "cpu:1": [_clean()]})
    assert (consensus.verdict, consensus.suspects) == ("recording_suspect", ["record"])
    assert consensus.first_divergence.brief() == {
        "step": 0,
        "phase": "backward",
        "name": "backward:l1",
    }
    assert consensus.voters["record"].verdict == "persistent"


def test_vote_record_and_a_replica_both_wrong():
    bad_record = _with(_clean(), {(0, "backward:l1"): "x"})
    bad = _with(_clean(), {(0, "forward:l1"): "y"})
    consensus = vote(bad_record, {"cpu:0": [_clean()], "cpu:1": [bad], "cpu:2": [_clean()]})
    assert (consensus.verdict, consensus.suspects) == ("persistent", ["record", "cpu:1"])
    assert consensus.first_divergence.name == "forward:l1"  # earliest in execution order


def test_vote_undecided_marks_the_tied_voters_and_says_what_decides():
    bad = _with(_clean(), {(1, "forward:l1"): "x", (1, "loss"): "x"})
    consensus = vote(_clean(), {"cpu:0": [bad]})  # one against one
    assert (consensus.verdict, consensus.undecided_entries, consensus.suspects) == (
        "undecided",
        2,
        [],
    )
    assert {voter: v.verdict for voter, v in consensus.voters.items()} == {
        "record": "undecided",
        "cpu:0": "undecided",
    }
    assert consensus.advice == (
        "record, cpu:0 are tied at 2 entries (as many voters on each side): "
        "replay on at least 1 more device of "
        "the recording's kind (same model, driver and software, see `sdcreplay info`); "
        "the side it joins decides"
    )
    other = _with(_clean(), {(1, "forward:l1"): "z", (1, "loss"): "z"})
    consensus = vote(_clean(), {"cpu:0": [bad], "cpu:1": [other]})  # three different values
    assert (consensus.verdict, consensus.undecided_entries, consensus.suspects) == (
        "undecided",
        2,
        [],
    )
    assert {v.verdict for v in consensus.voters.values()} == {"undecided"}


def test_a_plurality_of_agreeing_voters_decides():
    """Two that agree outvote two that are each wrong in their own way."""
    consensus = vote(
        _clean(),
        {
            "cpu:0": [_clean()],
            "cpu:1": [_with(_clean(), {(1, "loss"): "x"})],
            "cpu:2": [_with(_clean(), {(1, "loss"): "y"})],
        },
    )
    assert (consensus.verdict, consensus.suspects) == ("persistent", ["cpu:1", "cpu:2"])


def test_a_voter_on_another_machine_never_votes_against_the_record():
    """The record and a replica disagree, but the replica's machine differs: incomparable, not
    suspect."""
    other_machine = _with(_clean(), {(0, "forward:l0.a"): "x"})
    consensus = vote(
        _clean(),
        {"cpu:0": [other_machine], "cpu:1": [other_machine]},
        incomparable={
            "cpu:0": ["cpu.capability: recorded 'AVX2', here 'AVX512'"],
            "cpu:1": ["cpu.capability: recorded 'AVX2', here 'AVX512'"],
        },
    )
    assert (consensus.verdict, consensus.suspects) == ("incomparable", [])
    assert {voter: v.verdict for voter, v in consensus.voters.items()} == {
        "record": "match",
        "cpu:0": "incomparable",
        "cpu:1": "incomparable",
    }
    assert "cpu.capability" in consensus.advice
    # a comparable replica judges the record; the other machine's replicas vote among themselves,
    # where two outvote the third
    odd = _with(_clean(), {(1, "loss"): "odd"})
    consensus = vote(
        _clean(),
        {"cpu:0": [_clean()], "cpu:1": [other_machine], "cpu:2": [other_machine], "cpu:3": [odd]},
        incomparable={
            label: ["torch.git: recorded 'a', here 'b'"] for label in ("cpu:1", "cpu:2", "cpu:3")
        },
    )
    assert (consensus.verdict, consensus.suspects) == ("persistent", ["cpu:3"])
    assert consensus.voters["cpu:3"].verdict == "persistent"
    assert consensus.voters["record"].verdict == "match"


def test_vote_refuses_a_replica_of_another_program():
    with pytest.raises(StructureError):
        vote(_clean(), {"cpu:0": [_clean(steps=(0, 1))]})


# ---------------------------------------------------------------------------
# a record of the boundary level: the record votes at the entries it holds


def _boundary(log: SignatureLog) -> SignatureLog:
    """What a Recorder(signature="boundary") would have kept of ``log``."""
    return log.at("boundary")


def test_a_boundary_record_holds_only_the_step_boundary():
    assert [name for name, _ in _boundary(_clean()).steps[0]] == [
        "rng:cpu",
        "loss",
        "param:l0.a.weight",
        "param:l1.weight",
    ]
    assert _boundary(_clean()).level == "boundary" and _clean().level == "layer"


def test_a_boundary_record_compares_with_a_replay_at_its_own_entries():
    comparison = compare_logs(_boundary(_clean()), _clean())
    assert comparison.identical and comparison.entries == 3 * 4
    inside = _with(_clean(), {(1, "forward:l1"): "x"})  # a layer the record does not hold
    assert compare_logs(_boundary(_clean()), inside).identical
    at_boundary = _with(inside, {(1, "param:l1.weight"): "y"})
    assert compare_logs(_boundary(_clean()), at_boundary).first == Divergence(
        1, "param:l1.weight", "1-10", "y"
    )


def test_a_boundary_record_and_two_replicas_name_the_odd_replica_at_its_first_layer():
    """With two replicas every layer entry would be one against one; the record votes there
    with the replica that reproduces its boundary, so the faulty replica is named at the layer
    where it first went wrong."""
    bad = _with(_clean(), {(1, "backward:l0"): "x", (1, "grad:l0.a.weight"): "x"})
    bad = _with(bad, {(1, "param:l0.a.weight"): "x", (2, "loss"): "x"})
    consensus = vote(_boundary(_clean()), {"cpu:0": [_clean()], "cpu:1": [bad]})
    assert (consensus.verdict, consensus.suspects, consensus.undecided_entries) == (
        "persistent",
        ["cpu:1"],
        0,
    )
    assert consensus.first_divergence == Divergence(1, "backward:l0", "1-6", "x")
    assert {voter: v.verdict for voter, v in consensus.voters.items()} == {
        "record": "match",
        "cpu:0": "match",
        "cpu:1": "persistent",
    }


def test_a_boundary_record_that_left_the_replicas_is_suspect_at_its_boundary():
    bad_record = _with(_boundary(_clean()), {(1, "param:l0.a.weight"): "x"})
    consensus = vote(bad_record, {"cpu:0": [_clean()], "cpu:1": [_clean()]})
    assert (consensus.verdict, consensus.suspects) == ("recording_suspect", ["record"])
    assert consensus.first_divergence == Divergence(1, "param:l0.a.weight", "1-9", "x")


def test_a_corruption_the_boundary_masks_stays_undecided_between_two_replicas():
    """Both replicas reproduce the record's boundary but differ inside: the record cannot
    say which one it computed, so neither is accused."""
    masked = _with(_clean(), {(1, "forward:l0.a"): "x"})
    consensus = vote(_boundary(_clean()), {"cpu:0": [_clean()], "cpu:1": [masked]})
    assert (consensus.verdict, consensus.suspects, consensus.undecided_entries) == (
        "undecided",
        [],
        1,
    )
    # a third replica decides it
    consensus = vote(
        _boundary(_clean()), {"cpu:0": [_clean()], "cpu:1": [masked], "cpu:2": [_clean()]}
    )
    assert (consensus.verdict, consensus.suspects) == ("persistent", ["cpu:1"])


def test_replicas_of_a_boundary_record_must_agree_in_structure_among_themselves():
    other = _log(
        {step: [*entries, ("forward:extra", "e")] for step, entries in _clean().steps.items()}
    )
    with pytest.raises(StructureError, match="forward:extra"):
        vote(_boundary(_clean()), {"cpu:0": [_clean()], "cpu:1": [other]})
    with pytest.raises(StructureError, match="different programs"):
        compare_logs(_boundary(_clean()), _log({s: e[:-1] for s, e in _clean().steps.items()}))


# ---------------------------------------------------------------------------
# sdcreplay diff


def test_cli_diff_identical_exit_0(cli, paths):
    result = cli("diff", paths["bundle"], paths["clean"])
    assert result.exit_code == 0, result.stderr
    assert "identical" in result.stderr and "match bit for bit" in result.stderr
    result = cli("diff", paths["bundle"], paths["clean"], "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert (
        data["schema"],
        data["identical"],
        data["first_divergence"],
        data["divergent_entries"],
    ) == ("sdcreplay.diff/1", True, None, 0)


def test_cli_diff_divergent_exit_1(cli, paths, recorded):
    result = cli("diff", paths["bundle"], paths["faulty"], "--json")
    assert result.exit_code == 1, result.stderr
    data = json.loads(result.stdout)
    comparison = compare_logs(load_log(recorded["bundle"]), load_log(recorded["faulty"]))
    assert data["schema"] == "sdcreplay.diff/1"
    assert data["identical"] is False
    assert {k: data["first_divergence"][k] for k in ("step", "phase", "name")} == {
        "step": 1,
        "phase": "forward",
        "name": "forward:layers.1.attn.wq",
    }
    assert data["divergent_entries"] == len(comparison.divergences)
    assert data["per_step"] == {"0": 0, "1": len(comparison.divergences)}
    assert "First divergence: step 1, forward, forward:layers.1.attn.wq" in result.stderr
    assert "Divergent entries per step" in result.stderr
    assert "Divergent entries per layer" in result.stderr
    # replay log against replay log, in either order
    assert cli("diff", paths["faulty"], paths["clean"]).exit_code == 1


def test_cli_diff_structural_difference_exit_3(cli, paths, tmp_path):
    other = tmp_path / "b.bundle"
    args = [a if a != "dim=32" else "dim=48" for a in ARGS]
    made = cli("record", "builtin:tiny-llama", "--steps", "2", "--out", other, *args)
    assert made.exit_code == 0, made.stderr
    result = cli("diff", paths["bundle"], other, "--json")
    assert result.exit_code == 3
    assert json.loads(result.stdout)["kind"] == "StructureError"  # the error object, no result
    assert (
        "Error: the logs describe different programs: "
        "workload builtin:tiny-llama with dim=32 vs dim=48" in result.stderr
    )
    assert (
        "Hint: This is a different workload or configuration, not silent data corruption"
        in result.stderr
    )
    assert "Traceback" not in result.stderr
    # a replay log of a.bundle knows its program too
    assert cli("diff", other, paths["clean"]).exit_code == 3


def test_cli_diff_missing_file_exit_3(cli, paths, tmp_path):
    result = cli("diff", paths["bundle"], tmp_path / "nothing.sig.zst")
    assert result.exit_code == 3
    assert "does not exist" in result.stderr and "Hint:" in result.stderr


def test_two_recordings_of_the_same_run_are_identical(tmp_path):
    import random

    import numpy as np
    from conftest import SMALL

    random.seed(1)
    np.random.seed(1)  # whatever the training script did before
    record("builtin:tiny-llama", tmp_path / "first.bundle", steps=1, kwargs=dict(SMALL))
    random.seed(2)
    np.random.seed(2)
    record("builtin:tiny-llama", tmp_path / "second.bundle", steps=1, kwargs=dict(SMALL))
    comparison = compare_logs(
        load_log(tmp_path / "first.bundle"), load_log(tmp_path / "second.bundle")
    )
    assert comparison.identical, comparison.first
