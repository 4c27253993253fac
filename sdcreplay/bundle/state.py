"""The state a recorded step starts from: RNG states, model, optimizer and state objects'
state dicts in HDF5 (checkpoints outside the bundle: checkpoints.py).

torch (and tensorio) are imported inside these functions only, where tensors are read or
written, so that `sdcreplay info` runs without torch.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BundleError

if TYPE_CHECKING:  # torch, h5py, tensorio and RngState: imported where tensors are read or
    # written, so that `sdcreplay info`, `diff` and `replay`'s own process load none of them
    import h5py

    from ..capture.determinism import RngState


def write_rng(group: h5py.Group, rng: RngState) -> None:
    import numpy as np

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
    import numpy as np

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
    import numpy as np
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
    import h5py

    from ..storage import tensorio

    with h5py.File(path, "w") as handle:
        if model_state is not None:
            tensorio.write_tree(handle.create_group("model"), model_state)
        if optimizer_state is not None:
            tensorio.write_tree(handle.create_group("optimizer"), optimizer_state)
        for name, state in (objects or {}).items():
            tensorio.write_tree(handle.require_group("objects").create_group(name), state)
