"""What minimize takes from a bisect report: the operator case it names, and the switches the
bundle was recorded with, so the call computes here the bits it computed there.

A report of a job's rank (``bisect JOB --rank R``, with ``--alone`` or not) names a call made
on that rank: its bundle is the job's, and what the call was recorded with is rank R's part
(`recorded_part`). The call itself needs no peers; where it ran in the job (`job_of`) goes
into the ticket."""

from __future__ import annotations

import json
from pathlib import Path

from ..bisect.operator_case import OPERATOR_FILE, OperatorCase
from ..bisect.report import REPORT_FILE
from ..bisect.report import SCHEMA as BISECT_SCHEMA
from ..bundle.job_bundle import JobBundle, is_job_bundle
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


def report_bundle(report: dict, report_dir: Path) -> Path | None:
    """The report's bundle where its bisect named it (a relative path: in the directory that
    bisect ran in, found from the report's own path), or beside the report (None: found in
    neither place)."""
    if not report.get("bundle"):
        return None
    recorded = Path(report["bundle"])
    written = Path(report.get("report") or "").parts  # the report's path as bisect named it
    here = report_dir.absolute().parts
    places = [recorded, report_dir.parent / recorded.name]
    if written and not recorded.is_absolute() and here[-len(written) :] == written:
        places.insert(0, Path(*here[: -len(written)], recorded))  # where bisect ran
    return next((path for path in places if path.is_dir()), None)


def report_rank(report: dict) -> int | None:
    """The job rank a report's call was made on (None: a single process's report)."""
    rank = report.get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def recorded_part(path: Path, report: dict, verify: bool = True) -> Bundle:
    """The single-process bundle the call was recorded in: the bundle, or a job's rank part."""
    rank = report_rank(report)
    if rank is None or not is_job_bundle(path):
        return Bundle.open(path, verify=verify)
    return JobBundle.open(path, verify=verify).rank(rank)


def job_of(report: dict, report_dir: Path) -> dict | None:
    """Where a job's call ran: the job, the rank, its coordinates in the mesh, how the rank
    was bisected, and the collectives around the call (None: a single process's report)."""
    rank = report_rank(report)
    if rank is None:
        return None
    found = report_bundle(report, report_dir)
    job = JobBundle.open(found, verify=False) if found and is_job_bundle(found) else None
    layout = job.layout if job is not None else None
    return {
        "bundle": report.get("bundle"),
        "rank": rank,
        "world_size": job.world_size if job is not None else None,
        "backend": job.backend if job is not None else None,
        "mesh": layout.shape() if layout is not None else None,
        "coordinates": layout.coordinates_of(rank) if layout is not None else None,
        "where": layout.describe(rank) if layout is not None else f"rank {rank}",
        "alone": bool(report.get("alone")),
        "collectives": report.get("collectives"),
    }


def deterministic_switches(report: dict, report_dir: Path, warnings: list[str]) -> dict:
    """Put in force the switches the bundle was recorded with (TF32, threads... change the bits)."""
    found = report_bundle(report, report_dir)
    if found is None:
        warnings.append(
            f"bundle {report.get('bundle')} not found: "
            "running with the default deterministic switches"
        )
        return determinism.enable()
    part = recorded_part(found, report, verify=False)
    determinism.apply(part.manifest.determinism.to_json())
    return determinism.current_switches()
