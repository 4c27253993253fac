"""What the debug model's config expects under ``./tests/assets`` of a TorchTitan checkout
(which the wheel does not ship): a byte-level BPE tokenizer and the ``c4_test`` data set, made
from a fixed vocabulary."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the quick brown fox jumps over lazy dog silent data corruption gpu kernel replay tensor "
    "bit flip train step loss"
).split()


def write_assets(directory: Path) -> None:
    """``directory/tests/assets/{tokenizer,c4_test}`` as the debug model's config names them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    chooser = random.Random(0)
    texts = [" ".join(chooser.choice(WORDS) for _ in range(200)) for _ in range(64)]
    tokenizer_dir = directory / "tests" / "assets" / "tokenizer"
    data_dir = directory / "tests" / "assets" / "c4_test"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": special[0], "eos_token": special[1]})
    )
    (data_dir / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
