"""Helpers the benches share: units, CPU time, the disk's O_DIRECT limits, page cache, contention, RSS, GPT-2.

Imported by the benches as a sibling module (``from common import ...``): a
bench run as ``python benches/NAME.py`` has ``benches/`` first on ``sys.path``.
Nothing here is a bench itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import mmap
import os
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from harness import order  # noqa: F401  (moved to harness.py; imported from here by older benches)

REPO = Path(__file__).resolve().parent.parent
KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
GB = 1e9
DD_BLOCK = 64 * MIB


# -- units and statistics ------------------------------------------------------


def gbps(nbytes: int, seconds: float) -> float:
    """10**9 bytes per second."""
    return nbytes / seconds / GB if seconds > 0 else float("nan")


def median(values: Sequence[float]) -> float:
    """Median, NaN when empty."""
    return statistics.median(values) if values else float("nan")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads (CLOCK_PROCESS_CPUTIME_ID: ns, not 10 ms ticks)."""
    return time.process_time()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def git_state() -> dict[str, Any]:
    """HEAD and whether asymstore/ differs from it (the benchmark measures the working tree)."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"head": git("rev-parse", "HEAD"), "asymstore_changes": git("status", "--porcelain", "asymstore")}


def write_json(path: str | os.PathLike[str], doc: Any, indent: int = 2) -> None:
    """Write ``doc`` as JSON to ``path``, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=indent)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: float | None = None) -> None:
    """Lay ``fig`` out tightly, write it to ``path`` (PNG) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


# -- page cache -------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.mincore.restype = ctypes.c_int


def resident_pages(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of ``path``), by mincore."""
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    npages = (size + page - 1) // page
    if size == 0:
        return 0, 0
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: never dirties the file
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        vec = (ctypes.c_ubyte * npages)()
        if _libc.mincore(ctypes.addressof(anchor), size, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        del anchor
        return sum(v & 1 for v in vec), npages
    finally:
        mm.close()


def evict(paths: Sequence[str], method: str) -> float:
    """Drop ``paths`` from the page cache; return the fraction of their pages still resident."""
    if method == "drop_caches":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    else:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)  # already durable; makes every page clean so DONTNEED can drop it
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    resident = total = 0
    for path in paths:
        r, n = resident_pages(path)
        resident += r
        total += n
    return resident / total if total else 0.0


def files_under(root: str) -> list[str]:
    """Every regular file under ``root``."""
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


# -- contention (other processes on the machine) ---------------------------


def pressure_totals() -> dict[str, int]:
    """Cumulative PSI stall microseconds ("some") for cpu and io; empty where PSI is unavailable."""
    out: dict[str, int] = {}
    for res in ("cpu", "io"):
        try:
            with open(f"/proc/pressure/{res}") as f:
                for line in f:
                    if line.startswith("some"):
                        out[res] = int(line.rsplit("total=", 1)[1])
        except (OSError, ValueError, IndexError):
            pass
    return out


class Pressure:
    """Share of wall time some task on the machine stalled on cpu / io over a ``with`` block."""

    def __enter__(self) -> Pressure:
        self.start = pressure_totals()
        self.t0 = time.perf_counter()
        self.share: dict[str, float] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        wall_us = (time.perf_counter() - self.t0) * 1e6
        end = pressure_totals()
        self.share = {k: (end[k] - v) / wall_us for k, v in self.start.items() if k in end and wall_us > 0}


# -- the disk's sequential limits (dd equivalent) ---------------------------


def aligned_random_buffer(nbytes: int, seed: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of random bytes, for O_DIRECT."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    gen = torch.Generator().manual_seed(seed)
    torch.frombuffer(buf, dtype=torch.uint8).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    return buf


def odirect_write(path: str, nbytes: int, buf: mmap.mmap) -> float:
    """Seconds to write ``nbytes`` with O_DIRECT in ``len(buf)`` blocks and fsync (dd oflag=direct conv=fsync)."""
    assert nbytes % len(buf) == 0
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        done = 0
        view = memoryview(buf)
        while done < nbytes:
            n = os.write(fd, view)
            if n != len(view):
                raise OSError(f"short O_DIRECT write: {n} of {len(view)}")
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def odirect_read(path: str, buf: mmap.mmap) -> tuple[float, int]:
    """(seconds, bytes) to read ``path`` with O_DIRECT in ``len(buf)`` blocks (dd iflag=direct)."""
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    total = 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return time.perf_counter() - start, total


# -- resident memory ------------------------------------------------------------


def _status_bytes(status: bytes, key: bytes) -> int | None:
    """The value of ``key`` (``b"VmRSS:"``, in kB there) in a /proc/PID/status text, in bytes."""
    for line in status.splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return None


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS of /proc/self/status), bytes."""
    with open("/proc/self/status", "rb") as f:
        return _status_bytes(f.read(), b"VmRSS:") or 0


def release_free_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the kernel (glibc ``malloc_trim``).

    Called before a baseline is taken, so what a previous run freed but the
    allocator kept does not hide (or inflate) the next run's growth.
    """
    gc.collect()
    with contextlib.suppress(AttributeError):
        _libc.malloc_trim(0)


class RssSampler:
    """This process's resident set size, sampled on a daemon thread: the baseline at start, the peak, the growth.

    ``start()`` reads the baseline (VmRSS of /proc/self/status), then a daemon
    thread reads VmRSS every ``interval`` seconds (10 ms) until ``stop()``;
    or use it as a ``with`` block. Where /proc/self/clear_refs accepts it, the
    kernel's own high-water mark (VmHWM) is reset at start and read at stop,
    so a spike shorter than the interval still counts: ``peak_bytes`` is the
    larger of the two (``sampled_peak_bytes`` and ``kernel_peak_bytes`` apart).
    """

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.baseline_bytes = 0
        self.sampled_peak_bytes = 0
        self.kernel_peak_bytes: int | None = None
        self.samples = 0
        self._fd = -1
        self._hwm_reset = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> bytes:
        return os.pread(self._fd, 8192, 0)  # procfs regenerates the text on a read at offset 0

    def _sample(self) -> None:
        rss = _status_bytes(self._read(), b"VmRSS:") or 0
        self.samples += 1
        self.sampled_peak_bytes = max(self.sampled_peak_bytes, rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> RssSampler:
        """Take the baseline and start sampling."""
        if self._thread is not None:
            raise RuntimeError("RssSampler already started")
        self._fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5\n")  # 5: reset the peak RSS (VmHWM) to the current RSS; touches nothing else
            self._hwm_reset = True
        except OSError:
            self._hwm_reset = False
        self.baseline_bytes = _status_bytes(self._read(), b"VmRSS:") or 0
        self.sampled_peak_bytes = self.baseline_bytes
        self.samples = 1
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> RssSampler:
        """Stop sampling (one last sample, and the kernel's peak where it was reset)."""
        if self._thread is None:
            return self
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample()
        if self._hwm_reset:
            self.kernel_peak_bytes = _status_bytes(self._read(), b"VmHWM:")
        os.close(self._fd)
        self._fd = -1
        return self

    @property
    def peak_bytes(self) -> int:
        """The highest RSS seen: sampled, or the kernel's high-water mark where it was reset at start."""
        return max(self.sampled_peak_bytes, self.kernel_peak_bytes or 0)

    @property
    def peak_growth_bytes(self) -> int:
        """Peak RSS over the baseline, bytes."""
        return self.peak_bytes - self.baseline_bytes

    def as_dict(self) -> dict[str, Any]:
        """The measurements, for JSON."""
        return {"baseline_bytes": self.baseline_bytes, "peak_bytes": self.peak_bytes,
                "peak_growth_bytes": self.peak_growth_bytes, "sampled_peak_bytes": self.sampled_peak_bytes,
                "kernel_peak_bytes": self.kernel_peak_bytes, "samples": self.samples, "interval_s": self.interval}

    def __enter__(self) -> RssSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- GPT-2 (built from a config: nothing downloaded) -------------------------------

GPT2_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 2048},
    "8m": {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 16384},
    "30m": {"n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 50257},
    "124m": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257},
}


def build_gpt2(name: str, seq: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """GPT-2 of config ``name`` (seeded, randomly initialised) with AdamW; (model, optimizer, parameters)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_positions=max(seq, 128), bos_token_id=0, eos_token_id=0, **GPT2_CONFIGS[name])
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, sum(p.numel() for p in model.parameters())


def slowest_rank_times(runs: Sequence[Sequence[dict[str, Any]]]) -> list[float]:
    """Per iteration, the slowest rank's time (ranks wait for each other in the collectives anyway).

    ``runs[rank]`` lists that rank's repetitions of one method, each a dict with ``"times"``.
    """
    return [max(ts) for reps in zip(*runs, strict=True) for ts in zip(*(r["times"] for r in reps), strict=True)]


def run_ranks(argv: Sequence[str], world: int, threads: int, timeout: float | None = None, **env: str) -> list[int]:
    """Run ``argv`` as ``world`` ranks of one torch.distributed job on this machine; return their exit codes.

    Each process gets MASTER_ADDR/PORT (a free loopback port), RANK, WORLD_SIZE,
    LOCAL_RANK and OMP_NUM_THREADS=``threads``, plus ``env``; only rank 0's
    output is shown. Past ``timeout`` seconds (None: no limit) the ranks still
    running are killed (their exit code is then ``-SIGKILL``).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        penv = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                    WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads), **env)
        procs.append(subprocess.Popen(list(argv), env=penv, stdout=None if rank == 0 else subprocess.DEVNULL))
    deadline = None if timeout is None else time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(None if deadline is None else max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:  # a hung collective: every rank still running goes
                if q.poll() is None:
                    q.kill()
            codes.append(p.wait())
    return codes
