"""A training child of the Lightning tests with the README's two lines and nothing else (never imported by pytest).

``python -m tests.procs.lightning_plain --out OUT [--dir CKPT] [--kill S] [--generator]``

A stock-style LightningModule, as Lightning's own transformer example has it: the demo
``lightning.pytorch.demos.Transformer`` (small, dropout on) on synthetic tokens, SGD, and a plain
``DataLoader(dataset, batch_size=4, shuffle=True)`` returned by ``train_dataloader()`` (shuffled by
the global RNG; no ``ResumableLoader``). 3 epochs of 6 batches. With ``--dir`` it runs under
``callbacks=[AsymCheckCallback(CKPT)]``; without it, it is the uninterrupted reference.
``--kill S``: inside the ``training_step`` after S optimizer steps, wait until every sealed version
is committed (so the resume starts at step S - 1), then SIGKILL. ``--generator``: the loader shuffles with a
generator of its own (``DataLoader(..., generator=torch.Generator().manual_seed(11))``), each epoch's order
drawn from it where the epoch before left it.

Writes ``OUT/losses.jsonl`` (``{"key": "epoch:batch", "loss": hex float}`` per batch),
``OUT/restored.json`` (the step the fit resumed from, or null) and, when it finishes,
``OUT/final.pt`` (the parameters, global step and epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos import Transformer

from asymcheck.lightning import AsymCheckCallback

VOCAB = 64
SAMPLES = 24  # 6 batches of 4 per epoch
EPOCHS = 3


class Tokens(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (SAMPLES, 9), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


class Model(pl.LightningModule):
    def __init__(self, out: Path, kill: int | None) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.2)
        self.out = out
        self.kill = kill
        self.generator = False  # the loader shuffles with a generator of its own (--generator)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.kill is not None and self.global_step == self.kill:
            for callback in self.trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(callback, AsymCheckCallback) and callback.checkpointer is not None:
                    callback.checkpointer.flush()  # the version of step kill - 1 is durable
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, target = batch
        output = self.model(inputs, target)
        loss = torch.nn.functional.nll_loss(output, target.reshape(-1))
        with (self.out / "losses.jsonl").open("a") as f:
            f.write(json.dumps({"key": f"{self.current_epoch}:{batch_idx}", "loss": float(loss.detach()).hex()}) + "\n")
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        generator = torch.Generator().manual_seed(11) if self.generator else None
        return torch.utils.data.DataLoader(Tokens(), batch_size=4, shuffle=True, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir")
    parser.add_argument("--kill", type=int)
    parser.add_argument("--generator", action="store_true", help="the loader shuffles with a generator of its own")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    module = Model(out, args.kill)
    module.generator = args.generator
    callbacks: list[pl.Callback] = []
    if args.dir:
        callbacks.append(AsymCheckCallback(args.dir))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module)
    restored = callbacks[0].restored if callbacks else None  # type: ignore[attr-defined]
    (out / "restored.json").write_text(json.dumps(restored.step if restored is not None else None))
    final = {f"model/{k}": v.detach().clone() for k, v in module.state_dict().items()}
    final["global_step"] = torch.tensor(trainer.global_step)
    final["epoch"] = torch.tensor(trainer.current_epoch)
    torch.save(final, out / "final.pt")


if __name__ == "__main__":
    main()
