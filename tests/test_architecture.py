"""The package's import graph has no cycles, its stage folders import only the stages below
them, and only the CLI layer imports typer and rich.

Function-level imports count: a cycle hidden inside a function still ties two
modules' fates together (and shows up as a circular import the day someone
moves it to the top).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sdcreplay"
PRESENTATION = "sdcreplay.cli"

# The stage folders, lowest first: a module may import the ground (the package's own
# top-level modules: errors, kinds, devices, ...) and the folders below its own, never one
# above it, not even inside a function (docs/architecture.md draws the same ladder).
LAYERS = [
    "storage",
    "ledger",
    "workload",
    "capture",
    "bundle",
    "compare",
    "replay",
    "online",
    "recording",
    "bisect",
    "minimize",
    "fleet",
    "integrations",
    "cli",
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every sdcreplay module ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, name, modules) for name, path in files.items()}


def _third_party(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``a -> b -> ... -> a``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return stack[stack.index(child) :] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def module_graph() -> dict[str, set[str]]:
    """The import graph between modules. A package's ``__init__`` only offers names lazily
    (the top one is the public facade), and ``from .bundle import trust`` names the package
    only as the place ``trust`` lives, so packages are left out."""
    graph = import_graph()
    packages = {path.parent for path in PACKAGE.rglob("__init__.py")}
    package_names = {_module_name(path / "__init__.py") for path in packages}
    return {name: deps - package_names for name, deps in graph.items() if name not in package_names}


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(module_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def layer_of(module: str) -> int:
    """0 for the ground, else 1 + the stage folder's place in LAYERS."""
    parts = module.split(".")
    if len(parts) < 3 and not (PACKAGE / parts[-1]).is_dir():
        return 0
    return 1 + LAYERS.index(parts[1])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a stage above the importer's own."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(name)
    )


def test_every_stage_folder_is_on_the_ladder() -> None:
    folders = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert folders == set(LAYERS)


def test_no_stage_imports_a_stage_above_it() -> None:
    assert upward_imports(module_graph()) == []


def test_the_ladder_check_finds_an_upward_import() -> None:
    graph = {"sdcreplay.capture.digest": {"sdcreplay.replay.session", "sdcreplay.errors"}}
    assert upward_imports(graph) == ["sdcreplay.capture.digest -> sdcreplay.replay.session"]
    assert upward_imports({"sdcreplay.replay.session": {"sdcreplay.capture.digest"}}) == []


def test_the_process_layer_knows_no_task() -> None:
    """Replay and bisect name their task functions; the layer that runs them imports neither."""
    graph = module_graph()
    assert graph["sdcreplay.replay.worker"] == {"sdcreplay.errors", "sdcreplay.heartbeat"}
    assert graph["sdcreplay.replay.processes"] == {
        "sdcreplay.capture.environment",  # what a device process inherits: torch-free, no task
        "sdcreplay.errors",
        "sdcreplay.leftovers",
        "sdcreplay.bundle.trust",
        "sdcreplay.replay.worker",
    }


def test_no_module_is_over_six_hundred_lines() -> None:
    """One concern per module; a module that grows past this holds two."""
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > 600
    }
    assert long == {}


def test_only_the_command_line_layer_imports_typer_and_rich() -> None:
    offenders = {
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        if not _module_name(path).startswith(PRESENTATION)
        and _third_party(path) & {"typer", "rich"}
    }
    assert not offenders
