"""Commit and restore throughput of AsymStore on a LocalTier, next to the disk's O_DIRECT limits.

Run by hand (never a timed test)::

    .venv/bin/python benches/store_throughput.py                 # 1, 2, 4 GiB, 2 repeats
    .venv/bin/python benches/store_throughput.py --sizes 1,2 --repeat 2 --dir /mnt/nvme/bench

For each checkpoint size it builds a state dict of many tensors (log-uniform
sizes from 1 KiB to 256 MiB plus one 256 MiB tensor per GiB, random bytes,
float32/bfloat16), then per repetition, on the same filesystem (``--dir``):

* ``dd write``: O_DIRECT sequential write of the same number of bytes, 64 MiB
  per ``write``, then ``fsync`` (the Python equivalent of
  ``dd if=/dev/zero of=F bs=64M count=N oflag=direct conv=fsync``, with random
  bytes from an aligned mmap buffer instead of zeros);
* ``commit``: ``put_many`` (host staging copy + chunk checksums; with
  ``--put adopt``, ``adopt_many``: checksums only, the buffers taken as they are) then
  ``commit`` (plan, build segments with their checksums while the previous
  one is written + fsynced, manifest, directory fsyncs, atomic rename, LATEST),
  i.e. until durable;
* ``dd read``: O_DIRECT sequential read of the dd file, 64 MiB per ``read``
  (``dd if=F of=/dev/null bs=64M iflag=direct``);
* ``restore``: ``AsymStore.restore(step)`` from a freshly opened store, cold:
  the page cache of the version's files is evicted first (``--evict``), and
  the fraction still resident is measured with ``mincore`` and reported.

Each repetition commits into a fresh store directory (removed afterwards,
outside the timings); the store's options are its defaults unless given
(``--segment-mib``, ``--compression``); the tier calibration is measured once
per run into ``DIR/calibration.json`` during the first ``open`` (untimed).

GB/s are 10**9 bytes per second of raw tensor bytes; ratios are
``commit / dd write`` and ``restore / dd read`` (targets: >= 0.8). The
median over repetitions is reported; every sample is in the JSON. The time
inside commit and restore is broken down by wrapping the tier (``TimedTier``);
``--profile-io`` also splits the time in ``write_parts`` into data writes
(``writev`` into the page cache, or O_DIRECT to the disk) and ``fsync``.

Outputs: JSON (``--out``) and a PNG plot next to it (GB/s vs checkpoint size).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import math
import mmap
import os
import platform
import random
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from common import (
    DD_BLOCK,
    GIB,
    KIB,
    MIB,
    REPO,
    Pressure,
    aligned_random_buffer,
    cpu_seconds,
    evict,
    files_under,
    gbps,
    git_state,
    median,
    odirect_read,
    odirect_write,
    pyplot,
    same_bytes,
    save_figure,
    write_json,
)

import asymstore.tiers.local
from asymstore import AsymStore, LocalTier
from asymstore.tiers.protocol import Buffer, VersionWriter

MIN_TENSOR = 1 * KIB
MAX_TENSOR = 256 * MIB


# -- the checkpoint ---------------------------------------------------------


def tensor_sizes(total: int, rng: random.Random) -> list[int]:
    """Byte sizes summing to ``total``: one 256 MiB tensor per GiB, the rest log-uniform in [1 KiB, 256 MiB]."""
    sizes = [MAX_TENSOR] * max(1, round(total / GIB))
    remaining = total - sum(sizes)
    lo, hi = math.log(MIN_TENSOR), math.log(MAX_TENSOR)
    while remaining > 0:
        size = int(math.exp(rng.uniform(lo, hi))) // 4 * 4
        size = min(max(size, MIN_TENSOR), remaining)
        sizes.append(size)
        remaining -= size
    rng.shuffle(sizes)
    return sizes


def make_state(total: int, seed: int, data: str = "random") -> dict[str, torch.Tensor]:
    """A state dict of ``total`` bytes over many float32/bfloat16 tensors.

    ``data="random"``: uniformly random bytes (incompressible: the store's
    codec has nothing to gain, so this measures the I/O path). ``"randn"``:
    normally distributed values (float-like byte planes, where the exponent
    bytes compress).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if data == "randn":
        pool = torch.randn((MAX_TENSOR + 64 * MIB) // 4, generator=gen).view(torch.uint8)
    else:
        pool = torch.randint(0, 256, (MAX_TENSOR + 64 * MIB,), dtype=torch.uint8, generator=gen)
    state: dict[str, torch.Tensor] = {}
    for i, size in enumerate(tensor_sizes(total, rng)):
        dtype = torch.bfloat16 if size % 2 == 0 and rng.random() < 0.5 else torch.float32
        if size % 4:
            dtype = torch.uint8
        raw = torch.empty(size, dtype=torch.uint8)
        start = rng.randrange(0, 64 * MIB // 4) * 4  # float32 aligned, so randn stays float-like
        raw.copy_(pool[start:start + size])
        t = raw.view(dtype)
        cols = 1024 if t.numel() % 1024 == 0 and t.numel() > 1024 else t.numel()
        state[f"model.layers.{i}.{'weight' if size > MIB else 'bias'}"] = t.view(-1, cols)
    return state


def describe_state(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Count and size distribution of the tensors."""
    sizes = sorted(t.numel() * t.element_size() for t in state.values())
    return {
        "tensors": len(sizes),
        "bytes": sum(sizes),
        "min_bytes": sizes[0],
        "median_bytes": int(statistics.median(sizes)),
        "max_bytes": sizes[-1],
        "count_le_1MiB": sum(s <= MIB for s in sizes),
        "count_ge_64MiB": sum(s >= 64 * MIB for s in sizes),
    }


# -- a tier wrapper that records where the time goes ------------------------


@dataclass
class Timings:
    """Timestamps (perf_counter) recorded by :class:`TimedTier`."""

    begin: float | None = None
    segments: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, bytes)
    publish: tuple[float, float] | None = None
    latest: tuple[float, float] | None = None
    manifest_read: tuple[float, float] | None = None
    writev_s: float = 0.0  # with --profile-io: data writes (writev or O_DIRECT) inside write_parts
    fsync_s: float = 0.0

    def reset(self) -> None:
        """Forget everything recorded."""
        fresh = Timings()
        for name in vars(fresh):
            setattr(self, name, getattr(fresh, name))


class _TimedWriter:
    def __init__(self, inner: VersionWriter, timings: Timings) -> None:
        self.inner = inner
        self.timings = timings

    async def write_segment(self, name: str, parts: Sequence[Buffer]) -> None:
        start = time.perf_counter()
        await self.inner.write_segment(name, parts)
        self.timings.segments.append((start, time.perf_counter(), sum(len(p) for p in parts)))

    async def publish(self, manifest: bytes) -> None:
        start = time.perf_counter()
        await self.inner.publish(manifest)
        self.timings.publish = (start, time.perf_counter())

    async def abort(self) -> None:
        await self.inner.abort()


class TimedTier:
    """A LocalTier (by delegation) that timestamps writes, publish and reads."""

    persistent = True

    def __init__(self, inner: LocalTier, timings: Timings) -> None:
        self.inner = inner
        self.timings = timings
        self.name = inner.name
        self.keep_last = inner.keep_last

    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def list_versions(self) -> list[int]:
        return await self.inner.list_versions()

    async def begin(self, step: int, nbytes: int) -> VersionWriter:
        self.timings.begin = time.perf_counter()
        return _TimedWriter(await self.inner.begin(step, nbytes), self.timings)

    async def read_manifest(self, step: int) -> bytes:
        start = time.perf_counter()
        data = await self.inner.read_manifest(step)
        self.timings.manifest_read = (start, time.perf_counter())
        return data

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        start = time.perf_counter()
        data = await self.inner.read_segment(step, name, size)
        self.timings.segments.append((start, time.perf_counter(), len(data)))
        return data

    async def delete_version(self, step: int) -> None:
        await self.inner.delete_version(step)

    async def quarantine(self, step: int) -> None:
        await self.inner.quarantine(step)

    async def write_latest(self, step: int) -> None:
        start = time.perf_counter()
        await self.inner.write_latest(step)
        self.timings.latest = (start, time.perf_counter())

    async def read_latest(self) -> int | None:
        return await self.inner.read_latest()

    def __getattr__(self, name: str) -> Any:
        # optional tier methods (calibration_key, probe_writes, ...) go to the LocalTier, so the
        # store calibrates and plans exactly as it would for the LocalTier itself
        return getattr(self.inner, name)


def install_io_profiler(timings: Timings) -> Callable[[], None]:
    """Make LocalTier's segment writes record data-write and fsync time separately; return the undo.

    ``write_parts`` (as LocalTier calls it) is timed as a whole, and ``os.fsync``
    calls made inside it are timed apart; the data time is the difference
    (``writev`` into the page cache, or O_DIRECT writes straight to the disk).
    """
    original = getattr(asymstore.tiers.local, "write_parts")  # noqa: B009  # not re-exported
    real_fsync = os.fsync
    inside = threading.local()

    def timed_fsync(fd: Any) -> None:
        start = time.perf_counter()
        try:
            real_fsync(fd)
        finally:
            if getattr(inside, "on", False):
                timings.fsync_s += time.perf_counter() - start

    def timed_write_parts(path: str, parts: Sequence[Buffer], *, fsync: bool = True) -> int:
        inside.on = True
        before = timings.fsync_s
        start = time.perf_counter()
        try:
            return int(original(path, parts, fsync=fsync))
        finally:
            inside.on = False
            timings.writev_s += time.perf_counter() - start - (timings.fsync_s - before)

    setattr(asymstore.tiers.local, "write_parts", timed_write_parts)  # noqa: B010
    os.fsync = timed_fsync

    def undo() -> None:
        setattr(asymstore.tiers.local, "write_parts", original)  # noqa: B010
        os.fsync = real_fsync

    return undo


# -- one repetition ---------------------------------------------------------


def span(intervals: Sequence[tuple[float, float, int]]) -> float:
    """Wall time from the first start to the last end."""
    return max(e for _, e, _ in intervals) - min(s for s, _, _ in intervals) if intervals else 0.0


def make_tier(root: str, options: dict[str, Any]) -> LocalTier:
    """The tier under test: a LocalTier, or with ``--tier nvme`` an NVMeTier (a LocalTier with an I/O engine)."""
    if options["tier"] == "nvme":
        from asymstore.tiers.nvme import NVMeTier

        return NVMeTier(root, engine="posix")
    return LocalTier(root)


def store_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """The AsymStore keyword arguments in ``options``."""
    return {k: v for k, v in options.items() if k not in ("tier", "put")}


def store_options(args: argparse.Namespace) -> dict[str, Any]:
    """Tier kind and AsymStore keyword arguments from the command line (only those given, else defaults)."""
    kwargs: dict[str, Any] = {"tier": args.tier, "put": args.put, "keep_last": None,
                              "calibration_cache": args.calibration_cache}
    if args.segment_mib:
        kwargs["segment_bytes"] = args.segment_mib * MIB
    if args.compression:
        kwargs["compression"] = args.compression
    return kwargs


def plain(value: Any) -> Any:
    """A JSON-able form of a dataclass (or anything: its repr)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


async def commit_once(root: str, state: dict[str, torch.Tensor], step: int, timings: Timings,
                      options: dict[str, Any]) -> dict[str, Any]:
    """put_many + commit into a fresh store at ``root``; return the time breakdown."""
    async with AsymStore([TimedTier(make_tier(root, options), timings)], **store_kwargs(options)) as store:
        timings.reset()  # after open: the calibration probe (if any) is not part of the commit
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        if options.get("put") == "adopt":  # the one-copy path: the store takes the buffers as they are
            await store.adopt_many(step, state)
        else:
            await store.put_many(step, state)
        t1 = time.perf_counter()
        c1 = cpu_seconds()
        result = await store.commit(step, meta={"bench": True})
        t2 = time.perf_counter()
        c2 = cpu_seconds()
        status = store.status() if hasattr(store, "status") else {}
    assert timings.begin is not None and timings.publish is not None
    writes = sum(e - s for s, e, _ in timings.segments)
    stream = timings.publish[0] - timings.begin
    out: dict[str, Any] = {
        "put_s": t1 - t0,
        "commit_s": t2 - t1,
        "put_cpu_s": c1 - c0,  # CPU time of this process (all threads), less sensitive to other load
        "commit_cpu_s": c2 - c1,
        "total_s": t2 - t0,
        "plan_s": timings.begin - t1,  # seal, wait for puts, per-tier plan (codec sampling, segment size)
        "stream_s": stream,  # first segment begun -> last written (building k+1 overlaps writing k)
        "segment_write_s": writes,  # inside write_segment: copy to disk + fsync per segment
        "fill_wait_s": stream - writes,  # waiting for the next segment to be built (checksum/compress)
        "publish_s": timings.publish[1] - timings.publish[0],  # manifest + fsyncs + rename
        "after_publish_s": t2 - timings.publish[1],  # LATEST + retention
        "segments": len(timings.segments),
        "segment_bytes_max": max((n for _, _, n in timings.segments), default=0),
        "stored_bytes": result.manifest.stored_bytes,
    }
    if timings.writev_s or timings.fsync_s:
        out["writev_s"] = timings.writev_s
        out["fsync_s"] = timings.fsync_s
    for tier_status in status.values():
        out["flush"] = plain(getattr(tier_status, "last_flush", None))
        out["calibration"] = plain(getattr(tier_status, "calibration", None))
    return out


async def restore_once(root: str, step: int, timings: Timings,
                       options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore ``step`` from a freshly opened store; return the time breakdown and the tensors."""
    async with AsymStore([TimedTier(make_tier(root, options), timings)], **store_kwargs(options)) as store:
        timings.reset()
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        ckpt = await store.restore(step)
        t1 = time.perf_counter()
        c1 = cpu_seconds()
    reads = timings.segments
    out = {
        "restore_s": t1 - t0,
        "restore_cpu_s": c1 - c0,
        "read_span_s": span(reads),  # first segment read started -> last one finished
        "read_sum_s": sum(e - s for s, e, _ in reads),  # summed over the concurrent reads
        "after_reads_s": t1 - max((e for _, e, _ in reads), default=t1),  # decode + chunk checksums
    }
    return out, ckpt.tensors


def run_size(size_gib: float, args: argparse.Namespace, dd_buf: mmap.mmap, timings: Timings) -> dict[str, Any]:
    """Every repetition for one checkpoint size; return its JSON record."""
    nbytes = int(size_gib * GIB) // DD_BLOCK * DD_BLOCK
    t_gen = time.perf_counter()
    state = make_state(nbytes, args.seed + int(size_gib * 1000), args.data)
    options = store_options(args)
    shape = describe_state(state)
    print(f"\n== {nbytes / GIB:g} GiB: {shape['tensors']} tensors, {shape['min_bytes']} B .. "
          f"{shape['max_bytes'] / MIB:.0f} MiB, median {shape['median_bytes'] / KIB:.0f} KiB "
          f"(built in {time.perf_counter() - t_gen:.1f} s)", flush=True)
    workdir = os.path.join(args.dir, f"size-{nbytes // MIB}MiB")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    dd_file = os.path.join(workdir, "dd.bin")
    reps: list[dict[str, Any]] = []
    for rep in range(args.repeat):
        rec: dict[str, Any] = {"rep": rep}
        # dd write limit, then the commit, then dd read limit, then the restore: each
        # store measurement sits next to the matching limit, so drift hits both.
        rec["dd_write_s"] = odirect_write(dd_file, nbytes, dd_buf)
        root = os.path.join(workdir, f"store-r{rep}")
        step = 1000 + rep
        with Pressure() as psi:
            rec.update(asyncio.run(commit_once(root, state, step, timings, options)))
        rec["commit_psi_some"] = psi.share
        rec["dd_write_resident"] = evict([dd_file], args.evict)
        rec["dd_read_s"], got = odirect_read(dd_file, dd_buf)
        assert got == nbytes, (got, nbytes)
        os.unlink(dd_file)
        rec["store_resident_before_restore"] = evict(files_under(root), args.evict)
        with Pressure() as psi:
            restored, tensors = asyncio.run(restore_once(root, step, timings, options))
        rec["restore_psi_some"] = psi.share
        rec["loadavg_1m"] = os.getloadavg()[0]
        rec.update(restored)
        if rep == 0 or args.verify_all:
            bad = [n for n, t in state.items() if not same_bytes(t, tensors[n])]
            if bad or len(tensors) != len(state):
                raise SystemExit(f"restore is not bit-exact: {bad[:5]}")
            rec["verified"] = True
        del tensors
        gc.collect()
        shutil.rmtree(root)
        rec["commit_gbps"] = gbps(nbytes, rec["total_s"])
        rec["put_gbps"] = gbps(nbytes, rec["put_s"])
        rec["durable_write_gbps"] = gbps(nbytes, rec["commit_s"])
        rec["restore_gbps"] = gbps(nbytes, rec["restore_s"])
        rec["dd_write_gbps"] = gbps(nbytes, rec["dd_write_s"])
        rec["dd_read_gbps"] = gbps(nbytes, rec["dd_read_s"])
        reps.append(rec)
        print(f"  rep {rep}: commit {rec['commit_gbps']:.2f} GB/s (put {rec['put_s']:.2f} s + durable "
              f"{rec['commit_s']:.2f} s) vs dd write {rec['dd_write_gbps']:.2f} | restore "
              f"{rec['restore_gbps']:.2f} GB/s vs dd read {rec['dd_read_gbps']:.2f} | still cached before "
              f"restore {rec['store_resident_before_restore']:.1%} | cpu pressure commit "
              f"{rec['commit_psi_some'].get('cpu', math.nan):.0%} restore "
              f"{rec['restore_psi_some'].get('cpu', math.nan):.0%}"
              f", load {rec['loadavg_1m']:.1f}", flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    del state
    gc.collect()

    def med(key: str) -> float:
        return median([r[key] for r in reps if key in r])

    summary = {k: med(k) for k in (
        "commit_gbps", "restore_gbps", "dd_write_gbps", "dd_read_gbps", "put_gbps", "durable_write_gbps",
        "put_s", "commit_s", "total_s", "put_cpu_s", "commit_cpu_s", "restore_cpu_s",
        "plan_s", "stream_s", "segment_write_s", "fill_wait_s", "publish_s",
        "after_publish_s", "segments", "segment_bytes_max", "stored_bytes",
        "writev_s", "fsync_s", "restore_s", "read_span_s", "read_sum_s", "after_reads_s",
        "dd_write_s", "dd_read_s", "store_resident_before_restore", "loadavg_1m")}
    for phase in ("commit", "restore"):
        for res in ("cpu", "io"):
            summary[f"{phase}_psi_{res}"] = median([r[f"{phase}_psi_some"][res] for r in reps
                                                     if res in r[f"{phase}_psi_some"]])
    summary["commit_ratio"] = median([r["commit_gbps"] / r["dd_write_gbps"] for r in reps])
    summary["restore_ratio"] = median([r["restore_gbps"] / r["dd_read_gbps"] for r in reps])
    return {"size_gib": nbytes / GIB, "bytes": nbytes, "state": shape, "median": summary, "reps": reps}


# -- output -----------------------------------------------------------------


def print_table(results: Sequence[dict[str, Any]]) -> None:
    """The summary table (medians)."""
    head = (f"{'GiB':>4} {'commit':>7} {'ddW':>6} {'c/ddW':>6} {'restore':>8} {'ddR':>6} {'r/ddR':>6} "
            f"{'put s':>6} {'plan s':>6} {'segW s':>6} {'fillW s':>7} {'publ s':>6} {'read s':>6} {'decode s':>8} "
            f"{'cpuPSI':>6}")
    print("\nmedians, GB/s (10^9 B/s) unless marked s; cpuPSI: share of the commit's wall time some task on the"
          " machine waited for a CPU (other load)\n" + head)
    for res in results:
        m = res["median"]
        print(f"{res['size_gib']:>4g} {m['commit_gbps']:>7.2f} {m['dd_write_gbps']:>6.2f} {m['commit_ratio']:>6.2f} "
              f"{m['restore_gbps']:>8.2f} {m['dd_read_gbps']:>6.2f} {m['restore_ratio']:>6.2f} "
              f"{m['put_s']:>6.2f} {m['plan_s']:>6.2f} {m['segment_write_s']:>6.2f} {m['fill_wait_s']:>7.2f} "
              f"{m['publish_s']:>6.2f} {m['read_span_s']:>6.2f} {m['after_reads_s']:>8.2f} "
              f"{m['commit_psi_cpu']:>6.0%}")
        print(f"     {m['segments']:.0f} segments of up to {m['segment_bytes_max'] / MIB:.0f} MiB, stored "
              f"{m['stored_bytes'] / res['bytes']:.3f} of raw; CPU s: put {m['put_cpu_s']:.2f}, commit "
              f"{m['commit_cpu_s']:.2f}, restore {m['restore_cpu_s']:.2f}")
        if not math.isnan(m["writev_s"]):
            print(f"     in write_parts: data writes {m['writev_s']:.2f} s + fsync {m['fsync_s']:.2f} s")


def plot(results: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Left: GB/s vs checkpoint size for commit, restore, put and the O_DIRECT limits. Right: the ratios."""
    plt = pyplot()
    sizes = [r["size_gib"] for r in results]
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(13, 5), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    series = [
        ("commit_gbps", "commit (put_many + commit, until durable)", "tab:blue", "-", "o"),
        ("dd_write_gbps", "O_DIRECT write limit (dd oflag=direct)", "tab:blue", "--", "s"),
        ("restore_gbps", "restore (cold page cache)", "tab:orange", "-", "o"),
        ("dd_read_gbps", "O_DIRECT read limit (dd iflag=direct)", "tab:orange", "--", "s"),
        ("put_gbps", "put_many alone (staging copy + checksums)", "tab:gray", ":", "^"),
        ("durable_write_gbps", "commit alone (after put_many)", "tab:green", ":", "v"),
    ]
    for key, label, color, style, marker in series:
        med = [r["median"][key] for r in results]
        lo = [m - min(x[key] for x in r["reps"]) for m, r in zip(med, results, strict=True)]
        hi = [max(x[key] for x in r["reps"]) - m for m, r in zip(med, results, strict=True)]
        ax.errorbar(sizes, med, yerr=[lo, hi], label=label, color=color, linestyle=style, marker=marker, capsize=3)
    for key, label, color in (("commit_ratio", "commit / O_DIRECT write", "tab:blue"),
                              ("restore_ratio", "restore / O_DIRECT read", "tab:orange")):
        rx.plot(sizes, [r["median"][key] for r in results], label=label, color=color, marker="o")
    rx.axhline(0.8, color="tab:red", linestyle="--", linewidth=1, label="target 0.8")
    for a in (ax, rx):
        a.set_xscale("log", base=2)
        a.set_xticks(sizes, [f"{x:g}" for x in sizes])
        a.set_xlabel("checkpoint size (GiB)")
        a.set_ylim(bottom=0)
        a.grid(True, alpha=0.3)
    ax.set_ylabel("GB/s (10^9 B/s): median of repeats, bars min-max")
    rx.set_ylabel("ratio to the disk's O_DIRECT limit (median of per-repeat ratios)")
    rx.set_ylim(0, max(1.2, *(r["median"][k] * 1.1 for r in results for k in ("commit_ratio", "restore_ratio"))))
    ax.legend(fontsize=8, loc="best")
    rx.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def parse_sizes(text: str) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0] (GiB)."""
    sizes = [float(s) for s in text.split(",") if s.strip()]
    if not sizes or any(s * GIB < DD_BLOCK for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes are GiB, each at least {DD_BLOCK / GIB:g}")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dir", default=str(REPO / "bench-out" / "store-throughput"),
                        help="directory on the disk under test (default: bench-out/store-throughput)")
    parser.add_argument("--sizes", type=parse_sizes, default=[1.0, 2.0, 4.0], help="checkpoint sizes, GiB (1,2,4)")
    parser.add_argument("--repeat", type=int, default=2, help="repetitions per size; medians reported (2)")
    parser.add_argument("--out", default=str(REPO / "bench-out" / "store_throughput.json"), help="JSON output")
    parser.add_argument("--plot", default=None, help="PNG output (default: --out with .png)")
    parser.add_argument("--evict", choices=["fadvise", "drop_caches"], default="fadvise",
                        help="cold cache by posix_fadvise(DONTNEED) per file (default) or /proc/sys/vm/drop_caches")
    parser.add_argument("--tier", choices=["local", "nvme"], default="local",
                        help="LocalTier (default), or NVMeTier with its POSIX engine (parallel O_DIRECT)")
    parser.add_argument("--segment-mib", type=int, default=0,
                        help="fixed segment size, MiB (0: the store's choice from the tier calibration)")
    parser.add_argument("--compression", choices=["auto", "never", "always"], default=None,
                        help="store compression policy (default: the store's default)")
    parser.add_argument("--data", choices=["random", "randn"], default="random",
                        help="tensor contents: random bytes (incompressible, default) or normal floats")
    parser.add_argument("--calibration-cache", default=None,
                        help="store calibration cache file (default: DIR/calibration.json, removed at start so "
                             "the tier is measured once per run, with the code under test)")
    parser.add_argument("--profile-io", action="store_true", help="split segment writes into writev and fsync")
    parser.add_argument("--verify-all", action="store_true", help="check bit-exactness every repetition, not the first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--put", choices=["copy", "adopt"], default="copy",
                        help="stage with put_many (a private copy) or adopt_many (the caller's buffers, no copy)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    os.makedirs(args.dir, exist_ok=True)
    if args.calibration_cache is None:
        args.calibration_cache = os.path.join(args.dir, "calibration.json")
        if os.path.exists(args.calibration_cache):
            os.unlink(args.calibration_cache)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    plot_path = args.plot or os.path.splitext(args.out)[0] + ".png"

    timings = Timings()
    undo = install_io_profiler(timings) if args.profile_io else None
    dd_buf = aligned_random_buffer(DD_BLOCK, args.seed)
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    try:
        for size in args.sizes:
            results.append(run_size(size, args, dd_buf, timings))
    finally:
        if undo:
            undo()
        dd_buf.close()
    elapsed = time.perf_counter() - started

    evict_note = ("posix_fadvise(POSIX_FADV_DONTNEED) on every file of the version after fdatasync"
                  if args.evict == "fadvise" else "sync + echo 1 > /proc/sys/vm/drop_caches")
    env = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "dir": os.path.abspath(args.dir),
        "statvfs_free_gib": os.statvfs(args.dir).f_bavail * os.statvfs(args.dir).f_frsize / GIB,
        "loadavg_at_end": os.getloadavg(),
        "git": git_state(),
        "options": {k: v for k, v in vars(args).items() if k != "sizes"},
    }
    doc = {
        "command": " ".join([sys.executable, *sys.argv]),
        "units": "GB/s = 1e9 bytes/s of raw tensor bytes; *_s = seconds (median over repeats)",
        "cold_cache_method": evict_note,
        "dd_limits": f"O_DIRECT, {DD_BLOCK // MIB} MiB blocks, random bytes from an aligned mmap buffer, fsync "
                     "after writing (Python equivalent of dd oflag=direct conv=fsync / iflag=direct)",
        "targets": {"commit_ratio": 0.8, "restore_ratio": 0.8},
        "environment": env,
        "elapsed_s": elapsed,
        "results": results,
    }
    write_json(args.out, doc)
    print_table(results)
    print(f"\ncold cache: {evict_note}")
    print(f"wrote {args.out} and {plot_path} in {elapsed:.0f} s")
    psi = [r["median"]["commit_psi_cpu"] for r in results]
    plot(results, plot_path, f"asymstore {args.tier} tier on {os.path.abspath(args.dir)} ({args.data} data); "
                             f"{os.cpu_count()} CPUs, cold restore via {args.evict}, medians of {args.repeat}; "
                             f"CPU pressure from other load during commits {min(psi):.0%}-{max(psi):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
