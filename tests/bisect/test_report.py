"""The bisect report directory is written whole or not at all: a run that fails leaves the
report already there as it was (minimize can still read it), one that succeeds replaces it
only when asked (``--overwrite``, ``overwrite=True``) and then moves it aside with the tickets
in it, and no directory that is not a report is ever replaced."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sdcreplay.bisect.localize import bisect
from sdcreplay.bisect.operator_case import OPERATOR_FILE
from sdcreplay.bisect.report import REPORT_FILE, STAGING_SUFFIX
from sdcreplay.errors import SdcReplayError
from sdcreplay.minimize.report import load_report

FLIP = (
    "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index={index},bit=13,"
    "device=cpu:1"
)
TOO_WIDE = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,step=1,bit=40,device=cpu:1"


def _bisect(bundle: Path, out: Path, spec: str, overwrite: bool = False):
    return bisect(
        bundle,
        suspect="cpu:1",
        reference="cpu:0",
        step=1,
        inject=[spec],
        out=out,
        overwrite=overwrite,
        ledger=False,
    )


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def test_a_failed_bisect_leaves_the_good_report_whole(small_bundle: Path, tmp_path: Path):
    out = tmp_path / "report"
    first = _bisect(small_bundle, out, FLIP.format(index=5))
    assert first.verdict == "divergence" and first.findings["elements"]["indices"] == [5]
    written = json.loads((out / REPORT_FILE).read_text())
    assert written["report"] == str(out)
    assert not [s for s in _strings(written) if STAGING_SUFFIX in s]  # paths name the report
    report_bytes, case_bytes = (out / REPORT_FILE).read_bytes(), (out / OPERATOR_FILE).read_bytes()

    with pytest.raises(SdcReplayError, match="bit 40 does not exist"):
        _bisect(small_bundle, out, TOO_WIDE, overwrite=True)
    assert (out / REPORT_FILE).read_bytes() == report_bytes
    assert (out / OPERATOR_FILE).read_bytes() == case_bytes
    report, case = load_report(out)  # what minimize starts from
    assert report["elements"]["indices"] == [5] and case.op == "aten.mm.default"
    assert not list(tmp_path.glob(f"report.*{STAGING_SUFFIX}"))  # the failed run's: discarded

    second = _bisect(small_bundle, out, FLIP.format(index=6), overwrite=True)
    assert second.findings["elements"]["indices"] == [6]
    assert json.loads((out / REPORT_FILE).read_text())["elements"]["indices"] == [6]
    moved = Path(second.findings["moved_aside"])
    assert (moved / REPORT_FILE).read_bytes() == report_bytes  # the first report, whole
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["report", moved.name, "small.bundle"])


def test_a_directory_that_is_not_a_report_is_never_replaced(small_bundle: Path, tmp_path: Path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    for out in (mine, small_bundle):
        with pytest.raises(SdcReplayError) as info:
            _bisect(small_bundle, out, FLIP.format(index=5))
        assert info.value.message == (
            f"{out} exists and is not a bisect report, so it is not replaced"
        )
    assert (mine / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "small.bundle"]


def test_a_report_directory_that_cannot_be_made_is_a_clean_error(small_bundle: Path, tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SdcReplayError, match="cannot create the report directory"):
        _bisect(small_bundle, tmp_path / "a-file" / "x", FLIP.format(index=5))


def test_a_plot_inside_the_report_directory_lands_there(small_bundle: Path, tmp_path: Path, cli):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    _bisect(small_bundle, out, FLIP.format(index=5))  # a report there already, to be replaced
    result = cli(
        "bisect", small_bundle, "--suspect", "cpu:1", "--step", "1", "--inject",
        FLIP.format(index=7), "--out", out, "--plot", out / "heatmap.png", "--overwrite",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / REPORT_FILE).read_text())["plot"] == str(out / "heatmap.png")
    assert f"Plot: {out / 'heatmap.png'}" in result.stderr


def test_a_report_holding_a_ticket_is_replaced_only_when_asked_and_then_moved_aside(
    small_bundle: Path, tmp_path: Path, cli, tickets: list[Path]
):
    out = tmp_path / "report"
    _bisect(small_bundle, out, FLIP.format(index=5))
    shutil.copytree(tickets[0], out / "ticket")  # what `sdcreplay minimize REPORT` writes there
    ticket_bytes = (out / "ticket" / "ticket.json").read_bytes()
    report_bytes = (out / REPORT_FILE).read_bytes()
    message = f"{out} already exists (a bisect report, holding the minimize ticket ticket/)"

    with pytest.raises(SdcReplayError) as info:  # the Python API
        _bisect(small_bundle, out, FLIP.format(index=6))
    assert info.value.message == message
    assert info.value.python_hint == (
        "Pass overwrite=True to replace it (the old one is moved aside to "
        "report.old-<time>-<pid>-<random>), or choose another out=."
    )
    args = ["bisect", small_bundle, "--suspect", "cpu:1", "--step", "1", "--out", out]
    args += ["--inject", FLIP.format(index=7), "--no-ledger"]
    refused = cli(*args)  # the command line
    assert refused.exit_code == 3 and "Traceback" not in refused.output
    said = " ".join(refused.stderr.split())
    assert f"Error: {message}" in said
    assert "Hint: Pass --overwrite to replace it (the old one is moved aside to report.old-" in said
    assert (out / REPORT_FILE).read_bytes() == report_bytes
    assert (out / "ticket" / "ticket.json").read_bytes() == ticket_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report", "small.bundle"]  # no run

    done = cli(*args, "--overwrite", "--json")
    assert done.exit_code == 1, done.output
    written = json.loads(done.stdout)
    moved = Path(written["moved_aside"])
    assert moved.parent == tmp_path and moved.name.startswith("report.old-")
    assert (moved / "ticket" / "ticket.json").read_bytes() == ticket_bytes
    assert (moved / REPORT_FILE).read_bytes() == report_bytes
    assert written["elements"]["indices"] == [7] and not (out / "ticket").exists()
    assert f"The report that was there is now {moved}" in " ".join(done.stderr.split())
