"""A small Llama-style transformer on synthetic tokens (``builtin:tiny-llama``).

It exercises the kernels a real LLM step runs (embedding, RMSNorm, rotary
attention through ``scaled_dot_product_attention``, SwiGLU, AdamW) while one
step takes milliseconds on a CPU. Module names are a contract: signatures and
fault specs refer to them (``layers.1.attn.wq`` ...).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .definition import Workload


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 so low-precision inputs stay stable."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rotary_tables(head_dim: int, max_seq_len: int, base: float = 10000.0):
    """Cos/sin of shape ``[max_seq_len, head_dim]`` for the rotate-half layout."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., seq, head_dim]``) by position, in float32."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return (x32 * cos + rotated_half * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings."""

    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, dim: int, heads: int, max_seq_len: int):
        super().__init__()
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"dim={dim} must split into {heads} heads of even size")
        self.heads = heads
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        cos, sin = rotary_tables(self.head_dim, max_seq_len)
        # Buffers, not attributes: they follow the model through ``.to(device)``.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            # -1 heads: under tensor parallelism a rank holds its share of them
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        q = apply_rotary(split_heads(self.wq(x)), cos, sin)
        k = apply_rotary(split_heads(self.wk(x)), cos, sin)
        v = split_heads(self.wv(x))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(attended.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """Gated feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def default_hidden(dim: int) -> int:
    """Llama's feed-forward width: about 8/3 of ``dim``, rounded to a multiple of 8."""
    return max(8, 8 * round(8 * dim / 3 / 8))


class TransformerBlock(nn.Module):
    """Pre-norm residual block; the feed-forward is registered as ``feed_forward_name``
    so the MoE variant keeps the same layout under its own module name."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_seq_len: int,
        dropout: float,
        feed_forward: nn.Module,
        feed_forward_name: str = "mlp",
    ):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads, max_seq_len)
        self.attn_dropout = nn.Dropout(dropout)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward_name = feed_forward_name
        self.add_module(feed_forward_name, feed_forward)
        self.mlp_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn_dropout(self.attn(self.attention_norm(x)))
        feed_forward = getattr(self, self.feed_forward_name)
        return h + self.mlp_dropout(feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    """Token embedding, a stack of blocks, final norm and the vocabulary head."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        make_block: Callable[[], nn.Module],
        layers: int,
        tie_embeddings: bool,
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(make_block() for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def synthetic_batches(
    seed: int, batch_size: int, seq_len: int, vocab: int
) -> Callable[[int], dict[str, torch.Tensor]]:
    """Batch *i* from its own generator, so any step's batch can be rebuilt alone.

    Each row counts up from a random start by a random stride (1-3) modulo
    ``vocab``, and 10% of tokens are replaced by noise: learnable, so the loss
    falls, but never trivially zero.
    """

    def get_batch(index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        length = seq_len + 1
        start = torch.randint(vocab, (batch_size, 1), generator=generator)
        stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
        tokens = (start + stride * torch.arange(length)) % vocab
        noise = torch.randint(vocab, (batch_size, length), generator=generator)
        noisy = torch.rand(batch_size, length, generator=generator) < 0.1
        return {"tokens": torch.where(noisy, noise, tokens)}

    return get_batch


def next_token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross entropy of each position's logits against the following token."""
    tokens = batch["tokens"].to(next(model.parameters()).device)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@dataclass(frozen=True)
class LoopOptions:
    """What a real training loop adds to the step; the defaults add nothing (the plain step).

    ``grad_clip``: clip the gradient norm to this before the optimizer step.
    ``warmup_steps``/``schedule_steps``: linear warm-up, then cosine decay to 0
    at ``schedule_steps`` (a LambdaLR stepped after every optimizer step).
    ``accumulation``: K micro-batches (the batch split along its rows), each
    ``loss / K`` backward, one optimizer step. ``autocast``: ``"bfloat16"``
    runs the forward and loss under ``torch.autocast``.
    """

    grad_clip: float | None = None
    warmup_steps: int = 0
    schedule_steps: int = 0
    accumulation: int = 1
    autocast: str | None = None

    @property
    def plain(self) -> bool:
        return self == LoopOptions()

    def check(self, batch_size: int) -> None:
        if self.accumulation < 1 or batch_size % self.accumulation:
            raise ValueError(
                f"accumulation={self.accumulation} must divide batch_size={batch_size}"
            )
        if self.autocast not in (None, "bfloat16", "float16"):
            raise ValueError(f"autocast={self.autocast!r} is not bfloat16 or float16")
        if self.warmup_steps < 0 or self.schedule_steps < 0:
            raise ValueError("warmup_steps and schedule_steps must be at least 0")


def warmup_cosine(warmup_steps: int, schedule_steps: int) -> Callable[[int], float]:
    """The learning-rate factor at optimizer step ``n``: linear warm-up, then cosine to 0."""

    def factor(n: int) -> float:
        if n < warmup_steps:
            return (n + 1) / warmup_steps
        if not schedule_steps:
            return 1.0
        progress = min(1.0, (n - warmup_steps) / max(1, schedule_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def loop_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    options: LoopOptions,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
):
    """The whole step a loop with these options runs: micro-batches, clipping, step, schedule."""

    def train_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        device = next(model.parameters()).device
        total = torch.zeros((), device=device)
        for tokens in batch["tokens"].chunk(options.accumulation):
            autocast = (
                torch.autocast(device.type, dtype=getattr(torch, options.autocast))
                if options.autocast
                else contextlib.nullcontext()
            )
            with autocast:
                loss = next_token_loss(model, {"tokens": tokens}) / options.accumulation
            loss.backward()
            total += loss.detach()
        if options.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.grad_clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        return total

    return train_step


def language_model_workload(
    model: nn.Module,
    *,
    seed: int,
    seq_len: int,
    batch_size: int,
    vocab: int,
    lr: float,
    options: LoopOptions = LoopOptions(),
) -> Workload:
    """Wrap a next-token model with AdamW, synthetic batches, the loss and the loop's step."""
    options.check(batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    workload = Workload(
        model=model,
        optimizer=optimizer,
        get_batch=synthetic_batches(seed, batch_size, seq_len, vocab),
        loss_fn=next_token_loss,
    )
    if not options.plain:  # the plain step stays the default one, so its bundles do not change
        scheduler = None
        if options.warmup_steps or options.schedule_steps:
            factor = warmup_cosine(options.warmup_steps, options.schedule_steps)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
            workload.state["scheduler"] = scheduler
        workload.train_step = loop_step(model, optimizer, options, scheduler)
    return workload


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
    grad_clip: float | None = None,
    warmup_steps: int = 0,
    schedule_steps: int = 0,
    accumulation: int = 1,
    autocast: str | None = None,
    parallel: str | None = None,
) -> Workload:
    """Build tiny-llama on the CPU; the caller moves the model with ``.to()``.

    ``grad_clip``, ``warmup_steps``/``schedule_steps``, ``accumulation`` and
    ``autocast`` make the step a real loop's (see :class:`LoopOptions`).
    ``parallel`` (in a torch.distributed job): "ddp" or "fsdp2" train data-parallel (the same
    initial weights on every rank, each rank its own shard of the batches); "tp" splits every
    block's projections over the ranks (every rank the same batches); "fsdp2+tp" does both on
    a 2-D mesh (tensor-parallel pairs of ranks, data-parallel across them).
    """
    torch.manual_seed(seed)
    hidden = hidden or default_hidden(dim)

    def make_block() -> TransformerBlock:
        return TransformerBlock(dim, heads, seq_len, dropout, SwiGLU(dim, hidden))

    model = Transformer(vocab, dim, make_block, layers, tie_embeddings)
    options = LoopOptions(grad_clip, warmup_steps, schedule_steps, accumulation, autocast)
    wrapped = model if parallel is None else data_parallel(model, parallel)
    workload = language_model_workload(
        wrapped,
        seed=seed,
        seq_len=seq_len,
        batch_size=batch_size,
        vocab=vocab,
        lr=lr,
        options=options,
    )
    if parallel is not None:
        # The step runs through the wrapper (which exchanges the gradients); the model the
        # bundle, signatures and fault specs name stays the plain one (layers.1.attn.wq...).
        workload.model = model
        if parallel == "ddp":
            workload.data_parallel = wrapped
        workload.loss_fn = lambda _model, batch: next_token_loss(wrapped, batch)
        workload.get_batch = rank_shard(workload.get_batch, parallel)
    return workload


PARALLEL = ("ddp", "fsdp2", "tp", "fsdp2+tp")
TENSOR_PARALLEL = 2  # ranks per tensor-parallel group under "fsdp2+tp"


def data_parallel(model: nn.Module, parallel: str) -> nn.Module:
    """Wrap ``model`` for the job this process is a rank of: DDP, or FSDP2's ``fully_shard``
    per block and at the root. Both need the model on the rank's device when they wrap it:
    the CPU under gloo, the current CUDA device otherwise (replay puts it on the same)."""
    import torch.distributed as dist

    if parallel not in PARALLEL:
        raise ValueError(f"parallel={parallel!r} is not one of {', '.join(PARALLEL)} or None")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"parallel={parallel!r} needs torch.distributed initialized (start the ranks with "
            "torchrun or `sdcreplay record --nproc N`)"
        )
    if dist.get_backend() != "gloo":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    if parallel == "ddp":
        # The rotary tables are constant buffers: no broadcast of them before every forward.
        return nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)
    from torch.distributed.fsdp import fully_shard

    data_mesh = None
    if "tp" in parallel:
        mesh = _mesh(parallel)
        data_mesh = mesh["dp"] if mesh.ndim == 2 else None
        for block in model.layers:  # type: ignore[union-attr]
            _tensor_parallel(block, mesh["tp"] if mesh.ndim == 2 else mesh)
    if "fsdp2" in parallel:
        for block in model.layers:  # type: ignore[union-attr]
            fully_shard(block, mesh=data_mesh)
        fully_shard(model, mesh=data_mesh)
    return model


def _mesh(parallel: str):
    """The device mesh: 1-D over every rank ("tp"), or (dp, tp) with TENSOR_PARALLEL ranks per
    tensor-parallel group ("fsdp2+tp")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cpu" if dist.get_backend() == "gloo" else "cuda"
    world_size = dist.get_world_size()
    if parallel == "tp":
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("tp",))
    if world_size % TENSOR_PARALLEL:
        raise ValueError(f"parallel={parallel!r} needs a multiple of {TENSOR_PARALLEL} ranks")
    shape = (world_size // TENSOR_PARALLEL, TENSOR_PARALLEL)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp"))


def _tensor_parallel(block: nn.Module, mesh) -> None:
    """Megatron's split of a block: q, k, v and the gate/up projections by columns (each rank
    its heads, its share of the hidden width), the attention and MLP outputs by rows (summed
    by an all_reduce)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    columns = ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in columns}
    plan.update({"attn.wo": RowwiseParallel(), "mlp.w2": RowwiseParallel()})
    parallelize_module(block, mesh, plan)


def rank_shard(get_batch: Callable[[int], dict], parallel: str = "ddp") -> Callable[[int], dict]:
    """Data-parallel rank r of R's batch i is batch ``i * R + r`` of the one synthetic stream
    (R: every rank, or under tensor parallelism the data-parallel groups: one for "tp")."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    if "tp" in parallel:
        tensor_parallel = TENSOR_PARALLEL if "fsdp2" in parallel else world_size
        rank, world_size = rank // tensor_parallel, world_size // tensor_parallel
    return lambda index: get_batch(index * world_size + rank)
