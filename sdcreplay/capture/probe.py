"""The kernel probe: evidence that a machine computes a step's kernels as the recording did.

A fingerprint lists what we know can change a result bit (a torch build, a
GPU model, a BLAS branch); every list misses something (a CPU vendor, a
microcode, a library build). The probe asks the machine instead: every
distinct operator call of the recorded step (op overload, shapes, dtypes,
strides, non-tensor arguments) is run on seeded synthetic inputs, and the
digest of each output is kept. A replica whose digests equal the record's
computes those kernels alike; one whose digests differ may not vote on the
record. Synthetic inputs are made from integers only (no transcendental
function whose vectorized code could round differently on another CPU), with
full mantissas so that a different summation order shows, and within the
step's own ranges for indices and for inputs that were never negative. A
defect that fires only on the step's own values passes the probe: the probe
proves kernels alike, never a device healthy.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .aten_mode import AtenMode
from .digest import tensor_digest
from .memory import local_shard, storage_layout

PROBE_FILE = "probe.json"
MAX_CALLS = 256
SEED = 20261201
# Ops that compute nothing (their outputs alias an input) are left out through their
# schema; these create memory without defined contents, or reach outside the process.
_UNDEFINED_CONTENTS = ("empty", "resize", "set_", "_local_scalar_dense")
_NAMESPACES = {"aten", "prims"}


@dataclass
class ProbeCall:
    """One distinct call: ``op`` with its arguments' description, as often as it ran."""

    op: str
    args: list
    kwargs: dict
    count: int = 1
    digest: str | None = None

    @property
    def key(self) -> str:
        return json.dumps([self.op, _without_ranges(self.args), _without_ranges(self.kwargs)])

    def describe(self) -> str:
        """``aten.mm.default [8, 48] x [48, 192] float32``: how a person names the kernel."""
        tensors = [spec["tensor"] for spec in _tensor_specs([self.args, self.kwargs])]
        shapes = " x ".join(str(t["shape"]) for t in tensors)
        dtypes = sorted({t["dtype"] for t in tensors})
        return " ".join(part for part in (self.op, shapes, "/".join(dtypes)) if part)

    def to_json(self) -> dict:
        return {
            "op": self.op,
            "args": self.args,
            "kwargs": self.kwargs,
            "count": self.count,
            "digest": self.digest,
        }

    @classmethod
    def from_json(cls, data: dict) -> ProbeCall:
        return cls(data["op"], data["args"], data["kwargs"], data["count"], data["digest"])


@dataclass
class Probe:
    """The probe of one device: its calls with their output digests, in a bundle's
    ``probe.json`` (docs/bundle-format.md)."""

    calls: list[ProbeCall]
    seed: int = SEED
    skipped: int = 0  # distinct calls left out: over the cap, or not runnable on synthetic inputs
    schema: str = "sdcreplay.probe/1"

    def to_json(self) -> dict:
        return {
            "schema": self.schema,
            "seed": self.seed,
            "skipped": self.skipped,
            "calls": [call.to_json() for call in self.calls],
        }

    @classmethod
    def from_json(cls, data: dict) -> Probe:
        if not isinstance(data, dict) or data.get("schema") != "sdcreplay.probe/1":
            raise ValueError("not an sdcreplay.probe/1 object")
        calls = [ProbeCall.from_json(call) for call in data["calls"]]
        return cls(calls, int(data["seed"]), int(data.get("skipped", 0)))

    @property
    def digests(self) -> list[str | None]:
        return [call.digest for call in self.calls]


@dataclass
class ProbeOutcome:
    """What a device's run of a recorded probe found: its digests and which calls differ."""

    digests: list[str | None]
    differing: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def matched(self) -> bool:
        return not self.differing

    def to_json(self, probe: Probe, limit: int = 5) -> dict:
        return {
            "ran": len(self.digests),
            "matched": self.matched,
            "digests": self.digests,
            "differing": [
                {
                    "call": index,
                    "kernel": probe.calls[index].describe(),
                    **({"error": self.errors[index]} if index in self.errors else {}),
                }
                for index in self.differing[:limit]
            ],
            "differing_count": len(self.differing),
        }


class _CallCollector(AtenMode):
    """Notes each distinct operator call of a step, passing every call through unchanged."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.calls: dict[str, ProbeCall] = {}
        self.order: Counter[str] = Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while Dynamo and Inductor compile, on while compiled code runs: a compiled step
        runs its own kernels here, never an eager fallback. The calls it sees there are the
        compiled code's ATen calls (extern kernels such as a GEMM); Inductor's generated kernels
        are no operator calls, and the bundle's code digests (capture/compiled.py) stand for
        them."""
        return True

    def on_aten(self, func, types, args, kwargs):
        out = func(*args, **kwargs)
        call = _describe_call(func, args, kwargs, self.device, measure=False)
        if call is None:
            return out
        known = self.calls.get(call.key)
        if known is None:  # measured once: the values a float input takes, an index's range
            self.calls[call.key] = _describe_call(func, args, kwargs, self.device, measure=True)
        else:
            known.count += 1
            if _has_integer_inputs(call):  # every call of the key within the ranges
                seen = _describe_call(func, args, kwargs, self.device, measure=True)
                _widen_ranges(known.args, seen.args)
                _widen_ranges(known.kwargs, seen.kwargs)
        return out


@contextmanager
def collecting_calls(device: torch.device) -> Iterator[_CallCollector]:
    """Inside: every operator call is noted for the probe (results unchanged)."""
    collector = _CallCollector(device)
    with collector:
        yield collector


def select_calls(calls: list[ProbeCall], limit: int = MAX_CALLS) -> tuple[list[ProbeCall], int]:
    """The calls a probe runs: each floating-point op's most frequent call, then the most
    frequent of the rest up to ``limit``; and how many were left out."""
    by_frequency = sorted(calls, key=lambda call: -call.count)
    chosen: dict[str, ProbeCall] = {}
    for call in by_frequency:
        if _computes_floats(call) and not any(c.op == call.op for c in chosen.values()):
            chosen[call.key] = call
    for call in by_frequency:
        if len(chosen) >= limit:
            break
        chosen.setdefault(call.key, call)
    return list(chosen.values()), len(calls) - len(chosen)


def record_probe(calls: list[ProbeCall], device: torch.device, limit: int = MAX_CALLS) -> Probe:
    """Run the step's distinct calls on synthetic inputs on the recording device: the probe a
    bundle keeps. A call that cannot run on synthetic inputs is left out."""
    chosen, skipped = select_calls(calls, limit)
    kept = []
    for call in chosen:
        try:
            digest = run_call(call, device, SEED)
        except Exception:  # noqa: BLE001 - an op that refuses synthetic inputs is not probed
            skipped += 1
            continue
        kept.append(ProbeCall(call.op, call.args, call.kwargs, call.count, digest))
    return Probe(kept, SEED, skipped)


def run_probe(probe: Probe, device: torch.device) -> ProbeOutcome:
    """Run a recorded probe here; its calls, its seeds, and which digests differ."""
    outcome = ProbeOutcome(digests=[])
    for index, call in enumerate(probe.calls):
        try:
            digest: str | None = run_call(call, device, probe.seed)
        except Exception as exc:  # noqa: BLE001 - a call that raises here computes differently
            digest = None
            outcome.errors[index] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        outcome.digests.append(digest)
        if digest != call.digest:
            outcome.differing.append(index)
    return outcome


def run_call(call: ProbeCall, device: torch.device, seed: int) -> str:
    """The digest of ``call``'s outputs on fresh synthetic inputs made from ``seed`` and the
    call itself (so a call's inputs do not depend on which other calls a probe holds)."""
    op = _resolve(call.op)
    seed = (seed ^ zlib.crc32(call.key.encode())) & 0x7FFF_FFFF
    generator = torch.Generator().manual_seed(seed)
    args = _materialize(call.args, device, generator)
    kwargs = {k: _materialize(v, device, generator) for k, v in call.kwargs.items()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = op(*args, **kwargs)
    outputs = _tensors_of(out) or _tensors_of(args)
    return "+".join(tensor_digest(t) for t in outputs) if outputs else repr(out)


def probe_step(run: Callable[[], Any], device: torch.device, limit: int = MAX_CALLS) -> Probe:
    """Run ``run`` (one step, re-executed) with its calls noted, then probe them."""
    with collecting_calls(device) as collector:
        run()
    return record_probe(list(collector.calls.values()), device, limit)


# -- describing a call -------------------------------------------------------------------


def _describe_call(func, args, kwargs, device: torch.device, measure: bool) -> Any:
    name = str(func)
    if name.split(".")[0] not in _NAMESPACES or any(word in name for word in _UNDEFINED_CONTENTS):
        return None
    schema = func._schema
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return None  # a view: it computes nothing
    if not schema.returns:
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if not mutates:
            return None
    try:
        described_args = [_describe(a, device, measure) for a in args]
        described_kwargs = {k: _describe(v, device, measure) for k, v in kwargs.items()}
    except _Unprobeable:
        return None
    if not _tensor_specs([described_args, described_kwargs]):
        return None  # a factory call (zeros, arange, ...): nothing of the machine's kernels
    return ProbeCall(name, described_args, described_kwargs)


class _Unprobeable(Exception):
    """An argument the probe cannot make again (a tensor subclass, a generator, ...)."""


def _describe(value: Any, device: torch.device, measure: bool) -> Any:
    if isinstance(value, torch.Tensor):
        value = local_shard(value)  # a DTensor's kernel runs on this rank's shard
        offset, strides = storage_layout(value)
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.is_sparse:
            raise _Unprobeable
        spec: dict[str, Any] = {
            "shape": list(value.shape),
            "stride": list(strides),
            "offset": offset,
            "dtype": str(value.dtype).removeprefix("torch."),
            "device": "cpu" if value.device.type == "cpu" and device.type != "cpu" else "step",
        }
        if measure and value.numel() and not value.is_complex():
            low, high = torch.aminmax(value.detach().reshape(-1).to(torch.float64))
            if value.is_floating_point():
                spec["nonnegative"] = bool(low >= 0)
            else:
                spec["range"] = [int(low), int(high)]
        return {"tensor": spec}
    if isinstance(value, (list, tuple)):
        return {"list": [_describe(v, device, measure) for v in value]}
    if value is None or isinstance(value, (bool, int, str)):
        return {"value": value}
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": "cpu" if value.type == "cpu" and device.type != "cpu" else "step"}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    raise _Unprobeable


def _tensor_specs(described: Any) -> list[dict]:
    if isinstance(described, dict):
        if "tensor" in described:
            return [described]
        if "list" in described:
            return _tensor_specs(described["list"])
        return [s for v in described.values() for s in _tensor_specs(v)]
    if isinstance(described, list):
        return [s for v in described for s in _tensor_specs(v)]
    return []


def _without_ranges(described: Any) -> Any:
    if isinstance(described, dict):
        if "tensor" in described:
            spec = dict(described["tensor"])
            spec.pop("range", None)
            spec.pop("nonnegative", None)
            return {"tensor": spec}
        return {k: _without_ranges(v) for k, v in described.items()}
    if isinstance(described, list):
        return [_without_ranges(v) for v in described]
    return described


def _widen_ranges(known: Any, seen: Any) -> None:
    for kept, new in zip(_tensor_specs(known), _tensor_specs(seen)):
        kept, new = kept["tensor"], new["tensor"]
        if "range" in kept and "range" in new:
            kept["range"] = [
                min(kept["range"][0], new["range"][0]),
                max(kept["range"][1], new["range"][1]),
            ]
        if "nonnegative" in kept:
            kept["nonnegative"] = kept["nonnegative"] and new.get("nonnegative", False)


def _has_integer_inputs(call: ProbeCall) -> bool:
    return any(
        not spec["tensor"]["dtype"].startswith(("float", "bfloat", "complex", "bool"))
        for spec in _tensor_specs([call.args, call.kwargs])
    )


def _computes_floats(call: ProbeCall) -> bool:
    return any(
        spec["tensor"]["dtype"].startswith(("float", "bfloat", "complex"))
        for spec in _tensor_specs(call.args)
    )


# -- making a call again ---------------------------------------------------------------


def _resolve(name: str):
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _materialize(described: Any, device: torch.device, generator: torch.Generator) -> Any:
    if isinstance(described, list):
        return [_materialize(v, device, generator) for v in described]
    if not isinstance(described, dict) or len(described) != 1:
        raise ValueError(f"not a probe argument: {described!r}")
    ((kind, value),) = described.items()
    if kind == "tensor":
        return _synthetic_tensor(value, device, generator)
    if kind == "list":
        return [_materialize(v, device, generator) for v in value]
    if kind == "value":
        return value
    if kind == "float":
        return float(value)
    if kind == "device":
        return device if value == "step" else torch.device("cpu")
    if kind in ("dtype", "memory_format", "layout"):
        return getattr(torch, value)
    raise ValueError(f"not a probe argument: {described!r}")


def _synthetic_tensor(spec: dict, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """Seeded values for one input, made from integers on the CPU: the same bits everywhere."""
    dtype = getattr(torch, spec["dtype"])
    shape, stride = spec["shape"], spec["stride"]
    extent = spec["offset"] + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0) + 1
    if any(n == 0 for n in shape):
        extent = spec["offset"]
    count = max(extent, 0)
    if dtype.is_floating_point or dtype.is_complex:
        real = _full_mantissa(count * (2 if dtype.is_complex else 1), spec, generator)
        flat = torch.view_as_complex(real.reshape(-1, 2)) if dtype.is_complex else real
        flat = flat.to(dtype)
    elif dtype == torch.bool:
        flat = torch.randint(0, 2, (count,), generator=generator).bool()
    else:
        low, high = spec.get("range", [0, 0])
        flat = torch.randint(low, high + 1, (count,), generator=generator, dtype=torch.int64)
        flat = flat.to(dtype)
    placed = flat.to(device)
    return placed.as_strided(shape, stride, spec["offset"])


def _full_mantissa(count: int, spec: dict, generator: torch.Generator) -> torch.Tensor:
    """Uniform in [-1, 1) (or [0, 1) for an input the step never made negative) with every
    bit of a float64 mantissa used: k / 2**52 for a random integer k, exact in float64."""
    low = 0 if spec.get("nonnegative") else -(2**52)
    integers = torch.randint(low, 2**52, (count,), generator=generator, dtype=torch.int64)
    return integers.to(torch.float64) * 2.0**-52


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_of(v)]
    return []
