"""The multi-rank commit and recovery protocol at 64 to 1,024 simulated ranks, against one real TCPStore.

Runs the real code — ``RankStore.commit`` (shard report, the coordinator's
``publish_global`` with its placement record and global retention),
``RankStore.restore`` (the collective agreement of :mod:`asymstore.multirank.restore`)
and the peer ring assignment (:func:`asymstore.tiers.peer.ring.ring_of`) — with tiny
shards (one 1 KiB tensor in a process-memory ``host_tier`` per rank) so that only
the protocol costs. One ``torch.distributed.TCPStore`` server (as ``torchrun``
starts it); the coordinator (rank 0) alone in its own process, so that its CPU
is that process's; the other ranks as asyncio tasks in ``--procs`` worker
processes, each rank with its own TCPStore client (as a real job has). Every
store operation of every client is counted.

Reported per N, over ``--commits`` commits (after one warm-up):

- publish latency: from the last rank's shard report (the ``set`` of its report
  key, timed by the counting client) to the global manifest being published (the
  coordinator's ``commit`` returning), p50 and max;
- store requests per commit: every ``set``/``get``/``check``/``add``/``multi_get``
  of every client, per commit;
- coordinator CPU per commit (its process's user+system CPU seconds);
- restore agreement: the slowest rank's ``restore()`` of the newest global version,
  every rank starting together (a counter in the store as the start line);
- ring: ``ring_of`` for every rank (what every rank computes once at open).

    python benches/scale.py                      # N = 64, 256, 1024; 10 commits each
    python benches/scale.py --ranks 64 --commits 3 --out scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import multiprocessing as mp
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

KIB = 1 << 10


class Counting:
    """A c10d store client that counts the operations made through it, and notes when shard reports go out."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls = 0
        self.reported: dict[str, float] = {}  # commit key -> when this client set its shard report

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            out = attr(*args, **kwargs)
            if name == "set" and "/commit/" in str(args[0]) and "/rank/" in str(args[0]):
                self.reported[str(args[0]).split("/commit/")[1].split("/")[0]] = time.time()
            return out

        return call


def client(port: int) -> Counting:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=600),
                          wait_for_workers=False)
    return Counting(dist.PrefixStore("asymstore/scale", store))


def worker(ranks: list[int], world: int, root: str, port: int, commits: int, out: Any) -> None:
    """Host ``ranks``: open, commit ``commits + 1`` steps, restore; send timings and request counts."""
    import torch

    from asymstore import host_tier
    from asymstore.multirank import RankStore

    clients = {r: client(port) for r in ranks}
    result: dict[str, Any] = {"ranks": ranks, "done": {}, "reported": {}, "restore": {}, "calls": 0, "cpu_s": 0.0}

    def cpu() -> float:
        use = resource.getrusage(resource.RUSAGE_SELF)
        return use.ru_utime + use.ru_stime

    async def one(rank: int) -> None:
        store = RankStore(root, rank=rank, world_size=world, kv=clients[rank], tiers=[host_tier(1 << 20)],
                          keep_last=3, timeout_s=600.0, restore_timeout_s=600.0, fsync=False,
                          segment_bytes=1 << 20, compression="never")
        async with store:
            for step in range(commits + 1):
                if step == 1:  # after the warm-up commit: count what the measured ones cost
                    calls, cpu_start = clients[rank].calls, cpu()
                await store.put_many(step, {"w": torch.full((KIB // 4,), float(rank + step))})
                await store.commit(step)
                result["done"].setdefault(step, {})[rank] = time.time()
            result["calls"] += clients[rank].calls - calls
            if rank == 0:  # the coordinator is alone in its process
                result["cpu_s"] = cpu() - cpu_start
            for step_key, at in clients[rank].reported.items():
                result["reported"].setdefault(step_key, {})[rank] = at
            kv = clients[rank]
            await asyncio.to_thread(kv.add, "bench/ready", 1)  # every rank at the start line: the agreement alone
            while int(await asyncio.to_thread(kv.add, "bench/ready", 0)) < world:
                await asyncio.sleep(0.01)
            started = time.perf_counter()
            await store.restore()
            result["restore"][rank] = time.perf_counter() - started

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(len(ranks) + 8))
        await asyncio.gather(*(one(r) for r in ranks))

    asyncio.run(main())
    out.send(result)


def run(world: int, procs: int, commits: int) -> dict[str, Any]:
    """One N: the server here, the coordinator and ``procs`` workers as processes; return the figures."""
    import torch.distributed as dist

    from asymstore.tiers.peer.ring import ring_of

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=600),
                           wait_for_workers=False)
    root = tempfile.mkdtemp(prefix="asymstore-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ctx = mp.get_context("spawn")
    groups = [[0]] + [list(range(1 + i, world, procs)) for i in range(procs)]
    pipes, workers = [], []
    try:
        for ranks in groups:
            here, there = ctx.Pipe()
            p = ctx.Process(target=worker, args=(ranks, world, root, port, commits, there))
            p.start()
            pipes.append(here)
            workers.append(p)
        results = [pipe.recv() for pipe in pipes]
        for p in workers:
            p.join(60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        del server
    done: dict[int, dict[int, float]] = {}
    reported: dict[int, float] = {}
    for res in results:
        for step, by_rank in res["done"].items():
            done.setdefault(int(step), {}).update({int(r): t for r, t in by_rank.items()})
        for step_key, by_rank in res["reported"].items():
            step = int(step_key.split(".")[0])
            reported[step] = max(reported.get(step, 0.0), *by_rank.values())
    latency = []
    for step in range(1, commits + 1):  # step 0 is the warm-up
        latency.append(max(0.0, done[step][0] - reported[step]))  # the last report to the publish
    started = time.perf_counter()
    for r in range(world):
        ring_of(r, world, local_world_size=8 if world % 8 == 0 else 1)
    ring_s = time.perf_counter() - started
    calls = sum(res["calls"] for res in results)
    restore = max(t for res in results for t in res["restore"].values())
    return {"ranks": world, "commits": commits, "publish_p50_ms": 1e3 * statistics.median(latency),
            "publish_max_ms": 1e3 * max(latency), "requests_per_commit": calls / commits,
            "coordinator_cpu_ms_per_commit": 1e3 * results[0]["cpu_s"] / commits,
            "restore_s": restore, "ring_all_ranks_ms": 1e3 * ring_s}


def main(argv: list[str] | None = None) -> int:
    """Run the bench and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--procs", type=int, default=3, help="worker processes hosting ranks 1..N-1")
    parser.add_argument("--commits", type=int, default=10)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})", flush=True)
    rows = []
    print(f"{'ranks':>6} {'publish p50':>12} {'publish max':>12} {'requests/commit':>16} {'coord CPU/commit':>17} "
          f"{'restore':>9} {'ring (all)':>11}")
    for n in args.ranks:
        row = run(n, args.procs, args.commits)
        rows.append(row)
        print(f"{n:>6} {row['publish_p50_ms']:>9.1f} ms {row['publish_max_ms']:>9.1f} ms "
              f"{row['requests_per_commit']:>16.0f} {row['coordinator_cpu_ms_per_commit']:>14.1f} ms "
              f"{row['restore_s']:>7.2f} s {row['ring_all_ranks_ms']:>8.2f} ms", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
