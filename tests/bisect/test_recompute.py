"""One name for a call in an activation-checkpoint recompute, in replay, bisect, ops and specs.

``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` runs the block's forward
again inside the backward node that needs its saved tensors. Such a call is named as the
code reads: the block's module, phase ``forward``, marked ``recompute``; its ``nth`` counts on
from the first forward's calls (replay's ``forward:blocks.1.fc1#1`` is the second forward of
blocks.1.fc1). A spec written from replay's first divergence fires on that call in bisect.
"""

from __future__ import annotations

import json
import textwrap

WORKLOAD = textwrap.dedent("""
    import torch
    from torch.utils.checkpoint import checkpoint

    from sdcreplay import Workload


    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 8)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x


    def get_batch(index):
        return {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(index))}


    def make_workload(seed=0):
        torch.manual_seed(seed)
        model = Model()
        return Workload(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
            get_batch=get_batch,
            loss_fn=lambda model, batch: model(batch["x"]).pow(2).mean(),
        )
""")

# The recomputed forward of blocks.1.fc1 (its second addmm of the step), on cpu:1 only.
RECOMPUTED = "op=aten.addmm,module=blocks.1.fc1,phase=forward,step=1,nth=1"
FAULT = f"kind=bitflip,{RECOMPUTED},index=3,bit=20,device=cpu:1"


def test_a_recomputed_call_has_one_name_from_replay_to_bisect(cli, tmp_path):
    source = tmp_path / "checkpointed.py"
    source.write_text(WORKLOAD)
    bundle = tmp_path / "run.bundle"
    recorded = cli("record", f"{source}:make_workload", "--steps", "2", "--out", bundle)
    assert recorded.exit_code == 0, recorded.output

    listed = cli("ops", bundle, "--step", "1", "--module", "blocks.1.fc1", "--op", "aten.addmm",
                 "--trust-workload", "--json")  # fmt: skip
    assert listed.exit_code == 0, listed.output
    calls = json.loads(listed.stdout)["calls"]
    assert [(c["phase"], c["module"], c["nth"], c["recompute"]) for c in calls] == [
        ("forward", "blocks.1.fc1", 0, False),
        ("forward", "blocks.1.fc1", 1, True),
    ]
    assert calls[1]["spec"] == f"kind=bitflip,{RECOMPUTED}".replace(
        "op=aten.addmm,", "op=aten.addmm.default,"
    )

    replayed = cli("replay", bundle, "-d", "cpu:1", "--inject", FAULT, "--trust-workload", "--json")
    assert replayed.exit_code == 1, replayed.output
    first = json.loads(replayed.stdout)["devices"][0]["first_divergence"]
    assert first == {"step": 1, "phase": "forward", "name": "forward:blocks.1.fc1#1"}

    # The spec as the divergence reads: blocks.1.fc1's forward, its second call (#1).
    module, nth = first["name"].removeprefix("forward:").split("#")
    spec = f"kind=bitflip,op=aten.addmm,module={module},phase={first['phase']},step=1,nth={nth}"
    bisected = cli(
        "bisect", bundle, "--suspect", "cpu:1", "--reference", "cpu:0", "--step", "1",
        "--inject", f"{spec},index=3,bit=20,device=cpu:1", "--out", tmp_path / "report",
        "--trust-workload", "--json",
    )  # fmt: skip
    assert bisected.exit_code == 1, bisected.output
    report = json.loads(bisected.stdout)
    site = (report["phase"], report["module"], report["op"], report["recompute"])
    assert site == ("forward", "blocks.1.fc1", "aten.addmm.default", True)
    assert report["isolated"] == "kernel"
    assert report["elements"]["indices"] == [3] and report["bits"]["histogram"] == {"20": 1}
