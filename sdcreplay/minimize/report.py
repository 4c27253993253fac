"""What minimize takes from a bisect report: the operator case it names, and the switches the
bundle was recorded with, so the call computes here the bits it computed there."""

from __future__ import annotations

import json
from pathlib import Path

from ..bisect.operator_case import OPERATOR_FILE, OperatorCase
from ..bisect.report import REPORT_FILE
from ..bisect.report import SCHEMA as BISECT_SCHEMA
from ..bundle.reader import Bundle
from ..capture import determinism
from ..errors import BundleError, ReportError


def read_report(report_dir: str | Path) -> dict:
    """``report.json`` of a bisect report directory, checked to be one."""
    path = Path(report_dir)
    if not path.is_dir():
        raise ReportError(f"{path} is not a bisect report directory")
    try:
        report = json.loads((path / REPORT_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ReportError(f"{path} has no {REPORT_FILE}") from exc
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path / REPORT_FILE} is not readable JSON: {exc}") from exc
    if not isinstance(report, dict) or report.get("schema") != BISECT_SCHEMA:
        raise ReportError(f"{path / REPORT_FILE} is not a bisect report (schema {BISECT_SCHEMA})")
    return report


def load_report(report_dir: str | Path) -> tuple[dict, OperatorCase]:
    """``report.json`` and ``operator.h5`` of a bisect report that names an operator call."""
    path = Path(report_dir)
    report = read_report(path)
    if report.get("verdict") != "divergence" or not report.get("op"):
        raise ReportError(
            f"the report in {path} names no operator call (verdict {report.get('verdict')}, "
            f"isolated {report.get('isolated')})",
            "minimize starts from a bisect that named a corrupted operator; "
            "bisect with --suspect first.",
            python_hint="minimize starts from a bisect that named a corrupted operator; "
            "bisect(bundle, suspect=LABEL) first.",
        )
    if not (path / OPERATOR_FILE).is_file():
        raise ReportError(f"{path} has no {OPERATOR_FILE} (the operator's inputs and outputs)")
    try:
        case = OperatorCase.read(path / OPERATOR_FILE)
    except BundleError as exc:
        raise ReportError(f"cannot read {path / OPERATOR_FILE}: {exc.message}") from exc
    return report, case


def deterministic_switches(report: dict, report_dir: Path, warnings: list[str]) -> dict:
    """Put in force the switches the bundle was recorded with (TF32, threads... change the bits)."""
    recorded = Path(report.get("bundle") or "")
    found = next(
        (
            path
            for path in (recorded, report_dir.parent / recorded.name)
            if report.get("bundle") and path.is_dir()
        ),
        None,
    )
    if found is None:
        warnings.append(
            f"bundle {report.get('bundle')} not found: "
            "running with the default deterministic switches"
        )
        return determinism.enable()
    determinism.apply(Bundle.open(found, verify=False).manifest.determinism.to_json())
    return determinism.current_switches()
