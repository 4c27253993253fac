"""Compiled regions: found in a model, their generated code digested as Inductor writes it, a
replay's code compared with the record's, and the tool's hooks never traced by Dynamo.

The models are tiny (CPU Inductor, g++): each compile costs seconds on a loaded machine, and
Inductor's on-disk caches make the second one cheap.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sdcreplay
from sdcreplay.capture.compiled import (
    ROOT,
    CompiledGraph,
    CompiledRegion,
    find_regions,
    graph_breaks,
    regions_problem,
    watching,
)
from sdcreplay.compare.compiled_code import code_differences, entry_region

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compiled_loop import Net, make_workload  # noqa: E402


def _region(path: str, *graphs: CompiledGraph, **fields) -> CompiledRegion:
    return CompiledRegion(path=path, backend="inductor", graphs=list(graphs), **fields)


FORWARD = CompiledGraph("forward", "a" * 64, ("cpp_fused_add_0",))
BACKWARD = CompiledGraph("backward", "b" * 64, ("cpp_fused_sum_0", "cpp_fused_add_1"))


def test_regions_are_named_by_module_path_with_how_they_were_compiled():
    whole = torch.compile(Net(), dynamic=False, fullgraph=True, options={"max_fusion_size": 8})
    (region,) = find_regions(whole)
    assert (region.path, region.backend, region.dynamic, region.fullgraph) == (
        ROOT,
        "inductor",
        False,
        True,
    )
    assert region.options == {"max_fusion_size": 8}
    assert region.modules[:3] == [ROOT, "layers", "layers.0"]  # plain: no _orig_mod
    net = Net()
    for block in net.layers:
        block.compile(dynamic=True, mode="max-autotune-no-cudagraphs")
    regions = find_regions(net)
    assert [r.path for r in regions] == ["layers.0", "layers.1"]
    assert [r.modules for r in regions][1] == ["layers.1", "layers.1.fc", "layers.1.norm"]
    assert {(r.dynamic, r.mode) for r in regions} == {(True, "max-autotune-no-cudagraphs")}
    assert find_regions(Net()) == []


def test_a_replays_code_is_compared_region_by_region_naming_what_differs():
    recorded = [_region("layers.0", FORWARD, BACKWARD, settings={"max_fusion_size": 64})]
    same = [_region("layers.0", FORWARD, BACKWARD, settings={"max_fusion_size": 64})]
    assert code_differences(recorded, same) == []
    other = CompiledGraph("backward", "c" * 64, BACKWARD.kernels)
    replayed = [_region("layers.0", FORWARD, other, settings={"$TORCHINDUCTOR_X": "1"})]
    assert code_differences(recorded, replayed) == [
        "compiled: region layers.0's backward graph has other generated code than the record's "
        "(settings: $TORCHINDUCTOR_X default here 1; max_fusion_size 64 here default)"
    ]
    assert code_differences(recorded, [_region("layers.0", FORWARD, other)])[0].endswith(
        "(settings: max_fusion_size 64 here default)"
    )
    assert code_differences([_region("layers.0", FORWARD)], [_region("layers.0", other)]) == [
        "compiled: region layers.0's backward graph has other generated code than the record's "
        "(same settings: another torch, compiler or machine generated it)"
    ]
    # Code the record never saw generated (compiled before the Recorder began) proves nothing.
    assert code_differences([_region("layers.0")], replayed) == []
    assert code_differences(recorded, []) == ["compiled: region layers.0 is not compiled here"]
    assert code_differences([], [_region("head", FORWARD)]) == [
        "compiled: region head runs compiled code here, not in the record"
    ]


def test_an_entry_is_placed_in_the_region_and_graph_that_computed_it():
    regions = [
        _region("layers.0", FORWARD, BACKWARD, modules=["layers.0", "layers.0.fc"]),
        _region("layers.1", FORWARD, modules=["layers.1"]),
    ]
    assert entry_region("forward:layers.0.fc", regions) == (
        "compiled region layers.0 (inductor, forward graph: 1 kernels, covering layers.0, "
        "layers.0.fc)"
    )
    assert entry_region("grad:layers.0.fc.weight", regions) == (
        "compiled region layers.0 (inductor, backward graph: 2 kernels, covering layers.0, "
        "layers.0.fc)"
    )
    assert entry_region("backward:layers.1#1", regions).startswith(
        "compiled region layers.1 (inductor, backward graph, covering"
    )
    assert entry_region("param:layers.0.fc.weight", regions) is None  # the optimizer's update
    assert entry_region("forward:head", regions) is None


def test_a_manifests_compiled_list_is_checked_before_it_is_read():
    good = [_region("layers.0", FORWARD, BACKWARD).to_json()]
    assert regions_problem(good) is None
    assert [CompiledRegion.from_json(r) for r in good][0].graphs == [FORWARD, BACKWARD]
    bad_digest = [dict(good[0], graphs=[dict(FORWARD.to_json(), digest="$(rm -rf /)")])]
    assert "SHA-256" in regions_problem(bad_digest)
    assert regions_problem([dict(good[0], path=7)]) == "compiled[0].path is a str"
    assert regions_problem("layers") == "a list of compiled regions"


def test_each_regions_forward_and_backward_code_is_digested_as_inductor_writes_it():
    net = Net()
    for block in net.layers:
        block.compile()
    x = torch.randn(4, 8)
    with watching(net) as watch:
        net(x).sum().backward()
        regions = {region.path: region for region in watch.regions()}
    assert sorted(regions) == ["layers.0", "layers.1"]
    for region in regions.values():
        assert [graph.kind for graph in region.graphs] == ["forward", "backward"]
        assert all(k.startswith("cpp_fused_") for g in region.graphs for k in g.kernels)
        assert region.settings["(cpu vector isa)"]
    # A second model of the same code in this process: Dynamo's caches, nothing regenerated;
    # a fresh watch of a fresh compile sees the very same code. Its third block generates
    # nothing: Dynamo's cache serves it the second block's code, which it lists as the code it
    # ran, forward and backward.
    again = Net(depth=3)
    for block in again.layers:
        block.compile()
    with watching(again) as watch:
        torch._dynamo.reset()
        again(x).sum().backward()
        digests = {r.path: [g.digest for g in r.graphs] for r in watch.regions()}
    first = {path: [g.digest for g in r.graphs] for path, r in regions.items()}
    assert digests == {**first, "layers.2": first["layers.1"]}
    assert net.layers[0]._compiled_call_impl.__name__ == "_call_impl"  # the watch let go


@pytest.mark.parametrize("signature", ["boundary", "layer"])
def test_the_recorder_adds_no_graph_break_and_records_the_compiled_step(tmp_path, signature):
    workload = make_workload(compile="blocks")
    batches = [workload.get_batch(index) for index in range(2)]
    before = graph_breaks()
    workload.train_step(batches[0])
    assert graph_breaks() == before  # the model's own: none
    recorder = sdcreplay.Recorder(
        tmp_path / "run.bundle",
        f"{Path(__file__).resolve().parents[1] / 'compiled_loop.py'}:make_workload",
        workload.model,
        workload.optimizer,
        workload_kwargs={"compile": "blocks"},
        signature=signature,
    )
    torch._dynamo.reset()  # the recorded step compiles again, watched
    for batch in batches:
        with recorder.step(batch):
            loss = F.mse_loss(workload.model(batch["x"]), batch["y"])
            loss.backward()
            workload.optimizer.step()
            workload.optimizer.zero_grad()
    path = recorder.close()
    assert graph_breaks() == before
    bundle = sdcreplay.Bundle.open(path)
    assert bundle.verified
    regions = bundle.compiled_regions
    assert [(r.path, [g.kind for g in r.graphs]) for r in regions] == [
        ("layers.0", ["forward", "backward"]),
        ("layers.1", ["forward", "backward"]),
    ]
    names = [name for name, _ in bundle.signature_log().steps[0]]
    inside = [
        name for name in names if name.startswith(("forward:layers.0.", "backward:layers.0."))
    ]
    assert inside == []  # modules inside a compiled region are its entry's
    if signature == "layer":
        assert "forward:layers.0" in names and "backward:layers.1" in names
    else:
        assert not any(name.startswith("forward:") for name in names)


def test_a_compiled_loss_served_from_dynamos_cache_is_the_outside_regions_code():
    """TorchTitan compiles its loss beside the blocks. Re-executed in the process that
    compiled it (or with Dynamo's cache warm), the loss's code is run, never generated again:
    it used to be unseen, and the first-step check said 'region <outside> is not compiled
    here'. Run from the cache it is the outside region's, as when it was generated."""
    net = Net()
    for block in net.layers:
        block.compile()
    loss = torch.compile(lambda out: (out.float() ** 2).mean())
    x = torch.randn(4, 8)

    def step() -> None:
        loss(net(x)).backward()

    with watching(net) as generated:
        step()
    with watching(net) as cached:
        step()
    recorded = {region.path: region for region in generated.regions()}
    replayed = {region.path: region for region in cached.regions()}
    assert recorded["<outside>"].graphs and replayed["<outside>"].graphs
    assert {g.digest for g in replayed["<outside>"].graphs} <= {
        g.digest for g in recorded["<outside>"].graphs
    }
    assert code_differences(generated.regions(), cached.regions()) == []
