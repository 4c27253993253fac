"""capture/memory.py on DTensors, and every path that asks a tensor's memory through it, on 2
real gloo ranks (a script under torchrun, as a user's job runs).

Each rank holds its half of an ``arange(32)`` ``[8, 4]`` DTensor sharded by rows: its memory
is the local shard's, and bisect's memory map, fault injection, digests, forensics and the
probe all see that shard (a DTensor itself has no storage to read).
"""

from __future__ import annotations

import json
import textwrap

from conftest import run_torchrun

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from sdcreplay.capture import memory
    from sdcreplay.capture.digest import tensor_digest
    from sdcreplay.capture.fault_spec import FaultSpec
    from sdcreplay.capture.faults import corrupt
    from sdcreplay.capture.operators import OperatorLog, OperatorMode
    from sdcreplay.capture.probe import collecting_calls
    from sdcreplay.compare.forensics import element_forensics

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(32.0).reshape(8, 4)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    local = sharded._local_tensor
    transposed = local.t()
    report = {
        "shard_is_local": memory.local_shard(sharded) is local,
        "storage": memory.storage_address(sharded) == local.untyped_storage().data_ptr(),
        "data": memory.data_address(sharded) == local.data_ptr(),
        "layout": memory.storage_layout(transposed),
        "position": memory.storage_position(transposed, 1),  # [0, 1] of the transpose: [1, 0]
        "meta_has_memory": memory.has_memory(torch.empty(2, device="meta")),
        "digest": tensor_digest(sharded) == tensor_digest(local.clone()),
    }
    before = local.clone()
    changed = corrupt(FaultSpec(kind="bitflip", op="aten.mm", index=5, bit=0), sharded)
    report["corrupted"] = changed
    report["forensics"] = element_forensics(before, sharded)
    report["forensics"] = {k: report["forensics"][k] for k in ("indices", "shape", "local_shard")}

    # bisect's memory map: the call that last wrote a DTensor's shard is its producer
    model = torch.nn.Linear(4, 4)
    log = OperatorLog(expected=None)
    with OperatorMode(model, None, [log], step=0):
        doubled = sharded * 2
    report["logged"] = [(r.site.op, len(r.digests)) for r in log.records]
    report["doubled_digest"] = log.records[-1].digests[0] == tensor_digest(doubled._local_tensor)
    with collecting_calls(torch.device("cpu")) as collector:
        sharded + 1
    report["probe"] = [c.args[0]["tensor"]["shape"] for c in collector.calls.values()]
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # before torch's teardown, which after gloo sometimes aborts
""")


def test_every_path_takes_a_dtensors_memory_from_its_local_shard(tmp_path):
    script = tmp_path / "shards.py"
    script.write_text(SCRIPT)
    done = run_torchrun(script, 2, str(tmp_path), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["shard_is_local"] and report["storage"] and report["data"]
        assert report["layout"] == [0, [1, 4]] and report["position"] == 4
        assert report["meta_has_memory"] is False and report["digest"]
        assert report["corrupted"] == [[5], 0]  # element 5 of the rank's [4, 4] shard
        assert report["forensics"] == {"indices": [5], "shape": [4, 4], "local_shard": True}
        assert report["logged"] == [["aten.mul.Tensor", 1]] and report["doubled_digest"]
        assert report["probe"] == [[4, 4]]  # the kernel a rank runs: on its shard
