"""Whether a failure follows the data or the place: random values of the same shape, and the
failing element mapped back to the original call's coordinates.

A failure that random data of the same shape never shows depends on the
values; one that moves to another element when the shape shrinks is tied to
where an element is computed. Both go into the ticket for the vendor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..storage.tensorio import map_tensors
from .shrink import Cut, dense_like
from .trials import Acceptance

RANDOM_DATA_DRAWS = 3


def random_inputs(args: Sequence, kwargs: dict, generator: torch.Generator) -> tuple[list, dict]:
    """The same shapes, dtypes and layouts with random values in each input's range."""

    def draw(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:
            return t.clone()
        if t.dtype == torch.bool:
            values = torch.randint(0, 2, t.shape, generator=generator).bool()
        elif t.is_complex():
            values = torch.randn(t.shape, generator=generator, dtype=t.dtype)
        elif t.is_floating_point():
            finite = t[torch.isfinite(t)].double()
            low, high = (finite.min().item(), finite.max().item()) if finite.numel() else (0.0, 1.0)
            values = (
                torch.rand(t.shape, generator=generator, dtype=torch.float64) * (high - low) + low
            ).to(t.dtype)
        else:
            values = torch.randint(
                int(t.min()), int(t.max()) + 1, t.shape, generator=generator, dtype=t.dtype
            )
        return dense_like(values, t)

    return map_tensors((list(args), kwargs), draw)


def depends_on_data(
    args: list,
    kwargs: dict,
    acceptance: Acceptance,
    seed: int,
    on_draw: Callable[[int, int, int], None] = lambda done, total, held: None,
) -> bool:
    """True when random data of the same shape, dtype and range never meets the acceptance rule.

    ``on_draw(done, total, held)`` after each draw tested; the first that meets it ends the test.
    """
    generator = torch.Generator().manual_seed(seed)
    draws = [random_inputs(args, kwargs, generator) for _ in range(RANDOM_DATA_DRAWS)]
    on_draw(0, RANDOM_DATA_DRAWS, 0)
    for done, draw in enumerate(draws, 1):
        held = acceptance.holds(*draw)
        on_draw(done, RANDOM_DATA_DRAWS, int(held))
        if held:
            return False
    return True


def failing_element_coordinates(
    minimal: dict | None, original: dict | None, cut: Cut, shrunk: bool
) -> dict | None:
    """The failing element in the minimal inputs' coordinates, in the original's, how they relate.

    ``minimal`` is the first mismatch of a failing trial on the minimal inputs,
    ``original`` of one on the original inputs (what bisect saw). An output
    dimension an axis cut maps back through the indices it kept; one no axis
    cut is the original's. A matrix product's inner dimension is in no output
    position but changes every value that sums over it.
    """
    if not minimal or "position" not in minimal or not shrunk:
        return None
    first = None
    if original and "position" in original:
        first = {key: original[key] for key in ("output", "index", "position")}
    result: dict[str, Any] = {
        "minimal": {key: minimal[key] for key in ("output", "index", "position")},
        "original": None,
        "original_first_mismatch": first,
    }
    by_dim = {axis.output_dim: kept for axis, kept in cut if axis.output_dim is not None}
    position = minimal["position"]
    if len(position) <= max(by_dim, default=-1):
        result["why"] = (
            "the failing output does not have the dimensions the shrink cut, "
            "so its element has no place in the original output"
        )
        return result
    mapped = [by_dim[dim][index] if dim in by_dim else index for dim, index in enumerate(position)]
    result["original"] = {"output": minimal["output"], "position": mapped}
    cuts = [(axis, kept) for axis, kept in cut if len(kept) < axis.size]
    kept = "; ".join(f"{axis.name} {_indices(kept)} of {axis.size}" for axis, kept in cuts)
    said = [
        f"the minimal inputs keep {kept or 'every index'}, so element {position} of the "
        f"minimal output is element {mapped} of the original output"
    ]
    inner = [
        f"{len(kept)} of {axis.size} {axis.name} terms"
        for axis, kept in cuts
        if axis.output_dim is None
    ]
    if inner:
        said.append(f"computed from {', '.join(inner)}, so its value differs from the original's")
    if first is not None:
        same = first["position"] == mapped and first["output"] == minimal["output"]
        said.append(
            "the same element the original inputs fail at first"
            if same
            else f"the original inputs fail first at element {first['position']}: "
            + _why_elsewhere(minimal, first)
        )
    result["why"] = "; ".join(said)
    return result


def _why_elsewhere(minimal: dict, original: dict) -> str:
    """Why a shrunk call fails at another element than the original call did."""
    same_index = minimal["index"] == original["index"] and minimal["output"] == original["output"]
    where = (
        f"both are flat index {minimal['index']} of their output, so the corruption follows "
        "the position in the output's memory, not the data"
        if same_index
        else "the corruption is tied to where an element is computed (a lane, a tile, an address), "
        "and a smaller shape puts other elements there"
    )
    return f"{where}; the minimal inputs still fail, which is what the reproducer needs"


def _indices(kept: tuple) -> str:
    shown = ", ".join(map(str, kept[:8]))
    return f"[{shown}{', ...' if len(kept) > 8 else ''}]"
