"""Detection campaign: how often the online detectors catch a realistic fault, how soon, how
often they alarm on a clean run, and what they cost per step.

    python bench/detection_campaign.py               # the table in docs/benchmarks.md
    python bench/detection_campaign.py --quick       # a smoke run: every kind, a few trials
    python bench/detection_campaign.py --json out.json

Each trial trains a fresh ``builtin:tiny-llama`` (same seed, so every run starts from the
same weights and batches) under one detector, with one fault planted at random: an operator
call of the step (forward, backward or optimizer; any call with a floating-point output
that computes, i.e. not a view), an element of its output, its bits, and a kind:
``bitflip`` (one random bit), ``mask`` (a multi-bit XOR mask), ``burst`` (2-16 neighbouring
elements of a row, one mask or bit), ``bias`` (a block scaled by 1+scale) or ``swap``. The
fault becomes active at a random step and is

- ``sticky``: it fires on that call in every execution of every step from then on,
- ``intermittent``: the same, with probability p < 1 per execution (draws salted by step
  and execution), or
- ``single``: once, in its step, in the first execution that reaches the call (a one-off
  upset: a re-execution of the step computes right).

Every execution of a step (a detector re-runs steps: the replay check runs each checked
step twice, the update detector recomputes an alarming step) runs under its own
``capture.OperatorMode`` with its own ``faults.Injector``, as ``drive.record()`` does:
a call is the same call in every execution, and a defect in it fires there each time.

Measured per detector and kind: detection rate (an alarm at or after the first step the
fault fired), steps from that step to the alarm, and alarms before it fired (false alarms
of a faulty run). Clean runs (no fault) give the false-alarm rate. Overhead per step is the
step time under each detector over the plain step's, measured side by side in one run:
alternating blocks of plain and detector steps on the same model.

The replay check can only see a fault whose executions of a checked step differ (a fault
that fires identically in every execution looks deterministic to it: the blind spot of
any same-device re-execution, which ``sdcreplay replay`` on another device closes). The
campaign therefore also reports, per trial, whether the fault was *visible*: on a step the
check ran, it fired in some executions and not others, and a firing changes the loss or a
gradient (checked by an oracle: the step's forward and backward run from the same state
and RNG once clean and once with the fault forced, compared bit for bit). Target: the
replay check detects every visible fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sdcreplay.capture.determinism import capture_rng, restore_rng
from sdcreplay.capture.faults import FaultSpec, Injector
from sdcreplay.capture.operators import CallSite, OperatorMode
from sdcreplay.storage.tensorio import raw_bits
from sdcreplay.workload.definition import Workload, build_workload

KINDS = ("bitflip", "mask", "burst", "bias", "swap")
MODES = ("sticky", "intermittent", "single")
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------
# Where a fault can be planted: the calls of one clean step


@dataclass(frozen=True)
class Site:
    """One operator call of the step a spec can select: its key, position and output."""

    op: str
    module: str
    phase: str
    nth: int
    numel: int
    width: int  # bits per element
    mantissa: int  # of them, the mantissa's


class SiteList:
    """An OperatorMode observer listing the step's calls with a floating-point output that
    computes (a view's output aliases its input: a fault there is memory at rest)."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, str, str]] = []
        self.sites: list[Site] = []

    def on_call(self, site: CallSite, func, args, kwargs, out):
        key = site.key
        target = out[0] if isinstance(out, (tuple, list)) and out else out
        alias = func._schema.returns[0].alias_info if func._schema.returns else None
        if (
            isinstance(target, torch.Tensor)
            and target.is_floating_point()
            and target.numel() > 1
            and (alias is None or alias.is_write)
        ):
            spec = FaultSpec(kind="bitflip", op=key[0], module=key[1], phase=key[2])
            nth = sum(1 for earlier in self.keys if spec.matches_key(*earlier))
            width = 8 * target.element_size()
            mantissa = round(-math.log2(torch.finfo(target.dtype).eps))
            self.sites.append(Site(*key, nth, target.numel(), width, mantissa))
        self.keys.append(key)
        return out


def step_sites(workload: Workload) -> list[Site]:
    """The sites of step 1 of a fresh workload: every later step runs the same calls (step 0
    also creates the optimizer's state)."""
    workload.run_step(workload.get_batch(0))
    listing = SiteList()
    with OperatorMode(workload.model, workload.optimizer, [listing], 1):
        workload.run_step(workload.get_batch(1))
    return listing.sites


# ---------------------------------------------------------------------------
# Random faults


@dataclass
class PlantedFault:
    kind: str
    mode: str
    start: int  # the step from which it is active
    spec: FaultSpec
    site: Site

    @property
    def field(self) -> str:
        """Which part of a float the changed bits hit: what decides how large the error is."""
        if self.spec.kind in ("bias", "swap"):
            return "value (bias, swap)"
        bits = self.spec.mask if self.spec.mask is not None else 1 << (self.spec.bit or 0)
        if self.spec.mask is None and self.spec.bit is None:  # the injector's default bit
            bits = 1 << (self.site.mantissa - 1)
        sign = 1 << (self.site.width - 1)
        if bits & (sign - (1 << self.site.mantissa)):
            return "exponent bits"
        return "sign bit, mantissa" if bits & sign else "mantissa only"

    def active(self, step: int) -> bool:
        return step == self.start if self.mode == "single" else step >= self.start

    def injector(self, step: int, execution: int) -> Injector:
        """The injector of one execution of ``step`` (draws of p < 1 salted by both)."""
        return Injector([self.spec], "cpu", salt=1000 * step + execution)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "mode": self.mode,
            "start": self.start,
            "spec": str(self.spec),
            "field": self.field,
        }


def random_mask(draw: random.Random, width: int) -> int:
    bits = draw.sample(range(width), draw.randint(2, min(8, width)))
    return sum(1 << bit for bit in bits)


def random_fault(draw: random.Random, sites: list[Site], kind: str, mode: str, steps: int):
    site = draw.choice(sites)
    index = draw.randrange(site.numel)
    keys: dict = {}
    if kind == "bitflip":
        keys["bit"] = draw.randrange(site.width)
    elif kind == "mask":
        keys["mask"] = random_mask(draw, site.width)
    elif kind == "burst":
        keys["count"] = draw.randint(2, 16)
        if draw.random() < 0.5:
            keys["bit"] = draw.randrange(site.width)
        else:
            keys["mask"] = random_mask(draw, site.width)
    elif kind == "bias":
        keys["count"] = draw.randint(1, min(16, site.numel - index))
        keys["scale"] = float(f"{10 ** draw.uniform(-4, 0):.3g}")
    elif kind == "swap":
        index = min(index, site.numel - 2)
        keys["count"] = draw.randint(1, site.numel - 1 - index)
    if mode == "intermittent":
        keys["p"] = draw.choice((0.1, 0.3, 0.5))
        keys["seed"] = draw.randrange(1000)
    spec = FaultSpec(
        kind=kind,  # type: ignore[arg-type]
        op=site.op,
        module=site.module,
        phase=site.phase,
        nth=site.nth,
        index=index,
        **keys,
    )
    start = draw.randrange(steps // 3, steps - 2)
    return PlantedFault(kind, mode, start, spec, site)


# ---------------------------------------------------------------------------
# A training loop with a planted fault


class FaultyStep:
    """The workload's step with a planted fault: each execution under its own injector."""

    def __init__(self, workload: Workload, fault: PlantedFault | None):
        self.workload, self.fault = workload, fault
        self.spent = False  # a single upset has happened
        self.step = 0
        self.executions: Counter[int] = Counter()
        self.fired: dict[int, list[bool]] = {}  # step -> fired, per execution

    def __call__(self, batch):
        execution = self.executions[self.step]
        self.executions[self.step] += 1
        fault = self.fault
        if fault is None or not fault.active(self.step) or self.spent:
            self.fired.setdefault(self.step, []).append(False)
            return self.workload.run_step(batch)
        injector = fault.injector(self.step, execution)
        try:  # a replay check stops its reference execution at the optimizer (an exception)
            with OperatorMode(self.workload.model, self.workload.optimizer, [injector], self.step):
                return self.workload.run_step(batch)
        finally:
            self.fired.setdefault(self.step, []).append(bool(injector.fired))
            self.spent = fault.mode == "single" and bool(injector.fired)

    @property
    def first_fired(self) -> int | None:
        return min((step for step, fired in self.fired.items() if any(fired)), default=None)

    def diverging_steps(self) -> list[int]:
        """Steps whose executions did not all fire alike: a replay check can see those."""
        return sorted(s for s, fired in self.fired.items() if any(fired) and not all(fired))

    def wrapped(self) -> Workload:
        """The workload a detector drives: the same model and optimizer, this step."""
        base = self.workload
        return Workload(
            base.model,
            base.optimizer,
            base.get_batch,
            base.loss_fn,
            train_step=self,
            state=base.state,
        )


def _checked_tensors(workload: Workload, batch) -> list[torch.Tensor]:
    """The loss and every gradient of the step's forward and backward, as raw bits."""
    workload.optimizer.zero_grad(set_to_none=True)
    loss = workload.loss(batch)
    loss.backward()
    grads = [p.grad for p in workload.model.parameters() if p.grad is not None]
    return [raw_bits(t.detach()).clone() for t in (loss, *grads)]


def _xor_changes(clean: torch.Tensor, faulty: torch.Tensor) -> bool:
    """Does the XOR of all the tensor's words change (TorchTitan's ``torch.hash_tensor``)? Only
    if some bit is flipped in an odd number of elements: a swap or a pair of flips is blind."""
    flipped = (clean ^ faulty).reshape(-1).to(torch.int64)
    bits = torch.arange(8 * clean.element_size())
    return bool((((flipped.unsqueeze(1) >> bits) & 1).sum(0) % 2).any())


def changes_checked_tensors(
    workload: Workload, fault: PlantedFault, step: int, batch
) -> tuple[bool, bool]:
    """Does a firing of ``fault`` in ``step`` change the loss or a gradient, and does it
    change their XOR hashes? (the oracle; ``workload.loss`` is the forward and backward
    TorchTitan's replayer checks: the first micro-batch's)

    The forward and backward run twice from the same parameters and RNG, clean and with
    the fault forced (p=1); gradients and RNG are put back after.
    """
    model = workload.model
    saved = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    rng = capture_rng(CPU)
    clean = _checked_tensors(workload, batch)
    restore_rng(rng, CPU)
    forced = Injector([dataclasses.replace(fault.spec, p=1.0)], "cpu")
    with OperatorMode(model, workload.optimizer, [forced], step):
        faulty = _checked_tensors(workload, batch)
    restore_rng(rng, CPU)
    for parameter, grad in zip(model.parameters(), saved):
        parameter.grad = grad
    fired = bool(forced.fired)
    return (
        fired and any(not torch.equal(a, b) for a, b in zip(clean, faulty)),
        fired and any(_xor_changes(a, b) for a, b in zip(clean, faulty)),
    )


# ---------------------------------------------------------------------------
# The detectors, driven the same way


class Plain:
    """No detector: the loop's step (the overhead baseline)."""

    name = "plain"

    def __init__(self, workload: Workload, args: argparse.Namespace):
        self.workload = workload

    def run(self, step: int, batch) -> dict | None:
        self.workload.run_step(batch)
        return None

    def close(self) -> None:
        pass


class Replay:
    """``online.ReplayCheck`` on every step (``num_steps=-1``), one replay."""

    name = "ReplayCheck"

    def __init__(self, workload: Workload, args: argparse.Namespace):
        from sdcreplay.online.replay_check import ReplayCheck

        self.check = ReplayCheck(workload, num_steps=-1, num_replays=1)

    def run(self, step: int, batch) -> dict | None:
        from sdcreplay.online.stopping import SDCReplayMismatch

        try:
            self.check.run_step(batch, step=step)
        except SDCReplayMismatch as mismatch:  # the step was rolled back: the loop may go on
            return {"step": step, "entry": mismatch.entry, "elements": mismatch.elements}
        return None

    def close(self) -> None:
        self.check.close()


class Updates:
    """``online.UpdateDetector`` as it comes (judged before the update, nothing copied), with
    Megatron's 10x rule against the campaign's first steps."""

    name = "UpdateDetector"
    when = "before_update"

    def __init__(self, workload: Workload, args: argparse.Namespace):
        from sdcreplay.online.update_detector import UpdateDetector

        self.detector = UpdateDetector(
            workload,
            alpha=args.alpha,
            warmup=args.warmup,
            spike_steps=args.spike_steps,
            when=self.when,  # type: ignore[arg-type]
        )

    def run(self, step: int, batch) -> dict | None:
        from sdcreplay.online.stopping import (
            NonFiniteResultError,
            PersistentFaultError,
            RecomputeLimitError,
        )

        before = len(self.detector.alarms)
        fatal = True
        try:
            self.detector.run_step(batch, step=step)
            fatal = False
        except (PersistentFaultError, RecomputeLimitError, NonFiniteResultError) as error:
            alarm = error.alarm
        else:
            if len(self.detector.alarms) == before:
                return None
            alarm = self.detector.alarms[-1]
        return {
            "step": step,
            "reasons": alarm.reasons[:3],
            # judged once applied, an update that cannot be recomputed is left unresolved
            "classification": alarm.classification or "unresolved",
            "fatal": fatal,
        }

    def close(self) -> None:
        self.detector.close()


class CopiedUpdates(Updates):
    """``UpdateDetector(when="after_update")``: seeds/001's update rule (alpha 0.05) on a copy
    of the state taken before every step."""

    name = "UpdateDetector(after_update)"
    when = "after_update"


DETECTORS: dict[str, type] = {
    "ReplayCheck": Replay,
    "UpdateDetector": Updates,
    "UpdateDetector(after_update)": CopiedUpdates,
}


# ---------------------------------------------------------------------------
# Trials


def model_kwargs(args: argparse.Namespace, seed: int) -> dict:
    return {
        "seed": seed,
        "layers": args.layers,
        "dim": args.dim,
        "heads": 2,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "vocab": 64,
    }


def run_trial(
    detector: str,
    fault: PlantedFault | None,
    seed: int,
    args: argparse.Namespace,
    build: Callable[[int], Workload] | None = None,
    faulty_step: type[FaultyStep] = FaultyStep,
) -> dict:
    """One training run of ``args.steps`` steps under ``detector`` and what it alarmed.

    The run goes on after an alarm (a detector that rolled a step back lets the loop
    continue), so a clean run counts every false alarm and the update detector can reach
    ``persistent``; it ends at a fatal error, and the replay check's at its first detection.
    ``build(seed)``: the workload (default: tiny-llama at ``args``' size); ``faulty_step``: the
    step with the fault planted.
    """
    workload = (
        build(seed) if build else build_workload("builtin:tiny-llama", model_kwargs(args, seed))
    )
    faulty = faulty_step(workload, fault)
    running = DETECTORS[detector](faulty.wrapped(), args)
    oracle = detector == "ReplayCheck" and fault is not None
    alarms: list[dict] = []
    visible = xor_visible = None
    steps_run = 0
    try:
        for step in range(args.steps):
            steps_run = step + 1
            faulty.step = step
            batch = workload.get_batch(step)
            changes = (
                changes_checked_tensors(workload, fault, step, batch)
                if oracle and visible is None and fault is not None and fault.active(step)
                else (False, False)
            )
            alarm = running.run(step, batch)
            if changes[0] and step in faulty.diverging_steps():
                visible = step
            if changes[1] and xor_visible is None and step in faulty.diverging_steps():
                xor_visible = step
            if alarm is None:
                continue
            alarms.append(alarm)
            fired = faulty.first_fired
            if alarm.get("fatal") or (oracle and fired is not None and step >= fired):
                break
    finally:
        running.close()
    first = faulty.first_fired
    after = [a for a in alarms if first is not None and a["step"] >= first]
    return {
        "detector": detector,
        "seed": seed,
        "fault": fault.to_json() if fault else None,
        "first_fired": first,
        "alarms": alarms,
        "visible": visible,
        "xor_visible": xor_visible,
        "steps_run": steps_run,
        "detected": bool(after),
        "steps_to_alarm": after[0]["step"] - first if after and first is not None else None,
        "classification": after[0].get("classification") if after else None,
        "reasons": sorted({r.split(":")[0] for r in after[0].get("reasons", [])}) if after else [],
        "persistent": any(a.get("classification") == "persistent" for a in after),
        "false_alarms": len(alarms) - len(after),
    }


def campaign(args: argparse.Namespace, on_trial: Callable[[dict], None]) -> list[dict]:
    """Every detector on the same random faults: ``args.trials`` per kind and mode."""
    sites = step_sites(build_workload("builtin:tiny-llama", model_kwargs(args, 0)))
    draw = random.Random(args.seed)
    planted = [
        (random_fault(draw, sites, kind, mode, args.steps), 1 + number)
        for number, (kind, mode, _) in enumerate(
            (kind, mode, trial) for kind in KINDS for mode in MODES for trial in range(args.trials)
        )
    ]
    results = []
    for detector in args.detectors:
        for fault, seed in planted:
            results.append(run_trial(detector, fault, seed, args))
            on_trial(results[-1])
        for clean in range(args.clean_runs):
            results.append(run_trial(detector, None, 10_000 + clean, args))
            on_trial(results[-1])
    return results


# ---------------------------------------------------------------------------
# Overhead, side by side


def overhead(
    args: argparse.Namespace, workload: Workload | None = None
) -> dict[str, dict[str, float]]:
    """Median step time (wall and process CPU) of the plain step and under each detector.

    One model (``workload``, default tiny-llama at ``args``' size): blocks of steps in turn
    (plain, detector 1, detector 2, plain, ...), after a warm-up of each, so drift in the
    machine's speed hits every mode alike.
    """
    if workload is None:
        workload = build_workload("builtin:tiny-llama", model_kwargs(args, 0))
    modes = {"plain": Plain(workload, args)}
    modes.update((name, DETECTORS[name](workload, args)) for name in args.detectors)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    step = 0
    try:
        for block in range(args.overhead_blocks + 1):
            for name, mode in modes.items():
                for _ in range(args.block_steps):
                    batch = workload.get_batch(step)
                    wall, cpu = time.perf_counter(), time.process_time()
                    mode.run(step, batch)
                    if block:  # block 0 is the warm-up
                        times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
                    step += 1
    finally:
        for mode in modes.values():
            mode.close()
    plain_wall = statistics.median(t[0] for t in times["plain"])
    plain_cpu = statistics.median(t[1] for t in times["plain"])
    return {
        name: {
            "wall_ms": 1000 * statistics.median(t[0] for t in spent),
            "cpu_ms": 1000 * statistics.median(t[1] for t in spent),
            "wall_ratio": statistics.median(t[0] for t in spent) / plain_wall,
            "cpu_ratio": statistics.median(t[1] for t in spent) / plain_cpu,
            "steps": len(spent),
        }
        for name, spent in times.items()
    }


# ---------------------------------------------------------------------------
# Tables


def _rate(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else "-"


def _steps(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):g} (max {max(values)})"


def summarize(results: list[dict]) -> dict:
    """Per detector: by kind, by mode and by phase; clean runs; the replay check's target."""
    summary: dict = {}
    for detector in dict.fromkeys(r["detector"] for r in results):
        mine = [r for r in results if r["detector"] == detector]
        faulty = [r for r in mine if r["fault"] is not None]
        clean = [r for r in mine if r["fault"] is None]
        groups = {
            "kind": lambda r: r["fault"]["kind"],
            "mode": lambda r: r["fault"]["mode"],
            "phase": lambda r: _phase(r["fault"]["spec"]),
            "field": lambda r: r["fault"]["field"],
        }
        entry: dict = {}
        for axis, key in groups.items():
            entry[axis] = {}
            for value in dict.fromkeys(key(r) for r in faulty):
                rows = [r for r in faulty if key(r) == value]
                entry[axis][value] = _group(rows)
        entry["all"] = _group(faulty)
        entry["clean"] = {
            "runs": len(clean),
            "steps": sum(r["steps_run"] for r in clean),
            "alarms": sum(r["false_alarms"] for r in clean),
            "runs_with_alarm": sum(r["false_alarms"] > 0 for r in clean),
        }
        summary[detector] = entry
    return summary


def _phase(spec: str) -> str:
    return dict(part.split("=", 1) for part in spec.split(","))["phase"]


def _group(rows: list[dict]) -> dict:
    fired = [r for r in rows if r["first_fired"] is not None]
    visible = [r for r in rows if r["visible"] is not None]
    classified = Counter(r["classification"] for r in rows if r["classification"])
    reasons = Counter(reason for r in rows for reason in r["reasons"])
    return {
        "trials": len(rows),
        "fired": len(fired),
        "detected": sum(r["detected"] for r in rows),
        "persistent": sum(r["persistent"] for r in rows),
        "runs_alarmed_before_firing": sum(r["false_alarms"] > 0 for r in rows),
        "steps_to_alarm": [r["steps_to_alarm"] for r in rows if r["detected"]],
        "visible": len(visible),
        "visible_detected": sum(r["detected"] for r in visible),
        "first_classified": dict(classified),
        "reasons": dict(reasons),
    }


def markdown(summary: dict, costs: dict, args: argparse.Namespace) -> str:
    lines = [
        f"{args.trials} trial(s) per kind and mode ({len(MODES)} modes), {args.steps} steps "
        f"each; {args.clean_runs} clean runs per detector; seed {args.seed}.",
        "",
        "| detector | kind | trials | fired | detected (of fired) | steps to alarm, median "
        "(max) | visible to a replay | detected (of visible) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for detector, entry in summary.items():
        for kind, group in [*entry["kind"].items(), ("all", entry["all"])]:
            lines.append(
                f"| {detector} | {kind} | {group['trials']} | {group['fired']} | "
                f"{_rate(group['detected'], group['fired'])} | "
                f"{_steps(group['steps_to_alarm'])} | "
                + (
                    f"{group['visible']} | {_rate(group['visible_detected'], group['visible'])} |"
                    if detector == "ReplayCheck"
                    else "- | - |"
                )
            )
    lines += [
        "",
        "| detector | mode, phase or bits | trials | fired | detected (of fired) | classified "
        "(alarm reasons) |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for detector, entry in summary.items():
        for axis in ("mode", "phase", "field"):
            for value, group in entry[axis].items():
                classes = ", ".join(
                    f"{k} {v}" for k, v in sorted(group["first_classified"].items())
                )
                if group["persistent"]:
                    classes += f"; persistent later: {group['persistent']}"
                if group["reasons"]:
                    classes += (
                        " ("
                        + ", ".join(f"{k} {v}" for k, v in sorted(group["reasons"].items()))
                        + ")"
                    )
                lines.append(
                    f"| {detector} | {value} | {group['trials']} | {group['fired']} | "
                    f"{_rate(group['detected'], group['fired'])} | {classes or '-'} |"
                )
    lines += [
        "",
        "| detector | clean runs | steps | runs with an alarm | alarms per step | "
        "faulty runs alarmed before the fault fired | step time (wall) | ratio to plain "
        "(wall / CPU) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, cost in costs.items():
        entry = summary.get(name)
        if entry and entry["clean"]["steps"]:
            clean = entry["clean"]
            alarms = (
                f"{clean['runs']} | {clean['steps']} | "
                f"{_rate(clean['runs_with_alarm'], clean['runs'])} | "
                f"{100 * clean['alarms'] / clean['steps']:.2f}% | "
                f"{_rate(entry['all']['runs_alarmed_before_firing'], entry['all']['trials'])}"
            )
        else:
            alarms = "- | - | - | - | -"
        lines.append(
            f"| {name} | {alarms} | {cost['wall_ms']:.1f} ms | "
            f"{cost['wall_ratio']:.2f} / {cost['cpu_ratio']:.2f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 trial each")
    parser.add_argument("--trials", type=int, default=4, help="trials per kind and mode")
    parser.add_argument("--steps", type=int, default=30, help="training steps per trial")
    parser.add_argument("--clean-runs", type=int, default=10, help="clean runs per detector")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random faults")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.05, help="UpdateDetector's alpha")
    parser.add_argument("--warmup", type=int, default=10, help="UpdateDetector's warm-up")
    parser.add_argument(
        "--spike-steps",
        type=int,
        default=10,
        help="UpdateDetector's spike rule: 10x the largest loss/gradient norm of this many "
        "first steps (Megatron: 100; the campaign's runs are shorter)",
    )
    parser.add_argument("--overhead-blocks", type=int, default=8)
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument(
        "--detectors", default=",".join(DETECTORS), help="comma-separated: " + ", ".join(DETECTORS)
    )
    parser.add_argument("--json", type=Path, help="write every trial and the summary here")
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.steps, args.clean_runs = 1, 10, 2
        args.warmup, args.overhead_blocks, args.block_steps = 3, 1, 2
    args.detectors = [name.strip() for name in args.detectors.split(",") if name.strip()]
    unknown = [name for name in args.detectors if name not in DETECTORS]
    if unknown:
        parser.error(f"unknown detector(s) {', '.join(unknown)}; known: {', '.join(DETECTORS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()

    def progress(result: dict) -> None:
        fault = result["fault"]
        what = f"{fault['kind']}/{fault['mode']}" if fault else "clean"
        steps = [alarm["step"] for alarm in result["alarms"]]
        fired = result["first_fired"]
        said = f"fired {fired}, " if fault else ""
        said += f"alarms at {steps}" if steps else "no alarm"
        print(f"{result['detector']:>14} {what:<22} {said}", file=sys.stderr)

    results = campaign(args, progress)
    costs = overhead(args)
    summary = summarize(results)
    table = markdown(summary, costs, args)
    print(table)
    print(f"\n({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: v for k, v in vars(args).items() if k != "json"},
                    "summary": summary,
                    "overhead": costs,
                    "trials": results,
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
