"""From a command's result to the ledger's records: one per judged device.

Each command's JSON is a contract (``sdcreplay.replay/1``, ``bisect/1``, ``minimize/1``,
``screen/1``), and it names the judged devices' identities, so the records are read from
it: this module imports nothing of the pipeline that produced it. Online alarms and ring
dumps, which have no JSON, build theirs with `alarm_record` and `dump_record`.

Only evidence is recorded: a device that matched, diverged, failed or passed a reproducer.
A device whose process died, that was incomparable with the record, or undecided in a tie,
was not judged and gets no record. Every record carries the incident its evidence comes
from (``incident``: the bundle's identity, so the replay, bisect and minimize of one bundle
count once) and, when faults were injected (``--inject``, ``inject=`` or
``SDCREPLAY_INJECT``, or into the recording device of the bundle it judged: the JSON's
``recorded_faults``), the drill mark: ``drill`` and ``[drill: SPEC]`` in its evidence.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .identity import DeviceIdentity, identify
from .schema import Record

JOB_ENV = ("SLURM_JOB_ID", "SDCREPLAY_JOB_ID")
"""Where the scheduler's job id of this run is found, first set wins (docs/fleet.md)."""
JUDGED = ("match", "persistent", "intermittent")
INJECT_ENV = "SDCREPLAY_INJECT"  # capture.fault_spec's, read here without importing it


def current_job() -> str | None:
    return next((os.environ[name] for name in JOB_ENV if os.environ.get(name)), None)


def incident_of(manifest_digest: str | None) -> str | None:
    """A bundle's identity, the incident every record made from it names: its manifest's
    SHA-256 (a copy or a move of the bundle is the same incident)."""
    return f"bundle:{manifest_digest}" if manifest_digest else None


def drill_of(specs: Sequence[str] = (), recorded: Sequence[str] = ()) -> str | None:
    """The injected faults (``specs`` and ``SDCREPLAY_INJECT``'s, then ``recorded``: those of
    the judged bundle's recording device, ``recorded with SPEC``), or None: not a drill."""
    from_env = [s.strip() for s in os.environ.get(INJECT_ENV, "").split(";") if s.strip()]
    chosen = list(dict.fromkeys([*specs, *from_env]))
    chosen += [f"recorded with {spec}" for spec in dict.fromkeys(recorded)]
    return "; ".join(chosen) or None


def marked(records: list[Record], drill: str | None, incident: str | None) -> list[Record]:
    """The records, each naming its incident and, for a drill, marked as one (a record its
    converter already marked, a screen's pass of drill tickets only, keeps its mark)."""
    for record in records:
        record.incident = record.incident or incident
        mark = drill or record.drill
        if mark:
            record.drill = mark
            if f"[drill: {mark}]" not in record.evidence:
                record.evidence += f" [drill: {mark}]"
    return records


def _absolute(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


def _identity(identity: dict | None, label: str) -> DeviceIdentity:
    return DeviceIdentity.from_json(identity) if identity else identify(label)


def make_record(
    identity: DeviceIdentity, command: str, verdict: str, evidence: str, subject: str | None, **more
) -> Record:
    """A record for one device; its job is the scheduler's, else what was judged (``subject``)."""
    return Record(
        device_id=identity.id,
        label=identity.label,
        host=identity.host,
        command=command,
        verdict=verdict,
        evidence=evidence,
        job=current_job() or subject,
        bundle=subject,
        identity=identity.to_json(),
        **more,
    )


def bits_of(bits: dict | None) -> str | None:
    """``22`` or ``3,22``: the flipped bit positions of a forensics histogram."""
    histogram = (bits or {}).get("histogram") or {}
    return ",".join(sorted(histogram, key=int)) or None


def records_for(result: dict) -> list[Record]:
    """The records a command's JSON result makes; none for a schema that judges no device."""
    schema = result.get("schema")
    convert = _CONVERTERS.get(schema or "")
    if not convert:
        return []
    drill = drill_of(
        result.get("injected_faults") or result.get("inject") or [],
        result.get("recorded_faults") or [],
    )
    return marked(convert(result), drill, result.get("incident"))


def _replay(result: dict) -> list[Record]:
    """A replay's judged devices; a job's per rank (``ranks[].devices``)."""
    bundle = _absolute(result.get("bundle"))
    rows = [(row, None) for row in result.get("devices", [])] + [
        (row, rank.get("rank")) for rank in result.get("ranks", []) for row in rank["devices"]
    ]
    records = []
    for row, rank in rows:
        if row.get("verdict") not in JUDGED:
            continue
        first = row.get("first_divergence") or {}
        where = f", first at step {first['step']} {first['name']}" if first else ""
        evidence = (
            f"replay: {row['verdict']}, {row.get('divergent_repeats', 0)} of "
            f"{row.get('repeats', 0)} repeats diverge{where}"
        )
        records.append(
            make_record(
                _identity(row.get("identity"), row["device"]),
                "replay",
                row["verdict"],
                evidence,
                bundle,
                report=result.get("log_dir"),
                rank=rank,
                iteration=first.get("step"),
            )
        )
    consensus = result.get("consensus") or {}
    recorder = (result.get("record") or {}).get("identity")
    if consensus.get("verdict") == "recording_suspect" and recorder:
        identity = DeviceIdentity.from_json(recorder)
        evidence = "replay: the recording differs from every comparable replica"
        records.append(
            make_record(
                identity,
                "replay",
                "recording_suspect",
                evidence,
                bundle,
                report=result.get("log_dir"),
            )
        )
    return records


def _bisect(result: dict) -> list[Record]:
    identities = result.get("identities") or {}
    suspect = identities.get("suspect")
    if result.get("verdict") != "divergence" or not suspect:
        return []
    elements = result.get("elements") or {}
    element = (elements.get("indices") or [None])[0]
    bits = bits_of(result.get("bits"))
    what = result.get("op") or result.get("entry") or result.get("module")
    evidence = (
        f"bisect: step {result.get('step')} {result.get('phase')} {result.get('module')} {what}"
        + (f" element {element} of {elements.get('total')}" if element is not None else "")
        + (f" bit {bits}" if bits else "")
        + (f" ({result['isolated']})" if result.get("isolated") else "")
    )
    return [
        make_record(
            DeviceIdentity.from_json(suspect),
            "bisect",
            "divergence",
            evidence,
            _absolute(result.get("bundle")),
            report=result.get("report"),
            operator=result.get("op"),
            element=None if element is None else str(element),
            bits=bits,
            rank=result.get("rank"),
            iteration=result.get("step"),
        )
    ]


def _minimize(result: dict) -> list[Record]:
    identities = result.get("identities") or {}
    device = identities.get("device")
    if not device:
        return []
    first = result.get("first_mismatch") or {}
    bits = bits_of(result.get("bits"))
    low, high = result.get("ci95") or (None, None)
    reference_high = (result.get("reference_ci95") or (None, None))[1]
    reproduced = bool(result.get("reproduced"))
    evidence = (
        f"minimize: {result.get('op')} failed {result.get('failures')} of {result.get('trials')}"
        + (f" element {first['index']}" if first.get("index") is not None else "")
        + (f" bit {bits}" if bits else "")
        + (f", 95% interval {low:.3g} to {high:.3g}" if low is not None else "")
        + (f", reference at most {reference_high:.3g}" if reference_high is not None else "")
    )
    report = result.get("report") or ""
    return [
        make_record(
            DeviceIdentity.from_json(device),
            "minimize",
            "reproduced" if reproduced else "not reproduced",
            evidence,
            _bundle_of_report(report),
            report=result.get("ticket"),
            operator=result.get("op"),
            element=None if first.get("index") is None else str(first["index"]),
            bits=bits,
            rate=result.get("rate"),
            ci_low=low,
            ci_high=high,
            reference_ci_high=reference_high,
            iteration=(result.get("site") or {}).get("step"),
        )
    ]


def _bundle_of_report(report: str) -> str | None:
    """A bisect report ``X.bisect`` is about the bundle ``X``."""
    if not report:
        return None
    path = Path(report).resolve()
    return str(path.with_name(path.name.removesuffix(".bisect")))


def _screen(result: dict) -> list[Record]:
    corpus = _absolute(result.get("corpus"))
    records = []
    for row in result.get("devices", []):
        if row.get("status") not in ("passed", "failed"):
            continue
        failure: dict[str, Any] = row.get("failure") or {}
        ticket = failure.get("ticket") or {}
        if row["status"] == "failed":
            evidence = (
                f"screen: ticket {ticket.get('key')} {ticket.get('op')} failed at trial "
                f"{failure.get('trial')} of {failure.get('trials')}"
                + (f" element {failure['element']}" if failure.get("element") is not None else "")
                + (f" bit {failure['bits']}" if failure.get("bits") else "")
            )
        else:
            evidence = f"screen: passed {row.get('tickets_passed', 0)} tickets"
        records.append(
            make_record(
                _identity(row.get("identity"), row["device"]),
                "screen",
                row["status"],
                evidence,
                corpus,
                report=ticket.get("path"),
                operator=ticket.get("op"),
                element=None if failure.get("element") is None else str(failure["element"]),
                bits=failure.get("bits"),
                drill=_passed_drills_only(row, result.get("drills") or {}),
            )
        )
    return records


def _passed_drills_only(row: dict, drills: dict[str, list[str]]) -> str | None:
    """A pass of drill tickets only tests the tooling: a drill (their faults). A failure is
    evidence even on a drill ticket: no fault was injected into this device's trials."""
    passed = [t["key"] for t in row.get("tickets", []) if t.get("status") == "passed"]
    if row.get("status") != "passed" or not passed or any(key not in drills for key in passed):
        return None
    return "; ".join(dict.fromkeys(f for key in passed for f in drills[key])) or "drill tickets"


_CONVERTERS = {
    "sdcreplay.replay/1": _replay,
    "sdcreplay.bisect/1": _bisect,
    "sdcreplay.minimize/1": _minimize,
    "sdcreplay.screen/1": _screen,
}


def alarm_record(
    label: str,
    step: int,
    classification: str,
    reasons: str,
    *,
    contradicted_by: str | None = None,
    bundle: str | None = None,
) -> Record:
    """An online detector's alarm on ``label``: a finding only when another device computed
    the step otherwise (its second opinion); a same-device alarm is history."""
    verdict = "persistent" if contradicted_by else f"alarm ({classification})"
    evidence = f"alarm: step {step} {reasons} -> {classification}" + (
        f", {contradicted_by} computed otherwise" if contradicted_by else ""
    )
    record = make_record(
        identify(label), "alarm", verdict, evidence, _absolute(bundle), iteration=step
    )
    return marked([record], drill_of(), None)[0]


def dump_record(
    label: str, reason: str, bundle: str, first_step: int | None, recorded: Sequence[str] = ()
) -> Record:
    """A ring buffer's dump: where the evidence of an alarm now lies (history, not a finding);
    ``recorded``: the faults the recording device had injected (a drill's)."""
    record = make_record(
        identify(label),
        "dump",
        "dumped",
        f"dump: {reason}",
        _absolute(bundle),
        report=_absolute(bundle),
        iteration=first_step,
    )
    return marked([record], drill_of(recorded=recorded), None)[0]
