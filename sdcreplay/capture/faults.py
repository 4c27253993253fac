"""Fault specs and the injector: how sdcreplay proves it finds what it claims.

A spec such as ``kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,
step=1,index=5,bit=22,device=cpu:1`` corrupts the output of matching operator
calls (or, for ``memflip``, a parameter's memory before a step) on the device
label it names. Matching is by call site (step, phase, module, operator, and
position among the matching calls), so a call re-run alone by bisect or
minimize is the same call and the fault fires there too, as a real defect
fires on the same kernel with the same inputs. The grammar is `fault_spec.py`, which
imports no torch (docs/fault-injection.md).
"""

from __future__ import annotations

import difflib
import math
import os
import random
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from ..errors import FaultSpecError
from ..storage.tensorio import raw_bits
from .aten_mode import AtenMode
from .compiled_kernels import KernelCall, KernelObserver, KernelSite, observing_kernels
from .fault_spec import ENV_VAR as ENV_VAR  # the grammar lives there, torch-free; the names
from .fault_spec import FaultSpec  # are kept here for everyone who imports them from faults
from .fault_spec import parse_specs as parse_specs
from .memory import local_shard, storage_layout
from .module_names import aliases, named_buffers, named_parameters
from .operators import CallSite

_MANTISSA_TOP = {torch.float64: 51, torch.float32: 22, torch.float16: 9, torch.bfloat16: 6}


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
        )  # (step, op, module, phase) seen; a kernel call's op is its kernel's name

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
        return any(spec.kind != "memflip" and spec.kernel is None for spec in self.specs)

    @property
    def has_kernel_faults(self) -> bool:
        return any(spec.kernel is not None for spec in self.specs)

    def kernel_faults(
        self, step: int, model: torch.nn.Module, observers: Sequence[KernelObserver] = ()
    ) -> AbstractContextManager[None]:
        """While open, this injector's ``kernel=`` faults fire in the compiled kernels of
        ``step`` (then ``observers`` see each call); a no-op without either."""
        chain = ([self] if self.has_kernel_faults else []) + list(observers)
        return observing_kernels(chain, step, model) if chain else nullcontext()

    def on_kernel(self, call: KernelCall) -> None:
        """A compiled kernel call (a `compiled_kernels` observer): corrupt what it wrote."""
        site = call.site
        self._calls[(site.step, site.kernel, site.module, site.phase)] += 1
        for position, spec in enumerate(self.specs):
            if self._selects_kernel(spec, site):
                ordinal = self._seen[(position, site.step)]
                self._seen[(position, site.step)] += 1
                self._fire_in_kernel(position, spec, site, ordinal, call.outputs)

    def on_isolated_kernel(self, site: KernelSite, prior: Counter, outputs: list) -> None:
        """Fire as in the full step, for a kernel call re-run alone; ``prior`` counts the
        step's kernel calls before it by ``(kernel, module, phase)``."""
        for position, spec in enumerate(self.specs):
            if self._selects_kernel(spec, site):
                ordinal = sum(n for key, n in prior.items() if spec.matches_kernel(*key))
                self._fire_in_kernel(position, spec, site, ordinal, outputs)

    def _selects_kernel(self, spec: FaultSpec, site: KernelSite) -> bool:
        return spec.step in (None, site.step) and spec.matches_kernel(
            site.kernel, site.module, site.phase
        )

    def _fire_in_kernel(
        self, position: int, spec: FaultSpec, site: KernelSite, ordinal: int, outputs: list
    ) -> None:
        if spec.output >= len(outputs):
            raise FaultSpecError(
                f"fault spec {str(spec)!r}: {site.kernel} writes {len(outputs)} tensor(s), "
                f"no output {spec.output}",
                "`sdcreplay ops BUNDLE --step N` (a job's rank: `ops JOB --rank R --step N`) lists "
                "each kernel's outputs; give output= one "
                "of their positions.",
            )
        call_site = CallSite(site.step, site.phase, site.module, site.kernel, site.index)  # type: ignore[arg-type]
        self._maybe_fire(position, spec, call_site, ordinal, outputs[spec.output])

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

    def _selects(self, spec: FaultSpec, site: CallSite) -> bool:  # an operator call
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
        tensors: dict[str, torch.Tensor] = dict(named_parameters(model))
        tensors.update(named_buffers(model))
        for spec in self.specs:
            if spec.kind != "memflip" or spec.step != step:
                continue
            param = next((name for name in aliases(spec.param or "") if name in tensors), None)
            if param is None:
                raise FaultSpecError(
                    f"memflip names {spec.param!r}, which the model does not have",
                    "Use a parameter's or buffer's name in the plain model (without DDP's "
                    "module., compile's _orig_mod.), e.g. layers.0.attn.wq.weight.",
                )
            changed = corrupt(spec, tensors[param].data)
            if changed is None:
                raise FaultSpecError(
                    f"memflip index {spec.index} is outside {param} "
                    f"({tensors[param].numel()} elements)"
                )
            elements, bit = changed
            self.fired.append(
                Injection(
                    str(spec),
                    step,
                    "state",
                    param,
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
        same_op: float = op == spec.op or op.rsplit(".", 1)[0] == spec.op
        if spec.kernel is not None:  # a kernel's name: how alike, as a typo is
            same_op = difflib.SequenceMatcher(None, op, spec.kernel).ratio()
        near = difflib.SequenceMatcher(None, module, spec.module or module).ratio()
        return 4 * same_op + 2 * near + (spec.phase in (None, phase)) + (spec.step in (None, step))

    ranked = sorted(set(calls), key=lambda call: (-likeness(call), call))
    return [
        f"{op} under {module} ({phase}), step {step}" for step, op, module, phase in ranked[:shown]
    ]


def check_operators(specs: Iterable[FaultSpec]) -> None:
    """Refuse a spec whose ``op`` names no ATen operator (a typo: it could never fire), with
    the closest names; ops of other namespaces (a workload's own) are left to the run."""
    known = {
        name.replace("::", ".") + ("" if "." in name else ".default")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
    }
    packets = {name.rsplit(".", 1)[0] for name in known}
    for spec in specs:
        if spec.op is None or not spec.op.startswith("aten.") or spec.op in known | packets:
            continue
        close = difflib.get_close_matches(spec.op, sorted(packets | known), n=4, cutoff=0.6)
        raise FaultSpecError(
            f"fault spec {str(spec)!r}: op={spec.op} is not an ATen operator",
            (f"Closest: {', '.join(close)}. " if close else "")
            + "`sdcreplay ops BUNDLE --step N` (a job's rank: `ops JOB --rank R --step N`) "
            "lists a step's calls as specs name them.",
        )


def default_bit(dtype: torch.dtype) -> int:
    """The top mantissa bit of a float (a visible, finite change), bit 0 otherwise."""
    return _MANTISSA_TOP.get(dtype, 0)


def _no_such_bit(bit: int, dtype: torch.dtype) -> FaultSpecError:
    width = 8 * dtype.itemsize
    return FaultSpecError(
        f"bit {bit} does not exist in a {width}-bit {dtype} element",
        f"A {dtype} element has bits 0 to {width - 1}: give a smaller bit=, or leave it out "
        "(the top mantissa bit of a float).",
    )


def check_bits_fit(specs: Iterable[FaultSpec], site: CallSite, outputs: Iterable) -> None:
    """Refuse, before anything runs, a ``bit=`` beyond the width of the output a spec would
    corrupt at ``site`` (its first tensor output, as the injector takes), where the outputs'
    dtypes are known (an operator case)."""
    first = next((value for value in outputs if isinstance(value, torch.Tensor)), None)
    for spec in specs:
        selects = spec.matches_key(*site.key) and spec.step in (None, site.step)
        if first is not None and selects and spec.bit is not None:
            if spec.bit >= 8 * first.element_size():
                raise _no_such_bit(spec.bit, first.dtype)


def flip_bits(tensor: torch.Tensor, elements: list[int], bit: int) -> None:
    """XOR one bit of the storage word of each element (logical flat indices), in place."""
    if bit >= 8 * tensor.element_size():
        raise _no_such_bit(bit, tensor.dtype)
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
    tensor = local_shard(tensor)
    offset, strides = storage_layout(tensor)
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(tensor.untyped_storage(), offset, tensor.size(), strides)
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


class _OtherMachineKernels(AtenMode):
    """``ops`` computed as another kind of machine would: the lowest bit of each output's
    first element differs, on every call, in the probe and the step alike."""

    def __init__(self, ops: set[str]):
        super().__init__()
        self.ops = ops

    def on_aten(self, func, types, args, kwargs):
        out = func(*args, **kwargs)
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
