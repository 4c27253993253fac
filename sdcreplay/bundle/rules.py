"""The language the bundle's JSON documents are checked in, and the base of their typed objects.

A rule per field (a test and, in words, the form expected) lets one loop check a whole
document and name the field and the form in every refusal. ``Record`` reads and writes a JSON
object without losing a key it does not know or adding one that was absent, so a document's
own SHA-256 and its signature survive the round trip.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from ..errors import BundleError


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MISSING = object()


@dataclass(frozen=True)
class Check:
    """One manifest field's rule: a test of its value and the form it should have, in words."""

    test: Callable[[Any], bool]
    expected: str


def integer(low: int, high: int) -> Check:
    return Check(lambda v: _is_int(v) and low <= v <= high, f"an integer from {low} to {high}")


def number(low: float, high: float) -> Check:
    def test(v: Any) -> bool:
        return (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and low <= v <= high

    return Check(test, f"a number from {low} to {high}")


def text(limit: int = 4096, pattern: str | None = None) -> Check:
    regex = re.compile(pattern) if pattern else None
    form = f"a string of at most {limit} characters" + (f" matching {pattern}" if pattern else "")

    def test(v: Any) -> bool:
        return (
            isinstance(v, str)
            and len(v) <= limit
            and (regex is None or regex.fullmatch(v) is not None)
        )

    return Check(test, form)


def choice(*values: Any) -> Check:
    def test(v: Any) -> bool:  # True is not 1: the type must match too
        return any(v is value or (type(v) is type(value) and v == value) for value in values)

    return Check(test, "one of " + ", ".join(json.dumps(value) for value in values))


def optional(check: Check) -> Check:
    return Check(lambda v: v is _MISSING or v is None or check.test(v), f"null or {check.expected}")


def absent_or(check: Check) -> Check:
    """Absent, or ``check`` (not null: the reader's default stands in only for absence)."""
    return Check(lambda v: v is _MISSING or check.test(v), check.expected)


def nullable(check: Check) -> Check:
    """Present, and null or ``check``."""
    return Check(lambda v: v is None or check.test(v), f"null or {check.expected}")


def mapping(key: Check, value: Check) -> Check:
    def test(v: Any) -> bool:
        return isinstance(v, dict) and all(key.test(k) and value.test(x) for k, x in v.items())

    return Check(test, f"an object whose keys are {key.expected} and values {value.expected}")


BOOL = Check(lambda v: isinstance(v, bool), "true or false")
OBJECT = Check(lambda v: isinstance(v, dict), "an object")
OPTIONAL_OBJECT = Check(lambda v: v is _MISSING or isinstance(v, dict), "an object")
SHA256 = text(64, "[0-9a-f]{64}")
ENV_NAME = text(256, "[A-Za-z_][A-Za-z0-9_]*")


def _lookup(obj: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _shown(value: Any) -> str:
    return "missing" if value is _MISSING else json.dumps(value)[:60]


def _check_fields(
    obj: Any, rules: dict[str, Check], where: str = "", document: str = "manifest"
) -> None:
    for path, check in rules.items():
        value = _lookup(obj, path)
        if not check.test(value):
            raise BundleError(
                f"{document} is malformed: {where}{path} is {_shown(value)}, "
                f"expected {check.expected}"
            )


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise BundleError(f"manifest is malformed: {what}")


_BOOKKEEPING = ("extra", "absent")
_NAMES: dict[type, tuple[str, ...]] = {}
_R = TypeVar("_R", bound="Record")


@dataclass(kw_only=True)
class Record:
    """Base of the manifest's objects: the keys it does not know, the optional keys it lacked."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    absent: frozenset[str] = field(default=frozenset(), repr=False)

    RULES: ClassVar[dict[str, Check]] = {}
    """Rules of the object's own fields (empty: MANIFEST_FIELDS holds them, as dotted paths)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The JSON keys this type knows, in the order it writes them."""
        known = _NAMES.get(cls)
        if known is None:  # fields() is slow, and the writer serializes every step's record
            known = _NAMES[cls] = tuple(f.name for f in fields(cls) if f.name not in _BOOKKEEPING)
        return known

    @classmethod
    def _read(cls: type[_R], obj: dict[str, Any], **typed: Any) -> _R:
        """Build from a JSON object ``from_json`` validated; ``typed``: fields already converted."""
        names = cls.names()
        values = {name: typed.get(name, obj[name]) for name in names if name in obj}
        return cls(
            **values,
            extra={key: obj[key] for key in obj if key not in names},
            absent=frozenset(name for name in names if name not in obj),
        )

    def to_json(self) -> dict[str, Any]:
        absent = self.absent
        body = {name: _to_json(getattr(self, name)) for name in self.names() if name not in absent}
        if self.extra:
            body.update(_to_json(self.extra))
        return body

    def present(self, name: str, value: Any) -> None:
        """Set a field the writer now knows (an optional one is written from now on)."""
        setattr(self, name, value)
        self.absent = self.absent - {name}


def _to_json(value: Any) -> Any:
    """A fresh JSON value: a caller may change what it gets without changing the manifest."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    return value
