"""The multi-rank commit and recovery protocol at 64 to 12,288 simulated ranks, against one real TCPStore.

Runs the real code — ``RankStore.commit`` (shard report, the coordinator's
``publish_global`` with its placement record and global retention),
``RankStore.restore`` (the collective agreement of :mod:`asymstore.multirank.restore`)
and the peer ring assignment (:func:`asymstore.tiers.peer.ring.ring_of`) — with tiny
shards (one 1 KiB tensor in a small process-memory ``host_tier`` per rank) so that
only the protocol costs. One ``torch.distributed.TCPStore`` server (as ``torchrun``
starts it) in this process; the coordinator (rank 0) alone in its own process, so
that its CPU is that process's; the node leaders (ranks ``k·L``, ``k ≥ 1``: local
rank 0 of each node) together in one process, so that their CPU is that process's;
the other ranks as asyncio tasks in ``--procs`` worker processes. Each rank has its
own TCPStore client of the central server (as every rank of a torchrun job has),
connected before the start, one at a time per process (``--lazy-clients``: on the
rank's first request instead, so that a rank whose protocol never asks the central
store opens no connection); every operation through it is counted. c10d's connect
looks a socket's name up (``getnameinfo``): where DNS is unreachable (the development
VM) about one connect in 30 waits 5 s or 10 s for the resolver, so the bench sets
``RES_OPTIONS="timeout:1 attempts:1"`` for its processes unless it is set; a protocol
that opens connections of its own (node stores) still shows the rest in its opening
phase (printed per N).

The topology: ``--node-size L`` ranks per node, numbered node by node. It reaches
the protocol as ``RankStore(..., node_size=L)`` when ``RankStore`` takes that
keyword (hierarchical coordination: ranks report to their node's leader); a
``RankStore`` without it runs the flat protocol (every rank against the central
store), and the table says which ran. ``--flat`` runs every N a second time with
``node_size`` = N (one node: the flat path) for comparison in the same run;
``--flat-only`` runs only that.

Reported per N and protocol, over ``--commits`` commits (after one warm-up) and
``--restores`` restore agreements:

- publish latency: from the last rank's shard report to the global manifest being
  published (the coordinator's ``commit`` returning), p50 and max. A rank's report
  is the ``set`` of its report key on the central store, timed by the counting
  client; through node leaders the last report is the last relay group head's
  forward of its group's reports (``queue_push``; the coordinator can publish only
  after it);
- answer latency: from the same last report to the coordinator's ``set`` of its
  answer in the central store (the global manifest and ``LATEST`` written, retention
  decided), p50 and max: publish latency less the coordinator's own retention work
  after it;
- central store requests per commit, and per restore agreement (the requests made
  during ``restore()`` by every rank);
- restore agreement: the slowest rank's ``restore()`` of the newest global version,
  every rank starting together (the start line: the ranks of a process meet, then
  one ``add`` and one blocking ``wait`` per process on the bench's own connection,
  not counted), the median and the max over the agreements;
- descriptors and threads per process at its end (the node stores a process serves
  stay served until it exits): what a process of many leaders needs;
- CPU per process: the coordinator's per commit, the leaders' process's (and every
  worker's, with the ranks it hosts) per commit and per agreement, and the store
  server's process (this one) over the whole run; peak RSS of each process;
- peak store server connections: the most central-store clients the ranks held open
  at once (counted at each connect and release), and the connections the server's
  process holds besides the bench's own (its open descriptors less those it held at
  the start that were not the ranks' clients), sampled every 0.2 s: the server's
  view, which also sees connections the protocol opens itself;
- ring: ``ring_of`` for every rank (what every rank computes once at open).

Memory and descriptors: each rank costs a TCPStore connection (a descriptor on each
side), a thread while it blocks in a store call, and its store's Python objects; the
bench raises the soft ``RLIMIT_NOFILE`` to the hard limit, refuses an N the limits
cannot hold (saying which limit), and measures the bytes per rank of each N to refuse
the next N when ``MemAvailable`` cannot hold it.

Develop with small N; the official figures on a quiet machine::

    python benches/scale.py                                   # N = 64, 256, 1024; 10 commits, 3 restores
    python benches/scale.py --ranks 64 --commits 3 --restores 1 --out scale.json
    python benches/scale.py --ranks 1024 4096 12288 --procs 4 --node-size 8 --flat --out scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import inspect
import json
import multiprocessing as mp
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

KIB = 1 << 10
SAMPLE_S = 0.2
"""How often the server's open descriptors are counted."""
SPARE_FDS = 256
"""Descriptors a process needs besides the store connections (libraries, pipes, files)."""
LEADER_FDS = 56
"""Descriptors a node leader holds in its process (46 measured at 1,024 ranks in nodes of 8): its node store's
listening socket and server side of every connection to it (its own clients, its ranks' two each, rank 0's,
its relay group's), its clients' sockets, the server's event loop. 1,535 leaders (12,288 ranks) need ~70,000:
more than one process's ``RLIMIT_NOFILE`` here (20,000), so leaders are spread over several processes."""
SPARE_BYTES = 1 << 30
"""Memory left free when deciding whether the next N fits."""
PROCESS_BYTES = 300 << 20
"""A process's memory before its ranks (the interpreter and torch: 230 MiB measured)."""
RANK_BYTES = 128 * KIB
"""A rank's own memory (its store, client, task; 60 KiB measured at 1,024 ranks without restores)."""
PEER_BYTES = 768
"""A rank's memory per rank of the job once it has restored (~540 B measured at 1,024 ranks): each rank holds the
global manifest it restored (``RankStore.restored_global``, N entries), so N ranks in one machine hold N² entries."""


class Gauge:
    """Central-store clients open now and at most, over every process (shared counters)."""

    def __init__(self, ctx: Any) -> None:
        self.now = ctx.Value("q", 0)
        self.peak = ctx.Value("q", 0, lock=False)
        self.opened = ctx.Value("q", 0, lock=False)

    def open(self) -> None:
        """Note a connection opened."""
        with self.now.get_lock():
            self.now.value += 1
            self.opened.value += 1
            self.peak.value = max(self.peak.value, self.now.value)

    def close(self) -> None:
        """Note a connection released."""
        with self.now.get_lock():
            self.now.value -= 1


class Counting:
    """A rank's c10d store client of the central server, counting the operations made through it.

    Connected at once (``lazy`` False: as every rank of a torchrun job holds one), else on first use.
    It notes when this rank's shard report goes out (the ``set`` of a ``.../commit/<key>/rank/...`` key).
    """

    def __init__(self, port: int, gauge: Gauge, *, lazy: bool = False) -> None:
        self._port = port
        self._gauge = gauge
        self._store: Any = None
        self._connecting = threading.Lock()
        self.calls = 0
        self.reported: dict[str, float] = {}  # commit key -> when this client set its shard report
        self.answered: dict[str, float] = {}  # commit key -> when this client (the coordinator's) set the answer
        if not lazy:
            self._connected()

    def _connected(self) -> Any:
        if self._store is None:
            import torch.distributed as dist

            with self._connecting:
                if self._store is None:
                    store = dist.TCPStore("127.0.0.1", self._port, None, False,  # type: ignore[attr-defined]
                                          timeout=datetime.timedelta(seconds=900), wait_for_workers=False)
                    self._store = dist.PrefixStore("asymstore/scale", store)  # type: ignore[attr-defined]
                    self._gauge.open()
        return self._store

    def clone(self) -> Any:
        """A new connection to the central server (the protocol's blocking waits), counted with this client."""
        self._gauge.open()
        return _Counted(self, self._connected().clone())

    def release(self) -> None:
        """Drop the connection (the rank is done with the central store)."""
        if self._store is not None:
            self._store = None
            self._gauge.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self._connected(), name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            out = attr(*args, **kwargs)
            key = str(args[0]) if args else ""
            if name in ("set", "queue_push") and "/commit/" in key and "/rank/" in key:
                self.reported[key.split("/commit/")[1].split("/")[0]] = time.time()
            elif name == "set" and "/commit/" in key and key.endswith("/global"):
                self.answered[key.split("/commit/")[1].split("/")[0]] = time.time()
            return out

        return call


class _Counted:
    """A rank's further connection to the central server: its requests count as the rank's."""

    def __init__(self, owner: Counting, store: Any) -> None:
        self._owner = owner
        self._store = store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if name != "set_timeout":  # the client's own setting, no request
                self._owner.calls += 1
            return attr(*args, **kwargs)

        return call


def cpu_s() -> float:
    """This process's user + system CPU seconds."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class Window:
    """A span of this process's CPU: from the first of its ranks entering it to the last leaving it."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end = 0.0

    def enter(self) -> None:
        """A rank enters."""
        if self.start is None:
            self.start = cpu_s()

    def leave(self) -> None:
        """A rank leaves."""
        self.end = cpu_s()

    def seconds(self) -> float:
        """CPU seconds of the span."""
        return 0.0 if self.start is None else self.end - self.start


class StartLine:
    """Every rank of every process at a start line: the ranks of a process meet here, then one ``add`` per process
    and one blocking ``wait`` (in the server, no polling) on the bench's own connection of the process."""

    def __init__(self, local: int, processes: int, port: int) -> None:
        import torch.distributed as dist

        self.local, self.processes = local, processes
        client = dist.TCPStore("127.0.0.1", port, None, False,  # type: ignore[attr-defined]
                               timeout=datetime.timedelta(seconds=900), wait_for_workers=False)
        self.kv = dist.PrefixStore("asymstore/scale-bench", client)  # type: ignore[attr-defined]
        self.arrived: dict[str, int] = {}
        self.open: dict[str, asyncio.Event] = {}

    async def wait(self, name: str) -> None:
        """Return when every rank has reached ``name``."""
        gate = self.open.setdefault(name, asyncio.Event())
        self.arrived[name] = self.arrived.get(name, 0) + 1
        if self.arrived[name] == self.local:
            if int(await asyncio.to_thread(self.kv.add, f"{name}/count", 1)) == self.processes:
                await asyncio.to_thread(self.kv.set, f"{name}/go", "1")
            await asyncio.to_thread(self.kv.wait, [f"{name}/go"])
            gate.set()
        await gate.wait()


def worker(ranks: list[int], world: int, processes: int, root: str, port: int, commits: int, restores: int,
           store_kwargs: dict[str, Any], gauge: Gauge, lazy: bool, out: Any) -> None:
    """Host ``ranks``: open, commit ``commits + 1`` steps, agree ``restores`` times; send timings and counts."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:  # a process of node leaders holds many descriptors (see LEADER_FDS)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        import torch

        from asymstore import host_tier
        from asymstore.multirank import RankStore

        clients = {r: Counting(port, gauge, lazy=lazy) for r in ranks}  # one at a time: see --lazy-clients
        line = StartLine(len(ranks), processes, port)
        out.send("ready")
        out.recv()  # every process imported and connected: start together
        phases: dict[str, float] = {}

        def reached(phase: str) -> None:
            phases[phase] = time.time()  # the last of this process's ranks to get there

        result: dict[str, Any] = {"ranks": ranks, "done": {}, "reported": {}, "answered": {},
                                  "restore": [{} for _ in range(restores)],
                                  "commit_calls": 0, "restore_calls": 0}
        commit_cpu, restore_cpu = Window(), Window()

        async def one(rank: int) -> None:
            store = RankStore(root, rank=rank, world_size=world, kv=clients[rank], tiers=[host_tier(64 * KIB)],
                              keep_last=3, timeout_s=900.0, restore_timeout_s=900.0, fsync=False,
                              segment_bytes=64 * KIB, compression="never", **store_kwargs)
            kv = clients[rank]
            async with store:
                reached("opened")
                calls = 0
                for step in range(commits + 1):
                    if step == 1:  # after the warm-up commit: count what the measured ones cost
                        calls = kv.calls
                        commit_cpu.enter()
                    await store.put_many(step, {"w": torch.full((KIB // 4,), float(rank + step))})
                    await store.commit(step)
                    result["done"].setdefault(step, {})[rank] = time.time()
                commit_cpu.leave()
                reached("committed")
                result["commit_calls"] += kv.calls - calls
                for step_key, at in kv.reported.items():
                    result["reported"].setdefault(step_key, {})[rank] = at
                result["answered"].update(kv.answered)
                for i in range(restores):
                    await line.wait(f"restore{i}")  # every rank at the start line: the agreement alone
                    restore_cpu.enter()
                    calls, started = kv.calls, time.perf_counter()
                    await store.restore()
                    result["restore"][i][rank] = time.perf_counter() - started
                    result["restore_calls"] += kv.calls - calls
                    restore_cpu.leave()
                reached("agreed")
                await line.wait("closing")  # none closes (and leaves the agreements) before all are done
            kv.release()
            reached("closed")

        async def main() -> None:
            asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(len(ranks) + 8))
            await asyncio.gather(*(one(r) for r in ranks))

        asyncio.run(main())
        result.update(fds=open_fds(), threads=native_threads())  # node stores stay served until the process ends
        result.update(phases=phases, commit_cpu_s=commit_cpu.seconds(), restore_cpu_s=restore_cpu.seconds(),
                      cpu_s=cpu_s(), rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB)
        out.send(result)
    except BaseException:
        out.send({"error": traceback.format_exc()})
        raise


def accepts_node_size() -> bool:
    """Whether this ``RankStore`` takes the topology (``node_size=``): the hierarchical protocol."""
    from asymstore.multirank import RankStore

    return "node_size" in inspect.signature(RankStore).parameters


def groups_of(world: int, procs: int, node_size: int, leading: bool = True) -> list[tuple[str, list[int]]]:
    """The processes and the ranks each hosts: the coordinator, the other node leaders, then ``procs`` workers.

    ``leading`` False: the protocol is flat, and the same ranks are hosted the same way (for comparison).
    """
    leaders = list(range(node_size, world, node_size)) if node_size < world else []
    chosen = set(leaders)
    rest = [r for r in range(1, world) if r not in chosen]
    groups = [("coordinator (rank 0)", [0])]
    if leaders:
        role = "node leaders" if leading else "flat: not leaders,"
        shares = -(-len(leaders) // leaders_per_process())  # the descriptors of one process bound its leaders
        groups += [(f"{role} ranks k*{node_size}" + (f" ({i + 1}/{shares})" if shares > 1 else ""),
                    leaders[i::shares]) for i in range(shares)]
    groups += [(f"worker {i}", rest[i::procs]) for i in range(procs) if rest[i::procs]]
    return groups


def leaders_per_process() -> int:
    """How many node leaders one process can host: its descriptors (``RLIMIT_NOFILE``) over :data:`LEADER_FDS`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = hard if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and hard > soft) else soft
    if limit == resource.RLIM_INFINITY:
        return 1 << 20
    return max(1, (int(limit) - SPARE_FDS) // LEADER_FDS)


def open_fds() -> int:
    """This process's open descriptors."""
    return len(os.listdir("/proc/self/fd"))


def native_threads() -> int:
    """This process's threads (the kernel's count: Python's and the store servers' own)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def fd_limit(needed: int) -> str | None:
    """Raise the soft descriptor limit towards the hard one; None when ``needed`` fits, else why not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else hard, hard))
        except (ValueError, OSError) as e:
            print(f"could not raise the open-files limit from {soft}: {e}")
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < needed:
        return (f"needs {needed} open files in the store server's process (one per rank's connection, plus "
                f"{SPARE_FDS}) but the hard limit is {hard}: raise it (`ulimit -Hn`, limits.conf, or the "
                f"container's nofile) or run fewer ranks")
    return None


def mem_available() -> int:
    """``MemAvailable`` of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KIB
    return 0


def memory_needed(world: int, processes: int, restores: int) -> int:
    """The bytes ``world`` simulated ranks over ``processes`` processes need (the model of the constants above)."""
    return int(processes * PROCESS_BYTES + world * (RANK_BYTES + (PEER_BYTES * world if restores else 0)))


def fits(world: int, processes: int, restores: int, scale: float) -> str | None:
    """None when ``world`` ranks over ``processes`` processes fit in memory and threads, else why not.

    ``scale``: how much more than the model the runs so far took (1.0: as modelled).
    """
    need = int(memory_needed(world, processes, restores) * scale)
    free = mem_available()
    if need + SPARE_BYTES > free:
        why = (f"needs about {need >> 20} MiB and {SPARE_BYTES >> 20} MiB to spare, but {free >> 20} MiB are "
               f"available")
        if restores:
            return (f"{why}: after a restore each simulated rank holds the global manifest of {world} entries "
                    f"(~{world * PEER_BYTES >> 20} MiB each, N² in all)")
        return why
    threads = world + 64 * processes  # a thread per rank blocked in a store call, and each process's own
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if nproc != resource.RLIM_INFINITY and threads > nproc:
        return f"needs about {threads} threads; RLIMIT_NPROC (every thread of the user) is {nproc}"
    return None


def run(world: int, procs: int, commits: int, restores: int, topology: int, node_size: int | None,
        lazy: bool = False) -> dict[str, Any]:
    """One N: the server here, the coordinator, the leaders and ``procs`` workers as processes; return the figures.

    Args:
        world: the ranks.
        procs: worker processes for the ranks that are neither the coordinator nor leaders.
        commits: measured commits (after one warm-up).
        restores: restore agreements.
        topology: ranks per node (how ranks are hosted, and the ring).
        node_size: what ``RankStore`` is given (None: nothing, it does not take it).
        lazy: connect each rank's client of the central store on its first request, not before the start.
    """
    import torch.distributed as dist

    from asymstore.tiers.peer import ring as ring_module

    hierarchical = node_size is not None and node_size < world
    store_kwargs = {} if node_size is None else {"node_size": node_size}
    groups = groups_of(world, procs, topology, leading=hierarchical)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, None, True,  # type: ignore[attr-defined]
                           timeout=datetime.timedelta(seconds=900), wait_for_workers=False)
    root = tempfile.mkdtemp(prefix="asymstore-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ctx = mp.get_context("spawn")
    gauge = Gauge(ctx)
    pipes, workers = [], []
    peak_fds = [0]
    stop = threading.Event()
    server_cpu = cpu_s()
    spawned = time.time()
    try:
        for _, ranks in groups:
            here, there = ctx.Pipe()
            p = ctx.Process(target=worker, args=(ranks, world, len(groups), root, port, commits, restores,
                                                 store_kwargs, gauge, lazy, there))
            p.start()
            there.close()
            pipes.append(here)
            workers.append(p)
        for pipe in pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("a worker failed to start")
        startup = time.time() - spawned
        # before the start the server holds the ranks' clients connected so far and the bench's own: the rest
        # (files, pipes, the listening socket, multiprocessing's sockets) stays as it is for the whole run
        not_connections = open_fds() - gauge.now.value - len(groups)
        peak_fds[0] = open_fds() - not_connections - len(groups)

        def sample() -> None:
            while not stop.wait(SAMPLE_S):
                peak_fds[0] = max(peak_fds[0], open_fds() - not_connections - len(groups))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.time()
        for pipe in pipes:
            pipe.send("go")
        results = []
        for (name, _), pipe in zip(groups, pipes, strict=True):
            res = pipe.recv()
            if "error" in res:
                raise RuntimeError(f"{name} failed:\n{res['error']}")
            results.append(res)
        elapsed = time.time() - started
        for p in workers:
            p.join(60)
        teardown = time.time() - started - elapsed
    finally:
        stop.set()
        for p in workers:
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
        server_cpu = cpu_s() - server_cpu
        del server
    done: dict[int, dict[int, float]] = {}
    reported: dict[int, dict[int, float]] = {}
    for res in results:
        for step, by_rank in res["done"].items():
            done.setdefault(int(step), {}).update({int(r): t for r, t in by_rank.items()})
        for step_key, by_rank in res["reported"].items():
            reported.setdefault(int(step_key.split(".")[0]), {}).update(by_rank)
    answered = {int(k.split(".")[0]): at for res in results for k, at in res["answered"].items()}
    latency, answer = [], []
    for step in range(1, commits + 1):  # step 0 is the warm-up
        central = reported.get(step, {})  # the reports that reached the job's store (a node's: its leader's forward)
        last = max(central.values()) if central else max(done[step].values())
        latency.append(max(0.0, done[step][0] - last))  # the last report to the publish
        if step in answered:
            answer.append(max(0.0, answered[step] - last))  # the last report to the answer (manifest written)
    layouts = getattr(ring_module, "_layout", None)
    if layouts is not None:
        layouts.cache_clear()  # the membership's ring computed afresh, as in a new job
    ring_started = time.perf_counter()
    for r in range(world):
        ring_module.ring_of(r, world, local_world_size=topology if topology < world else 1)
    ring_s = time.perf_counter() - ring_started
    agreements = [max(t for res in results for t in res["restore"][i].values()) for i in range(restores)]
    processes = [{"process": name, "ranks": len(ranks), "first_ranks": ranks[:4],
                  "cpu_ms_per_commit": 1e3 * res["commit_cpu_s"] / commits,
                  "cpu_ms_per_agreement": 1e3 * res["restore_cpu_s"] / max(restores, 1),
                  "cpu_s": res["cpu_s"], "rss_mib": res["rss_bytes"] / (1 << 20),
                  "fds_at_end": res["fds"], "threads_at_end": res["threads"],
                  "phases_s": {phase: at - started for phase, at in res["phases"].items()}}
                 for (name, ranks), res in zip(groups, results, strict=True)]
    leaders = [p for p in processes if str(p["process"]).startswith("node leaders")]  # the first's CPU is shown
    return {"ranks": world, "protocol": f"nodes of {node_size}" if hierarchical else "flat",
            "topology": topology, "node_size": node_size, "commits": commits, "restores": restores,
            "publish_p50_ms": 1e3 * statistics.median(latency), "publish_max_ms": 1e3 * max(latency),
            "answer_p50_ms": 1e3 * statistics.median(answer) if answer else None,
            "answer_max_ms": 1e3 * max(answer) if answer else None,
            "requests_per_commit": sum(res["commit_calls"] for res in results) / commits,
            "requests_per_agreement": sum(res["restore_calls"] for res in results) / max(restores, 1),
            "restore_s": statistics.median(agreements) if agreements else None,
            "restore_max_s": max(agreements) if agreements else None,
            "coordinator_cpu_ms_per_commit": processes[0]["cpu_ms_per_commit"],
            "leader_cpu_ms_per_commit": leaders[0]["cpu_ms_per_commit"] if leaders else None,
            "server_process_cpu_s": server_cpu, "elapsed_s": elapsed, "startup_s": startup, "teardown_s": teardown,
            "phases_s": {phase: max(res["phases"][phase] for res in results) - started
                         for phase in ("opened", "committed", "agreed", "closed")},
            "clients_opened": gauge.opened.value, "peak_clients_open": gauge.peak.value,
            "peak_server_fds": peak_fds[0], "ring_all_ranks_ms": 1e3 * ring_s,
            "rss_mib_total": sum(p["rss_mib"] for p in processes), "processes": processes}


def main(argv: list[str] | None = None) -> int:
    """Run the bench and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--procs", type=int, default=3, help="worker processes hosting the ranks that are "
                        "neither the coordinator nor node leaders")
    parser.add_argument("--node-size", type=int, default=8, help="ranks per node, numbered node by node")
    parser.add_argument("--commits", type=int, default=10)
    parser.add_argument("--restores", type=int, default=3, help="restore agreements per N")
    parser.add_argument("--flat", action="store_true", help="also run every N with one node (the flat protocol)")
    parser.add_argument("--flat-only", action="store_true", help="run every N with one node only")
    parser.add_argument("--lazy-clients", action="store_true",
                        help="connect each rank's central-store client on its first request (shows which ranks use "
                        "the central store at all; on a VM without DNS, connects amid traffic can stall 5 s each)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's warning per client socket, in every process
    # c10d's connect looks a socket's name up (getnameinfo); where DNS is unreachable (this VM) about one connect in
    # 30 waits out the resolver's 5 s timeout twice: one short try keeps that artifact out of the opening phase
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    if args.node_size < 1 or args.procs < 1 or args.commits < 1 or args.restores < 0:
        parser.error("--node-size, --procs and --commits must be >= 1, --restores >= 0")
    hierarchical = accepts_node_size()
    if not hierarchical:
        print("RankStore takes no node_size: every run is the flat protocol (one central store for all ranks)")
    print(f"RES_OPTIONS={os.environ['RES_OPTIONS']!r}; load average before: {os.getloadavg()[0]:.2f} "
          f"(cores: {os.cpu_count()}); "
          f"memory available: {mem_available() >> 20} MiB; open files: {resource.getrlimit(resource.RLIMIT_NOFILE)}",
          flush=True)
    rows: list[dict[str, Any]] = []
    scale = 1.0  # the memory measured over the model's, at worst so far
    print(f"{'ranks':>6} {'protocol':>11} {'publish p50/max':>18} {'answer p50/max':>18} "
          f"{'req/commit':>11} {'req/agree':>10} "
          f"{'agreement':>10} {'coord CPU':>10} {'leader CPU':>11} {'clients':>8} {'srv fds':>8} {'ring':>9} "
          f"{'RSS':>8}")
    for n in args.ranks:
        if n < 2 or n % args.node_size:
            print(f"{n:>6}: skipped, {n} ranks do not split into nodes of {args.node_size}")
            continue
        # what RankStore is given: the topology, and/or one node of n (the flat path); nothing if it takes nothing
        given: list[int | None] = [None] if not hierarchical else (
            ([] if args.flat_only else [args.node_size]) + ([n] if args.flat or args.flat_only else []))
        for node_size in given:
            processes = len(groups_of(n, args.procs, args.node_size)) + 1
            restores = args.restores
            why = fd_limit(n + SPARE_FDS) or fits(n, processes, restores, scale)
            if why and restores and fd_limit(n + SPARE_FDS) is None and fits(n, processes, 0, scale) is None:
                print(f"{n:>6}: commits only, no restore agreement: {why}", flush=True)
                restores, why = 0, None
            if why:
                print(f"{n:>6}: skipped, {why}", flush=True)
                continue
            row = run(n, args.procs, args.commits, restores, args.node_size, node_size, args.lazy_clients)
            rows.append(row)
            scale = max(scale, row["rss_mib_total"] * (1 << 20) / memory_needed(n, processes - 1, restores))
            leader = row["leader_cpu_ms_per_commit"]
            agreement = "-" if row["restore_s"] is None else f"{row['restore_s']:.3f} s"
            ans = "-" if row["answer_p50_ms"] is None else \
                f"{row['answer_p50_ms']:>7.1f}/{row['answer_max_ms']:>6.1f} ms"
            print(f"{n:>6} {row['protocol']:>11} {row['publish_p50_ms']:>7.1f}/{row['publish_max_ms']:>6.1f} ms "
                  f"{ans:>18} "
                  f"{row['requests_per_commit']:>11.0f} {row['requests_per_agreement']:>10.0f} "
                  f"{agreement:>10} "
                  f"{row['coordinator_cpu_ms_per_commit']:>7.1f} ms "
                  f"{'-' if leader is None else f'{leader:.1f} ms':>11} {row['peak_clients_open']:>8} "
                  f"{row['peak_server_fds']:>8} {row['ring_all_ranks_ms']:>6.2f} ms {row['rss_mib_total']:>5.0f} MiB",
                  flush=True)
            for p in row["processes"]:
                print(f"{'':>8}{p['process']:<32} {p['ranks']:>6} ranks  CPU {p['cpu_ms_per_commit']:>7.1f} ms/commit "
                      f"{p['cpu_ms_per_agreement']:>8.1f} ms/agreement  RSS {p['rss_mib']:>6.0f} MiB  "
                      f"fds {p['fds_at_end']:>6}  threads {p['threads_at_end']:>5}")
            print(f"{'':>8}{'store server (this process)':<32} {'':>12}CPU {row['server_process_cpu_s']:.1f} s over "
                  f"{row['elapsed_s']:.1f} s (start-up {row['startup_s']:.0f} s, teardown {row['teardown_s']:.0f} s); "
                  "all ranks " + ", ".join(
                      f"{phase} at {at:.1f} s" for phase, at in row["phases_s"].items()), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
