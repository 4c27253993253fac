"""A flat training script in the style of nanoGPT's train.py, recorded in script mode.

Module-level globals overridden from the command line (``--compile=True``,
``--bundle=run.bundle``), a small GPT with dropout, gradient accumulation whose next batch
is prefetched inside the step by a ``get_batch`` that draws ``torch.randint``, the learning
rate set before the step by ``get_lr(iter_num)``, a GradScaler (disabled on a CPU, as
nanoGPT's is outside float16), ``clip_grad_norm_(1.0)``, optional ``torch.compile`` and DDP
under torchrun. The only lines about sdcreplay: the Recorder, ``rec.step()``, ``rec.feed``
and the print kept out of a replay with ``sdcreplay.replaying()``.

    python nanogpt_train.py --bundle=run.bundle
    torchrun --nproc-per-node 2 nanogpt_train.py --bundle=job.bundle
"""

import math
import os
import sys
from ast import literal_eval

import torch
import torch.nn as nn
from torch.distributed import init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sdcreplay

# -----------------------------------------------------------------------------
# default config values
bundle = "run.bundle"
max_iters = 3
gradient_accumulation_steps = 2
batch_size = 2
block_size = 8
vocab_size = 32
n_embd = 16
n_head = 2
dropout = 0.1
learning_rate = 1e-2
warmup_iters = 1
lr_decay_iters = 3
min_lr = 1e-3
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
compile = False
backend = "gloo"
device = "cpu"
# the configurator: --key=value overrides a global
for arg in sys.argv[1:]:
    key, val = arg[2:].split("=", 1)
    assert key in globals(), f"unknown config key {key}"
    try:
        val = literal_eval(val)
    except (SyntaxError, ValueError):
        pass
    globals()[key] = val
# -----------------------------------------------------------------------------

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    seed_offset = ddp_rank
else:
    seed_offset = 0
torch.manual_seed(1337 + seed_offset)

data = torch.randint(vocab_size, (512,), generator=torch.Generator().manual_seed(0))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                drop=nn.Dropout(dropout),
                h=nn.ModuleList([Block()]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(decay_ratio, 1.0)))
    return min_lr + coeff * (learning_rate - min_lr)


model = GPT().to(device)
scaler = torch.amp.GradScaler(device, enabled=False)
optimizer = torch.optim.AdamW(
    model.parameters(), lr=learning_rate, betas=(beta1, beta2), weight_decay=weight_decay
)
if compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model)
rec = sdcreplay.Recorder(bundle, model=model, optimizer=optimizer, state={"scaler": scaler})

X, Y = get_batch()  # fetch the very first batch
iter_num = 0
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    with rec.step():
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            X, Y = rec.feed((X, Y))
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch()  # prefetch the next batch while the step runs
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    if not sdcreplay.replaying():
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}")
    iter_num += 1
    if iter_num >= max_iters:
        break
rec.close()
