"""Forensics in the storage's terms: a word read through a broadcasting view is one element,
and damage that made a finite value NaN or Inf says so (test_bisect.py holds the patterns)."""

from __future__ import annotations

import math
import struct

import torch

from sdcreplay.capture.faults import FaultSpec, corrupt
from sdcreplay.compare.forensics import element_forensics


def _word(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def test_a_flip_seen_through_a_broadcast_is_one_storage_element():
    """``aten.expand`` of [2, 8, 1] to [2, 8, 32]: one flipped word shows at 32 positions of
    the view, and is reported as the one element of the storage it is."""
    storage = torch.arange(1, 17, dtype=torch.float32).reshape(2, 8, 1) / 7
    damaged = storage.clone()
    view = damaged.expand(2, 8, 32)
    corrupt(FaultSpec.parse("kind=bitflip,op=x,index=105,bit=10"), view)  # [0, 3, 9]: word 3
    found = element_forensics(storage.expand(2, 8, 32), view)
    assert (found["count"], found["total"]) == (1, 16)
    assert (found["indices"], found["positions"]) == ([96], [[0, 3, 0]])
    assert found["view"] == {"stride": [8, 1, 0], "storage_indices": [3], "elements": 32}
    assert found["shape"] == [2, 8, 32] and found["pattern"] == "single element"
    assert found["fault_model"] == (
        "single-bit flip of bit 10 (mask 0x00000400) on 1 element of the storage (a "
        "broadcasting view shows it at 32 of its 512 positions, first [0, 3, 0])"
    )
    dense = element_forensics(storage.expand(2, 8, 32).contiguous(), view.contiguous())
    assert dense["count"] == 32 and "view" not in dense  # a dense copy: 32 words really differ
    assert dense["fault_model"].startswith("burst: 32 neighbouring elements of row [0, 3]")


def test_two_words_of_a_broadcast_storage():
    storage = torch.arange(1, 5, dtype=torch.float64).reshape(4, 1)
    damaged = storage.clone()
    damaged[1, 0] = -damaged[1, 0]
    damaged[3, 0] = -damaged[3, 0]
    found = element_forensics(storage.expand(4, 3), damaged.expand(4, 3))
    assert (found["count"], found["total"], found["positions"]) == (2, 4, [[1, 0], [3, 0]])
    assert found["view"]["storage_indices"] == [1, 3] and found["view"]["elements"] == 6
    assert found["fault_model"] == (
        "single-bit flip of bit 63 (mask 0x8000000000000000) on 2 elements (two elements, same "
        "bit), words of the storage (a broadcasting view shows them at 6 of its 12 positions, "
        "first [1, 0])"
    )


def test_damage_that_made_nan_or_inf_says_so():
    values = torch.arange(1, 9, dtype=torch.float32) / 7
    nan = values.clone()
    corrupt(FaultSpec.parse("kind=nan,op=x,index=3"), nan)
    mask = _word(float(values[3])) ^ _word(math.nan)
    assert element_forensics(values, nan)["fault_model"] == (
        f"multi-bit XOR mask 0x{mask:08x} on 1 element, which became NaN"
    )
    ones = torch.ones(8)
    inf = ones.clone()
    corrupt(FaultSpec.parse("kind=bitflip,op=x,index=2,bit=30"), inf)  # 0x3f800000 -> 0x7f800000
    assert element_forensics(ones, inf)["fault_model"] == (
        "single-bit flip of bit 30 (mask 0x40000000) on 1 element, which became Inf"
    )
    several = ones.clone()
    several[[1, 4]] = math.nan
    several[6] = math.inf
    assert element_forensics(ones, several)["fault_model"].endswith(
        ", of which 2 became NaN and 1 became Inf"
    )
    already = torch.tensor([math.nan, 1.0])
    other_nan = torch.tensor([-math.nan, 1.0])  # a NaN with another payload: no new NaN made
    assert "became" not in element_forensics(already, other_nan)["fault_model"]
