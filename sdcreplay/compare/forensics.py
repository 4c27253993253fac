"""Which elements of a tensor differ from the expected one, which bits, what shape the damage has.

The evidence bisect reports for a divergent call (and for state entering a step)
and minimize reports for a failing trial: compared bitwise, as raw words, so a
NaN with another payload or a -0.0 counts as a difference. A DTensor is compared
as this rank's local shard (``local_shard`` in the result): its elements and
positions are the shard's, and nothing is gathered from other ranks.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..capture.memory import local_shard
from ..storage.tensorio import raw_bits


def words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, one int64 per element, flat."""
    return raw_bits(tensor.contiguous()).reshape(-1).to(torch.int64)


def element_forensics(expected: torch.Tensor, actual: torch.Tensor, shown: int = 16) -> dict:
    """Differing elements (bitwise), their XOR masks, flipped-bit histogram and pattern.

    A view whose elements share memory (a broadcast: ``aten.expand``'s stride 0) is judged
    in its storage's terms: each storage word once, so one flipped word is one element (at
    the view coordinates of the first element that reads it), and ``view`` says how many of
    the view's elements show the damage; never a "burst" of the elements reading one word.
    """
    sharded = local_shard(expected) is not expected or local_shard(actual) is not actual
    expected, actual = local_shard(expected).detach(), local_shard(actual).detach()
    if expected.is_complex() and expected.element_size() > 8 and actual.dtype == expected.dtype:
        # complex128 is two float64 words: compared as those (a last axis: real, imaginary)
        expected, actual = torch.view_as_real(expected), torch.view_as_real(actual)
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        shapes = f"{tuple(expected.shape)} {expected.dtype} vs {tuple(actual.shape)} {actual.dtype}"
        return {"count": None, "note": f"shape/dtype differ: {shapes}"}
    flat_e, flat_a = expected.reshape(-1), actual.reshape(-1)
    shared = _shared_words(expected, actual)
    if shared is None:  # every element its own word: the view's own layout
        compared, layout = torch.arange(flat_e.numel()), expected.shape
    else:  # each storage word once, in storage order: one row of words
        compared, layout = shared[0], torch.Size([shared[0].numel()])
    found, differing = _compare(flat_e[compared], flat_a[compared], layout, shown)
    result = {
        "count": found["count"],
        "total": found["total"],
        "indices": [int(compared[i]) for i in differing[:shown]],
        "positions": [list(_unravel(int(compared[i]), expected.shape)) for i in differing[:shown]],
        **{key: value for key, value in found.items() if key not in ("count", "total")},
        "dtype": str(expected.dtype).removeprefix("torch."),
        "shape": list(expected.shape),
    }
    if sharded:
        result["local_shard"] = True
    model = found["fault_model"]
    if shared is not None:
        seen = int(torch.isin(shared[1], differing).sum())
        result["view"] = {
            "stride": list(expected.stride()),
            "storage_indices": [int(shared[2][i]) for i in differing[:shown]],
            "elements": seen,  # of the view's elements, how many read a differing word
        }
        if found["count"]:
            shows = f"{seen} of its {expected.numel()} positions, first {result['positions'][0]}"
            model += (
                f" of the storage (a broadcasting view shows it at {shows})"
                if found["count"] == 1
                else f", words of the storage (a broadcasting view shows them at {shows})"
            )
    chosen_e, chosen_a = flat_e[compared][differing], flat_a[compared][differing]
    result["fault_model"] = model + _non_finite(chosen_e, chosen_a)
    return result


def _shared_words(expected: torch.Tensor, actual: torch.Tensor):
    """For two views alike whose elements share storage words: the flat index of the first
    element reading each distinct word (in storage order), every element's word, and the
    words' storage offsets; None where each element has a word of its own."""
    plain = all(type(t) is torch.Tensor and t.layout == torch.strided for t in (expected, actual))
    if not plain or expected.stride() != actual.stride() or 0 not in expected.stride():
        return None
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(expected.shape, expected.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    offsets = offsets.reshape(-1)
    distinct, word_of = torch.unique(offsets, return_inverse=True)
    if distinct.numel() == offsets.numel():
        return None
    first = torch.full((distinct.numel(),), offsets.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, word_of, torch.arange(offsets.numel()), reduce="amin")
    return first, word_of, distinct


def _compare(
    expected: torch.Tensor, actual: torch.Tensor, layout, shown: int
) -> tuple[dict, torch.Tensor]:
    """The forensics of two flat runs of elements laid out as ``layout``, and the positions
    (in the run) of those that differ."""
    width = 8 * expected.element_size()
    xor = words(expected) ^ words(actual)
    if width < 64:
        xor &= (1 << width) - 1
    indices = torch.nonzero(xor).flatten()
    masks = xor[indices]
    histogram: Counter[int] = Counter()
    for bit in range(width):
        flipped = int(((masks >> bit) & 1).sum()) if bit < 63 else int((masks < 0).sum())
        if flipped:
            histogram[bit] = flipped
    chosen = indices[:shown]
    result = {
        "count": int(indices.numel()),
        "total": int(expected.numel()),
        "xor": [f"{int(m) & ((1 << width) - 1):0{width // 4}x}" for m in masks[:shown]],
        "expected": [_value(expected[i]) for i in chosen],
        "actual": [_value(actual[i]) for i in chosen],
        "bits": {"width": width, "histogram": {str(b): n for b, n in sorted(histogram.items())}},
    }
    if (expected.is_floating_point() or expected.is_complex()) and indices.numel():
        e, a = _widened(expected[indices]), _widened(actual[indices])
        diff = (e - a).abs()
        result["max_abs_diff"] = _number(diff.max())
        result["max_rel_diff"] = _number(
            (diff / e.abs().clamp_min(torch.finfo(torch.float64).tiny)).max()
        )
    elif indices.numel():
        diff = (expected[indices].double() - actual[indices].double()).abs()
        result["max_abs_diff"] = _number(diff.max())
    else:
        result["max_abs_diff"] = 0.0
    pattern = _pattern(indices, masks, expected.reshape(layout), actual.reshape(layout))
    result["pattern"] = pattern
    result["fault_model"] = fault_model(indices, masks, width, pattern, layout)
    return result, indices


def _non_finite(expected: torch.Tensor, actual: torch.Tensor) -> str:
    """What the damage made of finite values, said first thing after the bits: NaN, Inf."""
    if not actual.is_floating_point() or not actual.numel():
        return ""
    finite, got = torch.isfinite(expected.double()), actual.double()
    made = [
        (int((finite & torch.isnan(got)).sum()), "NaN"),
        (int((finite & torch.isinf(got)).sum()), "Inf"),
    ]
    made = [(count, what) for count, what in made if count]
    if not made:
        return ""
    if actual.numel() == 1:
        return f", which became {made[0][1]}"
    return ", of which " + " and ".join(f"{count} became {what}" for count, what in made)


def fault_model(indices: torch.Tensor, masks: torch.Tensor, width: int, pattern: str, shape) -> str:
    """The damage in the words of a fault model a person recognizes (docs/fault-injection.md).

    One XOR mask on every differing element is a bit error (one bit: a flip;
    several: a multi-bit mask); neighbouring elements of one row are a burst,
    as one row of a tile written out together. A swap changes values, not bits.
    """
    count = indices.numel()
    if count == 0:
        return "none"
    if pattern == "two elements swapped":
        return "two elements swapped (values exchanged, no bit error)"
    distinct = masks.unique()
    mask = int(distinct[0]) & ((1 << width) - 1) if distinct.numel() == 1 else None
    if mask is None:
        change = same = "different XOR masks"
    elif mask & (mask - 1) == 0:
        bit = mask.bit_length() - 1
        change = f"single-bit flip of bit {bit} (mask 0x{mask:0{width // 4}x})"
        same = f"same mask 0x{mask:0{width // 4}x} (bit {bit})"
    else:
        change = f"multi-bit XOR mask 0x{mask:0{width // 4}x}"
        same = f"same mask 0x{mask:0{width // 4}x}"
    if count == 1:
        return f"{change} on 1 element"
    columns = shape[-1] if len(shape) else 1
    first, last = int(indices[0]), int(indices[-1])
    if last - first == count - 1 and first // columns == last // columns:
        row = _unravel(first, shape)[:-1]
        where = "" if not row else f" of row {row[0] if len(row) == 1 else list(row)}"
        return f"burst: {count} neighbouring elements{where}, {same}"
    return f"{change} on {count} elements ({pattern})"


def _widened(values: torch.Tensor) -> torch.Tensor:
    """In float64 (complex128 for complex values), where differences are computed."""
    return values.to(torch.complex128) if values.is_complex() else values.double()


def _value(scalar: torch.Tensor):
    value = scalar.item()
    if isinstance(value, complex):
        return str(value)
    return _number(value) if isinstance(value, float) else value


def _number(value) -> float | str:
    value = float(value)
    return value if value == value and abs(value) != float("inf") else str(value)


def _unravel(flat: int, shape) -> tuple[int, ...]:
    position = []
    for size in reversed(list(shape)):
        position.append(flat % size)
        flat //= size
    return tuple(reversed(position))


def _pattern(
    indices: torch.Tensor, masks: torch.Tensor, expected: torch.Tensor, actual: torch.Tensor
) -> str:
    """A word for the set of differing elements, as a vendor would describe it."""
    count = indices.numel()
    if count == 0:
        return "none"
    if count == 1:
        return "single element"
    flat_e, flat_a = expected.reshape(-1), actual.reshape(-1)
    if count == 2:
        i, j = int(indices[0]), int(indices[1])
        a_i, a_j = words(flat_a[i : i + 1]), words(flat_a[j : j + 1])
        if a_i.equal(words(flat_e[j : j + 1])) and a_j.equal(words(flat_e[i : i + 1])):
            return "two elements swapped"
        if int(masks[0]) == int(masks[1]):
            return "two elements, same bit"
    columns = expected.shape[-1] if expected.dim() else 1
    rows, cols = indices // columns, indices % columns
    one_row, one_column = rows.unique().numel() == 1, cols.unique().numel() == 1
    height = int(rows.max() - rows.min()) + 1
    width = int(cols.max() - cols.min()) + 1
    if one_row and width == count:
        return "row segment"
    if one_column and height == count:
        return "column segment"
    if height * width == count:
        return f"block {height}x{width}"
    steps = (indices[1:] - indices[:-1]).unique()
    if count > 2 and steps.numel() == 1:  # checked before "one row": a 1-D tensor is all one row
        return f"strided (every {int(steps[0])} elements)"
    if one_row:
        return "scattered in one row"
    if one_column:
        return "scattered in one column"
    return "scattered"
