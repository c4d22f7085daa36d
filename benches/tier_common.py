"""What the tier throughput scenarios share: the bytes, the device limits, a case, and the measurement of one.

Imported by benches/tier_throughput.py (the command line and the report) and
benches/tier_scenarios.py (which cases each ``--tiers`` key builds), as
sibling modules; benches/common.py holds what every bench shares. A case
(:class:`Case`) says how to make the tier and its device limit; :func:`run_case`
measures every repetition of it at the tier level and :func:`store_roundtrip`
through :class:`asymstore.AsymStore`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import mmap
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from common import (
    MIB,
    Pressure,
    cpu_seconds,
    evict,
    gbps,
    median,
    odirect_read,
    odirect_write,
)

from asymstore import AsymStore
from asymstore.format.tensors import as_bytes
from asymstore.tiers import NVMeTier, Tier
from asymstore.tiers.protocol import Buffer

STORE_TENSOR = 16 * MIB
MANIFEST = b'{"bench": "tier_throughput"}\n'


# -- the bytes ---------------------------------------------------------------


def u8(buf: Buffer | torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over ``buf`` (no copy)."""
    if isinstance(buf, torch.Tensor):
        return buf.view(-1).view(torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: only read here
        return torch.frombuffer(buf, dtype=torch.uint8)


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` random bytes (incompressible), touched, in one tensor."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def segment_name(i: int) -> str:
    """The file name of segment ``i`` (the store's naming)."""
    return f"seg-{i:06d}.bin"


def same(a: Buffer | torch.Tensor, b: Buffer | torch.Tensor) -> bool:
    """Byte equality."""
    ta, tb = u8(a), u8(b)
    return ta.numel() == tb.numel() and bool(torch.equal(ta.cpu(), tb.cpu()))


# -- device limits -------------------------------------------------------------


class Limit:
    """The device's limit for moving the same bytes; each method returns seconds."""

    description = ""

    def write(self, data: memoryview, seg: int) -> float:
        """Seconds to move ``data`` (contiguous; the tier gets it in ``seg``-byte segments) to the device."""
        raise NotImplementedError

    def read(self) -> float:
        """Seconds to move them back (cold where the device has a cache)."""
        raise NotImplementedError

    def extra(self) -> dict[str, float]:
        """Side measurements of the last write/read (seconds), for the JSON."""
        return {}

    def close(self) -> None:
        """Free buffers and files."""


class MemcpyLimit(Limit):
    """memcpy into preallocated, touched host memory: memoryview assignment and ``torch.copy_``, the faster."""

    description = ("memcpy of the same segments into a preallocated touched buffer (faster of memoryview slice "
                   "assignment and torch copy_)")

    def __init__(self, nbytes: int) -> None:
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)  # zeros: every page touched before timing
        self.out = torch.zeros(nbytes, dtype=torch.uint8)
        self.seg = 0
        self._extra: dict[str, float] = {}

    def write(self, data: memoryview, seg: int) -> float:
        """Copy ``data`` into ``dst`` by segment; both primitives are timed, the faster is returned."""
        self.seg = seg
        n = len(data)
        dst, src = as_bytes(self.dst), u8(data)
        t0 = time.perf_counter()
        for pos in range(0, n, seg):
            dst[pos:pos + seg] = data[pos:pos + seg]
        t_view = time.perf_counter() - t0
        t0 = time.perf_counter()
        for pos in range(0, n, seg):
            self.dst[pos:pos + seg].copy_(src[pos:pos + seg])
        t_torch = time.perf_counter() - t0
        self._extra = {"write_memoryview_s": t_view, "write_torch_copy_s": t_torch}
        return min(t_view, t_torch)

    def read(self) -> float:
        """Copy ``dst`` back into ``out`` by segment; also time a copy into fresh buffers (recorded only)."""
        n = self.dst.numel()
        src, out = as_bytes(self.dst), as_bytes(self.out)
        t0 = time.perf_counter()
        for pos in range(0, n, self.seg):
            out[pos:pos + self.seg] = src[pos:pos + self.seg]
        t_view = time.perf_counter() - t0
        t0 = time.perf_counter()
        for pos in range(0, n, self.seg):
            self.out[pos:pos + self.seg].copy_(self.dst[pos:pos + self.seg])
        t_torch = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh = [bytearray(src[pos:pos + self.seg]) for pos in range(0, n, self.seg)]
        t_fresh = time.perf_counter() - t0
        del fresh
        self._extra.update({"read_memoryview_s": t_view, "read_torch_copy_s": t_torch, "fresh_copy_s": t_fresh})
        return min(t_view, t_torch)

    def extra(self) -> dict[str, float]:
        """The time of each primitive, and of a copy into fresh buffers (``bytearray(view)``)."""
        return dict(self._extra)

    def close(self) -> None:
        """Free the buffers."""
        del self.dst, self.out


class CudaLimit(Limit):
    """Host->device copy of the segments (write), device->host into preallocated host memory (read)."""

    description = ("host->device copy of the same segments into preallocated device memory (write); "
                   "device->host into a preallocated pageable host buffer (read); device->device recorded")

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.zeros(nbytes, dtype=torch.uint8)
        self.seg = 0
        self._extra: dict[str, float] = {}

    def write(self, data: memoryview, seg: int) -> float:
        """H2D copy of each segment (pageable source, as the tier gets it), synchronized."""
        self.seg = seg
        src = u8(data)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for pos in range(0, len(data), seg):
            self.dev[pos:pos + seg].copy_(src[pos:pos + seg])
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def read(self) -> float:
        """D2H copy by segment into preallocated host memory; a D2D copy is timed too."""
        n = self.dev.numel()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for pos in range(0, n, self.seg):
            self.host[pos:pos + self.seg].copy_(self.dev[pos:pos + self.seg])
        torch.cuda.synchronize()
        t_d2h = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.dev2.copy_(self.dev)
        torch.cuda.synchronize()
        self._extra = {"device_to_device_s": time.perf_counter() - t0}
        return t_d2h

    def extra(self) -> dict[str, float]:
        """The device->device copy time."""
        return dict(self._extra)

    def close(self) -> None:
        """Free device and host memory."""
        del self.dev, self.dev2, self.host
        torch.cuda.empty_cache()


class DiskLimit(Limit):
    """O_DIRECT sequential write (64 MiB blocks, then fsync) and read of a file of the same size."""

    description = ("O_DIRECT sequential write of the same bytes in 64 MiB blocks + fsync, and O_DIRECT sequential "
                   "read (dd oflag=direct conv=fsync / iflag=direct), same filesystem")

    def __init__(self, directory: str, buf: mmap.mmap) -> None:
        self.path = os.path.join(directory, "dd-limit.bin")
        self.buf = buf
        self.nbytes = 0
        self.resident = 0.0

    def write(self, data: memoryview, seg: int) -> float:
        """dd-like write of ``len(data)`` bytes (random bytes from the dd buffer)."""
        self.nbytes = len(data)
        return odirect_write(self.path, self.nbytes, self.buf)

    def read(self) -> float:
        """dd-like read after evicting the file."""
        self.resident = evict([self.path], "fadvise")
        seconds, got = odirect_read(self.path, self.buf)
        if got != self.nbytes:
            raise OSError(f"dd read {got} of {self.nbytes} bytes")
        return seconds

    def extra(self) -> dict[str, float]:
        """Fraction of the dd file still cached before its read."""
        return {"resident_before_read": self.resident}

    def close(self) -> None:
        """Remove the file."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ArrowLimit(Limit):
    """A plain pyarrow upload and download of one object of the same size, with the tier's filesystem object."""

    description = ("plain pyarrow upload of one object of the same size (open_output_stream + one write) and "
                   "download (open_input_file + readinto a preallocated buffer), with the tier's filesystem object")

    def __init__(self, fs: Any, path: str, local_path: str | None) -> None:
        self.fs = fs
        self.path = path
        self.local_path = local_path  # file://: the file on disk, evicted before the read
        self.out = bytearray()
        self.resident = math.nan

    def write(self, data: memoryview, seg: int) -> float:
        """Upload ``data`` as one object (one write of the whole buffer)."""
        nbytes = len(data)
        if len(self.out) != nbytes:
            self.out = bytearray(nbytes)
            u8(self.out).fill_(1)  # touch every page before timing
        t0 = time.perf_counter()
        with self.fs.open_output_stream(self.path) as f:
            f.write(data)
        seconds = time.perf_counter() - t0
        if self.local_path:  # untimed: its dirty pages would otherwise throttle the tier's writes that follow
            fd = os.open(self.local_path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        return seconds

    def read(self) -> float:
        """Download the object into the preallocated buffer."""
        if self.local_path:
            self.resident = evict([self.local_path], "fadvise")
        view = memoryview(self.out)
        t0 = time.perf_counter()
        with self.fs.open_input_file(self.path) as f:
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise OSError(f"{self.path}: short read")
                done += n
        return time.perf_counter() - t0

    def extra(self) -> dict[str, float]:
        """Fraction of the file still cached before its read (file:// only)."""
        return {} if math.isnan(self.resident) else {"resident_before_read": self.resident}

    def close(self) -> None:
        """Delete the object and free the buffer."""
        with contextlib.suppress(OSError):
            self.fs.delete_file(self.path)
        self.out = bytearray()


# -- a case --------------------------------------------------------------------


@dataclass
class Case:
    """One tier configuration and the limit it is compared with."""

    key: str
    label: str
    nbytes: int
    make: Callable[[], Tier]
    make_limit: Callable[[Tier], Limit]
    cold_files: Callable[[Tier, int], list[str]] | None = None  # files to evict before a read
    warm_up: bool = False  # one untimed version first (in-memory tiers: fills the buffer pool)
    notes: list[str] = field(default_factory=list)


def kvikio_settings() -> dict[str, Any]:
    """kvikio's version and I/O settings, as it runs in this process."""
    import kvikio
    import kvikio.defaults

    out: dict[str, Any] = {"version": kvikio.__version__}
    for key in ("compat_mode", "num_threads", "task_size", "auto_direct_io_read", "auto_direct_io_write",
                "bounce_buffer_size"):
        with contextlib.suppress(Exception):
            value = kvikio.defaults.get(key)
            out[key] = getattr(value, "name", value)  # enums by name (compat_mode: ON, OFF, AUTO)
    with contextlib.suppress(Exception):
        out["compat_mode_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    return out


# -- one case ------------------------------------------------------------------


async def tier_write(tier: Tier, step: int, segments: Sequence[memoryview]) -> dict[str, float]:
    """begin -> write_segment each -> publish; the time of each phase."""
    nbytes = sum(len(s) for s in segments)
    t0 = time.perf_counter()
    writer = await tier.begin(step, nbytes)
    t1 = time.perf_counter()
    for i, seg in enumerate(segments):
        await writer.write_segment(segment_name(i), [seg])
    t2 = time.perf_counter()
    await writer.publish(MANIFEST)
    t3 = time.perf_counter()
    return {"write_s": t3 - t0, "begin_s": t1 - t0, "segments_s": t2 - t1, "publish_s": t3 - t2}


async def tier_read(tier: Tier, step: int, count: int, read_ahead: int) -> tuple[float, list[Buffer]]:
    """read_segment of every segment, ``read_ahead`` at a time; (seconds, buffers)."""
    sem = asyncio.Semaphore(read_ahead)

    async def one(i: int) -> Buffer:
        async with sem:
            return await tier.read_segment(step, segment_name(i))
    t0 = time.perf_counter()
    bufs = await asyncio.gather(*(one(i) for i in range(count)))
    return time.perf_counter() - t0, list(bufs)


async def settle() -> None:
    """Free what the last read returned before anything else is timed.

    gather's finished tasks keep their results until the event loop runs their done callbacks;
    without a few loop turns here, the next timed write would start by unmapping the 1 GiB just read.
    """
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()


async def run_case(case: Case, source: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Every repetition of one case; its JSON record."""
    seg = args.segment_mib * MIB
    data = as_bytes(source)
    segments = [data[pos:pos + seg] for pos in range(0, case.nbytes, seg)]
    tier = case.make()
    await tier.open()
    limit = case.make_limit(tier)
    record: dict[str, Any] = {"key": case.key, "label": case.label, "tier": repr(tier), "bytes": case.nbytes,
                              "segments": len(segments), "segment_bytes": seg, "limit": limit.description,
                              "cold_read": "fdatasync + posix_fadvise(DONTNEED), mincore checked"
                              if case.cold_files else "n/a (no page cache in the path)",
                              "notes": case.notes}
    if isinstance(tier, NVMeTier):
        record["engine"] = tier.engine.name
        if tier.engine.name == "kvikio":
            record["kvikio"] = kvikio_settings()
    print(f"\n== {case.key}: {case.label}, {case.nbytes / MIB:.0f} MiB in {len(segments)} segments; {tier!r}",
          flush=True)
    step = 1
    reps: list[dict[str, Any]] = []
    try:
        if case.warm_up:
            first = await tier_write(tier, step, segments)
            record["first_write_gbps"] = gbps(case.nbytes, first["write_s"])
            await tier.delete_version(step)
            step += 1
            print(f"  warm-up (first write, buffer pool allocated): {record['first_write_gbps']:.2f} GB/s",
                  flush=True)
        for rep in range(args.repeat):
            rec: dict[str, Any] = {"rep": rep}
            gc.collect()
            if case.cold_files:
                os.sync()  # untimed: start each write with no dirty pages (buffered writes are throttled by them)
            rec["limit_write_s"] = limit.write(data[:case.nbytes], seg)
            if case.cold_files:
                os.sync()
            c0 = cpu_seconds()
            with Pressure() as psi:
                rec.update(await tier_write(tier, step, segments))
            rec["write_cpu_s"] = cpu_seconds() - c0
            rec["write_psi_some"] = psi.share
            rec["limit_read_s"] = limit.read()
            rec.update({f"limit_{k}": v for k, v in limit.extra().items()})
            if case.cold_files:
                rec["resident_before_read"] = evict(case.cold_files(tier, step), "fadvise")
            c0 = cpu_seconds()
            with Pressure() as psi:
                rec["read_s"], bufs = await tier_read(tier, step, len(segments), args.read_ahead)
            rec["read_cpu_s"] = cpu_seconds() - c0
            rec["read_psi_some"] = psi.share
            if rep == 0 or args.verify_all:
                bad = [i for i, (b, s) in enumerate(zip(bufs, segments, strict=True)) if not same(b, s)]
                if bad:
                    raise SystemExit(f"{case.key}: segments {bad} read back differently")
                rec["verified"] = True
            del bufs
            await settle()
            await tier.delete_version(step)
            step += 1
            rec["loadavg_1m"] = os.getloadavg()[0]
            for d in ("write", "read"):
                rec[f"{d}_gbps"] = gbps(case.nbytes, rec[f"{d}_s"])
                rec[f"limit_{d}_gbps"] = gbps(case.nbytes, rec[f"limit_{d}_s"])
                rec[f"{d}_ratio"] = rec[f"{d}_gbps"] / rec[f"limit_{d}_gbps"]
            if "limit_fresh_copy_s" in rec:  # what a read must at least do here: fill fresh memory the caller owns
                rec["read_vs_fresh_copy"] = rec["limit_fresh_copy_s"] / rec["read_s"]
            reps.append(rec)
            print(f"  rep {rep}: write {rec['write_gbps']:.2f} GB/s vs limit {rec['limit_write_gbps']:.2f} "
                  f"({rec['write_ratio']:.2f}) | read {rec['read_gbps']:.2f} vs {rec['limit_read_gbps']:.2f} "
                  f"({rec['read_ratio']:.2f}) | cpu pressure w {rec['write_psi_some'].get('cpu', math.nan):.0%} "
                  f"r {rec['read_psi_some'].get('cpu', math.nan):.0%}, load {rec['loadavg_1m']:.1f}", flush=True)
    finally:
        limit.close()
        await tier.close()
    record["reps"] = reps
    keys = sorted({k for r in reps for k, v in r.items() if isinstance(v, float)})
    record["median"] = {k: median([r[k] for r in reps if k in r]) for k in keys}
    for d in ("write", "read"):
        shares = [r[f"{d}_psi_some"]["cpu"] for r in reps if "cpu" in r[f"{d}_psi_some"]]
        record["median"][f"{d}_psi_cpu"] = median(shares)
    return record


async def store_roundtrip(case: Case, source: torch.Tensor, args: argparse.Namespace,
                          limits: dict[str, float]) -> dict[str, Any]:
    """put_many + commit, then restore, through AsymStore (compression never); medians and ratios."""
    seg = args.segment_mib * MIB
    n = case.nbytes
    tensors = {f"layer.{i}.weight": source[pos:pos + min(STORE_TENSOR, n - pos)]
               for i, pos in enumerate(range(0, n, STORE_TENSOR))}
    opts: dict[str, Any] = {"keep_last": None, "segment_bytes": seg, "compression": "never",
                            "calibration_cache": False}
    reps = []
    for rep in range(args.repeat):
        step = 100 + rep
        gc.collect()
        tier = case.make()
        store = await AsymStore([tier], **opts).open()
        try:
            t0 = time.perf_counter()
            await store.put_many(step, tensors)
            t1 = time.perf_counter()
            await store.commit(step)
            t2 = time.perf_counter()
            resident = math.nan
            if tier.persistent:
                await store.close()
                if case.cold_files:
                    resident = evict(case.cold_files(tier, step), "fadvise")
                store = await AsymStore([case.make()], **opts).open()
            t3 = time.perf_counter()
            ckpt = await store.restore(step)
            t4 = time.perf_counter()
            if rep == 0 and not all(same(ckpt.tensors[k], v) for k, v in tensors.items()):
                raise SystemExit(f"{case.key}: store restore is not bit-exact")
            del ckpt
            await settle()
            for tier_ in store.tiers:
                await tier_.delete_version(step)
        finally:
            await store.close()
        rec = {"put_s": t1 - t0, "commit_s": t2 - t1, "restore_s": t4 - t3, "resident_before_restore": resident,
               "commit_gbps": gbps(n, t2 - t0), "restore_gbps": gbps(n, t4 - t3)}
        reps.append(rec)
        print(f"  store rep {rep}: put_many+commit {rec['commit_gbps']:.2f} GB/s (put {rec['put_s']:.2f} s), "
              f"restore {rec['restore_gbps']:.2f} GB/s", flush=True)
    med = {k: median([r[k] for r in reps]) for k in reps[0]}
    med["commit_ratio"] = med["commit_gbps"] / limits["limit_write_gbps"]
    med["restore_ratio"] = med["restore_gbps"] / limits["limit_read_gbps"]
    return {"options": {k: v for k, v in opts.items()}, "tensor_bytes": STORE_TENSOR, "median": med, "reps": reps}
