"""Layer-level capture: the signature log names a corruption by the module that computed it.

Forward hooks digest every module's output. For the backward,
the autograd nodes a module created are known by their sequence numbers
(taken in the forward pre-hook and hook); a hook on each node where the
module's graph hands a gradient to its inputs digests what the module's own
backward produced, before it is summed with other consumers' gradients (so a
corrupted backward is named by its module, at a fraction of the cost of
``register_full_backward_hook``). Gradients, the loss, the parameters after
the optimizer step and the RNG states complete a step.
"""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Callable, Iterator
from functools import partial

import torch

from ..errors import SdcReplayError
from ..kinds import SIGNATURE_LEVELS, ModuleNaming, SignatureLevel
from .compiled import boundary_hooks, covered, find_regions
from .determinism import RngState
from .digest import Digester, SignatureValue
from .module_names import named_buffers, named_parameters, outermost_modules
from .operators import ROOT, _own_work


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
    replay without them. ``level="boundary"`` keeps only the step's boundary
    (``signature.BOUNDARY_KINDS``: RNG, state objects, losses, what the optimizer is given
    and the parameters and buffers it produced, program entries included): no module is
    hooked, no gradient digested after each backward, no optimizer state digested.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        max_depth: int | None = None,
        *,
        state: dict | None = None,
        program: bool = False,
        level: SignatureLevel = "layer",
        names: ModuleNaming = "plain",
    ):
        if level not in SIGNATURE_LEVELS:
            raise SdcReplayError(
                f"signature level {level!r} is not one of {', '.join(SIGNATURE_LEVELS)}",
                "Use signature='layer' (every module: forensics) or 'boundary' (production).",
            )
        self.model = model
        self.state_objects = dict(state or {})
        self.level = level
        self.names = names  # "wrapped": a replay of a bundle recorded before names were plain
        self.program = program or level == "boundary"
        self._digester: Digester | None = None
        self._in_forward_window = False
        self._calls: Counter[str] = Counter()
        self._starts: dict[str, list[int]] = {}
        self.optimizer_stepped = False
        self.updated_state: dict[str, str] = {}
        self._updated_state_positions: dict[str, int] = {}
        self._param_names: dict[int, str] | None = None
        self._handles = []
        # A compiled region's modules run inside its compiled code: the region's entry is
        # hooked from outside it (compiled.boundary_hooks), the modules within are not.
        regions = find_regions(model, names) if level == "layer" else []
        for name, _, module in outermost_modules(model, names) if level == "layer" else ():
            if not within_depth("" if name == ROOT else name, max_depth) or covered(name, regions):
                continue
            self._handles += boundary_hooks(
                module,
                partial(self._on_forward_begin, name),
                partial(self._on_forward, name),
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
        # Traced by Dynamo (a module compiled where the capture did not see it): nothing.
        if self._in_forward_window and not torch.compiler.is_compiling():
            self._starts.setdefault(path, []).append(_next_sequence_nr())

    def _on_forward(self, path: str, module, inputs, output) -> None:
        if not self._in_forward_window or torch.compiler.is_compiling():
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
        """Every parameter's gradient (``grad:NAME``; ``grad:NAME#1`` after a second backward);
        not at the boundary level."""
        if self._digester is None or self.level == "boundary":
            return
        with _own_work():
            for name, param in named_parameters(self.model, self.names):
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
            self._param_names = {
                id(p): name for name, p in named_parameters(self.model, self.names)
            }
        names = self._param_names
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in names:
                    yield names[id(param)], param

    def _on_optimizer_begin(self, optimizer, args, kwargs) -> None:
        self.record_optimizer_inputs(optimizer)

    def record_optimizer_inputs(self, optimizer: torch.optim.Optimizer) -> None:
        """What the optimizer is about to use: each group's hyper-parameters and the gradients
        (its step pre-hook; called directly for a step a detector stops before it)."""
        if self._digester is None or not self.program:
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
            if self.program and self.level == "layer":  # the state the update came from first
                for name, param in self._named_group_params(optimizer):
                    for key, value in optimizer.state.get(param, {}).items():
                        if isinstance(value, torch.Tensor):
                            self._add(f"optim:{name}.{key}", value)
            positions = self._updated_state_positions
            for name, param in named_parameters(self.model, self.names):
                positions[f"param:{name}"] = len(self._step_digester())
                self._add(f"param:{name}", param)
            for name, buffer in named_buffers(self.model, self.names):
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
    """Digests of the parameters, buffers, state objects and hyper-parameters, by signature name
    (plain: `module_names`)."""
    digester = Digester()
    with _own_work():
        for name, param in named_parameters(model):
            digester.add(f"param:{name}", param)
        for name, buffer in named_buffers(model):
            digester.add(f"buffer:{name}", buffer)
        for name, value in state_object_items(objects or {}):
            digester.add(name, value)
        for name, value in hyper_items(optimizer) if optimizer is not None else ():
            digester.add(name, value)
        return dict(digester.entries())
