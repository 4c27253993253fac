"""Resolving a workload reference: builtin:NAME, package.module:function, path/file.py:function.

Every failure is a WorkloadError with a hint (what the CLI turns into exit 3),
never a bare ImportError, TypeError or the factory's own exception.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from conftest import SMALL
from sdcreplay.workloads import tiny_llama, tiny_moe

from sdcreplay import Workload
from sdcreplay.errors import SdcReplayError, WorkloadError
from sdcreplay.workload.definition import (
    accepts_seed,
    build_workload,
    builtin_names,
    resolve_factory,
)

FACTORY_SOURCE = """
import torch
import sdcreplay

def make_workload(seed=0, width=4):
    model = torch.nn.Linear(width, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return sdcreplay.Workload(
        model=model,
        optimizer=optimizer,
        get_batch=lambda i: torch.full((3, width), float(i)),
        loss_fn=lambda m, batch: m(batch).square().mean(),
    )

def no_seed(width=4):
    return make_workload(0, width)

def raises(seed=0):
    raise RuntimeError("the dataset is not mounted")

def not_a_workload(seed=0):
    return {"model": None}

NOT_CALLABLE = 42
"""


def write_module(directory: Path, name: str, source: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    return write_module(tmp_path, "mytrain", FACTORY_SOURCE)


@pytest.fixture
def factory_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A package on sys.path with a unique name (imports are cached per process)."""
    name = f"wlpkg_{tmp_path.name.replace('-', '_')}"
    package = tmp_path / "site" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    write_module(package, "train", FACTORY_SOURCE)
    write_module(package, "broken", "raise ValueError('config file missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return name


def test_builtin_names_resolve_to_the_shipped_factories():
    assert builtin_names() == ["tiny-llama", "tiny-moe"]
    assert resolve_factory("builtin:tiny-llama") is tiny_llama.make_workload
    assert resolve_factory("builtin:tiny-moe") is tiny_moe.make_workload


def test_builtin_builds_a_workload_with_keyword_sizes():
    workload = build_workload("builtin:tiny-llama", dict(SMALL))
    assert isinstance(workload, Workload)
    assert len(workload.model.layers) == 1
    assert workload.model.tok_embeddings.weight.shape == (SMALL["vocab"], SMALL["dim"])
    assert workload.get_batch(0)["tokens"].shape == (SMALL["batch_size"], SMALL["seq_len"] + 1)


def test_same_reference_and_kwargs_rebuild_the_same_parameters():
    first = build_workload("builtin:tiny-moe", {**SMALL, "experts": 2, "seed": 3})
    torch.manual_seed(12345)  # whatever the global RNG holds, the build is the same
    second = build_workload("builtin:tiny-moe", {**SMALL, "experts": 2, "seed": 3})
    for (name, a), (_, b) in zip(
        first.model.state_dict().items(), second.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    other = build_workload("builtin:tiny-moe", {**SMALL, "experts": 2, "seed": 4})
    assert not torch.equal(first.model.tok_embeddings.weight, other.model.tok_embeddings.weight)


def test_package_module_function(factory_package: str):
    workload = build_workload(f"{factory_package}.train:make_workload", {"width": 6})
    assert isinstance(workload, Workload)
    assert workload.model.in_features == 6
    assert torch.equal(workload.get_batch(2), torch.full((3, 6), 2.0))


def test_file_path_function(factory_file: Path):
    workload = build_workload(f"{factory_file}:make_workload", {"width": 5, "seed": 1})
    assert workload.model.in_features == 5
    loss = workload.loss_fn(workload.model, workload.get_batch(1))
    assert loss.shape == ()


def test_file_factory_is_called_under_the_seed(factory_file: Path):
    a = build_workload(f"{factory_file}:make_workload", {"seed": 7})
    b = build_workload(f"{factory_file}:make_workload", {"seed": 7})
    c = build_workload(f"{factory_file}:make_workload", {"seed": 8})
    assert torch.equal(a.model.weight, b.model.weight)
    assert not torch.equal(a.model.weight, c.model.weight)


def test_accepts_seed(factory_file: Path):
    assert accepts_seed("builtin:tiny-llama")
    assert accepts_seed(f"{factory_file}:make_workload")
    assert not accepts_seed(f"{factory_file}:no_seed")


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("builtin:nope", "unknown built-in workload 'nope'"),
        ("builtin:", "unknown built-in workload ''"),
        ("tiny-llama", "cannot read workload reference 'tiny-llama'"),
        (":make_workload", "cannot read workload reference"),
        ("sdcreplay.workload.tiny_llama:", "cannot read workload reference"),
        ("no_such_package_xyz.mod:fn", "cannot import module 'no_such_package_xyz.mod'"),
        ("sdcreplay.workload.tiny_llama:no_such_function", "has no function 'no_such_function'"),
        ("sdcreplay.workload.tiny_llama:F", "has no function 'F'"),  # a module, not a function
        ("/no/such/dir/train.py:make_workload", "does not exist"),
    ],
)
def test_bad_references(ref: str, message: str):
    with pytest.raises(WorkloadError) as info:
        build_workload(ref)
    assert message in info.value.message
    assert info.value.hint


def test_unknown_builtin_hint_lists_the_builtins():
    with pytest.raises(WorkloadError) as info:
        resolve_factory("builtin:nope")
    assert info.value.hint == "Built-in workloads: builtin:tiny-llama, builtin:tiny-moe."


def test_module_that_raises_on_import(factory_package: str):
    with pytest.raises(WorkloadError) as info:
        build_workload(f"{factory_package}.broken:make_workload")
    assert "raised ValueError: config file missing" in info.value.message


def test_file_that_raises_on_load(tmp_path: Path):
    path = write_module(tmp_path, "bad", "import torch\nx = 1 / 0\n")
    with pytest.raises(WorkloadError) as info:
        build_workload(f"{path}:make_workload")
    assert "raised ZeroDivisionError" in info.value.message


def test_file_with_a_syntax_error(tmp_path: Path):
    path = write_module(tmp_path, "syntax", "def make_workload(:\n")
    with pytest.raises(WorkloadError) as info:
        build_workload(f"{path}:make_workload")
    assert "raised SyntaxError" in info.value.message


def test_attribute_that_is_not_callable(factory_file: Path):
    with pytest.raises(WorkloadError, match="has no function 'NOT_CALLABLE'"):
        build_workload(f"{factory_file}:NOT_CALLABLE")


def test_factory_that_raises(factory_file: Path):
    with pytest.raises(WorkloadError) as info:
        build_workload(f"{factory_file}:raises")
    assert info.value.message == (
        f"workload '{factory_file}:raises' raised RuntimeError: the dataset is not mounted"
    )
    assert "SDCREPLAY_DEBUG=1" in info.value.hint
    assert isinstance(info.value.__cause__, RuntimeError)


def test_factory_that_returns_something_else(factory_file: Path):
    with pytest.raises(WorkloadError, match="returned dict, not sdcreplay.Workload"):
        build_workload(f"{factory_file}:not_a_workload")


def test_wrong_keyword_arguments(factory_file: Path):
    with pytest.raises(WorkloadError) as info:
        build_workload(f"{factory_file}:make_workload", {"depth": 3})
    assert "does not take these arguments" in info.value.message
    assert "depth" in info.value.message
    assert info.value.hint == f"Its signature is {factory_file}:make_workload(seed=0, width=4)."


def test_wrong_keyword_for_a_builtin():
    with pytest.raises(WorkloadError, match="does not take these arguments"):
        build_workload("builtin:tiny-llama", {"experts": 4})


def test_seed_that_is_not_an_integer():
    with pytest.raises(WorkloadError, match="seed must be an integer"):
        build_workload("builtin:tiny-llama", {"seed": "abc"})


def test_invalid_sizes_surface_as_workload_errors():
    # dim=30 does not split into 4 heads: the factory's ValueError is wrapped.
    with pytest.raises(WorkloadError, match="raised ValueError"):
        build_workload("builtin:tiny-llama", {"dim": 30, "heads": 4})


def test_every_workload_error_is_a_tool_error():
    assert issubclass(WorkloadError, SdcReplayError)
