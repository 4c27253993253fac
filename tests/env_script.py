"""A script-mode loop whose step depends on its environment, as a launcher's loop does:
``ACCELERATE_MIXED_PRECISION=bf16`` runs its forward under bfloat16 autocast (what
``accelerate launch --mixed_precision bf16`` sets) and its own ``MYAPP_SCALE`` scales the loss.

``python env_script.py BUNDLE [--keep] [--warn]``: ``--keep`` records with
``Recorder(env=["MYAPP_*"])``; ``--warn`` verifies in warn mode.
"""

import os
import sys

import torch

import sdcreplay


def main() -> None:
    bundle, options = sys.argv[1], sys.argv[2:]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = float(os.environ.get("MYAPP_SCALE", "1"))
    bf16 = os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16"
    rec = sdcreplay.Recorder(
        bundle,
        model=model,
        optimizer=optimizer,
        verify="warn" if "--warn" in options else True,
        **({"env": ["MYAPP_*"]} if "--keep" in options else {}),
    )
    for _ in range(3):
        with rec.step():
            x = rec.feed(torch.randn(4, 8))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(x).float().pow(2).mean() * scale
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    rec.close()


if __name__ == "__main__":
    main()
