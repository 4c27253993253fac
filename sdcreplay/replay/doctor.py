"""Is this machine and software deterministic enough for replay to be evidence?

Runs one training step of a workload twice on a device from the same state and
RNG, with operator-level capture, and names the first operator whose output
differs between the two runs. A device that cannot reproduce itself cannot be
compared bit for bit with a record.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from ..capture import comparable, determinism
from ..capture.operators import OperatorLog, OperatorMode
from ..devices import torch_device
from ..ledger.identity import identify
from ..storage.tensorio import map_tensors
from ..workload.definition import build_workload

SCHEMA = "sdcreplay.doctor/1"


@dataclass
class DoctorReport:
    """Whether a device reproduced a step bit for bit (``sdcreplay.doctor/1``)."""

    device: str
    workload: str
    runs: int
    operators: int  # operator calls in one run of the step
    reproducible: bool
    first_nondeterministic: dict | None  # the first call whose outputs differed between runs
    problems: list[str]  # deterministic switches that are off
    switches: dict
    environment: dict
    torch: str
    fingerprint: dict
    must_match: dict
    pinned: dict[str, str]

    @property
    def exit_code(self) -> int:
        """A device that cannot reproduce itself is a finding (1), as a divergence is."""
        return 0 if self.reproducible else 1

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **vars(self), "device_id": identify(self.device).id}


def doctor(
    device: str = "cpu",
    workload: str = "builtin:tiny-llama",
    kwargs: dict | None = None,
    runs: int = 2,
) -> DoctorReport:
    """Run one step ``runs`` times from the same state; report the first operator that differs."""
    target = torch_device(device)
    switches = determinism.enable()
    built = build_workload(workload, kwargs or {})
    built.model.to(target)
    model_state = copy.deepcopy(built.model.state_dict())
    optimizer_state = copy.deepcopy(built.optimizer.state_dict())
    rng = determinism.capture_rng(target)
    batch = map_tensors(built.get_batch(0), lambda t: t.to(target))
    logs = []
    for _ in range(runs):
        built.model.load_state_dict(model_state)
        built.optimizer.load_state_dict(optimizer_state)
        determinism.restore_rng(rng, target)
        oplog = OperatorLog()
        with OperatorMode(built.model, built.optimizer, [oplog], step=0):
            built.run_step(batch)
        logs.append(oplog.records)
    first = None
    for later in logs[1:]:
        for mine, theirs in zip(logs[0], later):
            if mine.site.key != theirs.site.key or mine.digests != theirs.digests:
                first = asdict(theirs.site) | {"structure": mine.site.key != theirs.site.key}
                break
        if first is None and len(later) != len(logs[0]):
            first = {"structure": True, "index": min(len(later), len(logs[0]))}
        if first:
            break
    fingerprint = determinism.fingerprint(target)
    problems = []
    if not switches["deterministic_algorithms"]:
        problems.append("torch.use_deterministic_algorithms is off")
    if target.type == "cuda" and not switches["env"].get("CUBLAS_WORKSPACE_CONFIG"):
        problems.append("CUBLAS_WORKSPACE_CONFIG is not set")
    return DoctorReport(
        device=device,
        workload=workload,
        runs=runs,
        operators=len(logs[0]),
        reproducible=first is None,
        first_nondeterministic=first,
        problems=problems,
        switches=switches,
        environment=determinism.environment(target),
        torch=torch.__version__,
        fingerprint=fingerprint,
        must_match=comparable.must_match(fingerprint),
        pinned=comparable.pinned_environment(fingerprint),
    )
