"""A tensor's memory, as the tool asks of it: the one place that knows a DTensor has none.

A DTensor (FSDP2's parameters, a tensor-parallel operator's output) is a wrapper: it has
no storage, and asking it for a pointer fails ("Attempted to access the data pointer on an
invalid python storage"). The memory its device wrote is its local shard. Bisect's memory
map, fault injection, digests, forensics, snapshots and the probe all take a tensor's
storage, address, offset, strides or element positions from here, so a sharded job is
handled by every one of them alike, and ``index=`` in a fault spec always counts the
elements of this rank's shard.
"""

from __future__ import annotations

import torch

from ..storage.tensorio import local_shard

__all__ = [
    "data_address",
    "has_memory",
    "local_shard",
    "storage_address",
    "storage_key",
    "storage_layout",
    "storage_position",
]


def has_memory(tensor: torch.Tensor) -> bool:
    """Whether the local shard is backed by memory that can be addressed (not a meta, fake or
    other wrapper tensor)."""
    shard = local_shard(tensor)
    if shard.device.type == "meta":
        return False
    try:
        shard.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def storage_address(tensor: torch.Tensor) -> int | None:
    """The address of the memory block the local shard lives in (shared by all its views), or
    None for a tensor without memory of its own."""
    if not has_memory(tensor):
        return None
    return local_shard(tensor).untyped_storage().data_ptr()


def data_address(tensor: torch.Tensor) -> int | None:
    """The address of the local shard's first element, or None (see ``storage_address``)."""
    return local_shard(tensor).data_ptr() if has_memory(tensor) else None


def storage_key(tensor: torch.Tensor) -> int | None:
    """The identity of the local shard's storage object (PyTorch's work registry finds a
    functional collective's Work by it), or None for a tensor without one."""
    try:
        return local_shard(tensor).untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def storage_layout(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """The local shard's storage offset and strides, in elements."""
    shard = local_shard(tensor)
    return int(shard.storage_offset()), tuple(int(stride) for stride in shard.stride())


def storage_position(tensor: torch.Tensor, flat_index: int) -> int:
    """Where the local shard's element ``flat_index`` (in logical, row-major order, as a fault
    spec's ``index=`` and forensics count) lies in its storage, in elements."""
    shard = local_shard(tensor)
    offset, strides = storage_layout(shard)
    position = offset
    for size, stride in zip(reversed(shard.shape), reversed(strides)):
        position += (flat_index % size) * stride
        flat_index //= size
    return position
