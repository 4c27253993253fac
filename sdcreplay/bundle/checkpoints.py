"""Checkpoints outside the bundle: what a reference pins, and how each kind is loaded.

A bundle may start from a checkpoint the job wrote itself instead of a copy of the state: a
``torch.save`` file (``{"model", "optimizer"}``, a bare model state dict, or a Lightning
checkpoint's ``state_dict`` and ``optimizer_states``), a Hugging Face ``Trainer`` checkpoint
directory (its weights and ``optimizer.pt``), or a ``torch.distributed.checkpoint``
directory. The reference holds the SHA-256 of every file replay reads (a directory's:
of their listing), checked before every load; nothing is unpickled (``torch.load`` with
``weights_only=True``, safetensors, and DCP's metadata through torch's weights-only
unpickler).

torch is imported inside these functions only, where tensors are read.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .manifest import CheckpointState, FileMeta, sha256_file

HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
HF_OPTIMIZER = "optimizer.pt"
DCP_METADATA = ".metadata"
MAX_INDEX_BYTES = 64 << 20

RESTORE_HINT = (
    "Replay needs the exact checkpoint the window started from; restore it from backup (a "
    "job that overwrites or rotates its checkpoints must keep the one a bundle refers to)."
)


def checkpoint_format(path: Path) -> str:
    """``torch`` (a file), ``hf`` (a Trainer checkpoint directory) or ``dcp`` (a
    torch.distributed.checkpoint directory); refused otherwise, with what was expected."""
    if path.is_file():
        return "torch"
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} does not exist",
            "Pass the path the checkpoint was just saved at (a torch.save file, a Trainer "
            "checkpoint directory or a torch.distributed.checkpoint directory).",
        )
    if (path / DCP_METADATA).is_file():
        return "dcp"
    if any((path / name).is_file() for name in HF_WEIGHTS + HF_INDEXES):
        return "hf"
    raise CheckpointError(
        f"checkpoint directory {path} is neither a Hugging Face Trainer checkpoint (no "
        f"{' or '.join(HF_WEIGHTS)}) nor a torch.distributed.checkpoint ({DCP_METADATA} missing)",
        "Pass the checkpoint's own directory (checkpoint-N/), or a torch.save file.",
    )


def checkpoint_reference(path: Path) -> CheckpointState:
    """Pin the checkpoint at ``path`` as it is now: its SHA-256 (a directory: every file replay
    reads, each with its own, and the SHA-256 of that listing)."""
    path = Path(path).resolve()
    kind = checkpoint_format(path)
    if kind == "torch":
        return CheckpointState(
            path=str(path),
            size=path.stat().st_size,
            sha256=sha256_file(path),
            absent=frozenset({"format", "files"}),  # a torch.save file, as ever
        )
    files = {name: _file_meta(path, name) for name in _pinned_files(path, kind)}
    return CheckpointState(
        path=str(path),
        size=sum(meta.size for meta in files.values()),
        sha256=listing_digest(files),
        format=kind,
        files=files,
    )


def listing_digest(files: dict[str, FileMeta]) -> str:
    """SHA-256 of a directory checkpoint's files: a line ``NAME SIZE SHA256`` per file, sorted."""
    lines = "".join(f"{name} {meta.size} {meta.sha256}\n" for name, meta in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def _file_meta(root: Path, name: str) -> FileMeta:
    file = _regular_file(root, name)
    return FileMeta(size=file.stat().st_size, sha256=sha256_file(file))


def _regular_file(root: Path, name: str) -> Path:
    """``root/name``, a regular file, no symlink below ``root``: a checkpoint holds its own."""
    file = root / name
    try:
        mode = os.lstat(file).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {root} has no {name} any more", RESTORE_HINT) from None
    if not stat.S_ISREG(mode) or Path(os.path.realpath(file)).parent != Path(
        os.path.realpath(root)
    ):
        raise CheckpointError(f"{name} in checkpoint {root} is not a regular file of it")
    return file


def _pinned_files(root: Path, kind: str) -> list[str]:
    """The files replay reads from a directory checkpoint."""
    if kind == "dcp":
        return sorted(
            entry.name
            for entry in root.iterdir()
            if entry.name == DCP_METADATA or entry.name.endswith(".distcp")
        )
    index = next((name for name in HF_INDEXES if (root / name).is_file()), None)
    if index is not None:
        weights = sorted(set(_hf_index(root, index).values()))
        names = [index, *weights]
    else:
        names = [next(name for name in HF_WEIGHTS if (root / name).is_file())]
    return names + ([HF_OPTIMIZER] if (root / HF_OPTIMIZER).is_file() else [])


def _hf_index(root: Path, index: str) -> dict[str, str]:
    """A sharded checkpoint's ``weight_map``: parameter name -> shard file (a plain name)."""
    try:
        document = json.loads(_regular_file(root, index).read_bytes()[:MAX_INDEX_BYTES])
        weight_map = document["weight_map"]
        assert isinstance(weight_map, dict)
        assert all(isinstance(v, str) and "/" not in v and v != ".." for v in weight_map.values())
        return weight_map
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise CheckpointError(f"{index} in checkpoint {root} is malformed: {exc!r}") from exc


def verify_checkpoint(reference: CheckpointState) -> Path:
    """Refuse a checkpoint that is missing or whose SHA-256 changed since it was referenced
    (a directory: naming the file that changed)."""
    path = Path(reference.path)
    if reference.files is None:
        _verify_file(path, FileMeta(size=reference.size or 0, sha256=reference.sha256), reference)
        return path
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} referenced by the bundle does not exist", RESTORE_HINT
        )
    for name, meta in sorted(reference.files.items()):
        _verify_file(_regular_file(path, name), meta, reference, name)
    if listing_digest(reference.files) != reference.sha256:
        raise CheckpointError(
            f"the reference to checkpoint {path} does not match its own file list",
            "The bundle was edited; record it again.",
        )
    return path


def _verify_file(
    file: Path, meta: FileMeta, reference: CheckpointState, name: str | None = None
) -> None:
    what = f"checkpoint {reference.path}" + (f": {name}" if name else "")
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {file} referenced by the bundle does not exist",
            "Restore the checkpoint at that path (the bundle holds its SHA-256 to check it).",
        )
    size = file.stat().st_size
    known = reference.size if name is None else meta.size
    if known is not None and size != known:
        raise CheckpointError(
            f"{what} changed since the recording ({size} bytes, recorded {known})", RESTORE_HINT
        )
    actual = sha256_file(file)
    if actual != meta.sha256:
        raise CheckpointError(
            f"{what} changed since the recording (SHA-256 {actual[:16]}..., "
            f"recorded {meta.sha256[:16]}...)",
            RESTORE_HINT,
        )


def load_checkpoint(reference: CheckpointState) -> tuple[dict, dict | None]:
    """Verify the checkpoint is the referenced one, then load its model and optimizer state
    without pickle."""
    path = verify_checkpoint(reference)
    kind = reference.format or "torch"
    try:
        if kind == "hf":
            return _load_hf(path, reference)
        if kind == "dcp":
            return _load_dcp(path)
        return _load_torch_file(path)
    except CheckpointError:
        raise
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:300]
        raise CheckpointError(f"cannot load checkpoint {path}: {first}") from exc


def _torch_load(file: Path) -> Any:
    import torch

    return torch.load(file, map_location="cpu", weights_only=True)


def _load_torch_file(path: Path) -> tuple[dict, dict | None]:
    obj = _torch_load(path)
    if isinstance(obj, dict) and "model" in obj:
        return obj["model"], obj.get("optimizer")
    if isinstance(obj, dict) and "state_dict" in obj and "optimizer_states" in obj:  # Lightning
        optimizers = obj["optimizer_states"]
        return obj["state_dict"], optimizers[0] if optimizers else None
    return obj, None


def _load_hf(path: Path, reference: CheckpointState) -> tuple[dict, dict | None]:
    files = reference.files or {}
    model: dict = {}
    for name in files:
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            model.update(load_file(str(path / name), device="cpu"))
        elif name.endswith(".bin"):
            model.update(_torch_load(path / name))
    optimizer = _torch_load(path / HF_OPTIMIZER) if HF_OPTIMIZER in files else None
    return model, optimizer


def _load_dcp(path: Path) -> tuple[dict, dict | None]:
    """A torch.distributed.checkpoint written in one process of ``{"model": state_dict,
    "optimizer": state_dict}`` (or of a model state dict alone), read into plain tensors."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader_type, planner_type = _weights_only_dcp()
    state: dict = {}
    try:
        _load_state_dict(
            state, storage_reader=reader_type(str(path)), planner=planner_type(), no_dist=True
        )
    except CheckpointException as exc:  # a BaseException, holding each rank's failure
        failures = [str(failure) for failure in getattr(exc, "failures", {}).values()]
        first = failures[0].strip().splitlines()[-1] if failures else str(exc)
        raise CheckpointError(f"cannot load checkpoint {path}: {first[:300]}") from None
    if "model" in state:
        return state["model"], _integer_keys(state.get("optimizer"))
    return state, None


def _integer_keys(optimizer: dict | None) -> dict | None:
    """DCP keeps a dict's keys as strings: an optimizer's per-parameter state is keyed by the
    integers its param groups list (load_state_dict would silently drop "0", "1"...)."""
    if optimizer is None or not isinstance(optimizer.get("state"), dict):
        return optimizer
    state = {
        int(k) if isinstance(k, str) and k.isdigit() else k: v
        for k, v in optimizer["state"].items()
    }
    return {**optimizer, "state": state}


def _weights_only_dcp() -> tuple[type, type]:
    """DCP's file reader and its planner that loads a whole checkpoint, with what they unpickle
    read safely: the pickled ``.metadata`` by an unpickler that admits DCP's metadata types,
    torch's sizes, dtypes and layouts and paths only (no other callable), non-tensor values
    (saved with torch.save) with ``weights_only=True``."""
    import pickle

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = _ALLOWED_DCP_GLOBALS.get((module, name))
            if found is not None:
                return found()
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if module == dcp_metadata.__name__ and isinstance(vars(dcp_metadata).get(name), type):
                return vars(dcp_metadata)[name]
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")

    class WeightsOnlyReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(Path(str(self.path)) / DCP_METADATA, "rb") as handle:
                loaded = MetadataUnpickler(handle).load()
            if not isinstance(loaded, dcp_metadata.Metadata):
                raise CheckpointError(f"{DCP_METADATA} of checkpoint {self.path} holds no Metadata")
            storage = getattr(loaded, "storage_meta", None) or dcp_metadata.StorageMeta()
            storage.load_id = self.load_id
            loaded.storage_meta = storage
            return loaded

    class WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                mapping = self.mappings[read_item.dest_index.fqn]
                set_element(self.original_state_dict, mapping, loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    _ALLOWED_DCP_GLOBALS.setdefault(
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), lambda: _StorageInfo
    )
    return WeightsOnlyReader, WeightsOnlyPlanner


def _layout_getter() -> Any:
    import torch.serialization

    return torch.serialization._get_layout  # a layout by its name, from torch's own table


def _size() -> Any:
    import torch

    return torch.Size


def _posix_path() -> Any:
    import pathlib

    return pathlib.PosixPath


_ALLOWED_DCP_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout_getter,
    ("pathlib", "PosixPath"): _posix_path,
}
"""What DCP's metadata may name besides its own types and torch's dtypes, made on demand."""
