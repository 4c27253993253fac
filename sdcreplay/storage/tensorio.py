"""Tensors and nested structures of them in HDF5, without pickle.

Batches, RNG states, model/optimizer state and operator inputs all go through
here, so every file sdcreplay writes can be read with h5py alone: dtypes numpy
knows are stored natively; the others (bfloat16, float8) as same-width integer
words with the torch dtype in an attribute.
"""

from __future__ import annotations

import json
from typing import Any

import h5py
import numpy as np
import torch

from ..errors import BundleError
from .safeio import HDF5_ERRORS, check_json_value, damaged_hdf5

_NATIVE = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
# Other dtypes are stored as unsigned words of their width (readable as bits),
# and read back through the signed numpy type torch can wrap without a copy.
_WORDS = {
    1: (np.uint8, np.uint8),
    2: (np.uint16, np.int16),
    4: (np.uint32, np.int32),
    8: (np.uint64, np.int64),
}


_INTEGER_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage words as integers (a view, no copy): bitwise compare, NaN == NaN,
    -0 != +0."""
    word = _INTEGER_WORDS.get(tensor.element_size())
    return tensor.view(word) if word is not None and tensor.dtype != word else tensor


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BundleError(f"unknown tensor dtype {name!r} in file")
    return dtype


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, without communication; any other tensor itself.

    The shard itself, never ``to_local()`` with grad enabled: that is an autograd function
    (a view and a node), which would run as an operator of the step being captured."""
    shard = getattr(tensor, "_local_tensor", None)
    if isinstance(shard, torch.Tensor):
        return shard
    to_local = getattr(tensor, "to_local", None)
    if to_local is None:
        return tensor
    with torch.no_grad():
        return to_local()


def write_tensor(group: h5py.Group, name: str, tensor: torch.Tensor) -> h5py.Dataset:
    """Store the values in logical order; shape, dtype and strides in attributes. A DTensor
    (FSDP2) is stored as this rank's shard: a job bundle's part holds its rank's data."""
    source = local_shard(tensor).detach()
    flat = source.cpu().contiguous()
    if flat.dtype in _NATIVE:
        data = flat.numpy()
    else:
        stored, signed = _WORDS[flat.element_size()]
        data = flat.view(torch.from_numpy(np.zeros(0, signed)).dtype).numpy().view(stored)
    dataset = group.create_dataset(name, data=data.reshape(tuple(flat.shape)))
    dataset.attrs["dtype"] = dtype_name(flat.dtype)
    dataset.attrs["shape"] = list(flat.shape)
    dataset.attrs["stride"] = list(source.stride())
    return dataset


_STORABLE = tuple(_NATIVE) + tuple(
    dtype
    for dtype in (
        getattr(torch, name, None)
        for name in (
            "bfloat16",
            "uint16",
            "uint32",
            "uint64",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
        )
    )
    if isinstance(dtype, torch.dtype)
)
MAX_DIMS = 64


def _storage_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a tensor of ``dtype`` is stored as."""
    if dtype in _NATIVE:
        return np.dtype(_NATIVE[dtype])
    return np.dtype(_WORDS[torch.empty((), dtype=dtype).element_size()][0])


def _tensor_layout(dataset: h5py.Dataset) -> tuple[torch.dtype, list[int]]:
    """The dtype and shape the attributes declare, checked against what the dataset really holds."""
    name = str(dataset.attrs["dtype"])
    dtype = dtype_from_name(name)
    if dtype not in _STORABLE:
        raise BundleError(
            f"tensor {dataset.name} has dtype {name[:40]!r}, which sdcreplay never stores"
        )
    stored = dataset.dtype
    expected = _storage_dtype(dtype)
    if stored.kind != expected.kind or stored.itemsize != expected.itemsize:
        raise BundleError(
            f"tensor {dataset.name} is stored as HDF5 type {stored}, "
            f"expected {expected} for a {name} tensor"
        )
    shape_attr = np.asarray(dataset.attrs["shape"])
    integers = shape_attr.size == 0 or shape_attr.dtype.kind in "iu"
    if shape_attr.ndim != 1 or shape_attr.size > MAX_DIMS or not integers:
        raise BundleError(
            f"tensor {dataset.name} has a malformed shape attribute {str(shape_attr)[:60]}"
        )
    shape = [int(n) for n in shape_attr]
    if any(n < 0 for n in shape):
        raise BundleError(f"tensor {dataset.name} has a negative dimension in its shape {shape}")
    if dataset.size * stored.itemsize > dataset.file.id.get_filesize():
        raise BundleError(
            f"tensor {dataset.name} declares {dataset.size * stored.itemsize} bytes, "
            "more than its file holds"
        )
    return dtype, shape


def read_tensor(dataset: h5py.Dataset, keep_strides: bool = False) -> torch.Tensor:
    if not isinstance(dataset, h5py.Dataset):
        raise BundleError(f"{dataset.name} is a group where a tensor was expected")
    try:
        dtype, shape = _tensor_layout(dataset)
        data = np.ascontiguousarray(dataset[()])
    except HDF5_ERRORS as exc:
        raise BundleError(
            f"cannot read tensor {dataset.name} of {dataset.file.filename}: {exc}"
        ) from exc
    if dtype in _NATIVE:
        tensor = torch.from_numpy(data.astype(_NATIVE[dtype], copy=False))
    else:
        _, signed = _WORDS[torch.empty((), dtype=dtype).element_size()]
        tensor = torch.from_numpy(data.view(signed)).view(dtype)
    if list(tensor.shape) != shape and tensor.numel() == int(np.prod(shape, dtype=np.int64)):
        tensor = tensor.reshape(shape)
    if list(tensor.shape) != shape:
        raise BundleError(f"tensor {dataset.name} has shape {list(tensor.shape)}, expected {shape}")
    if keep_strides and "stride" in dataset.attrs:
        try:
            stride = [int(n) for n in dataset.attrs["stride"]]
        except (TypeError, ValueError) as exc:
            raise BundleError(f"tensor {dataset.name} has unreadable strides: {exc}") from exc
        if stride != list(tensor.stride()) and _strides_fit(shape, stride):
            return _restride(tensor, stride)
    return tensor


def _strides_fit(shape: list[int], stride: list[int]) -> bool:
    """Strides that can be rebuilt: no two elements share memory (except
    broadcast dimensions of stride 0) and the memory needed stays near the
    tensor's size, whatever a damaged attribute says."""
    if len(shape) != len(stride) or any(s < 0 for s in stride):
        return False
    dims = sorted((s, n) for n, s in zip(shape, stride, strict=True) if n > 1 and s > 0)
    extent = 1
    for s, n in dims:
        if s < extent:
            return False  # overlapping: two indices would address one element
        extent = s * (n - 1) + extent
    numel = int(np.prod(shape, dtype=np.int64))
    return extent <= 64 * max(numel, 1) + 4096


def _restride(tensor: torch.Tensor, stride: list[int]) -> torch.Tensor:
    """The same values laid out with ``stride``; stride-0 dimensions become a broadcast (expand)."""
    broadcast = [
        i for i, (n, s) in enumerate(zip(tensor.shape, stride, strict=True)) if s == 0 and n > 1
    ]
    base = tensor
    for dim in broadcast:
        base = base.narrow(dim, 0, 1)
    base_stride = [1 if i in broadcast else s for i, s in enumerate(stride)]
    strided = torch.empty_strided(tuple(base.shape), base_stride, dtype=tensor.dtype)
    strided.copy_(base)
    return strided.expand(tensor.shape) if broadcast else strided


def write_tree(group: h5py.Group, obj: Any) -> None:
    """Store a nest of dicts/lists/tuples/scalars/tensors; the skeleton is JSON."""
    tensors: list[torch.Tensor] = []
    skeleton = _encode(obj, tensors)
    group.attrs["skeleton"] = json.dumps(skeleton)
    for index, tensor in enumerate(tensors):
        write_tensor(group, f"t{index}", tensor)


def read_tree(group: h5py.Group, keep_strides: bool = False) -> Any:
    """The nest :func:`write_tree` stored; ``keep_strides`` restores each tensor's memory layout.
    What a damaged file makes h5py raise is a BundleError naming the file."""
    if not isinstance(group, h5py.Group):
        raise BundleError(f"{group.name} is a dataset where a group of tensors was expected")
    with damaged_hdf5(group.file.filename):
        try:
            skeleton = json.loads(group.attrs["skeleton"])
        except RecursionError as exc:
            raise BundleError(f"the structure of {group.name} nests deeper than 32 levels") from exc
        except (KeyError, ValueError, TypeError) as exc:
            raise BundleError(
                f"{group.name} of {group.file.filename} has no readable structure: {str(exc)[:200]}"
            ) from exc
        check_json_value(skeleton, f"the structure of {group.name}")
        return _decode(skeleton, group, keep_strides)


def _encode(obj: Any, tensors: list[torch.Tensor]) -> dict:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"tensor": f"t{len(tensors) - 1}"}
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise BundleError(f"cannot store a dict key of type {type(key).__name__}")
        return {"dict": [[key, _encode(value, tensors)] for key, value in obj.items()]}
    if isinstance(obj, (list, tuple)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {kind: [_encode(value, tensors) for value in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    if isinstance(obj, torch.dtype):
        return {"dtype": dtype_name(obj)}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, (torch.layout, torch.memory_format)):
        return {type(obj).__name__: str(obj).removeprefix("torch.")}
    raise BundleError(
        f"cannot store a value of type {type(obj).__name__}",
        "Batches and states may hold tensors, numbers, strings and dicts/lists/tuples of them.",
    )


def _decode(node: Any, group: h5py.Group, keep_strides: bool = False) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise BundleError(f"{group.name}: malformed structure entry {str(node)[:80]!r}")
    ((kind, payload),) = node.items()
    if kind == "tensor":
        if not isinstance(payload, str) or payload not in group:
            raise BundleError(f"{group.name}: missing tensor {payload!r}")
        return read_tensor(group[payload], keep_strides)
    if kind == "dict" and isinstance(payload, list):
        return {_key(item, group): _decode(item[1], group, keep_strides) for item in payload}
    if kind in ("list", "tuple") and isinstance(payload, list):
        items = [_decode(item, group, keep_strides) for item in payload]
        return items if kind == "list" else tuple(items)
    if kind == "value":
        return payload
    if kind == "dtype" and isinstance(payload, str):
        return dtype_from_name(payload)
    if kind == "device" and isinstance(payload, str):
        try:
            return torch.device(payload)
        except (RuntimeError, ValueError) as exc:
            raise BundleError(f"{group.name}: unknown device {payload[:40]!r}") from exc
    if kind in ("layout", "memory_format") and isinstance(
        getattr(torch, str(payload), None), (torch.layout, torch.memory_format)
    ):
        return getattr(torch, payload)
    raise BundleError(f"{group.name}: malformed structure entry of kind {kind!r}")


def _key(item: Any, group: h5py.Group) -> Any:
    scalar = (str, int, float, bool, type(None))
    if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], scalar):
        raise BundleError(f"{group.name}: malformed dict item {str(item)[:60]}")
    return item[0]


def map_tensors(obj: Any, fn) -> Any:
    """Apply ``fn`` to every tensor in a nest of dicts/lists/tuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(value, fn) for value in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(value, fn) for value in obj)
    return obj
