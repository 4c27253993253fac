"""The update detector on a nanoGPT-shaped loop that clips its gradients (``bench/nanogpt_loop.py``:
AdamW, warm-up + cosine, two micro-batches, dropout, ``clip_grad_norm_(1.0)``).

Clipping divides every gradient by the total norm, so a corrupted gradient element that makes
that norm huge leaves the optimizer gradients that all look ordinary: the detector judges the
norms before the step's first clip (``online/pre_clip.py``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, planted

from sdcreplay.integrations.watch import StepWatch
from sdcreplay.online.alarms import gradient_norms
from sdcreplay.online.pre_clip import PreClipNorms
from sdcreplay.online.update_detector import UpdateDetector

LOOP = REPO / "bench" / "nanogpt_loop.py"
FACTORY = f"{LOOP}:make_workload"
C_ATTN = "transformer.h.0.attn.c_attn"
# one element of c_attn's weight gradient (the first backward mm of the module: grad_W, 96x32),
# its exponent's top bit, in the first execution of step 12 only
FLIP = f"kind=bitflip,op=aten.mm,module={C_ATTN},phase=backward,step=12,nth=0,index=70,bit=30"


def nanogpt(**kwargs):
    sys.path.insert(0, str(LOOP.parent))
    try:
        from nanogpt_loop import make_workload
    finally:
        sys.path.remove(str(LOOP.parent))
    return make_workload(**kwargs)


def test_the_drill_of_docs_online_alarms_and_its_bundle_bisects_to_the_planted_call(
    tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
):
    """docs/online.md's drill on the clipped loop, as a user pastes it, then its commands."""
    text = (REPO / "docs" / "online.md").read_text()
    (block,) = [b for b in text.split("```python\n")[1:] if "clipped.bundle" in b]
    monkeypatch.chdir(tmp_path)
    printed: list[str] = []
    names = {"print": printed.append, "__name__": "docs"}
    exec(compile(block.split("```")[0], "docs/online.md", "exec"), names)
    detector = names["detector"]
    assert names["spec"] == FLIP
    (alarm,) = detector.alarms
    assert printed == [
        f"step 12: grad_norm_jump, grad:{C_ATTN}.weight -> transient (bundle clipped.bundle)"
    ]
    # judged before the clip: the corrupted norm, not max_norm's share of it
    assert alarm.original.grad_norms[f"{C_ATTN}.weight"] > 1e20
    detector.close()
    names["recorder"].close()

    replayed = cli("replay", alarm.bundle, "--device", "cpu:0", "--device", "cpu:1", "--json")
    assert replayed.exit_code == 1, replayed.output
    report = json.loads(replayed.stdout)
    assert report["consensus"]["verdict"] == "recording_suspect", report
    # the recording is the suspect: bisect names the module and the gradient that diverged,
    bisected = cli("bisect", alarm.bundle, "--step", "12", "--out", tmp_path / "r1", "--json")
    assert bisected.exit_code == 1, bisected.output
    found = json.loads(bisected.stdout)
    assert (found["step"], found["module"], found["entry"]) == (12, C_ATTN, f"grad:{C_ATTN}.weight")
    # and on a device that computes as the recording one did, the planted call, element and bit
    spec = FLIP + ",device=cpu:1"  # the drill's spec
    bisected = cli(
        "bisect", alarm.bundle, "--suspect", "cpu:1", "--reference", "cpu:0", "--step", "12",
        "--inject", spec, "--out", tmp_path / "r2", "--json",
    )  # fmt: skip
    assert bisected.exit_code == 1, bisected.output
    found = json.loads(bisected.stdout)
    assert (found["step"], found["phase"], found["module"], found["op"]) == (
        12,
        "backward",
        C_ATTN,
        "aten.mm.default",
    )
    assert found["elements"]["indices"] == [70] and found["bits"]["histogram"] == {"30": 1}


@pytest.mark.parametrize("when", ["before_update", "after_update"])
def test_clean_clipped_steps_raise_no_alarm(when: str) -> None:
    workload = nanogpt(seed=1)
    with UpdateDetector(workload, when=when) as detector:  # type: ignore[arg-type]
        for i in range(45):
            detector.run_step(workload.get_batch(i))
    assert detector.alarms == [] and detector.metrics()["steps"] == 45


def test_norms_are_taken_before_the_first_clip_and_torch_is_given_back() -> None:
    original = torch.nn.utils.clip_grad._clip_grads_with_norm_
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = PreClipNorms(model, optimizer)
    model(torch.full((2, 4), 100.0)).sum().backward()
    before = gradient_norms(model)
    norms.begin()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert norms.take() == before and float(total) > 1.0
    assert gradient_norms(model) != before  # the optimizer is given the clipped ones
    norms.close()
    assert torch.nn.utils.clip_grad._clip_grads_with_norm_ is original


def test_a_gradscalers_unscale_is_seen_before_it_divides() -> None:
    """Measured at ``unscale_`` (before a clip) and divided by the scale: the true norms."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    norms = PreClipNorms(model, optimizer)
    norms.begin()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(optimizer)
    unscaled = gradient_norms(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    seen = norms.take()
    norms.close()
    assert seen.keys() == unscaled.keys()
    assert all(seen[name] == pytest.approx(unscaled[name], rel=1e-6) for name in seen)


def test_a_trainer_callback_judges_the_gradients_it_clipped(tmp_path: Path) -> None:
    """``StepWatch`` (both callbacks): the trainer clips, then tells the callback the optimizer
    steps; the flipped bit still alarms."""
    workload = nanogpt()
    watch = StepWatch(
        tmp_path / "watch.bundle",
        FACTORY,
        workload.model,
        workload.optimizer,
        state=workload.state,
        ring=4,
        verify=False,
    )
    model, optimizer = workload.model, workload.optimizer
    alarms = []
    for i in range(14):
        batch = workload.get_batch(i)
        watch.begin(batch)
        with planted(model, optimizer, FLIP if i == 12 else None, i):
            for x, y in zip(*batch):
                (model(x, y) / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            watch.before_optimizer()  # a trainer's on_pre_optimizer_step: after its clip
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with pytest.warns(UserWarning) if i == 12 else contextlib.nullcontext():
            alarm = watch.end()
        alarms.append(alarm)
    watch.close()
    assert [i for i, a in enumerate(alarms) if a is not None] == [12]
    assert f"grad:{C_ATTN}.weight" in alarms[12].reasons
