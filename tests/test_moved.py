"""The import paths of 0.1's flat layout, as the docs of that time gave them, keep working."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from conftest import REPO

from sdcreplay.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_module_name_is_the_module_at_its_new_place(old: str):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_the_documented_old_names_resolve():
    from sdcreplay.determinism import enable
    from sdcreplay.digest import tensor_digest
    from sdcreplay.faults import FaultSpec, Injector, parse_specs
    from sdcreplay.operator_case import OperatorCase
    from sdcreplay.ops import list_calls
    from sdcreplay.trust import granting

    assert all(
        callable(name)
        for name in (enable, tensor_digest, parse_specs, list_calls, granting, FaultSpec, Injector)
    )
    assert OperatorCase.read
    import sdcreplay.capture as capture

    assert capture.OperatorMode.__module__ == "sdcreplay.capture.operators"


@pytest.mark.parametrize(
    ("old", "usage"),
    [
        ("sdcreplay.distributed", "usage: python -m sdcreplay.distributed JOB LOGS"),
        ("sdcreplay.worker", "usage: python -m sdcreplay.worker TASK.json"),
    ],
)
def test_python_dash_m_old_name_runs_the_new_module(old: str, usage: str):
    done = subprocess.run(
        [sys.executable, "-m", old], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert usage in done.stderr
