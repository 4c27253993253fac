"""What the kept values say once the device runs are back: the divergent call's first wrong
output and its bits, whether the suspect's inputs matched the reference's (which tells a wrong
kernel from a wrong input), where a wrong input came from and when it went wrong, and how the
state entering the step differed.

These compare tensors the device processes already wrote, so they run in the driver, on no
device; `localize.py` turns them into the verdict and the report.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import torch

from ..compare.forensics import element_forensics, words
from ..storage.tensorio import read_tensor
from .operator_case import OperatorCase


def trees_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(words(a), words(b))
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(trees_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(trees_equal(a[k], b[k]) for k in a)
    return a == b


def _input_at(args: tuple, origin: dict):
    value = args[origin["position"]]
    return value if origin["element"] is None else value[origin["element"]]


def upstream(case: OperatorCase, origins: list[dict], state_differs: list[str]) -> dict | None:
    """The first input of the call that differed, where it came from, and when it went wrong.

    Every call before the first divergent one matched the reference, so a
    wrong input whose producer's output matched when produced, whose state
    tensor entered the step right, or that no call of the step wrote (an input
    of the step: the recorded batch, or a tensor made before the step, the same
    on both devices) was corrupted *at rest*, in memory between the write and
    this read. An input that was state which already differed entering the
    step is the ``state`` evidence instead.
    """
    suspect_args = case.suspect_args
    if suspect_args is None:
        return None
    differing = [
        o for o in origins if not trees_equal(_input_at(case.args, o), _input_at(suspect_args, o))
    ]
    if not differing:
        return None
    first, site = differing[0], case.site
    producer, state = first["producer"], first["state"]
    reader = {"index": site.index, "op": site.op, "module": site.module, "phase": site.phase}
    if producer:
        at_rest = bool(producer["matched_reference"])
    else:
        at_rest = state is None or state not in state_differs
    element = "" if first["element"] is None else f"[{first['element']}]"
    read = (
        f"call {site.index} ({site.op} under {site.module}, {site.phase}) read it wrong "
        f"as input {first['position']}{element} ({first['name']})"
    )
    if producer:
        how = "right" if producer["matched_reference"] else "wrong"
        made = (
            f"call {producer['index']} ({producer['op']} under {producer['module']}, "
            f"{producer['phase']}) produced it {how}"
        )
    else:
        how = "right" if at_rest else "already wrong"
        made = (
            f"it entered the step as {state}, {how}"
            if state
            else "it entered the step as one of its inputs, right (no operator call of the step "
            "wrote it: the recorded batch, or a tensor made before the step)"
        )
    summary = f"{'memory corrupted at rest: ' if at_rest else ''}{made}; {read}"
    forensics = element_forensics(_input_at(case.args, first), _input_at(suspect_args, first))
    evidence = (
        "count", "total", "indices", "positions", "xor", "bits", "pattern", "fault_model", "view",
    )  # fmt: skip
    return {
        "at_rest": at_rest,
        "summary": summary,
        "input": {key: first[key] for key in ("position", "element", "name")},
        "producer": producer,
        "state": state,
        "reader": reader,
        "inputs_differ": [
            o["name"] + ("" if o["element"] is None else f"[{o['element']}]") for o in differing
        ],
        "elements": {k: forensics.get(k) for k in evidence},
    }


ELEMENT_KEYS = (
    "count", "total", "indices", "positions", "xor", "expected", "actual", "max_abs_diff",
    "max_rel_diff", "dtype", "shape", "view",
)  # fmt: skip
"""What a report's ``elements`` holds of an output's forensics."""


def output_findings(forensics: dict) -> dict:
    """The report's keys for the first differing output's forensics: elements, bits, pattern,
    fault model (an operator's and a compiled kernel's alike)."""
    return {
        "elements": {key: forensics.get(key) for key in ELEMENT_KEYS},
        "bits": forensics.get("bits"),
        "pattern": forensics.get("pattern"),
        "fault_model": forensics.get("fault_model"),
    }


def first_differing_output(case: OperatorCase) -> tuple[int, dict]:
    expected = [v for v in case.expected if isinstance(v, torch.Tensor)]
    actual = [v for v in case.actual if isinstance(v, torch.Tensor)]
    for index, (e, a) in enumerate(zip(expected, actual)):
        report = element_forensics(e, a)
        if report.get("count") != 0:
            return index, report
    return 0, {"count": 0}


def state_forensics(work: Path, suspect: str, names: list[str]) -> list[dict]:
    if not names:
        return []
    found = []
    with (
        h5py.File(work / f"state-{suspect.replace(':', '-')}.h5") as mine,
        h5py.File(work / "state-reference.h5") as theirs,
    ):
        for name in names:
            key = name.replace("/", "|")
            report = element_forensics(read_tensor(theirs[key]), read_tensor(mine[key]))
            found.append(
                {
                    "tensor": name,
                    **{
                        k: report.get(k)
                        for k in (
                            "count",
                            "indices",
                            "positions",
                            "xor",
                            "expected",
                            "actual",
                            "bits",
                            "pattern",
                            "fault_model",
                        )
                    },
                }
            )
    return found
