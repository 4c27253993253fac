"""Where bisect starts the step: a loop whose step depends on state outside torch still bisects.

tests/loops/counter_accumulation.py is Accelerate's gradient accumulation in script mode with a
plain Python counter, tests/loops/accelerate_accumulation.py the same with Accelerate itself:
the counter, advanced by ``accumulate()``, decides whether a micro-batch (one ``rec.step()``)
steps the optimizer. Replay runs the window from its start, so the counter runs as it did; the
state saved entering a step holds it only when it is among the Recorder's ``state=`` and
``rec.step()`` is entered before ``accumulate()``. Otherwise the reference's run from the saved
state does not reproduce its run through the window, and every later run starts from the
window's start instead, as replay's do, said on stderr and in the report; a bit planted in step
1 on cpu:1 is named exactly either way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sdcreplay.bisect.kernel_stage import KERNEL_FILE
from sdcreplay.bisect.localize import bisect
from sdcreplay.bisect.report import ENTRY_STATE_FILE, WORK_DIR
from sdcreplay.bundle.reader import Bundle
from sdcreplay.errors import ReportError
from sdcreplay.minimize.kernel_case import minimize_kernel
from tests.conftest import TESTS

LOOP = TESTS / "loops" / "counter_accumulation.py"
ACCELERATE = TESTS / "loops" / "accelerate_accumulation.py"
SPEC = "kind=bitflip,op=aten.addmm,module=0,phase=forward,step=1,index=5,bit=20,device=cpu:1"
pytestmark = pytest.mark.slow


def _record(folder: Path, *arguments: str, loop: Path = LOOP) -> Path:
    """``python LOOP BUNDLE ARGUMENTS`` in ``folder``, as a person runs it."""
    bundle = folder / "run.bundle"
    done = subprocess.run(
        [sys.executable, str(loop), bundle.name, *arguments],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    opened = Bundle.open(bundle)
    assert opened.manifest.workload.is_script and opened.verified
    # Only the second micro-batch of each pair steps the optimizer: the counter decides.
    assert [record.optimizer_step for record in opened.steps] == [False, True, False]
    return bundle


def _exact(report: dict) -> None:
    """The planted bit, named where it was planted."""
    assert (report["verdict"], report["step"], report["phase"], report["module"]) == (
        "divergence",
        1,
        "forward",
        "0",
    )
    assert (report["op"], report["isolated"]) == ("aten.addmm.default", "kernel")
    assert report["elements"]["indices"] == [5] and report["bits"]["histogram"] == {"20": 1}


def test_a_counter_the_recorder_was_not_given_bisects_from_the_windows_start(tmp_path, cli):
    """The counter outside ``state=``: the state saved entering step 1 does not reproduce it
    (it does not step the optimizer), so bisect replays the window before each later run."""
    bundle = _record(tmp_path, "unseen")
    out = tmp_path / "r.bisect"
    done = cli(
        "bisect", bundle, "--suspect", "cpu:1", "--reference", "cpu:0", "--inject", SPEC,
        "--out", out, env={"SDCREPLAY_LEDGER": "off"},
    )  # fmt: skip
    assert done.exit_code == 1, done.stderr
    report = json.loads((out / "report.json").read_text())
    _exact(report)
    assert report["start"] == {
        "from": "window",
        "steps_before": 1,
        "reason": "it has 14 signature entries, 31 the first time",
    }
    assert not (out / WORK_DIR / ENTRY_STATE_FILE).exists()  # no later run may start there
    # Each run after the reference's first replays step 0 before step 1.
    assert report["steps_run"] == {
        "replay": 6,
        "oplog_reference": 5,
        "oplog_suspect": 2,
        "fetch": 2,
        "total": 15,
    }
    stderr = " ".join(done.stderr.split())
    assert (
        "start: step 1 does not reproduce from the state saved entering it: every later run "
        "starts from the window's start" in stderr
    )
    (warning,) = report["warnings"]
    assert f"Warning: {warning}" in stderr
    assert warning.startswith(
        "step 1 does not reproduce from the state saved entering it (it has 14 signature "
        "entries, 31 the first time), so every later run of it starts from the window's start, "
        "as replay does, and replays the 1 step(s) before it. The step depends on state the "
        "Recorder was not given"
    )
    assert "Pass it in the Recorder's state=" in warning and "workload" not in warning
    assert "`with rec.step(), accelerator.accumulate(model):`" in warning


def test_the_counter_as_state_but_counted_before_the_step_bisects_from_the_windows_start(
    tmp_path,
):
    """The counter in ``state=``, but ``accumulate()`` entered before ``rec.step()``: the state
    saved entering the step has already counted it, so bisect starts from the window's start."""
    result = bisect(
        _record(tmp_path, "outer"), suspect="cpu:1", inject=[SPEC], out=tmp_path / "r",
        ledger=False,
    )  # fmt: skip
    _exact(result.to_json())
    assert result.findings["start"]["from"] == "window"


@pytest.mark.parametrize(("counted", "start"), [(False, "window"), (True, "saved_state")])
def test_an_accelerate_loop_bisects_exactly(tmp_path, counted, start):
    """Accelerate itself (tests/loops/accelerate_accumulation.py): as its examples nest it, the
    counter not given, bisect starts from the window's start; with the counter in ``state=`` and
    ``rec.step()`` entered first (docs/porting.md), from the state saved entering the step."""
    bundle = _record(tmp_path, *["counted"] * counted, loop=ACCELERATE)
    result = bisect(bundle, suspect="cpu:1", inject=[SPEC], out=tmp_path / "r", ledger=False)
    _exact(result.to_json())
    assert result.findings["start"] == (
        {"from": "saved_state"}
        if counted
        else {
            "from": "window",
            "steps_before": 1,
            "reason": "it has 14 signature entries, 31 the first time",
        }
    )
    assert ("warnings" in result.findings) == (not counted)
    assert (tmp_path / "r" / WORK_DIR / ENTRY_STATE_FILE).exists() == counted


def test_minimize_reads_a_compiled_kernels_start_from_the_report(tmp_path):
    """A kernel found from the window's start has no saved state to compile from: minimize
    goes on without it (to the case file, unreadable here); a report from the saved state still
    needs its file."""
    report_dir = tmp_path / "r"
    (report_dir / WORK_DIR).mkdir(parents=True)
    (report_dir / KERNEL_FILE).write_text("not an HDF5 file")
    options = {"device": "cpu:1", "reference": "cpu:0", "trials": 1, "inject": [], "out": None}
    with pytest.raises(ReportError, match="cannot read kernel case"):
        minimize_kernel(report_dir, {"start": {"from": "window"}}, **options)
    with pytest.raises(ReportError, match=f"has no {WORK_DIR}/{ENTRY_STATE_FILE}"):
        minimize_kernel(report_dir, {"start": {"from": "saved_state"}}, **options)
