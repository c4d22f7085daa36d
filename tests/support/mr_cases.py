"""What one rank does in one case of the multi-rank tests (imported by tests/procs/mr_driver.py, in its forked child).

Case fields:

- ``kind``: ``"ds"`` (a DeepSpeed engine, ``stage`` 0-3), ``"ddp"`` (plain PyTorch DDP + Checkpointer) or
  ``"fsdp2"`` (``fully_shard`` + Checkpointer: tests/support/fsdp2_cases.py).
- ``mode``: ``"refuse"`` (DeepSpeed: an engine with optimizer offload; ``attach()`` and ``install()``
  must refuse it), ``"ref"`` (train ``iterations`` without checkpoints), ``"attach"`` (checkpoint every
  iteration into ``dir``: DeepSpeed ``attach()`` or a Checkpointer over a RankStore; resumes from
  what ``dir`` holds) or ``"roundtrip"`` (DeepSpeed ``save_checkpoint`` at ``save_at`` through
  AsymCheckpointEngine, continue; then a fresh engine loads it and continues the same way).
- ``shape`` (DeepSpeed only), loop shapes of issue 9: ``"loader"``: the batch comes from a data
  loader that advances when a batch is fetched (``data=``) plus a draw from the global RNG before
  the forward; ``"val"``: a validation forward (no_grad, eval()) runs after ``engine.step()``, before
  the data position (a ``stateful`` counter) is advanced; ``"accum"``: gradient accumulation over two
  micro-batches (``gradient_accumulation_steps: 2``, ``engine.step()`` after each).
- ``preempt``: ``{"at": K, "deadline_s": D}``: every rank is SIGTERMed in iteration K (tests/support/preempt_cases.py).
- ``kill``: ``{"rank": r | null (every rank), "at": "forward:K" | "commit:N"}``: SIGKILL inside the
  forward pass of iteration K, or inside this rank's commit after N commits succeeded
  (``CrashingLocalTier`` dies with half a manifest written).
- ``step_s`` (DDP, DeepSpeed): sleep this long at the start of every iteration.
- ``dedup`` (DDP, DeepSpeed): the Checkpointer's ``CommitOptions(dedup=...)`` (default: the option's default).
- ``diverge`` (DeepSpeed): the LayerNorm's weight is frozen (no optimizer touches it) and rank 1 adds 0.5 to it
  right after ``deepspeed.initialize`` (which broadcasts rank 0's module), so its replica differs for the whole run;
  every rank's final state then holds the model states file (not rank 0's only).
- ``refusal`` (DeepSpeed): ``resume()`` is expected to raise: the error is logged as ``{"event": "refused",
  "error", "message"}`` and the case ends there.
- ``diverge`` (DDP): rank 1 adds 0.5 to the first layer's bias right after DDP's broadcast, so its replica
  differs from rank 0's for the whole run (DDP averages the gradients, so the offset stays).
- ``mark`` (DDP): call ``ckpt.mark()`` as the last statement of every iteration.
- ``ordered`` (DDP): average gradients with :func:`ordered_mean` (bit-identical restarts beyond 2 ranks).
- ``sampler`` (DDP): the batches come from a DataLoader over 40 samples through
  ``asymcheck.ResumableDistributedSampler`` (shuffled, 2 samples a batch per rank, a ``data=`` object),
  epochs one after another (``set_epoch``); each rank logs the sample ids of each iteration
  (``{"event": "batch", "it", "epoch", "ids"}``).
- ``tamper_slices`` (DDP): ``{"rank": r, "times": n}``: rank r flips one byte of the slices it sends in the first n
  exchanges of a resume (a fault injected after its own verification: :mod:`asymcheck.restore.exchange`).
- ``peer`` (DDP, DeepSpeed): ``{"shm": dir, "per_node": n, "crash": {"rank": r, "step": s} | absent}``: ranks in
  simulated nodes of ``n``, each rank's tiers [host_tier in ``shm/node-K/own``, PeerTier holding its
  source's replicas in ``shm/node-K/replicas``, LocalTier ``dir/rank-NNNNN``], the memory tier durable;
  with ``crash``, rank r dies right after sending the first segment of step s to its peer; with ``disks``, each
  rank's disk tier is ``disks/node-N/rank-NNNNN`` (node-local, outside the root) instead of ``dir/rank-NNNNN``.

Every rank appends ``{"it", "loss"}`` (a hex float) to ``losses-rankR.jsonl`` per iteration and, when
it finishes, writes its final state through asymstore to ``final-rankR`` and events to ``events-rankR.jsonl``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

HIDDEN = 64
TIMEOUT = datetime.timedelta(seconds=45)


def preload(kinds: set[str]) -> None:
    """Import what the children need (fork copies it): DeepSpeed costs seconds, its ZeRO optimizers more."""
    import asymcheck
    from asymstore.multirank import RankStore  # noqa: F401

    if "ddp" in kinds:
        import torch._dynamo  # noqa: F401  (DistributedDataParallel imports it on construction: seconds)
    if "fsdp2" in kinds:
        import importlib

        for module in ("tests.support.fsdp2_cases", "torch.distributed.fsdp", "torch.distributed.tensor"):
            importlib.import_module(module)
    if "ds" in kinds:
        import importlib

        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (imports torch._inductor)

        import asymcheck.deepspeed  # noqa: F401

        # the CPU accelerator's shared-memory comm op is JIT-built on first use (minutes on a fresh
        # machine, then cached): build and load it here, once, not inside a case's deadline
        importlib.import_module("deepspeed.comm.torch").build_shm_op()


class DataPosition:
    """Iterations completed; advanced at the end of the loop body."""

    def __init__(self) -> None:
        self.iteration = 0

    def state_dict(self) -> dict[str, int]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.iteration = int(state["iteration"])


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    return nn.Sequential(nn.Linear(16, HIDDEN), nn.LayerNorm(HIDDEN), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 16))


def batch(it: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(it * 1000 + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.flip(1) * 0.5


class Loader:
    """A data loader whose position advances when a batch is fetched."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.fetched = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(500 + self.fetched, self.rank)
        self.fetched += 1
        return x, y

    def state_dict(self) -> dict[str, int]:
        return {"fetched": self.fetched}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.fetched = int(state["fetched"])


class Log:
    def __init__(self, cdir: Path, rank: int) -> None:
        self.cdir, self.rank = cdir, rank
        cdir.mkdir(parents=True, exist_ok=True)

    def loss(self, it: int, value: float) -> None:
        with open(self.cdir / f"losses-rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"it": it, "loss": float(value).hex()}) + "\n")

    def event(self, **event: Any) -> None:
        with open(self.cdir / f"events-rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def save_final(path: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    from asymstore import AsymStore, LocalTier

    async def write() -> None:
        async with AsymStore([LocalTier(path)], keep_last=None, segment_bytes=4 << 20, compression="never") as s:
            await s.put_many(step, tensors)
            await s.commit(step, meta)

    asyncio.run(write())


def kill_spec(case: dict[str, Any], rank: int) -> tuple[str, int]:
    kill = case.get("kill")
    if not kill or (kill.get("rank") is not None and kill["rank"] != rank):
        return "", -1
    kind, _, at = kill["at"].partition(":")
    return kind, int(at)


def peer_tiers(case: dict[str, Any], rank: int) -> list[Any]:
    """[shared memory, peer, local disk] of ``rank`` on its simulated node (``peer`` field, see the docstring)."""
    from asymstore import LocalTier, host_tier
    from asymstore.format.names import rank_dirname
    from asymstore.testing import CrashingPeerTier
    from asymstore.tiers.peer import PeerTier

    peer = case["peer"]
    node = Path(peer["shm"]) / f"node-{rank // peer['per_node']}"
    kw: dict[str, Any] = {"capacity_bytes": 64 << 20, "path": node / "replicas", "local_world_size": peer["per_node"],
                          "timeout_s": 60.0, "close_timeout_s": 20.0}
    crash = peer.get("crash")
    return [host_tier(64 << 20, path=node / "own" / rank_dirname(rank)),
            CrashingPeerTier(at_step=crash["step"], **kw) if crash and crash["rank"] == rank else PeerTier(**kw),
            LocalTier(Path(peer["disks"]) / f"node-{rank // peer['per_node']}" / rank_dirname(rank)
                      if peer.get("disks") else Path(case["dir"]) / rank_dirname(rank))]


def rank_tiers(case: dict[str, Any], rank: int) -> list[Any] | None:
    if case.get("peer"):
        return peer_tiers(case, rank)
    kind, at = kill_spec(case, rank)
    if kind != "commit":
        return None
    from asymstore.format.names import rank_dirname
    from asymstore.testing import CrashingLocalTier

    return [CrashingLocalTier(Path(case["dir"]) / rank_dirname(rank), crash_at="manifest_half", after=at)]


def run(case: dict[str, Any], rank: int, world: int, cdir: Path) -> None:
    per_node = case["peer"]["per_node"] if case.get("peer") else case.get("per_node", world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(case["port"]), RANK=str(rank),  # as torchrun
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node))
    torch.set_num_threads(1)
    log = Log(cdir, rank)
    if "preempt" in case:  # every rank SIGTERMed mid-training: tests/support/preempt_cases.py
        from tests.support.preempt_cases import run_preempt

        run_preempt(case, rank, log)
    elif case["kind"] == "ds":
        run_ds(case, rank, log)
    elif case["kind"] == "fsdp2":
        from tests.support.fsdp2_cases import run_fsdp2

        run_fsdp2(case, rank, log)
    else:
        run_ddp(case, rank, log)


# -- DeepSpeed -----------------------------------------------------------------------------


def ds_engine(stage: int, accum: int = 1, diverge: bool = False) -> Any:
    import deepspeed

    model = make_model()
    if diverge:  # frozen: ZeRO leaves it out of its partitions, each rank keeps its own (see the docstring)
        model.get_parameter("1.weight").requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": accum, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 64},
           "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    if diverge and int(os.environ["RANK"]) == 1:
        with torch.no_grad():
            engine.module.get_parameter("1.weight").add_(0.5)
    return engine


def ds_train(engine: Any, start: int, stop: int, rank: int, log: Log, pos: DataPosition | None = None,
             kill_at: int = -1, loader: Loader | None = None, val: bool = False, step_s: float = 0.0) -> None:
    accum = int(engine.gradient_accumulation_steps())
    for it in range(start, stop):
        time.sleep(step_s)
        if it == kill_at:
            log.event(event="dying", it=it)
        value = 0.0
        for micro in range(accum):  # engine.step() after every micro-batch; the optimizer steps on the last
            if loader is not None:  # fetched batch, then a draw from the global RNG, before the forward
                x, y = loader.next()
                x = x + 0.1 * torch.randn(x.shape)
            else:
                x, y = batch(it * 10 + micro if accum > 1 else it, rank)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            value += loss.item()
        if val:  # validation between the step and the loop's own bookkeeping (the data position below)
            engine.eval()
            with torch.no_grad():
                value += nn.functional.mse_loss(engine(batch(900 + it, rank)[0]), batch(900 + it, rank)[1]).item()
            engine.train()
        log.loss(it, value)
        if pos is not None:
            pos.iteration += 1


def ds_final(engine: Any, cdir: Path, rank: int, name: str = "final", every_rank: bool = False, **objs: Any) -> None:
    """Save the engine's state as a version would hold it; ``every_rank``: the model states file on every rank."""
    from asymcheck.deepspeed import DeepSpeedState

    state = DeepSpeedState(engine, **objs)
    state.slice_replicas(every_rank)
    tensors, meta = state.capture_all()
    save_final(cdir / f"{name}-rank{rank}", int(engine.global_steps), tensors, meta)


def run_ds(case: dict[str, Any], rank: int, log: Log) -> None:
    import deepspeed

    import asymcheck.deepspeed as ads
    from asymcheck.options import CommitOptions, PartitionOptions, RetentionOptions

    deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    n = case["iterations"]
    loader = Loader(rank) if case.get("shape") == "loader" else None
    val = case.get("shape") == "val"
    accum = 2 if case.get("shape") == "accum" else 1
    objs: dict[str, Any] = {"data": {"loader": loader}} if loader is not None else {}
    diverge = bool(case.get("diverge"))
    if case["mode"] == "ref":
        engine = ds_engine(case["stage"], accum, diverge)
        ds_train(engine, 0, n, rank, log, loader=loader, val=val)
        ds_final(engine, log.cdir, rank, every_rank=diverge, **objs)
    elif case["mode"] == "attach":
        engine = ds_engine(case["stage"], accum, diverge)
        pos = DataPosition()
        tiers = rank_tiers(case, rank)
        commits: dict[str, Any] = {"commits": CommitOptions(dedup=case["dedup"])} if "dedup" in case else {}
        where: Any = tiers if tiers is not None else case["dir"]
        if case.get("peer"):  # the memory tier durable: replication and the disk in the background
            from asymstore.multirank import RankStore

            where = RankStore(case["dir"], tiers=tiers, durable=where[0].name, keep_last=3, timeout_s=60.0)
        ckpt = ads.attach(engine, where, root=case["dir"], stateful={"pos": pos},
                          timeout_s=case.get("timeout_s", 60.0), retention=RetentionOptions(keep_last=3),
                          partitions=PartitionOptions(warmup=1, min_partition_bytes=512), **commits, **objs)
        try:
            resumed = ckpt.resume()
        except Exception as exc:  # e.g. a version of another number of ranks: the test reads the refusal
            if not case.get("refusal"):
                raise
            log.event(event="refused", error=type(exc).__name__, message=str(exc))
            torch.distributed.barrier()  # rank 0 (the key-value store's host) stays until every rank heard
            ckpt.close()
            return
        log.event(event="resumed", step=resumed, iteration=pos.iteration, fallbacks=list(
            ckpt.restored.fallbacks) if ckpt.restored else [], fetched=loader.fetched if loader else None,
            tier=ckpt.restored.tier if ckpt.restored else None)
        kind, at = kill_spec(case, rank)
        if kind == "forward":
            engine.module[4].register_forward_pre_hook(lambda m, a: die() if pos.iteration == at else None)
        ds_train(engine, pos.iteration, n, rank, log, pos, loader=loader, val=val, step_s=case.get("step_s", 0.0))
        ckpt.close()
        stats = ckpt.stats()
        log.event(event="stats", committed=stats.versions_committed, failed=stats.commits_failed,
                  versions=ckpt.final_versions, plan=len(ckpt.plan.partitions) if ckpt.plan else 0,
                  dropped=stats.versions_dropped)
        ds_final(engine, log.cdir, rank, every_rank=diverge, **objs)
    elif case["mode"] == "roundtrip":
        ds_roundtrip(case, rank, log)
    elif case["mode"] == "refuse":
        ds_refuse(case, rank, log)


def ds_refuse(case: dict[str, Any], rank: int, log: Log) -> None:
    """A real engine with ZeRO-Offload (optimizer state on the CPU): attach() and install() must refuse it."""
    import deepspeed

    import asymcheck.deepspeed as ads
    from asymcheck.errors import UnsupportedConfigError

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
           "zero_force_ds_cpu_optimizer": False,
           "zero_optimization": {"stage": case["stage"], "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    for api in ("attach", "install"):
        try:
            if api == "attach":
                ads.attach(engine, case["dir"])
            else:
                ads.install(engine)
            log.event(event="accepted", api=api)
        except UnsupportedConfigError as exc:
            log.event(event="refused", api=api, message=str(exc))
    ds_train(engine, 0, 2, rank, log)  # the engine is untouched and trains


def ds_roundtrip(case: dict[str, Any], rank: int, log: Log) -> None:
    import torch.distributed as dist

    import asymcheck.deepspeed as ads

    n, at, root = case["iterations"], case["save_at"], case["dir"]
    engine = ds_engine(case["stage"])
    ce = ads.install(engine)
    ds_train(engine, 0, at, rank, log)
    engine.save_checkpoint(root, tag=f"step{at}", client_state={"note": "hello", "at": at})
    torch.manual_seed(99)  # DeepSpeed checkpoints hold no RNG state: start both continuations alike
    ds_train(engine, at, n, rank, log)
    ds_final(engine, log.cdir, rank, "continued")
    ce.close()
    dist.barrier()
    if rank == 0:  # DeepSpeed's own 'latest' (a plain file) torn: asymstore's global manifests still know
        Path(root, "latest").write_text("")
    dist.barrier()
    fresh = ds_engine(case["stage"])
    ce2 = ads.install(fresh)
    path, client = ads.load_checkpoint(fresh, root)
    log.event(event="loaded", path=os.path.relpath(path, root), client={k: client[k] for k in ("note", "at")},
              global_steps=int(fresh.global_steps))
    torch.manual_seed(99)
    ds_train(fresh, at, n, rank, log)
    ds_final(fresh, log.cdir, rank, "reloaded")
    ce2.close()


# -- DDP -----------------------------------------------------------------------------------


def ordered_mean(state: object, bucket: Any) -> Any:
    """A DDP comm hook averaging gradients over ranks in rank order, whatever the bucket layout.

    With more than 2 ranks, gloo's ring allreduce adds an element's contributions in an order that depends
    on where the element sits in its bucket, and DDP rebuilds its buckets after the first iteration of each
    process: a job restarted from an exact checkpoint then differs from an uninterrupted one in the last
    bits. Summing gathered buckets in rank order makes both runs bit-identical.
    """
    import torch.distributed as dist

    grad = bucket.buffer()
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, grad)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(total.div_(len(parts)))
    return fut


def run_ddp(case: dict[str, Any], rank: int, log: Log) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from asymcheck import Checkpointer
    from asymcheck.options import CommitOptions, PartitionOptions
    from asymcheck.state.trainstate import TrainingState
    from asymstore.multirank import RankStore

    dist.init_process_group("gloo", timeout=TIMEOUT)
    n = case["iterations"]
    model = DDP(make_model())
    if case.get("diverge") and rank == 1:
        with torch.no_grad():
            model.module[0].bias.add_(0.5)
    if case.get("ordered"):
        model.register_comm_hook(None, lambda state, bucket: ordered_mean(state, bucket))  # no annotations to check
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    pos = DataPosition()
    stateful: dict[str, Any] = {"sched": sched, "pos": pos}
    data: dict[str, Any] = {}
    draw = sampled(case, data)
    ckpt = None
    if case["mode"] == "attach":
        tiers = rank_tiers(case, rank)
        # a directory: the Checkpointer sees a multi-rank job and makes the RankStore itself
        where: Any = case["dir"] if tiers is None and "timeout_s" not in case else RankStore(
            case["dir"], tiers=tiers, keep_last=3, timeout_s=case.get("timeout_s", 60.0),
            **({"durable": tiers[0].name} if case.get("peer") and tiers else {}))
        ckpt = Checkpointer(model, opt, where, stateful=stateful, data=data,
                            partitions=PartitionOptions(warmup=1, min_partition_bytes=512),
                            commits=CommitOptions(dedup=case["dedup"]) if "dedup" in case else None)
        assert isinstance(ckpt.store, RankStore) or dist.get_world_size() == 1  # one rank: an ordinary store
        tamper_slices(case, rank)
        resumed = ckpt.resume()
        log.event(event="resumed", step=resumed, iteration=pos.iteration,
                  tier=ckpt.restored.tier if ckpt.restored else None,
                  fallbacks=list(ckpt.restored.fallbacks) if ckpt.restored else [])
        if case.get("dump_resumed"):  # the state as resume() left it, before any training
            tensors, meta = TrainingState(model, opt, stateful).capture_all()
            save_final(log.cdir / f"resumed-rank{rank}", pos.iteration, tensors, meta)
        kind, at = kill_spec(case, rank)
        if kind == "forward":
            model.module[4].register_forward_pre_hook(lambda m, a: die() if pos.iteration == at else None)
    for it in range(pos.iteration, n):
        time.sleep(case.get("step_s", 0.0))  # a slower step (loading data), as a real one is
        if draw is not None:
            x, y, ids, epoch = draw()
            log.event(event="batch", it=it, epoch=epoch, ids=ids)
        else:
            x, y = batch(it, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log.loss(it, loss.item())
        pos.iteration += 1
        if ckpt is not None and case.get("mark"):
            ckpt.mark()
    if ckpt is not None:
        ckpt.close()
        stats = ckpt.stats()
        log.event(event="stats", committed=stats.versions_committed, failed=stats.commits_failed)
    tensors, meta = TrainingState(model, opt, stateful, data).capture_all()
    save_final(log.cdir / f"final-rank{rank}", pos.iteration, tensors, meta)
    dist.destroy_process_group()


def tamper_slices(case: dict[str, Any], rank: int) -> None:
    """With ``tamper_slices`` for this rank: the slices it sends in its first ``times`` exchanges get a byte flipped."""
    spec = case.get("tamper_slices")
    if not spec or spec["rank"] != rank:
        return
    from asymstore.multirank import sliceexchange

    honest = sliceexchange.payload
    left = [int(spec["times"])]

    def flipped(ckpt: Any) -> bytearray:
        out = honest(ckpt)
        if left[0] > 0 and out:
            left[0] -= 1
            out[len(out) // 2] ^= 0x10
        return out

    sliceexchange.payload = flipped


def sampled(case: dict[str, Any], data: dict[str, Any]) -> Any:
    """With ``sampler``: a function drawing the next batch (x, y, ids, epoch), the sampler put in ``data``."""
    if not case.get("sampler"):
        return None
    from asymcheck import ResumableDistributedSampler

    g = torch.Generator().manual_seed(31)
    x = torch.randn(40, 16, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x.flip(1) * 0.5, torch.arange(40))
    sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=3)
    # the loader's own generator: its base-seed draw at each iter() leaves the global RNG (dropout's) alone
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler, generator=torch.Generator())
    data["sampler"] = sampler
    state: dict[str, Any] = {"it": None}

    def draw() -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
        if state["it"] is None:  # the first draw of this process: the epoch the sampler is in (resumed or 0)
            sampler.set_epoch(sampler.epoch)
            state["it"] = iter(loader)
        got = next(state["it"], None)
        if got is None:  # the epoch is over: the next one
            sampler.set_epoch(sampler.epoch + 1)
            state["it"] = iter(loader)
            got = next(state["it"])
        bx, by, ids = got
        return bx, by, [int(i) for i in ids], sampler.epoch

    return draw
