"""What one execution of a checked step produced, as digests in execution order.

A replay check is only as good as what it compares: each execution is digested
entry by entry (the loss and gradients of every backward, the gradients the
optimizer is given, then what the step leaves behind) and compared with the
reference while it runs, so the first difference is found with its value still
at hand for forensics (a DTensor's as this rank's local shard).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import torch

from ..capture.digest import Digester, SignatureValue
from ..capture.layers import observed_backward
from ..capture.memory import local_shard
from ..capture.message import Message
from ..capture.module_names import named_parameters
from ..capture.operators import _own_work


@dataclass
class Difference:
    """The first signature entry where an execution differs from the reference."""

    position: int
    entry: str
    reference: str | None  # its digest there; None: the reference has no entry there
    micro_batch: int | None  # the backward (0-based) it came from; None: end-of-step entries
    found: str | None = None  # the execution's digest of that entry; None: it has none there


class _Probe:
    """Digests the entries of one execution; compares them with a reference as they come.

    Entries are fetched after every backward (one device sync) so a gradient is
    digested before the next micro-batch adds to it. The value of the first
    differing entry (or of ``watch``) is copied then, for forensics; nothing
    else is ever copied.
    """

    def __init__(
        self, reference: list[tuple[str, str]] | None = None, watch: str | None = None
    ) -> None:
        self.reference = reference
        self.watch = watch
        # Under torch.distributed: the execution's collectives up to the optimizer's step, and
        # the reference's, so the rank whose input to one differs first can be named.
        self.messages: list[Message] | None = None
        self.reference_messages: list[Message] | None = None
        self.entries: list[tuple[str, str]] = []
        self.difference: Difference | None = None
        self.kept: torch.Tensor | None = None
        self.kept_shard = False  # ``kept`` is this rank's shard of a DTensor
        self.backwards = 0
        self.finished = False
        self._digester = Digester()
        self._values: dict[str, SignatureValue] = {}
        self._calls: Counter[str] = Counter()

    def add(self, name: str, value: SignatureValue) -> None:
        count = self._calls[name]
        self._calls[name] += 1
        name = name if count == 0 else f"{name}#{count}"
        with _own_work():
            self._digester.add(name, value)
        self._values[name] = value

    def flush(self, micro_batch: int | None) -> None:
        with _own_work():
            fetched = self._digester.entries()
        for name, digest in fetched:
            self._note(len(self.entries), name, digest, micro_batch)
            self.entries.append((name, digest))
        self._values = {}

    def _note(self, position: int, name: str, digest: str, micro_batch: int | None) -> None:
        if name == self.watch and self.kept is None:
            self._keep(self._values[name])
        if self.reference is None or self.difference is not None:
            return
        expected = self.reference[position] if position < len(self.reference) else None
        if expected == (name, digest):
            return
        if expected is None or all(name != known for known, _ in self.reference):
            # an entry the reference lacks (a buffer only this execution filled in)
            self.difference = Difference(position, name, None, micro_batch, digest)
        elif expected[0] == name:
            self.difference = Difference(position, name, expected[1], micro_batch, digest)
            self._keep(self._values[name])
        else:  # the reference's entry is missing here
            self.difference = Difference(position, expected[0], expected[1], micro_batch)

    def _keep(self, value: SignatureValue) -> None:
        self.kept = _copied(value)
        self.kept_shard = isinstance(value, torch.Tensor) and local_shard(value) is not value

    def first_input_difference(self) -> int | None:
        """Issue order of the first collective whose input differs from the reference's."""
        if self.messages is None or self.reference_messages is None:
            return None
        pairs = enumerate(zip(self.messages, self.reference_messages))
        return next((i for i, (a, b) in pairs if a.input_digest != b.input_digest), None)

    def finish(self) -> None:
        """The execution ended: an entry the reference has beyond the end is a difference."""
        self.finished = True
        reference = self.reference
        if reference is not None and self.difference is None:
            if len(self.entries) < len(reference):
                name, digest = reference[len(self.entries)]
                self.difference = Difference(len(self.entries), name, digest, None)


def _copied(value: SignatureValue) -> torch.Tensor | None:
    """A private copy of a tensor entry; of a DTensor, this rank's shard (what its digest
    covers, and what forensics can compare without collectives)."""
    if not isinstance(value, torch.Tensor):
        return None
    with _own_work():
        return local_shard(value.detach()).clone()


def _probing_backward(
    probe: _Probe, model: torch.nn.Module
) -> contextlib.AbstractContextManager[None]:
    """While open, each ``backward()`` adds its loss before and every gradient after it."""
    parameters = list(named_parameters(model))

    def gradients() -> None:
        for name, param in parameters:
            probe.add(f"grad:{name}", param.grad)
        probe.flush(probe.backwards)
        probe.backwards += 1

    return observed_backward(lambda loss: probe.add("loss", loss), gradients)
