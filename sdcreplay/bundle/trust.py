"""Who may run code named by a bundle: a bundle is data, a workload reference is code.

Like Jupyter's notebook trust, a bundle recorded here carries an HMAC of its
manifest made with a local secret (``$SDCREPLAY_HOME/secret``, else
``~/.config/sdcreplay/secret``, created 0600 on first use); a cluster that
shares the secret trusts its own bundles. Any other bundle's workload runs only
when the person trusts it on the command line (``--trust-workload``, or the same
reference given with ``--workload``). Built-in workloads are always trusted.
Device processes check again, so a hand-written task cannot skip the check.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import UntrustedWorkloadError
from ..home import HOME_ENV, home_dir  # noqa: F401 (HOME_ENV: named here by tests)
from ..workload.references import canonical_ref

GRANTED_ENV = "SDCREPLAY_TRUSTED_WORKLOADS"
"""JSON list of references the person trusted, handed to the device processes."""
SIGNATURE = "signature"
_UNSIGNED = (SIGNATURE, "manifest_sha256")
_granted: list[str] = []


def secret_path() -> Path:
    return home_dir() / "secret"


def _secret(create: bool) -> bytes | None:
    path = secret_path()
    if not path.is_file() and create:
        _make_secret(path)
    try:
        return path.read_bytes().strip() or None
    except OSError:
        return None


def _make_secret(path: Path) -> None:
    """Written whole beside the secret, then linked into place: processes started together on
    a fresh machine (a job's ranks, a scheduler's jobs) never read it half-written (which
    would leave their bundles unsigned), and the first link stands for all of them."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = secrets.token_hex(32)
    written = path.with_name(f".secret-{os.getpid()}-{secrets.token_hex(4)}")
    descriptor = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(value)
        _link_unless_there(written, path)
    finally:
        written.unlink(missing_ok=True)


def _link_unless_there(written: Path, path: Path) -> None:
    try:
        os.link(written, path)
    except FileExistsError:
        pass  # another process's secret stands
    except OSError:  # a filesystem without hard links: a rename, which a racer may undo
        os.replace(written, path)


def _mac(document: dict, key: bytes) -> str:
    body = {name: value for name, value in document.items() if name not in _UNSIGNED}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def sign(document: dict) -> str | None:
    """The signature of a manifest's JSON with this user's secret (None when none can be made)."""
    key = _secret(create=True)
    return None if key is None else _mac(document, key)


def signed_here(document: dict) -> bool:
    key, signature = _secret(create=False), document.get(SIGNATURE)
    return (
        key is not None
        and isinstance(signature, str)
        and hmac.compare_digest(_mac(document, key), signature)
    )


def granted() -> set[str]:
    """References trusted in this process: granted here, or by the process that started it."""
    try:
        inherited = json.loads(os.environ.get(GRANTED_ENV) or "[]")
    except ValueError:
        inherited = []
    return set(_granted) | {ref for ref in inherited if isinstance(ref, str)}


@contextlib.contextmanager
def granting(refs: Iterable[str]) -> Iterator[None]:
    """Trust ``refs`` (given by the person) for the duration, in this process and its device
    processes."""
    added = [canonical_ref(ref) for ref in refs]
    _granted.extend(added)
    try:
        yield
    finally:
        for ref in added:
            _granted.remove(ref)


def child_environment() -> dict[str, str]:
    trusted = sorted(granted())
    return {GRANTED_ENV: json.dumps(trusted)} if trusted else {}


def is_trusted(ref: str, document: dict) -> bool:
    """``ref``: the workload the manifest names; ``document``: the manifest's JSON (signed)."""
    return ref.startswith("builtin:") or ref in granted() or signed_here(document)


def require_trusted(ref: str, document: dict) -> None:
    """Refuse, before anything is imported, to run a workload the person has not trusted."""
    if is_trusted(ref, document):
        return
    raise UntrustedWorkloadError(
        f"the bundle names workload {ref!r}, which is code, and it was not recorded by this user "
        "(no valid signature): nothing was imported or run",
        f"Read that code first; if you trust it, add --trust-workload (or --workload {ref}).",
        python_hint=f"Read that code first; if you trust it, make the call inside "
        f"`with sdcreplay.bundle.trust.granting([{ref!r}]):`.",
    )
