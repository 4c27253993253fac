"""The command line: parse options, call the library, render, exit.

Exit codes: 0 nothing diverged, 1 a divergence was found, 2 usage error,
3 the tool could not do its job (printed as ``Error:`` + ``Hint:``).
"""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from . import __version__
from .errors import SdcReplayError, WorkloadError
from .render import Output, escape, human_size, styled

app = typer.Typer(
    name="sdcreplay",
    help="Forensic replay of silent data corruption in PyTorch training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    add_completion=False,
)

BundleArg = Annotated[Path, typer.Argument(help="Bundle directory.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
class Phase(str, Enum):
    forward = "forward"
    backward = "backward"
    optimizer = "optimizer"


TrustOption = Annotated[bool, typer.Option(
    "--trust-workload", help="Run the workload the bundle names even though it was not recorded by you "
    "(it is code: read it first). Built-in workloads and your own bundles need no flag.")]
TrustedWorkloadOption = Annotated[str | None, typer.Option(
    "--workload", help="Trust this workload reference (it must be the one the bundle names).")]


def trusting(bundle: Path, trust_workload: bool, workload: str | None):
    """Trust, while the command runs, the references given on its command line (reading the bundle runs nothing)."""
    from .bundle import Bundle
    from .trust import granting

    refs = [workload] if workload else []
    if trust_workload:
        refs.append(Bundle.open(bundle, verify=False).workload_ref)
    return granting(refs)


def run(out: Output, action) -> None:
    """Run a command body; map tool failures to exit 3 with Error/Hint lines."""
    try:
        code = action()
    except SdcReplayError as exc:
        if os.environ.get("SDCREPLAY_DEBUG") == "1":
            raise
        out.error(exc)
        raise typer.Exit(3) from None
    except KeyboardInterrupt:
        out.say("Interrupted.")
        raise typer.Exit(130) from None
    except SystemExit as exc:  # workload code called sys.exit(): the tool could not do its job
        if os.environ.get("SDCREPLAY_DEBUG") == "1":
            raise
        out.error(WorkloadError(f"the workload called sys.exit({exc.code!r})",
                                "Workload code must return or raise, not exit the process."))
        raise typer.Exit(3) from None
    except Exception as exc:
        if os.environ.get("SDCREPLAY_DEBUG") == "1":
            raise
        out.error(SdcReplayError(f"unexpected {type(exc).__name__}: {exc}",
                                 "This is a bug in sdcreplay or the workload; rerun with SDCREPLAY_DEBUG=1 and report the traceback."))
        raise typer.Exit(3) from None
    raise typer.Exit(code or 0)


def parse_kwargs(pairs: list[str]) -> dict:
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--arg")
        try:
            kwargs[key] = json.loads(value)
        except ValueError:
            kwargs[key] = value
    return kwargs


def _seed_in_range(seed: int) -> int:
    """torch.manual_seed takes [-2**63, 2**64 - 1]: a larger seed is a usage error, not an overflow."""
    if not -(2**63) <= seed <= 2**64 - 1:
        raise typer.BadParameter(f"{seed} is outside [-2**63, 2**64 - 1], the seeds torch accepts")
    return seed


@app.command()
def record(
    workload: Annotated[str, typer.Argument(help="builtin:tiny-llama, builtin:tiny-moe, package.module:function or path/to/file.py:function.")],
    steps: Annotated[int, typer.Option(min=1, help="Training steps to record.")] = 4,
    out: Annotated[Path | None, typer.Option(help="Bundle directory to write (default: traces/<workload>.bundle).")] = None,
    device: Annotated[str, typer.Option(help="Device label to record on: cpu, cpu:N or cuda:N.")] = "cpu",
    seed: Annotated[int, typer.Option(callback=_seed_in_range, help="Seed for the workload and the RNGs.")] = 0,
    checkpoint: Annotated[Path | None, typer.Option(help="torch.save'd {'model', 'optimizer'} state to start from; referenced by SHA-256.")] = None,
    arg: Annotated[list[str] | None, typer.Option("--arg", "-a", help="Workload keyword argument KEY=VALUE (repeatable), e.g. -a layers=4.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing bundle at --out.")] = False,
    inject: Annotated[list[str] | None, typer.Option("--inject", help="Fault spec to inject while recording (repeatable); the bundle does not carry it.")] = None,
    depth: Annotated[int | None, typer.Option(min=0, help="Capture module outputs only down to this depth (root 0, layers.N 2); fewer activation digests, cheaper recording. Default: every module.")] = None,
    verify: Annotated[bool, typer.Option(
        help="Re-execute the first step through the workload's step and refuse a recording "
             "that cannot be replayed.")] = True,
    json_mode: JsonOption = False,
) -> None:
    """Run WORKLOAD's train_step (if any) for --steps steps; write a deterministic trace bundle."""
    from .recorder import record as record_bundle

    output = Output(json_mode)
    kwargs = parse_kwargs(arg or [])
    target = out or Path("traces") / f"{workload.split(':')[-1].replace('/', '_')}.bundle"

    def action() -> int:
        with output.progress(f"recording {workload}", steps) as advance:
            summary = record_bundle(
                workload, target, steps=steps, device=device, seed=seed, kwargs=kwargs,
                checkpoint=checkpoint, overwrite=overwrite, inject=inject or [], max_depth=depth,
                verify=verify,
                on_step=lambda index, loss: advance(note="" if loss is None else f"loss {loss:.4f}"),
            )
        output.say(
            f"Recorded {summary.steps} steps of {workload} on {device}: {summary.entries} signature entries, "
            f"{human_size(summary.size_bytes)} in {summary.bundle}"
        )
        output.data({
            "schema": "sdcreplay.record/1", "bundle": str(summary.bundle), "workload": workload,
            "kwargs": summary.kwargs, "device": device, "steps": summary.steps,
            "entries": summary.entries, "size_bytes": summary.size_bytes, "final_loss": summary.final_loss,
            "verification": summary.verification,
        })
        return 0

    run(output, action)


@app.command()
def info(
    bundle: BundleArg,
    json_mode: JsonOption = False,
) -> None:
    """Show what a bundle holds and check every file against its SHA-256."""
    from .bundle import describe

    output = Output(json_mode)

    def action() -> int:
        about = describe(bundle)
        env = about["environment"]
        state = about["state"]
        state_text = f"embedded ({state['file']})" if state["kind"] == "embedded" else f"checkpoint {state['path']} (sha256 {state['sha256'][:12]}...)"
        kwargs = ", ".join(f"{k}={v}" for k, v in about["workload"]["kwargs"].items())
        output.table(f"Bundle {about['bundle']}", ["field", "value"], [
            ["workload", f"{about['workload']['ref']} ({kwargs})"],
            ["recorded on", f"{about['device']} ({env['device'].get('name')}) on host {env['host']}"],
            ["software", f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, Python {env['python']}"],
            ["steps", f"{len(about['steps'])} ({', '.join(str(s['index']) for s in about['steps'])})"
                      + ("" if about["complete"] else " [yellow]incomplete: the recording stopped early[/]")],
            ["signature entries", str(about["entries"])],
            ["state", state_text + (f"; state objects {', '.join(about['state_objects'])}"
                                    if about["state_objects"] else "")],
            ["verified", _verification_text(about["verification"])],
            ["determinism", f"deterministic algorithms {about['determinism']['deterministic_algorithms']}, "
                            f"{about['determinism']['num_threads']} threads"],
            ["size", f"{human_size(about['size_bytes'])} in {about['files']} files"],
            ["integrity", styled("match") if about["integrity"] == "ok" else about["integrity"]],
            ["trusted", "yes" if about["trusted"] else "no: its workload runs only with --trust-workload"],
        ])
        fingerprint = about["fingerprint"] or {}
        output.table("Machine fingerprint (a replay is evidence where the result-affecting ones match)",
                     ["property", "recorded", "result-affecting"],
                     [[name, str(value), "yes" if name in about["must_match"] else "-"]
                      for name, value in fingerprint.items()] or [["-", "not recorded (older bundle)", "-"]])
        output.data(about)
        return 0

    run(output, action)


def _verification_text(verification: dict) -> str:
    return {
        "passed": "yes: the workload's step reproduced the loop's first step bit for bit",
        "failed": f"[yellow]no: {escape(verification.get('problem', ''))}[/]",
        "pending": "[yellow]no: the recording stopped before its first step was checked[/]",
        "off": "[yellow]no: recorded without verification; a record-vs-replay difference "
               "may be the program[/]",
    }[verification["status"]]


@app.command()
def replay(
    bundle: BundleArg,
    device: Annotated[list[str] | None, typer.Option("--device", "-d", help="Device label (repeatable; default cpu): cpu, cuda:N, or virtual replicas cpu:N. Each label replays in its own process, all at once; cpu:N replicas share this machine's cores and may take turns.")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Replays per device; some diverging means intermittent.")] = 1,
    inject: Annotated[list[str] | None, typer.Option("--inject", help="Fault spec to inject (repeatable); see docs/fault-injection.md.")] = None,
    logs: Annotated[Path | None, typer.Option(help="Directory for the replay logs (default: BUNDLE.replay/<time>/).")] = None,
    trust_workload: TrustOption = False,
    workload: TrustedWorkloadOption = None,
    timeout: Annotated[float | None, typer.Option(min=0.1, max=7 * 24 * 3600, help="Seconds a device may go without finishing a step before it is killed and reported (default: derived from the recorded step times).")] = None,
    json_mode: JsonOption = False,
) -> None:
    """Replay a bundle bit for bit on one or more devices and vote on every signature."""
    from .replay import replay_devices

    output = Output(json_mode)

    def action() -> int:
        devices = device or ["cpu"]
        with trusting(bundle, trust_workload, workload), \
                output.progress("replaying", len(devices)) as advance:
            report = replay_devices(bundle, devices, repeats=repeats, inject=inject or [], log_dir=logs,
                                    on_done=lambda label, _: advance(note=label), timeout=timeout)
        render_replay(output, report)
        if inject and not any(fired for run_ in report.devices for fired in run_.injected):
            output.warn("no injected fault fired on any device: check op=, module=, phase=, step= and index= against the workload")
        output.data(report.to_json())
        failure = report.failure()
        if failure is not None:
            output.error(failure)
        return report.exit_code

    run(output, action)


def _step_marks(per_step: dict[str, int]) -> str:
    """One mark per step: a check for a bit-identical step, the divergent entry count otherwise."""
    return " ".join(f"{step}:[green]ok[/]" if count == 0 else f"{step}:[red]{count}[/]" for step, count in per_step.items())


def render_replay(output: Output, report) -> None:
    rows = []
    for run_ in report.devices:
        data = run_.to_json()
        first = data["first_divergence"]
        where = f"step {first['step']} {first['name']}" if first else "-"
        repeats = f"{data['divergent_repeats']}/{data['repeats']}" if run_.error is None else "-"
        verdict = styled(run_.verdict)
        if run_.error and run_.error.get("timed_out") is not None:
            verdict += f" (timed out after {run_.error['timed_out']:g} s)"
        rows.append([run_.device, verdict, where, repeats, _step_marks(data["steps"]),
                     escape("; ".join(run_.differences)) or "-"])
    if report.consensus is not None:
        record = report.consensus.voters["record"]
        first = record.first_divergence
        rows.insert(0, ["record", styled(record.verdict), f"step {first.step} {first.name}" if first else "-", "-",
                        _step_marks({str(s): n for s, n in record.per_step.items()}), "-"])
    output.table(f"Replay of {report.bundle}",
                 ["device", "verdict", "first divergence", "diverged", "steps", "machine differs from record"], rows)
    for run_ in report.devices:
        for warning in run_.warnings:
            output.warn(f"{run_.device}: {warning}")
        if run_.error:
            output.say(f"[bold magenta]{run_.device}[/]: {escape(run_.error['message'])}")
            if run_.error.get("hint"):
                output.say(f"  Hint: {escape(run_.error['hint'])}")
            if run_.error.get("stderr_tail"):
                output.say("  " + escape(run_.error["stderr_tail"]).replace("\n", "\n  "))
            if run_.error.get("log"):
                output.say(f"  Log: {escape(run_.error['log'])}")
    if report.consensus is None:
        return
    consensus = report.consensus
    verdict = consensus.verdict
    explanation = {
        "correct": "every device reproduced the record bit for bit.",
        "persistent": f"{', '.join(s for s in consensus.suspects if s != 'record')} diverged in every repeat.",
        "transient": f"{', '.join(s for s in consensus.suspects if s != 'record')} diverged in some repeats only.",
        "recording_suspect": "every replay agrees with the others but not with the record: the recording device computed wrong.",
        "undecided": f"{consensus.advice}.",
        "incomparable": f"{consensus.advice}.",
    }[verdict]
    if report.failed:
        total, failed = len(report.devices), len(report.failed)
        explanation = (explanation.rstrip(".") + f" (from the {total - failed} of {total} devices "
                       f"that finished; {failed} did not).")
    output.say(f"Verdict: {styled(verdict)}: {explanation}")
    if report.caveat:
        output.warn(f"caveat: {report.caveat}")
    for label, differences in consensus.incomparable.items():
        output.warn(f"{label} did not vote on the record, its machine differs: {'; '.join(differences)}")
    if consensus.first_divergence is not None:
        first = consensus.first_divergence
        output.say(f"First divergence: step {first.step}, {first.phase}, {first.name}")
    output.say(f"Logs: {report.log_dir}")


@app.command()
def bisect(
    bundle: BundleArg,
    suspect: Annotated[str | None, typer.Option(help="Device label that computes wrong (default: the recording itself).")] = None,
    reference: Annotated[str, typer.Option(help="Device label you trust.")] = "cpu:0",
    step: Annotated[int | None, typer.Option(help="Step to bisect (default: the first divergent step, found by a replay).")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Repeats of the step on the suspect until a divergence shows (intermittent faults).")] = 1,
    inject: Annotated[list[str] | None, typer.Option("--inject", help="Fault spec to inject (repeatable); see docs/fault-injection.md.")] = None,
    out: Annotated[Path | None, typer.Option(help="Report directory (default: BUNDLE.bisect/).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Heatmap PNG of where in the output tensor the bits differ.")] = None,
    trust_workload: TrustOption = False,
    workload: TrustedWorkloadOption = None,
    json_mode: JsonOption = False,
) -> None:
    """Name the first corrupted operator call of a step, the kernel it launched and the bits it got wrong."""
    from .bisect import bisect as run_bisect

    output = Output(json_mode)

    def action() -> int:
        with trusting(bundle, trust_workload, workload):
            result = run_bisect(bundle, suspect=suspect, reference=reference, step=step, repeats=repeats,
                                inject=inject or [], out=out, plot=plot,
                                on_event=lambda kind, text: output.say(f"[dim]{text}[/]"))
        render_bisect(output, result.to_json())
        output.data(result.to_json())
        return result.exit_code

    run(output, action)


def render_bisect(output: Output, report: dict) -> None:
    if report["verdict"] == "no_divergence":
        step = f" in step {report['step']}" if report.get("step") is not None else ""
        output.say(f"{styled('correct')}: no divergence{step} after {report.get('repeats_run')} repeat(s) on {report['suspect']}.")
        return
    rows = [["step", str(report["step"])], ["phase", str(report.get("phase"))], ["module", str(report.get("module"))]]
    if report.get("op"):
        rows += [["operator", f"{report['op']} (call {report['op_index']} of the step)"],
                 ["kernels", ", ".join(report.get("kernels") or []) or "- (CPU: no kernel names)"],
                 ["isolated", f"{styled(report['isolated'])} ({report['isolation']['failures']} of {report['isolation']['runs']} runs alone wrong)"]]
        elements = report.get("elements") or {}
        if elements.get("count") is not None:
            rows += [["elements", f"{elements['count']} of {elements['total']} differ, first at {elements['positions'][:4]}"],
                     ["pattern", str(report.get("pattern"))],
                     ["bits flipped", ", ".join(f"bit {b} x{n}" for b, n in report["bits"]["histogram"].items())],
                     ["first element", f"expected {elements['expected'][0]}, got {elements['actual'][0]} (XOR {elements['xor'][0]})"],
                     ["max abs diff", str(elements.get("max_abs_diff"))]]
    elif report.get("entry"):
        rows.append(["first divergent entry", report["entry"]])
    upstream = report.get("upstream")
    if upstream:
        changed = upstream["elements"]
        rows.append(["upstream", f"{upstream['summary']}; {changed['count']} element(s) of it "
                                 f"differ at {changed['positions'][:4]} "
                                 f"(XOR {', '.join(changed['xor'][:4])})"])
    for state in report.get("state") or []:
        bits = ", ".join(f"bit {b}" for b in state["bits"]["histogram"])
        rows.append(["state entering step", f"{state['tensor']}: {state['count']} element(s) differ at {state['positions'][:4]} ({bits})"])
    output.table(f"Bisect: {report['suspect']} vs {report['reference']}", ["", ""], rows)
    if report.get("next"):
        output.say(report["next"])
    output.say(f"Report: {report['report']}")


@app.command()
def diff(
    first: Annotated[Path, typer.Argument(help="Bundle directory or replay log (*.sig.zst).")],
    second: Annotated[Path, typer.Argument(help="Bundle directory or replay log to compare with FIRST.")],
    plot: Annotated[Path | None, typer.Option(help="Draw which layers diverge at each step into this PNG.")] = None,
    json_mode: JsonOption = False,
) -> None:
    """Compare two signature logs: structure first, then the first divergent entry."""
    from .compare import compare_logs, load_log

    output = Output(json_mode)

    def action() -> int:
        reference, candidate = load_log(first), load_log(second)
        comparison = compare_logs(reference, candidate)
        render_diff(output, comparison)
        result = comparison.to_json()
        if plot is not None:
            from .plot import plot_divergence_map

            plot_divergence_map(reference, comparison, plot)
            result["plot"] = str(plot)
            output.say(f"Plot: {plot}")
        output.data(result)
        return 0 if comparison.identical else 1

    run(output, action)


def render_diff(output: Output, comparison) -> None:
    if comparison.identical:
        output.say(f"{styled('identical')}: {comparison.entries} entries over steps {comparison.steps} match bit for bit.")
        return
    first = comparison.first
    output.say(f"First divergence: step {first.step}, {first.phase}, {first.name} "
               f"(expected {first.expected}, got {first.actual})")
    if comparison.program_differs:
        output.say("It is a program entry: the second log ran another program (a hyper-parameter or "
                   "a state object differs), not silent data corruption.")
    output.table("Divergent entries per step", ["step", "divergent entries"], [
        [str(step), str(count)] for step, count in comparison.per_step().items()
    ])
    layers = list(comparison.per_layer().items())
    shown = 12
    output.table("Divergent entries per layer, in order of first divergence", ["layer", "forward", "backward", "optimizer"], [
        [layer, str(counts.get("forward", 0)), str(counts.get("backward", 0)), str(counts.get("optimizer", 0))]
        for layer, counts in layers[:shown]
    ])
    if len(layers) > shown:
        output.say(f"(+{len(layers) - shown} more layers; --json or --plot shows them all)")


@app.command()
def ops(
    bundle: BundleArg,
    step: Annotated[int, typer.Option(min=0, help="Recorded step whose operator calls to list.")],
    phase: Annotated[Phase | None, typer.Option(help="Only calls of this phase.")] = None,
    module: Annotated[str | None, typer.Option(help="Only calls under this module path (a prefix, as in a fault spec).")] = None,
    op: Annotated[str | None, typer.Option(help="Only calls of this operator: aten.mm or aten.mm.default.")] = None,
    device: Annotated[str, typer.Option(help="Device label to replay the step on.")] = "cpu",
    trust_workload: TrustOption = False,
    workload: TrustedWorkloadOption = None,
    json_mode: JsonOption = False,
) -> None:
    """List a step's operator calls exactly as fault specs and bisect name them (phase, module, op, nth)."""
    from .ops import describe_outputs, list_calls

    output = Output(json_mode)

    def action() -> int:
        with trusting(bundle, trust_workload, workload):
            listing = list_calls(bundle, step, device=device, phase=phase.value if phase else None,
                                 module=module, op=op)
        output.table(f"Step {step}: {len(listing['calls'])} of {listing['total_calls']} operator calls",
                     ["call", "phase", "module", "op", "nth", "outputs"],
                     [[str(c["index"]), c["phase"], c["module"], c["op"], str(c["nth"]), describe_outputs(c["outputs"])]
                      for c in listing["calls"]])
        output.data(listing)
        return 0

    run(output, action)


@app.command()
def doctor(
    device: Annotated[str, typer.Option(help="Device label to check: cpu or cuda:N.")] = "cpu",
    workload: Annotated[str, typer.Option(help="Workload whose step is run twice.")] = "builtin:tiny-llama",
    runs: Annotated[int, typer.Option(min=2, help="Runs of the step from the same state.")] = 2,
    json_mode: JsonOption = False,
) -> None:
    """Is this device bitwise reproducible? Runs a step twice and names the first operator that is not."""
    from .doctor import doctor as run_doctor

    output = Output(json_mode)

    def action() -> int:
        report = run_doctor(device, workload, runs=runs)
        env = report["environment"]
        output.say(f"{device}: {env['device'].get('name')}, torch {env['torch']}, CUDA {env['cuda']}, "
                   f"{report['switches']['num_threads']} threads; {report['operators']} operator calls per step")
        for problem in report["problems"]:
            output.warn(problem)
        output.table("A replay elsewhere is comparable with this device only where these match",
                     ["property", "here"], [[name, str(value)] for name, value in report["must_match"].items()])
        if report["pinned"]:
            output.say("Put in force by sdcreplay in each device process: "
                       + ", ".join(f"{name}={value}" for name, value in report["pinned"].items()))
        if report["reproducible"]:
            output.say(f"{styled('correct')}: {runs} runs of the step were identical bit for bit; replays on this device are evidence.")
        else:
            first = report["first_nondeterministic"]
            where = f"{first.get('op')} under {first.get('module')} ({first.get('phase')}), call {first.get('index')}"
            output.say(f"{styled('error')}: the step is not reproducible on {device}; first difference at {where}.")
        output.data(report)
        return 0 if report["reproducible"] else 3

    run(output, action)


@app.command()
def minimize(
    report: Annotated[Path, typer.Argument(help="Bisect report directory (`sdcreplay bisect --out`).")],
    device: Annotated[str | None, typer.Option(help="Device label to run the trials on (default: the report's suspect).")] = None,
    reference: Annotated[str | None, typer.Option(help="Device label you trust (default: the report's reference).")] = None,
    trials: Annotated[int, typer.Option(min=1, help="Runs of the operator alone on each device.")] = 1000,
    good_trials: Annotated[int, typer.Option(min=1, help="A smaller input is kept only if the reference passes all of these runs...")] = 10,
    bad_trials: Annotated[int | None, typer.Option(min=1, help="...and the suspect fails within these (default: enough to see the measured rate fail with 99% probability).")] = None,
    inject: Annotated[list[str] | None, typer.Option("--inject", help="Fault spec to inject (repeatable); see docs/fault-injection.md.")] = None,
    out: Annotated[Path | None, typer.Option(help="Ticket directory to write (default: REPORT/ticket).")] = None,
    json_mode: JsonOption = False,
) -> None:
    """Measure how often the reported operator fails alone, shrink its inputs, write a reproducer and a hardware ticket."""
    from .minimize import minimize as run_minimize

    output = Output(json_mode)

    def action() -> int:
        shown = {}
        with output.progress("minimize", None) as advance:
            def on_progress(stage: str, done: int, total: int | None, failures: int) -> None:
                counted = "kept" if stage == "shrink" else "failed"
                advance(done - shown.get(stage, 0), note=f"{stage}: {done}{f'/{total}' if total else ''}, {failures} {counted}")
                shown[stage] = done

            result = run_minimize(report, device=device, reference=reference, trials=trials, good_trials=good_trials,
                                  bad_trials=bad_trials, inject=inject or [], out=out, on_progress=on_progress)
        render_minimize(output, result.to_json())
        output.data(result.to_json())
        return result.exit_code

    run(output, action)


def render_minimize(output: Output, result: dict) -> None:
    low, high = result["ci95"]
    if result["reproduced"]:
        verdict = (f"{styled('persistent' if result['rate'] == 1 else 'intermittent')}: failed {result['failures']} of "
                   f"{result['trials']} ({result['rate']:.2%}, 95% interval {low:.2%} to {high:.2%}), "
                   f"first at trial {result['trials_to_first_failure']}")
    else:
        verdict = f"{styled('correct')}: not reproduced in {result['trials']} trials (rate below {high:.3%}, 95% upper bound)"
    shrink = result["shrink"]
    rows = [["operator", result["op"]], ["suspect", f"{result['device']}: {verdict}"],
            ["reference", f"{result['reference']}: failed {result['reference_failures']} of {result['reference_trials']}"],
            ["inputs", f"{result['input_shapes_original']} -> {result['input_shapes_minimal']} ({shrink['status']}"
                       + (f": {shrink['reason']}" if shrink.get("reason") else f", {shrink['tests']} candidates tested") + ")"],
            ["acceptance", f"reference passes {result['acceptance']['good_trials']} runs, suspect fails within {result['acceptance']['bad_trials']}"]]
    if result["data_dependent"] is not None:
        rows.append(["data dependent", "yes: random data of that shape passes" if result["data_dependent"] else "no: random data fails too"])
    first = result.get("first_mismatch") or {}
    if "index" in first:
        rows.append(["first mismatch", f"element {first['index']} {first['position']}: expected {first['expected']}, "
                                       f"got {first['actual']} (XOR {first['xor']})"])
    output.table(f"Minimize: {result['op']} on {result['device']}", ["", ""], rows)
    for warning in result["warnings"]:
        output.warn(warning)
    output.say(f"Ticket: {result['ticket']}")


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Directory for everything the demo writes (an earlier demo's is replaced; any other directory is refused).")] = Path("demo-out"),
) -> None:
    """The whole story on builtin:tiny-llama: record, replay on 3 replicas (cpu:1 defective), diff, bisect, minimize."""
    from .demo import DEFECT, run_demo

    output = Output(False)

    def show(stage) -> None:
        output.say(f"\n[bold]$ {stage.command}[/]")
        result = stage.result
        if stage.name == "record":
            output.say(f"Recorded {result.steps} steps: {result.entries} signature entries, {human_size(result.size_bytes)} in {result.bundle}")
        elif stage.name == "replay":
            render_replay(output, result)
        elif stage.name == "diff":
            render_diff(output, result)
        elif stage.name == "bisect":
            render_bisect(output, result.to_json())
        elif stage.name == "minimize":
            render_minimize(output, result.to_json())

    def action() -> int:
        output.say(f"Planted defect on the virtual replica cpu:1: [bold]{DEFECT}[/]")
        story = run_demo(out, on_stage=show)
        problems = story.mismatches()
        for problem in problems:
            output.say(f"[bold red]Mismatch:[/] {problem}")
        if problems:
            return 1
        ticket = story.result("minimize").to_json()["ticket"]
        output.say(f"\n[bold green]The findings match the planted defect.[/] Ticket for the vendor: {ticket}")
        return 0

    run(output, action)


@app.callback(invoke_without_command=True)
def main_callback(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        typer.echo(f"sdcreplay {__version__}")
        raise typer.Exit(0)


def main() -> None:
    app()
