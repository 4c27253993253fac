"""What ``doctor`` and ``demo`` tell a person: whether this device reproduces itself, and
whether the whole chain finds the demo's planted defect (each stage drawn as its command
would draw it).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .output import Output, escape, styled
from .render_bisect import render_bisect, render_minimize
from .render_record import render_record
from .render_replay import render_diff, render_replay

if TYPE_CHECKING:
    from ..replay.comparability import ComparabilityReport
    from ..replay.doctor import DoctorReport
    from .demo import Demo, DemoStage


def render_doctor(output: Output, report: DoctorReport | ComparabilityReport) -> None:
    from ..replay.comparability import ComparabilityReport

    if isinstance(report, ComparabilityReport):
        render_comparability(output, report)
        return
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
        fold=[1],
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


def render_comparability(output: Output, report: ComparabilityReport) -> None:
    probe = report.probe
    output.say(
        f"{report.device} against {report.bundle}: {probe['ran']} kernel probe calls, "
        f"{probe['differing_count']} give other bits than on the recording device"
    )
    for difference in report.fingerprint_differences:
        output.warn(f"fingerprint: {difference}")
    if probe["differing"]:
        output.table(
            "Kernels computed differently here",
            ["kernel", "here"],
            [[call["kernel"], call.get("error", "other bits")] for call in probe["differing"]],
            fold=[1],
        )
    if report.comparable:
        output.say(
            f"{styled('correct')}: {report.device} computes the recording's kernels bit for "
            "bit; its replays can vote on the record."
        )
    else:
        output.say(
            f"{styled('incomparable')}: {report.device} cannot judge this recording (another CPU "
            "or GPU model or library build, or a defect of the recording device on those "
            "kernels); a replica on the recording's kind of machine would decide."
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
    output.say(
        f"Its verdicts are drills (injected faults: no device's state moves) in the ledger "
        f"{escape(demo.ledger)}: sdcreplay devices list --ledger {escape(shlex.quote(demo.ledger))}"
    )
