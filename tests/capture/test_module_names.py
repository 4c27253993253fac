"""Names as the person reads the model: wrappers' own segments (DDP's ``module.``, compile's
``_orig_mod.``, checkpoint_wrapper's) are left out of operator sites, fault specs and bisect
reports, and the wrapped name a person copies from ``named_modules()`` still works."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import SMALL, preserved_global_state, wrapped_as
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from sdcreplay import Bundle
from sdcreplay.bundle.manifest import CaptureSettings
from sdcreplay.capture.compiled import ROOT, find_regions
from sdcreplay.capture.determinism import capture_rng
from sdcreplay.capture.fault_spec import FaultSpec
from sdcreplay.capture.faults import Injector
from sdcreplay.capture.layers import SignatureCapture, state_digests
from sdcreplay.capture.module_names import aliases, named_modules, named_parameters, plain_paths
from sdcreplay.capture.operators import CallSite, OperatorMode
from sdcreplay.compare.compiled_code import entry_region
from sdcreplay.recording.drive import record
from sdcreplay.recording.job import record_job
from sdcreplay.workload.definition import build_workload


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.module = nn.Linear(4, 4)  # a person's own child called "module" stays

    def forward(self, x):
        return self.module(self.fc(x))


def wrapped_model() -> nn.Module:
    """Every wrapper at once: DataParallel (DDP's ``module``) around a model with a compiled
    block and an activation-checkpointed one."""
    model = nn.Sequential(Block(), Block())
    model[0] = torch.compile(model[0])
    model[1] = checkpoint_wrapper(model[1])
    return nn.DataParallel(model)


def test_wrappers_segments_are_left_out_and_a_childs_own_name_kept():
    model = wrapped_model()
    plain = plain_paths(model)
    assert plain["module.0._orig_mod.fc"] == "0.fc"
    assert plain["module.1._checkpoint_wrapped_module.module"] == "1.module"
    assert [name for name, _ in named_parameters(model)] == [
        f"{block}.{layer}.{kind}"
        for block in "01"
        for layer in ("fc", "module")
        for kind in ("weight", "bias")
    ]
    names = {name for name, _ in named_modules(model)}
    assert names == {"<root>", "0", "0.fc", "0.module", "1", "1.fc", "1.module"}


def test_a_typed_name_may_be_the_wrapped_one():
    assert aliases("module.layers.0._orig_mod.attn") == (
        "module.layers.0._orig_mod.attn",
        "module.layers.0.attn",
        "layers.0.attn",
    )
    spec = FaultSpec.parse("kind=bitflip,op=aten.mm,module=module.layers.0")
    assert spec.matches_key("aten.mm.default", "layers.0.attn.wq", "forward")
    assert FaultSpec.parse("kind=bitflip,op=aten.mm,module=layers.0").matches_key(
        "aten.mm.default", "layers.0.attn.wq", "forward"
    )
    assert not spec.matches_key("aten.mm.default", "layers.1.attn.wq", "forward")


def test_operator_sites_and_faults_name_the_plain_module_under_data_parallel():
    torch.manual_seed(0)
    model = nn.DataParallel(nn.Sequential(Block()))
    fired = Injector(
        [FaultSpec.parse("kind=bitflip,op=aten.addmm,module=0.module,index=1,bit=3")], "cpu"
    )
    sites: list[CallSite] = []

    class Sites:
        def on_call(self, site, func, args, kwargs, out):
            sites.append(site)
            return out

    with OperatorMode(model, None, [fired, Sites()], step=0):
        model(torch.ones(2, 4))
    assert [(s.module, s.op) for s in sites if s.op == "aten.addmm.default"] == [
        ("0.fc", "aten.addmm.default"),
        ("0.module", "aten.addmm.default"),
    ]
    assert [(i.module, i.elements, i.bit) for i in fired.fired] == [("0.module", [1], 3)]


def test_memflip_takes_the_plain_and_the_wrapped_parameter_name():
    model = nn.DataParallel(nn.Sequential(Block()))
    for name in ("0.fc.weight", "module.0.fc.weight"):
        before = model.module[0].fc.weight.detach().clone()
        injector = Injector([FaultSpec.parse(f"kind=memflip,param={name},step=0,index=2")], "cpu")
        injector.before_step(0, model)
        assert injector.fired[0].module == "0.fc.weight"
        changed = (model.module[0].fc.weight != before).flatten().nonzero().flatten().tolist()
        assert changed == [2]


DDP_MODEL_WORKLOAD = f"""
from sdcreplay.workload.tiny_llama import make_workload as tiny_llama


def make_workload(seed=0):
    workload = tiny_llama(seed=seed, parallel="ddp", **{SMALL!r})
    workload.model = workload.data_parallel  # the loop hands the Recorder its DDP (nanoGPT)
    return workload
"""

PLAIN_SPEC = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=5"


@pytest.fixture(scope="module")
def ddp_model_job(tmp_path_factory) -> Path:
    """2 gloo ranks recording with the DistributedDataParallel itself as the model."""
    where = tmp_path_factory.mktemp("ddpmodel")
    (where / "ddp_model.py").write_text(DDP_MODEL_WORKLOAD)
    out = where / "job.bundle"
    with preserved_global_state():
        record_job(f"{where / 'ddp_model.py'}:make_workload", out, nproc=2, steps=2, timeout=60)
    return out


def test_a_plain_module_spec_under_ddp_names_rank_1_and_bisects_to_the_plain_module(
    cli, ddp_model_job, tmp_path
):
    devices = [arg for n in range(4) for arg in ("-d", f"cpu:{n}")]
    fault = f"{PLAIN_SPEC},rank=1,device=cpu:3"
    replayed = cli(
        "replay", ddp_model_job, *devices, "--inject", fault, "--timeout", "60", "--json"
    )
    assert replayed.exit_code == 1, replayed.output
    report = json.loads(replayed.stdout)
    assert (report["origin_rank"], report["suspects"]) == (1, ["cpu:3"])
    bisected = cli(
        "bisect", ddp_model_job, "--rank", "1", "--suspect", "cpu:1", "--reference", "cpu:0",
        "--step", "1", "--inject", f"{PLAIN_SPEC},rank=1,device=cpu:1", "--out", tmp_path / "b",
        "--json",
    )  # fmt: skip
    assert bisected.exit_code == 1, bisected.output
    found = json.loads(bisected.stdout)
    assert (found["rank"], found["step"], found["phase"], found["module"], found["op"]) == (
        1,
        1,
        "forward",
        "layers.0.attn.wq",
        "aten.mm.default",
    )
    assert found["elements"]["indices"] == [5] and found["bits"]["histogram"] == {"22": 1}


# ---------------------------------------------------------------------------
# Signature entries, state digests and the online detectors' names are the plain ones too.

WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module.")


def step_entries(workload) -> tuple[list[str], list[str]]:
    """The entry names of one captured step of ``workload``, and its state digests' names."""
    capture = SignatureCapture(workload.model, workload.optimizer, program=True)
    try:
        capture.begin_step(capture_rng(torch.device("cpu")))
        with capture.backward_capture():
            workload.run_step(workload.get_batch(0))
        names = [name for name, _ in capture.end_step()]
    finally:
        capture.close()
    return names, list(state_digests(workload.model, optimizer=workload.optimizer))


@pytest.mark.parametrize("wrapper", ["checkpoint", "ddp"])
def test_a_wrapped_models_entries_and_state_digests_name_the_plain_modules(wrapper, request):
    if wrapper == "ddp":
        request.getfixturevalue("lone_rank")
    plain, plain_state = step_entries(build_workload("builtin:tiny-llama", SMALL))
    names, state = step_entries(wrapped_as(build_workload("builtin:tiny-llama", SMALL), wrapper))
    assert not [name for name in names + state if any(s in name for s in WRAPPER_SEGMENTS)]
    assert state == plain_state
    if wrapper == "ddp":  # DDP and its module are one module, <root>
        assert names == plain
    else:  # the checkpointed block's modules run again as its backward recomputes them
        assert [name for name in names if "#1" not in name] == plain
        assert "forward:layers.0.attn.wq#1" in names and names.count("forward:layers.0") == 1


CHECKPOINTED_WORKLOAD = f"""
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from sdcreplay.workload.tiny_llama import make_workload as tiny_llama


def make_workload(seed=0):
    workload = tiny_llama(seed=seed, **{SMALL!r})
    layers = workload.model.layers  # TorchTitan's activation checkpointing, per block
    for position, block in enumerate(layers):
        layers[position] = checkpoint_wrapper(block)
    return workload
"""


@contextlib.contextmanager
def recording_as_before_plain_names() -> Iterator[None]:
    """The Recorder as it was before names were plain (bc92bfc): entries named as
    ``named_modules()`` names them, a wrapper and what it wraps each hooked, and no
    ``capture.naming`` in the manifest."""
    import sdcreplay.recording.recorder as recorder

    def settings(**fields) -> CaptureSettings:
        made = CaptureSettings(**fields)
        made.absent = made.absent | {"naming"}
        return made

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recorder, "SignatureCapture", partial(SignatureCapture, names="wrapped"))
        patch.setattr(recorder, "CaptureSettings", settings)
        yield


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> dict[str, Path]:
    """Two steps of tiny-llama with checkpointed blocks: recorded now, and as before."""
    where = tmp_path_factory.mktemp("checkpointed")
    (where / "checkpointed.py").write_text(CHECKPOINTED_WORKLOAD)
    ref = f"{where / 'checkpointed.py'}:make_workload"
    with preserved_global_state():
        record(ref, where / "plain.bundle", steps=2)
    with preserved_global_state(), recording_as_before_plain_names():
        # verify=False: that Recorder's first-step check refuses a checkpointed model
        record(ref, where / "wrapped.bundle", steps=2, verify=False)
    return {"plain": where / "plain.bundle", "wrapped": where / "wrapped.bundle"}


def entry_names(bundle: Path) -> set[str]:
    return {
        name
        for entries in Bundle.open(bundle).signature_log().steps.values()
        for name, _ in entries
    }


def test_a_checkpointed_models_replay_and_bisect_name_the_plain_module(cli, checkpointed, tmp_path):
    names = entry_names(checkpointed["plain"])
    assert {"forward:layers.0", "forward:layers.0.attn.wq", "grad:layers.0.attn.wq.weight"} <= names
    assert not [name for name in names if any(s in name for s in WRAPPER_SEGMENTS)]
    assert Bundle.open(checkpointed["plain"]).manifest.capture.naming == "plain"
    spec = f"{PLAIN_SPEC},device=cpu:1"
    replayed = cli(
        "replay", checkpointed["plain"], "-d", "cpu:0", "-d", "cpu:1", "--inject", spec, "--json"
    )
    assert replayed.exit_code == 1, replayed.output
    report = json.loads(replayed.stdout)
    assert report["verdict"] == "persistent"
    assert report["consensus"]["first_divergence"]["name"] == "forward:layers.0.attn.wq"
    bisected = cli(
        "bisect", checkpointed["plain"], "--suspect", "cpu:1", "--reference", "cpu:0",
        "--step", "1", "--inject", spec, "--out", tmp_path / "b", "--json",
    )  # fmt: skip
    assert bisected.exit_code == 1, bisected.output
    found = json.loads(bisected.stdout)
    assert (found["step"], found["phase"], found["module"]) == (1, "forward", "layers.0.attn.wq")
    assert not [s for s in WRAPPER_SEGMENTS[:3] if s in bisected.stdout]


def test_a_bundle_recorded_with_wrapped_names_still_replays_correct(cli, checkpointed):
    names = entry_names(checkpointed["wrapped"])
    assert "forward:layers.0._checkpoint_wrapped_module.attn.wq" in names
    assert "naming" not in Bundle.open(checkpointed["wrapped"]).manifest.capture.to_json()
    replayed = cli("replay", checkpointed["wrapped"], "-d", "cpu:0", "--json")
    assert replayed.exit_code == 0, replayed.output
    report = json.loads(replayed.stdout)
    assert report["verdict"] == "correct"
    (log,) = Path(report["log_dir"]).glob("*.sig.zst")
    same = cli("diff", checkpointed["wrapped"], log, "--json")
    assert same.exit_code == 0 and json.loads(same.stdout)["identical"], same.output
    other = cli("diff", checkpointed["wrapped"], checkpointed["plain"])
    assert other.exit_code == 3, other.output
    assert "recorded before names were plain" in " ".join(other.output.split())


def test_compiled_regions_are_named_by_plain_path_as_the_entries_they_computed():
    """A divergent entry is placed in the compiled region that computed it by name: the
    region's path and modules are plain, as the entries are."""
    (region,) = find_regions(wrapped_model())
    assert (region.path, region.modules) == ("0", ["0", "0.fc", "0.module"])
    assert entry_region("grad:0.module.weight", [region]).startswith("compiled region 0 ")
    assert entry_region("forward:1.fc", [region]) is None
    (whole,) = find_regions(nn.DataParallel(torch.compile(nn.Sequential(Block()))))
    assert (whole.path, whole.modules) == (ROOT, [ROOT, "0", "0.fc", "0.module"])
    (kept,) = find_regions(wrapped_model(), "wrapped")  # a bundle recorded before plain names
    assert (kept.path, kept.modules[:2]) == ("module.0", ["module.0", "module.0._orig_mod"])
