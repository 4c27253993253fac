"""Is this machine and software deterministic enough for replay to be evidence?

Runs one training step of a workload twice on a device from the same state and
RNG, with operator-level capture, and names the first operator whose output
differs between the two runs. A device that cannot reproduce itself cannot be
compared bit for bit with a record.
"""

from __future__ import annotations

import copy
from dataclasses import asdict

import torch

from . import determinism
from .capture import OperatorLog, OperatorMode
from .devices import torch_device
from .tensorio import map_tensors
from .workload import build_workload

SCHEMA = "sdcreplay.doctor/1"


def doctor(device: str = "cpu", workload: str = "builtin:tiny-llama", kwargs: dict | None = None, runs: int = 2) -> dict:
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
            loss = built.loss_fn(built.model, batch)
            loss.backward()
            built.optimizer.step()
            built.optimizer.zero_grad()
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
    return {
        "schema": SCHEMA,
        "device": device,
        "workload": workload,
        "runs": runs,
        "operators": len(logs[0]),
        "reproducible": first is None,
        "first_nondeterministic": first,
        "problems": problems,
        "switches": switches,
        "environment": determinism.environment(target),
        "torch": torch.__version__,
        "fingerprint": fingerprint,
        "must_match": determinism.must_match(fingerprint),
        "pinned": determinism.pinned_environment(fingerprint),
    }
