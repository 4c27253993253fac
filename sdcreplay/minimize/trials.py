"""One operator call run alone, again and again, on one device: the trials everything else counts.

Minimize measures a failure rate, tests shrink candidates and random data, and
each of them is a number of trials of one input set on one device against an
expected output. How a trial is run (placed once, cloned only when the call
writes its inputs, compared over the raw bits without waiting for the device)
and SiliFuzz's acceptance rule built from two such runners live here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..bisect.operator_case import place, to_cpu
from ..capture.determinism import restore_operator_rng
from ..capture.digest import tensor_digest
from ..capture.faults import FaultSpec, Injector
from ..capture.operators import CallSite, operator_results
from ..compare.forensics import element_forensics
from ..devices import torch_device
from ..storage.tensorio import map_tensors, raw_bits
from .statistics import wilson_interval

PROGRESS_SECONDS = 0.2
KEPT_OUTPUT_BYTES = 256 << 20  # outputs a device may hold while its verdicts wait for one sync


@dataclass
class Measurement:
    """F failures in N trials of one input set on one device."""

    device: str
    trials: int
    failures: int
    trials_to_first_failure: int | None  # 1-based: the trial that failed first
    first_failure: dict | None  # which output, and element_forensics of it
    failing_outputs: list | None  # the first failing trial's outputs, on the CPU
    seconds: float

    @property
    def rate(self) -> float:
        return self.failures / self.trials if self.trials else 0.0

    @property
    def ci95(self) -> tuple[float, float]:
        return wilson_interval(self.failures, self.trials)

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "trials": self.trials,
            "failures": self.failures,
            "rate": self.rate,
            "ci95": list(self.ci95),
            "trials_to_first_failure": self.trials_to_first_failure,
            "seconds": round(self.seconds, 3),
            "trials_per_second": round(self.trials / self.seconds, 1) if self.seconds else None,
        }


class TrialRunner:
    """Runs one operator call again and again on one device label; counts outputs that differ.

    Inputs are placed on the device once per measurement, used as they are
    when already there (cloned per trial only when the call can write to
    them: in place, ``out=``, or through an output that is a view of one).
    Each output is compared with the expected one where it lies, over the raw
    bits: on a CPU by its xxh3 digest read where it lies (one pass over the
    bytes, several times faster than ``torch.equal``), on an accelerator word
    by word into a flag that stays on the device and is fetched once per block
    of trials, so the loop never waits for the device.
    Only a failing trial's outputs are copied back.
    """

    def __init__(
        self,
        op,
        site: CallSite,
        prior,
        label: str,
        specs: Sequence[FaultSpec],
        rng: dict | None = None,
        rank: int | None = None,
    ):
        self.op, self.site, self.prior, self.label = op, site, prior, label
        self.rng = rng  # a random operator draws the numbers it drew in the step, every trial
        self.rank = rank  # a job's call: the rank it ran on, so a spec's rank= fires as there
        self.device = torch_device(label)
        self.specs = list(specs)
        # Inputs the call can write (in place, out=, or through an output that views them, which
        # an injected flip writes) are cloned for every trial, so each trial starts from the case.
        self.writes_inputs = op._schema.is_mutable or any(
            value.alias_info is not None for value in op._schema.returns
        )
        self._salts = itertools.count()  # a fresh random stream for each block of trials

    def _injector(self) -> Injector | None:
        injector = Injector(self.specs, self.label, salt=next(self._salts), rank=self.rank)
        return injector if injector.has_operator_faults else None

    def _call(self, args: list, kwargs: dict, injector: Injector | None) -> list:
        if self.writes_inputs:
            args, kwargs = map_tensors((args, kwargs), torch.clone)
        restore_operator_rng(self.rng, self.device)
        out = self.op(*args, **kwargs)
        if injector is not None:
            injector.on_isolated_call(self.site, self.prior, out)
        return operator_results(self.op, args, out)

    def _placed(self, args: Sequence, kwargs: dict) -> tuple[list, dict]:
        """The inputs on the device; no copy of inputs already there (a trial never writes them)."""
        tree = (list(args), kwargs)
        on_device = []
        map_tensors(tree, lambda t: on_device.append(t.device == self.device))
        return tree if all(on_device) else place(tree, self.device)

    def outputs(self, args: Sequence, kwargs: dict) -> list:
        """One run's outputs, on the CPU: the expected outputs of a candidate on the reference."""
        placed_args, placed_kwargs = self._placed(args, kwargs)
        return to_cpu(self._call(placed_args, placed_kwargs, self._injector()))

    def measure(
        self,
        args: Sequence,
        kwargs: dict,
        expected: Sequence,
        trials: int,
        *,
        stop_at_first_failure: bool = False,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> Measurement:
        placed_args, placed_kwargs = self._placed(args, kwargs)
        wanted = self._expectation(expected)
        injector = self._injector()
        block = 1 if self.device.type == "cpu" else _block_size(expected)
        failures, first_trial, first_outputs = 0, None, None
        started = time.perf_counter()
        reported = started
        done = 0
        while done < trials and not (stop_at_first_failure and failures):
            pending = [
                self._call(placed_args, placed_kwargs, injector)
                for _ in range(min(block, trials - done))
            ]
            for offset, failed in enumerate(self._verdicts(pending, wanted)):
                if failed:
                    failures += 1
                    if first_trial is None:
                        first_trial, first_outputs = done + offset + 1, to_cpu(pending[offset])
            done += len(pending)
            # Free this block's outputs before the next call allocates its own: the allocator
            # then hands that call the same, cache-warm memory, as in a bare loop (two outputs
            # alive at once made glibc give a 256 KiB matmul output back and fault it in again).
            del pending
            if progress is not None and (
                time.perf_counter() - reported >= PROGRESS_SECONDS or done == trials
            ):
                progress(done, trials, failures)
                reported = time.perf_counter()
        seconds = time.perf_counter() - started
        described = (
            describe_failure(list(expected), first_outputs) if first_outputs is not None else None
        )
        return Measurement(
            self.label, done, failures, first_trial, described, first_outputs, seconds
        )

    def _expectation(self, expected: Sequence) -> list:
        """What each trial's outputs are compared with: digests on a CPU, raw words elsewhere."""
        if self.device.type == "cpu":
            return [tensor_digest(value) for value in expected]
        return [
            raw_bits(e) if isinstance(e, torch.Tensor) else e
            for e in place(list(expected), self.device)
        ]

    def _verdicts(self, pending: list, wanted: list) -> list[bool]:
        """Which trials of a block failed; an accelerator's flags come back in one copy (one
        sync)."""
        if self.device.type == "cpu":
            return [[tensor_digest(value) for value in results] != wanted for results in pending]
        return _fetch([_device_flag(results, wanted) for results in pending])


def _device_flag(results: list, wanted: list) -> bool | torch.Tensor:
    """Outputs vs expected words on the device: a 0-dim bool tensor, or a bool when decided on
    the host."""
    if len(results) != len(wanted):
        return True
    flag: bool | torch.Tensor = False
    for result, expected in zip(results, wanted, strict=True):
        if not isinstance(expected, torch.Tensor):
            if result != expected:
                return True
        elif (
            not isinstance(result, torch.Tensor)
            or result.dtype.itemsize != expected.dtype.itemsize
            or result.shape != expected.shape
        ):
            return True
        else:
            differs = torch.ne(raw_bits(result), expected).any()
            flag = differs if flag is False else flag | differs
    return flag


def _block_size(expected: Sequence) -> int:
    """How many trials' outputs a device may hold before their verdicts are fetched."""
    nbytes = sum(t.numel() * t.element_size() for t in expected if isinstance(t, torch.Tensor))
    return max(1, min(1024, KEPT_OUTPUT_BYTES // max(nbytes, 1)))


def _fetch(verdicts: list) -> list[bool]:
    """Resolve a block's verdicts; the device flags come back in one copy (one sync)."""
    flags = [v for v in verdicts if isinstance(v, torch.Tensor)]
    fetched = iter(torch.stack(flags).tolist() if flags else ())
    return [bool(next(fetched)) if isinstance(v, torch.Tensor) else v for v in verdicts]


def describe_failure(expected: Sequence, actual: Sequence) -> dict:
    """The first differing output of a failing trial and its elements and bits."""
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
            forensics = element_forensics(want, got)
            if forensics.get("count") != 0:
                return {"output": index, **forensics}
        elif want != got:
            return {"output": index, "expected": want, "actual": got}
    return {"output": None, "note": f"{len(actual)} outputs instead of {len(expected)}"}


class Acceptance:
    """SiliFuzz's rule for a candidate reproducer.

    The expected output is the reference device's; the candidate is kept only
    if the suspect fails within ``bad_trials`` runs and the reference then
    passes all ``good_trials`` runs (so a shape that the reference itself does
    not compute reproducibly is never kept).
    """

    def __init__(
        self, suspect: TrialRunner, reference: TrialRunner, good_trials: int, bad_trials: int
    ):
        self.suspect, self.reference = suspect, reference
        self.good_trials, self.bad_trials = good_trials, bad_trials

    def holds(self, args: Sequence, kwargs: dict) -> bool:
        expected = self.reference.outputs(args, kwargs)
        failing = self.suspect.measure(
            args, kwargs, expected, self.bad_trials, stop_at_first_failure=True
        )
        return (
            failing.failures > 0
            and self.reference.measure(args, kwargs, expected, self.good_trials).failures == 0
        )
