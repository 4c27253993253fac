"""Checkpoints outside the bundle: what a reference pins (a file, a directory's files), how a
changed one is refused (naming the file), and that nothing in one is ever unpickled."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sdcreplay.bundle.checkpoints import checkpoint_reference, load_checkpoint
from sdcreplay.bundle.manifest import (
    MANIFEST,
    MANIFEST_DIGEST,
    CheckpointState,
    Manifest,
    manifest_digest,
)
from sdcreplay.errors import BundleError, CheckpointError


def test_checkpoint_reference_and_load(tmp_path: Path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt"
    )
    reference = checkpoint_reference(tmp_path / "ckpt.pt")
    assert reference.to_json() == {
        "kind": "checkpoint",
        "path": str((tmp_path / "ckpt.pt").resolve()),
        "size": (tmp_path / "ckpt.pt").stat().st_size,
        "sha256": hashlib.sha256((tmp_path / "ckpt.pt").read_bytes()).hexdigest(),
    }
    model_state, optimizer_state = load_checkpoint(reference)
    assert torch.equal(model_state["weight"], model.weight.detach())
    assert optimizer_state["param_groups"][0]["lr"] == 0.1


def test_bare_state_dict_checkpoint(tmp_path: Path):
    torch.save({"weight": torch.ones(2)}, tmp_path / "sd.pt")
    model_state, optimizer_state = load_checkpoint(checkpoint_reference(tmp_path / "sd.pt"))
    assert torch.equal(model_state["weight"], torch.ones(2)) and optimizer_state is None


def test_changed_checkpoint_is_refused(tmp_path: Path):
    torch.save({"model": {"w": torch.zeros(2)}}, tmp_path / "ckpt.pt")
    reference = checkpoint_reference(tmp_path / "ckpt.pt")
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(reference)
    assert "changed since the recording" in info.value.message
    assert "exact checkpoint" in info.value.hint


def test_missing_checkpoint_is_refused(tmp_path: Path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_reference(tmp_path / "nope.pt")
    torch.save({"w": torch.zeros(1)}, tmp_path / "ckpt.pt")
    reference = checkpoint_reference(tmp_path / "ckpt.pt")
    (tmp_path / "ckpt.pt").unlink()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(reference)


class _Payload:
    """Unpickling this runs code: it would create a file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_checkpoint_is_never_unpickled(tmp_path: Path):
    marker = tmp_path / "pwned"
    torch.save(
        {"model": {"w": torch.zeros(1)}, "extra": _Payload(str(marker))}, tmp_path / "evil.pt"
    )
    reference = checkpoint_reference(tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="cannot load checkpoint"):
        load_checkpoint(reference)
    assert not marker.exists()


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def same_state(model: torch.nn.Module, optimizer, loaded: tuple[dict, dict | None]) -> bool:
    model_state, optimizer_state = loaded
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(optimizer_state)
    return all(torch.equal(v, model.state_dict()[k]) for k, v in model_state.items()) and all(
        torch.equal(fresh.state[p]["exp_avg"], optimizer.state[p]["exp_avg"])
        for p in model.parameters()
    )


def test_a_lightning_checkpoint_file_gives_its_state_dict_and_first_optimizer(tmp_path: Path):
    model, optimizer = trained()
    torch.save(
        {
            "state_dict": model.state_dict(),
            "optimizer_states": [optimizer.state_dict()],
            "lr_schedulers": [],
            "global_step": 1,
        },
        tmp_path / "epoch=0-step=1.ckpt",
    )
    assert same_state(
        model, optimizer, load_checkpoint(checkpoint_reference(tmp_path / "epoch=0-step=1.ckpt"))
    )


def test_a_torch_distributed_checkpoint_directory_is_pinned_file_by_file(tmp_path: Path):
    model, optimizer = trained()
    directory = tmp_path / "dcp"
    with pytest.warns(UserWarning):  # DCP says it saves in one process
        dcp.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            checkpoint_id=directory,
        )
    reference = checkpoint_reference(directory)
    assert (reference.format, sorted(reference.files)) == ("dcp", [".metadata", "__0_0.distcp"])
    listing = "".join(
        f"{name} {meta.size} {meta.sha256}\n" for name, meta in sorted(reference.files.items())
    )
    assert reference.sha256 == hashlib.sha256(listing.encode()).hexdigest()
    assert reference.size == sum((directory / name).stat().st_size for name in reference.files)
    assert CheckpointState._read(reference.to_json()).to_json() == reference.to_json()
    assert same_state(model, optimizer, load_checkpoint(reference))
    (directory / "__0_0.distcp").write_bytes(b"changed")
    with pytest.raises(CheckpointError, match="__0_0.distcp changed since the recording") as info:
        load_checkpoint(reference)
    assert "restore it from backup" in info.value.hint


def test_the_metadata_of_a_distributed_checkpoint_is_never_unpickled_beyond_its_types(
    tmp_path: Path,
):
    model, optimizer = trained()
    directory = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save({"model": model.state_dict()}, checkpoint_id=directory)
    marker = tmp_path / "pwned"
    (directory / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match="cannot load checkpoint"):
        load_checkpoint(checkpoint_reference(directory))
    assert not marker.exists()


def test_a_trainer_checkpoint_directory_pins_its_weights_and_optimizer(tmp_path: Path):
    from safetensors.torch import save_file

    model, optimizer = trained()
    directory = tmp_path / "checkpoint-4"
    directory.mkdir()
    save_file(model.state_dict(), str(directory / "model.safetensors"))
    torch.save(optimizer.state_dict(), directory / "optimizer.pt")
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    reference = checkpoint_reference(directory)
    assert (reference.format, sorted(reference.files)) == (
        "hf",
        ["model.safetensors", "optimizer.pt"],
    )
    assert same_state(model, optimizer, load_checkpoint(reference))
    torch.save({"state": {}, "param_groups": []}, directory / "optimizer.pt")
    with pytest.raises(CheckpointError, match="optimizer.pt changed since the recording"):
        load_checkpoint(reference)
    (directory / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="has no optimizer.pt any more"):
        load_checkpoint(reference)


def test_a_directory_that_is_no_checkpoint_is_refused_with_what_was_expected(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="neither a Hugging Face Trainer checkpoint") as info:
        checkpoint_reference(tmp_path)
    assert "checkpoint-N" in info.value.hint


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda state: state.pop("files"), "state.files lists a directory checkpoint's files"),
        (lambda state: state.update(format="zip"), "state.format"),
        (
            lambda state: state["files"].update({"../x": state["files"][".metadata"]}),
            "state.files",
        ),
    ],
    ids=["files-missing", "format-unknown", "file-outside"],
)
def test_a_malformed_directory_reference_is_refused(
    tmp_path: Path, small_bundle: Path, edit, message
):
    model, _ = trained()
    with pytest.warns(UserWarning):
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "dcp")
    reference = checkpoint_reference(tmp_path / "dcp").to_json()
    edit(reference)
    manifest = json.loads((small_bundle / MANIFEST).read_text())
    manifest["state"] = reference
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    with pytest.raises(BundleError, match=message):
        Manifest.from_json(manifest)
