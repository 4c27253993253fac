"""The kernel probe: a step's distinct calls, run again on synthetic inputs, name the kernels
a machine computes differently, and only those."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL
from torch.utils._python_dispatch import TorchDispatchMode

from sdcreplay.capture.probe import (
    Probe,
    ProbeCall,
    collecting_calls,
    record_probe,
    run_probe,
    select_calls,
)
from sdcreplay.workload.definition import build_workload

CPU = torch.device("cpu")


class _SkewedKernel(TorchDispatchMode):
    """Another machine's ``op``: the last bit of its first output element differs."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) == self.op:
            out.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
        return out


@pytest.fixture(scope="module")
def step_calls() -> list[ProbeCall]:
    workload = build_workload("builtin:tiny-llama", SMALL)
    with collecting_calls(CPU) as collector:
        workload.run_step(workload.get_batch(0))
    return list(collector.calls.values())


def test_a_step_is_collected_as_its_distinct_computing_calls(step_calls):
    ops = {call.op for call in step_calls}
    assert "aten.mm.default" in ops
    assert "aten.embedding.default" in ops
    assert not ops & {"aten.view.default", "aten.t.default", "aten.detach.default"}
    assert not any("empty" in op for op in ops)
    embedding = next(c for c in step_calls if c.op == "aten.embedding.default")
    low, high = embedding.args[1]["tensor"]["range"]
    assert 0 <= low <= high < SMALL["vocab"]
    mm_calls = [c for c in step_calls if c.op == "aten.mm.default"]
    assert sum(c.count for c in mm_calls) > len(mm_calls)  # repeated shapes are one call


def test_the_probe_repeats_itself_bit_for_bit_and_survives_json(step_calls):
    probe = record_probe(step_calls, CPU)
    assert probe.calls and all(call.digest for call in probe.calls)
    again = Probe.from_json(json.loads(json.dumps(probe.to_json())))
    outcome = run_probe(again, CPU)
    assert outcome.matched and outcome.errors == {}
    assert outcome.digests == probe.digests


def test_a_kernel_computing_differently_is_named_and_only_it(step_calls):
    probe = record_probe(step_calls, CPU)
    with _SkewedKernel("aten.mm.default"):
        outcome = run_probe(probe, CPU)
    assert not outcome.matched
    named = {probe.calls[i].op for i in outcome.differing}
    assert named == {"aten.mm.default"}
    report = outcome.to_json(probe)
    assert report["differing"][0]["kernel"].startswith("aten.mm.default [")
    assert report["differing"][0]["kernel"].endswith("float32")


def test_the_cap_keeps_every_floating_point_op_and_then_the_most_frequent(step_calls):
    chosen, left_out = select_calls(step_calls, limit=5)
    float_ops = {c.op for c in step_calls if '"dtype": "float' in json.dumps(c.args)}
    assert {c.op for c in chosen} >= float_ops
    assert left_out == len(step_calls) - len(chosen)
    assert len(chosen) >= 5
    everything, none_left = select_calls(step_calls, limit=10_000)
    assert none_left == 0 and len(everything) == len(step_calls)


def test_synthetic_inputs_do_not_depend_on_the_other_calls(step_calls):
    """A call's inputs come from its own description, so a shorter probe agrees with a longer."""
    full = record_probe(step_calls, CPU)
    half = record_probe(step_calls[: len(step_calls) // 2], CPU)
    digests = {call.key: call.digest for call in full.calls}
    assert all(digests[call.key] == call.digest for call in half.calls)
