"""Fault specs and the injector: parsing, exact corruption per kind, and call matching.

Everything here runs in-process on small tensors and a four-layer toy model
under a real OperatorMode, so every expectation is exact.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch import nn

from sdcreplay.capture.faults import (
    ENV_VAR,
    FaultSpec,
    Injector,
    corrupt,
    default_bit,
    parse_specs,
)
from sdcreplay.capture.operators import CallSite, OperatorMode
from sdcreplay.errors import FaultSpecError

# ---------------------------------------------------------------------------
# Parsing


def test_parse_every_key():
    spec = FaultSpec.parse(
        "kind=bitflip,op=aten.mm.default,module=layers.0,phase=backward,step=3,nth=2,"
        "index=7,bit=5,count=2,scale=0.5,p=0.25,seed=9,device=cpu:1"
    )
    assert spec == FaultSpec(
        kind="bitflip",
        op="aten.mm.default",
        module="layers.0",
        phase="backward",
        step=3,
        nth=2,
        index=7,
        bit=5,
        count=2,
        scale=0.5,
        p=0.25,
        seed=9,
        device="cpu:1",
    )
    memflip = FaultSpec.parse("kind=memflip,param=layers.0.attn.wq.weight,step=1,index=4,bit=30")
    assert (memflip.kind, memflip.param, memflip.step, memflip.index, memflip.bit, memflip.op) == (
        "memflip",
        "layers.0.attn.wq.weight",
        1,
        4,
        30,
        None,
    )


def test_parse_defaults_and_whitespace():
    spec = FaultSpec.parse(" kind = nan , op = aten.mm ,")
    assert spec == FaultSpec(kind="nan", op="aten.mm")
    assert (
        spec.param,
        spec.module,
        spec.phase,
        spec.step,
        spec.nth,
        spec.index,
        spec.bit,
        spec.count,
        spec.scale,
        spec.p,
        spec.seed,
        spec.device,
    ) == (None, None, None, None, None, 0, None, 1, 1e-3, 1.0, 0, None)


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("op=aten.mm,kind=bitflip", "kind=bitflip,op=aten.mm"),
        ("kind=bitflip,op=aten.mm,index=0,count=1,p=1", "kind=bitflip,op=aten.mm"),
        (
            "device=cpu:1,kind=pairflip,op=aten.mm.default,step=1,nth=0,index=3,bit=22,count=7",
            "kind=pairflip,op=aten.mm.default,step=1,nth=0,index=3,bit=22,count=7,device=cpu:1",
        ),
        (
            "kind=bias,op=aten.mm,module=layers.0.attn.wo,phase=forward,scale=0.0001,count=8,p=0.3,seed=4",
            "kind=bias,op=aten.mm,module=layers.0.attn.wo,phase=forward,count=8,scale=0.0001,p=0.3,seed=4",
        ),
        (
            "kind=memflip,step=1,param=layers.0.mlp.w3.weight",
            "kind=memflip,param=layers.0.mlp.w3.weight,step=1",
        ),
    ],
)
def test_canonical_string_round_trip(text, canonical):
    spec = FaultSpec.parse(text)
    assert str(spec) == canonical
    assert FaultSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    "text, words",
    [
        ("kind=bitflip,op=aten.mm,colour=red", ["unknown or malformed part", "'colour=red'"]),
        ("kind=bitflip,op=aten.mm,oops", ["unknown or malformed part", "'oops'"]),
        (
            "kind=melt,op=aten.mm",
            ["kind 'melt' is not one of bitflip, pairflip, swap, bias, nan, memflip"],
        ),
        (
            "kind=bitflip,op=aten.mm,phase=sideways",
            ["phase 'sideways' is not one of forward, backward, optimizer"],
        ),
        ("kind=bitflip,op=aten.mm,step=one", ["step='one' is not a valid int"]),
        ("kind=bitflip,op=aten.mm,step=1.5", ["step='1.5' is not a valid int"]),
        ("kind=bitflip,op=aten.mm,p=often", ["p='often' is not a valid float"]),
        ("kind=bitflip,op=aten.mm,scale=", ["scale='' is not a valid float"]),
        ("kind=bitflip", ["bitflip needs op="]),
        ("kind=swap,module=layers.0", ["swap needs op="]),
        ("op=aten.mm,step=1", ["has no kind"]),
        ("kind=memflip,step=1", ["memflip needs param="]),
        ("kind=memflip,param=layers.0.attn.wq.weight", ["memflip needs param=", "and step="]),
        ("kind=bitflip,op=aten.mm,p=1.5", ["p=1.5 is not a probability"]),
        ("kind=bitflip,op=aten.mm,count=0", ["count must be at least 1"]),
        ("kind=bitflip,op=aten.mm,index=-1", ["index and nth at least 0"]),
        ("kind=bitflip,op=aten.mm,nth=-2", ["index and nth at least 0"]),
        ("kind=bitflip,op=aten.mm,bit=64", ["bit=64 is outside 0..63"]),
    ],
)
def test_parse_errors_name_the_problem(text, words):
    with pytest.raises(FaultSpecError) as caught:
        FaultSpec.parse(text)
    message = caught.value.message
    assert message.startswith(f"fault spec {text!r}")
    for word in words:
        assert word in message
    assert caught.value.hint  # every error carries a hint


def test_parse_specs_reads_the_environment_after_the_command_line(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "kind=nan,op=aten.add;; kind=swap,op=aten.mm,index=2 ;")
    specs = parse_specs(["kind=bitflip,op=aten.mm,bit=3"])
    assert [str(s) for s in specs] == [
        "kind=bitflip,op=aten.mm,bit=3",
        "kind=nan,op=aten.add",
        "kind=swap,op=aten.mm,index=2",
    ]
    assert [str(s) for s in parse_specs(["kind=bitflip,op=aten.mm"], include_env=False)] == [
        "kind=bitflip,op=aten.mm"
    ]
    monkeypatch.setenv(ENV_VAR, "kind=bitflip")
    with pytest.raises(FaultSpecError, match="bitflip needs op="):
        parse_specs([])
    monkeypatch.delenv(ENV_VAR)
    assert parse_specs([]) == []


# ---------------------------------------------------------------------------
# corrupt(): exactly the bits and elements the spec names

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _xor(before: torch.Tensor, after: torch.Tensor) -> list[tuple[int, int]]:
    """(flat element, XOR of its storage word) for every element whose bits changed."""
    word = _INT_OF[before.element_size()]
    a = before.contiguous().view(word).reshape(-1).tolist()
    b = after.contiguous().view(word).reshape(-1).tolist()
    width = 8 * before.element_size()
    return [(i, (x ^ y) & ((1 << width) - 1)) for i, (x, y) in enumerate(zip(a, b)) if x != y]


def _sample(dtype: torch.dtype, n: int = 12) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.arange(n) % 3 == 0
    if dtype.is_floating_point:
        return (torch.arange(n, dtype=torch.float64) * 0.37 - 1.5).to(dtype)
    return torch.arange(n).to(dtype) * 5 + 1


def spec(text: str) -> FaultSpec:
    return FaultSpec.parse(text)


@pytest.mark.parametrize(
    "dtype, bit",
    [
        (torch.float32, 0),
        (torch.float32, 22),
        (torch.float32, 31),
        (torch.bfloat16, 6),
        (torch.bfloat16, 15),
        (torch.float16, 9),
        (torch.float64, 63),
        (torch.int32, 31),
        (torch.int64, 63),
        (torch.int16, 4),
        (torch.uint8, 7),
        (torch.int8, 7),
    ],
)
def test_bitflip_flips_exactly_that_bit_of_the_storage_word(dtype, bit):
    tensor = _sample(dtype)
    before = tensor.clone()
    result = corrupt(spec(f"kind=bitflip,op=aten.mm,index=5,bit={bit}"), tensor)
    assert result == ([5], bit)
    assert _xor(before, tensor) == [(5, 1 << bit)]


@pytest.mark.parametrize(
    "dtype, bit",
    [
        (torch.float64, 51),
        (torch.float32, 22),
        (torch.float16, 9),
        (torch.bfloat16, 6),
        (torch.int32, 0),
        (torch.uint8, 0),
    ],
)
def test_default_bit_is_the_top_mantissa_bit_or_bit_zero(dtype, bit):
    assert default_bit(dtype) == bit
    tensor = _sample(dtype)
    before = tensor.clone()
    assert corrupt(spec("kind=bitflip,op=aten.mm,index=2"), tensor) == ([2], bit)
    assert _xor(before, tensor) == [(2, 1 << bit)]


def test_bitflip_sign_bit_negates_a_float():
    tensor = torch.tensor([1.0, 2.5, -3.0])
    corrupt(spec("kind=bitflip,op=aten.mm,index=1,bit=31"), tensor)
    assert tensor.tolist() == [1.0, -2.5, -3.0]


def test_bitflip_of_a_bool_and_bits_that_do_not_exist():
    tensor = torch.tensor([True, False, True])
    assert corrupt(spec("kind=bitflip,op=aten.mm,index=1,bit=0"), tensor) == ([1], 0)
    assert tensor.tolist() == [True, True, True]
    with pytest.raises(FaultSpecError, match="bool element has only bit 0"):
        corrupt(spec("kind=bitflip,op=aten.mm,index=1,bit=3"), tensor)
    with pytest.raises(
        FaultSpecError, match="bit 16 does not exist in a 16-bit torch.bfloat16 element"
    ):
        corrupt(spec("kind=bitflip,op=aten.mm,bit=16"), _sample(torch.bfloat16))


def test_flat_index_is_the_logical_position_in_a_strided_tensor():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base.t()  # [4, 3], not contiguous: logical element 1 is view[0, 1] == base[1, 0]
    corrupt(spec("kind=bitflip,op=aten.mm,index=1,bit=31"), view)
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    expected[1, 0] = -4.0
    assert torch.equal(base, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_pairflip_flips_the_same_bit_in_two_elements(dtype):
    tensor = _sample(dtype)
    before = tensor.clone()
    assert corrupt(spec("kind=pairflip,op=aten.mm,index=2,count=7,bit=3"), tensor) == ([2, 9], 3)
    assert _xor(before, tensor) == [(2, 8), (9, 8)]
    # count defaults to 1: the neighbour
    tensor = before.clone()
    assert corrupt(spec("kind=pairflip,op=aten.mm,index=4,bit=1"), tensor) == ([4, 5], 1)
    assert _xor(before, tensor) == [(4, 2), (5, 2)]


def test_pairflip_and_swap_are_invisible_to_an_xor_hash_but_not_to_the_digest():
    from sdcreplay.capture.digest import tensor_digest

    clean = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for text in (
        "kind=pairflip,op=aten.mm,index=3,count=40",
        "kind=swap,op=aten.mm,index=5,count=64",
    ):
        corrupted = clean.clone()
        corrupt(spec(text), corrupted)
        assert not torch.equal(corrupted, clean)
        assert torch.hash_tensor(corrupted) == torch.hash_tensor(clean)
        assert tensor_digest(corrupted) != tensor_digest(clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_swap_exchanges_two_elements(dtype):
    tensor = _sample(dtype).reshape(3, 4)
    before = tensor.clone()
    assert corrupt(spec("kind=swap,op=aten.mm,index=1,count=6"), tensor) == ([1, 7], None)
    expected = before.clone().reshape(-1)
    expected[1], expected[7] = before.reshape(-1)[7], before.reshape(-1)[1]
    assert torch.equal(tensor.reshape(-1), expected)


def test_bias_scales_a_block_of_count_elements():
    tensor = torch.full((10,), 2.0)
    assert corrupt(spec("kind=bias,op=aten.mm,index=3,count=4,scale=0.5"), tensor) == (
        [3, 4, 5, 6],
        None,
    )
    assert tensor.tolist() == [2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0]
    small = torch.linspace(-1, 1, 8, dtype=torch.bfloat16)
    before = small.clone()
    corrupt(spec("kind=bias,op=aten.mm,index=0,count=8,scale=0.01"), small)
    assert torch.equal(small, before * (1.0 + 0.01))
    with pytest.raises(FaultSpecError, match="bias needs a floating-point output"):
        corrupt(spec("kind=bias,op=aten.mm"), torch.arange(4))


def test_nan_writes_one_nan():
    tensor = torch.zeros(2, 3, dtype=torch.float16)
    assert corrupt(spec("kind=nan,op=aten.mm,index=4"), tensor) == ([4], None)
    assert tensor.isnan().reshape(-1).tolist() == [False, False, False, False, True, False]
    with pytest.raises(FaultSpecError, match="nan needs a floating-point output"):
        corrupt(spec("kind=nan,op=aten.mm"), torch.arange(4))


@pytest.mark.parametrize(
    "text",
    [
        "kind=bitflip,op=aten.mm,index=12",
        "kind=memflip,param=w,step=0,index=40",
        "kind=nan,op=aten.mm,index=12",
        "kind=pairflip,op=aten.mm,index=11",  # the partner, 12, is outside
        "kind=swap,op=aten.mm,index=4,count=8",  # 12 is outside
        "kind=bias,op=aten.mm,index=8,count=5",  # the block ends at 12
    ],
)
def test_an_element_outside_the_output_does_not_fire(text):
    tensor = _sample(torch.float32)
    before = tensor.clone()
    assert corrupt(spec(text), tensor) is None
    assert torch.equal(tensor, before)


def test_a_block_that_ends_on_the_last_element_fires():
    tensor = torch.ones(12)
    assert corrupt(spec("kind=bias,op=aten.mm,index=8,count=4,scale=1"), tensor) == (
        [8, 9, 10, 11],
        None,
    )
    assert tensor.tolist() == [1.0] * 8 + [2.0] * 4


# ---------------------------------------------------------------------------
# The injector under a real OperatorMode


class Toy(nn.Module):
    """enc -> enc2 -> relu -> head.0 -> head.1; ``enc`` is a prefix of ``enc2`` by name only."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 4, bias=False)
        self.enc2 = nn.Linear(4, 4, bias=False)
        self.head = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))

    def forward(self, x):
        return self.head(self.enc2(self.enc(x)).relu())


class Spy:
    """Records every call site and a copy of the output the injector left."""

    def __init__(self):
        self.calls: list[tuple[CallSite, torch.Tensor | None]] = []

    def on_call(self, site, func, args, kwargs, out):
        self.calls.append((site, out.detach().clone() if isinstance(out, torch.Tensor) else None))
        return out


def _toy():
    torch.manual_seed(0)
    model = Toy()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def run_steps(specs, steps=(0,), label="cpu:0", salt=0):
    """Train the toy for ``steps`` under OperatorMode([injector, spy]); (injector, spy)."""
    model, optimizer = _toy()
    injector = Injector([FaultSpec.parse(s) for s in specs], label, salt=salt)
    spy = Spy()
    for step in steps:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        injector.before_step(step, model)
        with OperatorMode(model, optimizer, [injector, spy], step):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return injector, spy


def fired_at(injector) -> list[tuple[int, str, str, str]]:
    return [(f.step, f.phase, f.module, f.op) for f in injector.fired]


MM = "aten.mm.default"


def test_clean_run_sites():
    """The toy's matmul call sites, which the matching tests below rely on."""
    _, spy = run_steps([])
    mms = [(s.phase, s.module) for s, _ in spy.calls if s.op == MM]
    assert mms == [
        ("forward", "enc"),
        ("forward", "enc2"),
        ("forward", "head.0"),
        ("forward", "head.1"),
        ("backward", "head.1"),
        ("backward", "head.1"),
        ("backward", "head.0"),
        ("backward", "head.0"),
        ("backward", "enc2"),
        ("backward", "enc2"),
        ("backward", "enc"),
    ]


@pytest.mark.parametrize("op", ["aten.mm", "aten.mm.default"])
def test_op_matches_the_overload_or_its_packet(op):
    injector, _ = run_steps([f"kind=bitflip,op={op},phase=forward"])
    assert fired_at(injector) == [
        (0, "forward", m, MM) for m in ("enc", "enc2", "head.0", "head.1")
    ]


@pytest.mark.parametrize("op", ["aten.m", "aten.mm.out", "aten.addmm", "mm"])
def test_other_op_names_do_not_match(op):
    injector, _ = run_steps([f"kind=bitflip,op={op}"])
    assert injector.fired == []


def test_the_corruption_is_what_later_observers_and_the_module_see():
    clean_injector, clean = run_steps([])
    injector, spy = run_steps(["kind=bitflip,op=aten.mm,module=enc2,phase=forward,index=5,bit=30"])
    assert clean_injector.fired == []
    (fired,) = injector.fired
    assert (fired.module, fired.op, fired.elements, fired.bit, fired.op_index) == (
        "enc2",
        MM,
        [5],
        30,
        3,
    )
    site, out = spy.calls[3]
    assert (site.module, site.op) == ("enc2", MM)
    assert _xor(clean.calls[3][1], out) == [(5, 1 << 30)]
    assert torch.equal(spy.calls[1][1], clean.calls[1][1])  # enc ran before: untouched


class VersionSpy(Spy):
    """Also records the version counter of every tensor output, after the injector."""

    def __init__(self):
        super().__init__()
        self.versions: list[int | None] = []

    def on_call(self, site, func, args, kwargs, out):
        self.versions.append(out._version if isinstance(out, torch.Tensor) else None)
        return super().on_call(site, func, args, kwargs, out)


@pytest.mark.parametrize(
    "text, where",
    [
        # views: the fault corrupts the memory they alias (a weight; a gradient's operand)
        ("kind=bitflip,op=aten.t,module=enc2,phase=forward,index=5,bit=30", ("forward", "enc2")),
        (
            "kind=bitflip,op=aten.t,module=head.1,phase=backward,nth=0,index=3,bit=31",
            ("backward", "head.1"),
        ),
        # relu's output, as autograd saved it for relu's backward; a gradient being accumulated
        ("kind=bitflip,op=aten.detach,phase=forward,index=2,bit=30", ("forward", "<root>")),
        (
            "kind=bitflip,op=aten.detach,module=head.1,phase=backward,index=3,bit=31",
            ("backward", "head.1"),
        ),
        # an output autograd saved for the backward, and an in-place update
        ("kind=bitflip,op=aten.relu,phase=forward,index=2,bit=30", ("forward", "<root>")),
        (
            "kind=bitflip,op=aten.add_,phase=optimizer,module=enc.weight,index=6,bit=29",
            ("optimizer", "enc.weight"),
        ),
    ],
)
def test_a_fault_changes_bits_only_never_a_version_counter(text, where):
    """A defect changes values, not metadata: autograd's saved-tensor checks never trip on it."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    spies = []
    for specs in ([], [text]):
        model, optimizer = _toy()
        injector, spy = Injector([FaultSpec.parse(s) for s in specs], "cpu:0"), VersionSpy()
        with OperatorMode(model, optimizer, [injector, spy], 0):
            model(x).square().sum().backward()  # would raise "modified by an inplace operation"
            optimizer.step()
        spies.append(spy)
    clean, spy = spies
    (fired,) = injector.fired
    assert (fired.phase, fired.module) == where
    assert spy.versions == clean.versions
    _, out = spy.calls[fired.op_index]
    assert _xor(clean.calls[fired.op_index][1], out) == [(fired.elements[0], 1 << fired.bit)]


@pytest.mark.parametrize(
    "prefix, modules",
    [
        ("enc", ["enc"]),  # a path prefix, not a string prefix: enc2 is not under enc
        ("enc2", ["enc2"]),
        ("head", ["head.0", "head.1"]),
        ("head.1", ["head.1"]),
        ("head.", []),
        ("", ["enc", "enc2", "head.0", "head.1"]),
    ],
)
def test_module_is_a_path_prefix(prefix, modules):
    injector, _ = run_steps([f"kind=bitflip,op=aten.mm,phase=forward,module={prefix}"])
    assert [f[2] for f in fired_at(injector)] == modules


def test_phase_selects_forward_backward_or_optimizer():
    injector, _ = run_steps(["kind=bitflip,op=aten.mm,module=head,phase=backward"])
    assert fired_at(injector) == [
        (0, "backward", m, MM) for m in ("head.1", "head.1", "head.0", "head.0")
    ]
    injector, _ = run_steps(["kind=bitflip,op=aten.add_,phase=optimizer,module=enc2.weight"])
    assert fired_at(injector) == [(0, "optimizer", "enc2.weight", "aten.add_.Tensor")]
    injector, _ = run_steps(["kind=bitflip,op=aten.mm,module=enc"])  # no phase: both
    assert [f[1] for f in fired_at(injector)] == ["forward", "backward"]


def test_step_selects_the_training_step():
    injector, _ = run_steps(
        ["kind=bitflip,op=aten.mm,module=enc,phase=forward,step=1"], steps=(0, 1, 2)
    )
    assert fired_at(injector) == [(1, "forward", "enc", MM)]
    injector, _ = run_steps(["kind=bitflip,op=aten.mm,module=enc,phase=forward"], steps=(0, 1, 2))
    assert [f[0] for f in fired_at(injector)] == [0, 1, 2]  # sticky without step/nth


def test_nth_counts_only_the_matching_calls_of_each_step():
    injector, spy = run_steps(["kind=bitflip,op=aten.mm,module=head,nth=1"], steps=(0, 1))
    # head's matmuls in each step: forward head.0, forward head.1, backward ...; nth=1 is forward
    # head.1
    assert fired_at(injector) == [(0, "forward", "head.1", MM), (1, "forward", "head.1", MM)]
    injector, spy = run_steps(
        ["kind=bitflip,op=aten.mm,module=head,phase=backward,nth=1,step=1"], steps=(0, 1)
    )
    assert fired_at(injector) == [(1, "backward", "head.1", MM)]
    backward_mms = [
        s.index for s, _ in spy.calls if s.step == 1 and s.phase == "backward" and s.op == MM
    ]
    assert injector.fired[0].op_index == backward_mms[1]
    injector, _ = run_steps(["kind=bitflip,op=aten.mm,module=head,nth=5"])
    assert fired_at(injector) == [(0, "backward", "head.0", MM)]  # head's last matmul of six
    injector, _ = run_steps(["kind=bitflip,op=aten.mm,module=head,nth=6"])
    assert injector.fired == []


def test_device_label_selects_the_replica():
    text = "kind=bitflip,op=aten.mm,module=enc,phase=forward,device=cpu:1"
    for label, fires in [("cpu:1", True), ("cpu:0", False), ("cpu:10", False), ("cpu", False)]:
        injector, _ = run_steps([text], label=label)
        assert bool(injector.fired) is fires
        assert injector.has_operator_faults is fires


def test_several_specs_fire_independently():
    injector, _ = run_steps(
        [
            "kind=bitflip,op=aten.mm,module=enc,phase=forward",
            "kind=nan,op=aten.mm,module=head.1,phase=forward,index=2",
        ]
    )
    assert [(f.module, f.spec) for f in injector.fired] == [
        ("enc", "kind=bitflip,op=aten.mm,module=enc,phase=forward"),
        ("head.1", "kind=nan,op=aten.mm,module=head.1,phase=forward,index=2"),
    ]


def _fires_per_call(text: str, salt: int, calls: int = 200) -> list[int]:
    injector = Injector([FaultSpec.parse(text)], "cpu:0", salt=salt)
    for index in range(calls):
        site = CallSite(0, "forward", "enc", MM, index)
        injector.on_call(site, None, (), {}, torch.zeros(4))
    return [f.op_index for f in injector.fired]


def test_probability_is_seeded_reproducible_and_differs_per_salt():
    text = "kind=bitflip,op=aten.mm,p=0.3,seed=7"
    first = _fires_per_call(text, salt=0)
    assert first == _fires_per_call(text, salt=0)
    assert 40 <= len(first) <= 80  # about 30% of 200 calls
    assert first != _fires_per_call(text, salt=1)
    assert first != _fires_per_call("kind=bitflip,op=aten.mm,p=0.3,seed=8", salt=0)
    assert _fires_per_call("kind=bitflip,op=aten.mm,p=0", salt=0) == []
    assert len(_fires_per_call("kind=bitflip,op=aten.mm,p=1", salt=0)) == 200
    assert len(_fires_per_call("kind=bitflip,op=aten.mm,p=1e-6", salt=0, calls=1000)) == 0


def test_probability_draws_only_for_calls_that_pass_nth():
    # nth picks one call per step; p decides, per step, whether that call fires
    steps = []
    for step in range(40):
        injector = Injector(
            [FaultSpec.parse("kind=bitflip,op=aten.mm,nth=2,p=0.5,seed=1")], "cpu:0"
        )
        for index in range(5):
            injector.on_call(
                CallSite(step, "forward", "enc", MM, index), None, (), {}, torch.zeros(4)
            )
        steps.append([f.op_index for f in injector.fired])
    assert {tuple(s) for s in steps} <= {(), (2,)}


def test_tuple_outputs_corrupt_their_first_tensor():
    injector = Injector([FaultSpec.parse("kind=bitflip,op=aten.max.dim,bit=31")], "cpu:0")
    values, indices = torch.ones(3), torch.zeros(3, dtype=torch.long)
    site = CallSite(0, "forward", "enc", "aten.max.dim", 0)
    injector.on_call(site, None, (), {}, (values, indices))
    assert values.tolist() == [-1.0, 1.0, 1.0]
    assert indices.tolist() == [0, 0, 0]
    assert injector.fired[0].to_json() == {
        "spec": "kind=bitflip,op=aten.max.dim,bit=31",
        "step": 0,
        "phase": "forward",
        "module": "enc",
        "op": "aten.max.dim",
        "op_index": 0,
        "elements": [0],
        "bit": 31,
        "mask": None,
    }


def test_elements_outside_small_outputs_are_not_recorded_as_fired():
    injector, spy = run_steps(["kind=bitflip,op=aten.mm,index=15"])
    # forward outputs are [3, 4] (12 elements); the weight gradients are [4, 4] (16)
    assert {f.phase for f in injector.fired} == {"backward"}
    assert all(
        spy_out.numel() == 16
        for (site, spy_out) in spy.calls
        if (site.phase, site.op) == ("backward", MM)
        and site.index in {f.op_index for f in injector.fired}
    )


@pytest.mark.parametrize(
    "text",
    [
        "kind=bitflip,op=aten.mm,module=head,nth=2",
        "kind=bitflip,op=aten.mm,nth=7",
        "kind=bitflip,op=aten.t,module=enc2,phase=backward,nth=1",
        "kind=bitflip,op=aten.mm.default,phase=backward,nth=0",
        "kind=mask,op=aten.mm,module=head,nth=1,index=2,mask=0x00f00000",
        "kind=burst,op=aten.mm,phase=backward,nth=3,index=1,count=3,bit=20",
    ],
)
def test_isolated_call_fires_as_in_the_full_step(text):
    """bisect/minimize re-run one call alone, with the counts of the calls before it."""
    injector, spy = run_steps([text])
    (expected,) = injector.fired
    fired_sites = []
    prior: Counter = Counter()
    for site, out in spy.calls:
        alone = Injector([FaultSpec.parse(text)], "cpu:0")
        if isinstance(out, torch.Tensor):
            alone.on_isolated_call(site, prior, out.clone())
        fired_sites += [f.op_index for f in alone.fired]
        prior[site.key] += 1
    assert fired_sites == [expected.op_index]


def test_memflip_corrupts_a_parameter_before_its_step():
    text = "kind=memflip,param=head.0.weight,step=1,index=5,bit=3"
    model, _ = _toy()
    injector = Injector([FaultSpec.parse(text)], "cpu:0")
    assert injector.has_operator_faults is False
    before = model.head[0].weight.detach().clone()
    injector.before_step(0, model)
    assert torch.equal(model.head[0].weight, before) and injector.fired == []
    injector.before_step(1, model)
    assert _xor(before, model.head[0].weight.detach()) == [(5, 1 << 3)]
    assert injector.fired[0].to_json() == {
        "spec": text,
        "step": 1,
        "phase": "state",
        "module": "head.0.weight",
        "op": "memory",
        "op_index": -1,
        "elements": [5],
        "bit": 3,
        "mask": None,
    }
    # it never fires on an operator call
    injector, _ = run_steps([text], steps=(0, 1))
    assert fired_at(injector) == [(1, "state", "head.0.weight", "memory")]


def test_memflip_of_a_buffer_and_its_errors():
    model = nn.BatchNorm1d(4)
    before = model.running_var.clone()
    Injector(
        [FaultSpec.parse("kind=memflip,param=running_var,step=0,index=2,bit=31")], "cpu:0"
    ).before_step(0, model)
    assert model.running_var.tolist() == [1.0, 1.0, -1.0, 1.0] and before.tolist() == [1.0] * 4
    with pytest.raises(
        FaultSpecError, match="memflip names 'nope.weight', which the model does not have"
    ):
        Injector([FaultSpec.parse("kind=memflip,param=nope.weight,step=0")], "cpu:0").before_step(
            0, model
        )
    with pytest.raises(FaultSpecError, match="memflip index 4 is outside weight"):
        Injector(
            [FaultSpec.parse("kind=memflip,param=weight,step=0,index=4")], "cpu:0"
        ).before_step(0, model)
    # another device's memflip does nothing here
    Injector(
        [FaultSpec.parse("kind=memflip,param=weight,step=0,device=cpu:1")], "cpu:0"
    ).before_step(0, model)
    assert model.weight.tolist() == [1.0] * 4


# ---------------------------------------------------------------------------
# Multi-bit masks and bursts (the realistic fault models)


@pytest.mark.parametrize(
    "text, mask",
    [
        ("kind=mask,op=aten.mm,mask=0x00f00000", 0xF00000),
        ("kind=mask,op=aten.mm,mask=0X00F00000", 0xF00000),
        ("kind=mask,op=aten.mm,mask=15728640", 0xF00000),
        ("kind=burst,op=aten.mm,count=8,mask=0x8000000000000000", 1 << 63),
        ("kind=memflip,param=w,step=1,mask=0x3", 3),
    ],
)
def test_mask_is_read_in_hex_or_decimal_and_written_in_hex(text, mask):
    parsed = spec(text)
    assert parsed.mask == mask
    assert f"mask={mask:#x}" in str(parsed)
    assert FaultSpec.parse(str(parsed)) == parsed


def test_canonical_form_of_mask_and_burst():
    text = "device=cpu:1,mask=0x00F00000,count=8,index=98,kind=burst,op=aten.mm,step=1"
    assert (
        str(spec(text))
        == "kind=burst,op=aten.mm,step=1,index=98,mask=0xf00000,count=8,device=cpu:1"
    )


@pytest.mark.parametrize(
    "text, words",
    [
        ("kind=mask,op=aten.mm,index=3", ["kind=mask needs mask="]),
        ("kind=mask,op=aten.mm,mask=0", ["mask=0 changes no bit"]),
        ("kind=burst,op=aten.mm,mask=0x0", ["mask=0 changes no bit"]),
        ("kind=mask,op=aten.mm,mask=-4", ["mask=-0x4 is negative"]),
        ("kind=mask,op=aten.mm,mask=0x10000000000000000", ["does not fit a 64-bit word"]),
        ("kind=mask,op=aten.mm,mask=0xg1", ["mask='0xg1' is not a valid int"]),
        ("kind=mask,op=aten.mm,mask=3,bit=2", ["give mask= or bit=, not both"]),
        ("kind=bitflip,op=aten.mm,mask=3", ["mask= applies to kind=mask, burst and memflip only"]),
        ("kind=mask,mask=3", ["mask needs op="]),
        ("kind=burst,mask=3", ["burst needs op="]),
    ],
)
def test_bad_masks_are_refused_with_a_hint(text, words):
    with pytest.raises(FaultSpecError) as caught:
        FaultSpec.parse(text)
    assert caught.value.message.startswith(f"fault spec {text!r}")
    for word in words:
        assert word in caught.value.message
    assert caught.value.hint


@pytest.mark.parametrize(
    "dtype, mask",
    [
        (torch.float32, 0x00F00000),
        (torch.float32, 0xFFFFFFFF),
        (torch.bfloat16, 0x8041),
        (torch.float16, 0x0300),
        (torch.float64, 0x000F000000000000),
        (torch.int64, 0x8000000000000001),
        (torch.int32, 0x80000001),
        (torch.uint8, 0xA5),
        (torch.bool, 0x1),
    ],
)
def test_mask_xors_exactly_that_mask_into_one_storage_word(dtype, mask):
    tensor = _sample(dtype)
    before = tensor.clone()
    assert corrupt(spec(f"kind=mask,op=aten.mm,index=5,mask={mask:#x}"), tensor) == ([5], None)
    assert _xor(before, tensor) == [(5, mask)]


@pytest.mark.parametrize(
    "dtype, mask, words",
    [
        (
            torch.float32,
            1 << 32,
            "mask 0x100000000 is wider than the 32-bit word of a torch.float32",
        ),
        (torch.bfloat16, 0x10000, "wider than the 16-bit word of a torch.bfloat16"),
        (torch.bool, 0x2, "wider than the 1-bit word of a torch.bool"),
    ],
)
def test_a_mask_wider_than_the_element_is_refused_when_it_fires(dtype, mask, words):
    tensor = _sample(dtype)
    before = tensor.clone()
    with pytest.raises(FaultSpecError, match=words) as caught:
        corrupt(spec(f"kind=mask,op=aten.mm,mask={mask:#x}"), tensor)
    assert "at most" in caught.value.hint
    assert torch.equal(tensor, before)


def test_burst_xors_neighbouring_elements_of_one_row():
    tensor = torch.arange(24, dtype=torch.float32).reshape(3, 8) + 0.5
    before = tensor.clone()
    changed = corrupt(spec("kind=burst,op=aten.mm,index=9,count=4,mask=0x00f00000"), tensor)
    assert changed == ([9, 10, 11, 12], None)
    assert _xor(before, tensor) == [(i, 0xF00000) for i in (9, 10, 11, 12)]


def test_burst_with_a_bit_flips_that_bit_and_defaults_to_the_top_mantissa_bit():
    tensor = torch.ones(2, 8, dtype=torch.bfloat16)
    before = tensor.clone()
    assert corrupt(spec("kind=burst,op=aten.mm,index=1,count=3,bit=2"), tensor) == ([1, 2, 3], 2)
    assert _xor(before, tensor) == [(i, 1 << 2) for i in (1, 2, 3)]
    again = torch.ones(2, 8)
    assert corrupt(spec("kind=burst,op=aten.mm,index=8,count=2"), again) == ([8, 9], 22)


@pytest.mark.parametrize(
    "shape, index, count, elements",
    [
        ((3, 8), 13, 8, [13, 14, 15]),  # clipped at the end of row 1
        ((3, 8), 16, 8, list(range(16, 24))),  # a whole row
        ((3, 8), 23, 4, [23]),  # the last element of the tensor
        ((2, 3, 4), 6, 5, [6, 7]),  # rows run along the last dimension
        ((10,), 7, 5, [7, 8, 9]),  # a 1-D tensor is one row
        ((), 0, 3, [0]),  # a scalar is one element
    ],
)
def test_burst_is_clipped_at_the_end_of_its_row(shape, index, count, elements):
    tensor = torch.ones(shape)
    before = tensor.clone()
    text = f"kind=burst,op=aten.mm,index={index},count={count},mask=0x1"
    assert corrupt(spec(text), tensor) == (elements, None)
    assert [i for i, _ in _xor(before, tensor)] == elements


def test_burst_on_a_strided_output_follows_the_logical_rows():
    base = torch.zeros(8, 4)
    view = base.t()  # [4, 8], non-contiguous
    corrupt(spec("kind=burst,op=aten.mm,index=10,count=3,mask=0x1"), view)
    changed = torch.nonzero(view.contiguous().view(torch.int32)).tolist()
    assert changed == [[1, 2], [1, 3], [1, 4]]


@pytest.mark.parametrize(
    "text", ["kind=mask,op=aten.mm,index=12,mask=0x3", "kind=burst,op=aten.mm,index=12,count=2"]
)
def test_mask_and_burst_outside_the_output_do_not_fire(text):
    tensor = _sample(torch.float32)
    before = tensor.clone()
    assert corrupt(spec(text), tensor) is None
    assert torch.equal(tensor, before)


def test_memflip_with_a_mask_is_a_multi_bit_memory_error():
    text = "kind=memflip,param=head.0.weight,step=1,index=5,mask=0x00c00003"
    model, _ = _toy()
    injector = Injector([FaultSpec.parse(text)], "cpu:0")
    before = model.head[0].weight.detach().clone()
    injector.before_step(1, model)
    assert _xor(before, model.head[0].weight.detach()) == [(5, 0x00C00003)]
    assert (injector.fired[0].bit, injector.fired[0].mask) == (None, "0xc00003")


def test_injector_records_the_mask_and_burst_elements_it_fired():
    mask = "kind=mask,op=aten.mm,module=head.1,phase=forward,index=6,mask=0x00f00000"
    burst = "kind=burst,op=aten.mm,module=enc,phase=forward,index=5,count=8,bit=21"
    injector, spy = run_steps([mask, burst])
    fired = {f.module: f.to_json() for f in injector.fired}
    assert fired["head.1"]["elements"] == [6]
    assert (fired["head.1"]["bit"], fired["head.1"]["mask"]) == (None, "0xf00000")
    assert fired["enc"]["elements"] == [5, 6, 7]  # outputs are [3, 4]: row 1 ends at 7
    assert (fired["enc"]["bit"], fired["enc"]["mask"]) == (21, None)
    # the module saw the corrupted output: the spy (after the injector) has the changed bits
    enc_out = next(out for site, out in spy.calls if site.module == "enc" and site.op == MM)
    _, clean_spy = run_steps([])
    clean_out = next(out for site, out in clean_spy.calls if site.module == "enc" and site.op == MM)
    assert _xor(clean_out, enc_out) == [(i, 1 << 21) for i in (5, 6, 7)]


def test_a_recording_with_a_mask_diverges_where_it_was_planted(cli, tmp_path, small_bundle):
    """record --inject kind=mask: the bundle differs from a clean one from that call on."""
    from conftest import SMALL_ARGS

    spec = (
        "kind=mask,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=101,"
        "mask=0x00f00000"
    )
    out = tmp_path / "masked.bundle"
    recorded = cli("record", "builtin:tiny-llama", "--steps", "2", "--out", out, *SMALL_ARGS,
                   "--inject", spec)  # fmt: skip
    assert recorded.exit_code == 0, recorded.stderr
    compared = cli("diff", small_bundle, out, "--json")
    assert compared.exit_code == 1, compared.stderr
    first = json.loads(compared.stdout)["first_divergence"]
    assert (first["step"], first["phase"], first["name"]) == (
        1,
        "forward",
        "forward:layers.0.attn.wq",
    )


@pytest.mark.parametrize(
    "spec, words",
    [
        ("kind=mask,op=aten.mm,step=1,mask=0", "mask=0 changes no bit"),
        ("kind=mask,op=aten.mm,step=1,index=3,mask=0x100000000", "wider than the 32-bit word"),
    ],
)
def test_a_bad_mask_on_the_command_line_is_an_error_with_a_hint(cli, tmp_path, spec, words):
    from conftest import SMALL_ARGS

    out = tmp_path / "refused.bundle"
    result = cli("record", "builtin:tiny-llama", "--steps", "2", "--out", out, *SMALL_ARGS,
                 "--inject", spec)  # fmt: skip
    assert result.exit_code == 3
    assert "Error:" in result.stderr and words in result.stderr
    assert "Hint:" in result.stderr and "Traceback" not in result.stderr
