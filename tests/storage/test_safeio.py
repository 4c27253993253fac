"""Reading files a stranger may have prepared: a damaged HDF5 file is refused naming the file,
whatever h5py raises while its structure is walked."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from bundle_fuzz import unreadable_structures

from sdcreplay.errors import BundleError
from sdcreplay.storage.safeio import check_self_contained


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
