"""An Accelerate loop in script mode, as ``accelerate launch --mixed_precision bf16`` runs it:
the launcher says bf16 through ``ACCELERATE_MIXED_PRECISION`` alone, and ``prepare`` wraps the
model's forward in bfloat16 autocast. ``python accelerate_loop.py BUNDLE``."""

import sys

import torch
from accelerate import Accelerator

import sdcreplay


def main() -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    rec = sdcreplay.Recorder(sys.argv[1], model=model, optimizer=optimizer.optimizer)
    for _ in range(3):
        with rec.step():
            x = rec.feed(torch.randn(4, 8))
            loss = model(x).float().pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    rec.close()


if __name__ == "__main__":
    main()
