"""A tiny Llama trained by ``transformers.Trainer``: a user's workload module, as the
integration tests (test_integrations.py) and replay import it. Built from a config: nothing
is downloaded."""

from __future__ import annotations

import tempfile

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from sdcreplay.integrations.hf import trainer_workload

CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=16,
)
SEQ_LEN = 8


class OwnLossTrainer(Trainer):
    """A Trainer subclass with its own compute_loss, as the Trainer's docs show one: the labels
    popped, the model called without them (so it returns no loss), cross-entropy of the
    shifted logits computed here."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs["logits"][:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )
        return (loss, outputs) if return_outputs else loss


class Tokens(Dataset):
    def __init__(self, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, CONFIG["vocab_size"], (count, SEQ_LEN), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index].clone()}


def make_trainer(
    out_dir: str,
    *,
    seed: int = 0,
    max_steps: int = 8,
    accumulation: int = 1,
    own_loss: bool = False,
    callbacks=(),
    save_steps: int | None = None,
) -> Trainer:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        logging_strategy="no",
        save_strategy="no" if save_steps is None else "steps",
        save_steps=save_steps or 500,
        report_to=[],
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kind = OwnLossTrainer if own_loss else Trainer
    return kind(model=model, args=args, train_dataset=Tokens(64, seed), callbacks=list(callbacks))


def make_workload(
    seed: int = 0,
    max_steps: int = 8,
    accumulation: int = 1,
    own_loss: bool = False,
    broken: bool = False,
):
    """What replay rebuilds: the same model and Trainer, its update step as train_step.
    ``broken``: a train_step that raises KeyError, as one that asks a model given no labels
    for its loss does."""
    trainer = make_trainer(
        tempfile.mkdtemp(),
        seed=seed,
        max_steps=max_steps,
        accumulation=accumulation,
        own_loss=own_loss,
    )
    workload = trainer_workload(trainer)
    if broken:

        def train_step(batch):
            raise KeyError("loss")

        workload.train_step = train_step
    return workload
