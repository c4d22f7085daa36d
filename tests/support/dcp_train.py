"""GPT-2 and FSDP2 training with ``torch.distributed.checkpoint`` through asymstore.dcp (tests/asymstore/dcp).

The GPT-2 is ``GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32)`` with its dropout
on (so the RNG state matters), trained on synthetic tokens that are a function of the step, with AdamW. The
state a DCP save holds is ``app_state``: the model and optimizer state dicts of
``torch.distributed.checkpoint.state_dict.get_state_dict``, the CPU RNG state, and the step (a Python int:
a value DCP's planner serializes itself).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.support.launch import proc_argv, proc_env

VOCAB, SEQ, BATCH = 256, 32, 4
WIDTH = 37  # the FSDP2 model: 37 rows on 2 ranks are pieces of 19 and 18, the last layer's [1, 37] leaves rank 1 empty


def gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.train()
    return model


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    ids = tokens(step)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def app_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "rng": torch.get_rng_state(), "step": step}


def apply_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"])


def digests(obj: Any, path: str = "") -> dict[str, str]:
    """Every leaf of a nested state: a tensor's dtype, shape and the hash of its bytes; anything else its repr."""
    out: dict[str, str] = {}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[path] = f"{t.dtype} {list(t.shape)} {hashlib.sha256(data).hexdigest()}"
    elif isinstance(obj, dict):
        for key in obj:
            out.update(digests(obj[key], f"{path}/{key}"))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(digests(value, f"{path}/{i}"))
    else:
        out[path] = repr(obj)
    return out


def full_digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Digests of the whole (unsharded) model and optimizer state, as torch's own full state dict API gives it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return digests({"model": msd, "optim": osd})


# -- the FSDP2 model of the resharding test ------------------------------------------


def small_model(*, shard: bool) -> nn.Module:
    """The resharding test's model; with ``shard`` every Linear and the root are ``fully_shard``-ed (FSDP2)."""
    torch.manual_seed(4321)
    model = nn.Sequential(nn.Linear(16, WIDTH), nn.LayerNorm(WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                          nn.Linear(WIDTH, 1))
    if shard:
        from torch.distributed.fsdp import fully_shard

        for i in (0, 3, 5):
            fully_shard(model[i])
        fully_shard(model)
    return model


def small_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(8, 16, generator=g)
    nn.functional.mse_loss(model(x), x[:, :1] * 0.5).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_ranks(world: int, *args: str, timeout: float = 240) -> list[str]:
    """Run ``python -m tests.procs.dcp_child ARGS`` on ``world`` gloo ranks; return each rank's log (asserting rc 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(proc_argv("dcp_child", *args),
                              env=proc_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    return logs


def fsck(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asymstore.fsck", str(root), *flags], capture_output=True, text=True,
                          env=proc_env(), timeout=120, check=False)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_json(path: Path, doc: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
