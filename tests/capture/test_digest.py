"""The digests must see what torch.hash_tensor cannot: every bit, every position."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import xxhash
from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from sdcreplay.capture import digest as digest_module
from sdcreplay.capture.digest import (
    CPU_ALGORITHM,
    DEVICE_ALGORITHM,
    ONE_PASS_SWITCH,
    Digester,
    _exact_renderer,
    _packed_exact,
    algorithm_for,
    mix64,
    one_pass_status,
    tensor_digest,
)

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
NUMEL = 37  # odd, so 1- and 2-byte dtypes leave a partial 32-bit word at the end
MASK64 = (1 << 64) - 1


def mix64_digest(tensor: torch.Tensor) -> str:
    return f"{int(mix64(tensor)) & MASK64:016x}"


def one_pass_digest(tensor: torch.Tensor) -> str:
    """mix64 through torch.compile (Inductor's C++ here, Triton on a GPU), checked against eager.

    Every test of the digest's properties runs through it, so the compiled pass
    is held to the eager definition on every dtype and shape here. One graph
    (``dynamic=True``) serves them all: the compile is paid once per session.
    """
    compiled = mix64(tensor, one_pass=True)
    eager = mix64(tensor, one_pass=False, chunk_words=7)  # several chunks: positions carry over
    assert int(compiled) == int(eager), (tensor.dtype, tuple(tensor.shape))
    return f"{int(compiled) & MASK64:016x}"


DIGESTS = {"xxh3": tensor_digest, "mix64": mix64_digest, "mix64 one pass": one_pass_digest}
each_digest = pytest.mark.parametrize("digest", DIGESTS.values(), ids=DIGESTS.keys())


def needs_cuda(test):
    """A GPU test: marked ``gpu`` and skipped where no CUDA device is present."""
    skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return pytest.mark.gpu(skip_without_cuda(test))


def random_tensor(dtype: torch.dtype, numel: int = NUMEL, seed: int = 0) -> torch.Tensor:
    """Random storage bytes of ``dtype`` (NaNs and all: the digest sees bits, not values)."""
    generator = torch.Generator().manual_seed(seed)
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def elements(tensor: torch.Tensor) -> torch.Tensor:
    """One row of storage bytes per element; writing to it writes the tensor."""
    return tensor.view(torch.uint8).view(-1, tensor.dtype.itemsize)


def flipped(tensor: torch.Tensor, *indices: int, bit: int) -> torch.Tensor:
    """A copy with storage bit ``bit`` (little-endian) flipped in each element at ``indices``."""
    corrupted = tensor.clone()
    for index in indices:
        elements(corrupted)[index, bit // 8] ^= 1 << (bit % 8)
    return corrupted


def swapped(tensor: torch.Tensor, first: int, second: int) -> torch.Tensor:
    corrupted = tensor.clone()
    elements(corrupted)[[first, second]] = elements(tensor)[[second, first]]
    return corrupted


def with_elements(tensor: torch.Tensor, indices: list[int], raw: list[int]) -> torch.Tensor:
    """A copy whose elements at ``indices`` all hold the storage bytes ``raw``."""
    changed = tensor.clone()
    elements(changed)[indices] = torch.tensor(raw, dtype=torch.uint8)
    return changed


def reference_mix64(tensor: torch.Tensor) -> int:
    """mix64 in plain Python integers: the algorithm as written down, for a small tensor."""
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    shape = "x".join(str(size) for size in tensor.shape)
    header = f"{str(tensor.dtype).removeprefix('torch.')}:{shape}:{len(raw)}"
    raw += bytes(-len(raw) % 4)
    total = 0
    for index in range(len(raw) // 4):
        x = int.from_bytes(raw[4 * index : 4 * index + 4], "little")
        x ^= index * 0x9E3779B97F4A7C15 & MASK64
        x ^= x >> 33
        x = x * 0xFF51AFD7ED558CCD & MASK64
        x ^= x >> 33
        x = x * 0xC4CEB9FE1A85EC53 & MASK64
        x ^= x >> 33
        total += x
    return (total + xxhash.xxh3_64_intdigest(header.encode())) & MASK64


@each_digest
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), index=st.integers(0, NUMEL - 1), bit=st.integers(0, 63))
def test_any_single_bit_flip_changes_the_digest(digest, dtype, index, bit):
    tensor = random_tensor(dtype, seed=index)
    assert digest(flipped(tensor, index, bit=bit % (8 * dtype.itemsize))) != digest(tensor)


@each_digest
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bit_of_an_element_gives_its_own_digest(digest, dtype):
    tensor = random_tensor(dtype)
    bits = range(8 * dtype.itemsize)
    corrupted = {digest(flipped(tensor, NUMEL // 2, bit=bit)) for bit in bits}
    assert len(corrupted) == len(bits)
    assert digest(tensor) not in corrupted


@each_digest
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swapping_two_unequal_elements_changes_the_digest(digest, dtype):
    tensor = with_elements(random_tensor(dtype), [3], [1] * dtype.itemsize)
    tensor = with_elements(tensor, [30], [0] * dtype.itemsize)
    assert digest(swapped(tensor, 3, 30)) != digest(tensor)


@each_digest
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_same_bit_flipped_in_two_elements_changes_the_digest(digest, dtype):
    tensor = random_tensor(dtype)
    for bit in range(8 * dtype.itemsize):
        assert digest(flipped(tensor, 4, 20, bit=bit)) != digest(tensor)


@each_digest
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_equal_elements_changed_together_change_the_digest(digest, dtype):
    before = with_elements(random_tensor(dtype), [2, 33], [1] * dtype.itemsize)
    after = with_elements(before, [2, 33], [0] * dtype.itemsize)
    assert digest(after) != digest(before)


def pair_corruptions(tensor: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The corruptions an XOR of elements cannot see, on real values (mantissa bit 3 flipped)."""
    equal_pair = tensor.clone()
    equal_pair[[5, 9]] = 3
    changed_pair = equal_pair.clone()
    changed_pair[[5, 9]] = 5
    return {
        "swap": (tensor, swapped(tensor, 0, 1)),
        "same bit in two elements": (tensor, flipped(tensor, 2, 7, bit=3)),
        "equal pair changed together": (equal_pair, changed_pair),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=str)
def test_hash_tensor_misses_what_ours_sees(dtype):
    generator = torch.Generator().manual_seed(1)
    tensor = (torch.randn(64, generator=generator) * 100).to(dtype)
    for kind, (before, after) in pair_corruptions(tensor).items():
        assert not torch.equal(before.view(torch.uint8), after.view(torch.uint8)), kind
        assert torch.hash_tensor(after) == torch.hash_tensor(before), kind
        for digest in DIGESTS.values():
            assert digest(after) != digest(before), kind


def test_hash_tensor_refuses_dtypes_that_ours_digests():
    tensor = random_tensor(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError):
        torch.hash_tensor(tensor)
    assert tensor_digest(tensor) != tensor_digest(flipped(tensor, 0, bit=0))


@each_digest
def test_same_bytes_as_another_shape_or_dtype_is_another_digest(digest):
    tensor = random_tensor(torch.float32, numel=24)
    views = [
        tensor,
        tensor.view(4, 6),
        tensor.view(6, 4),
        tensor.view(torch.int32),
        tensor.view(torch.bfloat16),
    ]
    assert len({digest(view) for view in views}) == len(views)


@each_digest
def test_a_non_contiguous_tensor_digests_as_its_contiguous_copy(digest):
    matrix = random_tensor(torch.float32, numel=60).view(6, 10)
    for view in [matrix.T, matrix[:, 1:7], matrix[::2], matrix.bfloat16()[1:]]:
        assert digest(view) == digest(view.contiguous().clone())


@each_digest
def test_views_that_need_resolving_digest_as_their_values(digest):
    weight = torch.randn(16, requires_grad=True)
    assert digest(weight) == digest(weight.detach().clone())
    complex_values = torch.randn(8, dtype=torch.complex64)
    assert digest(complex_values.conj()) == digest(complex_values.conj().resolve_conj())
    assert digest(complex_values.conj()) != digest(complex_values)


@each_digest
@pytest.mark.parametrize(
    "dtype", DTYPES + [torch.complex64, torch.uint16, torch.float8_e8m0fnu], ids=str
)
def test_digests_are_deterministic_64_bit_hex(digest, dtype):
    tensor = random_tensor(dtype)
    assert re.fullmatch(r"[0-9a-f]{16}", digest(tensor))
    assert digest(tensor) == digest(tensor) == digest(tensor.clone())


def test_small_values_are_kept_exactly():
    assert tensor_digest(None) == "none"
    assert tensor_digest(torch.tensor(1.0)) == "=float32:3f800000"
    assert tensor_digest(torch.tensor(1.0, dtype=torch.bfloat16)) == "=bfloat16:3f80"
    assert tensor_digest(torch.tensor([1.0, -2.0])) == "=float32:3f800000c0000000"
    assert tensor_digest(torch.tensor([1, 2], dtype=torch.int16)) == "=int16:00010002"
    assert tensor_digest(torch.tensor(True)) == "=bool:01"
    assert tensor_digest(1.0) == "=float64:3ff0000000000000"
    assert tensor_digest(-1) == "=int64:ffffffffffffffff"
    assert tensor_digest(True) == "=bool:01"
    assert tensor_digest(torch.tensor(7, dtype=torch.uint8)) == "=uint8:07"
    assert re.fullmatch(r"[0-9a-f]{16}", tensor_digest(torch.zeros(9, dtype=torch.uint8)))


def test_other_values_are_refused():
    with pytest.raises(TypeError, match="str"):
        tensor_digest("loss")


def test_digester_returns_entries_in_order_and_clears():
    values = {
        "forward:layers.0": torch.randn(4, 8),
        "loss": torch.tensor(2.5),
        "grad:layers.0.weight": None,
        "step": 3,
        "param:layers.0.weight": torch.randn(3, 3, requires_grad=True).T,
    }
    digester = Digester()
    for name, value in values.items():
        digester.add(name, value)
    assert digester.entries() == [(name, tensor_digest(value)) for name, value in values.items()]
    assert digester.entries() == []


@pytest.mark.parametrize(
    "small",
    [torch.tensor(2.5), torch.tensor([1, -2], dtype=torch.int32), torch.tensor([True] * 3)],
    ids=str,
)
def test_small_values_packed_for_one_device_copy_read_back_exactly(small):
    """The Digester's device path for small values, exercised on the CPU."""
    raw = small.reshape(-1).view(torch.uint8)
    packed = _packed_exact(raw)
    assert packed.dtype == torch.int64 and packed.dim() == 0
    assert _exact_renderer(small.dtype, raw.numel())(int(packed)) == tensor_digest(small)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.bool], ids=str)
@pytest.mark.parametrize("numel", [3, 37, 1000])
def test_mix64_is_the_reference_algorithm_whatever_the_chunk_size(dtype, numel):
    tensor = random_tensor(dtype, numel=numel)
    expected = reference_mix64(tensor)
    for chunk_words in [1, 3, 7, 64, 1 << 23]:
        result = mix64(tensor, chunk_words=chunk_words)
        assert result.dtype == torch.int64 and result.dim() == 0
        assert int(result) & MASK64 == expected


def test_algorithm_names():
    assert algorithm_for("cpu") == CPU_ALGORITHM == "xxh3-64"
    assert algorithm_for("cpu:1") == CPU_ALGORITHM
    assert algorithm_for("cuda") == DEVICE_ALGORITHM == "mix64"


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mix64_on_cuda_equals_mix64_on_cpu(dtype):
    tensor = random_tensor(dtype, numel=(1 << 20) + 3)
    on_cuda = mix64(tensor.cuda(), chunk_words=1 << 16)
    assert on_cuda.device.type == "cuda"
    assert int(on_cuda) == int(mix64(tensor))
    assert tensor_digest(tensor.cuda()) == mix64_digest(tensor)


@needs_cuda
def test_digester_on_cuda_matches_tensor_digest_and_small_values_match_the_cpu():
    values = {
        "loss": torch.tensor(2.5, device="cuda"),
        "pair": torch.tensor([1, -2], dtype=torch.int32, device="cuda"),
        "cpu": torch.randn(10),
        "activations": torch.randn(8, 8, device="cuda").bfloat16(),
        "none": None,
    }
    digester = Digester()
    for name, value in values.items():
        digester.add(name, value)
    entries = dict(digester.entries())
    assert list(entries) == list(values)
    assert entries == {name: tensor_digest(value) for name, value in values.items()}
    assert entries["loss"] == tensor_digest(values["loss"].cpu()) == "=float32:40200000"
    assert entries["pair"] == "=int32:00000001fffffffe"


def c_compiler_present() -> bool:
    return any(shutil.which(name) for name in ("g++", "c++", "clang++"))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64], ids=str
)
def test_one_pass_equals_the_eager_definition_on_large_and_unaligned_tensors(dtype):
    tensor = random_tensor(dtype, numel=(1 << 16) + 3).view(-1)
    # whole, starting off a word boundary, a partial last word, a short reshaped slice
    for case in [tensor, tensor[1:], tensor[:-1].view(1, -1), tensor[5:].reshape(-1)[:999]]:
        assert one_pass_digest(case) == mix64_digest(case)
    short = tensor[3:40].view(1, 37)
    assert one_pass_digest(short) == f"{reference_mix64(short):016x}"
    if c_compiler_present():
        assert one_pass_status() == "compiled"


@pytest.fixture
def fresh_one_pass(monkeypatch):
    """A one-pass digest that has not been compiled yet (the session's compiled one is kept)."""
    fresh = digest_module._OnePass()
    monkeypatch.setattr(digest_module, "_one_pass", fresh)
    return fresh


def test_a_failed_compile_falls_back_to_the_eager_definition(fresh_one_pass, monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("InductorError: no working C++ compiler found\nmore detail")

    monkeypatch.setattr(torch, "compile", no_compiler)
    tensor = random_tensor(torch.bfloat16, numel=101)
    with pytest.warns(RuntimeWarning, match="device digests run eager"):
        fallback = mix64(tensor, one_pass=True)
    assert int(fallback) & MASK64 == reference_mix64(tensor)
    assert one_pass_status() == (
        "eager (torch.compile failed: RuntimeError: InductorError: no working C++ compiler found)"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not on every tensor
        assert int(mix64(tensor, one_pass=True)) == int(fallback)


def test_the_switch_turns_the_one_pass_off(fresh_one_pass, monkeypatch):
    monkeypatch.setenv(ONE_PASS_SWITCH, "0")
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled despite it"))
    tensor = random_tensor(torch.float32, numel=50)
    assert int(mix64(tensor, one_pass=True)) & MASK64 == reference_mix64(tensor)
    assert one_pass_status() == f"eager ({ONE_PASS_SWITCH}=0)"


@needs_cuda
def test_digester_on_cuda_never_waits_for_the_device_until_entries():
    tensors = [torch.randn(n, device="cuda") for n in (3, 1000, 1 << 20)]
    digester = Digester()
    for tensor in tensors:  # a first step: compiles, and Triton may time its configs per size
        digester.add("warm-up", tensor.clone())
    digester.entries()
    torch.cuda.set_sync_debug_mode("error")  # every later step: no sync until entries()
    try:
        for index, tensor in enumerate(tensors):
            digester.add(f"t{index}", tensor)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager = {
        f"t{i}": f"{int(mix64(t, one_pass=False)) & MASK64:016x}" for i, t in enumerate(tensors)
    }
    assert dict(digester.entries()) == eager
    assert one_pass_status() == "compiled"


@pytest.mark.slow
def test_gpu_check_runs_its_cpu_parts_and_says_so(tmp_path):
    """`make gpu-check` on a machine without a GPU (here in --quick mode: the smallest sizes)."""
    script = REPO / "bench" / "gpu_check.py"
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(script), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = (tmp_path / "gpu-check" / "table.md").read_text()
    assert table in done.stdout and "no GPU: the CPU-checkable parts ran on the CPU" in table
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith(("| part", "| ---"))
    }
    assert rows == {
        "gpu-marked tests": "skipped",
        "digest vs torch.hash_tensor (cpu)": "ok",
        "bisect operator capture (cpu)": "ok",
        "minimize trials/s (cpu)": "ok",
    }
    assert "ours/hash_tensor" in table and "of the plain step" in table and "of bare" in table
    assert {path.name for path in (tmp_path / "gpu-check").iterdir()} >= {
        "table.md",
        "digest.log",
        "capture-factor.log",
        "minimize-throughput.log",
    }


def test_one_pass_inside_a_dispatch_handler_waits_for_a_graph_compiled_outside(fresh_one_pass):
    """bisect's operator capture digests in a dispatch mode's handler, where torch.compile
    cannot trace: there the eager definition runs, with no warning, until a graph exists."""
    results = []

    class Digesting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            results.append((mix64(out, one_pass=True), fresh_one_pass.ready.copy()))
            return out

    tensor = random_tensor(torch.float32, numel=40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Digesting():
            torch.neg(tensor)
        assert one_pass_status() == "not compiled yet" and results[0][1] == set()
        outside = mix64(tensor, one_pass=True)  # compiles (or reuses the session's graph)
        with Digesting():
            torch.neg(tensor)
    if c_compiler_present():
        assert one_pass_status() == "compiled" and results[1][1] == {"cpu"}
    expected = int(mix64(-tensor, one_pass=False))
    assert [int(total) for total, _ in results] == [expected, expected]
    assert int(outside) == int(mix64(tensor, one_pass=False))
