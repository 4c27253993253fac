"""Which modules a compiled graph's code came from: its FX nodes' ``nn_module_stack``.

A whole model compiled (``torch.compile(model)``) runs as one region, so a generated
kernel's place is known only as the region (``<root>``). Dynamo knows better: each node of
the graph it hands the backend carries the module stack it was traced under. While the
backend compiles a graph (``OutputGraph.call_user_compiler``, in every process, whether
Inductor compiles afresh or loads its caches), the node -> module table is kept under the
AOT graph number of the wrapper module(s) Inductor loads meanwhile; `compiled_kernels`
then names a kernel call by the modules of the source nodes Inductor's comment gives it
(``Source Nodes: [linear_1]``: Dynamo's node names). Paths are relative to the compiled
module, without wrappers' segments (`module_names`). Installed once per process, before a
model compiles (by `compiled.CompileWatch`, which the Recorder and a replay open first).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from .module_names import WRAPPED_ATTRIBUTES

_TABLES: dict[str, dict[str, str]] = {}
"""AOT graph number (``0`` of ``0_forward``, shared with its backward) -> node -> module."""

_AOT_NUMBER = re.compile(r"^# AOT ID: \['(\d+)_", re.MULTILINE)
_TRACED_ROOT = re.compile(r"^L\[['\"][^'\"]*['\"]\]")  # L['self'], the traced module itself
_SUBSCRIPT = re.compile(r"\._modules\[['\"]([^'\"]*)['\"]\]|\[['\"]?([^'\"\]]*)['\"]?\]")


def traced_path(qualified: str) -> str:
    """``L['self'].h[0]._orig_mod.fc`` -> ``h.0.fc``: Dynamo's source of a module, as a plain
    path relative to the compiled module."""
    path = _TRACED_ROOT.sub("", qualified)
    path = _SUBSCRIPT.sub(lambda found: "." + (found.group(1) or found.group(2)), path)
    return ".".join(s for s in path.split(".") if s and s not in WRAPPED_ATTRIBUTES)


def node_modules(graph_module: Any) -> dict[str, str]:
    """Each computing node's innermost module (``""``: the compiled module itself)."""
    table = {}
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        innermost = list(stack.values())[-1] if stack else None
        qualified = innermost[0] if isinstance(innermost, tuple) else innermost
        table[node.name] = traced_path(qualified) if isinstance(qualified, str) else ""
    return table


def _wrapper_modules() -> list[Any]:
    from torch._inductor.codecache import PyCodeCache

    return list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values())


def _aot_number(module: Any) -> str | None:
    try:
        with open(module.__file__, encoding="utf-8") as handle:
            found = _AOT_NUMBER.search(handle.read(4096))
    except (OSError, TypeError, AttributeError):
        return None
    return found.group(1) if found else None


@functools.cache
def install() -> None:
    """Keep each graph's table as the backend compiles it (once per process)."""
    from torch._dynamo.output_graph import OutputGraph

    original = OutputGraph.call_user_compiler

    def call_user_compiler(self: Any, graph_module: Any, example_inputs: Any) -> Any:
        before = {id(module) for module in _wrapper_modules()}
        compiled = original(self, graph_module, example_inputs)
        table = None
        for module in _wrapper_modules():
            number = None if id(module) in before else _aot_number(module)
            if number is not None:
                table = table if table is not None else node_modules(graph_module)
                _TABLES.setdefault(number, table)
        return compiled

    OutputGraph.call_user_compiler = call_user_compiler  # type: ignore[method-assign,assignment]


def module_of(graph_number: str, source_nodes: tuple[str, ...]) -> str | None:
    """The innermost module all the named nodes of forward graph ``graph_number`` ran under
    (relative to the compiled module; ``""`` the module itself), or None where no node is
    known. A forward kernel's source nodes are Dynamo's; a backward's are the backward
    graph's own, which may share a name with a forward node, so they are not looked up."""
    table = _TABLES.get(graph_number, {})
    paths = [table[node].split(".") for node in source_nodes if node in table]
    if not paths:
        return None
    return ".".join(segment for segment in os.path.commonprefix(paths) if segment)
