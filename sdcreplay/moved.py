"""The import paths of sdcreplay 0.1, when every module sat in one flat folder, keep working.

Users' scripts and our own docs of that time say ``from sdcreplay.faults import
parse_specs`` or ``torchrun ... -m sdcreplay.distributed``; the modules now live
in the stage folders. A finder on ``sys.meta_path`` answers an old name with the
module at its new place (the same module object, so a patch through either name
is one patch), and ``python -m OLD`` runs the new module as ``__main__``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import CodeType, ModuleType

MOVED = {
    "sdcreplay.safeio": "sdcreplay.storage.safeio",
    "sdcreplay.tensorio": "sdcreplay.storage.tensorio",
    "sdcreplay.workloads": "sdcreplay.workload",
    "sdcreplay.workloads.tiny_llama": "sdcreplay.workload.tiny_llama",
    "sdcreplay.workloads.tiny_moe": "sdcreplay.workload.tiny_moe",
    "sdcreplay.digest": "sdcreplay.capture.digest",
    "sdcreplay.signature": "sdcreplay.capture.signature",
    "sdcreplay.collectives": "sdcreplay.capture.collectives",
    "sdcreplay.faults": "sdcreplay.capture.faults",
    "sdcreplay.determinism": "sdcreplay.capture.determinism",
    "sdcreplay.comparable": "sdcreplay.capture.comparable",
    "sdcreplay.snapshot": "sdcreplay.capture.snapshot",
    "sdcreplay.trust": "sdcreplay.bundle.trust",
    "sdcreplay.jobs": "sdcreplay.bundle.jobs",
    "sdcreplay.forensics": "sdcreplay.compare.forensics",
    "sdcreplay.plot": "sdcreplay.compare.plot",
    "sdcreplay.worker": "sdcreplay.replay.worker",
    "sdcreplay.processes": "sdcreplay.replay.processes",
    "sdcreplay.launch": "sdcreplay.replay.launch",
    "sdcreplay.distributed": "sdcreplay.replay.job",
    "sdcreplay.doctor": "sdcreplay.replay.doctor",
    "sdcreplay.recorder": "sdcreplay.recording.recorder",
    "sdcreplay.ring": "sdcreplay.recording.ring",
    "sdcreplay.ops": "sdcreplay.bisect.ops",
    "sdcreplay.operator_case": "sdcreplay.bisect.operator_case",
    "sdcreplay.ticket": "sdcreplay.minimize.ticket",
    "sdcreplay.templates": "sdcreplay.minimize.templates",
    "sdcreplay.render": "sdcreplay.cli.output",
    "sdcreplay.demo": "sdcreplay.cli.demo",
}


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The module ran at its new place already."""

    def get_code(self, fullname: str) -> CodeType:
        """``python -m OLD``: run the new module as ``__main__``."""
        source = (
            f"import runpy\nrunpy.run_module({self.target!r}, run_name='__main__', alter_sys=True)"
        )
        return compile(source, f"<{fullname}, now {self.target}>", "exec")

    def is_package(self, fullname: str) -> bool:
        return False


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


def install() -> None:
    """First on ``sys.meta_path``: below a moved package (``sdcreplay.workloads``) the path
    finder would otherwise load a second copy of a module under its old name."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
