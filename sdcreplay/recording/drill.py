"""A drill: the recording device's faults, injected into the loop's own recorded steps.

``Recorder(inject=...)``, ``record(..., inject=...)`` and ``SDCREPLAY_INJECT`` make the
recording device defective: each recorded step's block runs under the fault injector
(`capture/faults.py`), so the bundle holds exactly what a defective device would have
recorded. The manifest names the specs that fired (``injected_faults``), and only those:
a spec that matched no call of a recorded step changes nothing, is said by name at
``close()`` (`UnmatchedFaultWarning`), and does not make the bundle a drill.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..bundle.writer import BundleWriter
from ..capture.compiled_kernels import KernelCall, observing_kernels
from ..capture.faults import Injector, parse_specs
from ..capture.operators import CallSite, OperatorMode
from ..replay.replicas import ops_command


class UnmatchedFaultWarning(UserWarning):
    """A recording's fault spec selected no call of any recorded step."""


class Drill:
    """The recording device's fault injector, opened around each recorded step.

    ``fired_specs`` is a live list (the Recorder's ``injected_faults``, which its ring dumps
    and their ledger notes read as they happen): the specs that have fired so far, in the
    order they first fired.
    """

    def __init__(
        self,
        inject: Sequence[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        label: str,
    ):
        self.injector = Injector(parse_specs(inject), label)
        self.model, self.optimizer = model, optimizer
        self.fired_specs: list[str] = []
        self.writer: BundleWriter | None = None  # the bundle whose manifest names them
        self._open = False

    @property
    def armed(self) -> bool:
        """Does any spec apply to this device (and rank)?"""
        return bool(self.injector.specs)

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Run step ``index``'s work as the defective device would (nothing without specs).

        Re-entrant: a caller that opened it around more than the Recorder's block (a
        detector that runs the step's executions itself) keeps its one count of the calls.
        """
        if self._open or not self.armed:
            yield
            return
        self._open = True
        try:
            self.injector.before_step(index, self.model)
            self._note_fired()
            operators = (
                OperatorMode(self.model, self.optimizer, [self], index)
                if self.injector.has_operator_faults
                else contextlib.nullcontext()
            )
            kernels = (
                observing_kernels([self], index, self.model)
                if self.injector.has_kernel_faults
                else contextlib.nullcontext()
            )
            with operators, kernels:
                yield
        finally:
            self._open = False

    def on_call(self, site: CallSite, func, args, kwargs, out):
        out = self.injector.on_call(site, func, args, kwargs, out)
        self._note_fired()
        return out

    def on_kernel(self, call: KernelCall) -> None:
        self.injector.on_kernel(call)
        self._note_fired()

    def _note_fired(self) -> None:
        new = [
            injection.spec
            for injection in self.injector.fired
            if injection.spec not in self.fired_specs
        ]
        if not new:
            return
        self.fired_specs.extend(dict.fromkeys(new))
        if self.writer is not None:  # saved with the next step (a crash keeps the mark)
            self.writer.manifest.present("injected_faults", list(self.fired_specs))

    def unmatched(self) -> list[dict]:
        """The operator and kernel specs that selected no call, with the closest calls."""
        return self.injector.unmatched()

    def close(self, bundle: Path | str = "BUNDLE") -> None:
        """Say each spec that matched no call of a recorded step, by name, with the ``ops``
        command that lists the calls of ``bundle`` (a job's: this rank's part)."""
        for miss in self.unmatched():
            warnings.warn(
                f"fault spec {miss['spec']!r} matched no operator call of the recorded steps, "
                "so nothing was injected for it; closest calls: "
                + ("; ".join(miss["closest"]) or "none")
                + f" (`{listing_command(bundle, miss['spec'])}` lists them all)",
                UnmatchedFaultWarning,
                stacklevel=3,
            )


def listing_command(bundle: Path | str, spec: str) -> str:
    """The ``sdcreplay ops`` command that lists the calls of the step ``spec`` names."""
    (parsed,) = parse_specs([spec], include_env=False)
    return ops_command(bundle, parsed.step)
