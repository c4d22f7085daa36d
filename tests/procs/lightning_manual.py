"""A training child of the Lightning manual-optimization tests (run as a script; never imported by pytest).

``python -m tests.procs.lightning_manual --out OUT [--dir CKPT] [--kill B] [--optimizers 1|2] [--ddp]``

Fits a LightningModule with ``automatic_optimization = False`` on CPU, one process, for 3 epochs of
7 batches (a plain ``DataLoader`` shuffled by the global RNG, positioned by the callback):

- ``--optimizers 1``: an MLP with dropout, one AdamW and a per-step LambdaLR stepped in
  ``training_step`` (``self.lr_schedulers().step()``);
- ``--optimizers 2``: a GAN-style module: a generator and a discriminator (dropout in both), noise
  drawn from the global RNG in ``training_step``, ``opt_d.step()`` every batch and ``opt_g.step()``
  every other batch (``n_critic=2``), so some ``training_step``\\ s step one optimizer, some both.

``--precision 16-mixed``: fp16 autocast with a GradScaler, through the plugin ``precision="16-mixed"``
builds on a GPU (``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", ...))``, started
at 2**24 so that it skips steps). ``--ddp``: ``strategy="ddp"`` (``find_unused_parameters=True`` with two
optimizers) on 2 processes that the test starts with ``RANK``/``WORLD_SIZE``... in the environment;
Lightning puts a shuffling ``DistributedSampler`` into the loader, each rank trains 4 batches of 4 per
epoch and writes its own files (``rankR``). With ``--dir`` it runs under
``asymcheck.lightning.AsymCheckCallback`` (a version every training
step); without it, it is the uninterrupted reference. ``--kill B``: SIGKILL inside the ``B``-th
``training_step`` (counted over epochs from 0; every rank), having written ``OUT/killed-rankR.json``
(``{"step": B, "signal": "SIGKILL"}``) just before. Writes ``OUT/losses-rankR.jsonl`` (``{"key": "epoch:batch",
"loss": hex float}``), when it finishes ``OUT/final-rankR.pt`` (parameters, every optimizer's state, the
scheduler, torch RNG, global step and epoch, as tensors), and after a resume ``OUT/resumed-rankR.json``.
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
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from asymcheck.lightning import AsymCheckCallback
from asymcheck.options import PacingOptions
from tests.procs.lightning_train import loop_state

EPOCHS = 3
BATCHES = 7
BATCH = 4


def mlp(i: int, o: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(i, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, o))


class Manual(pl.LightningModule):
    def __init__(self, out: Path, kill: int | None, optimizers: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.out = out
        self.kill = kill
        self.two = optimizers == 2
        self.g = mlp(8, 4)
        self.d = mlp(4, 1)

    def _log(self, key: str, loss: torch.Tensor) -> None:
        with (self.out / f"losses-rank{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps({"key": key, "loss": float(loss).hex()}) + "\n")

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batches = self.trainer.num_training_batches
        if self.kill is not None and self.current_epoch * batches + batch_idx == self.kill:
            marker = self.out / f"killed-rank{self.global_rank}.json"
            marker.write_text(json.dumps({"step": self.kill, "signal": "SIGKILL"}))
            os.kill(os.getpid(), signal.SIGKILL)
        real = batch[0]
        key = f"{self.current_epoch}:{batch_idx}"
        if not self.two:
            opt = self.optimizers()
            loss = (self.d(self.g(torch.randn(len(real), 8)) + real)).square().mean()
            opt.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            opt.step()  # type: ignore[union-attr]
            self.lr_schedulers().step()  # type: ignore[union-attr]
            self._log(key, loss)
            return
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        fake = self.g(torch.randn(len(real), 8))
        d_loss = bce(self.d(real), torch.ones(len(real), 1)) + bce(self.d(fake.detach()), torch.zeros(len(real), 1))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self._log(f"d:{key}", d_loss)
        if batch_idx % 2 == 0:  # n_critic = 2: the generator steps every other batch
            g_loss = bce(self.d(fake), torch.ones(len(real), 1))
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            self._log(f"g:{key}", g_loss)

    def configure_optimizers(self) -> Any:
        if not self.two:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
            return {"optimizer": opt, "lr_scheduler": sched}
        return [torch.optim.Adam(self.g.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                torch.optim.AdamW(self.d.parameters(), lr=1e-3)]

    def train_dataloader(self) -> Any:
        data = torch.randn(BATCHES * BATCH, 4, generator=torch.Generator().manual_seed(5)) * 0.5 + 1.0
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=BATCH, shuffle=True)


def final_state(trainer: pl.Trainer, module: Manual) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in module.state_dict().items()}
    for j, optimizer in enumerate(trainer.optimizers):
        sd = optimizer.state_dict()
        for i, st in sd["state"].items():
            for k, v in st.items():
                out[f"opt{j}/{i}/{k}"] = torch.as_tensor(v).clone()
        out[f"opt{j}/lr"] = torch.tensor([g["lr"] for g in sd["param_groups"]], dtype=torch.float64)
    for j, config in enumerate(trainer.lr_scheduler_configs):
        out[f"sched{j}/last_epoch"] = torch.tensor(config.scheduler.last_epoch)
    return loop_state(trainer, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir")
    parser.add_argument("--kill", type=int)
    parser.add_argument("--optimizers", type=int, choices=[1, 2], default=1)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--precision", choices=["32-true", "16-mixed"], default="32-true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    module = Manual(out, args.kill, args.optimizers)
    ckpt = None
    callbacks: list[pl.Callback] = []
    if args.dir:
        ckpt = AsymCheckCallback(args.dir, keep_last=2, pacing=PacingOptions(max_overhead=None))
        callbacks.append(ckpt)
    plugins: list[Any] = []
    if args.precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=4)
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    strategy: Any = "auto"
    if args.ddp:
        strategy = DDPStrategy(find_unused_parameters=args.optimizers == 2)
    trainer = pl.Trainer(accelerator="cpu", devices=2 if args.ddp else 1, strategy=strategy, max_epochs=EPOCHS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, plugins=plugins)
    trainer.fit(module)
    rank = trainer.global_rank
    torch.save(final_state(trainer, module), out / f"final-rank{rank}.pt")
    if ckpt is not None and ckpt.restored is not None:
        (out / f"resumed-rank{rank}.json").write_text(json.dumps({"step": ckpt.restored.step}))


if __name__ == "__main__":
    main()
