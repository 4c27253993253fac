"""A directory of one run's own, and a place aside for what a run replaces.

Processes that start in the same second (eight Slurm jobs on one node) once shared a log
directory named by that second and read each other's results. A run directory's name holds
the time, the process id and a random part, and it is created with one ``mkdir`` that fails
when the name exists, so no two processes ever get the same one and none is reused.
`set_aside` moves a person's old report, ticket or bundle to a name of the same kind instead
of deleting it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import tempfile
import time
from pathlib import Path

from ..errors import SdcReplayError

ATTEMPTS = 16  # names that already exist before giving up (each has 24 random bits)
ASIDE = ".old-"  # NAME.old-<time>-<pid>-<random>: what --overwrite moved away
LOCK_FILE = ".sdcreplay-lock"  # in a directory a person named: who writes there now
_claimed: dict[Path, int] = {}  # the directories this process holds, and their lock's fd


def unique_name(prefix: str = "") -> str:
    """``<prefix><YYYYmmdd-HHMMSS>-<pid>-<6 hex digits>``: sorts by time, says whose it is."""
    return f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"


def make_run_dir(parent: str | Path, prefix: str = "", suffix: str = "") -> Path:
    """A new directory ``parent/<unique_name(prefix)><suffix>`` that only this call created
    (``parent`` is created when missing)."""
    parent = Path(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for _ in range(ATTEMPTS):
            path = parent / (unique_name(prefix) + suffix)
            try:
                path.mkdir()
            except FileExistsError:
                continue
            return path
    except OSError as exc:
        raise SdcReplayError(
            f"cannot create a run directory in {str(parent)[:300]}: {exc.strerror or exc}",
            "Choose a --logs/--out directory that can be written (not under a file or /proc, "
            "each name at most 255 bytes).",
            python_hint="Pass a log_dir/out that can be written (not under a file or /proc, "
            "each name at most 255 bytes).",
        ) from exc
    raise SdcReplayError(f"no new run directory could be named in {parent} ({ATTEMPTS} tries)")


def claim(directory: str | Path) -> Path:
    """Hold ``directory`` (created when missing), one a person named (``--logs``), for this
    process until it ends: another process that claims it meanwhile is refused rather than
    mixing its files with these. A lock of the kernel's (``flock``): a process that dies
    releases it."""
    directory = Path(directory)
    try:
        key = directory.resolve()  # a name over 255 bytes fails here already
        if key in _claimed:
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise SdcReplayError(
            f"cannot create the log directory {str(directory)[:300]}: {exc.strerror or exc}",
            "Choose a --logs directory that can be written (not under a file or /proc, "
            "each name at most 255 bytes).",
            python_hint="Choose a log_dir that can be written (not under a file or /proc, "
            "each name at most 255 bytes).",
        ) from exc
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(descriptor, 32).decode(errors="replace").strip() or "?"
        os.close(descriptor)
        raise SdcReplayError(
            f"{directory} is being written by another sdcreplay run (pid {holder})",
            "Give each run its own --logs, or leave --logs out: each run then makes its own "
            "directory.",
            python_hint="Give each call its own log_dir, or leave it out: each call then makes "
            "its own directory.",
        ) from None
    with contextlib.suppress(OSError):
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    _claimed[key] = descriptor
    return directory


def writable_dir(path: str | Path) -> bool:
    """Whether a directory could be created at ``path``: its nearest existing ancestor is a
    directory this process may write, on a file system mounted read-write (``os.access``
    says yes to root on a chmod 555 directory; a read-only mount refuses root too, and
    ``statvfs`` tells it)."""
    path = Path(path).absolute()
    while not path.exists():
        if path.parent == path:
            return False
        path = path.parent
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        return False
    try:
        return not os.statvfs(path).f_flag & os.ST_RDONLY
    except OSError:
        return False


def temporary_run_dir(purpose: str) -> Path:
    """A run directory under the system's temporary directory (``$TMPDIR``/sdcreplay-PURPOSE),
    for a run whose usual place cannot be written."""
    return make_run_dir(Path(tempfile.gettempdir()) / f"sdcreplay-{purpose}")


def replacing_refused(
    path: Path, what: str, error: type[SdcReplayError] = SdcReplayError
) -> SdcReplayError:
    """The refusal to replace ``path`` (``what`` it holds, if said) without being asked, with
    the advice for the command line and for Python."""
    aside = f"{path.name}{ASIDE}<time>-<pid>-<random>"
    return error(
        f"{path} already exists" + (f" ({what})" if what else ""),
        f"Pass --overwrite to replace it (the old one is moved aside to {aside}), "
        "or choose another --out.",
        python_hint=f"Pass overwrite=True to replace it (the old one is moved aside to {aside}), "
        "or choose another out=.",
    )


def set_aside(path: str | Path) -> Path:
    """Move ``path`` (a file or directory) to ``NAME.old-<time>-<pid>-<random>`` beside it,
    in one rename that never replaces anything, and return where it went."""
    path = Path(path)
    for _ in range(ATTEMPTS):
        target = path.with_name(unique_name(path.name + ASIDE))
        try:
            if path.is_dir() and not path.is_symlink():
                target.mkdir()  # reserved: renaming a directory onto an empty one is atomic
                try:
                    path.rename(target)
                except OSError:
                    target.rmdir()
                    raise
            elif not target.exists() and not target.is_symlink():
                path.rename(target)
            else:
                continue
        except FileExistsError:
            continue
        except OSError as exc:
            raise SdcReplayError(
                f"cannot move {path} aside to {target.name}: {exc.strerror or exc}",
                "Move it away yourself, or choose another --out.",
                python_hint="Move it away yourself, or choose another out=.",
            ) from exc
        return target
    raise SdcReplayError(f"no free name to move {path} aside to ({ATTEMPTS} tries)")
