"""The Inductor kernel calls of a running compiled region: names, provenance, digests, faults.

A ``torch.compile``d step runs Inductor's generated wrapper (a Python module that
``PyCodeCache`` loaded), whose ``call(args)`` calls the kernels it defined by their
generated names (``cpp_fused_add_mul_3 = async_compile.cpp_pybinding(...)`` on a CPU,
``triton_per_fused_...`` on a GPU) and ATen's through ``extern_kernels.mm(..., out=buf)``.
A dispatch mode never sees a fused kernel, and Inductor's own debug printer changes the
generated code (and so the code digest a replay compares). Here the wrapper module's
globals are replaced, after Inductor loaded it in this process, by thin callables that
pass straight through unless an observer is active (`observing_kernels`): then each call
gets a `KernelSite` that is the same on every device generating the same code (step,
phase, its graph, the kernel's name, its position), and observers see its arguments
before and the memory it wrote after it ran. What a kernel writes comes from its
signature: the pointers a C++ kernel does not declare ``const``, the ``out_ptr``/
``in_out_ptr`` arguments of a Triton kernel, the ``out=`` of an extern kernel.

Nothing here loads code: the module is the one Inductor generated (or found in its own
cache) in this process, read as text (`ast`) only to learn each kernel's signature, the
ATen operators it fused and its source; the code of a bundle is never run.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from . import graph_modules
from .compiled import boundary_hooks
from .digest import tensor_digest
from .operators import ROOT, _capture_depth, _own_work, compiled_modules, eager_modules

KERNEL_FACTORIES = ("cpp_pybinding", "cpp", "triton")
"""The ``async_compile`` methods whose results the wrapper calls as kernels."""

EXTERN = "extern_kernels"


@dataclass(frozen=True)
class Kernel:
    """One kernel a loaded wrapper module calls: what the generated code says about it."""

    name: str  # as generated: cpp_fused_add_mul_3, triton_poi_fused_add_0, extern_kernels.mm
    kind: str  # cpp, triton or extern
    graph: str  # the wrapper's AOT graph, e.g. 0_forward
    arguments: tuple[str, ...]  # the kernel's parameter names (in_ptr0, out_ptr1, ...)
    written: tuple[int, ...]  # positions of the arguments it writes
    fused: tuple[str, ...]  # the ATen operators it was generated from
    source_nodes: tuple[str, ...]  # the FX nodes (Inductor's comment), where it names them
    source: str  # the generated kernel source (empty for an extern kernel)
    argument_types: tuple[str, ...] = ()  # a C++ kernel's declared argument types

    def reads(self, position: int) -> bool:
        """Does the kernel read the argument at ``position`` (an input, or ``in_out_ptr``)?"""
        if position not in self.written or position >= len(self.arguments):
            return True
        return self.arguments[position].startswith("in_out")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "graph": self.graph,
            "fused": list(self.fused),
            "source_nodes": list(self.source_nodes),
        }


@dataclass(frozen=True)
class KernelSite:
    """Which kernel call this is; the same call on a device generating the same code has the
    same site."""

    step: int
    phase: str  # forward, or backward (the compiled backward runs under an autograd node)
    module: str  # the compiled module whose region ran it (<compiled> when not known)
    graph: str
    kernel: str
    index: int  # position among all kernel calls of the step
    nth: int  # position among the step's calls of this kernel


@dataclass
class KernelCall:
    """One call, as observers see it: the arguments (written ones after the call), the outputs,
    and the kernel itself to run again (bisect's isolation, minimize's trials)."""

    site: KernelSite
    kernel: Kernel
    args: tuple
    kwargs: dict
    invoke: Callable[..., Any]

    @property
    def outputs(self) -> list[torch.Tensor]:
        return written_tensors(self.kernel, self.args, self.kwargs)


class KernelObserver(Protocol):
    def on_kernel(self, call: KernelCall) -> None: ...


def written_tensors(kernel: Kernel, args: Sequence, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call of ``kernel`` with these arguments writes, in signature order."""
    if kernel.kind == "extern":
        out = kwargs.get("out")
        values = out if isinstance(out, (list, tuple)) else [out]
        return [t for t in values if isinstance(t, torch.Tensor)]
    return [args[i] for i in kernel.written if i < len(args) and isinstance(args[i], torch.Tensor)]


# ---------------------------------------------------------------------------------------------
# What the generated module says


_GRAPH_ID = re.compile(r"^# AOT ID: \['([^']*)'\]", re.MULTILINE)
_METADATA = re.compile(r"Source Nodes: \[([^\]]*)\], Original ATen: \[([^\]]*)\]")


def _graph_of(text: str) -> str:
    found = _GRAPH_ID.search(text)
    return found.group(1) if found else "<graph>"


@functools.cache
def _aten_names() -> frozenset[str]:
    return frozenset(
        name.split("::", 1)[1].split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
    )


def fused_operators(name: str) -> tuple[str, ...]:
    """The ATen operators a kernel's generated name joins (``cpp_fused_gelu_mul_native_layer_
    norm_sum_0`` -> gelu, mul, native_layer_norm, sum): Inductor names a kernel after the
    operators of its nodes (at most ``kernel_name_max_ops`` of them), and the split is the
    one into the fewest known ATen names. A name's own leading underscore is kept
    (``fused__unsafe_view_add`` -> _unsafe_view, add): the empty word before it joins it."""
    body = re.sub(r"^(cpp|triton)_(\w+?_)?fused_?", "", name)
    body = re.sub(r"_\d+$", "", body)
    words = body.split("_")
    known = _aten_names()
    best: list[list[str] | None] = [[]] + [None] * len(words)
    for end in range(1, len(words) + 1):
        for start in range(end):
            head, piece = best[start], "_".join(words[start:end])
            if head is not None and piece in known:
                if best[end] is None or len(head) + 1 < len(best[end] or ()):
                    best[end] = head + [piece]
    split = best[len(words)]
    return tuple(f"aten.{op}" for op in (split if split is not None else filter(None, words)))


def _comment_before(lines: list[str], line: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The source nodes and ATen operators Inductor's comment just above ``line`` names."""
    for previous in range(line - 1, max(line - 12, -1), -1):
        found = _METADATA.search(lines[previous])
        if found:
            nodes = tuple(n.strip() for n in found.group(1).split(",") if n.strip())
            aten = tuple(n.strip() for n in found.group(2).split(",") if n.strip())
            return nodes, aten
        if not lines[previous].lstrip().startswith("#"):
            break
    return (), ()


def _triton_signature(source: str) -> tuple[str, ...]:
    tree = ast.parse(source)
    function = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef))
    return tuple(
        a.arg
        for a in function.args.args
        if not (isinstance(a.annotation, ast.Attribute) and a.annotation.attr == "constexpr")
    )


def _cpp_signature(source: str) -> tuple[str, ...]:
    found = re.search(r"void\s+kernel\s*\(([^)]*)\)", source)
    if not found:
        return ()
    return tuple(part.strip().split()[-1].lstrip("*") for part in found.group(1).split(","))


def kernels_of_module(text: str) -> dict[str, Kernel]:
    """The kernels a wrapper module defines, by global name, from its text."""
    graph = _graph_of(text)
    lines = text.splitlines()
    kernels: dict[str, Kernel] = {}
    for node in ast.parse(text).body:
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and isinstance(node.value.func.value, ast.Name)
            and node.value.func.value.id == "async_compile"
            and node.value.func.attr in KERNEL_FACTORIES
        ):
            continue
        name = node.targets[0].id
        constants = [a.value for a in node.value.args if isinstance(a, ast.Constant)]
        source = next((c for c in constants if isinstance(c, str) and "\n" in c), "")
        types: tuple[str, ...] = ()
        if node.value.func.attr == "triton":
            kind, arguments = "triton", _triton_signature(source)
            written = tuple(i for i, a in enumerate(arguments) if a.startswith(("out_", "in_out")))
        else:
            listed = next((a for a in node.value.args if isinstance(a, ast.List)), None)
            types = tuple(
                str(e.value) for e in (listed.elts if listed else []) if isinstance(e, ast.Constant)
            )
            kind, arguments = "cpp", _cpp_signature(source)
            written = tuple(
                i for i, t in enumerate(types) if t.endswith("*") and not t.startswith("const")
            )
        nodes, aten = _comment_before(lines, node.lineno - 1)
        kernels[name] = Kernel(
            name,
            kind,
            graph,
            arguments,
            written,
            aten or fused_operators(name),
            nodes,
            source,
            types,
        )
    return kernels


# ---------------------------------------------------------------------------------------------
# Instrumenting loaded modules


@dataclass
class _Run:
    """The observation now open: its observers and the step's counters."""

    observers: Sequence[KernelObserver]
    step: int
    regions: list[str]  # the paths of the model's compiled modules
    index: int = 0
    seen: Counter = field(default_factory=Counter)
    stack: list[str] = field(default_factory=list)
    graph_modules: dict[str, str] = field(default_factory=dict)  # graph number -> module
    busy: bool = False


_active: list[_Run] = []  # at most one: a step's kernels may run on autograd's threads
_lock = threading.Lock()


def _current() -> _Run | None:
    return _active[0] if _active else None


def _graph_number(graph: str) -> str:
    return graph.split("_", 1)[0]


def _observe(kernel: Kernel, invoke: Callable, args: tuple, kwargs: dict):
    run = _current()
    if run is None or run.busy or _capture_depth():
        return invoke(*args, **kwargs)
    backward = torch._C._current_autograd_node() is not None
    number = _graph_number(kernel.graph)
    alone = run.regions[0] if len(run.regions) == 1 else "<compiled>"
    if backward:  # where the same graph's forward ran
        module = run.graph_modules.get(number, alone)
    else:
        module = run.stack[-1] if run.stack else alone
        run.graph_modules[number] = module
        if module in run.regions:  # inside the region: the modules its source nodes ran under
            inner = graph_modules.module_of(number, kernel.source_nodes)
            if inner:
                module = inner if module == ROOT else f"{module}.{inner}"
    site = KernelSite(
        run.step,
        "backward" if backward else "forward",
        module,
        kernel.graph,
        kernel.name,
        run.index,
        run.seen[kernel.name],
    )
    run.index += 1
    run.seen[kernel.name] += 1
    call = KernelCall(site, kernel, args, kwargs, invoke)
    with _observers_running(run):  # their tensor work is not the step's
        for observer in run.observers:
            before = getattr(observer, "before_kernel", None)
            if before is not None:
                before(call)
    result = invoke(*args, **kwargs)
    with _observers_running(run):
        for observer in run.observers:
            observer.on_kernel(call)
    return result


@contextlib.contextmanager
def _observers_running(run: _Run) -> Iterator[None]:
    run.busy = True
    try:
        with _own_work():
            yield
    finally:
        run.busy = False


class _ObservedKernel:
    """Stands in a wrapper module's globals for one generated kernel."""

    def __init__(self, kernel: Kernel, original: Any):
        self._kernel, self._original = kernel, original

    def __call__(self, *args, **kwargs):  # a C++ kernel
        return _observe(self._kernel, self._original, args, kwargs)

    def run(self, *args, **kwargs):  # a Triton kernel: name.run(*args, stream=...)
        return _observe(self._kernel, self._original.run, args, kwargs)

    def __getattr__(self, name: str):
        return getattr(self._original, name)


class _ObservedExterns:
    """Stands for ``extern_kernels`` in one wrapper module: each call is a kernel call, its
    ATen operators those of Inductor's comment above the calling line."""

    def __init__(self, namespace: Any, graph: str, lines: list[str]):
        self._namespace, self._graph, self._lines = namespace, graph, lines
        self._kernels: dict[tuple[str, int], Kernel] = {}

    def __getattr__(self, name: str):
        original = getattr(self._namespace, name)
        if not callable(original):
            return original

        def extern(*args, **kwargs):
            if _current() is None:
                return original(*args, **kwargs)
            line = sys._getframe(1).f_lineno
            kernel = self._kernels.get((name, line))
            if kernel is None:
                nodes, aten = _comment_before(self._lines, line - 1)
                kernel = Kernel(f"{EXTERN}.{name}", "extern", self._graph, (), (), aten, nodes, "")
                self._kernels[(name, line)] = kernel
            return _observe(kernel, original, args, kwargs)

        return extern


_INSTRUMENTED = "__sdcreplay_kernels__"


def _instrument(module: Any) -> None:
    """Put observed stand-ins for a loaded wrapper module's kernels (once per module)."""
    if getattr(module, _INSTRUMENTED, None) is not None or not getattr(module, "__file__", None):
        return
    try:
        with open(module.__file__, encoding="utf-8") as handle:
            text = handle.read()
        kernels = kernels_of_module(text)
    except (OSError, SyntaxError, StopIteration, ValueError):
        kernels, text = {}, ""
    namespace = vars(module)
    for name, kernel in kernels.items():
        if name in namespace:
            namespace[name] = _ObservedKernel(kernel, namespace[name])
    if EXTERN in namespace and "def call" in text:
        namespace[EXTERN] = _ObservedExterns(namespace[EXTERN], _graph_of(text), text.splitlines())
    setattr(module, _INSTRUMENTED, kernels)


@functools.cache
def install() -> None:
    """Instrument every wrapper module Inductor loaded in this process, and each it loads later
    (``PyCodeCache.load_by_key_path``, which cache hits go through too). Idempotent."""
    from torch._inductor.codecache import PyCodeCache

    graph_modules.install()  # for a model compiled from now on
    original = PyCodeCache.load_by_key_path.__func__  # type: ignore[attr-defined]

    def load_by_key_path(cls, *args, **kwargs):
        module = original(cls, *args, **kwargs)
        _instrument(module)
        return module

    PyCodeCache.load_by_key_path = classmethod(load_by_key_path)  # type: ignore[method-assign,assignment]
    for module in list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values()):
        _instrument(module)


def _enter_region(run: _Run, path: str, module, args) -> None:
    run.stack.append(path)


def _leave_region(run: _Run, path: str, module, args, output) -> None:
    if run.stack[-1:] == [path]:
        run.stack.pop()


@contextlib.contextmanager
def observing_kernels(
    observers: Sequence[KernelObserver], step: int, model: torch.nn.Module | None = None
) -> Iterator[None]:
    """While open, every Inductor kernel call of this process is handed to ``observers`` with
    its site in ``step``; ``model``'s modules name where a kernel ran (`eager_modules`, and a
    block compiled in place itself; a backward kernel where its graph's forward ran)."""
    install()
    regions = compiled_modules(model) if model is not None else {}
    run = _Run(list(observers), step, sorted(regions))
    handles = []
    # a block compiled in place names its own kernels: its hooks wrap its compiled call
    named = [*(eager_modules(model) if model is not None else []), *regions.items()]
    hooked = {id(module): (path, module) for path, module in named}  # each module once
    for path, module in hooked.values():
        handles += boundary_hooks(
            module,
            partial(_enter_region, run, path),
            partial(_leave_region, run, path),
            always=True,
        )
    with _lock:
        if _active:
            raise RuntimeError("kernel observation is already open in this process")
        _active.append(run)
    try:
        yield
    finally:
        with _lock:
            _active.clear()
        for handle in handles:
            handle.remove()


def digests(call: KernelCall) -> list[str]:
    with _own_work():
        return [tensor_digest(t) for t in call.outputs]
