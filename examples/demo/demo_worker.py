"""The training child of ``python examples/demo/run.py``: a small GPT-2 on synthetic tokens.

Run by the demo's parent as ``python examples/demo/run.py --worker ...``. Every
finished optimizer step prints one JSON line (step, loss as a hex float,
iteration time, stall) and appends it to ``OUT/losses.jsonl``; a run that
ends writes its final state through asymstore to ``OUT/final`` and its
statistics to ``OUT/stats.json``. With ``--role reference`` it trains without
a Checkpointer: the uninterrupted run the others are compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from asymcheck.checkpointer import Checkpointer
from asymcheck.options import RetentionOptions
from asymcheck.state.trainstate import TrainingState
from asymstore import AsymStore, LocalTier, Tier, host_tier

logger = logging.getLogger(__name__)

VOCAB = 2048
SEQ = 128
BATCH = 8


def shm_path(ckpt_dir: str) -> str:
    """The /dev/shm directory of the ``shm`` tier for a checkpoint directory."""
    return f"/dev/shm/asymcheck-demo-{os.getuid()}-{zlib.crc32(os.path.abspath(ckpt_dir).encode()):08x}"


def make_tiers(spec: str, ckpt_dir: str) -> list[Tier]:
    """Build the tiers named in ``spec`` (``local``, ``host``, ``shm``), fastest first."""
    tiers: list[Tier] = []
    for name in spec.split(","):
        name = name.strip()
        if name == "host":
            tiers.append(host_tier(capacity_bytes=1 << 30))
        elif name == "shm":
            tiers.append(host_tier(capacity_bytes=1 << 30, path=shm_path(ckpt_dir)))
        elif name == "local":
            tiers.append(LocalTier(ckpt_dir))
        else:
            raise SystemExit(f"unknown tier {name!r}: use local, host or shm")
    return tiers


def make_model(seed: int) -> torch.nn.Module:
    """A 2-layer GPT-2 from a config (no download), initialised from ``seed``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=0)
    model: torch.nn.Module = GPT2LMHeadModel(config)
    model.train()  # dropout on: the RNG states are part of the checkpoint
    return model


def batch(seed: int, step: int) -> torch.Tensor:
    """Tokens of one step: a fixed random successor chain with 10% random jumps (learnable)."""
    table = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.empty(BATCH, SEQ, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    jumps = torch.rand(BATCH, SEQ, generator=g) < 0.1
    noise = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    for i in range(1, SEQ):
        tokens[:, i] = torch.where(jumps[:, i], noise[:, i], table[tokens[:, i - 1]])
    return tokens


def save_final(out: Path, state: TrainingState, step: int) -> None:
    """Write the whole state of ``step`` through asymstore into ``out/final``."""
    tensors, meta = state.capture_all()

    async def write() -> None:
        async with AsymStore([LocalTier(out / "final")], keep_last=None) as store:
            await store.put_many(step, tensors)
            await store.commit(step, meta)

    asyncio.run(write())


def emit(**event: Any) -> None:
    """Print one JSON line for the parent."""
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Train; see the module docstring."""
    ap = argparse.ArgumentParser(prog="python examples/demo/run.py --worker")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--role", choices=["reference", "train"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="demo-out/ckpt")
    ap.add_argument("--tiers", default="local")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.device == "cuda":
        # cuBLAS is deterministic only with a fixed workspace; set before CUDA starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    try:
        import numpy as np

        np.random.seed(args.seed)
    except ImportError:
        pass
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(args.seed).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * 0.98 ** s)
    stateful: dict[str, Any] = {"sched": sched}
    ckpt = (Checkpointer(model, opt, make_tiers(args.tiers, args.dir), stateful=stateful,
                         retention=RetentionOptions(keep_last=3))
            if args.role == "train" else None)
    start = 0
    if ckpt is not None:
        resumed = ckpt.resume()
        start = resumed or 0
        restored = ckpt.restored
        emit(event="resumed", step=resumed, tier=restored.tier if restored else None,
             fallbacks=list(restored.fallbacks) if restored else [])
    with open(out / "losses.jsonl", "a") as losses:
        for step in range(start, args.steps):
            began = time.perf_counter()
            tokens = batch(args.seed, step).to(args.device)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()
            record = {"step": step + 1, "loss": value.hex(), "iter_s": time.perf_counter() - began}
            last = ckpt.last_record if ckpt is not None else None
            if last is not None:
                record["stall_s"] = last.stall_s
                record["overhead_s"] = last.overhead_s
            losses.write(json.dumps(record) + "\n")
            losses.flush()
            emit(event="step", **record)
    if ckpt is not None:
        ckpt.close()
        summary = ckpt.stats().summary()
        summary["versions"] = ckpt.final_versions
        summary["plan"] = ckpt.plan.to_dict() if ckpt.plan else None
        (out / "stats.json").write_text(json.dumps(summary, indent=1))
    save_final(out, TrainingState(model, opt, stateful), args.steps)
    emit(event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
