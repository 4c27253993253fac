"""A replay's generated code against the record's, and which compiled region computed an entry.

Both read only the `CompiledRegion`s a bundle and a replica carry (`capture.compiled`): a
replica with other code for a region is incomparable, named by region, graph and the settings
that differ; an entry's region names where a first divergence was computed.
"""

from __future__ import annotations

from ..capture.compiled import OUTSIDE, ROOT, CompiledRegion


def code_differences(recorded: list[CompiledRegion], replayed: list[CompiledRegion]) -> list[str]:
    """Why a replica's generated code is not the record's, region by region (empty: the same
    code, or none to compare). A region the record did not see compiled cannot be compared."""
    differences = []
    by_path = {region.path: region for region in recorded}
    for region in replayed:
        record = by_path.get(region.path)
        if record is None:
            if region.graphs:
                differences.append(
                    f"compiled: region {region.path} runs compiled code here, not in the record"
                )
            continue
        if not record.observed:
            continue
        known = {(graph.kind, graph.digest) for graph in record.graphs}
        other = [graph for graph in region.graphs if (graph.kind, graph.digest) not in known]
        if not other:
            continue
        differences.append(
            f"compiled: region {region.path}'s {other[0].kind} graph has other generated code "
            f"than the record's ({_what_differs(record, region)})"
        )
    for record in recorded:
        if record.observed and record.path not in {region.path for region in replayed}:
            differences.append(f"compiled: region {record.path} is not compiled here")
    return differences


def _what_differs(record: CompiledRegion, replay: CompiledRegion) -> str:
    settings = sorted(set(record.settings) | set(replay.settings))
    changed = [
        f"{name} {record.settings.get(name, 'default')} here {replay.settings.get(name, 'default')}"
        for name in settings
        if record.settings.get(name) != replay.settings.get(name)
    ]
    for attribute in ("backend", "mode", "options", "dynamic", "fullgraph"):
        if getattr(record, attribute) != getattr(replay, attribute):
            changed.append(
                f"{attribute} {getattr(record, attribute)!r} here {getattr(replay, attribute)!r}"
            )
    if changed:
        return "settings: " + "; ".join(changed[:4])
    return "same settings: another torch, compiler or machine generated it"


def entry_region(name: str, regions: list[CompiledRegion]) -> str | None:
    """Which compiled region (and which of its graphs) computed signature entry ``name``, in
    words; None for an entry computed outside every region (the optimizer's update)."""
    kind, _, target = name.partition(":")
    target = target.split("#")[0].split("[")[0]
    if kind == "forward":
        module, graph = target, "forward"
    elif kind == "backward":
        module, graph = target, "backward"
    elif kind in ("grad", "step_grad"):
        module, graph = target.rpartition(".")[0] or ROOT, "backward"
    else:
        return None
    found = [region for region in regions if region.path != OUTSIDE and region.covers(module)]
    if not found:
        return None
    return max(found, key=lambda region: len(region.path)).describe(graph)
