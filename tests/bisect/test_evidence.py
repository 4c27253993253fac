"""What bisect says of a wrong input, in the storage's and the bundle's terms: a word flipped
through a broadcasting view is one element of the storage it views, an input of the step
that changed before its reader read it was corrupted at rest, and optimizer state has the
name the signature log gives it (``optim:``). Each fault is planted on cpu:1 of the session's
small tiny-llama bundle (conftest's SMALL: one layer, width 32, 2 steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import preserved_global_state
from test_bisect import only_fired

from sdcreplay.bisect.localize import bisect
from sdcreplay.capture.operators import state_tensors
from sdcreplay.replay.session import ReplaySession

# RMSNorm's backward broadcasts a [2, 8, 1] gradient over [2, 8, 32] (aten.expand, a view):
# the flip lands in the word of [0, 0] that all 32 elements of that row read.
THROUGH_EXPAND = (
    "kind=bitflip,op=aten.expand,module=norm,phase=backward,step=1,index=9,bit=10,device=cpu:1"
)
# The first slice of the batch's tokens (a view, written by no call): token [0, 3] read wrong.
BATCH_SLICE = (
    "kind=bitflip,op=aten.slice,module=<outside>,phase=forward,step=1,nth=0,index=3,bit=0,"
    "device=cpu:1"
)


@pytest.fixture(scope="module")
def reports(_small_bundle_template: Path, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("evidence")
    found = {}
    with preserved_global_state(), pytest.MonkeyPatch.context() as patch:
        patch.delenv("SDCREPLAY_INJECT", raising=False)
        for name, spec in (
            ("expand", THROUGH_EXPAND),
            ("slice", BATCH_SLICE),
        ):
            result = bisect(
                _small_bundle_template, suspect="cpu:1", step=1, inject=[spec], out=root / name
            )
            found[name] = result.to_json()
    return found


def test_a_flip_through_a_broadcasting_view_is_one_element_of_its_storage(reports):
    report = reports["expand"]
    upstream = report["upstream"]
    assert (report["isolated"], upstream["at_rest"]) == ("upstream", True)
    assert (upstream["producer"]["op"], upstream["reader"]["op"]) == (
        "aten.mul.Tensor",
        "aten.div.Scalar",
    )
    changed = upstream["elements"]
    assert (changed["count"], changed["total"], changed["positions"]) == (1, 16, [[0, 0, 0]])
    assert changed["view"] == {"stride": [8, 1, 0], "storage_indices": [0], "elements": 32}
    assert changed["fault_model"] == (
        "single-bit flip of bit 10 (mask 0x00000400) on 1 element of the storage (a "
        "broadcasting view shows it at 32 of its 512 positions, first [0, 0, 0])"
    )
    # The reader's own output is a dense tensor: its 32 wrong elements are 32.
    assert (report["elements"]["count"], report["pattern"]) == (32, "row segment")


def test_an_input_of_the_step_that_changed_before_its_reader_is_at_rest(
    reports, _small_bundle_template
):
    fired = only_fired(_small_bundle_template, BATCH_SLICE)
    report = reports["slice"]
    upstream = report["upstream"]
    assert report["isolated"] == "upstream" and upstream["at_rest"] is True
    assert (upstream["producer"], upstream["state"]) == (None, None)
    assert upstream["reader"]["op"] == "aten.embedding.default"
    assert upstream["reader"]["index"] == fired["op_index"] + 1  # the call right after the slice
    assert upstream["input"]["name"] == "indices"
    assert upstream["summary"] == (
        "memory corrupted at rest: it entered the step as one of its inputs, right (no "
        "operator call of the step wrote it: the recorded batch, or a tensor made before the "
        "step); call 1 (aten.embedding.default under tok_embeddings, forward) read it wrong as "
        "input 1 (indices)"
    )
    assert upstream["elements"]["positions"] == [[0, 3]]


def test_optimizer_state_is_named_as_the_signature_log_names_it(_small_bundle_template):
    """The state bisect digests entering a step (its ``state`` entries, and an input's
    ``state``) and the bundle's signature entries call AdamW's moments alike: ``optim:``."""
    session = ReplaySession(_small_bundle_template, "cpu")
    try:
        first = session.bundle.steps[0]
        entries = session.run_step(first)
        named = state_tensors(session.model, session.optimizer)
    finally:
        session.close()
    logged = {name for name, _ in entries if name.startswith("optim:")}
    assert "optim:layers.0.mlp.w1.weight.exp_avg" in logged
    assert {name for name in named if name.startswith("optim")} == logged
