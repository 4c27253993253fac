"""Resolving a workload reference: builtin:NAME, package.module:function, path/file.py:function.

Every failure is a WorkloadError with a hint (what the CLI turns into exit 3),
never a bare ImportError, TypeError or the factory's own exception.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMALL
from sdcreplay.workloads import tiny_llama, tiny_moe

from sdcreplay import Workload
from sdcreplay.bundle.manifest import MANIFEST, MANIFEST_DIGEST, manifest_digest
from sdcreplay.errors import SdcReplayError, WorkloadError
from sdcreplay.workload.definition import accepts_seed, build_workload, resolve_factory
from sdcreplay.workload.references import (
    builtin_defaults,
    builtin_names,
    canonical_ref,
    recorded_ref,
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


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe"])
def test_a_builtins_defaults_read_from_its_source_are_its_signatures(name: str):
    """`diff` fills in a built-in's defaults without importing it (and torch)."""
    parameters = inspect.signature(resolve_factory(f"builtin:{name}")).parameters.values()
    assert builtin_defaults(f"builtin:{name}") == {
        p.name: p.default for p in parameters if p.default is not p.empty
    }
    assert builtin_defaults("builtin:no-such") == {}


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


# The reference a bundle keeps: one a replay resolves from any directory (docs/recording.md).

LOOP_SCRIPT = """
import torch
import sdcreplay
from helpers import batch_of  # a module beside the script, as a user's loop has

def make_workload(seed=0, width=4):
    model = torch.nn.Linear(width, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(batch):
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return sdcreplay.Workload(model=model, optimizer=optimizer, get_batch=batch_of,
                              train_step=train_step)

if __name__ == "__main__":
    workload = make_workload()
    rec = sdcreplay.Recorder("run.bundle", workload="mytrain:make_workload",
                             model=workload.model, optimizer=workload.optimizer)
    for index in range(3):
        batch = workload.get_batch(index)
        with rec.step(batch):
            workload.train_step(batch)
    rec.close()
"""


HELPERS = """
import torch

def batch_of(index):
    return torch.full((3, 4), float(index))
"""


def test_own_loop_bundle_replays_from_a_fresh_shell_elsewhere(tmp_path: Path, sdcreplay_exe):
    """README's own-loop snippet, literally: `python mytrain.py` names `mytrain:make_workload`;
    replay and ops then run from another directory with nothing of the script's on the path."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    write_module(project, "mytrain", LOOP_SCRIPT)
    write_module(project, "helpers", HELPERS)
    # Only the package under test on the path (this checkout), never the script's directory.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    recorded = subprocess.run(
        [sys.executable, "mytrain.py"], cwd=project, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert recorded.returncode == 0, recorded.stderr
    manifest = json.loads((project / "run.bundle" / "manifest.json").read_text())
    assert manifest["workload"]["ref"] == f"{(project / 'mytrain.py').resolve()}:make_workload"
    bundle = project / "run.bundle"
    replay = subprocess.run(
        [sdcreplay_exe, "replay", str(bundle), "-d", "cpu:0", "-d", "cpu:1", "--json"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["consensus"]["verdict"] == "correct"
    assert "replaying: 2/2, all finished" in replay.stderr
    ops = subprocess.run(
        [sdcreplay_exe, "ops", str(bundle), "--step", "1", "--op", "aten.mm", "--json"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ops.returncode == 0, ops.stderr
    calls = json.loads(ops.stdout)["calls"]
    assert [(c["index"], c["phase"], c["module"], c["op"]) for c in calls] == [
        (11, "backward", "<root>", "aten.mm.default")
    ]


def test_module_found_only_here_is_stored_as_its_file(tmp_path: Path, monkeypatch):
    write_module(tmp_path, "here_only_train", FACTORY_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    expected = f"{(tmp_path / 'here_only_train.py').resolve()}:make_workload"
    assert canonical_ref("here_only_train:make_workload") == expected
    assert recorded_ref("here_only_train:make_workload") == expected
    assert canonical_ref("here_only_train.py:make_workload") == expected  # relative file
    assert "here_only_train" not in sys.modules  # located, never imported


def test_module_every_process_finds_is_kept(tmp_path: Path, monkeypatch):
    site_dir = tmp_path / "lib"
    site_dir.mkdir()
    write_module(site_dir, "lasting_train", FACTORY_SOURCE)
    monkeypatch.chdir(site_dir)  # found through this directory, and through PYTHONPATH as well
    monkeypatch.syspath_prepend(str(site_dir))
    monkeypatch.setenv("PYTHONPATH", str(site_dir))
    assert recorded_ref("lasting_train:make_workload") == "lasting_train:make_workload"
    monkeypatch.chdir(tmp_path)
    assert recorded_ref("sdcreplay.workload.tiny_llama:make_workload") == (
        "sdcreplay.workload.tiny_llama:make_workload"
    )
    assert recorded_ref("builtin:tiny-llama") == "builtin:tiny-llama"


def test_reference_no_replay_could_import_is_refused_while_recording(tmp_path: Path, monkeypatch):
    package = tmp_path / "localpkg_unique"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write_module(package, "train", FACTORY_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(WorkloadError) as info:
        recorded_ref("localpkg_unique.train:make_workload")
    assert info.value.message == (
        "workload 'localpkg_unique.train:make_workload': package 'localpkg_unique' is found "
        f"only through this directory ({tmp_path.resolve()}), so a replay started elsewhere "
        "could not import it"
    )
    assert "path/to/train.py:make_workload" in info.value.hint
    with pytest.raises(WorkloadError, match="no module 'no_such_module_xyz' can be found"):
        recorded_ref("no_such_module_xyz:make_workload")
    assert canonical_ref("no_such_module_xyz:make_workload") == "no_such_module_xyz:make_workload"


def test_device_that_cannot_import_the_workload_is_reported_failed(small_bundle: Path, cli):
    """An older bundle naming a module only its recording's directory had: the progress says
    each device failed (not "finished"), and the error names the import."""
    manifest_path = small_bundle / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["workload"] = {"ref": "gone_train_module:make_workload", "kwargs": dict(SMALL)}
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    manifest_path.write_text(json.dumps(manifest))
    result = cli("replay", small_bundle, "-d", "cpu:0", "-d", "cpu:1", "--trust-workload")
    assert result.exit_code == 3, result.output
    assert "cpu:0 failed" in result.stderr or "cpu:1 failed" in result.stderr
    assert "finished" not in result.stderr
    assert "cannot import module 'gone_train_module'" in result.stderr
