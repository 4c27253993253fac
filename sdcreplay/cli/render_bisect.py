"""What ``ops``, ``bisect`` and ``minimize`` tell a person: the operator calls of a step,
the first corrupted call with its wrong bits, and how often it fails alone on what inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from .output import Output, say_moved_aside, styled

if TYPE_CHECKING:
    from ..bisect.ops import OpsListing
    from ..bisect.report import BisectResult
    from ..minimize.driver import MinimizeResult
    from ..minimize.kernel_case import KernelMinimizeResult


def _call_rows(report: dict) -> list[list[str]]:
    """The rows naming the corrupted call: operator, kernels, isolation, elements and bits."""
    isolation = report["isolation"]
    kernel = report.get("kernel")
    rows = (
        [
            [
                "kernel",
                f"{kernel['name']} (kernel call {kernel['index']} of the step, {kernel['graph']})",
            ],
            ["fused", ", ".join(kernel["fused"]) or "-"],
            ["output", f"{report['output_index']} of {len(kernel['outputs'])} it writes"],
        ]
        if kernel
        else [
            ["operator", f"{report['op']} (call {report['op_index']} of the step)"],
            ["kernels", ", ".join(report.get("kernels") or []) or "- (CPU: no kernel names)"],
        ]
    )
    rows += [
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
            ["elements", _differing(elements)],
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


def _differing(elements: dict) -> str:
    """How many elements differ and where; for a broadcasting view, its storage's words (each
    once) at the view coordinates of their first reader."""
    view = elements.get("view")
    if view is None:
        return (
            f"{elements['count']} of {elements['total']} differ, "
            f"first at {elements['positions'][:4]}"
        )
    return (
        f"{elements['count']} of the {elements['total']} storage words a broadcasting view "
        f"reads differ (storage index {view['storage_indices'][:4]}, first read at "
        f"{elements['positions'][:4]})"
    )


def render_bisect(output: Output, result: BisectResult) -> None:
    report = result.to_json()
    if result.verdict == "no_divergence":
        step = f" in step {result.step}" if result.step is not None else ""
        output.say(
            f"{styled('correct')}: no divergence{step} after {report.get('repeats_run')} "
            f"repeat(s) on {result.suspect}."
        )
        _warn(output, report)
        say_moved_aside(output, "report", report.get("moved_aside"))
        return
    rows = [
        ["step", str(result.step)],
        [
            "phase",
            str(report.get("phase"))
            + (
                " (recomputed in backward: activation checkpointing)"
                if report.get("recompute")
                else ""
            ),
        ],
        ["module", str(report.get("module"))],
    ]
    if report.get("op") or report.get("kernel"):
        rows += _call_rows(report)
    elif report.get("entry"):
        rows.append(["first divergent entry", report["entry"]])
    upstream = report.get("upstream")
    if upstream:
        changed = upstream["elements"]
        rows.append(
            [
                "upstream",
                f"{upstream['summary']}; of it {_differing(changed)} "
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
    output.table(
        f"Bisect: {of_rank}{result.suspect} vs {result.reference}", ["", ""], rows, fold=[1]
    )
    if report.get("next"):
        output.say(report["next"])
    _warn(output, report)
    output.say(f"Report: {result.report}")
    say_moved_aside(output, "report", report.get("moved_aside"))
    if "plot" in result.findings:
        plot = result.findings["plot"]
        output.say(
            f"Plot: {plot}" if plot else "Plot: none drawn (no element of an output differs)"
        )


def _warn(output: Output, report: dict) -> None:
    """What the bisect did otherwise than asked (its start: docs/bisect.md)."""
    for warning in report.get("warnings") or []:
        output.warn(warning)


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


def render_kernel_minimize(output: Output, result) -> None:
    """A compiled kernel's measurement (``minimize.kernel_case.KernelMinimizeResult``)."""
    kernel = result.kernel
    low, high = result.ci95
    output.table(
        "Minimize (compiled kernel)",
        ["", ""],
        [
            ["kernel", f"{kernel['name']} ({kernel['kind']}, {kernel['graph']})"],
            ["fused", ", ".join(kernel["fused"]) or "-"],
            *_job_rows(result.job),
            [
                "suspect",
                f"{result.device}: failed {result.failures} of {result.trials} "
                f"({result.rate:.2%}, 95% {low:.2%}-{high:.2%})",
            ],
            [
                "reference",
                f"{result.reference}: failed {result.reference_failures} of "
                f"{result.reference_trials}",
            ],
            ["ticket", result.ticket],
        ],
    )
    for warning in result.warnings:
        output.warn(warning)


def render_minimize(output: Output, result: MinimizeResult | KernelMinimizeResult) -> None:
    if getattr(result, "level", None) == "kernel":
        render_kernel_minimize(output, result)
        return
    result = cast("MinimizeResult", result)  # not a kernel's: an operator's measurement
    shrink, acceptance = result.shrink, result.acceptance
    how = (
        f": {shrink['reason']}"
        if shrink.get("reason")
        else f", {shrink['tests']} candidates tested"
    )
    rows = [
        ["operator", result.op],
        *_job_rows(result.job),
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
    output.table(f"Minimize: {result.op} on {result.device}", ["", ""], rows, fold=[1])
    for warning in result.warnings:
        output.warn(warning)
    output.say(f"Ticket: {result.ticket}")
    say_moved_aside(output, "ticket", result.moved_aside)


def _job_rows(job: dict | None) -> list[list[str]]:
    """Where a job's call ran: its rank, by coordinates, in the job bundle."""
    return [["in the job", f"{job['where']} of {job['bundle']}"]] if job else []


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
    where = f"Step {listing.step}"
    if listing.rank is not None:
        where += f" of rank {listing.rank}" + (
            f" ({listing.coordinates})" if listing.coordinates else ""
        )
    output.table(
        f"{where}: {len(listing.calls)} of {listing.total_calls} operator calls",
        ["call", "phase", "module", "op", "nth", "outputs"],
        [
            [
                str(c.index),
                c.phase + (" (recomputed)" if c.recompute else ""),
                c.module,
                c.op,
                str(c.nth),
                _outputs_text(c.outputs),
            ]
            for c in listing.calls
        ],
        fold=[5],  # the outputs' shapes fold; an operator or module name is printed whole
    )
    if listing.kernels:
        output.table(
            f"{where}: {len(listing.kernels)} Inductor kernel calls (kernel=NAME)",
            ["call", "phase", "module", "kernel", "nth", "fused", "outputs"],
            [
                [
                    str(k.index),
                    k.phase,
                    k.module,
                    k.kernel,
                    str(k.nth),
                    ", ".join(k.fused),
                    _outputs_text(k.outputs),
                ]
                for k in listing.kernels
            ],
            fold=[5, 6],
        )
    if listing.rank is not None:
        output.say(
            f"Specs name these calls with step={listing.step},rank={listing.rank} "
            "(--json gives each call's spec ready)"
            + (": listed alone, peers absent." if listing.alone else ".")
        )
