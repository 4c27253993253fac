"""What ``record`` and ``info`` tell a person about a bundle: what was written, and what a
bundle holds (its recording, its machine, whether it can be trusted and replayed).

The result types are imported only for type checking: rendering ``info`` must not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape

from .output import Output, human_size, say_moved_aside, styled

if TYPE_CHECKING:
    from ..bundle.info import BundleInfo
    from ..recording.drive import RecordSummary


def render_record(output: Output, summary: RecordSummary) -> None:
    if summary.ring is not None:
        _render_ring_record(output, summary, summary.ring)
        return
    output.say(
        f"Recorded {summary.steps} steps of {summary.workload} on {summary.device}: "
        f"{summary.entries} signature entries, {human_size(summary.size_bytes)} "
        f"in {summary.bundle}"
    )
    for moved in summary.moved_aside:
        say_moved_aside(output, "bundle", moved)


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
    rows = [
        [
            "written because",
            f"{escape(trigger['reason'])} ({escape(trigger['source'])}, at step "
            f"{trigger['step']}; ring of the last {trigger['ring']} steps)",
        ]
    ]
    if trigger.get("note"):
        rows.append(["window", escape(trigger["note"])])
    return rows


def _job_rows(about: BundleInfo) -> list[list[str]]:
    """A job bundle's ranks and messages; the rows after them describe its lowest part. One
    rank's part: its job, its place in the mesh and its messages per step."""
    if about.rank is not None:
        per_step = ", ".join(f"{s['index']}: {s['messages']}" for s in about.steps)
        return [
            ["job", f"{about.job}: rank {about.rank} of {about.ranks}"],
            ["coordinates", escape(about.coordinates or "not recorded (an older bundle)")],
            ["layout", _layout_text(about.layout)],
            ["messages", f"{about.messages} logged by this rank (per step {per_step})"],
        ]
    if about.ranks is None or about.parts is None:
        return []
    from ..bundle.job_bundle import isolated_ranks

    alone = isolated_ranks(about.ranks, about.messages or 0) if about.complete else None
    parts = "; ".join(
        f"rank {p['rank']} on {p['device']}: {p['steps']} steps, {p['messages']} messages"
        + ("" if p["complete"] else " (incomplete)")
        for p in about.parts
    )
    return [
        ["ranks", f"{about.ranks} ({parts})"],
        ["layout", _layout_text(about.layout)],
        [
            "messages",
            f"{about.messages} in all ranks (the other rows: the lowest rank's part)"
            + (f"; warning: {alone}" if alone else ""),
        ],
    ]


def _layout_text(layout: dict | None) -> str:
    """``dp=2 (replicate) x tp=2 (tensor); data-parallel: dp; rank 0 (0, 0), ...``."""
    if layout is None:
        return "not recorded (an older bundle): replay --same-batch needs it"
    dims = layout["dimensions"]
    shape = " x ".join(f"{escape(d['name'])}={d['size']} ({d['kind']})" for d in dims)
    parallel = [d["name"] for d in dims if d["kind"] in ("replicate", "shard")]
    where = ", ".join(
        f"rank {rank} ({', '.join(map(str, point))})"
        for rank, point in enumerate(layout["coordinates"][:16])
    )
    more = len(layout["coordinates"]) - 16
    return (
        f"{shape}; data-parallel: {escape(', '.join(parallel)) or 'none known'}; "
        f"{where}{f', ... ({more} more)' if more > 0 else ''}"
    )


def render_info(output: Output, about: BundleInfo) -> None:
    env, state = about.environment, about.state
    state_text = (
        f"embedded ({state['file']})"
        if state["kind"] == "embedded"
        else f"checkpoint {state['path']} ({_checkpoint_kind(state)}, sha256 "
        f"{state['sha256'][:12]}...)"
    )
    if about.state_objects:
        state_text += f"; state objects {', '.join(about.state_objects)}"
    steps = ", ".join(str(s["index"]) for s in about.steps)
    incomplete = "" if about.complete else " [yellow]incomplete: the recording stopped early[/]"
    switches = about.determinism
    output.table(
        f"Bundle {about.bundle}",
        ["field", "value"],
        [
            ["workload", about.workload_named],
            ["recorded on", f"{about.device} ({env['device'].get('name')}) on host {env['host']}"],
            [
                "software",
                f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
                f"Python {env['python']}",
            ],
            *_job_rows(about),
            *_drill_rows(about.injected_faults),
            ["steps", f"{len(about.steps)} ({steps}){incomplete}"],
            *_trigger_rows(about.trigger),
            ["signature entries", f"{about.entries} ({_level_text(about.signature_level)})"],
            ["state", state_text],
            ["verified", _verification_text(about.verification)],
            ["kernel probe", _probe_text(about.probe)],
            *_compiled_rows(about.compiled),
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
        fold=[1],
    )
    rows = [
        [name, str(value), "yes" if name in about.must_match else "-"]
        for name, value in (about.fingerprint or {}).items()
    ]
    output.table(
        "Machine fingerprint (a replay is evidence where the result-affecting ones match)",
        ["property", "recorded", "result-affecting"],
        rows or [["-", "not recorded (older bundle)", "-"]],
        fold=[1],
    )


def _drill_rows(injected_faults: list[str]) -> list[list[str]]:
    """A drill bundle's row: what its recording device had injected."""
    if not injected_faults:
        return []
    return [
        [
            "drill",
            "[cyan]recorded with injected faults[/] "
            + escape("; ".join(injected_faults))
            + ": every verdict made from it is a drill, never evidence",
        ]
    ]


def _checkpoint_kind(state: dict) -> str:
    kind = {"hf": "a Trainer checkpoint", "dcp": "a torch.distributed.checkpoint"}.get(
        state.get("format") or "torch", "a torch.save file"
    )
    files = state.get("files")
    return f"{kind} of {len(files)} files" if files else kind


def _level_text(level: str) -> str:
    if level == "boundary":
        return (
            "boundary level: losses, what the optimizer is given, the parameters it produced; "
            "replicas compute every layer"
        )
    return "layer level: every module's output and gradient"


def _compiled_rows(compiled: list[dict] | None) -> list[list[str]]:
    """One row per compiled region: how it was compiled, its graphs and their code's digest
    (docs/compiled.md); modules inside a region are hooked at its entry, no graph break added."""
    rows = []
    for region in compiled or []:
        how = ", ".join(
            f"{key}={region[key]}" for key in ("mode", "dynamic") if region.get(key) is not None
        )
        how += ", fullgraph" if region.get("fullgraph") else ""
        graphs = ", ".join(
            f"{graph['kind']} ({len(graph['kernels'])} kernels)" for graph in region["graphs"]
        )
        digest = region.get("code_digest")
        code = f"code {digest[:12]}" if digest else "code not seen generated: not comparable"
        rows.append(
            [
                f"compiled {region['path']}",
                f"{region['backend']}{' (' + how + ')' if how else ''}: {graphs or 'no graph'}; "
                f"{code}",
            ]
        )
    return rows


def _probe_text(probe: dict | None) -> str:
    if probe is None:
        return "none: replicas are compared by fingerprint only (CPU and GPU models included)"
    return f"{probe['calls']} distinct operator calls of the first step" + (
        f" ({probe['skipped']} left out)" if probe["skipped"] else ""
    )
