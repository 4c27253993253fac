"""Tensors and nests of them in HDF5: every dtype bit for bit, structure exact, strides kept."""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from bundle_fuzz import unreadable_structures

from sdcreplay.errors import BundleError
from sdcreplay.storage import tensorio

FLOAT8 = [
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
]
UNSIGNED_WIDE = [
    getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)
]
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    *FLOAT8,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    *UNSIGNED_WIDE,
    torch.bool,
]


def bits(tensor: torch.Tensor) -> bytes:
    """The raw storage bytes of the logical values (exact: NaN payloads, -0.0, ...)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype: torch.dtype, shape=(3, 5), seed: int = 0) -> torch.Tensor:
    """Every bit pattern is fair game, NaNs and infinities included."""
    generator = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, width), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


@pytest.fixture
def h5(tmp_path: Path):
    with h5py.File(tmp_path / "t.h5", "w") as handle:
        yield handle


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(h5, dtype: torch.dtype):
    tensor = random_tensor(dtype)
    tensorio.write_tensor(h5, "x", tensor)
    back = tensorio.read_tensor(h5["x"])
    assert back.dtype == dtype
    assert back.shape == tensor.shape
    assert bits(back) == bits(tensor)


def test_special_float_values_keep_their_bits(h5):
    values = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -3.4e38])
    payload_nan = (
        torch.tensor([0x7FC00001, 0xFFA00000], dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )
    tensor = torch.cat([values, payload_nan])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = f"x_{tensorio.dtype_name(dtype)}"
        source = tensor if dtype is torch.float32 else tensor.to(dtype)
        tensorio.write_tensor(h5, name, source)
        assert bits(tensorio.read_tensor(h5[name])) == bits(source)


def test_non_numpy_dtypes_are_stored_as_unsigned_words_readable_with_h5py(h5):
    bf16 = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16)
    tensorio.write_tensor(h5, "bf16", bf16)
    dataset = h5["bf16"]
    assert dataset.dtype == np.uint16
    assert dataset.attrs["dtype"] == "bfloat16"
    # What a reader without torch does: bfloat16 is the top half of a float32.
    as_float32 = (dataset[()].astype(np.uint32) << 16).view(np.float32)
    assert as_float32.tolist() == [1.0, -2.5, 3.0]
    if FLOAT8:
        fp8 = torch.tensor([0.5, -1.0], dtype=torch.float32).to(FLOAT8[0])
        tensorio.write_tensor(h5, "fp8", fp8)
        assert h5["fp8"].dtype == np.uint8
        assert h5["fp8"][()].tolist() == fp8.view(torch.uint8).tolist()


def test_native_dtypes_are_stored_natively(h5):
    tensorio.write_tensor(h5, "f", torch.arange(4, dtype=torch.float32))
    tensorio.write_tensor(h5, "b", torch.tensor([True, False]))
    assert h5["f"].dtype == np.float32 and h5["f"][()].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert h5["b"].dtype == np.bool_
    assert list(h5["f"].attrs["shape"]) == [4]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(2.5),
        torch.tensor(7, dtype=torch.int64),
        torch.zeros(0, 3),
        torch.zeros(2, 0, 4, dtype=torch.bfloat16),
    ],
    ids=["scalar", "int-scalar", "empty", "empty-bf16"],
)
def test_scalars_and_empty_tensors_keep_their_shape(h5, tensor: torch.Tensor):
    tensorio.write_tensor(h5, "x", tensor)
    back = tensorio.read_tensor(h5["x"])
    assert back.shape == tensor.shape and back.dtype == tensor.dtype
    assert bits(back) == bits(tensor)


BASE = torch.arange(48, dtype=torch.float32).reshape(6, 8)
STRIDED = {
    "transposed": BASE.t(),
    "every-other-column": BASE[:, ::2],
    "narrowed": BASE[1:4, 2:7],
    "permuted-3d": torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1),
    "broadcast": torch.arange(3.0).expand(4, 3),
    "broadcast-inner": torch.arange(4.0).reshape(4, 1).expand(4, 5),
}


@pytest.mark.parametrize("name", sorted(STRIDED))
def test_strides_are_kept(h5, name: str):
    tensor = STRIDED[name]
    tensorio.write_tensor(h5, "x", tensor)
    assert list(h5["x"].attrs["stride"]) == list(tensor.stride())
    plain = tensorio.read_tensor(h5["x"])
    assert plain.is_contiguous() and torch.equal(plain, tensor)
    strided = tensorio.read_tensor(h5["x"], keep_strides=True)
    assert strided.stride() == tensor.stride()
    assert torch.equal(strided, tensor)


def test_read_tree_can_keep_strides(h5):
    tree = {"a": BASE.t(), "b": [BASE[:, ::2]]}
    tensorio.write_tree(h5.create_group("g"), tree)
    back = tensorio.read_tree(h5["g"], keep_strides=True)
    assert back["a"].stride() == BASE.t().stride()
    assert back["b"][0].stride() == BASE[:, ::2].stride()
    assert tensorio.read_tree(h5["g"])["a"].is_contiguous()


@pytest.mark.parametrize(
    "stride",
    [[10**12, 1], [1, 1], [-4, 1], [4]],
    ids=["huge", "overlapping", "negative", "wrong-rank"],
)
def test_damaged_strides_fall_back_to_a_contiguous_tensor(h5, stride):
    tensor = torch.arange(12.0).reshape(3, 4)
    tensorio.write_tensor(h5, "x", tensor)
    h5["x"].attrs["stride"] = stride
    back = tensorio.read_tensor(h5["x"], keep_strides=True)
    assert back.is_contiguous() and torch.equal(back, tensor)


def test_nested_tree_round_trip(h5):
    tree = {
        "tokens": torch.arange(6).reshape(2, 3),
        "mask": torch.tensor([[True, False, True]]),
        "pair": (torch.ones(2, dtype=torch.bfloat16), [1, 2.5, None, "text", False]),
        0: {"step": torch.tensor(3.0), 1: (torch.zeros(1),)},
        7: [],
        "empty": {},
        "dtype": torch.float16,
        "nan": math.nan,
        "where": (torch.device("cpu"), torch.strided, torch.channels_last),
    }
    tensorio.write_tree(h5.create_group("tree"), tree)
    back = tensorio.read_tree(h5["tree"])
    assert list(back) == ["tokens", "mask", "pair", 0, 7, "empty", "dtype", "nan", "where"]
    assert back["where"] == (torch.device("cpu"), torch.strided, torch.channels_last)
    assert isinstance(back["pair"], tuple) and isinstance(back["pair"][1], list)
    assert back["pair"][1] == [1, 2.5, None, "text", False]
    assert isinstance(back[0], dict) and list(back[0]) == ["step", 1]
    assert isinstance(back[0][1], tuple) and torch.equal(back[0][1][0], torch.zeros(1))
    assert back[7] == [] and back["empty"] == {}
    assert back["dtype"] is torch.float16
    assert math.isnan(back["nan"])
    assert torch.equal(back["tokens"], tree["tokens"]) and back["tokens"].dtype == torch.int64
    assert torch.equal(back["mask"], tree["mask"])
    assert back["pair"][0].dtype == torch.bfloat16


def test_int_and_str_keys_stay_distinct(h5):
    tree = {1: torch.tensor([1.0]), "1": torch.tensor([2.0]), 2.5: "float key", None: "none key"}
    tensorio.write_tree(h5.create_group("g"), tree)
    back = tensorio.read_tree(h5["g"])
    assert list(back) == [1, "1", 2.5, None]
    assert torch.equal(back[1], torch.tensor([1.0]))
    assert torch.equal(back["1"], torch.tensor([2.0]))
    assert back[2.5] == "float key" and back[None] == "none key"


def test_optimizer_state_dict_round_trip(h5):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    tensorio.write_tree(h5.create_group("opt"), state)
    back = tensorio.read_tree(h5["opt"])
    assert list(back["state"]) == [0, 1]
    assert back["param_groups"][0]["betas"] == state["param_groups"][0]["betas"]
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    fresh.load_state_dict(back)
    assert fresh.param_groups[0]["lr"] == 0.01
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_skeleton_is_plain_json(h5):
    tensorio.write_tree(h5.create_group("g"), {"x": torch.zeros(2), 3: (1, "a")})
    skeleton = json.loads(h5["g"].attrs["skeleton"])
    assert skeleton == {
        "dict": [["x", {"tensor": "t0"}], [3, {"tuple": [{"value": 1}, {"value": "a"}]}]]
    }


@pytest.mark.parametrize(
    "value", [{1, 2}, object(), {(1, 2): 3}, b"bytes"], ids=["set", "object", "tuple-key", "bytes"]
)
def test_unstorable_values_raise_bundle_error(h5, value):
    with pytest.raises(BundleError, match="cannot store"):
        tensorio.write_tree(h5.create_group("g"), {"v": value})


@pytest.mark.parametrize(
    "skeleton",
    [
        '{"tensor": "t9"}',
        '{"dict": [["a"]]}',
        '{"list": 3}',
        '{"weird": 1}',
        "[1, 2]",
        "not json",
        '{"dtype": "nope"}',
        '{"device": "nope:x"}',
        '{"layout": "nope"}',
        '{"memory_format": "float32"}',
    ],
)
def test_malformed_skeletons_raise_bundle_error(h5, skeleton: str):
    group = h5.create_group("g")
    tensorio.write_tree(group, [torch.zeros(1)])
    group.attrs["skeleton"] = skeleton
    with pytest.raises(BundleError):
        tensorio.read_tree(group)


def test_tree_without_skeleton_raises_bundle_error(h5):
    with pytest.raises(BundleError, match="no readable structure"):
        tensorio.read_tree(h5.create_group("g"))


def test_bad_tensor_attributes_raise_bundle_error(h5):
    tensorio.write_tensor(h5, "a", torch.zeros(2, 3))
    h5["a"].attrs["dtype"] = "float99"
    with pytest.raises(BundleError, match="unknown tensor dtype 'float99'"):
        tensorio.read_tensor(h5["a"])
    tensorio.write_tensor(h5, "b", torch.zeros(2, 3))
    h5["b"].attrs["shape"] = [4, 4]
    with pytest.raises(BundleError, match="expected \\[4, 4\\]"):
        tensorio.read_tensor(h5["b"])
    tensorio.write_tensor(h5, "c", torch.zeros(2))
    del h5["c"].attrs["dtype"]
    with pytest.raises(BundleError, match="cannot read tensor"):
        tensorio.read_tensor(h5["c"])


def test_map_tensors_keeps_the_structure():
    tree = {"a": torch.ones(1), "b": [torch.zeros(1), (torch.ones(2), 3)], "c": "s"}
    doubled = tensorio.map_tensors(tree, lambda t: t * 2)
    assert torch.equal(doubled["a"], torch.tensor([2.0]))
    assert isinstance(doubled["b"][1], tuple) and doubled["b"][1][1] == 3
    assert doubled["c"] == "s"


def test_a_tree_whose_structure_cannot_be_read_names_the_damaged_file(tmp_path: Path):
    """The structure is a variable-length string kept in the file's global heap; walking the
    file never reads it, loading the tree does (a bundle's state.h5 in a device process)."""
    path = tmp_path / "state.h5"
    with h5py.File(path, "w") as handle:
        tensorio.write_tree(handle.create_group("model"), {"w": torch.ones(2)})
    unreadable_structures(path, b"GCOL")
    with h5py.File(path, "r") as handle, pytest.raises(BundleError) as caught:
        tensorio.read_tree(handle["model"])
    assert caught.value.message == (
        f"{path} is damaged: OSError: Can't synchronously read data "
        "(bad global heap collection signature)"
    )
