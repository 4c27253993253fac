"""The command line: parse options, call the library once, render its result, exit.

Every command body returns its result object; ``boundary.command`` renders it, prints its
JSON and maps failures to exit codes. The library is imported inside each body, so
``--help`` loads no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .. import __version__
from ..kinds import Phase
from .at_scale import at_scale_replay, job_replay, nodes_replay, placement
from .boundary import app, command
from .options import (
    AloneOpt,
    AloneRankOpt,
    BundleArg,
    DeviceOpt,
    DumpOn,
    FromRankOpt,
    FromStateOpt,
    InfoRankOpt,
    InjectOpt,
    JsonOpt,
    KeepStateOpt,
    NnodesOpt,
    NodeRankOpt,
    NoLedgerOpt,
    NprocPerNodeOpt,
    OpsAloneOpt,
    OpsDeviceOpt,
    OpsRankOpt,
    OutOpt,
    OverwriteOpt,
    RdzvEndpointOpt,
    RdzvTimeoutOpt,
    ReferenceOpt,
    SameBatchOpt,
    Signature,
    TrustedWorkloadOpt,
    TrustOpt,
    _seed_in_range,
    parse_kwargs,
    preflight,
    trusting,
    workload_file,
)
from .output import Output
from .render_bisect import render_bisect, render_minimize, render_ops
from .render_checks import render_demo, render_demo_stage, render_doctor
from .render_record import render_info, render_record
from .render_replay import render_diff, render_replay

if TYPE_CHECKING:
    from ..replay.worker import DeviceResult


@command(render_record)
def record(
    output: Output,
    workload: Annotated[
        str,
        typer.Argument(
            help="builtin:tiny-llama, builtin:tiny-moe, package.module:function or "
            "path/to/file.py:function."
        ),
    ],
    steps: Annotated[int, typer.Option(min=1, help="Training steps to record.")] = 4,
    out: OutOpt = None,
    device: DeviceOpt = "cpu",
    seed: Annotated[
        int, typer.Option(callback=_seed_in_range, help="Seed for the workload and the RNGs.")
    ] = 0,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="torch.save'd {'model', 'optimizer'} state to start from; referenced by SHA-256."
        ),
    ] = None,
    arg: Annotated[
        list[str] | None,
        typer.Option(
            "--arg",
            "-a",
            help="Workload keyword argument KEY=VALUE (repeatable), e.g. -a layers=4.",
        ),
    ] = None,
    overwrite: OverwriteOpt = False,
    inject: InjectOpt = None,
    depth: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Capture module outputs only down to this depth (root 0, layers.N 2); fewer "
            "activation digests, cheaper recording. Default: every module.",
        ),
    ] = None,
    signature: Annotated[
        Signature,
        typer.Option(
            help="What each step's signature log holds: layer (every module's output and "
            "gradient, for forensics) or boundary (the production level: losses, what the "
            "optimizer is given and the parameters it produced; replay computes every layer).",
        ),
    ] = Signature.layer,
    verify: Annotated[
        bool,
        typer.Option(
            help="Re-execute the first step through the workload's step and refuse a recording "
            "that cannot be replayed."
        ),
    ] = True,
    ring: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Keep only the last K steps in memory and write the bundle only when --dump-on "
            "asks (docs/recording.md).",
        ),
    ] = None,
    dump_on: Annotated[
        list[DumpOn] | None,
        typer.Option(
            "--dump-on",
            help="With --ring, what writes the ring's bundle (repeatable): update (an "
            "UpdateDetector alarm; the default), replay (a ReplayCheck of every step "
            "disagrees), end (the run ended).",
        ),
    ] = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Record a torch.distributed job of N ranks on this machine (PyTorch's elastic "
            "launcher; gloo on cpu, NCCL with rank r on cuda:r). Built-in workloads run DDP "
            "unless -a parallel=... says otherwise. See docs/distributed.md.",
        ),
    ] = None,
    json_mode: JsonOpt = False,
):
    """Run WORKLOAD's train_step (if any) for --steps steps; write a deterministic trace bundle.

    --out defaults to traces/<workload>.bundle. Injected faults (--inject) fire while
    recording; the bundle does not carry them. With --ring nothing is written unless an alarm
    (--dump-on) asks; later bundles get -2, -3... before the suffix.
    """
    preflight(
        inject, [device], {"checkpoint": [checkpoint], "workload file": [workload_file(workload)]}
    )
    from ..recording.drive import record as record_bundle

    target = out or Path("traces") / f"{workload.split(':')[-1].replace('/', '_')}.bundle"
    options: dict[str, Any] = {
        "steps": steps,
        "device": device,
        "seed": seed,
        "kwargs": parse_kwargs(arg or []),
        "checkpoint": checkpoint,
        "overwrite": overwrite,
        "inject": inject or [],
        "max_depth": depth,
        "verify": verify,
        "ring": ring,
        "dump_on": [choice.value for choice in dump_on or []] or (["update"] if ring else []),
        "signature": signature.value,
    }
    if nproc is not None:
        from ..recording.job import record_job

        stage = f"recording {workload} on {nproc} rank{'' if nproc == 1 else 's'}"
        with output.stages() as progress:
            progress.update(stage, 0, steps)  # the ranks report when the job ends
            summary = record_job(workload, target, nproc=nproc, **options)
            loss = "" if summary.final_loss is None else f", loss {summary.final_loss:.4f}"
            progress.update(stage, summary.steps, steps, f"steps on each rank{loss}")
            return summary
    stage = f"recording {workload}"
    with output.stages() as progress:
        recorded = 0

        def on_step(index: int, loss: float | None) -> None:
            nonlocal recorded
            recorded += 1
            progress.update(stage, recorded, steps, "" if loss is None else f"loss {loss:.4f}")

        progress.update(stage, 0, steps)
        return record_bundle(workload, target, on_step=on_step, **options)


@command(render_info)
def info(
    output: Output,
    bundle: BundleArg,
    rank: InfoRankOpt = None,
    json_mode: JsonOpt = False,
):
    """Show what a bundle holds and check every file against its SHA-256."""
    preflight(paths={"bundle": [bundle]})
    from ..bundle.info import describe

    return describe(bundle, rank)


@command(render_replay)
def replay(
    output: Output,
    bundle: BundleArg,
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device",
            "-d",
            help="Device label (repeatable; default cpu): cpu, cuda:N, or virtual "
            "replicas cpu:N. Each label replays in its own process, all at once; cpu:N replicas "
            "share this machine's cores and may take turns.",
        ),
    ] = None,
    repeats: Annotated[
        int, typer.Option(min=1, help="Replays per device; some diverging means intermittent.")
    ] = 1,
    inject: InjectOpt = None,
    logs: Annotated[
        Path | None,
        typer.Option(
            help="Directory for the replay logs (default: a new "
            "BUNDLE.replay/<time>-<pid>-<random>/ of this run's own)."
        ),
    ] = None,
    trust_workload: TrustOpt = False,
    workload: TrustedWorkloadOpt = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            min=0.1,
            max=7 * 24 * 3600,
            help="Seconds a device may go without finishing a step "
            "before it is killed and reported (default: derived from the recorded step "
            "times).",
        ),
    ] = None,
    no_ledger: NoLedgerOpt = False,
    same_batch: SameBatchOpt = False,
    from_rank: FromRankOpt = None,
    keep_state: KeepStateOpt = None,
    rank: AloneRankOpt = None,
    alone: AloneOpt = False,
    from_state: FromStateOpt = None,
    nnodes: NnodesOpt = None,
    nproc_per_node: NprocPerNodeOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_timeout: RdzvTimeoutOpt = None,
    json_mode: JsonOpt = False,
):
    """Replay a bundle bit for bit on one or more devices and vote on every signature.

    A job bundle (record --nproc) replays every rank: each consecutive group of
    world-size --device labels is one replica, rank 0 first (default: one replica
    on the recorded devices); see docs/distributed.md. At scale (docs/at-scale.md):
    --same-batch judges every rank by its data-parallel peers in one replay;
    --rank R --alone replays rank R's group without its peers, once per --device;
    --keep-state DIR keeps phase 1's state entering the divergent step, --from-state DIR
    starts phase 2 there. Across nodes: the same command on each node with --nnodes K
    --nproc-per-node P --rdzv-endpoint HOST:PORT --node-rank R; node 0 prints the report.
    """
    preflight(inject, device or [], {"bundle": [bundle]})
    from ..bundle.job_bundle import is_job_bundle
    from ..replay.replicas import replay_devices

    placed = (nnodes, nproc_per_node, rdzv_endpoint, node_rank, rdzv_timeout)
    if any(option is not None for option in placed):
        nodes = placement(bundle, nnodes, nproc_per_node, rdzv_endpoint, node_rank, rdzv_timeout)
        incompatible = (rank, from_state, keep_state) != (None, None, None) or alone
        return nodes_replay(
            output, bundle, nodes, device, repeats, inject, logs, timeout,
            trusting(bundle, trust_workload, workload), not no_ledger, same_batch, from_rank,
            incompatible,
        )  # fmt: skip
    at_scale = (from_rank, rank, keep_state, from_state)
    if same_batch or alone or any(option is not None for option in at_scale):
        trust = trusting(bundle, trust_workload, workload)
        return at_scale_replay(
            output, bundle, device, inject, logs, timeout, trust, not no_ledger,
            same_batch=same_batch, from_rank=from_rank, rank=rank, alone=alone,
            keep_state=keep_state, from_state=from_state,
        )  # fmt: skip
    if is_job_bundle(bundle):
        return job_replay(
            output,
            bundle,
            device,
            repeats,
            inject,
            logs,
            timeout,
            trusting(bundle, trust_workload, workload),
            not no_ledger,
        )
    devices = device or ["cpu"]
    with trusting(bundle, trust_workload, workload), output.stages() as progress:

        def on_done(label: str, result: DeviceResult) -> None:
            progress.device_done("replaying", label, result.error is not None, len(devices))

        progress.update("replaying", 0, len(devices), ", ".join(devices))
        return replay_devices(
            bundle,
            devices,
            repeats=repeats,
            inject=inject or [],
            log_dir=logs,
            on_done=on_done,
            timeout=timeout,
            ledger=not no_ledger,
        )


@command(render_bisect)
def bisect(
    output: Output,
    bundle: BundleArg,
    suspect: Annotated[
        str | None,
        typer.Option(help="Device label that computes wrong (default: the recording itself)."),
    ] = None,
    reference: ReferenceOpt = "cpu:0",
    step: Annotated[
        int | None,
        typer.Option(help="Step to bisect (default: the first divergent step, found by a replay)."),
    ] = None,
    repeats: Annotated[
        int,
        typer.Option(
            min=1,
            help="Repeats of the step on the suspect until a divergence shows (intermittent "
            "faults).",
        ),
    ] = 1,
    inject: InjectOpt = None,
    out: OutOpt = None,
    plot: Annotated[
        Path | None, typer.Option(help="Heatmap PNG of where in the output tensor the bits differ.")
    ] = None,
    rank: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="For a job bundle: the rank to bisect (e.g. replay's origin_rank). It runs on "
            "--suspect/--reference while the other ranks replay on their recorded devices to "
            "serve the collectives.",
        ),
    ] = None,
    trust_workload: TrustOpt = False,
    workload: TrustedWorkloadOpt = None,
    no_ledger: NoLedgerOpt = False,
    overwrite: OverwriteOpt = False,
    alone: AloneOpt = False,
    from_state: FromStateOpt = None,
    json_mode: JsonOpt = False,
):
    """Name a step's first corrupted operator call, the kernel it launched and its wrong bits.

    The report is written to --out (default: BUNDLE.bisect/); one already there (and the
    ticket minimize wrote into it) is replaced only with --overwrite, and moved aside. With
    --rank R --alone a job's rank runs without its data-parallel peers (docs/at-scale.md).
    """
    preflight(inject, [suspect, reference], {"bundle": [bundle]})
    from ..bisect.localize import bisect as run_bisect

    with trusting(bundle, trust_workload, workload), output.stages() as progress:
        return run_bisect(
            bundle,
            rank=rank,
            suspect=suspect,
            reference=reference or "cpu:0",
            step=step,
            repeats=repeats,
            inject=inject or [],
            out=out,
            plot=plot,
            on_event=progress.begin,
            ledger=not no_ledger,
            overwrite=overwrite,
            alone=alone,
            from_state=from_state,
        )


@command(render_diff)
def diff(
    output: Output,
    first: Annotated[Path, typer.Argument(help="Bundle directory or replay log (*.sig.zst).")],
    second: Annotated[
        Path, typer.Argument(help="Bundle directory or replay log to compare with FIRST.")
    ],
    plot: Annotated[
        Path | None, typer.Option(help="Draw which layers diverge at each step into this PNG.")
    ] = None,
    json_mode: JsonOpt = False,
):
    """Compare two signature logs: structure first, then the first divergent entry.

    Two jobs (job bundles, a job replay's LOGS/replicaN directory, or its LOGS directory when
    it holds one replica) are compared rank by rank, with the origin rank and the first
    divergent message. One rank's log (JOB/ranks/00000R, LOGS/replicaN/rankR.r0.sig.zst) is
    compared with another rank's, or with its rank of a job, its messages among its entries.
    """
    preflight(paths={"log": [first, second]})
    from ..compare.jobs import diff as compare

    return compare(first, second, plot=plot)


@command(render_ops)
def ops(
    output: Output,
    bundle: BundleArg,
    step: Annotated[int, typer.Option(min=0, help="Recorded step whose operator calls to list.")],
    phase: Annotated[Phase | None, typer.Option(help="Only calls of this phase.")] = None,
    module: Annotated[
        str | None,
        typer.Option(help="Only calls under this module path (a prefix, as in a fault spec)."),
    ] = None,
    op: Annotated[
        str | None, typer.Option(help="Only calls of this operator: aten.mm or aten.mm.default.")
    ] = None,
    rank: OpsRankOpt = None,
    alone: OpsAloneOpt = False,
    device: OpsDeviceOpt = None,
    trust_workload: TrustOpt = False,
    workload: TrustedWorkloadOpt = None,
    json_mode: JsonOpt = False,
):
    """List a step's operator calls as fault specs and bisect name them (phase, module, op, nth).

    On a job bundle, --rank R lists rank R's calls (JOB/ranks/00000R names its rank itself).
    """
    preflight(devices=[device], paths={"bundle": [bundle]})
    from ..bisect.ops import list_calls

    with trusting(bundle, trust_workload, workload):
        return list_calls(
            bundle,
            step,
            device=device,
            phase=phase.value if phase else None,
            module=module,
            op=op,
            rank=rank,
            alone=alone,
        )


@command(render_doctor)
def doctor(
    output: Output,
    device: DeviceOpt = "cpu",
    workload: Annotated[
        str, typer.Option(help="Workload whose step is run twice.")
    ] = "builtin:tiny-llama",
    runs: Annotated[int, typer.Option(min=2, help="Runs of the step from the same state.")] = 2,
    against: Annotated[
        Path | None,
        typer.Option(
            help="Bundle: run its kernel probe here and say whether this machine can judge it."
        ),
    ] = None,
    json_mode: JsonOpt = False,
):
    """Is this device bitwise reproducible? Runs a step twice, names the first operator that is not.

    With --against BUNDLE: does this device compute the bundle's kernels as its recording
    device did (can it vote on the record)? Exit 1 when the step is not reproducible or the
    machine cannot judge the bundle (a finding, like a divergence).
    """
    preflight(devices=[device], paths={"bundle": [against]})
    if against is not None:
        from ..replay.comparability import judge_against

        return judge_against(against, device)
    from ..replay.doctor import doctor as run_doctor

    return run_doctor(device, workload, runs=runs)


@command(render_minimize)
def minimize(
    output: Output,
    report: Annotated[
        Path, typer.Argument(help="Bisect report directory (`sdcreplay bisect --out`).")
    ],
    device: Annotated[
        str | None,
        typer.Option(help="Device label to run the trials on (default: the report's suspect)."),
    ] = None,
    reference: ReferenceOpt = None,
    trials: Annotated[
        int, typer.Option(min=1, help="Runs of the operator alone on each device.")
    ] = 1000,
    good_trials: Annotated[
        int,
        typer.Option(
            min=1, help="A smaller input is kept only if the reference passes all of these runs..."
        ),
    ] = 10,
    bad_trials: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="...and the suspect fails within these (default: enough to see the measured "
            "rate fail with 99% probability).",
        ),
    ] = None,
    inject: InjectOpt = None,
    out: OutOpt = None,
    no_ledger: NoLedgerOpt = False,
    overwrite: OverwriteOpt = False,
    json_mode: JsonOpt = False,
):
    """Measure how often the reported operator fails alone, shrink its inputs, write a ticket.

    The ticket holds a standalone reproducer and the hardware report.

    --reference defaults to the report's; the ticket is written to --out (default:
    REPORT/ticket); a ticket already there is replaced only with --overwrite, and moved aside.
    ^C or SIGTERM during the shrink writes the ticket of the smallest inputs so far, marked
    partial, and exits 130 / 143 naming it.
    """
    preflight(inject, [device, reference], {"report": [report]})
    from ..minimize.driver import minimize as run_minimize

    with output.stages() as progress:

        def on_progress(stage: str, done: int, total: int | None, failures: int) -> None:
            counted = "kept" if stage == "shrink" else "failed"
            progress.update(stage, done, total, f"{failures} {counted}")

        return run_minimize(
            report,
            device=device,
            reference=reference,
            trials=trials,
            good_trials=good_trials,
            bad_trials=bad_trials,
            inject=inject or [],
            out=out,
            on_progress=on_progress,
            ledger=not no_ledger,
            overwrite=overwrite,
        )


@command(render_demo)
def demo(
    output: Output,
    out: Annotated[
        Path,
        typer.Option(
            help="Directory for everything the demo writes (an earlier demo's is replaced; any "
            "other directory is refused)."
        ),
    ] = Path("demo-out"),
    json_mode: JsonOpt = False,
):
    """The whole story on builtin:tiny-llama: record, replay, diff, bisect, minimize.

    Three virtual replicas replay the recording; cpu:1 has a planted defect.
    """
    from .demo import DEFECT, run_demo

    output.say(f"Planted defect on the virtual replica cpu:1: [bold]{DEFECT}[/]")
    return run_demo(out, on_stage=lambda stage: render_demo_stage(output, stage))


@app.callback(invoke_without_command=True)
def main_callback(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        typer.echo(f"sdcreplay {__version__}")
        raise typer.Exit(0)


def main() -> None:
    app()
