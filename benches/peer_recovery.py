"""Losing a node: the peer tier's cost per step, its lag, and recovering a node's state from peer memory.

Run by hand (never a timed test)::

    .venv/bin/python benches/peer_recovery.py            # GPT-2 30m, 2 simulated nodes of 1 rank (gloo, CPU)
    .venv/bin/python benches/peer_recovery.py --quick    # tiny GPT-2, under a minute

Two ranks, each its own simulated node (``node_of=[0, 1]``), train a DDP GPT-2 built from ``GPT2Config``
with a Checkpointer every iteration; per method, ``warmup + steps`` iterations, method order rotated per
repetition:

- ``none``: no checkpoint;
- ``memory``: a RankStore over [shared-memory host_tier] (durable);
- ``memory+peer``: [shared-memory host_tier (durable), PeerTier]: each version also copied to the other rank;
- ``memory+floor``: ``memory``, plus the least work a peer replica needs per step, with none of the peer
  tier's code: after each step a background thread (one per run) copies every parameter and optimizer state
  tensor into one flat buffer reused from step to step, then both ranks exchange that buffer through a gloo
  group of their own in 32 MiB messages, both ways at once (as the loopback transfer below); one in flight,
  the next step waits for it. No consistency (the copy races the next step), no checksum, no manifest: a
  lower bound on what the peer tier adds to ``memory`` here.

Reported: per iteration the slowest rank's time (median per method, ratio to ``none``, the peer tier's
ratio to ``memory``: target <= 1.10, the floor's ratio to ``memory`` beside it, and the peer tier's ratio to
the floor), and under ``memory+peer`` the peer tier's lag in versions after each step
(``status().lag_versions``).

Then recovery: the state after training is committed once to [memory, peer, local disk, remote
``file://``]; every rank restores it (into tensors, as ``resume()`` does), in fresh stores, from each
source alone — its replica in the other
rank's memory (``PeerTier``), its disk (``LocalTier``, page cache dropped with fadvise), the remote tier
(pyarrow ``file://``, page cache dropped) — and both ranks move the same number of bytes to each other
through a gloo group of their own in 32 MiB messages, both ways at once as the restore does: the loopback
transfer limit, measured in the same run (target: peer restore <= 2x of it). The restore produces new
tensors, whose every page the receive faults in (on this VM that alone makes a transfer 1.6x slower), so
the loopback is measured twice: into one buffer reused across repetitions (``loopback``) and into a new
buffer each time (``loopback_fresh``); and the peer restore runs a second time into the tensors the first
one filled (``peer_into_live``, as ``Checkpointer.resume()`` reads into the model's live tensors). Like for
like: ``peer`` against ``loopback_fresh``, ``peer_into_live`` against ``loopback``. Writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from common import GPT2_CONFIGS, build_gpt2, evict, files_under, run_ranks, slowest_rank_times, write_json

METHODS = ["none", "memory", "memory+peer", "memory+floor"]


def train_step(model: Any, opt: Any, args: argparse.Namespace, it: int, rank: int) -> None:
    import torch

    vocab = GPT2_CONFIGS[args.config]["vocab_size"]
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(it * 7 + rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def tiers(method: str, args: argparse.Namespace, rank: int, work: Path, shm: Path) -> list[Any]:
    from asymstore import LocalTier, host_tier
    from asymstore.tiers.peer import PeerTier
    from asymstore.tiers.remote.tier import RemoteTier

    cap = args.capacity_gib << 30
    out: list[Any] = [host_tier(cap, path=shm / method.replace("+", "_") / f"rank-{rank}")]
    if "peer" in method or method == "all":
        out.append(PeerTier(cap, path=shm / method.replace("+", "_") / "replicas", node_of=[0, 1]))
    if method == "all":
        out.append(LocalTier(work / "local" / f"rank-{rank}"))
        out.append(RemoteTier(f"file://{work / 'remote' / f'rank-{rank}'}"))
    return out


class FloorReplica:
    """The least a peer replica needs per step: copy this rank's state into a buffer, exchange it with the other rank.

    No asymstore peer code: one background thread (started here) copies every parameter and optimizer state
    tensor into a flat uint8 buffer reused from step to step, then both ranks send it to each other through a
    gloo group of their own in ``CHUNK``-sized messages, both ways at once, into a second buffer. One
    replication in flight: :meth:`after_step` waits for the previous one before handing over the next.
    """

    def __init__(self, model: Any, opt: Any, rank: int) -> None:
        import torch.distributed as dist

        self.model, self.opt, self.other = model, opt, 1 - rank
        self.group = dist.new_group(backend="gloo")  # both ranks, same order: before training, once per run
        self.tensors: list[Any] = []
        self.send: Any = None  # allocated on the first step: AdamW's moments exist only after it
        self.recv: Any = None
        self.nbytes = 0
        self.pending: Future[None] | None = None
        self.jobs: queue.SimpleQueue[Future[None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="floor-replica", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                self._replicate()
            except BaseException as e:
                job.set_exception(e)
            else:
                job.set_result(None)

    def _replicate(self) -> None:
        import torch
        import torch.distributed as dist

        from asymstore.tiers.peer.link import CHUNK

        at = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            self.send[at:at + n].copy_(t.reshape(-1).view(torch.uint8))
            at += n
        works: list[Any] = []
        for pos in range(0, self.nbytes, CHUNK):
            works.append(dist.irecv(self.recv[pos:pos + CHUNK], self.other, group=self.group))
            works.append(dist.isend(self.send[pos:pos + CHUNK], self.other, group=self.group))
        for w in works:
            w.wait()

    def after_step(self) -> None:
        """Wait for the previous replication, if still in flight, then start this step's."""
        import torch

        if self.pending is not None:
            self.pending.result()
        if self.send is None:
            self.tensors = [p.detach() for p in self.model.parameters()] + [
                v for st in self.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
            self.send = torch.empty(self.nbytes, dtype=torch.uint8)
            self.recv = torch.empty(self.nbytes, dtype=torch.uint8)
        self.pending = Future()
        self.jobs.put(self.pending)

    def close(self) -> None:
        """Wait for the last replication and join the thread."""
        try:
            if self.pending is not None:
                self.pending.result()
        finally:
            self.jobs.put(None)
            self.thread.join()


def run_method(args: argparse.Namespace, method: str, rank: int, work: Path, shm: Path) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from asymcheck import Checkpointer
    from asymcheck.options import PacingOptions
    from asymstore.multirank import RankStore

    model, opt, nparams = build_gpt2(args.config, args.seq)
    model = DDP(model)
    root = work / method.replace("+", "_")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm / method.replace("+", "_"), ignore_errors=True)
    dist.barrier()
    ckpt = None
    if method != "none":
        ts = tiers(method, args, rank, work, shm)
        ckpt = Checkpointer(model, opt, RankStore(root, tiers=ts, durable=ts[0].name, keep_last=2),
                            pacing=PacingOptions(max_overhead=None))
    floor = FloorReplica(model, opt, rank) if method == "memory+floor" else None
    times: list[float] = []
    lags: list[int] = []
    for it in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        train_step(model, opt, args, it, rank)
        if floor is not None:
            floor.after_step()  # its wait for the previous replication is part of the step
        if it >= args.warmup:
            times.append(time.perf_counter() - t0)
            if ckpt is not None and "peer" in method:
                status = ckpt.status()
                lags.append(next(s.lag_versions for n, s in status.items() if n.startswith("peer:")))
    if floor is not None:
        floor.close()
    if ckpt is not None:
        ckpt.close()
    dist.barrier()
    return {"method": method, "times": times, "lags": lags, "params": nparams,
            "floor_bytes": floor.nbytes if floor is not None else None}


def loopback_seconds(nbytes: int, rank: int, repeat: int, *, fresh: bool = False) -> float:
    """Both ranks send ``nbytes`` to each other at once, in 32 MiB gloo messages, over a group of their own.

    Into one buffer reused (touched) across repetitions, or with ``fresh`` into a new buffer each time,
    as a restore into new tensors must (every page faulted in by the receive).
    """
    import torch
    import torch.distributed as dist

    from asymstore.tiers.peer.link import CHUNK

    group = dist.new_group(backend="gloo")
    other = 1 - rank
    out = torch.zeros(nbytes, dtype=torch.uint8)
    inp = torch.ones(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeat):
        dist.barrier(group)
        t0 = time.perf_counter()
        if fresh:
            del out
            out = torch.empty(nbytes, dtype=torch.uint8)
        works: list[Any] = []
        for pos in range(0, nbytes, CHUNK):
            works.append(dist.irecv(out[pos:pos + CHUNK], other, group=group))
            works.append(dist.isend(inp[pos:pos + CHUNK], other, group=group))
        for w in works:
            w.wait()
        best = min(best, time.perf_counter() - t0)
    return best


def one_destination(manifest: Any) -> dict[str, Any]:
    """A destination for the first tensor: the store then reads every raw tensor straight into fresh ones."""
    import torch

    name, entry = next(iter(manifest.tensors.items()))
    return {name: torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))}


def recover(args: argparse.Namespace, rank: int, work: Path, shm: Path) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from asymcheck import Checkpointer
    from asymcheck.options import PacingOptions
    from asymstore import AsymStore
    from asymstore.multirank import RankStore

    model, opt, _ = build_gpt2(args.config, args.seq)
    model = DDP(model)
    for d in ("all", "local", "remote"):
        if rank == 0:
            shutil.rmtree(work / d, ignore_errors=True)
            shutil.rmtree(shm / d, ignore_errors=True)
    dist.barrier()
    ts = tiers("all", args, rank, work, shm)
    with Checkpointer(model, opt, RankStore(work / "all", tiers=ts, durable=ts[0].name),
                      pacing=PacingOptions(max_overhead=None)):
        for it in range(args.warmup):
            train_step(model, opt, args, it, rank)
    dist.barrier()
    out: dict[str, Any] = {}
    for source in ("peer", "local", "remote"):
        fresh = tiers("all", args, rank, work, shm)
        tier = fresh[{"peer": 1, "local": 2, "remote": 3}[source]]
        if source != "peer":
            evict(files_under(str(work / source / f"rank-{rank}")), "fadvise")
        dist.barrier()

        async def restore(tier: Any = tier, source: str = source) -> tuple[float, float | None, int]:
            async with AsymStore([tier], keep_last=None) as store:
                t0 = time.perf_counter()
                ckpt = await store.restore(into=one_destination)  # as resume(): read into tensors, not staged
                seconds = time.perf_counter() - t0
                again = None
                if source == "peer":  # once more, into the tensors just filled: resume() into live tensors
                    t0 = time.perf_counter()
                    await store.restore(into=dict(ckpt.tensors))
                    again = time.perf_counter() - t0
                return seconds, again, ckpt.manifest.nbytes

        out[source], again, nbytes = asyncio.run(restore())
        if again is not None:
            out["peer_into_live"] = again
        dist.barrier()
    out["loopback"] = loopback_seconds(nbytes, rank, args.repeat)
    out["loopback_fresh"] = loopback_seconds(nbytes, rank, args.repeat, fresh=True)
    out["bytes"] = nbytes
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work, shm = Path(args.dir).resolve(), Path(args.shm)
    results: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for method in METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]:
            results.append(run_method(args, method, rank, work, shm) | {"rep": rep})
            if rank == 0:
                print(f"  {method:<12} median {statistics.median(results[-1]['times']):.3f} s", flush=True)
    results.append({"method": "recover", **recover(args, rank, work, shm)})
    Path(args.out).with_suffix(f".rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny GPT-2, few steps")
    ap.add_argument("--config", choices=sorted(GPT2_CONFIGS), default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3, help="loopback transfer repetitions (best kept)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--capacity-gib", type=int, default=2, help="memory tier and replica capacity per rank")
    ap.add_argument("--dir", default="bench-out/peer_recovery-work")
    ap.add_argument("--shm", default=None, help="the simulated nodes' shared memory (default: under /dev/shm)")
    ap.add_argument("--out", default="bench-out/peer_recovery")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.config = args.config or ("tiny" if args.quick else "30m")
    args.steps = args.steps or (6 if args.quick else 12)
    args.seq = args.seq or (64 if args.quick else 256)
    args.reps = args.reps or (1 if args.quick else 2)
    if args.worker:
        worker(args)
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    shm = args.shm or tempfile.mkdtemp(prefix="asymstore-peer-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                       else None)
    argv = [sys.executable, __file__, "--worker", *sys.argv[1:], "--shm", shm]
    try:
        codes = run_ranks(argv, 2, args.threads)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    if any(codes):
        raise SystemExit(f"workers failed: {codes}")
    per_rank = [json.loads(Path(args.out).with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
    methods: dict[str, Any] = {}
    for method in METHODS:
        runs = [[r for r in rank if r["method"] == method] for rank in per_rank]
        times = slowest_rank_times(runs)
        lags = [lag for rank in runs for r in rank for lag in r["lags"]]
        methods[method] = {"median_s": statistics.median(times), "n": len(times),
                           "lag_versions": {"median": statistics.median(lags), "max": max(lags)} if lags else None}
    for entry in methods.values():
        entry["ratio_to_none"] = entry["median_s"] / methods["none"]["median_s"]
    peer_over_memory = methods["memory+peer"]["median_s"] / methods["memory"]["median_s"]
    floor_over_memory = methods["memory+floor"]["median_s"] / methods["memory"]["median_s"]
    floor_bytes = next(r["floor_bytes"] for r in per_rank[0] if r["method"] == "memory+floor")
    rec = [next(r for r in rank if r["method"] == "recover") for rank in per_rank]
    recovery = {k: max(r[k] for r in rec)
                for k in ("peer", "peer_into_live", "local", "remote", "loopback", "loopback_fresh")}
    recovery["bytes"] = rec[0]["bytes"]
    results = {"config": args.config, "gpt2": GPT2_CONFIGS[args.config], "params": per_rank[0][0]["params"],
               "seq": args.seq, "batch": args.batch, "steps": args.steps, "reps": args.reps, "threads": args.threads,
               "cpus": os.cpu_count(), "methods": methods, "peer_over_memory": peer_over_memory,
               "floor_over_memory": floor_over_memory, "peer_over_floor": peer_over_memory / floor_over_memory,
               "floor_bytes": floor_bytes,
               "recovery_s": recovery, "peer_over_loopback": recovery["peer"] / recovery["loopback"],
               "peer_over_fresh_loopback": recovery["peer"] / recovery["loopback_fresh"],
               "peer_into_live_over_loopback": recovery["peer_into_live"] / recovery["loopback"],
               "load_avg": os.getloadavg()}
    write_json(Path(args.out).with_suffix(".json"), results, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    for method, e in methods.items():
        lag = f"  peer lag {e['lag_versions']}" if e["lag_versions"] else ""
        print(f"{method:<12} median {e['median_s']:.3f} s  x{e['ratio_to_none']:.3f}{lag}")
    print(f"peer tier on top of memory: x{peer_over_memory:.3f} (target <= 1.10); the floor (copy + gloo exchange "
          f"only, {floor_bytes / 2**20:.0f} MiB per rank): x{floor_over_memory:.3f}; peer over floor "
          f"x{results['peer_over_floor']:.3f}")
    print(f"recovery of {recovery['bytes'] / 2**20:.0f} MiB per rank: peer {recovery['peer']:.3f} s, local "
          f"{recovery['local']:.3f} s, remote {recovery['remote']:.3f} s; loopback limit {recovery['loopback']:.3f} s "
          f"-> peer x{results['peer_over_loopback']:.2f} of it (target <= 2)")
    print(f"like for like: into new tensors peer {recovery['peer']:.3f} s vs loopback into a new buffer "
          f"{recovery['loopback_fresh']:.3f} s -> x{results['peer_over_fresh_loopback']:.2f}; into live tensors "
          f"{recovery['peer_into_live']:.3f} s vs loopback into a touched buffer {recovery['loopback']:.3f} s "
          f"-> x{results['peer_into_live_over_loopback']:.2f} (target <= 2)")
    print(f"wrote {Path(args.out).with_suffix('.json')}")


if __name__ == "__main__":
    main()
