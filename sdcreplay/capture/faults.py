"""Fault specs and the injector: how sdcreplay proves it finds what it claims.

A spec such as ``kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,
step=1,index=5,bit=22,device=cpu:1`` corrupts the output of matching operator
calls (or, for ``memflip``, a parameter's memory before a step) on the device
label it names. Matching is by call site (step, phase, module, operator, and
position among the matching calls), so a call re-run alone by bisect or
minimize is the same call and the fault fires there too, as a real defect
fires on the same kernel with the same inputs. Grammar: docs/fault-injection.md.
"""

from __future__ import annotations

import difflib
import math
import os
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import FaultSpecError
from ..kinds import PhaseName
from ..storage.tensorio import local_shard, raw_bits
from .operators import CallSite

FaultKind = Literal["bitflip", "pairflip", "swap", "bias", "nan", "memflip", "mask", "burst"]
KINDS: tuple[str, ...] = get_args(FaultKind)
PHASES: tuple[str, ...] = get_args(PhaseName)
ENV_VAR = "SDCREPLAY_INJECT"
_MANTISSA_TOP = {torch.float64: 51, torch.float32: 22, torch.float16: 9, torch.bfloat16: 6}


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    op: str | None = None
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
        elif self.kind != "memflip" and self.op is None:
            problem = f"{self.kind} needs op= (e.g. aten.mm or aten.mm.default)"
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
        if self.kind == "memflip":
            return False
        if op != self.op and op.rsplit(".", 1)[0] != self.op:
            return False
        if self.module is not None and not _under(module, self.module):
            return False
        return self.phase is None or phase == self.phase


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".") or prefix == ""


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


@dataclass
class Injection:
    """One fault that fired: where, and what it changed."""

    spec: str
    step: int
    phase: str
    module: str
    op: str
    op_index: int
    elements: list[int]
    bit: int | None
    mask: str | None = None  # the XOR mask in hex, for mask, burst and memflip with mask=

    def to_json(self) -> dict:
        return dict(self.__dict__)


def distributed_rank() -> int | None:
    """This process's rank in an initialized torch.distributed job, or None."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


@dataclass
class Injector:
    """Corrupts matching operator outputs on one device label (an OperatorMode observer)."""

    specs: list[FaultSpec]
    device_label: str
    salt: int = 0
    fired: list[Injection] = field(default_factory=list)
    rank: int | None = field(default_factory=distributed_rank)

    def __post_init__(self) -> None:
        self.specs = [spec for spec in self.specs if spec.applies_to(self.device_label, self.rank)]
        self._draws = [
            random.Random(f"{spec.seed}:{self.salt}:{position}")
            for position, spec in enumerate(self.specs)
        ]
        self._seen: Counter[tuple[int, int]] = Counter()
        self._memory_flipped: set[int] = set()
        self._calls: Counter[tuple[int, str, str, str]] = (
            Counter()
        )  # (step, op, module, phase) seen

    def unmatched(self) -> list[dict]:
        """Operator specs that selected no call of the steps run, each with the closest calls
        that ran."""
        return [
            {"spec": str(spec), "closest": closest_calls(spec, self._calls)}
            for position, spec in enumerate(self.specs)
            if spec.kind != "memflip" and not any(key[0] == position for key in self._seen)
        ]

    @property
    def has_operator_faults(self) -> bool:
        return any(spec.kind != "memflip" for spec in self.specs)

    def on_call(self, site: CallSite, func, args, kwargs, out):
        call = (site.step, *site.key)  # named first: mypy misreads a starred subscript on 3.10
        self._calls[call] += 1
        for position, spec in enumerate(self.specs):
            if not self._selects(spec, site):
                continue
            ordinal = self._seen[(position, site.step)]
            self._seen[(position, site.step)] += 1
            self._maybe_fire(position, spec, site, ordinal, out)
        return out

    def on_isolated_call(self, site: CallSite, prior: Counter, out) -> None:
        """Fire as in the full step, for a call re-run alone.

        ``prior`` counts the calls of the step before this one by
        ``(op, module, phase)``, which gives each spec its ``nth`` position.
        """
        for position, spec in enumerate(self.specs):
            if self._selects(spec, site):
                ordinal = sum(n for key, n in prior.items() if spec.matches_key(*key))
                self._maybe_fire(position, spec, site, ordinal, out)

    def _selects(self, spec: FaultSpec, site: CallSite) -> bool:
        return (spec.step is None or spec.step == site.step) and spec.matches_key(*site.key)

    def _maybe_fire(
        self, position: int, spec: FaultSpec, site: CallSite, ordinal: int, out
    ) -> None:
        if spec.nth is not None and ordinal != spec.nth:
            return
        if spec.p < 1.0 and self._draws[position].random() >= spec.p:
            return
        target = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(target, torch.Tensor) or target.numel() == 0:
            return
        changed = corrupt(spec, target)
        if changed is None:
            return
        elements, bit = changed
        self.fired.append(
            Injection(
                str(spec),
                site.step,
                site.phase,
                site.module,
                site.op,
                site.index,
                elements,
                bit,
                spec.mask_text,
            )
        )

    def before_step(self, step: int, model: torch.nn.Module) -> None:
        """Flip the memory of parameters/buffers that ``memflip`` names for this step (once)."""
        if step in self._memory_flipped:
            return
        self._memory_flipped.add(step)
        tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        for spec in self.specs:
            if spec.kind != "memflip" or spec.step != step:
                continue
            if spec.param not in tensors:
                raise FaultSpecError(
                    f"memflip names {spec.param!r}, which the model does not have",
                    "Use a name from model.named_parameters() or named_buffers(), "
                    "e.g. layers.0.attn.wq.weight.",
                )
            changed = corrupt(spec, tensors[spec.param].data)
            if changed is None:
                raise FaultSpecError(
                    f"memflip index {spec.index} is outside {spec.param} "
                    f"({tensors[spec.param].numel()} elements)"
                )
            elements, bit = changed
            self.fired.append(
                Injection(
                    str(spec),
                    step,
                    "state",
                    spec.param,
                    "memory",
                    -1,
                    elements,
                    bit,
                    spec.mask_text,
                )
            )


def closest_calls(
    spec: FaultSpec, calls: Iterable[tuple[int, str, str, str]], shown: int = 3
) -> list[str]:
    """The call sites (``op under module (phase), step N``) most like what ``spec`` asks for."""

    def likeness(call: tuple[int, str, str, str]) -> float:
        step, op, module, phase = call
        same_op = op == spec.op or op.rsplit(".", 1)[0] == spec.op
        near = difflib.SequenceMatcher(None, module, spec.module or module).ratio()
        return 4 * same_op + 2 * near + (spec.phase in (None, phase)) + (spec.step in (None, step))

    ranked = sorted(set(calls), key=lambda call: (-likeness(call), call))
    return [
        f"{op} under {module} ({phase}), step {step}" for step, op, module, phase in ranked[:shown]
    ]


def default_bit(dtype: torch.dtype) -> int:
    """The top mantissa bit of a float (a visible, finite change), bit 0 otherwise."""
    return _MANTISSA_TOP.get(dtype, 0)


def flip_bits(tensor: torch.Tensor, elements: list[int], bit: int) -> None:
    """XOR one bit of the storage word of each element (logical flat indices), in place."""
    width = 8 * tensor.element_size()
    if bit >= width:
        raise FaultSpecError(f"bit {bit} does not exist in a {width}-bit {tensor.dtype} element")
    if tensor.dtype == torch.bool and bit != 0:
        raise FaultSpecError("a bool element has only bit 0")
    xor_words(tensor, elements, 1 << bit)


def xor_words(tensor: torch.Tensor, elements: list[int], mask: int) -> None:
    """XOR ``mask`` into the storage word of each element (logical flat indices), in place."""
    width = 1 if tensor.dtype == torch.bool else 8 * tensor.element_size()
    if mask >> width:
        raise FaultSpecError(
            f"mask {mask:#x} is wider than the {width}-bit word of a {tensor.dtype} element",
            f"Use a mask of at most {width} bits (at most {(1 << width) - 1:#x}) for this "
            "output, or put the fault on an operator with a wider dtype.",
        )
    words = raw_bits(tensor)
    word_width = 8 * tensor.element_size()
    signed = mask - (1 << word_width) if mask >= 1 << (word_width - 1) else mask
    for element in elements:
        position = _unravel(element, tensor.shape)
        words[position] = words[position] ^ signed


def burst_elements(index: int, count: int, shape: torch.Size) -> list[int]:
    """``index`` and its ``count - 1`` right neighbours along the last dimension, clipped at the
    end of the row: the elements one row of a tile puts out together."""
    row = shape[-1] if len(shape) else 1
    row_end = (index // row + 1) * row
    return list(range(index, min(index + count, row_end)))


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    position = []
    for size in reversed(shape):
        position.append(flat % size)
        flat //= size
    return tuple(reversed(position))


def bits_only_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh tensor over the same memory (same offset, shape and strides), outside autograd.

    Writing through it changes the values and nothing else: the version
    counter of ``tensor`` (shared with every view of it, and checked by
    autograd for the tensors it saved) does not move, as a hardware defect
    would not move it. A fault on a view therefore corrupts the memory the
    view aliases, and a replay never dies of "modified by an inplace operation".
    """
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
    return alias


@torch.no_grad()
def corrupt(spec: FaultSpec, tensor: torch.Tensor) -> tuple[list[int], int | None] | None:
    """Apply one fault to the memory of ``tensor``; the flat elements touched and the bit.

    The bits change, the metadata does not (see ``bits_only_alias``). Returns
    None (nothing fired) when the elements lie outside the tensor: a defect
    tied to an output position cannot fire where the output is smaller. A
    DTensor's elements are those of this rank's shard (a tensor-parallel
    operator's output, as a dispatch mode sees it, has no memory of its own).
    """
    tensor = local_shard(tensor)
    numel = tensor.numel()
    tensor = bits_only_alias(tensor)
    first, second = spec.index, spec.index + spec.count
    needed = {"pairflip": second, "swap": second, "bias": spec.index + spec.count - 1}.get(
        spec.kind, first
    )
    if needed >= numel:
        return None
    elements = burst_elements(first, spec.count, tensor.shape) if spec.kind == "burst" else [first]
    if spec.mask is not None:  # mask, and burst or memflip given mask=
        xor_words(tensor, elements, spec.mask)
        return elements, None
    bit = spec.bit if spec.bit is not None else default_bit(tensor.dtype)
    if spec.kind in ("bitflip", "memflip", "burst"):
        flip_bits(tensor, elements, bit)
        return elements, bit
    if spec.kind == "pairflip":
        flip_bits(tensor, [first, second], bit)
        return [first, second], bit
    if spec.kind == "swap":
        a, b = _unravel(first, tensor.shape), _unravel(second, tensor.shape)
        held = tensor[a].clone()
        tensor[a] = tensor[b]
        tensor[b] = held
        return [first, second], None
    if not tensor.is_floating_point():
        raise FaultSpecError(
            f"{spec.kind} needs a floating-point output; {spec.op} gave {tensor.dtype}"
        )
    if spec.kind == "nan":
        tensor[_unravel(first, tensor.shape)] = math.nan
        return [first], None
    block = list(range(spec.index, spec.index + spec.count))
    for element in block:
        position = _unravel(element, tensor.shape)
        tensor[position] = tensor[position] * (1.0 + spec.scale)
    return block, None


OTHER_MACHINE_VAR = "SDCREPLAY_OTHER_MACHINE"


class _OtherMachineKernels(TorchDispatchMode):
    """``ops`` computed as another kind of machine would: the lowest bit of each output's
    first element differs, on every call, in the probe and the step alike."""

    def __init__(self, ops: set[str]):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in self.ops or str(func.overloadpacket) in self.ops:
            target = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(target, torch.Tensor) and target.numel():
                xor_words(target, [0], 1)
        return out


@contextmanager
def other_machine_kernels(label: str | None = None) -> Iterator[None]:
    """Under ``SDCREPLAY_OTHER_MACHINE=OP[@LABEL][,...]``, the device ``label`` (default: this
    device process's ``SDCREPLAY_DEVICE``; an entry without LABEL: every one) computes those
    operators as another machine would: how the tests show what a replica on another CPU or
    GPU model does to a verdict (docs/fault-injection.md)."""
    here = label or os.environ.get("SDCREPLAY_DEVICE")
    ops = set()
    for entry in os.environ.get(OTHER_MACHINE_VAR, "").split(","):
        op, _, label = entry.partition("@")
        if op and label in ("", here):
            ops.add(op)
    if not ops:
        yield
        return
    with _OtherMachineKernels(ops):
        yield
