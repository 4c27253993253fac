"""A loop shaped like Hugging Face Accelerate's gradient accumulation, in script mode: each
``rec.step()`` is one micro-batch, and a plain Python counter (Accelerate's
``accelerator.step``, advanced by ``accumulate()``) decides whether the micro-batch steps the
optimizer or only accumulates. No torch state holds the counter.

    python counter_accumulation.py BUNDLE NESTING

``NESTING``: ``unseen`` (the counter is not among the Recorder's ``state=``), ``outer`` (it is,
but ``accumulate()`` is entered before ``rec.step()``, as ``with accelerator.accumulate(model),
rec.step():`` does), ``inner`` (it is, and ``rec.step()`` is entered first: the nesting
docs/porting.md asks for).
"""

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

import sdcreplay

bundle, nesting = sys.argv[1], sys.argv[2]
ACCUMULATION = 2


class Accumulator:
    """Accelerate's counter: each ``accumulate()`` advances it, and only every
    ``ACCUMULATION``-th micro-batch syncs (steps the optimizer)."""

    def __init__(self):
        self.step = 0
        self.sync_gradients = True

    @contextlib.contextmanager
    def accumulate(self):
        self.step += 1
        self.sync_gradients = self.step % ACCUMULATION == 0
        yield

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accelerator = Accumulator()
state = {} if nesting == "unseen" else {"accumulator": accelerator}
rec = sdcreplay.Recorder(bundle, model=model, optimizer=optimizer, state=state)


def micro_batch(x: torch.Tensor, y: torch.Tensor) -> None:
    x, y = rec.feed((x, y))
    loss = F.cross_entropy(model(x), y) / ACCUMULATION
    loss.backward()
    if accelerator.sync_gradients:  # Accelerate's optimizer steps and zeroes only then
        optimizer.step()
        optimizer.zero_grad()


for index in range(3):
    generator = torch.Generator().manual_seed(index)
    x, y = torch.randn(4, 8, generator=generator), torch.randint(4, (4,), generator=generator)
    if nesting == "inner":
        with rec.step(), accelerator.accumulate():
            micro_batch(x, y)
    else:
        with accelerator.accumulate(), rec.step():
            micro_batch(x, y)
rec.close()
