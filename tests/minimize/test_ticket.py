"""The ticket directory: repro.py runs where only torch and h5py exist, inputs.h5 keeps
dtypes, shapes and strides, ticket.json/ticket.md say what a vendor needs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import types
from collections import Counter
from importlib import metadata
from pathlib import Path

import h5py
import pytest
import torch
from conftest import REPO, TICKET_CALL, TICKET_FAULTS, preserved_global_state
from test_minimize import MODULE, STICKY

from sdcreplay.bisect.operator_case import OperatorCase
from sdcreplay.capture import determinism
from sdcreplay.capture.operators import CallSite
from sdcreplay.errors import SdcReplayError
from sdcreplay.minimize.driver import minimize
from sdcreplay.minimize.templates import repro
from sdcreplay.minimize.ticket import device_identity, nvml_identity, render_markdown, write_ticket
from sdcreplay.storage.tensorio import raw_bits

TRIALS = 200


@pytest.fixture(scope="session")
def ticket(tmp_path_factory: pytest.TempPathFactory, tickets: list[Path]) -> Path:
    """The whole story once: the run's bisect of a recorded tiny-llama step with a sticky
    bitflip on cpu:1 (conftest ``tickets``, whose first fault is STICKY), minimized here."""
    assert f"{TICKET_CALL},{TICKET_FAULTS[0]},device=cpu:1" == STICKY
    report = tickets[0].parent / "run.bundle.bisect"
    found = json.loads((report / "report.json").read_text())
    assert (found["op"], found["module"]) == ("aten.mm.default", MODULE)
    out = tmp_path_factory.mktemp("ticket") / "ticket"
    with preserved_global_state(), pytest.MonkeyPatch.context() as patch:
        patch.delenv("SDCREPLAY_INJECT", raising=False)
        return Path(minimize(report, trials=TRIALS, inject=[STICKY], out=out).to_json()["ticket"])


def _distribution_closure(names: list[str]) -> set[str]:
    """These distributions and everything they require (extras aside)."""
    found, queue = set(), list(names)
    while queue:
        name = re.split(r"[^A-Za-z0-9._-]", queue.pop())[0].lower().replace("_", "-")
        if name in found:
            continue
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        found.add(name)
        queue += [requirement for requirement in requires if "extra ==" not in requirement]
    return found


@pytest.fixture(scope="session")
def only_torch_and_h5py(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An environment for ``python -S`` whose path holds torch, h5py and their requirements only."""
    directory = tmp_path_factory.mktemp("only-torch-h5py")
    for name in _distribution_closure(["torch", "h5py"]):
        distribution = metadata.distribution(name)
        for top in {Path(str(file)).parts[0] for file in distribution.files or []}:
            source = Path(distribution.locate_file(top))
            if top.endswith(".dist-info") or top in ("..", "__pycache__") or not source.exists():
                continue
            if not (directory / top).exists():
                (directory / top).symlink_to(source)
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("SDCREPLAY")},
        "PYTHONPATH": str(directory),
    }


def test_repro_runs_where_only_torch_and_h5py_are_importable(
    ticket: Path, only_torch_and_h5py: dict
):
    isolated = [sys.executable, "-S"]
    probe = subprocess.run(
        [*isolated, "-c", "import sdcreplay"],
        env=only_torch_and_h5py,
        cwd=ticket,
        capture_output=True,
        text=True,
    )
    assert probe.returncode != 0 and "No module named 'sdcreplay'" in probe.stderr
    run = subprocess.run(
        [*isolated, "repro.py", "--device", "cpu:1", "--trials", str(TRIALS)],
        env=only_torch_and_h5py,
        cwd=ticket,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert f"failed 0 of {TRIALS}" in run.stdout


def test_repro_applies_sdcreplay_inject_when_sdcreplay_is_importable(ticket: Path):
    env = {**os.environ, "SDCREPLAY_INJECT": STICKY}
    run = subprocess.run(
        [sys.executable, "repro.py", "--device", "cpu:1", "--trials", "50"],
        env=env,
        cwd=ticket,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr
    assert "failed 50 of 50" in run.stdout
    assert "first failure at trial 1: output 0, element 5 (position [0, 5])" in run.stdout
    assert "XOR mask 0x00400000" in run.stdout


def _ticket_command(ticket: Path) -> str:
    """The one command in ticket.md's Reproduce section."""
    markdown = (ticket / "ticket.md").read_text()
    return markdown.split("## Reproduce", 1)[1].split("```")[1].strip()


def test_the_drill_command_in_ticket_md_runs_the_drill_literally(ticket: Path):
    command = _ticket_command(ticket)
    assert command == (
        f"SDCREPLAY_INJECT={shlex.quote(STICKY)} python repro.py --device cpu:1 --trials 1000"
    )
    assert json.loads((ticket / "ticket.json").read_text())["reproduce"] == command
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SDCREPLAY")},
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),  # sdcreplay importable, as the drill needs
    }
    run = subprocess.run(
        ["bash", "-c", command], env=env, cwd=ticket, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 1, run.stderr
    assert "failed 1000 of 1000" in run.stdout


def test_repro_that_cannot_run_here_says_so_and_exits_3(ticket: Path, tmp_path: Path):
    missing = "cuda:99" if torch.cuda.is_available() else "cuda:0"
    run = subprocess.run(
        [sys.executable, "repro.py", "--device", missing, "--trials", "5"],
        cwd=ticket, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 3, run.stderr
    expected = (
        f"this machine has {torch.cuda.device_count()} CUDA device(s)"
        if torch.cuda.is_available()
        else "this machine has no CUDA device"
    )
    assert run.stderr.startswith(f"Error: --device {missing}: {expected}")
    assert "\nHint: " in run.stderr and "Traceback" not in run.stderr
    alone = tmp_path / "repro.py"
    alone.write_text((ticket / "repro.py").read_text())
    run = subprocess.run(
        [sys.executable, str(alone), "--device", "cpu"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 3
    assert run.stderr.splitlines() == [
        f"Error: cannot read {tmp_path / 'inputs.h5'}: there is no such file",
        "Hint: Keep repro.py beside the ticket's inputs.h5.",
    ]


def test_ticket_json_and_markdown_say_what_a_vendor_needs(ticket: Path):
    doc = json.loads((ticket / "ticket.json").read_text())
    assert doc["schema"] == "sdcreplay.ticket/1" and doc["status"] == "reproduced"
    assert doc["drill"] is True and doc["injected_faults"] == [STICKY]
    assert doc["device"]["label"] == "cpu:1" and doc["device"]["name"]
    assert doc["software"]["torch"] == torch.__version__
    assert doc["operator"]["op"] == "aten.mm.default" and doc["operator"]["dtypes"] == [
        "float32",
        "float32",
    ]
    assert doc["shapes"]["original"] == [[16, 32], [32, 32]] and doc["shapes"]["minimal"] == [
        [1, 1],
        [1, 6],
    ]
    assert (doc["rate"]["failures"], doc["rate"]["trials"], doc["rate"]["ci95"][1]) == (
        TRIALS,
        TRIALS,
        1.0,
    )
    assert doc["acceptance"] == {"good_trials": 10, "bad_trials": 1}
    assert doc["data_dependent"] is False
    assert doc["first_mismatch"]["index"] == 5 and doc["first_mismatch"]["xor"] == "00400000"
    assert doc["bits"]["histogram"] == {"22": 1}
    assert len(doc["commands"]) == 2 and doc["commands"][1].startswith("sdcreplay minimize")
    assert doc["bisect"]["module"] == MODULE and doc["bisect"]["isolated"] == "kernel"
    markdown = (ticket / "ticket.md").read_text()
    assert f"failed {TRIALS} of {TRIALS} trials" in markdown.splitlines()[0]
    assert (
        "**Drill:**" in markdown
        and "python repro.py --device cpu:1 --trials 1000" in markdown
        and "XOR mask 0x00400000" in markdown
    )
    original = doc["coordinates"]["original"]["position"]
    assert (
        f"| in the original output | element {original}: the minimal inputs keep rows [" in markdown
    )
    assert "| original inputs' first mismatch | output 0, element 5 at [0, 5] |" in markdown


def test_inputs_keep_dtype_shape_and_strides(tmp_path: Path):
    left = torch.randn(3, 4).to(torch.bfloat16)
    right = torch.randn(5, 4).to(torch.bfloat16).t()  # a transposed operand, as nn.Linear passes it
    site = CallSite(0, "forward", "proj", "aten.mm.default", 7)
    out = torch.mm(left, right)
    case = OperatorCase(
        site, Counter({("aten.mm.default", "proj", "forward"): 2}), (left, right), {}, [out], [out]
    )
    result = {
        "switches": determinism.current_switches(),
        "device": "cpu:1",
        "reference": "cpu:0",
        "reproduced": False,
        "inject": [],
        "op": "aten.mm.default",
        "trials": 0,
        "failures": 0,
        "rate": 0.0,
        "ci95": [0.0, 1.0],
        "trials_to_first_failure": None,
        "kernels": [],
        "dtypes": ["bfloat16", "bfloat16"],
        "site": {"step": 0, "phase": "forward", "module": "proj", "index": 7},
        "input_shapes_original": [[3, 4], [4, 5]],
        "input_shapes_minimal": [[3, 4], [4, 5]],
        "shrink": {"status": "not reproduced"},
        "minimal": None,
        "reference_trials": 0,
        "reference_failures": 0,
        "acceptance": {"good_trials": 10, "bad_trials": 1},
        "data_dependent": None,
        "first_mismatch": None,
        "bits": None,
        "pattern": None,
        "commands": [],
    }
    target = tmp_path / "ticket"
    assert write_ticket(target, result, {}, case) is None  # nothing was there to move aside
    with h5py.File(target / "inputs.h5") as handle:
        inputs = repro.read_tree(handle["reference_inputs"])
        expected = repro.read_tree(handle["reference_outputs"])
        assert handle.attrs["op"] == "aten.mm.default"
    for original, read in zip((left, right), inputs["args"], strict=True):
        assert (read.dtype, read.shape, read.stride()) == (
            original.dtype,
            original.shape,
            original.stride(),
        )
        assert torch.equal(raw_bits(read), raw_bits(original))
    assert torch.equal(raw_bits(expected[0]), raw_bits(out))
    assert OperatorCase.read(target / "inputs.h5").prior == case.prior


def test_ticket_never_replaces_a_directory_that_is_not_a_ticket(tmp_path: Path):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    with pytest.raises(SdcReplayError, match="not a ticket directory"):
        write_ticket(tmp_path / "keep", {}, {}, None)
    assert (tmp_path / "keep" / "notes.txt").read_text() == "mine"


def test_cpu_identity_names_the_model():
    identity = device_identity("cpu:3")
    assert identity["label"] == "cpu:3" and identity["type"] == "cpu" and identity["name"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_identity_from_nvml():
    identity = device_identity("cuda:0")
    assert identity["type"] == "cuda" and identity["uuid"]
    nvml = identity["nvml"]
    if nvml["available"]:
        uuid = identity["uuid"].removeprefix("GPU-")
        assert nvml["identity"]["uuid"].removeprefix("GPU-") == uuid
        assert nvml["driver"] and "serial" in nvml["identity"]
        assert "volatile_uncorrected" in nvml["health"]["ecc"]


class FakeNvml(types.ModuleType):
    """pynvml's calls for one board: an A100 whose InfoROM and row remapper NVML cannot read."""

    class NVMLError(Exception):
        pass

    NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
    NVML_TEMPERATURE_GPU = 0
    UUID = "GPU-5b0c2a7e-0000-4000-8000-000000000001"

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.open = 0

    def nvmlInit(self):
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != self.UUID:
            raise self.NVMLError("Not Found")
        return "handle"

    def nvmlSystemGetDriverVersion(self):
        return b"550.54.15"

    def nvmlDeviceGetName(self, handle):
        return "NVIDIA A100-SXM4-80GB"

    def nvmlDeviceGetUUID(self, handle):
        return self.UUID

    def nvmlDeviceGetSerial(self, handle):
        return b"1564720004631"

    def nvmlDeviceGetBoardPartNumber(self, handle):
        return "692-2G506-0212-002"

    def nvmlDeviceGetVbiosVersion(self, handle):
        return "92.00.45.00.03"

    def nvmlDeviceGetInforomImageVersion(self, handle):
        raise self.NVMLError("Not Supported")

    def nvmlDeviceGetPciInfo(self, handle):
        return types.SimpleNamespace(busId="00000000:07:00.0")

    def nvmlDeviceGetTotalEccErrors(self, handle, error, counter):
        return {(0, 0): 3, (1, 0): 0, (0, 1): 118, (1, 1): 2}[(error, counter)]

    def nvmlDeviceGetRetiredPages(self, handle, cause):
        double_bit = cause == self.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        return [0x1F000, 0x2A000] if double_bit else []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle):
        return 1

    def nvmlDeviceGetRemappedRows(self, handle):
        raise self.NVMLError("Insufficient Permissions")

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return [1410, 1410, 1593][clock]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 71

    def nvmlDeviceGetPowerUsage(self, handle):
        return 312_500  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 400_000


def test_nvml_identity_and_health_with_unsupported_fields(ticket: Path, monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    nvml = nvml_identity(fake.UUID.removeprefix("GPU-"))  # torch's UUID lacks the prefix
    assert fake.open == 0  # shut down again
    assert nvml["available"] is True and nvml["driver"] == "550.54.15"
    assert nvml["identity"] == {
        "name": "NVIDIA A100-SXM4-80GB",
        "uuid": fake.UUID,
        "serial": "1564720004631",
        "board_part_number": "692-2G506-0212-002",
        "vbios": "92.00.45.00.03",
        "inforom": "unavailable (Not Supported)",
        "pci_bus_id": "00000000:07:00.0",
    }
    assert nvml["health"] == {
        "ecc": {
            "volatile_corrected": 3,
            "volatile_uncorrected": 0,
            "aggregate_corrected": 118,
            "aggregate_uncorrected": 2,
        },
        "retired_pages": {"single_bit_ecc": 0, "double_bit_ecc": 2, "pending": True},
        "remapped_rows": "unavailable (Insufficient Permissions)",
        "clocks_mhz": {"graphics": 1410, "sm": 1410, "memory": 1593},
        "temperature_c": 71,
        "power_w": 312.5,
        "power_limit_w": 400.0,
    }
    assert nvml_identity("another-board") == {"available": False, "note": "NVML: Not Found"}
    assert fake.open == 0

    doc = json.loads((ticket / "ticket.json").read_text())
    doc["device"] = {
        "label": "cuda:0",
        "type": "cuda",
        "name": "NVIDIA A100-SXM4-80GB",
        "nvml": nvml,
    }
    markdown = render_markdown(doc)
    for row in [
        "| serial | 1564720004631 |",
        "| board part number | 692-2G506-0212-002 |",
        "| inforom | unavailable (Not Supported) |",
        "| pci bus id | 00000000:07:00.0 |",
        "| driver | 550.54.15 |",
        "| ecc | volatile corrected 3, volatile uncorrected 0, aggregate corrected 118, "
        "aggregate uncorrected 2 |",
        "| retired pages | single bit ecc 0, double bit ecc 2, pending True |",
        "| remapped rows | unavailable (Insufficient Permissions) |",
        "| power w | 312.5 |",
    ]:
        assert row in markdown.splitlines(), row
    assert "## For the vendor's return process" in markdown and "nvidia-bug-report.sh" in markdown
    assert "fieldiag" in markdown
    assert "serial 1564720004631, board part number 692-2G506-0212-002" in markdown


def test_without_nvidia_ml_py_the_ticket_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert nvml_identity("x") == {
        "available": False,
        "note": "install nvidia-ml-py (pip install 'sdcreplay[gpu]') "
        "for serial, VBIOS and ECC counters",
    }
