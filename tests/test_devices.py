"""Device labels, and which ones this machine certainly cannot run, told without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdcreplay.devices import _nvidia_driver, cuda_absent, require_available, torch_build
from sdcreplay.errors import DeviceError


def test_torch_build_is_read_from_its_source_without_importing_torch():
    code = (
        "import json, sys; from sdcreplay.devices import torch_build; "
        "print(json.dumps([torch_build(), 'torch' in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    build, imported = json.loads(done.stdout)
    assert not imported
    assert (build["__version__"], build["cuda"], build["hip"]) == (
        torch.__version__, torch.version.cuda, torch.version.hip,
    )  # fmt: skip
    assert torch_build() == {
        "__version__": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
    }  # fmt: skip


def test_an_nvidia_driver_shows_in_its_files(tmp_path: Path):
    assert not _nvidia_driver(tmp_path)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "null").write_text("")
    assert not _nvidia_driver(tmp_path)
    (tmp_path / "dev" / "nvidia0").write_text("")
    assert _nvidia_driver(tmp_path)
    wsl = tmp_path / "wsl"
    (wsl / "dev").mkdir(parents=True)
    (wsl / "dev" / "dxg").write_text("")
    assert _nvidia_driver(wsl)


def test_empty_cuda_visible_devices_hides_every_gpu(monkeypatch):
    if torch.version.cuda is None and torch.version.hip is None:
        assert cuda_absent() == f"torch {torch.__version__} is built without CUDA"
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_absent() == "CUDA_VISIBLE_DEVICES='' hides every GPU"


def test_require_available_with_torch_loaded_checks_the_gpu_count():
    assert require_available(" cpu:3 ") == "cpu:3"
    with pytest.raises(DeviceError, match="unknown device label 'gpu:0'"):
        require_available("gpu:0")
    with pytest.raises(DeviceError) as info:
        require_available("cuda:99")
    expected = (
        f"device cuda:99 does not exist (this machine has {torch.cuda.device_count()} GPUs)"
        if cuda_absent() is None
        else f"device cuda:99 was asked for but this machine has no CUDA device ({cuda_absent()})"
    )
    assert info.value.message == expected
