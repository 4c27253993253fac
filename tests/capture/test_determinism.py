"""Determinism switches (set, recorded, applied, verified) and exact RNG capture/restore."""

from __future__ import annotations

import json
import os
import random

import h5py
import numpy as np
import pytest
import torch

from sdcreplay.bundle.state import read_rng, write_rng
from sdcreplay.capture import determinism
from sdcreplay.errors import DeterminismError

SWITCH_KEYS = {
    "deterministic_algorithms",
    "cudnn_deterministic",
    "cudnn_benchmark",
    "cuda_matmul_allow_tf32",
    "cudnn_allow_tf32",
    "float32_matmul_precision",
    "num_threads",
    "env",
}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch):
    for name in determinism.SWITCH_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_current_switches_reflect_torch(clean_env):
    torch.use_deterministic_algorithms(False)
    switches = determinism.current_switches()
    assert set(switches) == SWITCH_KEYS
    assert switches["deterministic_algorithms"] is False
    assert switches["num_threads"] == torch.get_num_threads()
    assert switches["env"] == {name: None for name in determinism.SWITCH_ENV_VARS}
    json.dumps(switches)  # goes into the manifest as is


def test_enable_turns_every_switch_on(clean_env):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    switches = determinism.enable()
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic is True
    assert torch.backends.cudnn.benchmark is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert switches["deterministic_algorithms"] is True
    assert switches["cudnn_benchmark"] is False
    assert switches["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_enable_keeps_a_value_the_user_set(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert determinism.enable()["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_enable_sets_threads_when_asked():
    threads = torch.get_num_threads()
    assert determinism.enable(num_threads=1)["num_threads"] == 1
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)


def test_apply_puts_recorded_switches_in_force_and_verify_accepts(clean_env):
    recorded = determinism.enable()
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG")
    with pytest.raises(DeterminismError):
        determinism.verify(recorded)
    determinism.apply(recorded)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    determinism.verify(recorded)
    assert determinism.current_switches() == recorded


def test_apply_refuses_a_conflicting_environment(clean_env, monkeypatch: pytest.MonkeyPatch):
    recorded = determinism.enable()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(False)
    with pytest.raises(DeterminismError) as info:
        determinism.apply(recorded)
    assert info.value.message == (
        "the environment differs from the recording: "
        "CUBLAS_WORKSPACE_CONFIG=':16:8' (recorded ':4096:8')"
    )
    assert "Unset those variables" in info.value.hint
    # Refused before changing anything: the person's value and switches stand.
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert not torch.are_deterministic_algorithms_enabled()


def test_apply_refuses_a_variable_set_where_the_record_had_none(
    clean_env, monkeypatch: pytest.MonkeyPatch
):
    recorded = determinism.enable()
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    with pytest.raises(DeterminismError, match="NCCL_ALGO='Ring' \\(recorded None\\)"):
        determinism.apply(recorded)


def test_verify_names_every_differing_switch(clean_env):
    recorded = determinism.enable()
    recorded = {**recorded, "cudnn_benchmark": True, "num_threads": recorded["num_threads"] + 1}
    with pytest.raises(DeterminismError) as info:
        determinism.verify(recorded)
    assert "cudnn_benchmark: recorded True, now False" in info.value.message
    assert f"num_threads: recorded {recorded['num_threads']}" in info.value.message
    assert "deterministic_algorithms" not in info.value.message


def test_verify_checks_recorded_env(clean_env):
    recorded = determinism.enable()
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG")
    with pytest.raises(
        DeterminismError, match="CUBLAS_WORKSPACE_CONFIG: recorded ':4096:8', now None"
    ):
        determinism.verify(recorded)


def test_environment_describes_the_run():
    env = determinism.environment(torch.device("cpu"))
    assert env["torch"] == torch.__version__
    assert env["numpy"] == np.__version__
    assert env["device"]["type"] == "cpu"
    assert env["device"]["cores"] == os.cpu_count()
    assert set(determinism.SWITCH_ENV_VARS) <= set(env["env"])
    assert set(determinism.INFO_ENV_VARS) <= set(env["env"])
    json.dumps(env)


def test_environment_warnings():
    now = determinism.environment(torch.device("cpu"))
    assert determinism.environment_warnings(now, now) == []
    older = {**now, "torch": "2.0.0", "device": {**now["device"], "name": "Other CPU"}}
    assert determinism.environment_warnings(older, now) == [
        f"torch {now['torch']} replays a recording made with torch 2.0.0",
        f"device model {now['device']['name']!r} replays a recording made on 'Other CPU'",
    ]


def draw() -> tuple:
    return (
        random.random(),
        random.getrandbits(64),
        np.random.rand(3).tolist(),
        np.random.standard_normal(),
        torch.rand(4).tolist(),
        torch.randint(0, 2**31, (2,)).tolist(),
    )


def test_rng_capture_and_restore_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in NumPy's legacy state
    state = determinism.capture_rng(torch.device("cpu"))
    first = draw()
    assert draw() != first
    determinism.restore_rng(state, torch.device("cpu"))
    assert draw() == first


def test_rng_state_survives_hdf5(tmp_path):
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    np.random.standard_normal()
    state = determinism.capture_rng(torch.device("cpu"))
    assert state.numpy[3] == 1  # has_gauss: the cached value must be kept exactly
    expected = draw()
    with h5py.File(tmp_path / "rng.h5", "w") as handle:
        write_rng(handle.create_group("rng"), state)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    with h5py.File(tmp_path / "rng.h5", "r") as handle:
        loaded = read_rng(handle["rng"])
    assert loaded.python == state.python
    assert np.array_equal(loaded.numpy[1], state.numpy[1])
    assert loaded.numpy[0] == state.numpy[0] and loaded.numpy[2:] == state.numpy[2:]
    assert torch.equal(loaded.cpu, state.cpu)
    assert loaded.accelerator is None
    determinism.restore_rng(loaded, torch.device("cpu"))
    assert draw() == expected


def test_python_state_json_round_trip():
    random.seed(5)
    state = determinism.capture_rng(torch.device("cpu"))
    assert determinism.RngState.python_from_json(state.python_json()) == state.python


def test_rng_signature_items_are_exact_and_see_every_generator():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    state = determinism.capture_rng(torch.device("cpu"))
    items = dict(state.signature_items())
    assert list(items) == ["rng:python", "rng:numpy", "rng:cpu"]
    assert items["rng:python"].tolist() == list(state.python[1])
    assert items["rng:numpy"][:-1].tolist() == [int(k) for k in state.numpy[1]]
    assert torch.equal(items["rng:cpu"], state.cpu)
    random.random()
    moved = dict(determinism.capture_rng(torch.device("cpu")).signature_items())
    assert not torch.equal(moved["rng:python"], items["rng:python"])
    assert torch.equal(moved["rng:cpu"], items["rng:cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_round_trip():
    device = torch.device("cuda", 0)
    torch.cuda.manual_seed(4)
    state = determinism.capture_rng(device)
    assert state.accelerator is not None
    first = torch.rand(8, device=device).cpu()
    determinism.restore_rng(state, device)
    assert torch.equal(torch.rand(8, device=device).cpu(), first)
    assert [name for name, _ in state.signature_items()][-1] == "rng:cuda"
