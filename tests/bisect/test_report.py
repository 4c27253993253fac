"""The bisect report directory is written whole or not at all: a run that fails leaves the
report already there as it was (minimize can still read it), one that succeeds replaces it,
and no directory that is not a report is ever replaced."""

from __future__ import annotations

import json
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


def _bisect(bundle: Path, out: Path, spec: str):
    return bisect(bundle, suspect="cpu:1", reference="cpu:0", step=1, inject=[spec], out=out)


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
        _bisect(small_bundle, out, TOO_WIDE)
    assert (out / REPORT_FILE).read_bytes() == report_bytes
    assert (out / OPERATOR_FILE).read_bytes() == case_bytes
    report, case = load_report(out)  # what minimize starts from
    assert report["elements"]["indices"] == [5] and case.op == "aten.mm.default"
    assert (tmp_path / f"report{STAGING_SUFFIX}" / "work").is_dir()  # the failed run's logs

    second = _bisect(small_bundle, out, FLIP.format(index=6))
    assert second.findings["elements"]["indices"] == [6]
    assert json.loads((out / REPORT_FILE).read_text())["elements"]["indices"] == [6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report", "small.bundle"]


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
        FLIP.format(index=7), "--out", out, "--plot", out / "heatmap.png",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / REPORT_FILE).read_text())["plot"] == str(out / "heatmap.png")
    assert f"Plot: {out / 'heatmap.png'}" in result.stderr
