"""Compare signature logs: structure first, values second, then vote.

A structural difference (other steps, other entries, other order) means a
different program or configuration, never SDC, so it raises StructureError
instead of being reported as a divergence. Values are compared in execution
order; the first divergent entry is where the corruption became visible.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..bundle.reader import Bundle
from ..capture.signature import (
    SignatureLog,
    coarser,
    is_program_entry,
    layer_of,
    phase_of,
    read_signature_log,
)
from ..errors import BundleError, StructureError
from ..kinds import SIGNATURE_LEVELS, ConsensusVerdict, DeviceVerdictName
from ..workload.references import builtin_defaults

RECORD = "record"


@dataclass
class Divergence:
    step: int
    name: str
    expected: str
    actual: str

    @property
    def phase(self) -> str:
        return phase_of(self.name)

    @property
    def layer(self) -> str:
        return layer_of(self.name)

    def brief(self) -> dict:
        return {"step": self.step, "phase": self.phase, "name": self.name}


@dataclass
class Comparison:
    steps: list[int]
    entries: int
    divergences: list[Divergence] = field(default_factory=list)
    plot: str | None = None  # the divergence map drawn for it, if one was asked for
    ranks: list[int] | None = None  # two ranks' logs (a job's), each with its messages

    @property
    def identical(self) -> bool:
        return not self.divergences

    @property
    def first(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    def per_step(self) -> dict[int, int]:
        counts = Counter(d.step for d in self.divergences)
        return {step: counts.get(step, 0) for step in self.steps}

    def per_layer(self) -> dict[str, dict[str, int]]:
        """For each layer, how many forward/backward/... entries diverge (from the first on)."""
        table: dict[str, Counter] = {}
        for divergence in self.divergences:
            table.setdefault(divergence.layer, Counter())[divergence.phase] += 1
        return {layer: dict(counts) for layer, counts in table.items()}

    @property
    def program_differs(self) -> bool:
        """The first divergence is a program entry (hyper-parameters, state objects): not SDC."""
        return self.first is not None and is_program_entry(self.first.name)

    @property
    def exit_code(self) -> int:
        return 0 if self.identical else 1

    def to_json(self) -> dict:
        first = self.first
        extra: dict = {"plot": self.plot} if self.plot is not None else {}
        if self.ranks is not None:
            extra["ranks"] = self.ranks
        return {
            "schema": "sdcreplay.diff/1",
            "identical": self.identical,
            "program_differs": self.program_differs,
            "steps": self.steps,
            "entries": self.entries,
            "first_divergence": None
            if first is None
            else {**first.brief(), "expected": first.expected, "actual": first.actual},
            "divergent_entries": len(self.divergences),
            "per_step": {str(step): count for step, count in self.per_step().items()},
            "per_layer": self.per_layer(),
        } | extra


def load_log(path: str | Path) -> SignatureLog:
    """A bundle directory's recorded log, or a replay log file."""
    path = Path(path)
    if path.is_dir() or path.with_name(path.name + ".partial").is_dir():
        bundle = Bundle.open(path)
        log = bundle.signature_log()
        log.meta.setdefault(
            "workload", {"ref": bundle.workload_ref, "kwargs": bundle.workload_kwargs}
        )
        return log
    if not path.exists():
        raise BundleError(
            f"{path} does not exist", "Give a bundle directory or a replay log (*.sig.zst)."
        )
    log = read_signature_log(path)
    if "workload" not in log.meta and log.meta.get("source"):
        # A replay log names the bundle it replayed; its workload is the replay's program.
        with contextlib.suppress(BundleError, OSError, KeyError, TypeError, ValueError):
            source = Bundle.open(log.meta["source"], verify=False)
            log.meta["workload"] = {"ref": source.workload_ref, "kwargs": source.workload_kwargs}
    return log


def _effective_kwargs(workload: dict) -> dict:
    """The workload's keyword arguments, with a built-in factory's defaults filled in.

    Only built-in factories are inspected, from their source: diff never imports a workload
    named in a file it was given (that would run a stranger's code), nor torch.
    """
    kwargs = dict(workload.get("kwargs") or {})
    ref = workload.get("ref")
    if isinstance(ref, str) and ref.startswith("builtin:"):
        kwargs = builtin_defaults(ref) | kwargs
    return kwargs


def _workload_difference(left: dict, right: dict) -> str | None:
    """``builtin:x vs file.py:y``, or the keyword arguments that differ (``dim=32 vs dim=48``),
    or None.

    A keyword argument given on one side only (a default of a factory that is
    not built in) cannot be compared and is left out.
    """
    if left.get("ref") != right.get("ref"):
        return f"workload {left.get('ref')} vs {right.get('ref')}"
    a, b = _effective_kwargs(left), _effective_kwargs(right)
    keys = sorted(key for key in set(a) & set(b) if a[key] != b[key])
    if not keys:
        return None
    show = lambda kwargs: ", ".join(f"{key}={kwargs[key]}" for key in keys)  # noqa: E731
    return f"workload {left.get('ref')} with {show(a)} vs {show(b)}"


def check_comparable(a: SignatureLog, b: SignatureLog) -> None:
    """Refuse to compare logs whose digests cannot be equal on a healthy device."""
    for key in ("device_type", "digest"):
        left, right = a.meta.get(key), b.meta.get(key)
        if left and right and left != right:
            raise StructureError(
                f"the logs were made with a different {key.replace('_', ' ')}: {left} vs {right}",
                "Floating-point results differ between device types by design; "
                "replay on the device type the record was made on.",
            )
    left, right = a.meta.get("workload"), b.meta.get("workload")
    difference = (
        _workload_difference(left, right)
        if isinstance(left, dict) and isinstance(right, dict)
        else None
    )
    if difference:
        # Same entry names, other sizes or settings: every digest differs, and none of it is SDC.
        raise StructureError(
            f"the logs describe different programs: {difference}",
            "This is a different workload or configuration, not silent data corruption; "
            "record and replay the same program.",
        )


def check_structure(reference: SignatureLog, candidate: SignatureLog, steps: list[int]) -> None:
    """Same steps, same entries in the same order, at the level both logs hold (a record of
    the ``boundary`` level against a replay's ``layer`` log: the replay's boundary entries)."""
    level = coarser(reference.level, candidate.level)
    reference, candidate = reference.at(level), candidate.at(level)
    for step in steps:
        if step not in reference.steps or step not in candidate.steps:
            where = "first" if step not in reference.steps else "second"
            raise StructureError(
                f"step {step} is missing from the {where} log "
                f"(steps {sorted(reference.steps)} vs {sorted(candidate.steps)})"
            )
        left = [name for name, _ in reference.steps[step]]
        right = [name for name, _ in candidate.steps[step]]
        if left == right:
            continue
        position = next(
            (i for i, (x, y) in enumerate(zip(left, right)) if x != y), min(len(left), len(right))
        )
        raise StructureError(
            f"the logs describe different programs: step {step}, entry {position}: "
            f"{_entry_at(left, position)!r} vs {_entry_at(right, position)!r} "
            f"({len(left)} vs {len(right)} entries)",
            "This is a different workload, configuration or code version, "
            "not silent data corruption; "
            "record and replay the same program."
            if reference.naming == candidate.naming
            else "One log names modules as named_modules() does, wrappers' segments included "
            "(a bundle recorded before names were plain), the other by their plain names: "
            "compare each bundle with its own replay.",
        )


def _entry_at(names: list[str], position: int) -> str:
    return names[position] if position < len(names) else "(end of step)"


def compare_logs(
    reference: SignatureLog, candidate: SignatureLog, steps: list[int] | None = None
) -> Comparison:
    """Every divergent entry of ``candidate`` against ``reference``, in execution order.

    ``steps`` limits the comparison (a replay may stop early); by default both
    logs must hold the same steps. Logs of two levels are compared at the entries both hold.
    """
    check_comparable(reference, candidate)
    level = coarser(reference.level, candidate.level)
    reference, candidate = reference.at(level), candidate.at(level)
    if steps is None:
        if sorted(reference.steps) != sorted(candidate.steps):
            raise StructureError(
                f"the logs hold different steps: {sorted(reference.steps)} "
                f"vs {sorted(candidate.steps)}"
            )
        steps = sorted(reference.steps)
    check_structure(reference, candidate, steps)
    comparison = Comparison(steps=list(steps), entries=sum(len(reference.steps[s]) for s in steps))
    for step in steps:
        for (name, expected), (_, actual) in zip(reference.steps[step], candidate.steps[step]):
            if expected != actual:
                comparison.divergences.append(Divergence(step, name, expected, actual))
    return comparison


def diff(first: str | Path, second: str | Path, plot: str | Path | None = None) -> Comparison:
    """What ``sdcreplay diff`` does: compare two logs (bundles or replay logs), optionally plot."""
    reference = load_log(first)
    comparison = compare_logs(reference, load_log(second))
    if plot is not None:
        from .plot import plot_divergence_map

        plot_divergence_map(reference, comparison, plot)
        comparison.plot = str(plot)
    return comparison


@dataclass
class DeviceVerdict:
    """How one voter's runs compare with the majority."""

    verdict: DeviceVerdictName
    runs: int
    divergent_runs: int
    first_divergence: Divergence | None
    per_step: dict[int, int]  # divergent entries per step, in the first divergent run


@dataclass
class Consensus:
    """Majority vote over every entry; the record counts as one voter.

    ``incomparable`` names, per voter whose machine differs from the
    recording's in a result-affecting property or whose kernel probe gives
    other bits, what differs: such a voter never votes against the record.
    ``missing`` says what the case against the recording device lacks when the
    record alone is out of line but the verdict is ``undecided`` for it.
    """

    verdict: ConsensusVerdict
    suspects: list[str]
    first_divergence: Divergence | None
    voters: dict[str, DeviceVerdict]
    undecided_entries: int = 0
    incomparable: dict[str, list[str]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @property
    def advice(self) -> str | None:
        """What would turn this answer into a decision, or None when it is one."""
        if self.verdict == "undecided" and self.missing:
            return (
                "every comparable replica agrees with the others but not with the record, and "
                "that accuses the recording device only with the whole case; missing: "
                + "; ".join(self.missing)
            )
        if self.verdict == "undecided":
            tied = ", ".join(label for label, v in self.voters.items() if v.verdict == "undecided")
            entries = (
                f"{self.undecided_entries} entr{'y' if self.undecided_entries == 1 else 'ies'}"
            )
            return (
                f"{tied} are tied at {entries} (as many voters on each side): "
                "replay on at least 1 more device of the recording's kind (same model, driver and "
                "software, see `sdcreplay info`); the side it joins decides"
            )
        if self.verdict == "incomparable":
            properties = sorted(
                {d.split(":", 1)[0] for diffs in self.incomparable.values() for d in diffs}
                - {"probe"}
            )
            kernels = sorted(
                {
                    d.removeprefix("probe: ").rpartition(" gives")[0]
                    for diffs in self.incomparable.values()
                    for d in diffs
                    if d.endswith("gives other bits here")
                }
            )
            why = []
            if properties:
                why.append(f"{', '.join(properties)} differ")
            if kernels:
                why.append(f"the kernel probe gives other bits on {'; '.join(kernels[:3])}")
            return (
                f"no replica ran on a machine comparable with the recording ({'; '.join(why)}): "
                "replay on a device of the recording's kind (`sdcreplay doctor --against "
                "BUNDLE` says whether a machine can judge it)"
            )
        return None

    def to_json(self) -> dict:
        first = self.first_divergence
        return {
            "verdict": self.verdict,
            "suspects": self.suspects,
            "first_divergence": None if first is None else first.brief(),
            "undecided_entries": self.undecided_entries,
            "incomparable": self.incomparable,
            "missing": self.missing,
            "advice": self.advice,
        }


def _modal(values: list[str]) -> str:
    counts = Counter(values)
    best = max(counts.values())
    return next(value for value in values if counts[value] == best)


Ballots = dict[int, list[str | None]]
"""A voter's value at each entry of each step of the full log; None: it has no say there."""


def _ballots(logs: list[SignatureLog], names: dict[int, list[str]], steps: list[int]) -> Ballots:
    """A voter's most frequent value over its runs, at each entry its logs hold."""
    ballots: Ballots = {}
    for step in steps:
        runs = [dict(log.steps[step]) for log in logs]
        ballots[step] = [
            _modal([run[name] for run in runs]) if name in runs[0] else None for name in names[step]
        ]
    return ballots


def _record_ballots(
    record: SignatureLog,
    replicas: dict[str, Ballots],
    names: dict[int, list[str]],
    steps: list[int],
) -> Ballots:
    """The record's ballots: its own value at each entry it holds; at an entry its level lacks
    (a ``boundary`` record's layers), the value of the replicas that reproduce every entry it
    holds of that step, where they all agree (a deterministic step that ends in the same
    boundary computed the same inside), else no say."""
    ballots: Ballots = {}
    for step in steps:
        held = dict(record.steps[step])
        agreeing = [
            replica[step]
            for replica in replicas.values()
            if all(
                replica[step][position] == held[name]
                for position, name in enumerate(names[step])
                if name in held
            )
        ]
        row: list[str | None] = []
        for position, name in enumerate(names[step]):
            if name in held:
                row.append(held[name])
                continue
            values = {replica[position] for replica in agreeing}
            row.append(values.pop() if len(values) == 1 else None)
        ballots[step] = row
    return ballots


def _tally(voters: dict[str, list[SignatureLog]], steps: list[int]) -> tuple[SignatureLog, set]:
    """The winning value of every entry, and the entries ``(step, name)`` that are tied.

    Each voter votes with its most frequent value over its runs. A value wins
    when more voters hold it than any other value and at least two agree (so
    three healthy replicas outvote seven that are each wrong in their own way);
    at a tie the first voter's (the record's) value stands in the log. The entries are
    those of the voter whose log holds most (a replica's every layer); a record of a
    coarser level votes as ``_record_ballots`` says.
    """
    full = min(
        (log for logs in voters.values() for log in logs),
        key=lambda log: SIGNATURE_LEVELS.index(log.level),
    )
    names = {step: [name for name, _ in full.steps[step]] for step in steps}
    replicas = {
        voter: _ballots(logs, names, steps) for voter, logs in voters.items() if voter != RECORD
    }
    ballots = dict(replicas)
    if RECORD in voters:
        record = voters[RECORD][0]
        ballots = {RECORD: _record_ballots(record, replicas, names, steps), **replicas}
    reference = SignatureLog(meta={**full.meta, "role": "consensus"})
    ties = set()
    for step in steps:
        entries = []
        for position, name in enumerate(names[step]):
            cast = [row[step][position] for row in ballots.values()]
            present = [value for value in cast if value is not None]
            ranked = Counter(present).most_common(2)
            value = ranked[0][0]
            if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
                value = present[0]
                ties.add((step, name))
            entries.append((name, value))
        reference.steps[step] = entries
    return reference, ties


def _judge(
    reference: SignatureLog, logs: list[SignatureLog], steps: list[int], ties: set
) -> DeviceVerdict:
    """A voter's verdict against the majority; a voter that differs only at ties is
    ``undecided``."""
    comparisons = [compare_logs(reference, log, steps) for log in logs]
    divergent = [c for c in comparisons if not c.identical]
    decided = [c for c in divergent if any((d.step, d.name) not in ties for d in c.divergences)]
    # A divergent comparison has at least one divergence, so its first one exists.
    firsts = [c.divergences[0] for c in divergent]
    first = min(firsts, key=lambda d: (d.step, _position(reference, d))) if firsts else None
    kind: DeviceVerdictName
    if ties and len(decided) < len(logs):
        kind = "undecided"
    elif not divergent:
        kind = "match"
    else:
        kind = "persistent" if len(divergent) == len(logs) else "intermittent"
    per_step = (divergent or comparisons)[0].per_step()
    return DeviceVerdict(kind, len(logs), len(divergent), first, per_step)


def vote(
    record: SignatureLog,
    replicas: dict[str, list[SignatureLog]],
    incomparable: dict[str, list[str]] | None = None,
    case_gaps: list[str] | None = None,
) -> Consensus:
    """Judge every replica run, and the record, against the majority.

    A voter whose runs all diverge is ``persistent``, one whose runs diverge
    only sometimes ``intermittent``. When only the record is out of line, the
    device that recorded it is the suspect (the usual case: the alert came from
    the defective GPU itself). Where an entry is tied (see ``_tally``), the
    voters that differ only there are ``undecided``, and the consensus's
    ``advice`` says what would decide it. Replicas named in ``incomparable``
    (their machine differs from the recording's) vote only among replicas with
    the same differences: they can show one of them is odd, never that the
    record is. The record is the suspect only on the whole case: at least two
    comparable replicas agreeing against it (one is a tie), and nothing in
    ``case_gaps`` (what the caller knows is missing: an unverified recording, no
    kernel probe); short of it the verdict is ``undecided`` and ``missing`` says why.
    A record of a coarser level than the replicas' (``boundary``) is judged at the entries
    it holds, the replicas at every entry (``_record_ballots``: how the record votes there).
    """
    incomparable = {
        label: diffs for label, diffs in (incomparable or {}).items() if label in replicas
    }
    steps = sorted(record.steps)
    first_replica = next((log for logs in replicas.values() for log in logs), record)
    for logs in replicas.values():
        for log in logs:
            check_comparable(record, log)
            check_structure(record, log, steps)  # at the record's level
            check_structure(first_replica, log, steps)  # at every entry
    voters = {RECORD: [record], **{k: v for k, v in replicas.items() if k not in incomparable}}
    reference, ties = _tally(voters, steps)
    verdicts = {voter: _judge(reference, logs, steps, ties) for voter, logs in voters.items()}
    peers: dict[tuple, dict[str, list[SignatureLog]]] = {}
    for label, differences in incomparable.items():
        peers.setdefault(tuple(differences), {})[label] = replicas[label]
    for others in peers.values():  # machines alike among themselves, unlike the recording's
        own_reference, own_ties = _tally(others, steps)
        for label, logs in others.items():
            judged = _judge(own_reference, logs, steps, own_ties)
            verdicts[label] = (
                judged
                if judged.verdict in ("persistent", "intermittent")
                else DeviceVerdict("incomparable", judged.runs, 0, None, {})
            )
    refuse_program_difference(verdicts)
    suspects = [
        voter for voter, v in verdicts.items() if v.verdict in ("persistent", "intermittent")
    ]
    missing: list[str] = []  # what the case against the record lacks
    replica_kinds = {v.verdict for voter, v in verdicts.items() if voter != RECORD}
    verdict: ConsensusVerdict
    if len(voters) == 1 and incomparable:
        verdict = "incomparable"
    elif ties:
        verdict = "undecided"
    elif "persistent" in replica_kinds:
        verdict = "persistent"
    elif "intermittent" in replica_kinds:
        verdict = "transient"
    elif verdicts[RECORD].verdict != "match":
        verdict = "recording_suspect"
        missing += case_gaps or []
        if missing:
            verdict = "undecided"
            suspects = []
    else:
        verdict = "correct"
    firsts = [v.first_divergence for v in verdicts.values() if v.first_divergence is not None]
    first = min(firsts, key=lambda d: (d.step, _position(reference, d))) if firsts else None
    return Consensus(verdict, suspects, first, verdicts, len(ties), incomparable, missing)


def refuse_program_difference(verdicts: dict[str, DeviceVerdict]) -> None:
    """A voter whose first divergence is a program entry ran another program: blame no device."""
    for voter, judgement in verdicts.items():
        first = judgement.first_divergence
        if first is not None and is_program_entry(first.name):
            raise StructureError(
                f"the replayed program differs from the recorded one: {voter} first differs "
                f"at step {first.step} in {first.name} "
                f"(the majority has {first.expected}, {voter} {first.actual})",
                "This is the training loop, not the device: the workload's step does not do what "
                "the recorded loop did (a scheduler, GradScaler or other state outside the "
                "workload's step?). "
                "See docs/recording.md.",
            )


def _position(log: SignatureLog, divergence: Divergence) -> int:
    names = [name for name, _ in log.steps[divergence.step]]
    return names.index(divergence.name)
