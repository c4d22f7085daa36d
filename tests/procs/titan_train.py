"""A training child of the TorchTitan tests (run as a script; never imported by pytest).

``python -m tests.procs.titan_train --out OUT [--dir DUMP] [--steps N] [--kill S] [--hf] [--exclude NAME]``

TorchTitan's own training entry point needs CUDA and triton, so this child drives the manager the way
``torchtitan.trainer.Trainer.train`` does, with TorchTitan's own state objects on the CPU: the model parts
go into ``OptimizersContainer`` (built from ``default_adamw``, TorchTitan's AdamW config) and
``LRSchedulersContainer`` (warmup, then linear decay); the batches come from TorchTitan's
``HuggingFaceTextDataLoader`` (``--assets``: tests/support/titan_assets.py's tokenizer and dataset, through
TorchTitan's tokenizer) or a ``ParallelAwareDataloader`` (torchdata's ``StatefulDataLoader``) over a stateful
token stream; ``train_state`` is the trainer's own
``{"step", "ntokens_seen"}``. The manager is built as the trainer builds it (``config.checkpoint.build(...)``
with ``AsymCheckManager.Config``); each step runs the trainer's order: ``step += 1``, ``zero_grad``, the
micro-batches' forward and backward, ``clip_grad_norm_``, ``maybe_wait_for_staging()``,
``optimizers.step()``, ``lr_schedulers.step()``, ``save(step, last_step=...)``; ``load()`` first,
``close()`` last. The model (embedding, two blocks with dropout, a head) draws from the global RNG.

Without ``--dir`` the manager is disabled (``enable=False``): the uninterrupted reference. ``--kill S``:
SIGKILL inside the first forward after S optimizer steps. ``--fsdp``: FSDP2 (``fully_shard`` on each block
and the root) over the ranks of the environment (``RANK``, ``WORLD_SIZE``..., gloo), the loader split by
rank; ``--dump-resumed``: the whole state right after ``load()`` into ``OUT/resumed.*``. ``--hf``:
``last_save_in_hf=True`` with a state-dict adapter that renames to Hugging Face's names and ``export_dtype="bfloat16"``.

Writes ``OUT/losses.jsonl`` (``{"step", "loss": hex}`` per step), ``OUT/events.jsonl`` and, when it
finishes, ``OUT/final.safetensors`` + ``OUT/final.json``: the model, the optimizer's state, its param
groups, the scheduler, the train state and the RNG state.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.support.titan_parts import ACCUM, BATCH, SEQ, TinyLM, TokenStream, TrainState, hf_adapter


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill", type=int, default=-1)
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--exclude", action="append", default=[])
    ap.add_argument("--assets", default=None, help="titan_assets' directory: TorchTitan's HuggingFaceTextDataLoader")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) over WORLD_SIZE ranks, gloo")
    ap.add_argument("--dump-resumed", action="store_true", help="write the state right after load() (resumed.*)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"-rank{os.environ['RANK']}" if args.fsdp else ""
    events = open(out / f"events{suffix}.jsonl", "a")
    losses = open(out / f"losses{suffix}.jsonl", "a")

    def event(**fields: Any) -> None:
        events.write(json.dumps({**fields, "t": round(time.time() - started, 2)}) + "\n")
        events.flush()

    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from asymcheck.torchtitan import AsymCheckManager

    rank, world = 0, 1
    if args.fsdp:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    model = TinyLM()
    if args.fsdp:  # TorchTitan's FSDP2: each block, then the root
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    model_parts: list[nn.Module] = [model]
    optimizers = default_adamw(lr=3e-3).build(model_parts=model_parts)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                 min_lr_factor=0.0).build(optimizers=optimizers,
                                                                          training_steps=args.steps)
    if args.assets is None:
        dataloader = ParallelAwareDataloader(TokenStream(), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    else:  # TorchTitan's own text loader over a Hugging Face dataset, tokenized by TorchTitan's tokenizer
        from torchtitan.components.tokenizer import HuggingFaceTokenizer
        from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

        tokenizer = HuggingFaceTokenizer.Config().build(tokenizer_path=os.path.join(args.assets, "tokenizer"))
        dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=os.path.join(args.assets, "c4")
                                                      ).build(dp_world_size=world, dp_rank=rank, tokenizer=tokenizer,
                                                              seq_len=SEQ, local_batch_size=BATCH)
    train_state = TrainState()
    config = AsymCheckManager.Config(enable=args.dir is not None, interval=1, folder="ckpt", keep_latest_k=3,
                                     last_save_in_hf=args.hf, export_dtype="bfloat16" if args.hf else "float32",
                                     exclude_from_loading=list(args.exclude))
    checkpointer = config.build(dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=hf_adapter() if args.hf else None, base_folder=args.dir or "")
    checkpointer.load(step=config.load_step)
    event(event="resumed", step=train_state.step, ntokens_seen=train_state.ntokens_seen)
    if args.dump_resumed:
        save_final(out, model, optimizers, lr_schedulers, train_state, name="resumed", write=rank == 0)

    def forward_pre(module: nn.Module, inputs: Any) -> None:
        if train_state.step == args.kill + 1:
            os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(forward_pre)
    data_iterator = iter(dataloader)
    while train_state.step < args.steps:
        train_state.step += 1
        optimizers.zero_grad()
        total = torch.zeros(())
        for _ in range(ACCUM):
            input_dict, labels = next(data_iterator)
            train_state.ntokens_seen += labels.numel()
            pred = model(input_dict["input"])
            loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten()) / ACCUM
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_([p for m in model_parts for p in m.parameters()], 1.0, foreach=True)
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        losses.write(json.dumps({"step": train_state.step, "loss": float(total).hex()}) + "\n")
        losses.flush()
        checkpointer.save(train_state.step, last_step=train_state.step == args.steps)
    checkpointer.close()
    if args.dir is not None:
        stats = checkpointer.checkpointer.stats()
        event(event="stats", committed=stats.versions_committed, dropped=stats.versions_dropped,
              versions=checkpointer.checkpointer.final_versions)
    save_final(out, model, optimizers, lr_schedulers, train_state, write=rank == 0)
    event(event="done")
    return 0


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor's full tensor: a collective every rank runs)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def save_final(out: Path, model: nn.Module, optimizers: Any, lr_schedulers: Any, train_state: TrainState,
               name: str = "final", write: bool = True) -> None:
    """Write the whole state as ``OUT/NAME.safetensors`` and ``.json`` (every rank gathers; ``write`` writes)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {f"model/{k}": full(v) for k, v in model.state_dict().items()}
    [optimizer] = optimizers.optimizers
    sd = optimizer.state_dict()
    for index, state in sd["state"].items():
        for key, value in state.items():
            tensors[f"optim/{index}/{key}"] = full(value).reshape(-1)
    tensors["rng"] = torch.get_rng_state()
    if not write:
        return
    save_file(tensors, str(out / f"{name}.safetensors"))
    groups = [{k: (v.hex() if isinstance(v, float) else v) for k, v in g.items() if k not in ("params", "param_names")}
              for g in sd["param_groups"]]
    (out / f"{name}.json").write_text(json.dumps({"param_groups": groups, "lr_scheduler": lr_schedulers.state_dict(),
                                                "train_state": train_state.state_dict()}, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
