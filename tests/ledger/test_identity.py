"""Device identity: a GPU by its NVML UUID (with serial and PCI bus id), a CPU by label and
host, and the recording device from a bundle's environment without touching it."""

from __future__ import annotations

import socket
import sys

import pytest
import torch

from sdcreplay.ledger.identity import DeviceIdentity, identify, recorded_identity


def test_virtual_replicas_of_one_host_have_ids_of_their_own():
    host = socket.gethostname()
    first, second, plain = identify("cpu:0"), identify("cpu:1"), identify("cpu")
    assert (first.id, second.id, plain.id) == (f"cpu:0@{host}", f"cpu:1@{host}", f"cpu@{host}")
    assert first.kind == "cpu" and first.host == host and first.model
    assert DeviceIdentity.from_json(first.to_json()) == first


def test_the_recording_gpu_is_named_by_its_uuid(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML here: the UUID alone
    device = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "uuid": "6b8e1c2a-0000"}
    identity = recorded_identity("cuda:3", "h17", device)
    assert (identity.id, identity.label, identity.host, identity.model) == (
        "GPU-6b8e1c2a-0000",
        "cuda:3",
        "h17",
        "NVIDIA H100 80GB HBM3",
    )
    assert recorded_identity("cpu", "h18", {"type": "cpu", "name": "X"}).id == "cpu@h18"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_is_named_by_nvmls_uuid_with_serial_and_bus_id():
    identity = identify("cuda:0")
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    assert identity.id == f"GPU-{uuid}" and identity.kind == "cuda"
    assert identity.model == torch.cuda.get_device_name(0)
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(identity.id)
        assert identity.pci_bus_id == pynvml.nvmlDeviceGetPciInfo(handle).busId
    finally:
        pynvml.nvmlShutdown()
