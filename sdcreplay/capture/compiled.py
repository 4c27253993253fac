"""Compiled regions: what `torch.compile` made of a model, and proof that a replay runs the same.

A compiled region is a module whose call Dynamo compiles: the model given to
``torch.compile(model)`` (an ``OptimizedModule``) or a block compiled in place with
``block.compile()`` (TorchTitan's per-block compile). It is named by its module path, with
the backend, mode, options, dynamic and fullgraph it was compiled with and the modules it
covers. Each graph Inductor generated for it (forward, backward, or inference) is kept as a
digest of the generated code (the output code Inductor wrote, a fresh compile or a cache hit,
through ``GraphLowering.save_output_code``) with its generated kernel names and the Inductor
settings in force that change code generation (the non-default ones of those Inductor's own
FX graph cache key covers). A replay compiles its workload again in each device process and
compares: other code is another program, never evidence against a device. Generated code is
never stored or loaded: only its digest travels.

A region's entry is watched from outside the compiled code (an ``OptimizedModule``'s own
hooks, or a wrapper around a block's ``_compiled_call_impl``), so Dynamo never traces the
tool; modules inside a region are covered by the region's entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..kinds import ModuleNaming
from . import graph_modules
from .module_names import plain_paths

if TYPE_CHECKING:  # torch-free at import: the manifest's rule and `info` use this module
    import torch

ROOT = "<root>"
OUTSIDE = "<outside>"  # code compiled while no watched region ran (a compiled loss, a step)
GRAPH_KINDS = ("forward", "backward", "inference")
MAX_REGIONS = 4096
MAX_GRAPHS = 4096

_AOT_ID = re.compile(r"^# AOT ID: \['\d+_(forward|backward|inference)'\]", re.M)
_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)
# Lines that name this process or this machine's cache, not the code: an AOT counter, paths.
_VOLATILE = re.compile(
    r"^# (AOT ID|kernel path|Compile-time auto-tuning block|Output code).*$", re.M
)


@dataclass(frozen=True)
class CompiledGraph:
    """One graph Inductor generated code for: its kind, the code's digest, its kernels."""

    kind: str  # forward | backward | inference
    digest: str  # SHA-256 of the generated code, lines naming the process or cache dropped
    kernels: tuple[str, ...] = ()  # generated kernel names, in definition order
    compile_id: str | None = None  # Dynamo's compile id in the recording process (not compared)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "digest": self.digest,
            "kernels": list(self.kernels),
            "compile_id": self.compile_id,
        }

    @classmethod
    def from_json(cls, data: dict) -> CompiledGraph:
        return cls(data["kind"], data["digest"], tuple(data["kernels"]), data.get("compile_id"))


@dataclass
class CompiledRegion:
    """A module whose calls run compiled code, and the graphs generated for it."""

    path: str  # its module path; ROOT for the model itself, OUTSIDE for unwatched code
    backend: str
    mode: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    dynamic: bool | None = None
    fullgraph: bool = False
    modules: list[str] = field(default_factory=list)  # its own path and every submodule's
    settings: dict[str, Any] = field(default_factory=dict)  # non-default, code-changing
    graphs: list[CompiledGraph] = field(default_factory=list)
    module: Any = field(default=None, compare=False, repr=False)  # live (find_regions) only

    @property
    def observed(self) -> bool:
        """Was its code seen being generated (a region compiled before the watch began was
        not)?"""
        return bool(self.graphs)

    @property
    def code_digest(self) -> str | None:
        """One digest over its graphs' code (in the order they were compiled)."""
        if not self.graphs:
            return None
        joined = "\n".join(f"{graph.kind}:{graph.digest}" for graph in self.graphs)
        return hashlib.sha256(joined.encode()).hexdigest()

    def covers(self, module_path: str) -> bool:
        """Does this region compute ``module_path`` (a module path, ROOT for the model)?"""
        return _within(module_path, self.path)

    def describe(self, kind: str | None = None) -> str:
        """``compiled region layers.0 (inductor, backward graph: 3 kernels, covering layers.0,
        layers.0.fc)``: how a person names where a divergence was computed."""
        graph = next((g for g in self.graphs if kind is None or g.kind == kind), None)
        which = f"{kind} graph" if kind else "graphs"
        kernels = f": {len(graph.kernels)} kernels" if graph is not None else ""
        shown = ", ".join(self.modules[:4]) + (", ..." if len(self.modules) > 4 else "")
        return f"compiled region {self.path} ({self.backend}, {which}{kernels}, covering {shown})"

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "backend": self.backend,
            "mode": self.mode,
            "options": self.options,
            "dynamic": self.dynamic,
            "fullgraph": self.fullgraph,
            "modules": self.modules,
            "settings": self.settings,
            "code_digest": self.code_digest,
            "graphs": [graph.to_json() for graph in self.graphs],
        }

    @classmethod
    def from_json(cls, data: dict) -> CompiledRegion:
        return cls(
            path=data["path"],
            backend=data["backend"],
            mode=data.get("mode"),
            options=dict(data.get("options") or {}),
            dynamic=data.get("dynamic"),
            fullgraph=bool(data.get("fullgraph", False)),
            modules=list(data.get("modules") or []),
            settings=dict(data.get("settings") or {}),
            graphs=[CompiledGraph.from_json(graph) for graph in data.get("graphs") or []],
        )


def regions_problem(value: Any) -> str | None:
    """What is wrong with a manifest's ``compiled`` list, or None (the bundle's rule)."""
    if not isinstance(value, list) or len(value) > MAX_REGIONS:
        return "a list of compiled regions"
    for position, region in enumerate(value):
        where = f"compiled[{position}]"
        if not isinstance(region, dict):
            return f"{where} is an object"
        for key, kind in (("path", str), ("backend", str), ("modules", list), ("graphs", list)):
            if not isinstance(region.get(key), kind):
                return f"{where}.{key} is a {kind.__name__}"
        if not isinstance(region.get("options", {}), dict) or not isinstance(
            region.get("settings", {}), dict
        ):
            return f"{where}.options and .settings are objects"
        if len(region["graphs"]) > MAX_GRAPHS:
            return f"{where}.graphs holds at most {MAX_GRAPHS} graphs"
        for index, graph in enumerate(region["graphs"]):
            if (
                not isinstance(graph, dict)
                or graph.get("kind") not in GRAPH_KINDS
                or not isinstance(graph.get("digest"), str)
                or re.fullmatch("[0-9a-f]{64}", graph["digest"]) is None
                or not isinstance(graph.get("kernels"), list)
                or not all(isinstance(name, str) for name in graph["kernels"])
            ):
                return (
                    f"{where}.graphs[{index}] has a kind ({', '.join(GRAPH_KINDS)}), a SHA-256 "
                    "digest and a list of kernel names"
                )
    return None


# --- finding and watching regions ------------------------------------------------------------


def _within(path: str, region: str) -> bool:
    if region in ("", ROOT):
        return True
    path = "" if path == ROOT else path
    return path == region or path.startswith(region + ".")


def _compile_context(module: torch.nn.Module) -> Any | None:
    """The Dynamo context a module's calls are compiled by, or None for an eager module."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, OptimizedModule):
        return module.dynamo_ctx
    compiled = getattr(module, "_compiled_call_impl", None)
    if compiled is None:
        return None
    compiled = getattr(compiled, "_sdcreplay_compiled", compiled)  # our own watch's wrapper
    for cell in getattr(compiled, "__closure__", None) or ():
        contents = cell.cell_contents
        if hasattr(contents, "callback") and hasattr(contents, "_dynamic"):
            return contents
    return None


def _backend_of(context: Any) -> tuple[str, dict[str, Any], bool | None]:
    """(backend name, its options, dynamic) of a Dynamo context, as far as it tells."""
    backend: Any = getattr(getattr(context, "callback", None), "_torchdynamo_orig_backend", None)
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or "?"
    options = dict(getattr(backend, "config", None) or {})
    dynamic = getattr(backend, "dynamic", getattr(context, "_dynamic", None))
    return str(name), options, dynamic


def _mode_of(options: dict[str, Any], dynamic: bool | None) -> str | None:
    """The ``mode=`` whose options the backend holds (torch.compile keeps only the options)."""
    try:
        from torch._inductor import list_mode_options
    except ImportError:  # pragma: no cover - torch without Inductor
        return None
    for mode in ("max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"):
        wanted = list_mode_options(mode, dynamic)
        if wanted and all(options.get(key) == value for key, value in wanted.items()):
            return mode
    return None


def find_regions(model: torch.nn.Module, names: ModuleNaming = "plain") -> list[CompiledRegion]:
    """The compiled regions of ``model`` (outermost only: a region inside another is the
    outer one's), without graphs; paths named as signature entries are (`module_names`)."""
    regions: list[CompiledRegion] = []
    plain = plain_paths(model) if names == "plain" else {}
    for path, module in model.named_modules():
        if any(region.covers(plain.get(path, path) or ROOT) for region in regions):
            continue
        context = _compile_context(module)
        if context is None:
            continue
        backend, options, dynamic = _backend_of(context)
        inside = (plain.get(p, p) or ROOT for p, _ in module.named_modules(prefix=path))
        regions.append(
            CompiledRegion(
                path=plain.get(path, path) or ROOT,
                backend=backend,
                mode=_mode_of(options, dynamic),
                options=_jsonable(options),
                dynamic=dynamic,
                fullgraph=bool(getattr(context, "fullgraph", False)),
                modules=list(dict.fromkeys(inside)),
                module=module,
            )
        )
    return regions


def covered(path: str, regions: list[CompiledRegion]) -> bool:
    """Is module ``path`` strictly inside a region (its code compiled, so not hooked)?"""
    return any(region.covers(path) and path != region.path for region in regions)


def boundary_hooks(
    module: torch.nn.Module,
    before: Callable[[torch.nn.Module, tuple], None],
    after: Callable[[torch.nn.Module, tuple, Any], None],
    *,
    always: bool = False,
) -> list[Any]:
    """Forward pre-hook and hook on ``module`` that Dynamo never traces: a block compiled in
    place (``block.compile()``) runs its hooks inside its compiled code, so there they wrap
    its compiled call instead. ``always``: ``after`` runs when the call raises too (with
    output None). Each returned handle has ``remove()``."""
    compiled = getattr(module, "_compiled_call_impl", None)
    if compiled is None:
        return [
            module.register_forward_pre_hook(before),
            module.register_forward_hook(after, always_call=always),
        ]

    def call(*args: Any, **kwargs: Any) -> Any:
        before(module, args)
        output = None
        try:
            output = inner(*args, **kwargs)
        except BaseException:
            if always:
                after(module, args, None)
            raise
        after(module, args, output)
        return output

    inner = compiled
    call._sdcreplay_compiled = getattr(compiled, "_sdcreplay_compiled", compiled)  # type: ignore[attr-defined]
    module._compiled_call_impl = call
    return [_Restore(module, call, compiled)]


class _Restore:
    """Takes a wrapper off a block's compiled call (whatever was wrapped around it since)."""

    def __init__(self, module: torch.nn.Module, wrapper: Callable, original: Callable):
        self.module, self.wrapper, self.original = module, wrapper, original

    def remove(self) -> None:
        if getattr(self.module, "_compiled_call_impl", None) is self.wrapper:
            self.module._compiled_call_impl = self.original


# --- observing generated code ----------------------------------------------------------------

_running = threading.local()  # the stack of (watch id, region path) whose compiled call runs
_watches: dict[int, CompileWatch] = {}
_installed: list[Callable[[str], None] | None] = []  # the save_output_code hook we chained


def _stack() -> list[tuple[int, str]]:
    if not hasattr(_running, "stack"):
        _running.stack = []
    return _running.stack


def _on_output_code(code: str) -> None:
    """Inductor hands over each graph's generated code (fresh or from its caches)."""
    previous = _installed[0] if _installed else None
    if previous is not None:
        previous(code)
    from .operators import _capture_work

    if getattr(_capture_work, "depth", 0):  # the tool's own compiled digest pass
        return
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    graph = _graph(code, None if compile_id is None else str(compile_id))
    stack = _stack()
    if stack:  # the innermost watched region running compiled it
        owner, path = stack[-1]
        if owner in _watches:
            _watches[owner]._add(graph, path)
        return
    # No region runs: a backward compiled as it runs, under its forward's compile id, or code
    # compiled outside every watched region.
    watches = list(_watches.values())
    owner_of = next((w for w in watches if graph.compile_id in w._by_compile_id), None)
    for watch in [owner_of] if owner_of is not None else watches:
        watch._add(graph, None)


def _graph(code: str, compile_id: str | None) -> CompiledGraph:
    kind = (_AOT_ID.search(code) or _DEFAULT_KIND).group(1)
    return CompiledGraph(kind, code_digest(code), tuple(_KERNEL.findall(code)), compile_id)


class _Kind:
    def group(self, _: int) -> str:
        return "forward"


_DEFAULT_KIND = _Kind()


def code_digest(code: str) -> str:
    """SHA-256 of generated code without the lines that name the process or the cache."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    normalized = _VOLATILE.sub("", code).replace(cache_dir(), "<cache>")
    return hashlib.sha256(normalized.encode()).hexdigest()


# Environment variables of Inductor's that choose where files go, not what code is generated.
_PLACE_ONLY = re.compile(
    r"TORCHINDUCTOR_(CACHE_DIR|FX_GRAPH_CACHE.*|AUTOGRAD_CACHE|.*LOG.*|"
    r"COMPILE_THREADS|WORKER_START|.*REMOTE.*)"
)


def codegen_settings(options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Inductor settings in force that change generated code: those of Inductor's own FX
    graph cache key that are not at their defaults, the ``TORCHINDUCTOR_*`` variables set
    (Inductor reads many at import, into its defaults), and the CPU vector ISA it generates
    for."""
    import os

    from torch._inductor import config

    ignored = tuple(config._cache_config_ignore_prefix) + tuple(config._save_config_ignore)
    settings: dict[str, Any] = {}
    for name, value in {**config.get_config_copy(), **(options or {})}.items():
        entry = config._config.get(name)  # type: ignore[attr-defined]
        if name.startswith(("_", *ignored)) or entry is None:
            continue
        if value != entry.default:
            settings[name] = _jsonable(value)
    for name in sorted(os.environ):
        if name.startswith("TORCHINDUCTOR_") and not _PLACE_ONLY.fullmatch(name):
            settings[f"${name}"] = os.environ[name]
    with contextlib.suppress(Exception):  # no C++ compiler: no ISA, and no CPU code either
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        settings["(cpu vector isa)"] = str(pick_vec_isa()) or "none"
    return settings


class CompileWatch:
    """Observes the code Inductor generates while open, per compiled region of ``model``.

    A graph compiled while a region's call runs is that region's; its backward (compiled
    later, as the backward runs) has its forward's Dynamo compile id. Code generated while no
    watched region ran (a compiled loss, the tool's own digest pass excluded) is the pseudo
    region OUTSIDE's; a model without compiled regions is not watched at all. Dynamo's
    graph-break counter is read at open and at ``regions()``.
    """

    def __init__(self, model: torch.nn.Module, names: ModuleNaming = "plain"):
        import torch

        self._is_compiling = torch.compiler.is_compiling
        self._regions = {region.path: region for region in find_regions(model, names)}
        self._options = {  # the options each region's backend applies over the global settings
            path: _backend_of(_compile_context(region.module))[1]
            for path, region in self._regions.items()
        }
        self._by_compile_id: dict[str, str] = {}
        self._reused: dict[str, set[str]] = {}  # region -> compile ids of code it ran, not made
        self._handles: list[Any] = []
        self._breaks_at_open = graph_breaks()
        # For code compiled outside every region (taken at once only for a compiled model).
        self._settings_at_open = codegen_settings() if self._regions else None
        for path, region in self._regions.items():
            self._handles += boundary_hooks(
                region.module, self._entering(path), self._leaving(path), always=True
            )
        if self._regions:  # Inductor's modules are imported only for a compiled model
            _install()
            _watches[id(self)] = self

    @property
    def compiled(self) -> bool:
        return bool(self._regions)

    def _entering(self, path: str) -> Callable[[torch.nn.Module, tuple], None]:
        def before(module: torch.nn.Module, args: tuple) -> None:
            if self._is_compiling():
                return
            _stack().append((id(self), path))
            region = self._regions[path]
            if not region.settings:  # as its first call compiles: outside Inductor's own patches
                region.settings = codegen_settings(self._options.get(path))

        return before

    def _leaving(self, path: str) -> Callable[[torch.nn.Module, tuple, Any], None]:
        def after(module: torch.nn.Module, args: tuple, output: Any) -> None:
            stack = _stack()
            if not self._is_compiling() and stack and stack[-1] == (id(self), path):
                stack.pop()

        return after

    def _add(self, graph: CompiledGraph, running: str | None) -> None:
        """A graph generated while region ``running`` ran (None: while none of this process's
        watched regions ran)."""
        if running is not None and graph.compile_id is not None:
            self._by_compile_id[graph.compile_id] = running
        elif running is None and graph.compile_id is not None:
            running = self._by_compile_id.get(graph.compile_id)
        region = self._regions.get(running) if running else self._outside()
        assert region is not None
        if graph not in region.graphs and len(region.graphs) < MAX_GRAPHS:
            region.graphs.append(graph)

    def _outside(self) -> CompiledRegion:
        """The pseudo region of code compiled while no watched region ran."""
        region = self._regions.get(OUTSIDE)
        if region is None:
            region = self._regions[OUTSIDE] = CompiledRegion(
                path=OUTSIDE, backend="inductor", settings=self._settings_at_open or {}
            )
            if not region.settings:
                region.settings = codegen_settings()
        return region

    def _ran_outside(self, graph: CompiledGraph) -> None:
        """Code run while no watched region ran, from Dynamo's cache (a loss compiled earlier
        in this process) is the outside region's, unless a backward (a region's) or known."""
        known = {g.digest for r in self._regions.values() for g in r.graphs}
        if graph.kind != "backward" and graph.digest not in known:
            self._add(graph, None)

    def _ran(self, graph: CompiledGraph, path: str) -> None:
        """Region ``path``'s call ran ``graph``'s code: generated for it, or served from
        Dynamo's cache, compiled for another region (identical blocks)."""
        region = self._regions.get(path)
        if region is None or any(g.digest == graph.digest for g in region.graphs):
            return
        known = [g for r in self._regions.values() for g in r.graphs if g.digest == graph.digest]
        graph = known[0] if known else graph  # with the compile id its backward will have
        if len(region.graphs) < MAX_GRAPHS:
            region.graphs.append(graph)
        if graph.compile_id is not None:
            self._reused.setdefault(path, set()).add(graph.compile_id)

    def regions(self) -> list[CompiledRegion]:
        """The regions and every graph generated for them, or run from another region's
        code, since the watch opened (a reused forward brings its backward along)."""
        for path, compile_ids in self._reused.items():
            region = self._regions[path]
            for other in list(self._regions.values()):
                for graph in other.graphs:
                    if graph.compile_id in compile_ids and graph not in region.graphs:
                        region.graphs.append(graph)
        return list(self._regions.values())

    @property
    def graph_breaks(self) -> int:
        """Dynamo's graph breaks since the watch opened (the model's own and any added)."""
        return graph_breaks() - self._breaks_at_open

    def close(self) -> None:
        _watches.pop(id(self), None)
        for handle in self._handles:
            handle.remove()
        self._handles = []


@contextlib.contextmanager
def watching(model: torch.nn.Module) -> Iterator[CompileWatch]:
    watch = CompileWatch(model)
    try:
        yield watch
    finally:
        watch.close()


def _install() -> None:
    """Chain our hooks in front of whatever ``save_output_code`` and a compiled graph's call
    were (once per process)."""
    from torch._inductor.graph import GraphLowering
    from torch._inductor.output_code import CompiledFxGraph

    graph_modules.install()  # which modules each graph's nodes came from, for kernel sites
    if GraphLowering.save_output_code is not _on_output_code:
        _installed[:] = [GraphLowering.save_output_code]
        GraphLowering.save_output_code = _on_output_code
    call = CompiledFxGraph.__call__
    if not getattr(call, "_sdcreplay", False):

        def watched_call(graph: Any, inputs: Any) -> Any:
            if _watches:
                _on_graph_run(graph)
            return call(graph, inputs)

        watched_call._sdcreplay = True  # type: ignore[attr-defined]
        CompiledFxGraph.__call__ = watched_call  # type: ignore[method-assign,assignment]


def _on_graph_run(compiled: Any) -> None:
    """A compiled graph runs: inside a watched region's call, the region ran that code; in
    none, the code outside every region did (its digest taken once per graph object, from
    the code Inductor keeps on it)."""
    from .operators import _capture_work

    if getattr(_capture_work, "depth", 0):  # the tool's own compiled digest pass
        return
    graph = compiled.__dict__.get("_sdcreplay_graph")
    if graph is None:
        code = getattr(compiled, "source_code", None)
        if not isinstance(code, str):
            return
        graph = compiled.__dict__["_sdcreplay_graph"] = _graph(code, None)
    stack = _stack()
    if not stack:
        for watch in list(_watches.values()):
            watch._ran_outside(graph)
        return
    owner, path = stack[-1]
    if owner in _watches:
        _watches[owner]._ran(graph, path)


def graph_breaks() -> int:
    """Dynamo's graph breaks in this process so far (its ``counters["graph_break"]``)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _jsonable(value: Any) -> Any:
    """A setting's value as JSON (what JSON cannot hold, as its repr)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(key): _jsonable(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [_jsonable(item) for item in value]
        return repr(value)
