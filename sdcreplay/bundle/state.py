"""The state a recorded step starts from: RNG states, model, optimizer and state objects'
state dicts in HDF5, and checkpoints outside the bundle pinned by their SHA-256.

torch (and tensorio) are imported inside these functions only, where tensors are read or
written, so that `sdcreplay info` runs without torch.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from ..errors import BundleError, CheckpointError
from .manifest import CheckpointState, sha256_file

if TYPE_CHECKING:  # torch, tensorio and RngState are imported where tensors are read or written,
    from ..capture.determinism import RngState  # so that `sdcreplay info` runs without torch


def write_rng(group: h5py.Group, rng: RngState) -> None:
    from ..storage import tensorio

    group.attrs["python"] = rng.python_json()
    numpy_group = group.create_group("numpy")
    kind, keys, pos, has_gauss, cached = rng.numpy
    numpy_group.create_dataset("keys", data=np.asarray(keys, dtype=np.uint32))
    numpy_group.attrs["kind"] = kind
    numpy_group.attrs["pos"] = int(pos)
    numpy_group.attrs["has_gauss"] = int(has_gauss)
    numpy_group.attrs["cached_gaussian"] = float(cached)
    tensorio.write_tensor(group, "cpu", rng.cpu)
    if rng.accelerator is not None:
        tensorio.write_tensor(group, "accelerator", rng.accelerator)


def read_rng(group: h5py.Group) -> RngState:
    from ..capture.determinism import RngState
    from ..storage import tensorio

    try:
        numpy_group = group["numpy"]
        numpy_state = (
            str(numpy_group.attrs["kind"]),
            np.asarray(numpy_group["keys"][()], dtype=np.uint32),
            int(numpy_group.attrs["pos"]),
            int(numpy_group.attrs["has_gauss"]),
            float(numpy_group.attrs["cached_gaussian"]),
        )
        state = RngState(
            python=RngState.python_from_json(group.attrs["python"]),
            numpy=numpy_state,
            cpu=tensorio.read_tensor(group["cpu"]),
            accelerator=tensorio.read_tensor(group["accelerator"])
            if "accelerator" in group
            else None,
        )
    except (KeyError, ValueError, TypeError, OverflowError) as exc:
        raise BundleError(f"RNG state in {group.file.filename} is damaged: {exc}") from exc
    _check_rng(state, group.file.filename)
    return state


def _check_rng(state: RngState, filename: str) -> None:
    """Load the state into throwaway generators: a state of the wrong size or type is refused here,
    with the file named, instead of failing inside the step."""
    import torch

    try:
        random.Random().setstate(state.python)
        np.random.RandomState().set_state(state.numpy)
        torch.Generator().set_state(state.cpu)
        accelerator = state.accelerator
        if accelerator is not None and (accelerator.dtype != torch.uint8 or accelerator.dim() != 1):
            raise ValueError(
                f"the accelerator state is {accelerator.dtype} of shape "
                f"{list(accelerator.shape)}, expected a 1-D uint8 tensor"
            )
    except (ValueError, TypeError, RuntimeError, OverflowError, IndexError) as exc:
        raise BundleError(
            f"RNG state in {filename} is invalid: {str(exc).splitlines()[0][:200]}",
            "The bundle was damaged or edited; record it again or restore a copy.",
        ) from exc


def write_state(
    path: Path,
    model_state: dict | None,
    optimizer_state: dict | None,
    objects: dict[str, Any] | None = None,
) -> None:
    """Model, optimizer and named state objects' state dicts (a checkpoint bundle: objects only)."""
    from ..storage import tensorio

    with h5py.File(path, "w") as handle:
        if model_state is not None:
            tensorio.write_tree(handle.create_group("model"), model_state)
        if optimizer_state is not None:
            tensorio.write_tree(handle.create_group("optimizer"), optimizer_state)
        for name, state in (objects or {}).items():
            tensorio.write_tree(handle.require_group("objects").create_group(name), state)


def checkpoint_reference(path: Path) -> CheckpointState:
    path = Path(path).resolve()
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return CheckpointState(path=str(path), size=path.stat().st_size, sha256=sha256_file(path))


def verify_checkpoint(reference: CheckpointState) -> Path:
    """Refuse a checkpoint that is missing or whose SHA-256 changed since the recording."""
    path = Path(reference.path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} referenced by the bundle does not exist",
            "Restore the checkpoint at that path (the bundle holds its SHA-256 to check it).",
        )
    size = path.stat().st_size
    if reference.size is not None and size != reference.size:
        raise CheckpointError(
            f"checkpoint {path} changed since the recording "
            f"({size} bytes, recorded {reference.size})",
            "Replay needs the exact checkpoint the step was recorded from; restore it from backup.",
        )
    actual = sha256_file(path)
    if actual != reference.sha256:
        raise CheckpointError(
            f"checkpoint {path} changed since the recording (SHA-256 {actual[:16]}..., "
            f"recorded {reference.sha256[:16]}...)",
            "Replay needs the exact checkpoint the step was recorded from; restore it from backup.",
        )
    return path


def load_checkpoint(reference: CheckpointState) -> tuple[dict, dict | None]:
    """Verify the checkpoint is the recorded one, then load it without pickle."""
    import torch

    path = verify_checkpoint(reference)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from exc
    if isinstance(obj, dict) and "model" in obj:
        return obj["model"], obj.get("optimizer")
    return obj, None
