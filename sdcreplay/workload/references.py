"""How a workload is named: ``builtin:NAME``, ``pkg.mod:fn``, ``path/file.py:fn``; the form a
bundle stores, and a built-in factory's defaults.

Torch-free, and nothing here imports or runs a workload's module (it is only located, or a
built-in's source read): the command's process names, stores and compares workloads that only
its device processes build (`definition.build_workload`).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import site
import sys
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import WorkloadError

BUILTIN_WORKLOADS = {
    "tiny-llama": "sdcreplay.workload.tiny_llama:make_workload",
    "tiny-moe": "sdcreplay.workload.tiny_moe:make_workload",
}
"""``builtin:NAME`` -> the factory's reference: built-ins are named like any workload, so
this module never imports them (they import `Workload` from here)."""


def builtin_names() -> list[str]:
    return sorted(BUILTIN_WORKLOADS)


def builtin_defaults(ref: str) -> dict[str, Any]:
    """The keyword arguments a built-in factory (``builtin:NAME``) fills in by default, read
    from its source: the factory's module imports torch, which comparing two logs needs not.
    Defaults that are not literals are left out, and an unknown name has none."""
    target = BUILTIN_WORKLOADS.get(ref.removeprefix("builtin:"))
    if target is None:
        return {}
    module, _, name = target.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return {}
    tree = ast.parse(Path(spec.origin).read_text())
    function = next(
        (node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name),
        None,
    )
    if function is None:
        return {}
    arguments = function.args
    named = [*arguments.posonlyargs, *arguments.args]
    pairs = [*zip(named[len(named) - len(arguments.defaults) :], arguments.defaults)]
    pairs += [
        (argument, default)
        for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults)
        if default is not None
    ]
    found = {}
    for argument, default in pairs:
        try:
            found[argument.arg] = ast.literal_eval(default)
        except ValueError:
            continue
    return found


def canonical_ref(ref: str) -> str:
    """The reference as a bundle stores it: one a fresh process in any directory resolves.

    ``path/file.py:fn`` gets an absolute path. ``module:fn`` for a single-file module found
    only through this process's directory or its script's (``python mytrain.py`` naming
    ``mytrain:make_workload``) becomes that file, ``/abs/dir/mytrain.py:fn``: a replay,
    started elsewhere without that directory on its path, could not import it. Anything else
    is kept as given (`recorded_ref` refuses what a replay could never import). Nothing is
    imported or run: the module is only located.
    """
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr or ref.startswith("builtin:"):
        return ref
    if target.endswith(".py"):
        return f"{Path(target).resolve()}:{attr}"
    found = _located(target)
    if found is not None and found.only_here and not found.package and "." not in target:
        return f"{found.origin}:{attr}"
    return ref


def recorded_ref(ref: str) -> str:
    """`canonical_ref`, refused (WorkloadError) when a replay could not import it: a module
    this process cannot find, or a package reachable only through this directory."""
    stored = canonical_ref(ref)
    target, sep, attr = stored.rpartition(":")
    if not sep or stored.startswith("builtin:") or target.endswith(".py"):
        return stored
    found = _located(target)
    file_hint = "Name the factory by its file instead, e.g. path/to/train.py:make_workload."
    if found is None:
        raise WorkloadError(
            f"workload {ref!r}: no module {target!r} can be found, so no replay could import it",
            f"Check the spelling and that it is importable here. {file_hint}",
        )
    if found.only_here:
        top = target.split(".")[0]
        raise WorkloadError(
            f"workload {ref!r}: package {top!r} is found only through this directory "
            f"({found.entry}), so a replay started elsewhere could not import it",
            f"Install it (pip install -e .), or put its directory on PYTHONPATH for the "
            f"recording and every replay. {file_hint}",
        )
    return stored


class _Location(NamedTuple):
    origin: Path  # the module's file, or its package's __init__.py (or directory)
    entry: Path  # the directory on sys.path it is found through
    package: bool
    only_here: bool  # found only through this process's directory or its script's


def _located(target: str) -> _Location | None:
    """Where the top-level module of ``target`` lives; None when it cannot be found. The
    module is located, not imported (its code does not run)."""
    top = target.split(".")[0]
    loaded = sys.modules.get(top)
    try:
        spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    package = spec.submodule_search_locations is not None
    if spec.origin and spec.has_location:
        origin = Path(spec.origin).resolve()
    elif package:
        origin = Path(next(iter(spec.submodule_search_locations or []), ".")).resolve()
    else:
        return None  # built into the interpreter or frozen: every process has it
    entry = origin.parent.parent if package and origin.suffix == ".py" else origin.parent
    return _Location(origin, entry, package, _only_here(entry))


def _only_here(entry: Path) -> bool:
    """Is ``entry`` on the path only because of where this process runs (its current
    directory, its script's directory), not for every process (PYTHONPATH, site-packages)?"""
    here = {Path.cwd().resolve()}
    script = sys.argv[0] if sys.argv else ""
    if script and Path(script).is_file():
        here.add(Path(script).resolve().parent)
    if entry not in here:
        return False
    lasting = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    lasting += [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    return not any(os.path.isabs(p) and Path(p).resolve() == entry for p in lasting)
