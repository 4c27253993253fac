"""Operator-level capture (bisect): every aten call of a step, named by where and when it ran.

A layer's digest says which module went wrong; to find the first corrupted
operator inside it, ``OperatorMode`` gives each call a site that is the same on
every device, and ``OperatorLog`` digests each call's outputs to compare them with
a reference's and keep the first divergent call's inputs. The capture's own
tensor work (digests, copies) is marked, so the mode does not count it as the step's.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from ..kinds import PhaseName
from ..storage.tensorio import map_tensors
from . import determinism
from .aten_mode import AtenMode
from .digest import tensor_digest
from .memory import data_address, storage_address
from .module_names import ROOT as ROOT
from .module_names import named_buffers, named_modules, named_parameters, plain_paths

OUTSIDE = "<outside>"
"""Module path of operators that ran outside every module (e.g. the loss)."""

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
"""Operator namespaces of collectives (and ``wait_tensor``): the message log's, not operators."""

_capture_work = threading.local()


@contextlib.contextmanager
def _own_work() -> Iterator[None]:
    """Mark the capture's own tensor work on this thread, which an OperatorMode never counts as
    the step's: whichever thread runs it (a collective's digest runs on gloo's thread, or inline
    on the step's when the call had completed) and however deeply nested (the mark holds until
    the outermost one ends)."""
    depth = getattr(_capture_work, "depth", 0)
    _capture_work.depth = depth + 1
    try:
        yield
    finally:
        _capture_work.depth = depth


def _compiled_paths(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``compiled_modules`` by the paths of ``named_modules()`` (``""`` for the root)."""
    from torch._dynamo.eval_frame import OptimizedModule

    found: dict[str, torch.nn.Module] = {}
    for path, module in model.named_modules():
        inside = any(path.startswith(f"{outer}.") or not outer for outer in found)
        if inside:
            continue
        if isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None):
            found[path] = module
    return found


def compiled_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules of ``model`` that run compiled (``torch.compile(m)`` or ``m.compile()``),
    by plain path (`module_names`), outermost only (what they contain runs inside their
    compiled code)."""
    plain = plain_paths(model)
    return {plain[path] or ROOT: module for path, module in _compiled_paths(model).items()}


def eager_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose hooks run outside compiled code, by plain path: every module not
    inside a compiled one, and an ``OptimizedModule`` itself (its hooks run before its
    compiled code). A kernel call is attributed to the innermost of them running (a compiled
    function to its caller)."""
    from torch._dynamo.eval_frame import OptimizedModule

    compiled = _compiled_paths(model)
    plain = plain_paths(model)
    return [
        (plain[path] or ROOT, module)
        for path, module in model.named_modules()
        if not any(not outer or path.startswith(f"{outer}.") or path == outer for outer in compiled)
        or path in compiled
        and isinstance(module, OptimizedModule)
    ]


def _capture_depth() -> int:
    return getattr(_capture_work, "depth", 0)


@dataclass(frozen=True)
class CallSite:
    """Which operator call this is; the same call on another device has the same site."""

    step: int
    phase: PhaseName
    module: str  # module path; in the optimizer, the parameter the call updates
    op: str  # aten overload, e.g. aten.mm.default
    index: int  # position among all operator calls of the step
    recompute: bool = False  # a forward call run again in backward (activation checkpointing)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.op, self.module, self.phase)


class OperatorObserver(Protocol):
    def on_call(self, site: CallSite, func, args, kwargs, out): ...


@functools.cache
def op_name(func) -> str:
    return (
        f"aten.{func._schema.name.split('::')[-1]}.{func._overloadname or 'default'}"
        if hasattr(func, "_schema")
        else str(func)
    )


class OperatorMode(AtenMode):
    """A dispatch mode that names every operator call and hands it to observers.

    The module a call ran under comes from forward pre/post hooks; in backward,
    from the forward module that created the autograd node now executing
    (matched by its sequence number); in the optimizer, from the parameter
    (or its gradient or optimizer state) the call reads. Observers run in
    order on the output: a fault injector first, then a logger that sees what
    the injector left.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        observers: Sequence[OperatorObserver],
        step: int,
    ):
        super().__init__()
        self.observers = observers
        self._before = [o for o in observers if hasattr(o, "before_call")]
        self.step = step
        self.index = 0
        self._stack: list[tuple[str, bool]] = []  # (module path, entered during backward)
        self._node_module: dict[int, str] = {}
        self._last_sequence_nr = torch._C._autograd._get_sequence_nr()
        self._in_optimizer = False
        self._tensor_owner: dict[int, str] = {}
        self._model, self._optimizer = model, optimizer
        self._param_names = {id(p): name for name, p in named_parameters(model)}
        self._module_of_param = {
            id(p): path for path, m in named_modules(model) for p in m.parameters(recurse=False)
        }
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code stays compiled under the mode (Dynamo would run it eager otherwise,
        which is other code with other bits): the mode is off while Dynamo compiles and sees
        the ATen calls the compiled code makes (its fused kernels are `compiled_kernels`')."""
        return True

    def __enter__(self):
        for name, module in eager_modules(self._model):  # never hooks compiled code
            self._handles.append(module.register_forward_pre_hook(partial(self._push, name)))
            self._handles.append(
                module.register_forward_hook(partial(self._pop, name), always_call=True)
            )
        if self._optimizer is not None:
            self._handles.append(self._optimizer.register_step_pre_hook(self._optimizer_begins))
            self._handles.append(self._optimizer.register_step_post_hook(self._optimizer_ends))
        return super().__enter__()

    def __exit__(self, *exc_info):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return super().__exit__(*exc_info)

    def _push(self, name, module, args) -> None:
        self._stack.append((name, torch._C._current_autograd_node() is not None))

    def _pop(self, name, module, args, output) -> None:
        if self._stack and self._stack[-1][0] == name:
            self._stack.pop()

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        self._in_optimizer = True
        owner = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self._param_names.get(id(param), "optimizer")
                tensors = [param, param.grad, *optimizer.state.get(param, {}).values()]
                addresses = (
                    data_address(t)
                    for t in tensors
                    if isinstance(t, torch.Tensor) and t.numel() > 1
                )
                owner.update({address: name for address in addresses if address is not None})
        self._tensor_owner = owner

    def _optimizer_ends(self, optimizer, args, kwargs) -> None:
        self._in_optimizer = False

    def _site(self, func, args) -> CallSite:
        node = torch._C._current_autograd_node()
        phase: PhaseName
        recompute = node is not None and bool(self._stack) and self._stack[-1][1]
        if recompute:
            # Activation checkpointing runs a module's forward again inside the backward node
            # that needs its saved tensors: named as the code reads, that module's forward.
            phase, module = "forward", self._stack[-1][0]
        elif node is not None:
            phase = "backward"
            variable = getattr(node, "variable", None)
            if variable is not None:
                module = self._module_of_param.get(id(variable), OUTSIDE)
            else:
                module = self._node_module.get(node._sequence_nr(), OUTSIDE)
        elif self._in_optimizer:
            phase = "optimizer"
            owners = (self._tensor_owner.get(data_address(t) or 0) for t in _tensors_in(args))
            module = next((owner for owner in owners if owner is not None), "optimizer")
        else:
            phase = "forward"
            module = self._stack[-1][0] if self._stack else OUTSIDE
            sequence_nr = torch._C._autograd._get_sequence_nr()
            if sequence_nr != self._last_sequence_nr:
                self._node_module[sequence_nr - 1] = module
                self._last_sequence_nr = sequence_nr
        site = CallSite(self.step, phase, module, op_name(func), self.index, recompute)
        self.index += 1
        return site

    def on_aten(self, func, types, args, kwargs):
        if _capture_depth() or func.namespace in COLLECTIVE_NAMESPACES:
            # collectives are messages (collectives.py), not operators to digest or corrupt: a
            # functional one's output is not even written until wait_tensor waits for it
            return func(*args, **kwargs)
        site = self._site(func, args)
        for observer in self._before:
            observer.before_call(site, func, args, kwargs)
        out = func(*args, **kwargs)
        for observer in self.observers:
            out = observer.on_call(site, func, args, kwargs, out)
        return out


def _tensors_in(args) -> list[torch.Tensor]:
    found = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found.extend(t for t in arg if isinstance(t, torch.Tensor))
    return found


@dataclass
class OperatorRecord:
    site: CallSite
    digests: list[str]  # one per output; empty for views (they compute nothing)


@functools.cache
def _written_positions(func) -> tuple[int, ...]:
    """Argument positions an in-place/out= operator writes to (from its schema, once per
    operator)."""
    return tuple(
        position
        for position, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def _mutated_inputs(func, args) -> dict[int, object]:
    """Positions and values (tensors or lists of them) an in-place/out= operator writes to."""
    return {
        position: args[position] for position in _written_positions(func) if position < len(args)
    }


@dataclass
class InputOrigin:
    """Where a tensor input of a call came from: the last call that wrote its memory, or state."""

    position: int  # argument position in the call
    element: int | None  # position in a list argument (aten.cat's tensors); None for a tensor
    name: str  # the argument's name in the operator's schema (self, mat2, other, ...)
    producer: OperatorRecord | None  # the step's last call that wrote this memory
    state: str | None  # else the state tensor (param:..., optimizer:...) whose memory it is


class OperatorLog:
    """An OperatorMode observer: a digest of every operator's outputs, in order.

    Given the log of a reference device (``expected``), it compares as the
    step runs and keeps the inputs and outputs of the first divergent call
    (inputs as they were *before* the call, even for in-place operators),
    and where each input came from (``origins``: the call that last wrote
    its memory, or the state tensor named in ``state_memory``, a storage
    address -> name map); given ``watch``, it keeps those of that call index.
    """

    def __init__(
        self,
        expected: list[OperatorRecord] | None = None,
        watch: int | None = None,
        state_memory: dict[int, str] | None = None,
    ):
        self.records: list[OperatorRecord] = []
        self.expected = expected
        self.watch = watch
        self.structure_error: str | None = None
        self.divergent: OperatorRecord | None = None
        self.kept: tuple | None = None  # (args, kwargs, outputs), on the CPU
        self.origins: list[InputOrigin] = []  # the divergent call's tensor inputs
        self.rng_before: dict | None = None  # the watched call's generator states
        self._written_before: dict[int, object] = {}
        self._state_memory = state_memory or {}
        self._writer: dict[int, OperatorRecord] = {}  # storage address -> last call that wrote it

    def before_call(self, site: CallSite, func, args, kwargs) -> None:
        self._written_before = {}
        if self.kept is not None or func.is_view:
            return
        if site.index == self.watch and torch.Tag.nondeterministic_seeded in func.tags:
            device = next((t.device for t in _tensors_in(args)), torch.device("cpu"))
            self.rng_before = determinism.capture_operator_rng(device)
        if self.expected is not None or site.index == self.watch:
            # Only what the call overwrites must be copied before it runs.
            self._written_before = {
                i: _cpu_copy(value) for i, value in _mutated_inputs(func, args).items()
            }

    def on_call(self, site: CallSite, func, args, kwargs, out):
        results = [] if func.is_view else operator_results(func, args, out)
        record = OperatorRecord(site, [tensor_digest(value) for value in results])
        self.records.append(record)
        if self.kept is None and self.structure_error is None:
            if self.expected is not None:
                self._compare(self.expected, record, func, args, kwargs, out)
                self._note_writes(record, results)
            elif site.index == self.watch:
                self._keep(func, args, kwargs, out)
        return out

    def _note_writes(self, record: OperatorRecord, results: list) -> None:
        """Which call last wrote each memory block, so a wrong input can name its producer.

        Views write nothing: a view's input is traced to the call that wrote
        the memory it aliases.
        """
        for value in results:
            memory = storage_address(value) if isinstance(value, torch.Tensor) else None
            if memory is not None and value.numel():
                self._writer[memory] = record

    def _trace_inputs(self, func, args) -> list[InputOrigin]:
        schema = getattr(func, "_schema", None)
        names = [argument.name for argument in schema.arguments] if schema is not None else []
        origins = []
        for position, value in enumerate(args):
            tensors = (
                [(None, value)]
                if isinstance(value, torch.Tensor)
                else (list(enumerate(value)) if isinstance(value, (list, tuple)) else [])
            )
            for element, tensor in tensors:
                if not isinstance(tensor, torch.Tensor) or not tensor.numel():
                    continue
                memory = storage_address(tensor)
                name = names[position] if position < len(names) else f"arg{position}"
                producer = None if memory is None else self._writer.get(memory)
                state = None if memory is None or producer else self._state_memory.get(memory)
                origins.append(InputOrigin(position, element, name, producer, state))
        return origins

    def _compare(
        self, expected: list[OperatorRecord], record: OperatorRecord, func, args, kwargs, out
    ) -> None:
        index = record.site.index
        if index >= len(expected) or expected[index].site.key != record.site.key:
            theirs = expected[index].site if index < len(expected) else None
            self.structure_error = (
                f"operator call {index}: {record.site.op} under {record.site.module} "
                f"({record.site.phase}) here, "
                + (
                    f"{theirs.op} under {theirs.module} ({theirs.phase}) on the reference"
                    if theirs
                    else "nothing on the reference"
                )
            )
            return
        if record.digests != expected[index].digests:
            self.divergent = record
            self.origins = self._trace_inputs(func, args)
            self._keep(func, args, kwargs, out)

    def _keep(self, func, args, kwargs, out) -> None:
        with _own_work():
            inputs = [
                self._written_before[i] if i in self._written_before else _cpu_copy(value)
                for i, value in enumerate(args)
            ]
            self.kept = (
                tuple(inputs),
                _cpu_copy(kwargs),
                _cpu_copy(operator_results(func, args, out)),
            )


def operator_results(func, args, out) -> list:
    """What an operator call produced: the tensors it wrote for in-place/out= calls, else its
    outputs."""
    written = _mutated_inputs(func, args)
    if written:
        return _tensors_in(list(written.values()))
    return _outputs(out)


def _outputs(out) -> list:
    """Outputs that can be digested (tensors, numbers, None), in order."""
    values = out if isinstance(out, (list, tuple)) else [out]
    return [
        value
        for value in values
        if value is None or isinstance(value, (torch.Tensor, int, float, bool))
    ]


def _cpu_copy(tree):
    with _own_work():
        return map_tensors(tree, _kept_copy)


def _kept_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy in the same layout: a broadcast (stride 0, ``aten.expand``) stays a
    broadcast of a copy of the words it reads, so the report counts a flipped storage word
    once, not once per view element (``.to(copy=True)`` would make it dense)."""
    tensor = tensor.detach()
    broadcast = [
        dim
        for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride()))
        if stride == 0 and size > 1
    ]
    if type(tensor) is not torch.Tensor or not broadcast:
        return tensor.to("cpu", copy=True)
    words = tensor
    for dim in broadcast:
        words = words.narrow(dim, 0, 1)
    return words.to("cpu", copy=True).expand(tensor.shape)


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, torch.Tensor]:
    """Everything a step starts from, by plain name: parameters, buffers, optimizer state."""
    tensors: dict[str, torch.Tensor] = {f"param:{name}": p for name, p in named_parameters(model)}
    tensors.update({f"buffer:{name}": b for name, b in named_buffers(model)})
    if optimizer is not None:
        names = {id(p): name for name, p in named_parameters(model)}
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    # ``optim:``, as the signature log names the same state (capture/layers.py)
                    tensors[f"optim:{names.get(id(param), '?')}.{key}"] = value
    return tensors
