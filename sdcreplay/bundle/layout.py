"""A job's parallel layout: the device mesh its ranks form, and which of its dimensions are
data-parallel.

Data-parallel peers (the ranks whose every other coordinate is the same) run the same
program on other batches; fed one batch, they compute the same values bit for bit, which is
what lets a replay judge a rank by its peers at any size (docs/at-scale.md). The layout is
recorded in the job manifest (``layout``), shown by ``info``, and read by replay, the origin
rule and bisect. `detect_layout` reads it off a live job: DDP's process group, the device
mesh of the model's DTensors (FSDP2, HSDP, tensor parallelism), or a layout the script
declares (``Recorder(layout=ParallelLayout.from_mesh(mesh, {...}))``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import BundleError, SdcReplayError
from .manifest import MAX_WORLD_SIZE
from .rules import Check, Record, _check_fields, _is_int, _require, choice, integer, text

KINDS = ("replicate", "shard", "tensor", "pipeline", "context", "expert", "other")
"""What a mesh dimension does: ``replicate`` (data-parallel, parameters replicated: DDP, HSDP's
replicate dimension), ``shard`` (data-parallel, parameters sharded: FSDP2, HSDP's shard
dimension), ``tensor``, ``pipeline``, ``context``, ``expert`` (model-parallel), ``other``."""

DATA_PARALLEL = ("replicate", "shard")

_NAME = r"[A-Za-z_][A-Za-z0-9_.-]{0,63}"

_KIND_BY_NAME = (  # a mesh dimension's usual names, as TorchTitan and Megatron spell them
    (
        ("dp_replicate", "replicate", "ddp", "dp", "dp_cp", "batch", "data", "data_parallel"),
        "replicate",
    ),
    (("dp_shard", "fsdp", "shard", "dp_shard_cp", "efsdp", "hsdp_shard"), "shard"),
    (("tp", "tensor", "model", "mp"), "tensor"),
    (("pp", "pipe", "pipeline"), "pipeline"),
    (("cp", "context", "sp"), "context"),
    (("ep", "expert"), "expert"),
)


@dataclass(kw_only=True)
class MeshDimension(Record):
    """One dimension of the job's device mesh: its name, size and what it does (`KINDS`)."""

    RULES: ClassVar[dict[str, Check]] = {
        "name": text(64, _NAME),
        "size": integer(1, MAX_WORLD_SIZE),
        "kind": choice(*KINDS),
    }
    name: str
    size: int
    kind: str

    @property
    def data_parallel(self) -> bool:
        return self.kind in DATA_PARALLEL


@dataclass(kw_only=True)
class ParallelLayout(Record):
    """The job's mesh: its dimensions (outermost first) and each rank's coordinates in it
    (``coordinates[r]``, one per dimension). ``source``: how it was found (``ddp``,
    ``device_mesh``, ``declared``, ``world``: nothing said more than the world size)."""

    world_size: int
    dimensions: list[MeshDimension]
    coordinates: list[list[int]]
    source: str = "declared"

    SOURCES = ("ddp", "device_mesh", "declared", "world")

    @classmethod
    def from_json(cls, obj: Any) -> ParallelLayout:
        _validate(obj)
        return cls._read(obj, dimensions=[MeshDimension._read(d) for d in obj["dimensions"]])

    @classmethod
    def grid(
        cls, dimensions: list[tuple[str, int, str]], source: str = "declared"
    ) -> ParallelLayout:
        """Ranks numbered row-major over ``dimensions`` ((name, size, kind), outermost first),
        as ``init_device_mesh`` numbers them."""
        dims = [MeshDimension(name=n, size=s, kind=k) for n, s, k in dimensions]
        sizes = [d.size for d in dims]
        coordinates = [list(c) for c in itertools.product(*(range(s) for s in sizes))]
        layout = cls(
            world_size=math.prod(sizes), dimensions=dims, coordinates=coordinates, source=source
        )
        _validate(layout.to_json())
        return layout

    @classmethod
    def data_parallel_world(cls, world_size: int, kind: str = "replicate") -> ParallelLayout:
        """Every rank a data-parallel peer of every other (DDP over the world; FSDP2 with
        ``kind="shard"``)."""
        name, source = ("dp_shard", "device_mesh") if kind == "shard" else ("dp", "ddp")
        return cls.grid([(name, world_size, kind)], source)

    @classmethod
    def from_mesh(
        cls, mesh: Any, kinds: dict[str, str] | None = None, source: str = "declared"
    ) -> ParallelLayout:
        """The layout of a ``DeviceMesh`` spanning the job: ``kinds`` names what each dimension
        does (default: from its name, `KINDS`)."""
        names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])
        kinds = dict(kinds or {})
        unknown = sorted(set(kinds) - set(names))
        if unknown:
            raise SdcReplayError(
                f"the mesh has no dimension {unknown[0]!r} (it has {names})",
                "Name the kinds of the mesh's own dimensions (mesh_dim_names).",
            )
        ranks = mesh.mesh.tolist()
        shape = list(mesh.mesh.shape)
        coordinates: dict[int, list[int]] = {}
        for index in itertools.product(*(range(s) for s in shape)):
            value: Any = ranks
            for i in index:
                value = value[i]
            coordinates[int(value)] = list(index)
        dims = [
            MeshDimension(name=name, size=size, kind=kinds.get(name) or kind_of(name))
            for name, size in zip(names, shape)
        ]
        layout = cls(
            world_size=len(coordinates),
            dimensions=dims,
            coordinates=[coordinates.get(rank, []) for rank in range(len(coordinates))],
            source=source,
        )
        _validate(layout.to_json())
        return layout

    # -- questions replay and bisect ask -------------------------------------------------

    @property
    def data_parallel(self) -> list[str]:
        """The names of the data-parallel dimensions."""
        return [d.name for d in self.dimensions if d.data_parallel]

    @property
    def sharded(self) -> bool:
        """Do data-parallel peers hold other shards of the parameters (FSDP2, HSDP)?"""
        return any(d.kind == "shard" for d in self.dimensions)

    def coordinates_of(self, rank: int) -> dict[str, int]:
        return {d.name: c for d, c in zip(self.dimensions, self.coordinates[rank])}

    def where(self, rank: int) -> str | None:
        """``dp=1, tp=0``; None for a layout that knows only the world size (its one
        coordinate is the rank itself)."""
        if self.source == "world":
            return None
        return ", ".join(f"{n}={c}" for n, c in self.coordinates_of(rank).items())

    def describe(self, rank: int) -> str:
        """``rank 2 (dp=1, tp=0)``: a rank by its coordinates (``rank 2`` where it has none)."""
        where = self.where(rank)
        return f"rank {rank}" + (f" ({where})" if where else "")

    def shape(self) -> str:
        """``dp=2 x tp=2`` (kinds in the JSON)."""
        return " x ".join(f"{d.name}={d.size}" for d in self.dimensions)

    def _same(self, rank: int, data_parallel: bool) -> list[int]:
        """The ranks whose coordinates equal rank's in every dimension that is (not)
        data-parallel."""
        axes = [i for i, d in enumerate(self.dimensions) if d.data_parallel is data_parallel]
        mine = [self.coordinates[rank][i] for i in axes]
        return [
            r
            for r, coordinates in enumerate(self.coordinates)
            if [coordinates[i] for i in axes] == mine
        ]

    def peers(self, rank: int) -> list[int]:
        """Rank's data-parallel peers, itself included: the same coordinates in every other
        (model-parallel) dimension, one per data-parallel group."""
        return self._same(rank, data_parallel=False)

    def model_parallel_group(self, rank: int) -> list[int]:
        """The ranks of rank's data-parallel group: what replays together when rank replays
        without its peers (its tensor/pipeline group; rank alone under plain DDP or FSDP2)."""
        return self._same(rank, data_parallel=True)

    def peer_classes(self) -> list[list[int]]:
        """Every class of data-parallel peers, by lowest rank."""
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            peers = self.peers(rank)
            seen.setdefault(peers[0], peers)
        return [seen[key] for key in sorted(seen)]

    def counterpart(self, rank: int, source: int) -> int:
        """The rank of ``source``'s data-parallel group with rank's model-parallel coordinates:
        whose batch and RNG rank is fed when every group is fed ``source``'s group's."""
        axes = [i for i, d in enumerate(self.dimensions) if d.data_parallel]
        wanted = list(self.coordinates[rank])
        for i in axes:
            wanted[i] = self.coordinates[source][i]
        return self.coordinates.index(wanted)


def kind_of(name: str) -> str:
    """A mesh dimension's kind from its name (``dp``: replicate; a layout detected from the
    parameters' placements says ``shard`` where they are sharded along it)."""
    lowered = name.lower()
    for names, kind in _KIND_BY_NAME:
        if lowered in names:
            return kind
    return "other"


def _validate(obj: Any) -> None:
    _require(isinstance(obj, dict), "layout is not an object")
    _check_fields(
        obj,
        {
            "world_size": integer(1, MAX_WORLD_SIZE),
            "source": choice(*ParallelLayout.SOURCES),
            "dimensions": Check(
                lambda v: isinstance(v, list) and 0 < len(v) <= 16, "a list of 1 to 16 objects"
            ),
            "coordinates": Check(
                lambda v: isinstance(v, list) and len(v) <= MAX_WORLD_SIZE, "a list"
            ),
        },
        "layout.",
    )
    sizes = []
    for position, dimension in enumerate(obj["dimensions"]):
        _require(isinstance(dimension, dict), f"layout.dimensions[{position}] is not an object")
        _check_fields(dimension, MeshDimension.RULES, f"layout.dimensions[{position}].")
        sizes.append(dimension["size"])
    names = [d["name"] for d in obj["dimensions"]]
    _require(len(set(names)) == len(names), f"layout.dimensions repeat a name: {names}")
    _require(
        math.prod(sizes) == obj["world_size"],
        f"layout's dimensions {sizes} do not multiply to world_size {obj['world_size']}",
    )
    coordinates = obj["coordinates"]
    _require(len(coordinates) == obj["world_size"], "layout.coordinates is not one per rank")
    for rank, point in enumerate(coordinates):
        _require(
            isinstance(point, list)
            and len(point) == len(sizes)
            and all(_is_int(c) and 0 <= c < s for c, s in zip(point, sizes)),
            f"layout.coordinates[{rank}] is {str(point)[:60]}, expected one index per dimension",
        )
    _require(
        len({tuple(point) for point in coordinates}) == len(coordinates),
        "layout.coordinates give two ranks one place",
    )


# ---------------------------------------------------------------------------
# Reading the layout off a live job.


def detect_layout(model: Any, data_parallel: Any = None) -> ParallelLayout:
    """This job's layout, from what the model is: the device mesh its DTensor parameters live
    on (FSDP2, HSDP, tensor parallelism), or DDP over the world. Of the meshes that span the
    job, the root a trainer built is preferred (its ``cp`` stays apart from ``dp_shard``) over
    the parameters' own (a flattened ``dp_shard_cp``, or TorchTitan's ``fsdp`` cut from a 1-D
    ``world`` mesh), unless one of its dimensions has no known kind. A dimension is ``shard``
    where parameters are sharded along it and its name says data-parallel; size-1 dimensions
    are left out. A job that says neither is ``world``: one dimension of kind ``other``."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    meshes = _parameter_meshes(model, world_size)
    layouts = []
    for mesh, sharded_on in meshes:
        names = list(mesh.mesh_dim_names or [])
        if not names:
            continue
        kinds = {}
        for i, name in enumerate(names):
            if kind_of(name) == "replicate" and i in sharded_on:
                kinds[name] = "shard"
        layouts.append(_without_singletons(ParallelLayout.from_mesh(mesh, kinds, "device_mesh")))
    for layout in layouts:
        if all(d.kind != "other" for d in layout.dimensions):
            return layout
    if layouts:
        return layouts[0]
    if meshes and _is_fsdp(model):  # fully_shard's own mesh
        return ParallelLayout.data_parallel_world(world_size, "shard")
    if _is_ddp(data_parallel) and dist.get_world_size(data_parallel.process_group) == world_size:
        return ParallelLayout.data_parallel_world(world_size)
    return ParallelLayout.grid([("world", world_size, "other")], "world")


def _parameter_meshes(model: Any, world_size: int) -> list[tuple[Any, set[int]]]:
    """The meshes that span the job, root first: the root of the first DTensor parameter's
    mesh and that mesh itself, each with its dimensions along which some parameter (on a mesh
    of that root) is sharded, however the parameter's mesh was sliced or flattened from it."""
    from torch.distributed.tensor import DTensor, Shard

    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not params:
        return []
    own = params[0].device_mesh
    root = _root_of(own)
    candidates = [m for m in (root, own) if m.mesh.numel() == world_size]
    if len(candidates) == 2 and candidates[1] is candidates[0]:
        candidates.pop()
    found = []
    for candidate in candidates:
        place = _places(candidate)
        sharded_on: set[int] = set()
        for param in params:
            mesh = param.device_mesh
            if _root_of(mesh) is not root:
                continue
            for i, placement in enumerate(param.placements):
                if isinstance(placement, Shard):
                    sharded_on |= _moves_along(mesh, i, place)
        found.append((candidate, sharded_on))
    return found


def _places(mesh: Any) -> dict[int, list[int]]:
    """Each global rank's coordinates in ``mesh``."""
    shape = list(mesh.mesh.shape)
    ranks = mesh.mesh.reshape(-1).tolist()
    return {int(r): list(c) for r, c in zip(ranks, itertools.product(*map(range, shape)))}


def _moves_along(mesh: Any, dim: int, place: dict[int, list[int]]) -> set[int]:
    """The dimensions (of the mesh whose coordinates are ``place``) along which this rank's
    group on ``mesh``'s dimension ``dim`` spreads."""
    index: list[Any] = list(mesh.get_coordinate() or [])
    if len(index) != mesh.ndim:
        return set()
    index[dim] = slice(None)
    ranks = mesh.mesh[tuple(index)].reshape(-1).tolist()
    if not all(int(r) in place for r in ranks):
        return set()
    group = [place[int(r)] for r in ranks]
    return {d for point in group for d, c in enumerate(point) if c != group[0][d]}


def _without_singletons(layout: ParallelLayout) -> ParallelLayout:
    """The layout less its size-1 dimensions (a trainer names every dimension it knows, used
    or not); one is kept where all are."""
    keep = [i for i, d in enumerate(layout.dimensions) if d.size > 1] or [0]
    if len(keep) == len(layout.dimensions):
        return layout
    return ParallelLayout(
        world_size=layout.world_size,
        dimensions=[layout.dimensions[i] for i in keep],
        coordinates=[[point[i] for i in keep] for point in layout.coordinates],
        source=layout.source,
    )


def _root_of(mesh: Any) -> Any:
    getter = getattr(mesh, "_get_root_mesh", None)
    if getter is not None:
        return getter()
    from torch.distributed.device_mesh import _mesh_resources  # older torch

    return _mesh_resources.get_root_mesh(mesh)


def _is_ddp(module: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


def _is_fsdp(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def job_layout(declared: ParallelLayout | None, model: Any, data_parallel: Any) -> ParallelLayout:
    """The layout a recording writes: the one the script declared (checked against the
    job's world size), else `detect_layout`'s."""
    import torch.distributed as dist

    if declared is None:
        return detect_layout(model, data_parallel)
    if declared.world_size != dist.get_world_size():
        raise SdcReplayError(
            f"the declared layout ({declared.shape()}) has {declared.world_size} ranks, the "
            f"job {dist.get_world_size()}",
            "Declare the mesh the job runs on (ParallelLayout.from_mesh(mesh, kinds)).",
        )
    return declared


def require_layout(layout: ParallelLayout | None, path: Any) -> ParallelLayout:
    """The job's recorded layout, or why a command that needs it cannot run."""
    if layout is None:
        raise BundleError(
            f"{path} records no parallel layout (recorded before sdcreplay wrote one)",
            "Record the job again with this version of sdcreplay.",
        )
    return layout
