"""The parallel layout a job manifest records: peers, groups and coordinates of each rank,
and the refusal of a layout that does not describe the job."""

from __future__ import annotations

import json
import shutil

import pytest

from sdcreplay.bundle.layout import ParallelLayout, kind_of
from sdcreplay.errors import BundleError
from tests.conftest import TESTS, run_torchrun


def test_ddp_world_every_rank_a_peer_and_alone_in_its_group():
    layout = ParallelLayout.data_parallel_world(4)
    assert layout.data_parallel == ["dp"] and not layout.sharded
    assert layout.peers(2) == [0, 1, 2, 3]
    assert layout.model_parallel_group(2) == [2]
    assert layout.peer_classes() == [[0, 1, 2, 3]]
    assert layout.counterpart(3, 1) == 1
    assert layout.describe(2) == "rank 2 (dp=2)"


def test_dp_by_tp_peers_are_the_same_tensor_coordinate_in_other_groups():
    layout = ParallelLayout.grid([("dp", 3, "replicate"), ("tp", 2, "tensor")])
    assert layout.coordinates_of(3) == {"dp": 1, "tp": 1}
    assert layout.peers(3) == [1, 3, 5]
    assert layout.model_parallel_group(3) == [2, 3]
    assert layout.peer_classes() == [[0, 2, 4], [1, 3, 5]]
    assert layout.counterpart(5, 0) == 1  # fed (dp=0, tp=1)'s batch
    assert layout.counterpart(5, 2) == 3  # fed (dp=1, tp=1)'s
    assert layout.describe(3) == "rank 3 (dp=1, tp=1)"
    assert layout.shape() == "dp=3 x tp=2"


def test_hsdp_both_dimensions_data_parallel_and_sharded():
    layout = ParallelLayout.grid([("dp_replicate", 2, "replicate"), ("dp_shard", 2, "shard")])
    assert layout.data_parallel == ["dp_replicate", "dp_shard"] and layout.sharded
    assert layout.peers(1) == [0, 1, 2, 3] and layout.model_parallel_group(1) == [1]


def test_round_trip_and_refusals():
    layout = ParallelLayout.grid([("pp", 2, "pipeline"), ("dp", 2, "replicate")])
    assert ParallelLayout.from_json(layout.to_json()) == layout
    broken = layout.to_json()
    broken["coordinates"][1] = [0, 0]
    with pytest.raises(BundleError, match="two ranks one place"):
        ParallelLayout.from_json(broken)
    broken = layout.to_json()
    broken["dimensions"][0]["size"] = 3
    with pytest.raises(BundleError, match="do not multiply"):
        ParallelLayout.from_json(broken)
    broken = layout.to_json()
    broken["dimensions"][0]["kind"] = "$(rm -rf /)"
    with pytest.raises(BundleError, match="kind"):
        ParallelLayout.from_json(broken)


def test_kinds_from_the_usual_names():
    assert [kind_of(n) for n in ("dp", "dp_shard", "tp", "pp", "cp", "ep", "foo")] == [
        "replicate", "shard", "tensor", "pipeline", "context", "expert", "other",
    ]  # fmt: skip


def test_kinds_of_torchtitans_names():
    """TorchTitan's mesh dimensions, flattened ones too: ``fsdp`` (0.3.0: dp_shard x cp),
    ``dp_shard_cp``, ``dp`` and ``dp_cp`` (flattened), ``batch`` (its data loading's)."""
    names = ("dp_replicate", "dp_shard", "fsdp", "dp_shard_cp", "efsdp", "dp", "dp_cp", "batch")
    assert [kind_of(n) for n in names] == [
        "replicate", "shard", "shard", "shard", "shard", "replicate", "replicate", "replicate",
    ]  # fmt: skip
    assert [kind_of(n) for n in ("cp", "tp", "pp", "ep", "world")] == [
        "context", "tensor", "pipeline", "expert", "other",
    ]  # fmt: skip


def test_fsdp2_layouts_from_the_meshes_trainers_build(tmp_path):
    """2 ranks of gloo, `fully_shard` on each mesh of tests/mesh_layout_script.py: the
    data-parallel dimension found under TorchTitan's names, flattened or cut from its 1-D
    ``world`` mesh; size-1 dimensions left out; ``cp`` kept apart from ``dp_shard``."""
    script = tmp_path / "mesh_layout_script.py"
    shutil.copy(TESTS / "mesh_layout_script.py", script)
    done = run_torchrun(script, 2, str(tmp_path / "layouts.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "layouts.json").read_text()) == {
        "torchtitan": [["fsdp", 2, "shard"]],
        "flattened": [["dp_shard", 2, "shard"]],
        "hsdp": [["dp_shard", 2, "shard"]],
        "replicate": [["dp_replicate", 2, "replicate"]],
        "dp": [["dp_replicate", 2, "shard"]],
        "cp": [["cp", 2, "context"]],
    }


def test_a_layout_that_knows_only_the_world_size_names_a_rank_plainly():
    """Nothing said beyond the world size: `rank 1`, never `rank 1 (world=1)`."""
    layout = ParallelLayout.grid([("world", 2, "other")], "world")
    assert layout.describe(1) == "rank 1" and layout.where(1) is None
    assert ParallelLayout.data_parallel_world(2).where(1) == "dp=1"
