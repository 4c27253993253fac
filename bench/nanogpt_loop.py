"""A nanoGPT-shaped training loop as a workload factory: what people run, clipping included.

nanoGPT's ``model.py`` (GPT-2 blocks: ``c_attn``, ``c_proj``, ``c_fc``, LayerNorm, dropout,
tied embeddings, ``scaled_dot_product_attention``) and ``train.py``'s step, at a size a CPU
trains in milliseconds: AdamW with nanoGPT's weight-decay groups, its warm-up + cosine
learning rate set at the top of each iteration from the iteration number, gradient
accumulation (the loss divided by the number of micro-batches), ``clip_grad_norm_`` at
``grad_clip`` (1.0; 0 turns it off, as nanoGPT's ``grad_clip = 0.0``),
``zero_grad(set_to_none=True)``. The iteration number is a state object, so a bundle's replay
sets the same rates.

    sdcreplay record out.bundle bench/nanogpt_loop.py:make_workload -a grad_clip=1.0
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from sdcreplay.workload.definition import Workload


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=False)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd, bias=False)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float):  # fmt: skip
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, n_embd),
                "wpe": nn.Embedding(block_size, n_embd),
                "drop": nn.Dropout(dropout),
                "h": nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer)),
                "ln_f": nn.LayerNorm(n_embd, bias=False),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class Iteration:
    """nanoGPT's ``iter_num``: the learning rate of an iteration is a function of it."""

    def __init__(self) -> None:
        self.number = 0

    def state_dict(self) -> dict:
        return {"number": self.number}

    def load_state_dict(self, state: dict) -> None:
        self.number = int(state["number"])


def learning_rate(it: int, rate: float, warmup_iters: int, decay_iters: int) -> float:
    """nanoGPT's ``get_lr``: linear warm-up, cosine decay to a tenth, then constant."""
    min_lr = rate / 10
    if it < warmup_iters:
        return rate * (it + 1) / (warmup_iters + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (rate - min_lr)


def make_workload(
    seed: int = 0,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 32,
    block_size: int = 16,
    vocab: int = 64,
    batch_size: int = 4,
    accumulation: int = 2,
    dropout: float = 0.1,
    learning_rate_max: float = 1e-3,
    warmup_iters: int = 10,
    decay_iters: int = 2000,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
) -> Workload:
    torch.manual_seed(seed)
    model = GPT(vocab, block_size, n_layer, n_head, n_embd, dropout)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=learning_rate_max, betas=(0.9, 0.95))
    iteration = Iteration()
    # a token stream with structure to learn (a noisy repeating pattern), fixed by the seed
    data_generator = torch.Generator().manual_seed(1234 + seed)
    pattern = torch.randint(vocab, (37,), generator=data_generator)
    data = pattern.repeat(200)
    noise = torch.rand(data.shape, generator=data_generator) < 0.1
    data[noise] = torch.randint(vocab, (int(noise.sum()),), generator=data_generator)

    def get_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``accumulation`` micro-batches of ``batch_size`` windows (x, and y shifted by one)."""
        generator = torch.Generator().manual_seed(10_000 * seed + i)
        starts = torch.randint(len(data) - block_size - 1, (accumulation * batch_size,),
                               generator=generator)  # fmt: skip
        x = torch.stack([data[s : s + block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts.tolist()])
        return x.view(accumulation, batch_size, -1), y.view(accumulation, batch_size, -1)

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        lr = learning_rate(iteration.number, learning_rate_max, warmup_iters, decay_iters)
        for group in optimizer.param_groups:
            group["lr"] = lr
        xs, ys = batch
        total = torch.zeros(())
        for x, y in zip(xs, ys):
            loss = model(x, y) / accumulation
            loss.backward()
            total = total + loss.detach()
        if grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iteration.number += 1
        return total

    def first_micro_batch_loss(model: nn.Module, batch) -> torch.Tensor:
        """The loss of the first micro-batch, as the step hands it to backward."""
        return model(batch[0][0], batch[1][0]) / accumulation

    return Workload(
        model,
        optimizer,
        get_batch,
        first_micro_batch_loss,
        train_step=train_step,
        state={"iteration": iteration},
    )
