"""One operator call, its inputs and outputs on two devices: what bisect hands minimize.

``operator.h5`` in a bisect report holds the call's site (where and when it
ran in the step), how many calls of each kind came before it in that step (so
a fault spec's ``nth`` finds the same call when it is re-run alone), the
reference device's inputs and outputs and the suspect's. Everything is plain
HDF5 (see tensorio), readable without sdcreplay.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import h5py
import torch

from ..capture.operators import CallSite
from ..errors import ReportError
from ..storage import tensorio
from ..storage.tensorio import map_tensors

OPERATOR_FILE = "operator.h5"


@dataclass
class OperatorCase:
    site: CallSite
    prior: Counter  # (op, module, phase) -> calls before this one in the step
    args: tuple  # the reference device's inputs, on the CPU
    kwargs: dict
    expected: Any  # the reference device's outputs
    actual: Any  # the suspect device's outputs in the step
    suspect_args: tuple | None = None
    suspect_kwargs: dict | None = None
    rng: dict | None = (
        None  # generator states just before the call (random operators, e.g. dropout)
    )

    @property
    def op(self) -> str:
        return self.site.op

    def write(self, path: Path) -> None:
        with h5py.File(path, "w") as handle:
            handle.attrs["site"] = json.dumps(asdict(self.site))
            handle.attrs["prior"] = json.dumps([[*key, count] for key, count in self.prior.items()])
            tensorio.write_tree(
                handle.create_group("reference_inputs"),
                {"args": list(self.args), "kwargs": self.kwargs},
            )
            tensorio.write_tree(handle.create_group("reference_outputs"), self.expected)
            tensorio.write_tree(handle.create_group("suspect_outputs"), self.actual)
            if self.rng is not None:
                tensorio.write_tree(handle.create_group("rng"), self.rng)
            if self.suspect_args is not None:
                tensorio.write_tree(
                    handle.create_group("suspect_inputs"),
                    {"args": list(self.suspect_args), "kwargs": self.suspect_kwargs or {}},
                )

    @classmethod
    def read(cls, path: Path) -> OperatorCase:
        try:
            with h5py.File(path, "r") as handle:
                site = CallSite(**json.loads(handle.attrs["site"]))
                prior = Counter(
                    {
                        (op, module, phase): count
                        for op, module, phase, count in json.loads(handle.attrs["prior"])
                    }
                )
                inputs = tensorio.read_tree(handle["reference_inputs"], keep_strides=True)
                suspect = (
                    tensorio.read_tree(handle["suspect_inputs"], keep_strides=True)
                    if "suspect_inputs" in handle
                    else None
                )
                return cls(
                    site=site,
                    prior=prior,
                    args=tuple(inputs["args"]),
                    kwargs=inputs["kwargs"],
                    expected=tensorio.read_tree(handle["reference_outputs"]),
                    actual=tensorio.read_tree(handle["suspect_outputs"]),
                    suspect_args=tuple(suspect["args"]) if suspect else None,
                    suspect_kwargs=suspect["kwargs"] if suspect else None,
                    rng=tensorio.read_tree(handle["rng"]) if "rng" in handle else None,
                )
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ReportError(f"cannot read operator case {path}: {exc}") from exc


def resolve_op(name: str):
    """``aten.mm.default`` -> ``torch.ops.aten.mm.default``."""
    namespace, _, rest = name.partition(".")
    packet_name, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet_name), overload)
    except (AttributeError, RuntimeError) as exc:
        raise ReportError(
            f"this torch has no operator {name!r}",
            "Run minimize with the torch version the report was made with.",
        ) from exc


def place(tree: Any, device: torch.device) -> Any:
    """Fresh copies of the inputs on ``device`` (devices named in arguments follow)."""

    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, copy=True)
        if isinstance(value, torch.device):
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(move(item) for item in value)
        if isinstance(value, dict):
            return {key: move(item) for key, item in value.items()}
        return value

    return move(tree)


def to_cpu(tree: Any) -> Any:
    return map_tensors(tree, lambda t: t.detach().to("cpu", copy=True))
