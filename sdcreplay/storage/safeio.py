"""Reading files a stranger may have prepared: regular files only, never more bytes than expected.

A FIFO blocks an ``open`` forever, ``/dev/zero`` never ends and a symlink can
point anywhere on the machine, so every file sdcreplay reads from a bundle or a
log goes through here: opened without blocking, checked to be a regular file,
and read up to a limit.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BundleError

if TYPE_CHECKING:
    import h5py


def regular_file_inside(root: Path, name: str) -> Path:
    """``root/name``, refusing a symlink anywhere below ``root`` and anything but a regular file.

    ``root`` itself may be a symlink (the person named it); what the bundle
    holds may not point out of it.
    """
    path = root
    parts = name.split("/")
    for position, part in enumerate(parts):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            raise BundleError(f"bundle file {name} is missing from {root}") from None
        except OSError as exc:
            raise BundleError(f"cannot read bundle file {name} in {root}: {exc.strerror}") from exc
        if stat.S_ISLNK(mode):
            raise BundleError(
                f"bundle file {name} in {root} is (or lies under) a symlink",
                "A bundle holds its own files; copy the real files in with `cp -rL`.",
            )
        last = position == len(parts) - 1
        if last and not stat.S_ISREG(mode):
            raise BundleError(f"bundle file {name} in {root} is not a regular file ({_kind(mode)})")
        if not last and not stat.S_ISDIR(mode):
            raise BundleError(f"bundle file {name} in {root}: {part} is not a directory")
    return path


def read_limited(path: Path, limit: int, what: str, prefix: bool = False) -> bytes:
    """The bytes of a regular file (a symlink to one is followed), at most ``limit`` of them.

    ``prefix``: a longer file is fine, only its first ``limit`` bytes are read
    (an append-only log that grew after its manifest was written).
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise BundleError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise BundleError(f"cannot read {what} {path}: {exc.strerror}") from exc
    with os.fdopen(descriptor, "rb") as handle:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise BundleError(
                f"{what} {path} is not a regular file ({_kind(mode)})",
                "Give the path of a file sdcreplay wrote.",
            )
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            raise BundleError(f"cannot read {what} {path}: {exc.strerror}") from exc
    if len(data) > limit and prefix:
        return data[:limit]
    if len(data) > limit:
        raise BundleError(f"{what} {path} is larger than {limit} bytes, more than it can hold")
    return data


def check_json_value(value: Any, what: str, limit: int = 32) -> None:
    """Refuse nesting deeper than ``limit`` and strings with NUL or unpaired surrogates.

    Nothing sdcreplay writes nests deeper than a few levels; a deep value only
    exhausts the recursion of whoever reads it next, and such strings cannot be
    an environment variable, a path or UTF-8.
    """
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise BundleError(f"{what} nests deeper than {limit} levels")
        if isinstance(node, dict):
            stack.extend((key, depth + 1) for key in node)
            stack.extend((item, depth + 1) for item in node.values())
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str) and ("\0" in node or not _is_utf8(node)):
            raise BundleError(
                f"{what} holds a string with a NUL or an unpaired surrogate: {node[:40]!r}"
            )


def _is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"


HDF5_ERRORS = (
    KeyError,
    RuntimeError,
    OSError,
    ValueError,
    TypeError,
    OverflowError,
    IndexError,
    NotImplementedError,
)
"""What h5py raises for a damaged file: HDF5's error stack mapped onto builtins, e.g.
``RuntimeError: Unable to get group info (addr overflow ...)`` or ``KeyError: 'Unable to
synchronously open object (message not aligned)'``."""

DAMAGED_HDF5_HINT = (
    "Its bytes are the ones the manifest vouches for, so it was damaged before it was hashed "
    "(a disk, a copy) or edited together with its hash: take an intact copy of the bundle from "
    "where it was recorded, or record the step again."
)


@contextlib.contextmanager
def damaged_hdf5(filename: str | Path) -> Iterator[None]:
    """Any error h5py raises while reading ``filename`` (a bundle's HDF5 file) as a BundleError
    that says the file is damaged; a BundleError raised inside keeps its own words."""
    try:
        yield
    except BundleError:
        raise
    except HDF5_ERRORS as exc:
        said = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
        raise BundleError(
            f"{filename} is damaged: {type(exc).__name__}: {said[:300]}", DAMAGED_HDF5_HINT
        ) from exc


_COLLECTION = b"GCOL\x01\x00\x00\x00"  # a global heap collection: signature, version 1
_COLLECTION_HEADER_BYTES = 16  # the signature, version, reserved bytes, the collection's size
_OBJECT_HEADER_BYTES = 16  # an object's index, reference count, reserved bytes and size


def check_global_heaps(path: Path) -> None:
    """Refuse an HDF5 file whose global heap libhdf5 would read forever or past its end.

    The global heap holds variable-length strings (a tree's skeleton, the Python RNG state).
    libhdf5 walks a collection's objects when it first reads one of them and, at a free-space
    object of size 0 (a damaged size makes it land on one), never advances: a loop in C that
    no timeout of this process reaches. Each collection is walked here first, as libhdf5 walks
    it (lengths of 8 bytes, as h5py writes them).
    """
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            start = data.find(_COLLECTION)
            while start >= 0:
                _check_collection(path, data, start)
                start = data.find(_COLLECTION, start + 1)


def _check_collection(path: Path, data: mmap.mmap, start: int) -> None:
    end = start + int.from_bytes(data[start + 8 : start + 16], "little")
    if end > len(data) or end < start + _COLLECTION_HEADER_BYTES:
        return  # no collection libhdf5 would walk (it refuses one past the file's end)
    position = start + _COLLECTION_HEADER_BYTES
    while position + _OBJECT_HEADER_BYTES <= end:  # a shorter tail is free space
        index = int.from_bytes(data[position : position + 2], "little")
        size = int.from_bytes(data[position + 8 : position + 16], "little")
        # An object's header and its data padded to 8 bytes; free space (index 0) as it says.
        need = _OBJECT_HEADER_BYTES + (size + 7) // 8 * 8 if index else size
        if need == 0 or position + need > end:
            raise BundleError(
                f"{path} is damaged: the global heap at byte {start} has an object of "
                f"{size} bytes at byte {position} that does not fit it",
                DAMAGED_HDF5_HINT,
            )
        position += need


def check_self_contained(handle: h5py.File, limit: int = 100_000) -> None:
    """Refuse an HDF5 file whose data lives elsewhere: external links or storage, virtual datasets.

    Such a file reads other files of the machine while its own SHA-256 still
    matches, so editing them would change a replay's verdict unseen. A file whose
    structure cannot be walked is damaged (``damaged_hdf5``).
    """
    with damaged_hdf5(handle.filename):
        _check_links(handle, limit)


def _check_links(handle: h5py.File, limit: int) -> None:
    import h5py  # here: a command that reads only JSON (manifests, logs) needs not load it

    pending = [handle]
    seen = 0
    while pending:
        group = pending.pop()
        for name in group:
            seen += 1
            if seen > limit:
                raise BundleError(f"{handle.filename} holds more than {limit} objects")
            link = group.get(name, getlink=True)
            where = f"{handle.filename}: {group.name.rstrip('/')}/{name}"
            if isinstance(link, h5py.ExternalLink):
                raise BundleError(
                    f"{where} is an external link to {link.filename[:80]!r}",
                    "A bundle's HDF5 files must hold all their data themselves.",
                )
            if isinstance(link, h5py.SoftLink):
                continue  # points inside this file; its target is visited as itself
            item = group[name]
            if isinstance(item, h5py.Group):
                pending.append(item)
            elif isinstance(item, h5py.Dataset) and (item.external or item.is_virtual):
                raise BundleError(
                    f"{where} keeps its data outside the file (HDF5 external storage)",
                    "A bundle's HDF5 files must hold all their data themselves.",
                )
