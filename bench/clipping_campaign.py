"""Detection under gradient clipping: the detection campaign on the loops people run.

    python bench/clipping_campaign.py                # the table in docs/benchmarks.md
    python bench/clipping_campaign.py --quick        # a smoke run: every kind, 1 placement
    python bench/clipping_campaign.py --json out.json

``bench/detection_campaign.py``'s trials (a fresh model per trial, one fault planted, the run
goes on after an alarm) on two loops, each with ``clip_grad_norm_(1.0)`` and without it:
``nanogpt`` (``bench/nanogpt_loop.py``: AdamW, warm-up + cosine, two micro-batches, dropout)
and ``tiny-llama`` (``builtin:tiny-llama``, AdamW, ``grad_clip=1.0``). Every fault is one
upset at a random step (from a third of the run) and place, of every kind the fault spec has:

- ``bitflip`` in one element of a random operator call's output (forward, backward, the
  clipping, the optimizer), by the part of the float32 word it hits: the exponent's top bit
  (30: x2^128 or /2^128), its low bits (23-29), the mantissa's high bits (16-22), its low bits
  (0-15);
- ``mask`` (2-8 bits), ``burst`` (2-16 neighbouring elements), ``bias`` (1-16 elements scaled by
  1+s, s log-uniform in 1e-4..1), ``swap``, ``nan`` in a call's output;
- ``memflip`` of one random bit of a parameter before the step, or of AdamW's state
  (``exp_avg`` or ``exp_avg_sq``).

Detectors: ``UpdateDetector`` (default, judged before the update, nothing copied),
``UpdateDetector(after_update)``, ``ReplayCheck`` (every step, one replay) and TorchTitan's
replayer, whose verdict is derived from the same ReplayCheck trials: it re-runs the first
micro-batch's forward and backward and compares XOR hashes of the loss and gradients, so it
detects a fault iff one execution of a step fired it, the others did not, and forcing it
changes the XOR hash of the first micro-batch's loss or a gradient (the campaign's oracle).
Clean runs of each clipped loop give the false alarms; the cost per step is measured side by
side on the clipped nanoGPT loop.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from detection_campaign import (
    DETECTORS,
    FaultyStep,
    PlantedFault,
    Site,
    model_kwargs,
    overhead,
    random_mask,
    run_trial,
    step_sites,
)
from nanogpt_loop import make_workload

from sdcreplay.capture.faults import FaultSpec, Injector
from sdcreplay.storage.tensorio import raw_bits
from sdcreplay.workload.definition import Workload, build_workload

BITS = {
    "bitflip exponent top (30)": (30, 30),
    "bitflip exponent low (23-29)": (23, 29),
    "bitflip mantissa high (16-22)": (16, 22),
    "bitflip mantissa low (0-15)": (0, 15),
}
KINDS = (*BITS, "mask", "burst", "bias", "swap", "nan", "memflip parameter", "memflip optimizer")
LOOPS = ("nanogpt", "tiny-llama")
OPTIMIZER_STATE = ("exp_avg", "exp_avg_sq")


def builder(loop: str, clip: bool, args: argparse.Namespace) -> Callable[[int], Workload]:
    """The workload of a trial's seed."""
    if loop == "nanogpt":
        return lambda seed: make_workload(
            seed=seed, grad_clip=1.0 if clip else 0.0, decay_iters=args.steps * 4
        )
    return lambda seed: build_workload(
        "builtin:tiny-llama", dict(model_kwargs(args, seed), grad_clip=1.0 if clip else None)
    )


@dataclass
class Planted(PlantedFault):
    """A planted fault with its campaign kind; ``state``: the optimizer state it flips."""

    label: str = ""
    state: str | None = None

    def to_json(self) -> dict:
        return {**super().to_json(), "kind": self.label, "state": self.state}


def draw_fault(
    draw: random.Random, sites: list[Site], workload: Workload, label: str, args
) -> Planted:
    """One upset of kind ``label``, at a random step from ``args.first_step`` (the detector's
    warm-up) to two before the run's end."""
    start = draw.randrange(args.first_step, args.steps - 2)
    if label.startswith("memflip"):
        name, param = draw.choice(list(workload.model.named_parameters()))
        spec = FaultSpec(
            kind="memflip", param=name, step=start, index=draw.randrange(param.numel()),
            bit=draw.randrange(32),
        )  # fmt: skip
        site = Site("memory", name, "state", 0, param.numel(), 32, 23)
        state = draw.choice(OPTIMIZER_STATE) if label.endswith("optimizer") else None
        return Planted(label, "single", start, spec, site, label=label, state=state)
    site = draw.choice(sites)
    index = draw.randrange(site.numel)
    keys: dict = {}
    if label in BITS:
        keys["bit"] = draw.randint(*BITS[label])
    elif label == "mask":
        keys["mask"] = random_mask(draw, site.width)
    elif label == "burst":
        keys["count"] = draw.randint(2, 16)
        keys["bit"] = draw.randrange(site.width)
    elif label == "bias":
        keys["count"] = draw.randint(1, min(16, site.numel - index))
        keys["scale"] = float(f"{10 ** draw.uniform(-4, 0):.3g}")
    elif label == "swap":
        index = min(index, site.numel - 2)
        keys["count"] = draw.randint(1, site.numel - 1 - index)
    kind = label.split()[0]
    spec = FaultSpec(
        kind=kind,  # type: ignore[arg-type]
        op=site.op, module=site.module, phase=site.phase, nth=site.nth, index=index, **keys,
    )  # fmt: skip
    return Planted(kind, "single", start, spec, site, label=label)


class UpsetStep(FaultyStep):
    """``FaultyStep`` with memory upsets too: a parameter's bits (the spec's ``memflip``, as the
    injector flips them before a step) or the optimizer state's, at the first execution of the
    fault's step; the step then runs as it is."""

    def __call__(self, batch):
        fault = self.fault
        if fault is None or fault.spec.kind != "memflip":
            return super().__call__(batch)
        self.executions[self.step] += 1
        fires = fault.active(self.step) and not self.spent
        if fires:
            self._flip(fault)
            self.spent = True
        self.fired.setdefault(self.step, []).append(fires)
        return self.workload.run_step(batch)

    def _flip(self, fault: PlantedFault) -> None:
        spec, model = fault.spec, self.workload.model
        state = getattr(fault, "state", None)
        if state is None:
            Injector([spec], "cpu").before_step(self.step, model)
            return
        param = dict(model.named_parameters())[spec.param or ""]
        moments = self.workload.optimizer.state.get(param, {})
        if state in moments:
            words = raw_bits(moments[state].detach()).view(-1)
            bit = spec.bit or 0
            words[spec.index % words.numel()] ^= (1 << bit) if bit < 31 else -(1 << 31)


def campaign(args: argparse.Namespace, on_trial: Callable[[dict], None]) -> None:
    """Clean clipped runs first, then every fault on every loop, clipped and not, under every
    detector, placement by placement: a run cut short still covers every kind alike."""
    builds = {(loop, clip): builder(loop, clip, args) for loop in args.loops for clip in (1, 0)}
    for (loop, clip), build in builds.items():
        for detector in args.detectors if clip else ():
            runs = args.clean_runs if detector != "ReplayCheck" else args.clean_runs_replay
            for clean in range(runs):
                clean_args = args_with(args, args.clean_steps)
                result = run_trial(detector, None, 10_000 + clean, clean_args, build)
                on_trial({**result, "loop": loop, "clip": bool(clip)})
    planted = {}
    for loop in args.loops:
        draw = random.Random(f"{args.seed}:{loop}")  # the same faults with and without clip
        workload = builds[loop, 1](0)
        sites = step_sites(workload)
        planted[loop] = [
            [draw_fault(draw, sites, workload, label, args) for label in KINDS]
            for _ in range(args.placements)
        ]
    for placement in range(args.placements):
        for loop in args.loops:
            for number, fault in enumerate(planted[loop][placement]):
                if KINDS[number] not in args.kinds:
                    continue
                seed = 1 + placement * len(KINDS) + number
                for clip in (1, 0):
                    for detector in args.detectors:
                        result = run_trial(
                            detector, fault, seed, args, builds[loop, clip], UpsetStep
                        )
                        on_trial({**result, "loop": loop, "clip": bool(clip)})


def args_with(args: argparse.Namespace, steps: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "steps": steps})


def _rate(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else "-"


def _median(values: list[int]) -> str:
    return f"{statistics.median(values):g} (max {max(values)})" if values else "-"


def verdicts(rows: list[dict], detector: str) -> list[tuple[bool, int | None]]:
    """(detected, steps from the first firing to the alarm) per fired trial; TorchTitan's from
    the ReplayCheck trials' oracle."""
    fired = [r for r in rows if r["first_fired"] is not None]
    if detector == "TorchTitan":
        return [
            (r["xor_visible"] is not None,
             None if r["xor_visible"] is None else r["xor_visible"] - r["first_fired"])
            for r in fired
        ]  # fmt: skip
    return [(r["detected"], r["steps_to_alarm"]) for r in fired]


def markdown(results: list[dict], costs: dict, args: argparse.Namespace) -> str:
    detectors = [*args.detectors, *(["TorchTitan"] if "ReplayCheck" in args.detectors else [])]
    lines = [
        f"{args.placements} placements per kind, {args.steps} steps per trial, seed "
        f"{args.seed}; detected of fired (median steps to the alarm, max).",
        "",
        "| loop | kind | clip | " + " | ".join(detectors) + " |",
        "| --- | --- | --- |" + " ---: |" * len(detectors),
    ]
    faulty = [r for r in results if r["fault"] is not None]
    for loop in args.loops:
        for kind in (*KINDS, "all"):
            for clip in (True, False):
                cells = []
                for detector in detectors:
                    source = "ReplayCheck" if detector == "TorchTitan" else detector
                    rows = [
                        r for r in faulty
                        if r["loop"] == loop and r["clip"] == clip and r["detector"] == source
                        and kind in ("all", r["fault"]["kind"])
                    ]  # fmt: skip
                    seen = verdicts(rows, detector)
                    steps = [s for hit, s in seen if hit and s is not None]
                    cells.append(
                        f"{_rate(sum(hit for hit, _ in seen), len(seen))}, {_median(steps)}"
                    )
                lines.append(
                    f"| {loop} | {kind} | {'on' if clip else 'off'} | " + " | ".join(cells) + " |"
                )
    lines += [
        "",
        "| detector | clean clipped runs | steps | alarms | faulty runs alarmed before the "
        "fault fired | step time (wall, clipped nanogpt) | ratio to plain (wall / CPU) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in dict.fromkeys([*costs, *args.detectors]):
        cost = costs.get(name)
        clean = [r for r in results if r["detector"] == name and r["fault"] is None]
        early = [r for r in faulty if r["detector"] == name]
        counts = (
            f"{len(clean)} | {sum(r['steps_run'] for r in clean)} | "
            f"{sum(r['false_alarms'] for r in clean)} | "
            f"{_rate(sum(r['false_alarms'] > 0 for r in early), len(early))}"
            if clean
            else "- | - | - | -"
        )
        timing = (
            f"{cost['wall_ms']:.1f} ms | {cost['wall_ratio']:.2f} / {cost['cpu_ratio']:.2f}"
            if cost
            else "- | -"
        )
        lines.append(f"| {name} | {counts} | {timing} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 placement each")
    parser.add_argument("--placements", type=int, default=20, help="faults per kind")
    parser.add_argument("--steps", type=int, default=20, help="training steps per trial")
    parser.add_argument("--first-step", type=int, default=10, help="first step a fault fires")
    parser.add_argument("--clean-runs", type=int, default=5, help="clean clipped runs per loop")
    parser.add_argument("--clean-runs-replay", type=int, default=1, help="the same, ReplayCheck")
    parser.add_argument("--clean-steps", type=int, default=100, help="steps per clean run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--spike-steps", type=int, default=10)
    parser.add_argument("--overhead-blocks", type=int, default=8)
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument("--detectors", default=",".join(DETECTORS))
    parser.add_argument("--kinds", default=",".join(KINDS), help="run these kinds' faults only")
    parser.add_argument("--trials-out", help="append every trial here as a JSON line")
    parser.add_argument("--overhead", action="store_true", help="measure the cost per step")
    parser.add_argument(
        "--render", nargs="+", help="no trials: the table of these --trials-out files"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.placements, args.steps, args.first_step = 1, 14, 10
        args.clean_runs, args.clean_steps, args.overhead_blocks, args.block_steps = 1, 14, 1, 2
    args.loops = [name for name in args.loops.split(",") if name]
    args.detectors = [name for name in args.detectors.split(",") if name]
    args.kinds = [name for name in args.kinds.split(",") if name]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        lines = [json.loads(line) for path in args.render for line in open(path) if line.strip()]
        costs = next((line["overhead"] for line in lines if "overhead" in line), {})
        print(markdown([line for line in lines if "overhead" not in line], costs, args))
        return 0
    torch.set_num_threads(1)
    started = time.perf_counter()
    results: list[dict] = []
    out = open(args.trials_out, "a") if args.trials_out else None

    def keep(line: dict) -> None:
        if out is not None:
            out.write(json.dumps(line, default=str) + "\n")
            out.flush()

    if args.overhead:
        keep({"overhead": overhead(args, builder("nanogpt", True, args)(0))})

    def progress(result: dict) -> None:
        results.append(result)
        keep(result)
        fault = result["fault"]
        what = fault["kind"] if fault else "clean"
        alarms = [alarm["step"] for alarm in result["alarms"]]
        print(
            f"{time.perf_counter() - started:6.0f}s {result['loop']:>10} clip={result['clip']!s:5} "
            f"{result['detector']:>28} {what:<30} fired {result['first_fired']}, alarms {alarms}",
            file=sys.stderr,
            flush=True,
        )

    campaign(args, progress)
    print(f"\n({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
