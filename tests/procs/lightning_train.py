"""A training child of the Lightning tests (run as a script, one per process; never imported by pytest).

``python -m tests.procs.lightning_train --out OUT [--dir CKPT] [--kill S] [--ddp]``

Fits a small GPT-2 (``GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32)``,
dropout on) on synthetic tokens with ``lightning.pytorch.Trainer`` on CPU: AdamW, a per-step LambdaLR
scheduler, a train loader shuffled by the global RNG (one process) or a shuffling ``DistributedSampler``
(``--ddp``: ``strategy="ddp"`` on 2 processes that the test starts with ``RANK``/``WORLD_SIZE``... in
the environment), wrapped in ``asymcheck.lightning.ResumableLoader``, and a validation pass per epoch.
With ``--dir`` it runs under ``asymcheck.lightning.AsymCheckCallback`` (a version every step, ``monitor="val_loss"``,
kept by in one process, recorded only under DDP); without it, it is the uninterrupted reference.
``--kill S``: SIGKILL inside the ``training_step`` after S optimizer steps, having written
``OUT/killed-rankR.json`` (``{"step": S, "signal": "SIGKILL"}``) just before.
``--fsdp2`` (with ``--ddp``): ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` on the 2
processes, ``configure_model`` applying ``fully_shard`` over ``device_mesh["data_parallel"]`` to each GPT-2 block and
the whole model (FSDP2, gloo on the CPU); the final state holds each rank's local shards.
``--tensor-parallel`` (with ``--fsdp2``): ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)``.
``--deepspeed``: ``DeepSpeedStrategy(stage=2)`` (ZeRO-2) on DeepSpeed's CPU accelerator through a test-only subclass
that steps around Lightning's two CUDA checks (see ``_CPUDeepSpeedStrategy``); one process, or 2 with ``--ddp``.
``--accum N``: ``accumulate_grad_batches=N``.
``--flush`` (with ``--kill``): right before the kill, wait until the callback's sealed versions are committed
(``checkpointer.flush()``), so the resume takes the version of the step before the kill whatever the machine's load.
``--sigterm``: SIGTERM instead of SIGKILL (the preemption flush commits the newest step, then
Lightning's handler ends the fit by its ``SIGTERMException``, exit status 0, no final state written).
``--precision P``: ``bf16-mixed`` (``Trainer(precision="bf16-mixed")``: autocast, no scaler) or ``16-mixed``:
fp16 autocast with a GradScaler. On CPU Lightning turns ``precision="16-mixed"`` into ``bf16-mixed``, so
the child passes the same plugin that flag builds on a GPU, ``MixedPrecision("16-mixed", "cpu",
scaler=torch.amp.GradScaler("cpu", ...))``, its scaler starting at 2**24 and growing every 4 finite steps,
so that the fit has steps the scaler skips (about one in five). ``--gpu``: on CUDA (``deterministic=True``),
``precision="16-mixed"`` as a user writes it.
``--compile BACKEND``: ``trainer.fit(torch.compile(module, backend=BACKEND))`` (Lightning unwraps ``_orig_mod`` and
compiles ``training_step`` and ``validation_step``); the kill and the loss records are ``torch.compiler.disable``d
helpers (run, never traced), and the child writes ``OUT/compiled-rankR.json`` (the graphs Dynamo captured, whether
the module Lightning fitted was compiled) and ``OUT/stats-rankR.json`` (the bytes the callback's hooks copied in
forward and backward, summed over the steps). ``--peft``: the GPT-2 wrapped by ``peft.get_peft_model`` (LoRA ``r=4``
on ``c_attn``, LoRA dropout), the base frozen, AdamW over the adapters only.

Writes ``OUT/losses-rankR.jsonl`` (``{"key": "epoch:batch", "loss": hex float}`` per batch, validation
losses under ``"val:epoch"``) and, when it finishes, ``OUT/final-rankR.pt`` (parameters, optimizer and
scheduler state, torch RNG, global step and epoch, the GradScaler's state, as tensors), and after a
resume ``OUT/resumed-rankR.json`` (``{"step": S}``, the version the callback loaded); ``OUT/config-rankR.json`` (the
strategy's class, the world size, the precision and the CPU autocast dtype in the first ``training_step``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from transformers import GPT2Config, GPT2LMHeadModel

from asymcheck.lightning import AsymCheckCallback, ResumableLoader
from asymcheck.options import PacingOptions

EPOCHS = 3
SAMPLES = 28  # 7 batches of 4 per epoch in one process, 4 per process under 2 (DistributedSampler pads)
BATCH = 4


class Tokens(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, 256, (n, 32), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


class Model(pl.LightningModule):
    def __init__(self, out: Path, kill: int | None) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32))
        self.out = out
        self.kill = kill
        self.ddp = False
        self.fsdp2 = False
        self.signal = signal.SIGKILL
        self.flush: AsymCheckCallback | None = None  # --flush: the callback whose sealed versions commit first

    def configure_model(self) -> None:
        """``--fsdp2``: FSDP2 over the data-parallel mesh, each GPT-2 block and the whole model (Lightning's recipe)."""
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def _log_loss(self, key: str, loss: torch.Tensor) -> None:
        with (self.out / f"losses-rank{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps({"key": key, "loss": float(loss).hex()}) + "\n")

    @torch.compiler.disable  # type: ignore[misc]  # run, never traced, under --compile
    def _before(self, batch_idx: int) -> None:
        if self.kill is not None and self.global_step == self.kill:
            if self.flush is not None and self.flush.checkpointer is not None:  # commit the sealed versions first
                self.flush.checkpointer.flush()
            marker = {"step": self.global_step, "signal": signal.Signals(self.signal).name}
            (self.out / f"killed-rank{self.global_rank}.json").write_text(json.dumps(marker))  # the kill came here
            os.kill(os.getpid(), self.signal)
        if batch_idx == 0 and self.current_epoch == 0:  # what really runs: the strategy, world size and autocast
            autocast = str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None
            ran = {"strategy": type(self.trainer.strategy).__name__, "world_size": self.trainer.world_size,
                   "precision": str(self.trainer.precision), "autocast": autocast}
            (self.out / f"config-rank{self.global_rank}.json").write_text(json.dumps(ran))

    @torch.compiler.disable  # type: ignore[misc]
    def _after(self, key: str, batch: torch.Tensor, loss: torch.Tensor, name: str) -> None:
        if name == "val_loss" and self.trainer.sanity_checking:
            return
        self._log_loss(key, loss)
        self.log(name, loss.detach(), sync_dist=self.ddp and name == "val_loss")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self._before(batch_idx)
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        self._after(f"{self.current_epoch}:{batch_idx}", batch, loss, "train_loss")
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self.model(input_ids=batch, labels=batch).loss
        self._after(f"val:{self.current_epoch}:{batch_idx}", batch, loss, "val_loss")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Any:
        data = Tokens(SAMPLES, 5)
        if self.ddp:
            sampler: torch.utils.data.DistributedSampler[torch.Tensor] = torch.utils.data.DistributedSampler(
                data, num_replicas=self.trainer.world_size, rank=self.global_rank, shuffle=True, seed=3)
            return ResumableLoader(torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler))
        return ResumableLoader(torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True))

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(Tokens(8, 9), batch_size=BATCH)


class _CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``--deepspeed``: ``DeepSpeedStrategy`` on DeepSpeed's CPU accelerator, through a test-only shim.

    Lightning 2.6 refuses DeepSpeed without CUDA twice: ``setup_environment`` checks for a
    ``CUDAAccelerator`` (skipped here: the parent's parent sets up the environment, as the strategy
    does after its check) and its device-index check wants ``parallel_devices`` indexed by local rank
    (given as ``cpu:0``, ``cpu:1``). Nothing else differs; the reference run uses the same class.
    """

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)


def _local(v: Any) -> torch.Tensor:
    """A tensor as this rank holds it (a DTensor's local shard under FSDP2)."""
    from torch.distributed.tensor import DTensor
    return (v.to_local() if isinstance(v, DTensor) else torch.as_tensor(v)).detach().clone()


def final_state(trainer: pl.Trainer, module: Model) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": _local(v) for k, v in module.state_dict().items()}
    optimizer = trainer.optimizers[0]
    if isinstance(trainer.strategy, DeepSpeedStrategy):  # ZeRO's torch optimizer over this rank's flat partitions
        optimizer = optimizer.optimizer
    opt = optimizer.state_dict()
    for i, st in opt["state"].items():
        for k, v in st.items():
            out[f"opt/{i}/{k}"] = _local(v)
    out["lr"] = torch.tensor([g["lr"] for g in opt["param_groups"]], dtype=torch.float64)
    out["sched/last_epoch"] = torch.tensor(trainer.lr_scheduler_configs[0].scheduler.last_epoch)
    return loop_state(trainer, out)


def loop_state(trainer: pl.Trainer, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``out`` with the RNG, the loop's position and the GradScaler's state (empty without one) added."""
    out["rng"] = torch.get_rng_state()
    out["global_step"] = torch.tensor(trainer.global_step)
    out["epoch"] = torch.tensor(trainer.current_epoch)
    for k, v in trainer.precision_plugin.state_dict().items():
        out[f"scaler/{k}"] = torch.tensor(v, dtype=torch.float64)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir")
    parser.add_argument("--kill", type=int)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--fsdp2", action="store_true")
    parser.add_argument("--tensor-parallel", action="store_true")
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--sigterm", action="store_true")
    parser.add_argument("--flush", action="store_true")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed", "16-mixed"], default="32-true")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--compile", choices=["aot_eager", "inductor"])
    parser.add_argument("--peft", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if args.gpu:  # deterministic=True: cuBLAS needs a fixed workspace for reproducible results
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    pl.seed_everything(0, verbose=False)
    module = Model(out, args.kill)
    module.ddp = args.ddp or args.fsdp2
    module.fsdp2 = args.fsdp2
    if args.sigterm:
        module.signal = signal.SIGTERM
    if args.peft:  # LoRA adapters on the attention, the base frozen (the optimizer steps the adapters only)
        from peft import LoraConfig, get_peft_model
        module.model = get_peft_model(module.model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                               target_modules=["c_attn"], fan_in_fan_out=True))
    callbacks: list[pl.Callback] = []
    ckpt = None
    if args.dir:
        ckpt = AsymCheckCallback(args.dir, keep_last=2, monitor="val_loss", save_top_k=1,
                                 pacing=PacingOptions(max_overhead=None))
        callbacks.append(ckpt)
        if args.flush:
            module.flush = ckpt
    precision: dict[str, Any] = {}
    if args.precision == "16-mixed" and not args.gpu:  # what precision="16-mixed" builds on a GPU, on the CPU
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=4)
        precision["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    elif args.precision != "32-true":
        precision["precision"] = args.precision
    strategy: Any = "ddp" if args.ddp else "auto"
    if args.fsdp2:  # FSDP2 through configure_model, on 2 processes (gloo on the CPU)
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if args.tensor_parallel:  # the default layout on one node: a data-parallel mesh of 1, tensor-parallel of 2
            strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    if args.deepspeed:  # ZeRO stage 2 on DeepSpeed's CPU accelerator (the shim above)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if "MASTER_PORT" not in os.environ:  # one process: DeepSpeed still starts a process group
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
        devices = [torch.device("cpu", i) for i in range(2 if args.ddp else 1)]
        strategy = _CPUDeepSpeedStrategy(stage=2, parallel_devices=devices)
    trainer = pl.Trainer(accelerator="gpu" if args.gpu else "cpu", devices=2 if args.ddp or args.fsdp2 else 1,
                         strategy=strategy, deterministic=args.gpu,
                         max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=1,
                         accumulate_grad_batches=args.accum, **precision)
    fitted: Any = module
    if args.compile:  # Lightning unwraps _orig_mod and compiles the module's steps
        fitted = torch.compile(module, backend=args.compile)
    trainer.fit(fitted)
    if args.compile:
        from torch._dynamo.utils import counters
        compiled = {"graphs": int(counters["stats"]["unique_graphs"]), "wrapper": type(fitted).__name__,
                    "unwrapped": type(trainer.lightning_module).__name__}
        (out / f"compiled-rank{trainer.global_rank}.json").write_text(json.dumps(compiled))
    if ckpt is not None:
        stats = ckpt.stats()
        if stats is not None:
            copied = {"forward_bytes": sum(r.forward_bytes for r in stats.steps),
                      "backward_bytes": sum(r.backward_bytes for r in stats.steps)}
            (out / f"stats-rank{trainer.global_rank}.json").write_text(json.dumps(copied))
    if ckpt is not None and ckpt.restored is not None:
        (out / f"resumed-rank{trainer.global_rank}.json").write_text(json.dumps({"step": ckpt.restored.step}))
    torch.save(final_state(trainer, module), out / f"final-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
