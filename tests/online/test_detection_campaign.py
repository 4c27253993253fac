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
