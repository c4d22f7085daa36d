"""The pieces of the TorchTitan tests' training (tests/procs/titan_train.py and the in-process tests).

A small language model (embedding, two blocks with dropout, a head: TorchTitan's names), a stateful token
stream for TorchTitan's ``ParallelAwareDataloader``, the trainer's ``train_state`` and a state-dict adapter
of TorchTitan's kind that renames to Hugging Face's names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, DIM, SEQ, BATCH, ACCUM = 512, 32, 16, 2, 2  # VOCAB covers titan_assets' tokenizer (503 ids)


class TokenStream(torch.utils.data.IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """An endless stream of token samples (each from its own seed); its position is its state."""

    def __init__(self) -> None:
        self.sample_idx = 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(1000 + self.sample_idx)
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            self.sample_idx += 1
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample_idx = state["sample_idx"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.w2(torch.nn.functional.gelu(self.w1(self.norm(x)))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # type: ignore[no-any-return]


class TrainState:
    """The trainer's own ``train_state`` (``Trainer.state_dict``/``load_state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.ntokens_seen = state["ntokens_seen"]


HF_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "norm.bias": "model.norm.bias", "output.weight": "lm_head.weight"}


def hf_adapter() -> Any:
    """A state-dict adapter of TorchTitan's kind (``StateDictAdapter``): TorchTitan names -> Hugging Face's."""
    from torchtitan.protocols.state_dict_adapter import StateDictAdapter

    class Adapter(StateDictAdapter):  # type: ignore[misc]
        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return {HF_NAMES.get(k, "model." + k): v for k, v in state_dict.items()}

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            back = {v: k for k, v in HF_NAMES.items()}
            return {back.get(k, k.removeprefix("model.")): v for k, v in hf_state_dict.items()}

    return Adapter(None, None)  # type: ignore[arg-type]
