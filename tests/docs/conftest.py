"""The docs' runs take minutes (tests/docs/test_docs.py): the ones the chosen tests need start
as soon as the suite has chosen them, and run beside the tests before them (each run is mostly
one process at a time, and so are most other tests, on a machine of two cores or more)."""

from __future__ import annotations

import doccheck
import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    wanted: dict[object, set[str]] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        needed = getattr(module, "run_needed", None)
        if needed is not None and (name := needed(item)) is not None:
            wanted.setdefault(module, set()).add(name)
    for module, names in wanted.items():
        module.start_runs(names)  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    doccheck.stop_runs()
