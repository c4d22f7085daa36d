"""Child processes of tests/asymstore/dcp (``python -m tests.procs.dcp_child MODE ...``; never imported by pytest).

``train ROOT OUT STEPS [--reference] [--idiom] [--stager]``: trains the GPT-2 of tests/support/dcp_train.py to STEPS,
resuming with ``dcp.load`` from what ROOT holds, with a ``dcp.async_save`` of every step into ROOT through
``asymstore.dcp.StorageWriter`` (the previous save's future is waited for before the next, as TorchTitan
does). Without ``--idiom`` one writer saves every step and the resume reads through it; with ``--idiom``
it is DCP's own recipe: a new ``StorageWriter(ROOT)`` per save, ``checkpoint_id=f"checkpoint_step{step}"``
(the recipe's form), never closed, and the resume through a new ``StorageReader(ROOT)``. With ``--stager``
(one writer) every save stages through ``asymcheck.dcp.Stager(optimizer)``: the copy runs through the next
step's forward and backward, and the step's pre-hook waits for it.
``OUT/losses.jsonl`` gets each step's loss, ``OUT/progress.jsonl`` each step once its save is done,
``OUT/final.json`` the digests of the final state. With ``--reference`` the same process then trains a fresh
model for STEPS without any checkpoint and writes ``OUT/ref.json`` (losses and final digests).

``save ROOT STEP``: one ``dcp.save`` into ROOT through a new ``StorageWriter(ROOT)``; prints ``saved``, or
``failed:`` and the type names of the errors DCP's ``CheckpointException`` carries.

``reshard OUT`` (on 2 gloo ranks: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): an FSDP2 model trains 2 steps
and ``dcp.async_save``-s into ``OUT/root2`` (a RankStore per rank, from the directory); rank 0 writes the digests
of the whole state (torch's full state dict) to ``OUT/full2.json``. Then a fresh FSDP2 model loads ``OUT/root1``
(saved by one process) and rank 0 writes the whole state's digests to ``OUT/full1.json``. Between the two, the
ranks read ``root2`` back through the writer's own RankStore, and a save of two ranks into one list of tiers is
refused.

``ddp-stager OUT`` (on 2 gloo ranks): a small DDP model trains 4 steps with a ``dcp.async_save`` of every step into
``OUT/root`` (a RankStore per rank) staged by ``asymcheck.dcp.Stager``, on a gloo group of its own (DCP's upload
thread runs collectives while training runs DDP's); each rank then loads every step back and checks it against a
deep copy of its state taken right after that step, and rank 0 writes the last step's digests to ``OUT/last.json``.
``fsdp2-stager OUT``: the same with the FSDP2 model of ``reshard`` (DTensor state dicts: each rank stages its shards),
rank 0 writing the whole last state's digests (torch's full state dict) to ``OUT/last.json``.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from asymstore import LocalTier
from asymstore.dcp import StorageReader, StorageWriter
from asymstore.multirank import RankStore
from tests.support import dcp_train as t

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def append(path: Path, doc: dict[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(doc) + "\n")
        f.flush()


def train(root: str, out: Path, steps: int, reference: bool, idiom: bool = False, stager: bool = False) -> None:
    torch.set_num_threads(1)
    model = t.gpt2()
    opt = t.optimizer(model)
    if idiom:
        train_idiom(root, out, steps, model, opt)
    elif stager:
        train_stager(root, out, steps, model, opt)
    else:
        train_one_writer(root, out, steps, model, opt)
    t.write_json(out / "final.json", t.digests({"model": model.state_dict(), "optim": opt.state_dict()}))
    if reference:
        model = t.gpt2()
        opt = t.optimizer(model)
        losses = [t.train_step(model, opt, step).hex() for step in range(steps)]
        t.write_json(out / "ref.json", {"losses": losses, "final": t.digests({"model": model.state_dict(),
                                                                             "optim": opt.state_dict()})})


def resume(reader: StorageReader, out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load the newest version ``reader`` finds into the model and optimizer; the step to train next (0: none)."""
    if not reader.steps():
        return 0
    state = t.app_state(model, opt, -1)
    dcp.load(state, storage_reader=reader)
    t.apply_state(model, opt, state)
    assert reader.step == state["step"], (reader.step, state["step"])
    append(out / "progress.jsonl", {"resumed": state["step"], "fallbacks": reader.fallbacks})
    return int(state["step"]) + 1


def train_idiom(root: str, out: Path, steps: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """DCP's recipe: a new writer per save, never closed (the store they share closes at exit)."""
    reader = StorageReader(root)
    start = resume(reader, out, model, opt)
    reader.close()
    future = None
    for step in range(start, steps):
        loss = t.train_step(model, opt, step)
        append(out / "losses.jsonl", {"step": step, "loss": loss.hex()})
        state = t.app_state(model, opt, step)
        if future is not None:
            future.result()
            append(out / "progress.jsonl", {"saved": step - 1, "t": time.time()})
        future = dcp.async_save(state, storage_writer=StorageWriter(root, keep_last=2),
                                checkpoint_id=f"checkpoint_step{step}")
    if future is not None:
        future.result()
        append(out / "progress.jsonl", {"saved": steps - 1, "t": time.time()})


def train_one_writer(root: str, out: Path, steps: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with StorageWriter(root, keep_last=2) as writer:
        start = resume(StorageReader(writer), out, model, opt)
        future = None
        for step in range(start, steps):
            loss = t.train_step(model, opt, step)
            append(out / "losses.jsonl", {"step": step, "loss": loss.hex()})
            state = t.app_state(model, opt, step)
            if future is not None:
                future.result()
                append(out / "progress.jsonl", {"saved": step - 1, "t": time.time()})
            future = dcp.async_save(state, storage_writer=writer, checkpoint_id=str(step))
        if future is not None:
            future.result()
            append(out / "progress.jsonl", {"saved": steps - 1, "t": time.time()})


def train_stager(root: str, out: Path, steps: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One writer, every save staged by ``asymcheck.dcp.Stager``: ``async_save`` returns DCP's AsyncSaveResponse."""
    from asymcheck.dcp import Stager

    with StorageWriter(root, keep_last=2) as writer, Stager(opt) as stager:
        start = resume(StorageReader(writer), out, model, opt)
        response = None
        for step in range(start, steps):
            loss = t.train_step(model, opt, step)  # the step pre-hook waits for the previous copy
            append(out / "losses.jsonl", {"step": step, "loss": loss.hex()})
            state = t.app_state(model, opt, step)
            if response is not None:
                response.upload_completion.result()
                append(out / "progress.jsonl", {"saved": step - 1, "t": time.time()})
            response = dcp.async_save(state, storage_writer=writer, async_stager=stager, checkpoint_id=str(step))
            assert isinstance(response, AsyncSaveResponse)
        if response is not None:
            response.upload_completion.result()
            append(out / "progress.jsonl", {"saved": steps - 1, "t": time.time()})


def save_once(root: str, step: int) -> None:
    """One ``dcp.save`` of a small state at ``step`` through a new writer; prints ``saved`` or the typed failure."""
    try:
        dcp.save({"w": torch.full((3,), float(step))}, storage_writer=StorageWriter(root), checkpoint_id=step)
    except CheckpointException as exc:
        kinds = sorted({type(f[0] if isinstance(f, tuple) else f).__name__ for f in exc.failures.values()})
        print("failed:", ",".join(kinds), flush=True)
        return
    print("saved", flush=True)


def reshard(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = t.small_model(shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(2):
        t.small_step(model, opt, step, rank)
    with StorageWriter(out / "root2") as writer:
        state = t.app_state(model, opt, 0)
        future = dcp.async_save({"model": state["model"], "optim": state["optim"]}, storage_writer=writer)
        future.result()  # DCP's thread ran the save (collectives on the default gloo group meanwhile idle here)
        assert writer.last_step == 0 and isinstance(writer.store, RankStore)
        full = t.full_digests(model, opt)
        if rank == 0:
            t.write_json(out / "full2.json", full)
        # read back on the same 2 ranks through the writer's own RankStore (other ranks' shards: its peer tiers)
        again = t.small_model(shard=True)
        again_opt = torch.optim.AdamW(again.parameters(), lr=3e-3, weight_decay=0.01)
        state = t.app_state(again, again_opt, 0)
        state = {"model": state["model"], "optim": state["optim"]}
        reader = StorageReader(writer)
        dcp.load(state, storage_reader=reader)
        assert reader.step == 0
        t.apply_state(again, again_opt, {**state, "rng": torch.get_rng_state()})
        assert t.full_digests(again, again_opt) == full

    # several ranks cannot share one list of tiers: refused on every rank, nothing written
    try:
        dcp.save({"w": torch.zeros(2)}, storage_writer=StorageWriter([LocalTier(out / "shared")]))
    except CheckpointException as exc:
        assert "RankStore" in str(exc), exc
    else:
        raise AssertionError("two ranks saved into one list of tiers")

    model = t.small_model(shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    state = t.app_state(model, opt, 0)
    state = {"model": state["model"], "optim": state["optim"]}
    with StorageReader(out / "root1") as reader:
        dcp.load(state, storage_reader=reader)
        assert reader.step == 0
    t.apply_state(model, opt, {**state, "rng": torch.get_rng_state()})
    full = t.full_digests(model, opt)
    if rank == 0:
        t.write_json(out / "full1.json", full)
    dist.barrier()
    dist.destroy_process_group()


def local_digests(state: object) -> dict[str, str]:
    """Digests of a state dict with every DTensor replaced by this rank's piece of it."""
    from torch.distributed.tensor import DTensor

    def local(obj: object) -> object:
        if isinstance(obj, DTensor):
            return obj.to_local()
        if isinstance(obj, dict):
            return {k: local(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [local(v) for v in obj]
        return obj
    return t.digests(local(state))


def ddp_stager(out: Path, fsdp2: bool = False) -> None:
    import copy

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from asymcheck.dcp import Stager

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")  # the saves' collectives, apart from DDP's
    model = t.small_model(shard=True) if fsdp2 else \
        torch.nn.parallel.DistributedDataParallel(t.small_model(shard=False))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    taken: dict[int, dict[str, str]] = {}
    with StorageWriter(out / "root", keep_last=None) as writer, Stager(opt) as stager:
        response = None
        for step in range(4):
            t.small_step(model, opt, step, rank)
            if response is not None:
                response.upload_completion.result()
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            taken[step] = local_digests(copy.deepcopy(state))
            response = dcp.async_save(state, storage_writer=writer, async_stager=stager, checkpoint_id=str(step),
                                      process_group=group)
            assert isinstance(response, AsyncSaveResponse)
        assert response is not None
        response.upload_completion.result()
        stats = stager.stats()  # the parameters and AdamW's state (the local shards under FSDP2): in the background
        assert stats.failed == 0 and stats.background_bytes > stats.inline_bytes, stats
        assert isinstance(writer.store, RankStore)
        for step in range(4):
            msd, osd = get_state_dict(model, opt)
            state = copy.deepcopy({"model": msd, "optim": osd})
            for value in state["model"].values():
                value.zero_()
            dcp.load(state, storage_reader=StorageReader(writer), checkpoint_id=str(step), process_group=group)
            assert local_digests(state) == taken[step], step
    full = t.full_digests(model, opt) if fsdp2 else taken[3]  # the live state is step 3's: nothing trained since
    if rank == 0:
        t.write_json(out / "last.json", full)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "train":
        train(argv[1], Path(argv[2]), int(argv[3]), "--reference" in argv[4:], "--idiom" in argv[4:],
              "--stager" in argv[4:])
    elif mode == "save":
        save_once(argv[1], int(argv[2]))
    elif mode == "reshard":
        reshard(Path(argv[1]))
    elif mode == "ddp-stager":
        ddp_stager(Path(argv[1]))
    elif mode == "fsdp2-stager":
        ddp_stager(Path(argv[1]), fsdp2=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
