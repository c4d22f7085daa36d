"""The host pipeline's GiB/s against its threads, beside single-thread memcpy and the disk's O_DIRECT limit.

Run by hand (never a timed test)::

    .venv/bin/python benches/host_pipeline.py --out bench-out/host_pipeline.json          # ~3 min quiet, 2 cores
    .venv/bin/python benches/host_pipeline.py --quick                                      # ~30 s, 256 MiB
    .venv/bin/python benches/host_pipeline.py --threads 1,2,4,8,16 --size-mib 2048 --repeat 3   # a 16-core host

One version of ``--size-mib`` (default 1536 MiB: ``--tensor-mib`` tensors of
random fp32 bits) is committed through :class:`asymstore.AsymStore` with
``pipeline_threads=T`` for every ``T`` of ``--threads`` (default 1, 2, 4, ...
up to the CPUs this process may use), into two tiers:

* ``shm``: the shared-memory ``host_tier(path=/dev/shm/...)`` (files on tmpfs);
* ``local``: a ``LocalTier`` under ``--dir`` (fsync, O_DIRECT for large segments).

The tensors are handed over with ``adopt_many`` (no staging copy: the
training adapter's host copies are adopted the same way; ``--stage put``
copies them instead), so a version's bytes are hashed once at staging, laid
out into segments, hashed again per segment and written. Timed: ``adopt_many``
+ ``commit`` of ``--versions`` versions (the first one too: tmpfs and the
page cache allocate new pages for every version anyway); reported per
version, best and median, in GiB/s (2**30 bytes per second), with the
process's CPU seconds per GiB (all threads) beside them. ``compression`` is
``"never"`` by default (``--compression auto`` lets the cost model decide).

Beside them, in the same run, each in a fresh process and interleaved with
the pipeline's runs (ABBA rounds, ``benches/harness.py``):

* ``memcpy``: one thread copying the version's bytes (``ctypes.memmove``, the
  GIL released) into a buffer touched beforehand, and into fresh memory
  (page faults included, as a tmpfs write has them); and one xxh3 pass over
  them (CPU seconds per GiB: what the pipeline's second hash costs).
* ``odirect``: the disk's sequential write limit: the same bytes written with
  O_DIRECT in 64 MiB blocks then fsync under ``--dir`` (``dd oflag=direct
  conv=fsync``).

Target (issue 32): GiB/s into each tier >= 0.8 x min(T x single-thread
memcpy (touched), the disk's O_DIRECT limit (local only)). The table says
met / not met per row, and the 1-minute load average at the start of each
child. Outputs: a table on stdout and JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from common import GIB, MIB, Pressure, aligned_random_buffer, cpu_seconds, git_state, odirect_write, write_json
from harness import add_child_flag, add_quick_flag, child_argv, rounds, run_fresh, settle

TARGET = 0.8


def _tensors(size: int, tensor_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 bit patterns (incompressible mantissas), ``size`` bytes in tensors of ``tensor_bytes``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    left, i = size, 0
    while left > 0:
        n = min(tensor_bytes, left)
        out[f"layer{i:04d}.weight"] = torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32,
                                                    generator=gen).view(torch.float32)
        left -= n
        i += 1
    return out


# -- children ---------------------------------------------------------------


def child_memcpy(size: int) -> dict[str, Any]:
    """One thread: memmove into touched memory, into fresh memory; one xxh3 pass (CPU time)."""
    import xxhash

    torch.set_num_threads(1)
    src = aligned_random_buffer(size, seed=1)
    src_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    ctypes.memset(dst_addr, 1, size)  # touched
    touched = []
    for _ in range(3):
        t0 = time.perf_counter()
        ctypes.memmove(dst_addr, src_addr, size)
        touched.append(time.perf_counter() - t0)
    fresh = []
    for _ in range(2):
        new = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(new))
        t0 = time.perf_counter()
        ctypes.memmove(addr, src_addr, size)
        fresh.append(time.perf_counter() - t0)
        del addr
    hashes = []
    view = memoryview(src)
    for _ in range(3):
        c0 = time.thread_time()
        xxhash.xxh3_64_hexdigest(view)
        hashes.append(time.thread_time() - c0)
    return {"touched_gibps": size / GIB / min(touched), "fresh_gibps": size / GIB / min(fresh),
            "xxh3_cpu_s_per_gib": min(hashes) * GIB / size}


def child_odirect(size: int, directory: str) -> dict[str, Any]:
    """The disk's sequential O_DIRECT write limit (64 MiB blocks, then fsync)."""
    block = 64 * MIB
    buf = aligned_random_buffer(block, seed=2)
    nbytes = max(block, size - size % block)
    path = os.path.join(directory, f"odirect-{os.getpid()}.bin")
    try:
        seconds = odirect_write(path, nbytes, buf)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"gibps": nbytes / GIB / seconds}


def child_pipeline(tier_kind: str, threads: int, size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Commit ``--versions`` versions with ``pipeline_threads=threads``; time each adopt + commit."""
    from asymstore import AsymStore, LocalTier, host_tier

    tensors = _tensors(size, args.tensor_mib * MIB, seed=3)
    root = tempfile.mkdtemp(prefix="host-pipeline-", dir="/dev/shm" if tier_kind == "shm" else args.dir)
    tier = host_tier(size * 2 + (256 << 20), path=root) if tier_kind == "shm" else LocalTier(root)
    times, cpus, flush = [], [], []

    async def run() -> None:
        # references="off": every version is the same bytes here, and the pipeline is what is measured (with
        # references on, the second version of a LocalTier would reference the first and write nothing)
        async with AsymStore([tier], pipeline_threads=threads, keep_last=1, compression=args.compression,
                             references="off",
                             flush_memory_bytes=args.flush_memory_mib * MIB) as store:
            for step in range(args.versions):
                c0, t0 = cpu_seconds(), time.perf_counter()
                if args.stage == "adopt":
                    await store.adopt_many(step, tensors)
                else:
                    await store.put_many(step, tensors)
                result = await store.commit(step)
                times.append(time.perf_counter() - t0)
                cpus.append(cpu_seconds() - c0)
                stats = result.flush[tier.name]
                flush.append({"segments": stats.segments, "segment_bytes": stats.segment_bytes,
                              "segment_bytes_source": stats.segment_bytes_source,
                              "write_seconds": stats.write_seconds, "threads": stats.pipeline_threads,
                              "inflight_peak_bytes": stats.inflight_peak_bytes,
                              "compressed": stats.chunks_compressed, "stored_bytes": stats.stored_bytes})
    try:
        with Pressure() as pressure:
            asyncio.run(run())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = size / GIB
    return {"gibps_best": gib / min(times), "gibps_median": gib / statistics.median(times),
            "cpu_s_per_gib": statistics.median(cpus) / gib, "seconds": times, "flush": flush,
            "pressure": pressure.share}


# -- the parent ----------------------------------------------------------------


def _default_threads() -> list[int]:
    cpus = len(os.sched_getaffinity(0))
    out = [1]
    while out[-1] * 2 <= cpus:
        out.append(out[-1] * 2)
    if out[-1] != cpus:
        out.append(cpus)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1536, help="the version's size (default 1536 MiB)")
    ap.add_argument("--tensor-mib", type=int, default=64, help="bytes of each tensor (default 64 MiB)")
    ap.add_argument("--threads", default=None, help="pipeline_threads values, comma separated (default 1,2,4,.. CPUs)")
    ap.add_argument("--tiers", default="shm,local", help="shm, local or both (default)")
    ap.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-out", "host_pipeline"),
                    help="where the local tier and the O_DIRECT limit write (default ./bench-out/host_pipeline)")
    ap.add_argument("--versions", type=int, default=2, help="versions committed per run (default 2)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of every configuration (default 2)")
    ap.add_argument("--stage", choices=["adopt", "put"], default="adopt")
    ap.add_argument("--compression", choices=["never", "auto", "always"], default="never")
    ap.add_argument("--flush-memory-mib", type=int, default=256, help="AsymStore(flush_memory_bytes) (default 256)")
    ap.add_argument("--out", default=None, help="JSON output path")
    add_quick_flag(ap, "256 MiB, threads 1 and 2, one round (~30 s): for development, not for figures")
    add_child_flag(ap, nargs=2, metavar=("KIND", "THREADS"))
    args = ap.parse_args()
    if args.quick:
        args.size_mib, args.tensor_mib, args.repeat = 256, 32, 1
        args.threads = args.threads or "1,2"
    size = args.size_mib * MIB
    os.makedirs(args.dir, exist_ok=True)
    if args.child is not None:
        kind, threads = args.child[0], int(args.child[1])
        if kind == "memcpy":
            result = child_memcpy(size)
        elif kind == "odirect":
            result = child_odirect(size, args.dir)
        else:
            result = child_pipeline(kind, threads, size, args)
        print(json.dumps(result))
        return
    threads = [int(t) for t in args.threads.split(",")] if args.threads else _default_threads()
    tiers = [t for t in args.tiers.split(",") if t]
    methods = ["memcpy:1"] + (["odirect:1"] if "local" in tiers else []) + [
        f"{tier}:{t}" for tier in tiers for t in threads]
    passthrough = ["--size-mib", str(args.size_mib), "--tensor-mib", str(args.tensor_mib), "--dir", args.dir,
                   "--versions", str(args.versions), "--stage", args.stage, "--compression", args.compression,
                   "--flush-memory-mib", str(args.flush_memory_mib)]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for rnd, method in rounds(methods, args.repeat):
        kind, t = method.split(":")
        settle()
        run = run_fresh(child_argv(__file__, *passthrough, "--child", kind, t), timeout=1800)
        if run.code != 0:
            print(f"{method} (round {rnd}) failed:\n{run.log[-3000:]}", file=sys.stderr)
            continue
        out = run.last_json()
        out["loadavg_1m"] = run.loadavg_1m
        results[method].append(out)
        print(f"round {rnd} {method}: {json.dumps({k: v for k, v in out.items() if k != 'flush'})[:200]}",
              flush=True)
    report(args, threads, tiers, results)


def _best(runs: list[dict[str, Any]], key: str) -> float:
    return max((r[key] for r in runs), default=float("nan"))


def report(args: argparse.Namespace, threads: list[int], tiers: list[str],
           results: dict[str, list[dict[str, Any]]]) -> None:
    memcpy = _best(results["memcpy:1"], "touched_gibps")
    fresh = _best(results["memcpy:1"], "fresh_gibps")
    xxh3 = min((r["xxh3_cpu_s_per_gib"] for r in results["memcpy:1"]), default=float("nan"))
    disk = _best(results.get("odirect:1", []), "gibps")
    loads = [r["loadavg_1m"] for runs in results.values() for r in runs]
    print(f"\nversion {args.size_mib} MiB ({args.stage}, compression={args.compression}); "
          f"single-thread memcpy {memcpy:.2f} GiB/s (touched), {fresh:.2f} (fresh pages); "
          f"O_DIRECT write {disk:.2f} GiB/s; one xxh3 pass {xxh3:.3f} CPU s/GiB; "
          f"load (1 min) {min(loads, default=0):.2f}-{max(loads, default=0):.2f}")
    print(f"{'tier':6} {'threads':>7} {'GiB/s best':>10} {'median':>7} {'CPU s/GiB':>9} {'target':>7} "
          f"{'ratio':>6}  met")
    rows = []
    for tier in tiers:
        for t in threads:
            runs = results[f"{tier}:{t}"]
            best = _best(runs, "gibps_best")
            med = statistics.median([r["gibps_median"] for r in runs]) if runs else float("nan")
            cpu = statistics.median([r["cpu_s_per_gib"] for r in runs]) if runs else float("nan")
            limit = t * memcpy if tier == "shm" else min(t * memcpy, disk)
            target = TARGET * limit
            ratio = best / limit if limit else float("nan")
            met = best >= target
            rows.append({"tier": tier, "threads": t, "gibps_best": best, "gibps_median": med, "cpu_s_per_gib": cpu,
                         "limit_gibps": limit, "target_gibps": target, "met": met})
            print(f"{tier:6} {t:7d} {best:10.2f} {med:7.2f} {cpu:9.3f} {target:7.2f} {ratio:6.2f}  "
                  f"{'yes' if met else 'no'}")
    for row in rows:
        if row["threads"] == threads[0] and row["cpu_s_per_gib"] == row["cpu_s_per_gib"]:
            print(f"{row['tier']}: one xxh3 pass is {xxh3 / row['cpu_s_per_gib'] * 100:.0f}% of a version's CPU "
                  f"at {threads[0]} thread(s) (the pass the staging takes; format 5 takes no second one for the "
                  "segment: its chunks' checksums prove it)")
    if args.out:
        write_json(args.out, {"args": vars(args), "git": git_state(), "cpus": len(os.sched_getaffinity(0)),
                              "memcpy_gibps": memcpy, "memcpy_fresh_gibps": fresh, "odirect_gibps": disk,
                              "xxh3_cpu_s_per_gib": xxh3, "rows": rows, "runs": results})


if __name__ == "__main__":
    main()
