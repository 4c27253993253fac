"""bench/always_on.py runs (a few steps at the default size) and reports every configuration.

No timing is asserted: its ratios are measurements for docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import REPO


def test_the_always_on_benchmark_reports_every_configuration(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
):
    spec = importlib.util.spec_from_file_location("always_on", REPO / "bench" / "always_on.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    out = tmp_path / "runs.json"
    arguments = ["--size", "default", "--steps", "3", "--warmup", "1", "--runs", "1"]
    assert bench.main([*arguments, "--every", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    names = [
        "plain",
        "ring boundary, checkpoint-anchored",
        "the same, verify=False (no check between steps)",
        "ring boundary, copies every 8",
        "UpdateDetector",
        "UpdateDetector(when='after_update')",
        "both (anchored ring + detector)",
        "ring layer, copies every 8",
    ]
    for name in names:
        assert f"| {name} |" in table, name
    (run,) = json.loads(out.read_text())["runs"]
    assert list(run) == names and run["plain"]["thread_ratio"] == 1.0
    # a copy every 8 steps is held; a checkpoint-anchored window holds no copy of the model
    assert run["ring boundary, copies every 8"]["peak_bytes"] > 10 * max(
        run["ring boundary, checkpoint-anchored"]["peak_bytes"], 1
    )
