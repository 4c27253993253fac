"""bench/detection_campaign.py runs (its --quick smoke run) and reports every kind and detector.

No timing is asserted: the campaign's numbers are measurements for docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import REPO


def _campaign(monkeypatch: pytest.MonkeyPatch):
    """The bench script as a module (registered while the test runs: it defines dataclasses)."""
    spec = importlib.util.spec_from_file_location(
        "detection_campaign", REPO / "bench" / "detection_campaign.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_quick_campaign_reports_every_kind_for_every_detector(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
):
    campaign = _campaign(monkeypatch)
    out = tmp_path / "campaign.json"
    assert campaign.main(["--quick", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for detector in ("ReplayCheck", "UpdateDetector", "UpdateDetector(after_update)"):
        for kind in ("bitflip", "mask", "burst", "bias", "swap", "all"):
            assert f"| {detector} | {kind} |" in table, (detector, kind)
        for mode in ("sticky", "intermittent", "single"):
            assert f"| {detector} | {mode} |" in table
    assert "| plain |" in table
    data = json.loads(out.read_text())
    trials = data["trials"]
    for detector in ("ReplayCheck", "UpdateDetector", "UpdateDetector(after_update)"):
        mine = [t for t in trials if t["detector"] == detector]
        planted = sorted((t["fault"]["kind"], t["fault"]["mode"]) for t in mine if t["fault"])
        assert planted == sorted((k, m) for k in campaign.KINDS for m in campaign.MODES)
        assert sum(t["fault"] is None for t in mine) == 2  # the clean runs
        assert {"wall_ratio", "cpu_ratio"} <= data["overhead"][detector].keys()
    # the replay check's target: every fault it could see (its executions of a checked step
    # differed, and a firing changes the loss or a gradient) it detected
    replay = data["summary"]["ReplayCheck"]["all"]
    assert replay["visible_detected"] == replay["visible"]


def test_the_clipping_campaign_runs_every_detector_clipped_and_not(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
):
    """bench/clipping_campaign.py's smoke run on tiny-llama, two kinds: a fault in an operator's
    output and one in AdamW's state; every detector, clip on and off, then the table."""
    _campaign(monkeypatch)  # clipping_campaign imports it by name
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(
        "clipping_campaign", REPO / "bench" / "clipping_campaign.py"
    )
    assert spec is not None and spec.loader is not None
    clipping = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, clipping)
    spec.loader.exec_module(clipping)
    trials = tmp_path / "trials.jsonl"
    kinds = "bitflip exponent top (30),memflip optimizer"
    options = ["--quick", "--loops", "tiny-llama", "--kinds", kinds]
    assert clipping.main([*options, "--trials-out", str(trials)]) == 0
    lines = [json.loads(line) for line in trials.read_text().splitlines()]
    faulty = [line for line in lines if line["fault"] is not None]
    assert sorted({(t["detector"], t["clip"], t["fault"]["kind"]) for t in faulty}) == sorted(
        (detector, clip, kind)
        for detector in ("ReplayCheck", "UpdateDetector", "UpdateDetector(after_update)")
        for clip in (True, False)
        for kind in kinds.split(",")
    )
    assert all(t["clip"] for t in lines if t["fault"] is None)  # clean runs are clipped
    capsys.readouterr()
    assert clipping.main([*options, "--render", str(trials)]) == 0
    table = capsys.readouterr().out
    assert "| tiny-llama | memflip optimizer | on |" in table
    assert "| tiny-llama | all | off |" in table and "TorchTitan" in table
