"""Reading files a stranger may have prepared: a damaged HDF5 file is refused naming the file,
whatever h5py raises while its structure is walked, and before libhdf5 could loop in it."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from bundle_fuzz import heap_object_grown, unreadable_structures

from sdcreplay.errors import BundleError
from sdcreplay.storage.safeio import check_global_heaps, check_self_contained


def written(path: Path) -> Path:
    """An HDF5 file laid out as a bundle's step file is: groups of datasets with attributes."""
    with h5py.File(path, "w") as handle:
        for group in ("batch", "rng"):
            for index in range(3):
                handle.create_dataset(f"{group}/t{index}", data=np.arange(8) + index)
                handle[f"{group}/t{index}"].attrs["dtype"] = "int64"
    return path


@pytest.mark.parametrize(
    ("signature", "raised"),
    [
        (b"TREE", "RuntimeError: Unable to get group info (wrong B-tree signature)"),
        (b"HEAP", "RuntimeError: Link iteration failed (bad local heap signature)"),
        (b"SNOD", "RuntimeError: Unable to get group info (bad symbol table node signature)"),
    ],
)
def test_a_file_whose_groups_cannot_be_walked_is_named_as_damaged(tmp_path, signature, raised):
    path = written(tmp_path / "000000.h5")
    unreadable_structures(path, signature)
    with h5py.File(path, "r") as handle, pytest.raises(BundleError) as caught:
        check_self_contained(handle)
    assert caught.value.message == f"{path} is damaged: {raised}"
    assert "vouches for" in caught.value.hint


def test_an_object_whose_header_cannot_be_read_is_named_as_damaged(tmp_path):
    path = written(tmp_path / "000000.h5")
    with h5py.File(path, "r") as handle:
        header = h5py.h5o.get_info(handle["batch/t1"].id).addr
    data = bytearray(path.read_bytes())
    data[header] = 7  # the object header's version: HDF5 knows 1 and 2
    path.write_bytes(bytes(data))
    with h5py.File(path, "r") as handle, pytest.raises(BundleError) as caught:
        check_self_contained(handle)
    assert caught.value.message == (
        f"{path} is damaged: KeyError: Unable to synchronously open object "
        "(bad object header version number)"
    )


def test_a_global_heap_libhdf5_would_walk_forever_is_refused_before_it_reads_it(tmp_path):
    path = written(tmp_path / "000000.h5")
    with h5py.File(path, "a") as handle:
        handle["batch"].attrs["skeleton"] = '{"list": []}'  # a variable-length string: the heap
    check_global_heaps(path)  # as written
    heap_object_grown(path)
    heap = path.read_bytes().index(b"GCOL")
    with pytest.raises(BundleError) as caught:
        check_global_heaps(path)
    assert caught.value.message.startswith(
        f"{path} is damaged: the global heap at byte {heap} has an object of 0 bytes at byte "
    )


def test_the_global_heaps_of_every_file_sdcreplay_writes_pass(small_bundle):
    for path in sorted(small_bundle.rglob("*.h5")):
        check_global_heaps(path)
