"""A Hugging Face Accelerate loop recorded in script mode, in the shape of Accelerate's own
examples: a GPT-2 built from a config, AdamW, a DataLoader and a warm-up schedule through
``accelerator.prepare``, gradient accumulation with ``accelerator.accumulate``, and clipping
when the gradients are synchronized.

    accelerate launch --cpu --num_processes 1 --mixed_precision bf16 \\
        examples/accelerate_train.py --out run.bundle
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \\
        examples/accelerate_train.py --out job.bundle
    sdcreplay replay run.bundle -d cpu:0 -d cpu:1 -d cpu:2

The sdcreplay lines are marked ``# sdcreplay``. The Recorder takes the prepared objects as
they are (the ``AcceleratedOptimizer`` included); the launcher's choices (bf16, CPU, the
process count) reach the script as ``ACCELERATE_*`` variables, which the bundle keeps, so a
replay trains as the recording did from any shell. Accelerate counts micro-batches in a Python
counter (``accelerator.step``) as ``accumulate()`` begins: the Recorder is given it as state and
``rec.step()`` is entered first, so the state saved entering a step holds the count and
``bisect`` starts a step from there (docs/porting.md).
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import sdcreplay  # sdcreplay

VOCAB, CONTEXT = 64, 16


class AcceleratorStep:  # sdcreplay: Accelerate's micro-batch counter, as a state object
    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator

    def state_dict(self) -> dict:
        return {"step": self.accelerator.step}

    def load_state_dict(self, state: dict) -> None:
        self.accelerator.step = state["step"]


def tokens(count: int) -> TensorDataset:
    """A synthetic corpus (a real loop tokenizes its data set)."""
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, VOCAB, (count, CONTEXT), generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="run.bundle")
    parser.add_argument("--steps", type=int, default=4, help="micro-batches to record")
    arguments = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = DataLoader(tokens(64), batch_size=4, shuffle=True)
    schedule = get_linear_schedule_with_warmup(optimizer, 2, 100)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)

    rec = sdcreplay.Recorder(  # sdcreplay
        arguments.out, model=model, optimizer=optimizer,
        state={"accelerator_step": AcceleratorStep(accelerator)},
    )  # fmt: skip
    model.train()
    for step, (batch,) in enumerate(loader):
        if step == arguments.steps:
            break
        with rec.step(), accelerator.accumulate(model):  # sdcreplay: rec.step() first
            batch = rec.feed(batch)  # sdcreplay
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {loss.item():.4f}")
    rec.close()  # sdcreplay


if __name__ == "__main__":
    main()
