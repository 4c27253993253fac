"""What a person sees: rich tables and progress on stderr, JSON on stdout.

Only the command-line layer imports this module (and rich). Each command's
result type has one renderer here; the result types themselves stay in the
library and own their JSON (``to_json()``), so a script and a person read the
same facts. The result types are imported only for type checking: rendering
``info`` must not load torch.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..errors import SdcReplayError

if TYPE_CHECKING:
    from ..bisect.localize import BisectResult
    from ..bisect.ops import OpsListing
    from ..bundle.manifest import BundleInfo
    from ..compare.logs import Comparison, Consensus
    from ..minimize.trials import MinimizeResult
    from ..recording.recorder import RecordSummary
    from ..replay.doctor import DoctorReport
    from ..replay.job import JobComparison, JobReplayReport, Origin
    from ..replay.session import DeviceRun, ReplayReport
    from .demo import Demo, DemoStage

__all__ = ["Output", "escape", "human_size", "styled"]

VERDICT_STYLE = {
    "match": "green",
    "correct": "green",
    "identical": "green",
    "persistent": "bold red",
    "divergent": "bold red",
    "recording_suspect": "bold red",
    "intermittent": "yellow",
    "transient": "yellow",
    "undecided": "yellow",
    "incomparable": "yellow",
    "spread": "cyan",
    "error": "bold magenta",
}
LONGEST_UNBROKEN = 48  # a column is never narrower than its longest word, up to this many cells


def styled(word: str) -> str:
    style = VERDICT_STYLE.get(word)
    return f"[{style}]{word}[/]" if style else word


def human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _longest_word(cell: str) -> int:
    return max((len(word) for word in Text.from_markup(cell).plain.split()), default=0)


def _counts(done: int | None, total: int | None) -> str:
    """``7/10``; ``7`` where the total is not known (a shrink): never ``7/?``."""
    if done is None:
        return ""
    return f"{done}/{total}" if total is not None else str(done)


class Stages:
    """Progress through named stages, each with its own count and (when known) total.

    On a terminal: a live bar per stage. Elsewhere (a batch job, a CI log) the
    live display would be lost, so each stage leaves one line when it ends:
    its name, count, total, note and elapsed time.
    """

    def __init__(self, console: Console):
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[counts]}"),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not self.live,
        )
        self.tasks: dict[str, TaskID] = {}
        self.current: dict[str, Any] | None = None

    def update(
        self, stage: str, done: int | None = None, total: int | None = None, note: str = ""
    ) -> None:
        """``stage`` has reached ``done`` of ``total`` (None: no count, or no known total)."""
        if self.current is None or self.current["stage"] != stage:
            self._close_current()
            self.current = {"stage": stage, "started": time.perf_counter()}
            self.tasks[stage] = self.progress.add_task(stage, total=total, counts="", note="")
        self.current.update(done=done, total=total, note=note)
        self.progress.update(
            self.tasks[stage],
            completed=done or 0,
            total=total,
            counts=_counts(done, total),
            note=escape(note),
        )

    def begin(self, stage: str, note: str = "") -> None:
        """A new stage, even one named as the last (bisect replays a step on each device)."""
        self._close_current()
        self.update(stage, note=note)

    def _close_current(self) -> None:
        current = self.current
        if current is None:
            return
        if current["total"] is not None and current["done"] is not None:
            self.progress.update(self.tasks[current["stage"]], completed=current["total"])
        if not self.live:
            seconds = time.perf_counter() - current["started"]
            said = ", ".join(
                part
                for part in (_counts(current["done"], current["total"]), current["note"])
                if part
            )
            self.console.print(
                f"{escape(current['stage'])}: {escape(said)} ({seconds:.1f} s)", highlight=False
            )
        self.current = None

    def close(self) -> None:
        self._close_current()


class Output:
    """One object that knows whether the person asked for JSON."""

    def __init__(self, json_mode: bool = False, console: Console | None = None):
        self.json_mode = json_mode
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)

    def data(self, obj: dict) -> None:
        if self.json_mode:
            sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
            sys.stdout.flush()

    def say(self, text: str) -> None:
        self.console.print(text)

    def warn(self, text: str) -> None:
        self.console.print(f"[yellow]Warning:[/] {escape(text)}")

    def table(self, title: str | None, columns: list[str], rows: list[list[str]]) -> None:
        """A table whose cells wrap between words only: a device label or entry name stays whole
        (a word longer than the widest allowed column is folded, never cut short)."""
        table = Table(title=title, title_justify="left", header_style="bold")
        for column, width in zip(columns, self._unbroken_widths(columns, rows)):
            table.add_column(column, overflow="fold", min_width=width)
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    def _unbroken_widths(self, columns: list[str], rows: list[list[str]]) -> list[int]:
        """Each column at least as wide as its longest word; where they cannot all fit the
        console, the widest column (a value, rarely a name) gives up the difference."""
        widths = [
            min(
                LONGEST_UNBROKEN,
                max([_longest_word(column)] + [_longest_word(row[position]) for row in rows]),
            )
            for position, column in enumerate(columns)
        ]
        excess = sum(widths) + 3 * len(widths) + 1 - self.console.width  # padding and borders
        if excess > 0:
            widest = widths.index(max(widths))
            widths[widest] = max(1, widths[widest] - excess)
        return widths

    def error(self, exc: SdcReplayError) -> None:
        self.console.print(f"[bold red]Error:[/] {escape(exc.message)}")
        self.console.print(f"[bold]Hint:[/] {escape(exc.hint)}")

    @contextlib.contextmanager
    def stages(self) -> Iterator[Stages]:
        """Progress on stderr: live on a terminal, one line per stage elsewhere."""
        stages = Stages(self.console)
        with stages.progress:
            try:
                yield stages
            finally:
                stages.close()


# ---------------------------------------------------------------------------
# One renderer per command's result.


def render_record(output: Output, summary: RecordSummary) -> None:
    if summary.ring is not None:
        _render_ring_record(output, summary, summary.ring)
        return
    output.say(
        f"Recorded {summary.steps} steps of {summary.workload} on {summary.device}: "
        f"{summary.entries} signature entries, {human_size(summary.size_bytes)} "
        f"in {summary.bundle}"
    )


def _render_ring_record(output: Output, summary: RecordSummary, ring: dict) -> None:
    held = (
        f"Recorded {summary.steps} steps of {summary.workload} on {summary.device} in a ring of "
        f"the last {ring['size']} steps (at most {human_size(ring['peak_nbytes'])} held)"
    )
    if not ring["dumps"]:
        output.say(f"{held}; no alarm: nothing written.")
    else:
        output.say(f"{held}; {len(ring['dumps'])} bundle(s) written:")
    for dump in ring["dumps"]:
        trigger = dump["trigger"]
        output.say(
            f"  {escape(dump['bundle'])}: {escape(trigger['reason'])} ({trigger['source']}, "
            f"at step {trigger['step']})"
        )
    if ring["stopped"]:
        output.say(f"The detector ended the run at {escape(ring['stopped'])}")


def _verification_text(verification: dict) -> str:
    return {
        "passed": "yes: the workload's step reproduced the loop's first step bit for bit",
        "failed": f"[yellow]no: {escape(verification.get('problem', ''))}[/]",
        "pending": "[yellow]no: the recording stopped before its first step was checked[/]",
        "off": "[yellow]no: recorded without verification; a record-vs-replay difference "
        "may be the program[/]",
    }[verification["status"]]


def _trigger_rows(trigger: dict | None) -> list[list[str]]:
    """Why a ring buffer wrote the bundle (none for a bundle recorded step by step)."""
    if trigger is None:
        return []
    return [
        [
            "written because",
            f"{escape(trigger['reason'])} ({escape(trigger['source'])}, at step "
            f"{trigger['step']}; ring of the last {trigger['ring']} steps)",
        ]
    ]


def _job_rows(about: BundleInfo) -> list[list[str]]:
    """A job bundle's ranks and messages; the rows after them describe its lowest part."""
    if about.ranks is None or about.parts is None:
        return []
    parts = "; ".join(
        f"rank {p['rank']} on {p['device']}: {p['steps']} steps, {p['messages']} messages"
        + ("" if p["complete"] else " (incomplete)")
        for p in about.parts
    )
    return [
        ["ranks", f"{about.ranks} ({parts})"],
        ["messages", f"{about.messages} in all ranks (the other rows: the lowest rank's part)"],
    ]


def render_info(output: Output, about: BundleInfo) -> None:
    env, state = about.environment, about.state
    state_text = (
        f"embedded ({state['file']})"
        if state["kind"] == "embedded"
        else f"checkpoint {state['path']} (sha256 {state['sha256'][:12]}...)"
    )
    if about.state_objects:
        state_text += f"; state objects {', '.join(about.state_objects)}"
    kwargs = ", ".join(f"{k}={v}" for k, v in about.workload["kwargs"].items())
    steps = ", ".join(str(s["index"]) for s in about.steps)
    incomplete = "" if about.complete else " [yellow]incomplete: the recording stopped early[/]"
    switches = about.determinism
    output.table(
        f"Bundle {about.bundle}",
        ["field", "value"],
        [
            ["workload", f"{about.workload['ref']} ({kwargs})"],
            ["recorded on", f"{about.device} ({env['device'].get('name')}) on host {env['host']}"],
            [
                "software",
                f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
                f"Python {env['python']}",
            ],
            *_job_rows(about),
            ["steps", f"{len(about.steps)} ({steps}){incomplete}"],
            *_trigger_rows(about.trigger),
            ["signature entries", str(about.entries)],
            ["state", state_text],
            ["verified", _verification_text(about.verification)],
            [
                "determinism",
                f"deterministic algorithms {switches['deterministic_algorithms']}, "
                f"{switches['num_threads']} threads",
            ],
            ["size", f"{human_size(about.size_bytes)} in {about.files} files"],
            ["integrity", styled("match") if about.integrity == "ok" else about.integrity],
            [
                "trusted",
                "yes" if about.trusted else "no: its workload runs only with --trust-workload",
            ],
        ],
    )
    rows = [
        [name, str(value), "yes" if name in about.must_match else "-"]
        for name, value in (about.fingerprint or {}).items()
    ]
    output.table(
        "Machine fingerprint (a replay is evidence where the result-affecting ones match)",
        ["property", "recorded", "result-affecting"],
        rows or [["-", "not recorded (older bundle)", "-"]],
    )


def _step_marks(per_step: dict[str, int]) -> str:
    """One mark per step: a check for a bit-identical step, the divergent entry count otherwise."""
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
    from ..replay import job as distributed

    if isinstance(report, distributed.JobReplayReport):
        render_job_replay(output, report)
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
    )
    _device_failures(output, report.devices)
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
    )
    for rank in report.ranks:
        _device_failures(output, rank.runs, prefix=f"rank {rank.rank} ")
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
    output.table("Where the job first left the record", ["", ""], rows)


def render_diff(output: Output, comparison: Comparison | JobComparison) -> None:
    from ..replay import job as distributed

    if isinstance(comparison, distributed.JobComparison):
        _render_job_diff(output, comparison)
        return
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


def _call_rows(report: dict) -> list[list[str]]:
    """The rows naming the corrupted call: operator, kernels, isolation, elements and bits."""
    isolation = report["isolation"]
    rows = [
        ["operator", f"{report['op']} (call {report['op_index']} of the step)"],
        ["kernels", ", ".join(report.get("kernels") or []) or "- (CPU: no kernel names)"],
        [
            "isolated",
            f"{styled(report['isolated'])} ({isolation['failures']} of "
            f"{isolation['runs']} runs alone wrong)",
        ],
    ]
    elements = report.get("elements") or {}
    if elements.get("count") is not None:
        bits = ", ".join(f"bit {b} x{n}" for b, n in report["bits"]["histogram"].items())
        rows += [
            [
                "elements",
                f"{elements['count']} of {elements['total']} differ, "
                f"first at {elements['positions'][:4]}",
            ],
            ["pattern", str(report.get("pattern"))],
            ["fault model", str(report.get("fault_model"))],
            ["bits flipped", bits],
            [
                "first element",
                f"expected {elements['expected'][0]}, got "
                f"{elements['actual'][0]} (XOR {elements['xor'][0]})",
            ],
            ["max abs diff", str(elements.get("max_abs_diff"))],
        ]
    return rows


def render_bisect(output: Output, result: BisectResult) -> None:
    report = result.to_json()
    if result.verdict == "no_divergence":
        step = f" in step {result.step}" if result.step is not None else ""
        output.say(
            f"{styled('correct')}: no divergence{step} after {report.get('repeats_run')} "
            f"repeat(s) on {result.suspect}."
        )
        return
    rows = [
        ["step", str(result.step)],
        ["phase", str(report.get("phase"))],
        ["module", str(report.get("module"))],
    ]
    if report.get("op"):
        rows += _call_rows(report)
    elif report.get("entry"):
        rows.append(["first divergent entry", report["entry"]])
    upstream = report.get("upstream")
    if upstream:
        changed = upstream["elements"]
        rows.append(
            [
                "upstream",
                f"{upstream['summary']}; {changed['count']} element(s) of it "
                f"differ at {changed['positions'][:4]} "
                f"(XOR {', '.join(changed['xor'][:4])}): {changed.get('fault_model')}",
            ]
        )
    for state in report.get("state") or []:
        bits = ", ".join(f"bit {b}" for b in state["bits"]["histogram"])
        rows.append(
            [
                "state entering step",
                f"{state['tensor']}: {state['count']} element(s) "
                f"differ at {state['positions'][:4]} ({bits}): {state.get('fault_model')}",
            ]
        )
    rank = result.findings.get("rank")
    of_rank = "" if rank is None else f"rank {rank} of the job on "
    output.table(f"Bisect: {of_rank}{result.suspect} vs {result.reference}", ["", ""], rows)
    if report.get("next"):
        output.say(report["next"])
    output.say(f"Report: {result.report}")


def _minimize_verdict(result: MinimizeResult) -> str:
    low, high = result.ci95
    if not result.reproduced:
        return (
            f"{styled('correct')}: not reproduced in {result.trials} trials "
            f"(rate below {high:.3%}, 95% upper bound)"
        )
    kind = "persistent" if result.rate == 1 else "intermittent"
    return (
        f"{styled(kind)}: failed {result.failures} of {result.trials} ({result.rate:.2%}, "
        f"95% interval {low:.2%} to {high:.2%}), first at trial "
        f"{result.trials_to_first_failure}"
    )


def render_minimize(output: Output, result: MinimizeResult) -> None:
    shrink, acceptance = result.shrink, result.acceptance
    how = (
        f": {shrink['reason']}"
        if shrink.get("reason")
        else f", {shrink['tests']} candidates tested"
    )
    rows = [
        ["operator", result.op],
        ["suspect", f"{result.device}: {_minimize_verdict(result)}"],
        [
            "reference",
            f"{result.reference}: failed {result.reference_failures} of {result.reference_trials}",
        ],
        [
            "inputs",
            f"{result.input_shapes_original} -> {result.input_shapes_minimal} "
            f"({shrink['status']}{how})",
        ],
        [
            "acceptance",
            f"reference passes {acceptance['good_trials']} runs, suspect fails "
            f"within {acceptance['bad_trials']}",
        ],
    ]
    if result.data_dependent is not None:
        rows.append(
            [
                "data dependent",
                "yes: random data of that shape passes"
                if result.data_dependent
                else "no: random data fails too",
            ]
        )
    first = result.first_mismatch or {}
    if "index" in first:
        rows.append(
            [
                "first mismatch",
                f"element {first['index']} {first['position']}: expected "
                f"{first['expected']}, got {first['actual']} "
                f"(XOR {first['xor']})",
            ]
        )
    rows += _fault_model_rows(result.fault_model)
    output.table(f"Minimize: {result.op} on {result.device}", ["", ""], rows)
    for warning in result.warnings:
        output.warn(warning)
    output.say(f"Ticket: {result.ticket}")


def _fault_model_rows(models: dict | None) -> list[list[str]]:
    """The damage as a fault model; on the minimal inputs too where the shrink changed it."""
    if not models or not models.get("original"):
        return []
    rows = [["fault model", models["original"]]]
    if models.get("minimal") not in (None, models["original"]):
        rows.append(["on minimal inputs", models["minimal"]])
    return rows


def _outputs_text(outputs: list[dict]) -> str:
    return ", ".join(f"{o['dtype']}{o['shape']}" for o in outputs) or "-"


def render_ops(output: Output, listing: OpsListing) -> None:
    output.table(
        f"Step {listing.step}: {len(listing.calls)} of {listing.total_calls} operator calls",
        ["call", "phase", "module", "op", "nth", "outputs"],
        [
            [str(c.index), c.phase, c.module, c.op, str(c.nth), _outputs_text(c.outputs)]
            for c in listing.calls
        ],
    )


def render_doctor(output: Output, report: DoctorReport) -> None:
    env = report.environment
    output.say(
        f"{report.device}: {env['device'].get('name')}, torch {env['torch']}, "
        f"CUDA {env['cuda']}, {report.switches['num_threads']} threads; "
        f"{report.operators} operator calls per step"
    )
    for problem in report.problems:
        output.warn(problem)
    output.table(
        "A replay elsewhere is comparable with this device only where these match",
        ["property", "here"],
        [[name, str(value)] for name, value in report.must_match.items()],
    )
    if report.pinned:
        output.say(
            "Put in force by sdcreplay in each device process: "
            + ", ".join(f"{name}={value}" for name, value in report.pinned.items())
        )
    if report.reproducible:
        output.say(
            f"{styled('correct')}: {report.runs} runs of the step were identical bit for "
            "bit; replays on this device are evidence."
        )
        return
    first = report.first_nondeterministic or {}
    where = (
        f"{first.get('op')} under {first.get('module')} ({first.get('phase')}), "
        f"call {first.get('index')}"
    )
    output.say(
        f"{styled('error')}: the step is not reproducible on {report.device}; "
        f"first difference at {where}."
    )


def render_demo_stage(output: Output, stage: DemoStage) -> None:
    """One stage of the demo as its command would print it."""
    output.say(f"\n[bold]$ {stage.command}[/]")
    renderers: dict[str, Callable[[Output, Any], None]] = {
        "record": render_record,
        "replay": render_replay,
        "diff": render_diff,
        "bisect": render_bisect,
        "minimize": render_minimize,
    }
    renderers[stage.name](output, stage.result)


def render_demo(output: Output, demo: Demo) -> None:
    problems = demo.mismatches()
    for problem in problems:
        output.say(f"[bold red]Mismatch:[/] {problem}")
    if not problems:
        output.say(
            f"\n[bold green]The findings match the planted defect.[/] Ticket for the "
            f"vendor: {demo.result('minimize').ticket}"
        )
