"""What a Recorder is given, checked, and the settings of every bundle it writes (kept out of
recorder.py, whose Recorder only records)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..bundle.checkpoints import load_checkpoint
from ..bundle.manifest import CaptureSettings, CheckpointState, Environment, Switches, WorkloadRef
from ..capture import determinism
from ..capture.digest import algorithm_for
from ..errors import CheckpointError, SdcReplayError, WorkloadError
from ..kinds import SIGNATURE_LEVELS
from ..workload.loop_objects import loop_model, loop_optimizer

VERIFY_MODES = {True: "on", "warn": "warn", False: "off"}


def check_options(
    verify: Any, ring: int | None, checkpoint: str | Path | None, max_window: int, signature: Any
) -> None:
    if verify not in VERIFY_MODES:
        raise SdcReplayError(f"verify={verify!r} is not one of True, 'warn', False")
    _check_ring(ring, checkpoint, max_window)
    if signature not in SIGNATURE_LEVELS:
        raise SdcReplayError(
            f"signature={signature!r} is not one of {', '.join(SIGNATURE_LEVELS)}",
            "Record with signature='layer' (every module) or 'boundary' (production).",
        )


def loop_objects(
    path: Any = None,
    workload: Any = None,
    model: Any = None,
    optimizer: Any = None,
    **_: Any,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer a Recorder is given, by position or by name, as the one module
    and torch optimizer it records (model parts, optimizer wrappers, containers and lists
    taken: workload/loop_objects.py); what it cannot take is refused here, as it is created."""
    if model is None or optimizer is None:
        raise SdcReplayError(
            "a Recorder needs the loop's model and optimizer",
            "Recorder(path, model=model, optimizer=optimizer, state={...}).",
        )
    model = loop_model(model)
    if next(model.parameters(), None) is None:
        raise WorkloadError(
            f"Recorder: model={type(model).__name__} has no parameters",
            "Pass the module the loop trains, after it is built (and wrapped).",
        )
    return model, loop_optimizer(optimizer)


def bundle_settings(
    workload_ref: WorkloadRef,
    label: str,
    device: torch.device,
    switches: dict,
    capture: CaptureSettings,
    **more: Any,
) -> dict[str, Any]:
    """BundleWriter's settings, for every bundle a Recorder writes."""
    return dict(
        workload=workload_ref,
        device=label,
        device_type=device.type,
        digest=algorithm_for(device.type),
        environment=Environment(**determinism.environment(device)),
        determinism=Switches(**switches),
        fingerprint=determinism.fingerprint(device),
        capture=capture,
        **more,
    )


def _check_ring(ring: int | None, checkpoint: str | Path | None, max_window: int) -> None:
    if ring is None:
        return
    if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
        raise SdcReplayError(
            f"ring={ring!r} is not a number of steps", "Pass ring=K with K >= 1, or no ring."
        )
    if isinstance(max_window, bool) or not isinstance(max_window, int) or max_window < ring:
        raise SdcReplayError(
            f"max_window={max_window!r} is not a number of steps of at least ring={ring}",
            "Pass max_window=W >= K: the most steps a window since a checkpoint holds.",
        )
    if checkpoint is not None:
        raise SdcReplayError(
            "a ring buffer's bundle starts from the state at its window's start, not from the "
            "checkpoint the loop started from",
            "Drop checkpoint= with ring=, and call recorder.checkpoint_saved(path) after each "
            "checkpoint the loop saves: the ring's window then starts there.",
        )


def check_model_matches_checkpoint(model: torch.nn.Module, reference: CheckpointState) -> None:
    model_state, _ = load_checkpoint(reference)
    for name, tensor in model.state_dict().items():
        saved = model_state.get(name)
        if saved is None or not torch.equal(saved, tensor.detach().cpu()):
            raise CheckpointError(
                f"the model's {name} differs from checkpoint {reference.path}",
                "Load the checkpoint into the model (and optimizer) before creating the Recorder.",
            )
