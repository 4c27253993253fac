"""The meshes trainers build for FSDP2, as ``torchrun`` starts them (2 ranks; the tests copy
it into tmp_path): ``python -m torch.distributed.run --standalone --nproc_per_node 2
mesh_layout_script.py OUT``. For each mesh a tiny ``fully_shard`` model; rank 0 writes
``detect_layout``'s dimensions, ``[name, size, kind]`` each, to OUT as JSON by case:

- ``torchtitan``: TorchTitan 0.3.0's, a 1-D ``world`` mesh unflattened into
  ``(pp, dp_replicate, fsdp, tp)``, FSDP on ``fsdp``;
- ``flattened``: older TorchTitan's, every dimension named (size-1 ones too), ``dp``,
  ``dp_shard_cp`` and ``dp_cp`` flattened, FSDP on ``dp_shard_cp``;
- ``hsdp``: the same mesh, FSDP on ``(dp_replicate, dp_shard_cp)``;
- ``replicate``: HSDP whose shard dimension has size 1, FSDP on ``(dp_replicate, dp_shard_cp)``;
- ``dp``: the same mesh, FSDP on its flattened ``dp``;
- ``cp``: context parallelism only, FSDP on ``dp_shard_cp`` (no data-parallel dimension).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sdcreplay.bundle.layout import detect_layout

NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


def titan(shape: tuple[int, ...]):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=NAMES[: len(shape)])
    if len(shape) == 4:
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    else:
        mesh["dp_shard"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def layout_of(mesh) -> list[list]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=mesh)
    return [[d.name, d.size, d.kind] for d in detect_layout(model).dimensions]


def main() -> None:
    dist.init_process_group("gloo")
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (1, 1, 2, 1), ("pp", "dp_replicate", "fsdp", "tp"))
    flat = titan((1, 2, 1, 1))
    replicate = titan((2, 1))
    context = init_device_mesh("cpu", (1, 1, 2, 1), mesh_dim_names=("r", "s", "cp", "t"))
    context["s", "cp"]._flatten("s_cp")
    found = {
        "torchtitan": layout_of(dense["fsdp"]),
        "flattened": layout_of(flat["dp_shard_cp"]),
        "hsdp": layout_of(flat["dp_replicate", "dp_shard_cp"]),
        "replicate": layout_of(replicate["dp_replicate", "dp_shard_cp"]),
        "dp": layout_of(replicate["dp"]),
        "cp": layout_of(context["s_cp"]),
    }
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(found, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
