"""The fault spec: its grammar, parsed and checked without torch.

``kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=5,bit=22,
device=cpu:1`` names a corruption and where it fires (docs/fault-injection.md); in a compiled
step ``kernel=cpp_fused_add_mul_3,output=1`` names an Inductor kernel's output instead. Parsing
imports nothing heavy, so every command checks its ``--inject`` specs (and
``SDCREPLAY_INJECT``) before it imports torch or starts a device process; `faults.py`
injects what they describe.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Literal, get_args

from ..errors import FaultSpecError
from ..kinds import PhaseName
from .module_names import aliases

FaultKind = Literal["bitflip", "pairflip", "swap", "bias", "nan", "memflip", "mask", "burst"]
KINDS: tuple[str, ...] = get_args(FaultKind)
PHASES: tuple[str, ...] = get_args(PhaseName)
ENV_VAR = "SDCREPLAY_INJECT"


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    op: str | None = None
    kernel: str | None = None  # an Inductor kernel's generated name (capture/compiled_kernels)
    output: int = 0  # which tensor the kernel writes (0-based, in its signature's order)
    param: str | None = None
    module: str | None = None
    phase: str | None = None
    step: int | None = None
    nth: int | None = None
    index: int = 0
    bit: int | None = None
    mask: int | None = None
    count: int = 1
    scale: float = 1e-3
    p: float = 1.0
    seed: int = 0
    device: str | None = None
    rank: int | None = None  # the torch.distributed rank it applies to (default: every process)

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        values: dict = {}
        # The annotations are strings (postponed evaluation), e.g. "int | None".
        types = {f.name: str(f.type) for f in fields(cls)}
        for part in filter(None, (piece.strip() for piece in text.split(","))):
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in types:
                raise FaultSpecError(
                    f"fault spec {text!r}: unknown or malformed part {part!r}",
                    f"Keys: {', '.join(types)}; "
                    "e.g. kind=bitflip,op=aten.mm,step=0,index=3,bit=22.",
                )
            try:
                values[key] = _convert(types[key], value)
            except ValueError:
                raise FaultSpecError(
                    f"fault spec {text!r}: {key}={value!r} is not a valid "
                    f"{types[key].split('|')[0].strip()}"
                ) from None
        if "kind" not in values:
            raise FaultSpecError(
                f"fault spec {text!r} has no kind", f"kind is one of {', '.join(KINDS)}."
            )
        spec = cls(**values)
        spec._validate(text)
        return spec

    def _validate(self, text: str) -> None:
        problem = None
        if self.kind not in KINDS:
            problem = f"kind {self.kind!r} is not one of {', '.join(KINDS)}"
        elif self.kind == "memflip" and (self.param is None or self.step is None):
            problem = "memflip needs param= (a parameter or buffer name) and step="
        elif self.kind != "memflip" and (self.op is None) == (self.kernel is None):
            problem = (
                f"{self.kind} needs op= (e.g. aten.mm or aten.mm.default) or kernel= (a compiled "
                "step's Inductor kernel, e.g. cpp_fused_add_mul_3)"
                if self.op is None
                else "give op= (an ATen operator) or kernel= (an Inductor kernel), not both"
            )
        elif self.kind == "memflip" and self.kernel is not None:
            problem = "memflip corrupts a parameter's memory (param=), not a kernel's output"
        elif self.output != 0 and self.kernel is None:
            problem = "output= picks one of the tensors a kernel= writes; an op= corrupts its first"
        elif self.output < 0:
            problem = f"output={self.output} is not a position (0, 1, ...)"
        elif self.phase is not None and self.phase not in PHASES:
            problem = f"phase {self.phase!r} is not one of {', '.join(PHASES)}"
        elif not 0.0 <= self.p <= 1.0:
            problem = f"p={self.p} is not a probability"
        elif self.count < 1 or self.index < 0 or (self.nth is not None and self.nth < 0):
            problem = "count must be at least 1, index and nth at least 0"
        elif self.rank is not None and self.rank < 0:
            problem = f"rank={self.rank} is not a rank (0, 1, ...)"
        elif self.bit is not None and not 0 <= self.bit < 64:
            problem = f"bit={self.bit} is outside 0..63"
        if problem:
            raise FaultSpecError(f"fault spec {text!r}: {problem}")
        self._validate_mask(text)

    def _validate_mask(self, text: str) -> None:
        """The XOR mask of ``mask``, ``burst`` and ``memflip``: there, non-zero, at most 64 bits."""
        example = "e.g. mask=0x00f00000 (four bits of a float32's mantissa)"
        if self.mask is None:
            if self.kind == "mask":
                raise FaultSpecError(
                    f"fault spec {text!r}: kind=mask needs mask= (the bits to XOR)",
                    f"Give the mask in hex or decimal, {example}.",
                )
            return
        if self.kind not in ("mask", "burst", "memflip"):
            raise FaultSpecError(
                f"fault spec {text!r}: mask= applies to kind=mask, burst and memflip only",
                f"Use kind=mask for a multi-bit error on one element, or bit= with {self.kind}.",
            )
        if self.bit is not None:
            raise FaultSpecError(
                f"fault spec {text!r}: give mask= or bit=, not both",
                f"bit={self.bit} is mask={1 << self.bit:#x}.",
            )
        if self.mask == 0:
            raise FaultSpecError(
                f"fault spec {text!r}: mask=0 changes no bit", f"Name the bits to flip, {example}."
            )
        if not 0 < self.mask < 1 << 64:
            problem = "is negative" if self.mask < 0 else "does not fit a 64-bit word"
            raise FaultSpecError(
                f"fault spec {text!r}: mask={self.mask:#x} {problem}",
                f"A mask is a positive number of at most 64 bits, {example}.",
            )

    @property
    def mask_text(self) -> str | None:
        return None if self.mask is None else f"{self.mask:#x}"

    def __str__(self) -> str:
        defaults = FaultSpec(kind=self.kind)
        parts = [f"kind={self.kind}"] + [
            f"mask={self.mask_text}" if f.name == "mask" else f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name != "kind" and getattr(self, f.name) != getattr(defaults, f.name)
        ]
        return ",".join(parts)

    def applies_to(self, device_label: str, rank: int | None = None) -> bool:
        """``rank``: the process's rank in its torch.distributed job (None: not in one)."""
        return (self.device is None or self.device == device_label) and (
            self.rank is None or self.rank == rank
        )

    def matches_key(self, op: str, module: str, phase: str) -> bool:
        """Does a call of ``op`` under ``module`` in ``phase`` match (step and nth aside)?"""
        if self.kind == "memflip" or self.kernel is not None:
            return False
        if op != self.op and op.rsplit(".", 1)[0] != self.op:
            return False
        if self.module is not None and not _under(module, self.module):
            return False
        return self.phase is None or phase == self.phase

    def matches_kernel(self, kernel: str, module: str, phase: str) -> bool:
        """Does a call of the Inductor kernel ``kernel`` (its generated name) under the compiled
        module ``module`` in ``phase`` match (step and nth aside)?"""
        if self.kernel is None or kernel != self.kernel:
            return False
        if self.module is not None and not _under(module, self.module):
            return False
        return self.phase is None or phase == self.phase


def _under(module: str, prefix: str) -> bool:
    """Is ``module`` (a plain path) ``prefix`` or inside it; ``prefix`` as typed, or as its
    wrapped name (``module.layers.0`` under DDP) says it (`module_names.aliases`)."""
    return any(
        module == name or module.startswith(name + ".") or name == "" for name in aliases(prefix)
    )


def _convert(annotation: str, value: str):
    if "int" in annotation:  # decimal, or hex with 0x (masks read best in hex)
        return int(value, 16) if value.lower().lstrip("+-").startswith("0x") else int(value)
    if "float" in annotation:
        return float(value)
    return value


def parse_specs(specs: Iterable[str] = (), include_env: bool = True) -> list[FaultSpec]:
    """Specs from the command line, then from ``SDCREPLAY_INJECT`` (``;``-separated)."""
    texts = list(specs)
    if include_env:
        texts += [s for s in os.environ.get(ENV_VAR, "").split(";") if s.strip()]
    return [FaultSpec.parse(text) for text in texts]
