"""A user's training loop with checkpoints, recorded always-on (tests start it as a subprocess).

``python checkpoint_loop.py OUT CKPT_DIR --steps 14 --save-after 4,9 --alarm 12``: AdamW with a
warm-up and cosine schedule and gradient clipping, a ``torch.save`` checkpoint of the model,
optimizer and scheduler after the steps ``--save-after`` names, each announced to the
Recorder (``checkpoint_saved``). The Recorder is the production level: a ring of ``--ring``
steps at the boundary signature level, anchored on the checkpoints (at most
``--max-window`` steps since one). The copy-free UpdateDetector judges every step; the
job's own health check asks for a bundle at step ``--alarm``. Prints one JSON line: the
bundle, the checkpoints and the detector's alarms.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import sdcreplay
from sdcreplay.online import UpdateDetector


def make_workload(seed: int = 0) -> sdcreplay.Workload:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32, bias=False),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32, bias=False),
        torch.nn.GELU(),
        torch.nn.Linear(32, 4, bias=False),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / 50))
    )

    def get_batch(index: int) -> dict:
        generator = torch.Generator().manual_seed(1000 + index)
        x = torch.randn(8, 16, generator=generator)
        return {"x": x, "y": torch.randint(0, 4, (8,), generator=generator)}

    def train_step(batch: dict) -> torch.Tensor:
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss

    return sdcreplay.Workload(
        model, optimizer, get_batch, train_step=train_step, state={"scheduler": scheduler}
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("checkpoints", type=Path)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--save-after", default="4,9")
    parser.add_argument("--alarm", type=int, default=12)
    parser.add_argument("--ring", type=int, default=4)
    parser.add_argument("--max-window", type=int, default=1000)
    args = parser.parse_args()
    save_after = {int(step) for step in args.save_after.split(",") if step}
    args.checkpoints.mkdir(parents=True, exist_ok=True)

    workload = make_workload()
    recorder = sdcreplay.Recorder(
        args.out,
        f"{Path(__file__).resolve()}:make_workload",
        workload.model,
        workload.optimizer,
        state=workload.state,
        ring=args.ring,
        signature="boundary",
        max_window=args.max_window,
    )
    detector = UpdateDetector(workload, recorder=recorder)
    saved, bundle = [], None
    for step in range(args.steps):
        detector.run_step(workload.get_batch(step))
        if step in save_after:
            path = args.checkpoints / f"after-{step}.pt"
            torch.save(
                {
                    "model": workload.model.state_dict(),
                    "optimizer": workload.optimizer.state_dict(),
                    "scheduler": workload.state["scheduler"].state_dict(),
                },
                path,
            )
            recorder.checkpoint_saved(path)
            saved.append(str(path))
        if step == args.alarm:
            bundle = recorder.dump(f"health check failed at step {step}", source="healthcheck")
    recorder.close()
    detector.close()
    alarms = [alarm.describe() for alarm in detector.alarms]
    print(json.dumps({"bundle": str(bundle), "checkpoints": saved, "alarms": alarms}))


if __name__ == "__main__":
    main()
