"""A Hugging Face Accelerate loop as Accelerate's examples write it, in script mode:
``accelerator.prepare``, ``with accelerator.accumulate(model):`` around each micro-batch,
``accelerator.backward``, and the prepared optimizer's ``step``/``zero_grad``, which act only
when ``accelerator.sync_gradients`` (decided by the Accelerator's own Python counter,
``accelerator.step``). Each ``rec.step()`` is one micro-batch.

    python accelerate_accumulation.py BUNDLE [counted]

Without ``counted``, as the examples nest it (``with accelerator.accumulate(model),
rec.step():``) and the counter not given to the Recorder; with it, as docs/porting.md asks:
the counter in ``state=`` and ``rec.step()`` entered first.
"""

import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import sdcreplay

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
counted = sys.argv[2:] == ["counted"]


class AcceleratorStep:
    """The Accelerator's micro-batch counter, as a state object."""

    def state_dict(self) -> dict:
        return {"step": accelerator.step}

    def load_state_dict(self, state: dict) -> None:
        accelerator.step = state["step"]


state = {"accelerator_step": AcceleratorStep()} if counted else {}
rec = sdcreplay.Recorder(sys.argv[1], model=model, optimizer=optimizer.optimizer, state=state)


def micro_batch(x: torch.Tensor, y: torch.Tensor) -> None:
    x, y = rec.feed((x, y))
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


for index in range(3):
    generator = torch.Generator().manual_seed(index)
    x, y = torch.randn(4, 8, generator=generator), torch.randint(4, (4,), generator=generator)
    if counted:
        with rec.step(), accelerator.accumulate(model):
            micro_batch(x, y)
    else:
        with accelerator.accumulate(model), rec.step():
            micro_batch(x, y)
rec.close()
