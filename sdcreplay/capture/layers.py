"""Layer-level capture of the signature log, and operator-level capture.

Layer level: forward hooks digest every module's output. For the backward,
the autograd nodes a module created are known by their sequence numbers
(taken in the forward pre-hook and hook); a hook on each node where the
module's graph hands a gradient to its inputs digests what the module's own
backward produced, before it is summed with other consumers' gradients (so a
corrupted backward is named by its module, at a fraction of the cost of
``register_full_backward_hook``). Gradients, the loss, the parameters after
the optimizer step and the RNG states complete a step.

Operator level (bisect): ``OperatorMode`` names every aten call of a step.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import SdcReplayError
from ..kinds import PhaseName
from ..storage.tensorio import map_tensors
from . import determinism
from .determinism import RngState
from .digest import Digester, SignatureValue, tensor_digest

ROOT = "<root>"

_capture_work = threading.local()


@contextlib.contextmanager
def _own_work() -> Iterator[None]:
    """Mark the capture's own tensor work, which an OperatorMode must not count as the step's."""
    _capture_work.active = True
    try:
        yield
    finally:
        _capture_work.active = False


def flatten_tensors(value) -> list[torch.Tensor]:
    """Tensors of a module output (tensor, tuple/list, dict), in a stable order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in flatten_tensors(item)]
    if isinstance(value, dict):
        return [t for key in value for t in flatten_tensors(value[key])]
    return []


def within_depth(path: str, max_depth: int | None) -> bool:
    """Is a module captured at this signature depth? The root is depth 0, ``layers.1`` depth 2.

    Fewer modules mean fewer activation digests (the recorder's main cost);
    gradients and parameters are always captured, and bisect localizes to the
    operator either way.
    """
    return max_depth is None or (path.count(".") + 1 if path else 0) <= max_depth


def _next_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will get."""
    return torch._C._autograd._get_sequence_nr()


def _input_edges(roots: list, first: int, end: int) -> list[tuple[torch.autograd.graph.Node, int]]:
    """(node, input slot) pairs where a module's graph passes a gradient to its inputs.

    The module's nodes are those created during its forward (sequence numbers
    in ``[first, end)``); an edge from one of them to a node created before is
    where the module's backward hands a gradient back to whoever fed it.
    Parameter leaves are not inputs (their gradients are ``grad:`` entries).
    Breadth-first from the roots, each node queued once (the order names the edges).
    """
    edges: list[tuple[torch.autograd.graph.Node, int]] = []
    seen: set[int] = set()
    queue: deque[torch.autograd.graph.Node] = deque()
    for node in roots:
        if first <= node._sequence_nr() < end and id(node) not in seen:
            seen.add(id(node))
            queue.append(node)
    while queue:
        node = queue.popleft()
        for slot, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            if first <= child._sequence_nr() < end:
                if id(child) not in seen:
                    seen.add(id(child))
                    queue.append(child)
            elif not hasattr(child, "variable"):
                edges.append((node, slot))
    return edges


GRADS_ENTERING = ("none", "zero", "kept")
"""What the gradients hold when a step begins: all ``None``, all zero, or kept from before."""


def grads_entering(model: torch.nn.Module) -> str:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return "none"
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    with _own_work():  # one sync per device, not one per gradient
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad.any())
        nonzero = any(bool(torch.stack(flags).any()) for flags in by_device.values())
    return "kept" if nonzero else "zero"


def state_leaves(prefix: str, value) -> Iterator[tuple[str, SignatureValue, bool]]:
    """``(name, value, is_tensor)`` for every leaf of a state dict, in order.

    Dict keys join with ``.``, list items are ``[i]``; a string becomes its
    UTF-8 bytes (so it is compared too); other objects are left out.
    """
    if isinstance(value, torch.Tensor):
        yield prefix, value, True
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from state_leaves(f"{prefix}.{key}", item)
    elif isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            yield from state_leaves(f"{prefix}[{position}]", item)
    elif isinstance(value, str):
        data = bytearray(value.encode()) or bytearray(1)
        yield prefix, torch.frombuffer(data, dtype=torch.uint8), False
    elif value is None or isinstance(value, (bool, int, float)):
        yield prefix, value, False


def state_object_items(objects: dict) -> Iterator[tuple[str, SignatureValue]]:
    """Signature items of state objects: ``state:`` for numbers, ``state_tensor:`` for tensors."""
    for name, obj in objects.items():
        for path, value, is_tensor in state_leaves(name, obj.state_dict()):
            yield ("state_tensor:" if is_tensor else "state:") + path, value


def hyper_items(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, SignatureValue]]:
    """``hyper:GROUP.KEY`` for every hyper-parameter of every param group (lr, betas[0], ...)."""
    for index, group in enumerate(optimizer.param_groups):
        settings = {key: value for key, value in group.items() if key != "params"}
        for name, value, _ in state_leaves(str(index), settings):
            yield f"hyper:{name}", value


@contextlib.contextmanager
def observed_backward(
    before: Callable[[torch.Tensor], None], after: Callable[[], None]
) -> Iterator[None]:
    """While open, each ``backward()`` of one number calls ``before(loss)`` and then, once the
    gradients are in, ``after()``.

    It wraps ``torch.autograd.backward`` (which ``Tensor.backward`` calls), so
    the user's code is not touched.
    """
    original = torch.autograd.backward

    def backward(tensors, *args, **kwargs):
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            before(tensors)
        result = original(tensors, *args, **kwargs)
        after()
        return result

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


class SignatureCapture:
    """Hooks a model and optimizer once; they record only inside an open step.

    A step goes ``begin_step`` -> forward/backward inside ``backward_capture``
    (hooks; each ``backward()`` adds its loss and the gradients after it) ->
    optimizer step (pre-hook: hyper-parameters and the gradients it is given;
    post-hook: optimizer state, parameters, buffers) -> ``end_step``. The
    order of entries is the execution order, so two runs of the same program
    produce the same names in the same order. ``program`` adds the entries
    that make the program visible (``hyper:``, ``step_grad:``, ``optim:``,
    ``state:``, ``state_tensor:``); bundles recorded before they existed
    replay without them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        max_depth: int | None = None,
        *,
        state: dict | None = None,
        program: bool = False,
    ):
        self.model = model
        self.state_objects = dict(state or {})
        self.program = program
        self._digester: Digester | None = None
        self._in_forward_window = False
        self._calls: Counter[str] = Counter()
        self._starts: dict[str, list[int]] = {}
        self.optimizer_stepped = False
        self.updated_state: dict[str, str] = {}
        self._updated_state_positions: dict[str, int] = {}
        self._param_names: dict[int, str] | None = None
        self._handles = []
        for path, module in model.named_modules():
            if not within_depth(path, max_depth):
                continue
            self._handles.append(
                module.register_forward_pre_hook(partial(self._on_forward_begin, path or ROOT))
            )
            self._handles.append(
                module.register_forward_hook(partial(self._on_forward, path or ROOT))
            )
        if optimizer is not None:
            if program:
                self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_begin))
            self._handles.append(optimizer.register_step_post_hook(self._on_optimizer_step))

    @property
    def step_open(self) -> bool:
        return self._digester is not None

    def begin_step(self, rng: RngState) -> None:
        """Open a step: the RNG states, then (program entries) the state objects entering it."""
        digester = self._digester = Digester()
        self._calls.clear()
        self.optimizer_stepped = False
        self._updated_state_positions = {}
        self._param_names = None
        self._in_forward_window = True
        with _own_work():
            for name, value in rng.signature_items():
                digester.add(name, value)
            if self.program:
                for name, leaf in state_object_items(self.state_objects):
                    digester.add(name, leaf)

    def _numbered(self, name: str) -> str:
        count = self._calls[name]
        self._calls[name] += 1
        return name if count == 0 else f"{name}#{count}"

    def _step_digester(self) -> Digester:
        """The open step's digester: the hooks record only between begin_step and end_step."""
        if self._digester is None:
            raise SdcReplayError(
                "the signature capture has no open step",
                "Call begin_step before the step's work and end_step after it.",
            )
        return self._digester

    def _add(self, name: str, value: SignatureValue) -> None:
        self._step_digester().add(self._numbered(name), value)

    def _on_forward_begin(self, path: str, module, inputs) -> None:
        if self._in_forward_window:
            self._starts.setdefault(path, []).append(_next_sequence_nr())

    def _on_forward(self, path: str, module, inputs, output) -> None:
        if not self._in_forward_window:
            return
        first_node = self._starts[path].pop()
        base = self._numbered(path)
        tensors = flatten_tensors(output)
        with _own_work():
            for position, tensor in enumerate(tensors):
                suffix = f"[{position}]" if len(tensors) > 1 else ""
                self._step_digester().add(f"forward:{base}{suffix}", tensor)
            roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
            edges = _input_edges(roots, first_node, _next_sequence_nr())
            for position, (node, slot) in enumerate(edges):
                suffix = f"[{position}]" if len(edges) > 1 else ""
                node.register_hook(partial(self._on_input_grad, f"backward:{base}{suffix}", slot))

    def _on_input_grad(self, name: str, slot: int, grad_inputs, grad_outputs) -> None:
        if self._digester is not None:
            with _own_work():
                self._digester.add(name, grad_inputs[slot])

    def record_loss(self, loss: torch.Tensor) -> None:
        if self._digester is not None:
            with _own_work():
                self._add("loss", loss)

    def record_gradients(self) -> None:
        """Every parameter's gradient (``grad:NAME``; ``grad:NAME#1`` after a second backward)."""
        if self._digester is None:
            return
        with _own_work():
            for name, param in self.model.named_parameters():
                self._add(f"grad:{name}", param.grad)

    def backward_capture(self) -> contextlib.AbstractContextManager[None]:
        """While open, each ``backward()`` records its loss before and the gradients after it
        (the loss is the scalar handed to backward: a GradScaler's scaled loss under AMP)."""
        return observed_backward(self.record_loss, self.record_gradients)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing meanwhile, an open step included: another model's step runs in this
        process (a ring Recorder's verification from inside the loop's step)."""
        digester, window = self._digester, self._in_forward_window
        self._digester, self._in_forward_window = None, False
        try:
            yield
        finally:
            self._digester, self._in_forward_window = digester, window

    def close_window(self) -> None:
        """The step's own code is over (the block exited): later forwards are not the step's."""
        self._in_forward_window = False

    def _named_group_params(self, optimizer) -> Iterator[tuple[str, torch.nn.Parameter]]:
        if self._param_names is None:  # once per step: both optimizer hooks walk the groups
            self._param_names = {id(p): name for name, p in self.model.named_parameters()}
        names = self._param_names
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in names:
                    yield names[id(param)], param

    def _on_optimizer_begin(self, optimizer, args, kwargs) -> None:
        """What the optimizer is about to use: each group's hyper-parameters and the gradients."""
        if self._digester is None:
            return
        with _own_work():
            for name, value in hyper_items(optimizer):
                self._add(name, value)
            for name, param in self._named_group_params(optimizer):
                # A view: hashed afresh, not matched to the digest after backward by the version
                # counter, which foreach in-place ops (clipping) do not bump under a dispatch mode.
                grad = param.grad
                self._add(f"step_grad:{name}", None if grad is None else grad.view_as(grad))

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._digester is None:
            return
        with _own_work():
            if self.program:  # the state the update was computed from comes first
                for name, param in self._named_group_params(optimizer):
                    for key, value in optimizer.state.get(param, {}).items():
                        if isinstance(value, torch.Tensor):
                            self._add(f"optim:{name}.{key}", value)
            positions = self._updated_state_positions
            for name, param in self.model.named_parameters():
                positions[f"param:{name}"] = len(self._step_digester())
                self._add(f"param:{name}", param)
            for name, buffer in self.model.named_buffers():
                positions[f"buffer:{name}"] = len(self._step_digester())
                self._add(f"buffer:{name}", buffer)
        self.optimizer_stepped = True

    def end_step(self) -> list[tuple[str, str]]:
        """Fetch the step's digests (one device sync) and close the step.

        ``updated_state`` then holds the digests of the parameters and buffers
        as the step's last optimizer step left them, named as ``state_digests``
        names them (empty without an optimizer step).
        """
        with _own_work():
            entries = self._step_digester().entries()
        self.updated_state = {
            name: entries[position][1] for name, position in self._updated_state_positions.items()
        }
        self._digester = None
        self._in_forward_window = False
        return entries

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def state_digests(
    model: torch.nn.Module,
    objects: dict | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, str]:
    """Digests of the parameters, buffers, state objects and hyper-parameters, by signature name."""
    digester = Digester()
    with _own_work():
        for name, param in model.named_parameters():
            digester.add(f"param:{name}", param)
        for name, buffer in model.named_buffers():
            digester.add(f"buffer:{name}", buffer)
        for name, value in state_object_items(objects or {}):
            digester.add(name, value)
        for name, value in hyper_items(optimizer) if optimizer is not None else ():
            digester.add(name, value)
        return dict(digester.entries())


# ---------------------------------------------------------------------------
# Operator level: every aten call of a step, with where and when it ran.

OUTSIDE = "<outside>"
"""Module path of operators that ran outside every module (e.g. the loss)."""


@dataclass(frozen=True)
class CallSite:
    """Which operator call this is; the same call on another device has the same site."""

    step: int
    phase: PhaseName
    module: str  # module path; in the optimizer, the parameter the call updates
    op: str  # aten overload, e.g. aten.mm.default
    index: int  # position among all operator calls of the step

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


class OperatorMode(TorchDispatchMode):
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
        self._stack: list[str] = []
        self._node_module: dict[int, str] = {}
        self._last_sequence_nr = torch._C._autograd._get_sequence_nr()
        self._in_optimizer = False
        self._tensor_owner: dict[int, str] = {}
        self._model, self._optimizer = model, optimizer
        self._param_names = {id(p): name for name, p in model.named_parameters()}
        self._module_of_param = {
            id(p): path or ROOT
            for path, m in model.named_modules()
            for p in m.parameters(recurse=False)
        }
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self):
        for path, module in self._model.named_modules():
            name = path or ROOT
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
        self._stack.append(name)

    def _pop(self, name, module, args, output) -> None:
        if self._stack and self._stack[-1] == name:
            self._stack.pop()

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        self._in_optimizer = True
        owner = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self._param_names.get(id(param), "optimizer")
                tensors = [param, param.grad, *optimizer.state.get(param, {}).values()]
                owner.update(
                    {
                        t.data_ptr(): name
                        for t in tensors
                        if isinstance(t, torch.Tensor) and t.numel() > 1
                    }
                )
        self._tensor_owner = owner

    def _optimizer_ends(self, optimizer, args, kwargs) -> None:
        self._in_optimizer = False

    def _site(self, func, args) -> CallSite:
        node = torch._C._current_autograd_node()
        phase: PhaseName
        if node is not None:
            phase = "backward"
            variable = getattr(node, "variable", None)
            if variable is not None:
                module = self._module_of_param.get(id(variable), OUTSIDE)
            else:
                module = self._node_module.get(node._sequence_nr(), OUTSIDE)
        elif self._in_optimizer:
            phase = "optimizer"
            first = next((t for t in _tensors_in(args) if t.data_ptr() in self._tensor_owner), None)
            module = self._tensor_owner[first.data_ptr()] if first is not None else "optimizer"
        else:
            phase = "forward"
            module = self._stack[-1] if self._stack else OUTSIDE
            sequence_nr = torch._C._autograd._get_sequence_nr()
            if sequence_nr != self._last_sequence_nr:
                self._node_module[sequence_nr - 1] = module
                self._last_sequence_nr = sequence_nr
        site = CallSite(self.step, phase, module, op_name(func), self.index)
        self.index += 1
        return site

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_capture_work, "active", False) or func.namespace == "c10d":
            # collectives are messages (collectives.py), not operators to digest or corrupt
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
            if isinstance(value, torch.Tensor) and value.numel():
                self._writer[memory_address(value)] = record

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
                memory = memory_address(tensor)
                name = names[position] if position < len(names) else f"arg{position}"
                state = None if memory in self._writer else self._state_memory.get(memory)
                producer = self._writer.get(memory)
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


def memory_address(tensor: torch.Tensor) -> int:
    """The address of the memory block a tensor lives in (shared by all its views)."""
    return tensor.untyped_storage().data_ptr()


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
        return map_tensors(tree, lambda t: t.detach().to("cpu", copy=True))


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, torch.Tensor]:
    """Everything a step starts from, by name: parameters, buffers, optimizer state."""
    tensors: dict[str, torch.Tensor] = {f"param:{name}": p for name, p in model.named_parameters()}
    tensors.update({f"buffer:{name}": b for name, b in model.named_buffers()})
    if optimizer is not None:
        names = {id(p): name for name, p in model.named_parameters()}
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer:{names.get(id(param), '?')}.{key}"] = value
    return tensors
