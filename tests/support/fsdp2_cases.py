"""What one rank does in an FSDP2 case of the multi-rank tests (kind ``"fsdp2"``; see tests/support/mr_cases.py).

The model (dimensions chosen so that the shards are uneven, and the last layer's shards on rank 1 empty) has
every Linear and the root sharded with ``fully_shard`` on gloo; the root owns the LayerNorm, so its parameters
are unsharded at the first forward hook. Case fields beyond those of tests/support/mr_cases.py:

- ``mp``: a ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``;
- ``raf``: ``reshard_after_forward`` (default True);
- ``accum``: micro-batches per step (gradients synced and resharded after the last one only);
- ``dump_resumed``: save the state as ``resume()`` left it to ``resumed-rankR`` (resharding tests);
- ``across``: the Checkpointer's ``across_layouts`` (default ``"resume"``);
- ``expect_error``: ``resume()`` must raise; its type and message go to the ``error`` event, and the case ends;
- ``edit``: after the step of this iteration, ``weight.mul_(1.0)`` on a DTensor parameter outside
  ``ckpt.editing()`` (its version must be dropped), and the same inside ``editing()`` one iteration later.

Modes: ``"ref"`` trains ``iterations`` without checkpoints; ``"attach"`` checkpoints every iteration into
``dir`` through a Checkpointer (a RankStore per rank, made from the directory) and resumes from what it holds;
``"ref_from"`` is the reference for a resharded resume: it loads the final state of the case named ``from``
(run on ``from_world`` ranks) through torch's own full-state-dict API (``set_model_state_dict`` /
``set_optimizer_state_dict``), with what each rank holds whole (scheduler, data position, RNG states) from its
rank ``rank % from_world`` (the rule ``resume()`` documents), then trains to ``iterations`` without checkpoints.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tests.support.mr_cases import TIMEOUT, DataPosition, Log, die, kill_spec, rank_tiers, save_final

WIDTH = 37  # 37 rows on 2 ranks: pieces of 19 and 18 rows


def make_model(case: dict[str, Any]) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(4321)
    random.seed(4321)  # every case starts from the same Python and NumPy RNG states (they are checkpointed)
    np.random.seed(4321)
    model = nn.Sequential(nn.Linear(16, WIDTH), nn.LayerNorm(WIDTH), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1))
    kw: dict[str, Any] = {"reshard_after_forward": case.get("raf", True)}
    if case.get("mp"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in (0, 4, 6):
        fully_shard(model[i], **kw)
    fully_shard(model, **kw)
    return model


def batch(it: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(it * 1000 + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :1] * 0.5


def edit(case: dict[str, Any], it: int, model: nn.Module, ckpt: Any) -> None:
    """An in-place edit between steps that changes no value but moves the DTensor's version counter."""
    at = case.get("edit")
    if at is None or ckpt is None:
        return
    if it == at:
        with torch.no_grad():
            model[0].weight.mul_(1.0)
    elif it == at + 1:
        with ckpt.editing(), torch.no_grad():
            model[0].weight.mul_(1.0)


def read_final(path: Path) -> Any:
    """The one version a ``save_final`` store at ``path`` holds (an ``asymstore.read.restore.Checkpoint``)."""
    from asymstore import AsymStore, LocalTier

    async def read() -> Any:
        async with AsymStore([LocalTier(path)], keep_last=None, read_only=True) as store:
            return await store.restore()

    return asyncio.run(read())


def global_tensors(pieces: list[Any]) -> dict[str, torch.Tensor]:
    """Every sharded tensor of one job's state put together from its ranks' pieces (``Checkpoint`` objects)."""
    from asymstore.format.pieces import read_layouts

    out: dict[str, torch.Tensor] = {}
    for ckpt in pieces:
        for name, lay in read_layouts(ckpt.manifest).items():
            if lay.mesh is None:
                continue
            whole = out.setdefault(name, torch.full(lay.global_shape, float("nan"), dtype=ckpt.tensors[name].dtype))
            whole[tuple(slice(o, o + n) for o, n in zip(lay.offsets, lay.shape, strict=True))] = ckpt.tensors[name]
    return out


def load_reference(case: dict[str, Any], rank: int, log: Log, model: nn.Module, opt: torch.optim.Optimizer,
                   stateful: dict[str, Any]) -> None:
    """Load another case's final state the way a user of plain PyTorch would (see ``"ref_from"`` above)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    from asymcheck.state import rng
    from asymcheck.state.encode import decode

    old = case["from_world"]
    pieces = [read_final(log.cdir.parent / case["from"] / f"final-rank{q}") for q in range(old)]
    own = pieces[rank % old]
    tensors = {**own.tensors, **global_tensors(pieces)}
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")},
                         options=full)
    fqns = [name for name, _ in model.named_parameters()]
    state = decode(own.meta["optimizer"]["state"], tensors)
    groups = decode(own.meta["optimizer"]["param_groups"], tensors)
    osd = {"state": {fqns[int(i)]: s for i, s in state.items()},
           "param_groups": [{**g, "params": [fqns[int(i)] for i in g["params"]]} for g in groups]}
    set_optimizer_state_dict(model, opt, osd, options=full)
    for name, obj in stateful.items():
        obj.load_state_dict(decode(own.meta["stateful"][name], own.tensors))
    rng.restore(own.meta["rng"], own.tensors)


def run_fsdp2(case: dict[str, Any], rank: int, log: Log) -> None:
    import torch.distributed as dist

    from asymcheck import Checkpointer
    from asymcheck.options import PartitionOptions
    from asymcheck.state.trainstate import TrainingState
    from asymstore.multirank import RankStore

    dist.init_process_group("gloo", timeout=TIMEOUT)
    n = case["iterations"]
    model = make_model(case)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    pos = DataPosition()
    stateful: dict[str, Any] = {"sched": sched, "pos": pos}
    ckpt = None
    if case["mode"] == "ref_from":
        load_reference(case, rank, log, model, opt, stateful)
    if case["mode"] == "attach":
        tiers = rank_tiers(case, rank)
        where: Any = case["dir"] if tiers is None and "timeout_s" not in case else RankStore(
            case["dir"], tiers=tiers, keep_last=3, timeout_s=case.get("timeout_s", 60.0))
        ckpt = Checkpointer(model, opt, where, stateful=stateful,
                            partitions=PartitionOptions(warmup=1, min_partition_bytes=512),
                            across_layouts=case.get("across", "resume"))
        assert isinstance(ckpt.store, RankStore) or (dist.get_world_size() == 1 and tiers is None)
        if case.get("expect_error"):  # resume() must raise the same typed error on every rank, and train nothing
            try:
                ckpt.resume()
            except Exception as exc:
                log.event(event="error", type=type(exc).__name__, message=str(exc))
                dist.barrier()  # rank 0 hosts the job's TCPStore: it stays until every rank has read the error
                ckpt.close()
                dist.destroy_process_group()
                return
            raise AssertionError("resume() did not raise")
        resumed = ckpt.resume()
        log.event(event="resumed", step=resumed, iteration=pos.iteration,
                  tier=ckpt.restored.tier if ckpt.restored else None)
        if case.get("dump_resumed"):  # the state as resume() left it, before any training
            tensors, meta = TrainingState(model, opt, stateful).capture_all()
            save_final(log.cdir / f"resumed-rank{rank}", pos.iteration, tensors, meta)
        kind, at = kill_spec(case, rank)
        if kind == "forward":
            model[4].register_forward_pre_hook(lambda m, a: die() if pos.iteration == at else None)
    accum = case.get("accum", 1)
    for it in range(pos.iteration, n):
        value = 0.0
        for micro in range(accum):  # gradient accumulation: no reduce-scatter, no reshard before the last
            if accum > 1:
                model.set_requires_gradient_sync(micro == accum - 1)  # type: ignore[operator]
                model.set_reshard_after_backward(micro == accum - 1)  # type: ignore[operator]
            x, y = batch(it * 10 + micro if accum > 1 else it, rank)
            loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            value += loss.item()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log.loss(it, value)
        pos.iteration += 1
        edit(case, it, model, ckpt)
    if ckpt is not None:
        ckpt.close()
        stats = ckpt.stats()
        log.event(event="stats", committed=stats.versions_committed, failed=stats.commits_failed,
                  dropped=stats.versions_dropped, eager=list(stats.eager_tensors),
                  plan=len(ckpt.plan.partitions) if ckpt.plan else 0)
    tensors, meta = TrainingState(model, opt, stateful).capture_all()
    save_final(log.cdir / f"final-rank{rank}", pos.iteration, tensors, meta)
    dist.destroy_process_group()
