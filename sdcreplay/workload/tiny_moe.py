"""Tiny-llama with a top-k routed mixture-of-experts MLP (``builtin:tiny-moe``).

Routing gathers each expert's tokens with ``index_select`` and scatters the
results back with ``index_add_``, so the index/scatter kernels that MoE training
depends on show up in traces. ``index_add_`` is deterministic on CPU and has a
deterministic CUDA path, so replays stay bitwise comparable.
"""

from __future__ import annotations

import torch
from torch import nn

from .definition import Workload
from .tiny_llama import (
    SwiGLU,
    Transformer,
    TransformerBlock,
    default_hidden,
    language_model_workload,
)


class MoEFeedForward(nn.Module):
    """Each token goes to its ``top_k`` experts, weighted by renormalised router probabilities."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probabilities = self.router(tokens).float().softmax(dim=-1)
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        output = torch.zeros_like(tokens)
        # Every expert runs, even on zero tokens, so the operator sequence does
        # not depend on the routing.
        for expert_index, expert in enumerate(self.experts):
            token_index, slot = torch.where(chosen == expert_index)
            expert_out = expert(tokens.index_select(0, token_index))
            output.index_add_(0, token_index, expert_out * weights[token_index, slot, None])
        return output.view_as(x)


def make_workload(
    seed: int = 0,
    layers: int = 2,
    dim: int = 64,
    heads: int = 4,
    seq_len: int = 32,
    batch_size: int = 4,
    vocab: int = 256,
    hidden: int | None = None,
    tie_embeddings: bool = False,
    dropout: float = 0.1,
    lr: float = 1e-3,
    experts: int = 4,
    top_k: int = 2,
) -> Workload:
    """Build tiny-moe on the CPU; the caller moves the model with ``.to()``."""
    torch.manual_seed(seed)
    hidden = hidden or default_hidden(dim)

    def make_block() -> TransformerBlock:
        moe = MoEFeedForward(dim, hidden, experts, top_k)
        return TransformerBlock(dim, heads, seq_len, dropout, moe, feed_forward_name="moe")

    model = Transformer(vocab, dim, make_block, layers, tie_embeddings)
    return language_model_workload(
        model, seed=seed, seq_len=seq_len, batch_size=batch_size, vocab=vocab, lr=lr
    )
