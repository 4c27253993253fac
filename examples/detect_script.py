"""Watch your own inline training loop for silent data corruption (script mode, no train_step).

    python examples/detect_script.py --out /tmp/alarm.bundle \
        --inject "kind=bitflip,op=aten.mm,module=inp,phase=backward,step=12,nth=0,index=5,bit=30"
    sdcreplay replay /tmp/alarm.bundle --device cpu:0 --device cpu:1

The loop is written inline, as most are: `with detector.step():` stands where the loop had
`with rec.step():`. A ring Recorder keeps the last steps in memory and writes nothing; an
UpdateDetector judges each step as it ends (the losses handed to backward, every gradient's
norm before the clip, the update) and, on an alarm, dumps the ring as a bundle whose last
step is the alarmed one, warns, and training goes on. ``--inject`` plants a fault in the
recording device (a drill; ``SDCREPLAY_INJECT`` does the same without the option): two
healthy replicas of the bundle agree with each other and not with the record
(``recording_suspect``). Model and data are examples/train_script.py's (docs/online.md,
"In an inline loop").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from train_script import Classifier, learning_rate, sample_micro_batch

import sdcreplay
from sdcreplay.online import UpdateDetector


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/alarm.bundle"), help="alarm bundle")
    parser.add_argument("--steps", type=int, default=20, help="training steps to run")
    parser.add_argument("--inject", action="append", default=[], help="a fault spec (a drill)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Classifier(hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = sdcreplay.Recorder(args.out, model=model, optimizer=optimizer, ring=4, inject=args.inject)
    detector = UpdateDetector(model=model, optimizer=optimizer, recorder=rec)
    batch = sample_micro_batch()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, 1e-2, total=args.steps)
        with detector.step():  # opens rec.step(); judged, and dumped on an alarm, as it ends
            for _ in range(2):  # two micro-batches
                x, y = rec.feed(batch)
                batch = sample_micro_batch()
                loss = F.cross_entropy(model(x), y) / 2
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        alarm = detector.last_alarm
        if alarm is not None and alarm.step == step and not sdcreplay.replaying():
            print(f"alarm: {alarm.describe()}")
    rec.close()
    detector.close()
    if not sdcreplay.replaying():
        alarmed = [alarm.step for alarm in detector.alarms]
        print(f"{detector.metrics()['steps']} steps judged, alarms at {alarmed}")


if __name__ == "__main__":
    main()
