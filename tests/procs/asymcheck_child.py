"""A training child for the asymcheck kill tests (run as a script, never imported by pytest).

Trains a small MLP deterministically, checkpointing every iteration with a
Checkpointer into ``--dir``, and can SIGKILL itself at a chosen point:

- ``forward:S``  inside the forward pass of the iteration after S optimizer steps
- ``backward:S`` inside the backward pass of that iteration
- ``drain:S``    inside the step pre-hook's drain, sealing version S
- ``commit:K``   inside the background commit after K commits succeeded
  (a CrashingLocalTier that dies with half a manifest written)

``--config`` picks the loop shape: ``plain`` (step, then scheduler), ``accum`` (gradient
accumulation), ``scaler`` (GradScaler, fp16 autocast: some steps are skipped), ``val`` (a
validation forward under no_grad and eval() between the step and the scheduler), ``rngbatch``
(the batch is drawn from the global RNG before the forward), ``loader`` (a data loader that
advances when a batch is fetched, passed as ``data=``), ``ema`` (an EMA of the weights, swapped
into the model for an evaluation inside ``ckpt.editing()``), ``emaraw`` (the same swap without
``editing()``: versions are dropped and reported) and ``edits`` (an ``nn.Embedding(max_norm=...)``
front, ``load_state_dict`` weight surgery and ``p.data.mul_`` at the head of the iteration); the
configurations users train in (issue 31): ``bf16`` (bf16 autocast), ``lora`` (a PEFT LoRA model on the MLP:
the base frozen, adapters with dropout), ``compiled`` (``torch.compile(backend="aot_eager")``, the
Checkpointer's hooks inside the compiled graph) and ``sloader`` (torchdata's ``StatefulDataLoader``,
shuffled by its own generator, in ``data=``: its ``state_dict`` and its generator go into each version).

Each finished iteration appends ``{"it", "loss"}`` (loss as a hex float) to
``OUT/losses.jsonl``; a run that ends writes its final state through
asymstore to ``OUT/final``. ``--no-ckpt`` trains without a Checkpointer (the
uninterrupted reference). Lines on stdout are JSON events.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from asymcheck import Checkpointer
from asymcheck.options import CommitOptions, PartitionOptions, RetentionOptions
from asymcheck.state.trainstate import TrainingState
from asymstore import AsymStore, LocalTier
from asymstore.testing import CrashingLocalTier


class DataPosition:
    """Iterations completed; advanced at the end of the loop body."""

    def __init__(self) -> None:
        self.iteration = 0

    def state_dict(self) -> dict[str, int]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.iteration = int(state["iteration"])


class Loader:
    """A data loader whose position advances when a batch is fetched (captured as ``data=``)."""

    def __init__(self) -> None:
        self.fetched = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(77 + self.fetched)
        self.fetched += 1
        x = torch.randn(16, 32, generator=g)
        return x, x.flip(1) * 0.5

    def state_dict(self) -> dict[str, int]:
        return {"fetched": self.fetched}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.fetched = int(state["fetched"])


class EMA:
    """An exponential moving average of the parameters (a stateful object, updated after each step)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.shadow = [p.detach().clone() for p in self.params]

    def update(self) -> None:
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params, strict=True):
                s.mul_(0.9).add_(p, alpha=0.1)

    def swap_eval(self, model: nn.Module, x: torch.Tensor) -> float:
        """Evaluate with the EMA weights (copied in under no_grad), then put the originals back."""
        with torch.no_grad():
            backup = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow, strict=True):
                p.copy_(s)
            model.eval()
            loss = float(model(x).square().mean())
            model.train()
            for p, b in zip(self.params, backup, strict=True):
                p.copy_(b)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": [s.clone() for s in self.shadow]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s, v in zip(self.shadow, state["shadow"], strict=True):
            s.copy_(v)


class Embedded(nn.Module):
    """An ``nn.Embedding(max_norm=...)`` (renormalises looked-up rows in place, in the forward) before the MLP."""

    def __init__(self, body: nn.Sequential) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32, max_norm=0.8)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 9).long().clamp(max=63)
        out: torch.Tensor = self.body(self.emb(ids).mean(1) + x)
        return out


class Adapted(nn.Module):
    """A frozen base MLP with an own-loop low-rank adapter (no PEFT) beside its middle Linear."""

    def __init__(self, body: nn.Sequential) -> None:
        super().__init__()
        self.body = body
        for p in body.parameters():
            p.requires_grad_(False)
        width = body[3].in_features
        self.down = nn.Parameter(torch.randn(4, width) * 0.05)
        self.up = nn.Parameter(torch.zeros(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body[2](self.body[1](self.body[0](x)))
        h = self.body[3](h) + h @ self.down.t() @ self.up.t()
        for layer in list(self.body)[4:]:
            h = layer(h)
        return h


FROZEN = ("frozen", "frozenedit")


def build(config: str) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(1234)
    random.seed(1234)  # unused by training, but part of the state compared
    np.random.seed(1234)
    width = 256 if config in FROZEN else 128  # the frozen base's middle weight: 256 KiB, known unchanged
    model: nn.Module = nn.Sequential(
        nn.Linear(32, width), nn.GELU(), nn.Dropout(0.2),
        nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(), nn.Dropout(0.2),
        nn.Linear(width, 32),
    )
    if config in FROZEN:
        model = Adapted(model)  # type: ignore[arg-type]
    if config == "edits":
        model = Embedded(model)
    if config == "lora":
        import peft

        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["0", "3", "7"])
        model = peft.get_peft_model(model, lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=2) if config == "scaler" else None
    return model, opt, sched, scaler


def batch(it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(it * 1000 + micro)
    x = torch.randn(16, 32, generator=g)
    return x, x.flip(1) * 0.5


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def save_final(out: Path, state: TrainingState, step: int) -> None:
    tensors, meta = state.capture_all()

    async def write() -> None:
        async with AsymStore([LocalTier(out / "final")], keep_last=None) as store:
            await store.put_many(step, tensors)
            await store.commit(step, meta)

    asyncio.run(write())


CONFIGS = ["plain", "accum", "scaler", "val", "rngbatch", "loader", "ema", "emaraw", "edits",
           "bf16", "lora", "compiled", "sloader", *FROZEN]


def stateful_loader() -> Any:
    """torchdata's StatefulDataLoader over 192 samples, shuffled by its own generator, 16 a batch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    g = torch.Generator().manual_seed(99)
    x = torch.randn(192, 32, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x.flip(1) * 0.5)
    return StatefulDataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))


def middle_of(model: nn.Module) -> nn.Module:
    """The MLP's second Linear, where the kill hooks go, whatever wraps the MLP."""
    body = model.body if isinstance(model, Embedded | Adapted) else model
    if not isinstance(body, nn.Sequential):  # a PEFT model: the Sequential under its LoRA wrappers
        body = next(m for m in body.modules() if isinstance(m, nn.Sequential))
    return body[3]


def head_edits(model: nn.Module, it: int) -> None:
    """Edits at the head of the iteration (a restart repeats them): surgery and a manual ``.data`` edit."""
    body = model.body if isinstance(model, Embedded) else model
    if it % 4 == 2:
        model.load_state_dict({k: v * 0.97 for k, v in model.state_dict().items()})
    body[3].weight.data.mul_(0.995)


def frozen_edits(middle: nn.Module, it: int) -> None:
    """An in-place write under no_grad (one element: only the version counter tells), then a ``p.data`` edit."""
    if it == 4:
        with torch.no_grad():
            middle.weight.view(-1)[1] += 0.5
    if it == 6:
        middle.weight.data.mul_(0.9)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=14)
    ap.add_argument("--config", choices=CONFIGS, default="plain")
    ap.add_argument("--kill", default="none")
    ap.add_argument("--no-ckpt", action="store_true")
    ap.add_argument("--iter-sleep", type=float, default=0.0, help="seconds to sleep per iteration")
    ap.add_argument("--own-sigterm", action="store_true",
                    help="install the program's own SIGTERM handler first (writes OUT/sigterm, exits 0)")
    args = ap.parse_args()
    if args.own_sigterm:
        def own(signum: int, frame: Any) -> None:
            (Path(args.out) / "sigterm").write_text("handled\n")
            raise SystemExit(0)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        signal.signal(signal.SIGTERM, own)

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind, _, at = args.kill.partition(":")
    kill_at = int(at) if at else -1
    accum = 3 if args.config == "accum" else 1

    model, opt, sched, scaler = build(args.config)
    pos = DataPosition()
    stateful: dict[str, Any] = {"sched": sched, "pos": pos}
    data: dict[str, Any] = {}
    if scaler is not None:
        stateful["scaler"] = scaler
    loader = Loader()
    if args.config == "loader":
        data["loader"] = loader
    sloader = stateful_loader() if args.config == "sloader" else None
    batches: Any = None
    if sloader is not None:  # it advances when a batch is drawn: data=, taken when the step returns
        data["sloader"] = sloader
    ema = EMA(model) if args.config in ("ema", "emaraw") else None
    if ema is not None:
        stateful["ema"] = ema
    micro_now = [0]

    trained: nn.Module = model
    if args.config == "compiled":
        trained = torch.compile(model, backend="aot_eager")  # type: ignore[assignment]

    if args.no_ckpt:
        ckpt = None
        step_of = [0]
        opt.register_step_post_hook(lambda o, a, k: step_of.__setitem__(0, step_of[0] + 1))
    else:
        tier = (CrashingLocalTier(args.dir, crash_at="manifest_half", after=kill_at) if kind == "commit"
                else LocalTier(args.dir))
        ckpt = Checkpointer(trained, opt, [tier], stateful=stateful, data=data,
                            retention=RetentionOptions(keep_last=3),
                            partitions=PartitionOptions(warmup=2, min_partition_bytes=16 << 10),
                            commits=CommitOptions(frozen="known" if args.config in FROZEN else "copy"))

    def steps_done() -> int:
        return ckpt.step if ckpt is not None else step_of[0]

    middle = middle_of(model)
    if kind == "forward":
        middle.register_forward_pre_hook(
            lambda m, a: die() if steps_done() == kill_at and micro_now[0] == accum - 1 else None)
    if kind == "backward":
        middle.register_full_backward_pre_hook(
            lambda m, g: die() if steps_done() == kill_at and micro_now[0] == accum - 1 else None)
    if kind == "drain":
        from asymcheck.snapshot import copyengine

        original = copyengine.CopyEngine.wait

        def wait(self: copyengine.CopyEngine) -> Any:
            if steps_done() == kill_at:
                die()
            return original(self)

        copyengine.CopyEngine.wait = wait  # type: ignore[method-assign]

    resumed = ckpt.resume() if ckpt is not None else None
    emit(event="resumed", step=resumed, iteration=pos.iteration)
    started = time.perf_counter()
    with open(out / "losses.jsonl", "a") as losses:
        while pos.iteration < args.iterations:
            it = pos.iteration
            total = 0.0
            if args.config == "edits":
                head_edits(model, it)
            if args.config == "frozenedit":  # edits of the frozen base between steps
                frozen_edits(middle, it)
            for micro in range(accum):
                micro_now[0] = micro
                if args.config == "rngbatch":  # drawn from the global RNG before the forward
                    x = torch.randn(16, 32)
                    y = x.flip(1) * 0.5
                elif args.config == "loader":
                    x, y = loader.next()
                elif sloader is not None:
                    if batches is None:
                        batches = iter(sloader)
                    fetched = next(batches, None)
                    if fetched is None:  # an epoch ended: the next one, shuffled anew by the loader's generator
                        batches = iter(sloader)
                        fetched = next(batches)
                    x, y = fetched
                else:
                    x, y = batch(it, micro)
                if scaler is not None:
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = nn.functional.mse_loss(model(x).float(), y) / accum
                    scaler.scale(loss).backward()
                elif args.config == "bf16":
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = nn.functional.mse_loss(model(x).float(), y) / accum
                    loss.backward()
                else:
                    loss = nn.functional.mse_loss(trained(x), y) / accum
                    loss.backward()
                total += loss.item()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            extra = 0.0
            if args.config == "val":  # validation between the step and the scheduler
                model.eval()
                with torch.no_grad():
                    extra = float(nn.functional.mse_loss(model(batch(it, 99)[0]), batch(it, 99)[1]))
                model.train()
            if ema is not None:
                ema.update()
                guard = ckpt.editing() if ckpt is not None and args.config == "ema" else contextlib.nullcontext()
                with guard:
                    extra = ema.swap_eval(model, batch(it, 98)[0])
            sched.step()
            opt.zero_grad(set_to_none=True)
            record = {"it": it, "loss": float(total).hex(), "extra": float(extra).hex(), "step": steps_done(),
                      "dropped": ckpt.versions_dropped if ckpt is not None else 0}
            losses.write(json.dumps(record) + "\n")
            losses.flush()
            pos.iteration += 1
            if args.iter_sleep:
                time.sleep(args.iter_sleep)
    train_seconds = time.perf_counter() - started
    if ckpt is not None:
        ckpt.close()
        stats = ckpt.stats()
        emit(event="stats", skipped=stats.versions_skipped, committed=stats.versions_committed,
             dropped=stats.versions_dropped, copy_bytes=stats.copy_bytes)
    save_final(out, TrainingState(model, opt, stateful, data), steps_done())
    emit(event="done", step=steps_done(), iterations=pos.iteration, train_seconds=train_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
