"""What ``replay`` and ``diff`` tell a person: each device's vote on the record, the
verdict, and where two logs (or a job's ranks) first part.

The result types are imported only for type checking, the job types inside the renderer
that tells them apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape

from .output import Output, styled

if TYPE_CHECKING:
    from ..compare.jobs import JobComparison
    from ..compare.logs import Comparison, Consensus
    from ..compare.origin import Origin
    from ..replay.job_report import JobReplayReport
    from ..replay.replicas import DeviceRun, ReplayReport


def _step_marks(per_step: dict[str, int]) -> str:
    """One mark per step: a check for a bit-identical step, the divergent entry count otherwise;
    ``-`` for a voter judged on no step (the record of a rank replayed alone judges, it is not
    judged)."""
    if not per_step:
        return "-"
    return " ".join(
        f"{step}:[green]ok[/]" if count == 0 else f"{step}:[red]{count}[/]"
        for step, count in per_step.items()
    )


def _device_rows(
    runs: list[DeviceRun], consensus: Consensus | None, record_spread_from: int | None = None
) -> list[list[str]]:
    """``record_spread_from``: in a job, the origin rank whose corruption reached this rank's
    record (the record's verdict is then ``spread``)."""
    rows = []
    for run in runs:
        data = run.to_json()
        first = data["first_divergence"]
        where = f"step {first['step']} {first['name']}" if first else "-"
        repeats = f"{data['divergent_repeats']}/{data['repeats']}" if run.error is None else "-"
        verdict = styled(run.verdict)
        if run.spread_from is not None:
            verdict += f" (from rank {run.spread_from})"
        if run.error and run.error.get("timed_out") is not None:
            verdict += f" (timed out after {run.error['timed_out']:g} s)"
        rows.append(
            [
                run.device,
                verdict,
                where,
                repeats,
                _step_marks(data["steps"]),
                escape("; ".join(run.differences)) or "-",
            ]
        )
    if consensus is not None:
        record = consensus.voters["record"]
        first = record.first_divergence
        verdict = styled(record.verdict)
        if record_spread_from is not None:
            verdict = f"{styled('spread')} (from rank {record_spread_from})"
        rows.insert(
            0,
            [
                "record",
                verdict,
                f"step {first.step} {first.name}" if first else "-",
                "-",
                _step_marks({str(s): n for s, n in record.per_step.items()}),
                "-",
            ],
        )
    return rows


def _ignored_environment(output: Output, ignored: list[str]) -> None:
    for variable in ignored:
        output.warn(f"not passed to the replay (the bundle's environment is): {variable}")


def _device_failures(output: Output, runs: list[DeviceRun], prefix: str = "") -> None:
    for run in runs:
        for warning in run.warnings:
            output.warn(f"{prefix}{run.device}: {warning}")
        if not run.error:
            continue
        output.say(f"[bold magenta]{prefix}{run.device}[/]: {escape(run.error['message'])}")
        if run.error.get("hint"):
            output.say(f"  Hint: {escape(run.error['hint'])}")
        if run.error.get("stderr_tail"):
            output.say("  " + escape(run.error["stderr_tail"]).replace("\n", "\n  "))
        if run.error.get("log"):
            output.say(f"  Log: {escape(run.error['log'])}")


def _consensus_explanation(report: ReplayReport) -> str:
    consensus = report.consensus
    assert consensus is not None
    suspects = ", ".join(s for s in consensus.suspects if s != "record")
    explanation = {
        "correct": "every device reproduced the record bit for bit.",
        "persistent": f"{suspects} diverged in every repeat.",
        "transient": f"{suspects} diverged in some repeats only.",
        "recording_suspect": "every replay agrees with the others but not with the record: "
        "the recording device computed wrong.",
        "undecided": f"{consensus.advice}.",
        "incomparable": f"{consensus.advice}.",
    }[consensus.verdict]
    if report.failed:
        total, failed = len(report.devices), len(report.failed)
        explanation = (
            explanation.rstrip(".") + f" (from the {total - failed} of {total} devices "
            f"that finished; {failed} did not)."
        )
    return explanation


def render_replay(output: Output, report: ReplayReport | JobReplayReport) -> None:
    from ..replay.replicas import ReplayReport

    if not isinstance(report, ReplayReport):
        _render_job_replay_report(output, report)
        return
    output.table(
        f"Replay of {report.bundle}",
        [
            "device",
            "verdict",
            "first divergence",
            "diverged",
            "steps",
            "machine differs from record",
        ],
        _device_rows(report.devices, report.consensus),
        fold=[4, 5],
    )
    _device_failures(output, report.devices)
    _ignored_environment(output, report.ignored_environment)
    if report.consensus is not None:
        consensus = report.consensus
        output.say(f"Verdict: {styled(consensus.verdict)}: {_consensus_explanation(report)}")
        if report.caveat:
            output.warn(f"caveat: {report.caveat}")
        for label, differences in consensus.incomparable.items():
            output.warn(
                f"{label} did not vote on the record, its machine differs: {'; '.join(differences)}"
            )
        if consensus.first_divergence is not None:
            first = consensus.first_divergence
            output.say(f"First divergence: step {first.step}, {first.phase}, {first.name}")
            where = next((r.divergence_region for r in report.devices if r.divergence_region), None)
            if where:
                output.say(f"Computed in: {escape(where)}")
        output.say(f"Logs: {report.log_dir}")
    if report.injection_missed:
        output.warn(
            "no injected fault fired on any device: check op=, module=, phase=, step= "
            "and index= against the workload"
        )
    failure = report.failure()
    if failure is not None:
        output.error(failure)


def render_job_replay(output: Output, report: JobReplayReport) -> None:
    """Every rank's runs, then the origin: where the job first left the record."""
    rows = [
        [str(rank.rank), *row]
        for rank in report.ranks
        for row in _device_rows(rank.runs, rank.consensus, rank.record_spread_from)
    ]
    output.table(
        f"Replay of the {report.world_size}-rank job {report.bundle}",
        ["rank", "device", "verdict", "first divergence", "diverged", "steps", "machine differs"],
        rows,
        fold=[5, 6],
    )
    for rank in report.ranks:
        _device_failures(output, rank.runs, prefix=f"rank {rank.rank} ")
    _ignored_environment(output, report.ignored_environment)
    if report.verdict != "error":
        suspects = report.suspects
        who = f" (suspects: {', '.join(suspects)})" if suspects else ""
        output.say(f"Verdict: {styled(report.verdict)}{who}")
    _render_origin(output, report.origin)
    if report.caveat:
        output.warn(f"caveat: {report.caveat}")
    output.say(f"Logs: {report.log_dir}")
    if report.injection_missed:
        output.warn("no injected fault fired on any rank: check rank=, op=, step= and index=")
    failure = report.failure()
    if failure is not None:
        output.error(failure)


def _render_origin(output: Output, origin: Origin) -> None:
    """Which rank went wrong first (docs/distributed.md), as a table."""
    if not origin.diverged and origin.first_divergent_message is None:
        return
    if origin.origin_rank is not None:
        who = f"[bold red]rank {origin.origin_rank}[/]"
    else:
        who = "no single rank (several differ at once, or only a collective's output)"
    rows = [["origin rank", who]]
    message = origin.first_divergent_message
    if message is not None:
        sequence = (
            f"collective_seq_id {message['collective_seq_id']}"
            if message["collective_seq_id"] is not None
            else f"p2p_seq_id {message['p2p_seq_id']}"
        )
        rows.append(
            [
                "first divergent message",
                f"step {message['step']}, {message['profiling_name']} ({sequence}, process "
                f"group {message['process_group']}): its {message['which']} on rank "
                f"{message['rank']}",
            ]
        )
    else:
        rows.append(["first divergent message", "none: no message differs"])
    rows.append(["spread to ranks", ", ".join(map(str, origin.spread_ranks)) or "-"])
    output.table("Where the job first left the record", ["", ""], rows, fold=[1])


def _render_job_replay_report(output: Output, report: JobReplayReport) -> None:
    """A job's replay, phase 1's included; their modules are imported for a job's report only
    (the same-batch replay's imports torch, which a replay's own process needs not)."""
    from ..replay import nodes, same_batch

    if isinstance(report, nodes.NodeReport):
        from .render_scale import render_node

        render_node(output, report)
        return
    if isinstance(report, same_batch.SameBatchReport) and report.fallback is not None:
        output.warn(f"no peer vote: {report.missing}; replayed as recorded, voted with the record")
        render_job_replay(output, report.fallback)
        origin = report.fallback.origin.origin_rank
        if origin is not None:
            output.say(f"Origin by coordinates: {escape(report.layout.describe(origin))}")
        return
    if isinstance(report, same_batch.SameBatchReport):
        from .render_scale import render_same_batch

        render_same_batch(output, report)
        return
    render_job_replay(output, report)


def render_diff(output: Output, comparison: Comparison | JobComparison) -> None:
    from ..compare import jobs as distributed

    if isinstance(comparison, distributed.JobComparison):
        _render_job_diff(output, comparison)
        return
    if comparison.ranks is not None:
        first_rank, second_rank = comparison.ranks
        output.say(
            f"Rank {first_rank} vs rank {second_rank}, each rank's collective messages among "
            "its entries"
            + (
                " (two ranks: each computes on its own shard of the data, so entries before "
                "their reductions differ without any fault)."
                if first_rank != second_rank
                else "."
            )
        )
    if comparison.identical:
        output.say(
            f"{styled('identical')}: {comparison.entries} entries over steps "
            f"{comparison.steps} match bit for bit."
        )
    else:
        _render_divergences(output, comparison)
    if comparison.plot is not None:
        output.say(f"Plot: {comparison.plot}")


def _render_job_diff(output: Output, comparison: JobComparison) -> None:
    rows = []
    for rank, ranked in comparison.ranks.items():
        first = ranked.first
        rows.append(
            [
                str(rank),
                styled("identical" if ranked.identical else "divergent"),
                f"step {first.step} {first.name}" if first else "-",
                str(len(ranked.divergences)),
            ]
        )
    output.table("Jobs compared rank by rank", ["rank", "", "first divergence", "entries"], rows)
    _render_origin(output, comparison.origin)


def _render_divergences(output: Output, comparison: Comparison) -> None:
    first = comparison.first
    assert first is not None
    output.say(
        f"First divergence: step {first.step}, {first.phase}, {first.name} "
        f"(expected {first.expected}, got {first.actual})"
    )
    if comparison.program_differs:
        output.say(
            "It is a program entry: the second log ran another program (a hyper-parameter "
            "or a state object differs), not silent data corruption."
        )
    output.table(
        "Divergent entries per step",
        ["step", "divergent entries"],
        [[str(step), str(count)] for step, count in comparison.per_step().items()],
    )
    layers = list(comparison.per_layer().items())
    shown = 12
    output.table(
        "Divergent entries per layer, in order of first divergence",
        ["layer", "forward", "backward", "optimizer"],
        [
            [layer] + [str(counts.get(phase, 0)) for phase in ("forward", "backward", "optimizer")]
            for layer, counts in layers[:shown]
        ],
    )
    if len(layers) > shown:
        output.say(f"(+{len(layers) - shown} more layers; --json or --plot shows them all)")
