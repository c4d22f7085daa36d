"""A training child of the Accelerate tests (run as a script, one per process; never imported by pytest).

``python -m tests.procs.accel_train --mode MODE --out OUT [--dir CKPT] [--kill S [--durable]] [--no-ckpt] [--raw]``

Trains a small GPT-2 (``GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32)``,
dropout on) on synthetic tokens through Accelerate, in the loop shape of Hugging Face's
``run_clm_no_trainer.py``: epochs over a shuffled, prepared data loader, ``accelerator.accumulate()``,
``accelerator.backward``, ``optimizer.step()``, ``lr_scheduler.step()``, ``optimizer.zero_grad()``,
and a validation pass (eval(), no_grad) after each epoch. With a checkpoint root (``--dir``) it
runs under ``asymcheck.accelerate.attach`` (a version every optimizer step) and iterates
``ckpt.loader``; ``--no-ckpt`` is the uninterrupted reference, iterating the loader itself.

``--mode``: ``single`` (one process), ``ddp`` (``RANK``, ``WORLD_SIZE``... in the environment, CPU
and gloo), ``ds`` (the DeepSpeed plugin, ZeRO stage ``--stage``, DeepSpeed's CPU accelerator, gloo).
``--accum``: micro-steps per optimizer step. ``--kill S``: SIGKILL inside the forward of the first
micro-batch after S optimizer steps (every process of the job does); with ``--durable`` instead right after
the S-th optimizer step, once ``ckpt.preempt()`` made that step's version durable (the newest: the resume
starts exactly there, an epoch's end for instance). ``--raw``: iterate the loader
itself while attached; the first optimizer step must raise ``DataPositionError`` (an event).
``--precision``: ``no``; ``bf16`` (``Accelerator(mixed_precision="bf16")``: autocast on the CPU);
``fp16`` (``Accelerator(mixed_precision="fp16")`` on CUDA: Accelerate's ``GradScaler``); ``fp16-cpu``
(the same scaler path on the CPU: Accelerate makes its fp16 scaler on GPUs only, and on the CPU
trains fp16 in fp32 without one, so this test-only shim gives the ``Accelerator`` a
``torch.amp.GradScaler("cpu")`` before ``prepare``, the object Accelerate itself would put there; the
reference run has it too). Under ``fp16``/``fp16-cpu`` the loss of a few fixed micro-batches is made
infinite (``OVERFLOW``, in every run) so that the scaler skips their optimizer steps and backs off, and
the loop counts only the steps that ran (``optimizer.step_was_skipped``).
``--compile BACKEND``: ``prepare`` compiles the model (``TorchDynamoPlugin(backend=BACKEND)``); the kill
hook is wrapped in ``torch.compiler.disable`` so that it runs, never traced, and the run records how
many graphs Dynamo captured (event ``compiled``). ``--peft``: LoRA adapters (``peft``, ``r=4`` on
``c_attn``, dropout on) around the model, its base frozen; the optimizer holds only the adapters.
``--loader stateful``:
``DataLoaderConfiguration(use_stateful_dataloader=True)`` (torchdata's ``StatefulDataLoader``); the
evaluation loader is then given to ``attach`` too and iterated through its ``ResumableLoader`` (every
stateful loader draws from the global RNG at each pass but its first: a version must say whether it
had one).

The tests start it through tests/procs/accel_zygote.py (a fork server), which calls :func:`main`.

Writes ``OUT/losses-rankR.jsonl`` (``{"key": "epoch:batch", "loss": hex float}`` per micro-batch,
validation losses under ``"val:epoch"``), ``OUT/events-rankR.jsonl``, and, when it finishes, the final
state (model, optimizer, scheduler, RNG states, ``accelerator.step``, the loader's epoch) through
asymstore to ``OUT/final-rankR``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

EPOCHS = 3
SAMPLES = 44  # 11 batches of 4 per epoch in one process (odd: the last optimizer step of an epoch under
BATCH = 4  # accumulate(2) has one micro-batch), 6 per process under 2 (the last one padded)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 256, (SAMPLES, 32), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def save_final(path: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    from asymstore import AsymStore, LocalTier

    async def write() -> None:
        async with AsymStore([LocalTier(path)], keep_last=None, compression="never") as s:
            await s.put_many(step, tensors)
            await s.commit(step, meta)

    asyncio.run(write())


OVERFLOW = {"0:3", "1:2", "1:5", "2:7"}  # epoch:batch whose loss is made inf under fp16 (the scaler skips the step)


def make_accelerator(mode: str, accum: int, stage: int, precision: str = "no", compile: str = "no",
                     stateful: bool = False) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DeepSpeedPlugin, InitProcessGroupKwargs, TorchDynamoPlugin

    if mode == "ds":
        plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=accum, gradient_clipping=1.0)
        return Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=accum,
                           kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    if precision == "fp16":  # CUDA: Accelerate makes the GradScaler itself
        return Accelerator(mixed_precision="fp16", gradient_accumulation_steps=accum)
    dynamo = TorchDynamoPlugin(backend=compile) if compile != "no" else None
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum,
                              mixed_precision="bf16" if precision == "bf16" else "no", dynamo_plugin=dynamo,
                              dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    if precision == "fp16-cpu":  # test-only shim: the scaler Accelerate gives fp16 on a GPU, on the CPU
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    return accelerator


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["single", "ddp", "ds"], required=True)
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage under --mode ds")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--kill", type=int, default=-1)
    ap.add_argument("--durable", action="store_true",
                    help="--kill S: right after the S-th optimizer step, its version made durable (ckpt.preempt())")
    ap.add_argument("--no-ckpt", action="store_true")
    ap.add_argument("--raw", action="store_true", help="iterate the loader itself while attached (an error)")
    ap.add_argument("--precision", choices=["no", "bf16", "fp16", "fp16-cpu"], default="no")
    ap.add_argument("--compile", choices=["no", "aot_eager", "inductor"], default="no",
                    help="Accelerator(dynamo_plugin=TorchDynamoPlugin(backend=...)): prepare compiles the model")
    ap.add_argument("--peft", action="store_true", help="LoRA adapters (peft) on the attention, the base frozen")
    ap.add_argument("--loader", choices=["default", "stateful"], default="default",
                    help="stateful: DataLoaderConfiguration(use_stateful_dataloader=True), torchdata's loader")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "ds":
        os.environ.update(ACCELERATE_USE_DEEPSPEED="true", DS_ACCELERATOR="cpu")

    from accelerate.utils import set_seed
    from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

    accelerator = make_accelerator(args.mode, args.accum, args.stage, args.precision, args.compile,
                                   args.loader == "stateful")
    overflow = OVERFLOW if args.precision.startswith("fp16") else set()
    rank = accelerator.process_index
    losses = open(out / f"losses-rank{rank}.jsonl", "a")
    events = open(out / f"events-rank{rank}.jsonl", "a")

    def event(**fields: Any) -> None:
        events.write(json.dumps({**fields, "t": round(time.time() - started, 2)}) + "\n")
        events.flush()

    set_seed(1234)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    if args.peft:  # the optimizer then steps only the adapters
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"],
                                                 fan_in_fan_out=True))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH, shuffle=True)
    eval_loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH)
    per_process = -(-len(loader) // accelerator.num_processes)  # batches per epoch and process
    steps_per_epoch = -(-per_process // args.accum)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=2,
                              num_training_steps=EPOCHS * steps_per_epoch * accelerator.num_processes)
    event(event="accelerator")
    model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, loader, eval_loader, scheduler)
    event(event="prepared")

    ckpt = None
    batches: Any = loader
    eval_batches: Any = eval_loader
    completed = 0
    start_epoch = 0
    if not args.no_ckpt:
        import asymcheck.accelerate
        from asymcheck.options import PartitionOptions, RetentionOptions

        # a StatefulDataLoader draws from the global RNG at the start of every pass but the first after prepare:
        # the eval loader's position (has it had a pass?) must be in the versions too (docs/guides/accelerate.md)
        data: Any = {"loader": loader, "eval": eval_loader} if args.loader == "stateful" else loader
        ckpt = asymcheck.accelerate.attach(accelerator, model, optimizer, args.dir, scheduler=scheduler,
                                           data=data, retention=RetentionOptions(keep_last=3),
                                           partitions=PartitionOptions(warmup=1, min_partition_bytes=4096))
        completed = ckpt.resume() or 0
        batches = loader if args.raw else ckpt.loaders["loader"]
        if args.loader == "stateful":
            eval_batches = ckpt.loaders["eval"]
        start_epoch = ckpt.loaders["loader"].epoch
        event(event="resumed", step=completed, epoch=start_epoch, batches=ckpt.loaders["loader"].batches,
              loader=type(loader.base_dataloader).__name__, model=type(accelerator.unwrap_model(model)).__name__,
              trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
              parameters=sum(p.numel() for p in model.parameters()))

    module = accelerator.unwrap_model(model) if args.mode != "ds" else model.module
    state = {"completed": completed}
    if args.kill >= 0 and not args.durable:
        module.transformer.h[1].register_forward_pre_hook(torch.compiler.disable(  # run, never traced (compile)
            lambda m, a: die() if state["completed"] == args.kill and m.training else None))

    if args.raw:  # the position of a loader iterated around ckpt.loader is unknown: the first version refuses
        from asymcheck.errors import DataPositionError

        try:
            for batch in loader:
                accelerator.backward(model(**batch).loss)
                optimizer.step()
        except DataPositionError as exc:
            event(event="refused", error=type(exc).__name__, message=str(exc))
        return 0

    for epoch in range(start_epoch, EPOCHS):
        model.train()
        for i, batch in enumerate(batches):
            number = ckpt.loaders["loader"].batches if ckpt is not None else i + 1
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                if f"{epoch}:{number}" in overflow:
                    loss = loss * float("inf")  # the scaler finds inf gradients and skips this optimizer step
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.write(json.dumps({"key": f"{epoch}:{number}", "loss": loss.item().hex()}) + "\n")
            losses.flush()
            if accelerator.sync_gradients and not optimizer.step_was_skipped:
                completed += 1
                state["completed"] = completed
                if args.durable and completed == args.kill and ckpt is not None:
                    record = ckpt.preempt()  # this step's version durable and the newest: the resume starts here
                    event(event="preempted", step=completed, record=str(record))
                    die()
        model.eval()
        total = 0.0
        with torch.no_grad():
            for batch in eval_batches:
                total += model(**batch).loss.item()
        losses.write(json.dumps({"key": f"val:{epoch}", "loss": total.hex()}) + "\n")
        losses.flush()

    if ckpt is not None:
        ckpt.close()
        stats = ckpt.stats()
        event(event="stats", committed=stats.versions_committed, dropped=stats.versions_dropped,
              versions=ckpt.final_versions, partitioning=ckpt.checkpointer.partitioning,
              forward_bytes=sum(r.forward_bytes for r in stats.steps),
              backward_bytes=sum(r.backward_bytes for r in stats.steps))
    if args.compile != "no":  # the model ran compiled: Dynamo captured graphs of it
        from torch._dynamo.utils import counters

        event(event="compiled", graphs=int(counters["stats"]["unique_graphs"]),
              breaks=sum(counters["graph_break"].values()), wrapper=type(model).__name__)
    write_final(args.mode, accelerator, model, optimizer, scheduler, loader, out / f"final-rank{rank}", completed)
    event(event="done", completed=completed)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    event(event="exit")
    return 0


def write_final(mode: str, accelerator: Any, model: Any, optimizer: Any, scheduler: Any, loader: Any, path: Path,
                completed: int) -> None:
    extra = {"accelerator_step": int(accelerator.step), "epoch": int(loader.iteration), "completed": completed}
    stateful: dict[str, Any] = {"sched": scheduler}
    if accelerator.scaler is not None:
        stateful["scaler"] = accelerator.scaler
    if mode == "ds":
        from asymcheck.deepspeed import DeepSpeedState

        tensors, meta = DeepSpeedState(model).capture_all()
    else:
        from asymcheck.state.trainstate import TrainingState

        tensors, meta = TrainingState(accelerator.unwrap_model(model), optimizer.optimizer,
                                      stateful=stateful).capture_all()
    meta["final"] = extra
    save_final(path, completed, tensors, meta)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is written and closed: skip seconds of interpreter teardown (DeepSpeed, transformers)
