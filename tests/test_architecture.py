"""The package's import graph has no cycles and only the CLI layer imports typer and rich.

Function-level imports count: a cycle hidden inside a function still ties two
modules' fates together (and shows up as a circular import the day someone
moves it to the top).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sdcreplay"
PRESENTATION = {"sdcreplay.cli", "sdcreplay.render"}


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
    """The import graph between modules: the package __init__ re-exports the library, and
    ``from . import x`` names it only as the place x lives."""
    return {name: deps - {"sdcreplay"} for name, deps in import_graph().items()}


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(module_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_process_layer_knows_no_task() -> None:
    """Replay and bisect name their task functions; the layer that runs them imports neither."""
    graph = module_graph()
    assert graph["sdcreplay.worker"] == {"sdcreplay.errors"}
    assert graph["sdcreplay.processes"] == {
        "sdcreplay.errors",
        "sdcreplay.trust",
        "sdcreplay.worker",
    }


def test_only_the_command_line_layer_imports_typer_and_rich() -> None:
    offenders = {
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        if _module_name(path) not in PRESENTATION and _third_party(path) & {"typer", "rich"}
    }
    assert not offenders
