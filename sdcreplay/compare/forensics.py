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

from ..storage.tensorio import local_shard, raw_bits


def words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, one int64 per element, flat."""
    return raw_bits(tensor.contiguous()).reshape(-1).to(torch.int64)


def element_forensics(expected: torch.Tensor, actual: torch.Tensor, shown: int = 16) -> dict:
    """Differing elements (bitwise), their XOR masks, flipped-bit histogram and pattern."""
    sharded = local_shard(expected) is not expected or local_shard(actual) is not actual
    expected, actual = local_shard(expected).detach(), local_shard(actual).detach()
    if expected.is_complex() and expected.element_size() > 8 and actual.dtype == expected.dtype:
        # complex128 is two float64 words: compared as those (a last axis: real, imaginary)
        expected, actual = torch.view_as_real(expected), torch.view_as_real(actual)
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        shapes = f"{tuple(expected.shape)} {expected.dtype} vs {tuple(actual.shape)} {actual.dtype}"
        return {"count": None, "note": f"shape/dtype differ: {shapes}"}
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
    flat_e, flat_a = expected.reshape(-1), actual.reshape(-1)
    chosen = indices[:shown]
    result = {
        "count": int(indices.numel()),
        "total": int(expected.numel()),
        "indices": [int(i) for i in chosen],
        "positions": [list(_unravel(int(i), expected.shape)) for i in chosen],
        "xor": [f"{int(m) & ((1 << width) - 1):0{width // 4}x}" for m in masks[:shown]],
        "expected": [_value(flat_e[i]) for i in chosen],
        "actual": [_value(flat_a[i]) for i in chosen],
        "bits": {"width": width, "histogram": {str(b): n for b, n in sorted(histogram.items())}},
        "dtype": str(expected.dtype).removeprefix("torch."),
        "shape": list(expected.shape),
    }
    if sharded:
        result["local_shard"] = True
    if (expected.is_floating_point() or expected.is_complex()) and indices.numel():
        e, a = _widened(flat_e[indices]), _widened(flat_a[indices])
        diff = (e - a).abs()
        result["max_abs_diff"] = _number(diff.max())
        result["max_rel_diff"] = _number(
            (diff / e.abs().clamp_min(torch.finfo(torch.float64).tiny)).max()
        )
    elif indices.numel():
        diff = (flat_e[indices].double() - flat_a[indices].double()).abs()
        result["max_abs_diff"] = _number(diff.max())
    else:
        result["max_abs_diff"] = 0.0
    pattern = _pattern(indices, masks, expected, actual)
    result["pattern"] = pattern
    result["fault_model"] = fault_model(indices, masks, width, pattern, expected.shape)
    return result


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
