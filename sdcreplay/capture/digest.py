"""Tensor digests that see every bit and every position.

``torch.hash_tensor`` XORs the elements upcast to 64 bits, so it cannot see two
elements swapped, the same bit flipped in two elements, or two equal elements
changed together, and it refuses several dtypes. The digests here hash the raw
storage bytes in logical row-major order together with the dtype and shape:

- on the CPU, xxh3-64 through the buffer protocol (no copy of a contiguous tensor);
- on any other device, ``mix64``: every 32-bit word is mixed with its position
  by a 64-bit finalizer and the results are summed with wrapping int64
  arithmetic. The sum is associative, so the value does not depend on the
  reduction order, the chunking or the device, and the tensor never leaves the
  device. Each word's mix is a bijection, so any change to a single word always
  changes the digest. Written in eager torch ops it is about fifteen passes over
  the tensor; on a device the same function is compiled by ``torch.compile``
  (Triton on a GPU, C++ on a CPU) into one memory-bound pass, compiled once per
  process for every shape (``dynamic=True``). Where compiling fails (no compiler,
  no Triton) or ``SDCREPLAY_DIGEST_COMPILE=0``, the eager definition runs: the
  same value, more passes.

The two algorithms give different values for the same tensor; a digest is only
comparable with one made by the same algorithm (see :func:`algorithm_for`).
Tensors of at most 8 bytes and Python scalars are not digested at all: their
exact value is kept, identical on every device, as ``=dtype:bits`` with each
element's bit pattern in hex, most significant digit first, elements in
row-major order (read from the little-endian storage bytes).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import xxhash

from .memory import local_shard

__all__ = [
    "CPU_ALGORITHM",
    "DEVICE_ALGORITHM",
    "Digester",
    "algorithm_for",
    "mix64",
    "one_pass_status",
    "tensor_digest",
]

# What one signature entry digests: a tensor, or a number (None for an absent gradient).
SignatureValue = torch.Tensor | int | float | bool | None

CPU_ALGORITHM = "xxh3-64"
DEVICE_ALGORITHM = "mix64"

EXACT_MAX_BYTES = 8
"""Tensors this small (losses, scalars, step counters) are kept exactly."""

DEFAULT_CHUNK_WORDS = 1 << 23
"""32-bit words mixed at a time: bounds mix64's temporaries to a few x 64 MiB."""

ONE_PASS_SWITCH = "SDCREPLAY_DIGEST_COMPILE"
"""Set to 0 to digest device tensors with the eager definition (no torch.compile)."""

_MASK64 = (1 << 64) - 1
_LOW_32_BITS = (1 << 32) - 1
_LOW_31_BITS = (1 << 31) - 1  # what a logical shift right by 33 can leave set


def _wrap_int64(value: int) -> int:
    """The int64 with the same 64 bits as an unsigned constant (torch's uint64 lacks shifts)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_POSITION_MULTIPLIER = _wrap_int64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio
_FMIX_MULTIPLIER_1 = _wrap_int64(0xFF51AFD7ED558CCD)  # MurmurHash3 fmix64
_FMIX_MULTIPLIER_2 = _wrap_int64(0xC4CEB9FE1A85EC53)


def algorithm_for(device_type: str) -> str:
    """Which digest algorithm a tensor on this device type (``cpu``, ``cuda``, ``cpu:1``) gets."""
    return CPU_ALGORITHM if device_type.partition(":")[0] == "cpu" else DEVICE_ALGORITHM


def tensor_digest(value: SignatureValue) -> str:
    """The signature entry of one value; synchronous (a device tensor's digest is fetched).
    A DTensor's is its shard's on this rank (a rank digests its own bits, never gathering)."""
    if not isinstance(value, torch.Tensor):
        return _scalar_digest(value)
    value = local_shard(value)
    if value.is_cpu and value.nbytes > EXACT_MAX_BYTES and _plain_in_memory(value):
        return _hex(_xxh3_in_place(value))
    tensor = _plain(value)
    data = _storage_bytes(tensor)
    if data.numel() <= EXACT_MAX_BYTES:
        return _exact(tensor.dtype, data.cpu().numpy().tobytes())
    if tensor.device.type == "cpu":
        return _hex(_xxh3(tensor, data))
    return _hex(int(mix64(tensor).item()))


def mix64(
    t: torch.Tensor, *, chunk_words: int = DEFAULT_CHUNK_WORDS, one_pass: bool | None = None
) -> torch.Tensor:
    """The device digest of ``t``, as a 0-dim int64 tensor on ``t.device``, computed there.

    ``sum_i fmix64(word_i ^ i * golden) + xxh3(dtype, shape, length)``, wrapping
    at 64 bits, over the bytes as little-endian 32-bit words (the tail
    zero-padded). ``one_pass`` (default: on any device but the CPU, whose
    digest is xxh3) runs the compiled single pass over the whole tensor; the
    eager definition mixes ``chunk_words`` at a time so its temporaries stay
    bounded. The result depends on neither.
    """
    tensor = _plain(t)
    data = _storage_bytes(tensor)
    header = _wrap_int64(xxhash.xxh3_64_intdigest(_header(tensor, data.numel())))
    return _word_sum(data, chunk_words=chunk_words, one_pass=one_pass).add_(header)


def one_pass_status() -> str:
    """``compiled``, ``not compiled yet``, or why device digests run the eager definition."""
    if os.environ.get(ONE_PASS_SWITCH) == "0":
        return f"eager ({ONE_PASS_SWITCH}=0)"
    if _one_pass.failure is not None:
        return f"eager (torch.compile failed: {_one_pass.failure})"
    return "compiled" if _one_pass.compiled is not None else "not compiled yet"


def _word_sum(
    data: torch.Tensor, *, chunk_words: int = DEFAULT_CHUNK_WORDS, one_pass: bool | None = None
) -> torch.Tensor:
    """mix64 without the header: the sum over the words of ``data`` (flat uint8), on its device."""
    multiplier = _position_multiplier(data.device)
    if one_pass is None:
        one_pass = data.device.type != "cpu"
    if one_pass:
        total = _one_pass(_as_words(data), multiplier)
        if total is not None:
            return total
    chunk_bytes = 4 * chunk_words
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for first_byte in range(0, data.numel(), chunk_bytes):
        words = _as_words(data[first_byte : first_byte + chunk_bytes])
        total += _mixed_sum(words, first_byte // 4, multiplier)
    return total


@functools.cache
def _position_multiplier(device: torch.device) -> torch.Tensor:
    """The golden-ratio multiplier as a 0-dim tensor on ``device`` (made once per device).

    A tensor, not a constant, because Inductor folds ``arange * constant`` into
    a vectorized arange whose 64-bit step it computes wrongly on the CPU.
    """
    return torch.tensor(_POSITION_MULTIPLIER, dtype=torch.int64, device=device)


def _mixed_sum_from_zero(words: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
    return _mixed_sum(words, 0, multiplier)


class _OnePass:
    """``_mixed_sum`` compiled on first use; ``None`` (eager) after a compile failure.

    ``torch.compile`` cannot trace inside a dispatch mode's handler (bisect's
    operator capture digests every call there), but a graph compiled before
    runs there: until it has run once on a device type, calls from a handler
    get the eager definition, and its failure would not say compiling is broken.
    """

    def __init__(self) -> None:
        self.compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.failure: str | None = None
        self.ready: set[str] = set()  # device types it has run on

    def __call__(self, words: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor | None:
        if self.failure is not None or os.environ.get(ONE_PASS_SWITCH) == "0":
            return None
        if words.device.type not in self.ready and _in_dispatch_handler():
            return None
        try:
            if self.compiled is None:
                self.compiled = torch.compile(_mixed_sum_from_zero, dynamic=True, fullgraph=True)
            with torch.no_grad():  # one graph whatever the caller's grad mode
                total = self.compiled(words, multiplier)
            self.ready.add(words.device.type)
            return total
        except Exception as exc:  # noqa: BLE001 - any compile failure: the eager definition
            self.failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
            warnings.warn(
                f"device digests run eager ({self.failure}); set {ONE_PASS_SWITCH}=0 to skip",
                RuntimeWarning,
                stacklevel=3,
            )
            return None


_one_pass = _OnePass()


def _in_dispatch_handler() -> bool:
    """Running inside a ``TorchDispatchMode.__torch_dispatch__`` (it excludes this key)."""
    return torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.PythonTLSSnapshot)


class _Pending(NamedTuple):
    """A value still on its device: where it will be in the fetched batch, and how to show it."""

    device: torch.device
    position: int
    render: Callable[[int], str]


class Digester:
    """Collects the digests of one step; device digests are fetched to the host together (one sync).

    Work on a device tensor is queued on its stream when it is added, so the
    digest is of the tensor as it was then, even if it changes before
    :meth:`entries`.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[str, str | _Pending]] = []
        self._queued: dict[torch.device, list[torch.Tensor]] = {}
        self._seen: dict[int, tuple[weakref.ref, tuple, str | _Pending]] = {}

    def __len__(self) -> int:
        """How many entries were added since the last :meth:`entries`."""
        return len(self._entries)

    def add(self, name: str, value: SignatureValue) -> None:
        if not isinstance(value, torch.Tensor):
            self._entries.append((name, tensor_digest(value)))
            return
        value = local_shard(value)
        # The same tensor is often captured twice in a step (a container returns its
        # last child's output; a gradient reaches both branches of a residual): hash it once.
        key = (value._version, value.dtype, value.shape, value.stride(), value.storage_offset())
        seen = self._seen.get(id(value))
        if seen is not None and seen[0]() is value and seen[1] == key:
            self._entries.append((name, seen[2]))
            return
        digest = self._digest(value)
        self._seen[id(value)] = (weakref.ref(value), key, digest)
        self._entries.append((name, digest))

    def _digest(self, value: torch.Tensor) -> str | _Pending:
        if value.is_cpu:
            return tensor_digest(value)
        tensor = _plain(value)
        data = _storage_bytes(tensor)
        if data.numel() <= EXACT_MAX_BYTES:
            queued, render = _packed_exact(data), _exact_renderer(tensor.dtype, data.numel())
        else:  # the header is added on the host: one launch per tensor, not two
            header = xxhash.xxh3_64_intdigest(_header(tensor, data.numel()))
            queued, render = _word_sum(data), functools.partial(_hex_plus, header)
        queue = self._queued.setdefault(tensor.device, [])
        queue.append(queued)
        return _Pending(tensor.device, len(queue) - 1, render)

    def entries(self) -> list[tuple[str, str]]:
        """The digests in the order added (one host copy per device); clears the collector."""
        fetched = {
            device: torch.stack(values).cpu().tolist() for device, values in self._queued.items()
        }

        def shown(entry: str | _Pending) -> str:
            if isinstance(entry, str):
                return entry
            return entry.render(fetched[entry.device][entry.position])

        result = [(name, shown(entry)) for name, entry in self._entries]
        self._entries, self._queued, self._seen = [], {}, {}
        return result


def _scalar_digest(value: None | int | float | bool) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):  # before int: bool is an int subclass
        return _exact(torch.bool, bytes([value]))
    if isinstance(value, int):
        return _exact(torch.int64, value.to_bytes(8, "little", signed=True))
    if isinstance(value, float):
        return _exact(torch.float64, struct.pack("<d", value))
    raise TypeError(
        f"cannot digest a {type(value).__name__}; expected a tensor, None, int, float or bool"
    )


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical values in row-major order; no copy when already so."""
    return t.detach().resolve_conj().resolve_neg().contiguous()


def _storage_bytes(contiguous: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return contiguous.reshape(-1).view(torch.uint8)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _header(tensor: torch.Tensor, nbytes: int) -> bytes:
    """What the bytes alone do not say: same bytes as another dtype or shape is another tensor."""
    return _header_of(tensor.dtype, tensor.shape, nbytes)


def _header_of(dtype: torch.dtype, shape: torch.Size, nbytes: int) -> bytes:
    return f"{_dtype_name(dtype)}:{'x'.join(map(str, shape))}:{nbytes}".encode()


def _xxh3(tensor: torch.Tensor, data: torch.Tensor) -> int:
    hasher = xxhash.xxh3_64(_header(tensor, data.numel()))
    hasher.update(data.numpy().data)  # the tensor's own memory, not a copy
    return hasher.intdigest()


def _plain_in_memory(tensor: torch.Tensor) -> bool:
    """Its memory holds the logical values in row-major order (a real tensor is never conj)."""
    return (
        tensor.is_contiguous()
        and not tensor.is_neg()
        and not (tensor.dtype.is_complex and tensor.is_conj())
    )


def _xxh3_in_place(tensor: torch.Tensor) -> int:
    """``_xxh3`` without a single torch call: the hot path of layer-level capture.

    Same value as ``_xxh3``: the header is hashed into a state that is copied,
    then the tensor's memory is read where it lies.
    """
    header, memory = _in_place_reader(tensor.dtype, tensor.shape, tensor.nbytes)
    hasher = header.copy()
    hasher.update(memory.from_address(tensor.data_ptr()))
    return hasher.intdigest()


@functools.lru_cache(maxsize=4096)
def _in_place_reader(
    dtype: torch.dtype, shape: torch.Size, nbytes: int
) -> tuple[xxhash.xxh3_64, type[ctypes.Array]]:
    """The hashed header and the ctypes array type of one layout (a model has a few dozen)."""
    return xxhash.xxh3_64(_header_of(dtype, shape, nbytes)), ctypes.c_char * nbytes


def _as_words(chunk: torch.Tensor) -> torch.Tensor:
    """The chunk's bytes as int32 words; a zero-padded copy (on the device) when unaligned."""
    tail = -chunk.numel() % 4
    if tail or chunk.storage_offset() % 4:
        chunk = torch.cat((chunk, chunk.new_zeros(tail)))
    return chunk.view(torch.int32)


def _mixed_sum(words: torch.Tensor, first_index: int, multiplier: torch.Tensor) -> torch.Tensor:
    """Sum over words of fmix64(word ^ position * golden), all in wrapping int64.

    The eager definition, and what ``torch.compile`` turns into one pass.
    """
    mixed = torch.arange(
        first_index, first_index + words.numel(), dtype=torch.int64, device=words.device
    )
    mixed.mul_(multiplier)
    mixed.bitwise_xor_(words.to(torch.int64).bitwise_and_(_LOW_32_BITS))
    _xor_shift_right_33_(mixed)
    mixed.mul_(_FMIX_MULTIPLIER_1)
    _xor_shift_right_33_(mixed)
    mixed.mul_(_FMIX_MULTIPLIER_2)
    _xor_shift_right_33_(mixed)
    return mixed.sum()


def _xor_shift_right_33_(x: torch.Tensor) -> None:
    """x ^= x >>> 33 (logical): int64 ``>>`` copies the sign bit, so mask it off."""
    x.bitwise_xor_(x.bitwise_right_shift(33).bitwise_and_(_LOW_31_BITS))


def _packed_exact(data: torch.Tensor) -> torch.Tensor:
    """Up to 8 bytes on the device, zero-padded into one 0-dim int64, to fetch with the digests."""
    padded = torch.cat((data, data.new_zeros(EXACT_MAX_BYTES - data.numel())))
    return padded.view(torch.int64).squeeze(0)


def _exact_renderer(dtype: torch.dtype, nbytes: int) -> Callable[[int], str]:
    return lambda packed: _exact(dtype, (packed & _MASK64).to_bytes(8, "little")[:nbytes])


def _exact(dtype: torch.dtype, raw: bytes) -> str:
    """``=dtype:bits``: each element's bit pattern as a number (1.0 is ``=float32:3f800000``)."""
    size = dtype.itemsize
    bits = "".join(raw[start : start + size][::-1].hex() for start in range(0, len(raw), size))
    return f"={_dtype_name(dtype)}:{bits}"


def _hex_plus(header: int, word_sum: int) -> str:
    return _hex(word_sum + header)


def _hex(digest: int) -> str:
    return f"{digest & _MASK64:016x}"
