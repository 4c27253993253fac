"""doctor: a device that cannot reproduce a step is named, with the first operator that differs."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from sdcreplay.cli import app
from sdcreplay.replay.doctor import doctor

NOISY_WORKLOAD = """
import itertools

import torch

from sdcreplay import Workload


CALLS = itertools.count()


class Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.jitter = torch.nn.Identity()

    def forward(self, x):
        h = self.proj(x)
        # State that leaks from one run into the next (here a call counter): the kind of
        # nondeterminism doctor exists to catch.
        return self.jitter(h * (1.0 + next(CALLS)))


def make_workload(seed=0):
    model = Noisy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Workload(
        model, optimizer, lambda i: torch.ones(4, 8) * (i + 1), lambda m, b: m(b).square().mean()
    )


# The same model driven by the workload's own step (no loss_fn): doctor runs that step.
def make_train_step_workload(seed=0):
    model = Noisy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(batch):
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return Workload(model, optimizer, lambda i: torch.ones(4, 8) * (i + 1), train_step=train_step)
"""


def test_cpu_step_is_reproducible():
    report = doctor("cpu", "builtin:tiny-llama", {"layers": 1, "dim": 32}).to_json()
    assert report["schema"] == "sdcreplay.doctor/1"
    assert report["reproducible"] is True
    assert report["first_nondeterministic"] is None
    assert report["operators"] > 100
    assert report["problems"] == []


@pytest.mark.parametrize("factory", ["make_workload", "make_train_step_workload"])
def test_names_the_first_nondeterministic_operator(tmp_path, factory):
    path = tmp_path / "noisy.py"
    path.write_text(textwrap.dedent(NOISY_WORKLOAD))
    report = doctor("cpu", f"{path}:{factory}").to_json()
    assert report["reproducible"] is False
    first = report["first_nondeterministic"]
    assert (first["op"], first["module"], first["phase"]) == (
        "aten.mul.Tensor",
        "<root>",
        "forward",
    )


def test_cli_exit_codes(tmp_path):
    runner = CliRunner()
    clean = runner.invoke(app, ["doctor", "--json"])
    assert clean.exit_code == 0, clean.output
    assert json.loads(clean.stdout)["reproducible"] is True
    path = tmp_path / "noisy.py"
    path.write_text(textwrap.dedent(NOISY_WORKLOAD))
    noisy = runner.invoke(app, ["doctor", "--workload", f"{path}:make_workload"])
    assert noisy.exit_code == 1  # a finding, as a divergence is: not a tool error
    assert "first difference at aten.mul.Tensor under <root>" in noisy.stderr
    assert "Error:" not in noisy.stderr
