"""The files TorchTitan's debug model trains from, made locally: a tokenizer and a small c4-like text dataset.

TorchTitan's ``llama3_debugmodel`` reads ``tests/assets/tokenizer`` and ``tests/assets/c4_test`` of its own
repository, which the wheel does not ship. :func:`make_assets` writes a word-level tokenizer
(``tokenizer.json`` and ``tokenizer_config.json`` with ``<s>``/``</s>``; ids below the debug model's
vocabulary of 2048) and a ``data.json`` of lines ``{"text": ...}`` that ``datasets.load_dataset(dir,
split="train")`` reads; pass ``--hf_assets_path`` and ``--dataloader.dataset_path`` to TorchTitan.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = 500
DOCUMENTS = 400


def make_assets(root: Path) -> tuple[Path, Path]:
    """Write the tokenizer and the dataset under ``root``; return their directories."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = [f"w{i}" for i in range(WORDS)]
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                               "unk_token": "[UNK]"}))
    rng = random.Random(7)
    data_dir = root / "c4"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "data.json", "w") as f:
        for _ in range(DOCUMENTS):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))
            f.write(json.dumps({"text": text}) + "\n")
    return tok_dir, data_dir
