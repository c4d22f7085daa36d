"""Write and read throughput of every storage tier, next to its device's limit measured in the same run.

Run by hand (never a timed test)::

    .venv/bin/python benches/tier_throughput.py --out bench-out/tier_throughput.json
    .venv/bin/python benches/tier_throughput.py --tiers host,nvme-posix --size-mib 2048 --repeat 5 --store

Each tier is measured at the tier level, the way :class:`asymstore.AsymStore`
drives it: ``begin`` -> ``write_segment`` per segment (``--segment-mib``
each, one part, random bytes) -> ``publish`` is the write; the read is
``read_segment`` of every segment, 4 at a time as ``restore`` reads
(``--read-ahead``), buffers kept until the last one arrives. Next to each
measurement, in the same repetition, the same bytes go through the device's
limit:

* ``host`` (host_tier in process memory) and ``gpu`` (GPUTier; on the CPU
  device where there is no CUDA): memcpy of the same segments into a
  preallocated, already touched buffer, both as a memoryview slice
  assignment (what host_tier does) and as ``torch.Tensor.copy_``; the faster
  of the two is the limit. On a CUDA machine the GPU tier's limits are the
  host->device copy of the same segments (write) and the device->host copy
  into preallocated host memory (read); a device->device copy is recorded
  too. The in-memory tiers get one untimed warm-up version first (their
  buffer pool is then reused, as in training); its time is reported as
  ``first write``. The time of a copy into a *fresh* buffer (what a read
  must return: a buffer the caller owns) is recorded as ``fresh_copy``.
* ``nvme-posix``, ``nvme-kvikio`` (NVMeTier with each engine) and ``local``
  (LocalTier): O_DIRECT sequential write of the same number of bytes in
  64 MiB blocks then ``fsync`` and O_DIRECT sequential read of it (the
  Python equivalent of ``dd oflag=direct conv=fsync`` / ``dd iflag=direct``,
  from ``benches/common.py``), in ``--dir``. kvikio needs
  ``libcuda.so.1``: where no real one loads, the test stub
  (``tests/support/stub_libcuda.c``) is built with gcc into a temporary directory
  and loaded under that soname, so kvikio runs its compat (POSIX) mode;
  the output says which was used.
* ``remote-file`` (RemoteTier on ``file://`` under ``--dir``) and
  ``remote-s3`` (RemoteTier on a moto S3 server started on 127.0.0.1 in a
  child process, ``asymstore.testing_s3``): a plain pyarrow upload of one object of the same size
  (``open_output_stream`` + one ``write``) and download of it
  (``open_input_file`` + ``readinto`` a preallocated buffer) with the
  tier's own filesystem object. Each is measured with the tier's default
  ``verify="checksum"`` (every upload read back and hashed) and with
  ``verify="size"`` (``--remote-verify``). S3 uses ``--s3-size-mib`` (moto
  is slow).

Cold reads: before every disk or file:// read (the tier's and the limit's)
the files are evicted from the page cache with ``fdatasync`` +
``posix_fadvise(POSIX_FADV_DONTNEED)`` and the fraction still resident is
measured with ``mincore`` and reported. moto keeps objects in its own
process memory: S3 reads are not cold in that sense. Before each timed
write to a disk (tier and limit) ``sync`` runs, untimed, so that neither
is throttled by the other's dirty pages. The process CPU seconds of every
tier write and read are recorded too (less sensitive to other load than
wall time; kvikio's threads included, moto's process not).

``--store`` also measures ``AsymStore.put_many`` + ``commit`` and a
``restore`` (from a freshly opened store, cold, for persistent tiers) with
``compression="never"`` and ``segment_bytes`` = the segment size, tensors
of 16 MiB; its ratios are against the median limits of the same tier.

GB/s are 10**9 bytes per second. Each repetition's ratio is tier / limit
of that repetition; the median over ``--repeat`` repetitions is reported
and every sample is in the JSON. Targets: host tier >= 0.8 of memcpy,
NVMe tier writes >= 0.9 of the O_DIRECT write limit. Outputs: JSON
(``--out``) and a PNG plot next to it (``--plot``).

This file is the command line and the report; benches/tier_scenarios.py
builds the cases of each ``--tiers`` key, and benches/tier_common.py holds
the limits and the measurement of one case.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from common import DD_BLOCK, MIB, REPO, aligned_random_buffer, gbps, git_state, pyplot, save_figure, write_json
from tier_common import random_bytes, run_case, store_roundtrip
from tier_scenarios import ALL_TIERS, TEMP_DIRS, Setup, build_cases

from asymstore.testing_s3 import loopback_s3

TARGETS = {  # (case key prefix, direction) -> least ratio to the limit
    ("host", "write"): 0.8, ("host", "read"): 0.8,
    ("nvme-posix", "write"): 0.9, ("nvme-kvikio", "write"): 0.9,
}


# -- output --------------------------------------------------------------------


def target_of(key: str, direction: str) -> float | None:
    """The target ratio for a case and direction, if any."""
    return TARGETS.get((key, direction))


def verdicts(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per target: case, direction, ratio, target, met."""
    out = []
    for res in results:
        for d in ("write", "read"):
            target = target_of(res["key"], d)
            if target is not None:
                ratio = res["median"][f"{d}_ratio"]
                out.append({"case": res["key"], "direction": d, "ratio": ratio, "target": target,
                            "met": bool(ratio >= target)})
    return out


def print_table(results: Sequence[dict[str, Any]]) -> None:
    """The summary table (medians over repetitions)."""
    print("\nmedians over repetitions; GB/s = 10^9 B/s; ratio = tier / limit of the same repetition; cpuPSI = share"
          " of wall time some task waited for a CPU (other load)")
    head = (f"{'tier':<34} {'MiB':>5} {'write':>6} {'limW':>6} {'w/lim':>6} {'read':>6} {'limR':>6} {'r/lim':>6} "
            f"{'1stW':>6} {'segW s':>6} {'publ s':>6} {'cpuPSI':>6}")
    print(head)
    for res in results:
        m = res["median"]
        first = res.get("first_write_gbps", math.nan)
        print(f"{res['label']:<34} {res['bytes'] / MIB:>5.0f} {m['write_gbps']:>6.2f} {m['limit_write_gbps']:>6.2f} "
              f"{m['write_ratio']:>6.2f} {m['read_gbps']:>6.2f} {m['limit_read_gbps']:>6.2f} {m['read_ratio']:>6.2f} "
              f"{first:>6.2f} {m['segments_s']:>6.2f} {m['publish_s']:>6.2f} {m['write_psi_cpu']:>6.0%}")
        if "limit_fresh_copy_s" in m:
            print(f"{'':<34}       copy into fresh buffers (alloc + page faults + copy): "
                  f"{gbps(res['bytes'], m['limit_fresh_copy_s']):.2f} GB/s; read / that: "
                  f"{m['read_vs_fresh_copy']:.2f}")
        print(f"{'':<34}       process CPU s: write {m['write_cpu_s']:.2f}, read {m['read_cpu_s']:.2f}")
        if "store" in res:
            s = res["store"]["median"]
            print(f"{'  via AsymStore (never compress)':<34} {'':>5} {s['commit_gbps']:>6.2f} {'':>6} "
                  f"{s['commit_ratio']:>6.2f} {s['restore_gbps']:>6.2f} {'':>6} {s['restore_ratio']:>6.2f}")
    print("\ntargets:")
    for v in verdicts(results):
        verdict = "met" if v["met"] else "NOT met"
        print(f"  {v['case']:<12} {v['direction']:<5} {v['ratio']:.2f} >= {v['target']}: {verdict}")


def plot(results: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Three panels: write GB/s vs limit, read GB/s vs limit (log scale), and the ratios with the targets."""
    plt = pyplot()
    from matplotlib import ticker

    labels = [r["key"] for r in results]
    x = list(range(len(results)))
    w = 0.38
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 1.3 * len(results) + 2), 11), dpi=120)
    for ax, d, color in ((axes[0], "write", "tab:blue"), (axes[1], "read", "tab:orange")):
        tier = [r["median"][f"{d}_gbps"] for r in results]
        lim = [r["median"][f"limit_{d}_gbps"] for r in results]
        lo = [m - min(x_[f"{d}_gbps"] for x_ in r["reps"]) for m, r in zip(tier, results, strict=True)]
        hi = [max(x_[f"{d}_gbps"] for x_ in r["reps"]) - m for m, r in zip(tier, results, strict=True)]
        ax.bar([i - w / 2 for i in x], tier, w, yerr=[lo, hi], capsize=3, color=color,
               label=f"tier {d} (bars: min-max of repeats; label: median ratio to the limit)")
        ax.bar([i + w / 2 for i in x], lim, w, color="lightgray", edgecolor="gray", hatch="//",
               label=f"device limit ({d})")
        for i, r in enumerate(results):  # the ratio above the bar and its error bar, the value inside
            ax.annotate(f"{r['median'][f'{d}_ratio']:.2f}x", (i - w / 2, tier[i] + hi[i]), textcoords="offset points",
                        xytext=(0, 3), ha="center", fontsize=8, fontweight="bold")
            ax.annotate(f"{lim[i]:.2f}", (i + w / 2, lim[i]), textcoords="offset points", xytext=(0, 3),
                        ha="center", fontsize=7, color="dimgray")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        top = max(max(t + h for t, h in zip(tier, hi, strict=True)), max(lim))
        ax.set_ylim(top=top * 4)  # room for the labels and the legend
        ax.set_ylabel(f"{d} GB/s (log)")
        ax.set_xticks(x, labels, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper right")
    ax = axes[2]
    for off, d, color in ((-w / 2, "write", "tab:blue"), (w / 2, "read", "tab:orange")):
        ax.bar([i + off for i in x], [r["median"][f"{d}_ratio"] for r in results], w, color=color,
               label=f"{d} / limit")
        for i, r in enumerate(results):
            target = target_of(r["key"], d)
            if target is not None:
                ax.hlines(target, i + off - w / 2, i + off + w / 2, colors="red", linewidth=2)
    ax.plot([], [], color="red", linewidth=2, label="target")
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_ylabel("tier / limit (median of repeats)")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylim(0, max(1.2, max(max(r["median"]["write_ratio"], r["median"]["read_ratio"]) for r in results) * 1.1))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def read_text(path: str) -> str:
    """A small system file's content, or '' when unreadable."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def parse_tiers(text: str) -> list[str]:
    """'host,nvme-posix' -> the tier keys, checked."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = set(keys) - set(ALL_TIERS)
    if unknown or not keys:
        raise argparse.ArgumentTypeError(f"tiers are among {','.join(ALL_TIERS)}")
    return keys


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tiers", type=parse_tiers, default=list(ALL_TIERS),
                        help=f"comma-separated, among {','.join(ALL_TIERS)} (default: all)")
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes per version, memory/disk tiers (1024)")
    parser.add_argument("--s3-size-mib", type=int, default=256, help="bytes per version on S3/moto (256)")
    parser.add_argument("--segment-mib", type=int, default=64, help="segment size (64)")
    parser.add_argument("--read-ahead", type=int, default=4, help="segments read at once, as restore does (4)")
    parser.add_argument("--remote-verify", default="checksum,size",
                        type=lambda s: [v for v in s.split(",") if v in ("checksum", "size")] or ["checksum"],
                        help="RemoteTier verify modes measured, each a row (checksum,size)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; medians reported (3)")
    parser.add_argument("--store", action="store_true",
                        help="also measure AsymStore put_many+commit and restore (compression never)")
    parser.add_argument("--dir", default=str(REPO / "bench-out" / "tier-throughput"),
                        help="directory on the disk under test (default: bench-out/tier-throughput)")
    parser.add_argument("--out", default=str(REPO / "bench-out" / "tier_throughput.json"), help="JSON output")
    parser.add_argument("--plot", default=None, help="PNG output (default: --out with .png)")
    parser.add_argument("--verify-all", action="store_true", help="check read bytes every repetition, not the first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.read_ahead < 1 or args.segment_mib < 1:
        parser.error("--repeat, --read-ahead and --segment-mib must be >= 1")
    for name in ("size_mib", "s3_size_mib"):
        size = getattr(args, name)
        if size < 1 or size % args.segment_mib or size * MIB % DD_BLOCK:
            parser.error(f"--{name.replace('_', '-')} must be a multiple of --segment-mib and of "
                         f"{DD_BLOCK // MIB} (the dd block)")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    plot_path = args.plot or os.path.splitext(args.out)[0] + ".png"

    env: dict[str, Any] = {
        "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
        "dir": os.path.abspath(args.dir), "kernel": platform.release(),
        "transparent_hugepage": read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
        "loadavg_at_start": os.getloadavg(), "git": git_state(), "skipped": {},
        "options": {k: v for k, v in vars(args).items()},
    }
    started = time.perf_counter()
    source = random_bytes(max(args.size_mib, args.s3_size_mib) * MIB, args.seed)
    dd_buf = aligned_random_buffer(DD_BLOCK, args.seed)
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(loopback_s3("asymstore-bench")) if "remote-s3" in args.tiers else None
        for case in build_cases(Setup(args, dd_buf, env, s3)):
            os.makedirs(os.path.join(args.dir, case.key), exist_ok=True)
            record = asyncio.run(run_case(case, source, args))
            if args.store:
                limits = {k: record["median"][k] for k in ("limit_write_gbps", "limit_read_gbps")}
                record["store"] = asyncio.run(store_roundtrip(case, source, args, limits))
            results.append(record)
            gc.collect()
    dd_buf.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    for tmp in TEMP_DIRS:
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - started
    env["loadavg_at_end"] = os.getloadavg()

    doc = {
        "command": " ".join([sys.executable, *sys.argv]),
        "units": "GB/s = 1e9 bytes/s; *_s = seconds; ratio = tier / limit of the same repetition; medians of "
                 f"{args.repeat} repetitions, every sample under reps",
        "cold_read": "before each disk or file:// read (tier and limit): fdatasync + posix_fadvise(POSIX_FADV_DONTNEED)"
                     " on every file, then the fraction still resident measured with mincore (resident_before_read)",
        "targets": {f"{k}:{d}": t for (k, d), t in TARGETS.items()},
        "verdicts": verdicts(results),
        "environment": env,
        "elapsed_s": elapsed,
        "results": results,
    }
    write_json(args.out, doc)
    print_table(results)
    if env["skipped"]:
        print(f"skipped: {env['skipped']}")
    if "libcuda" in env:
        print(f"kvikio: {env['libcuda']}")
    print(f"cold reads: {doc['cold_read']}")
    plot(results, plot_path, f"asymstore tiers vs device limits, {args.size_mib} MiB ({args.s3_size_mib} MiB on S3) "
                             f"in {args.segment_mib} MiB segments; medians of {args.repeat}\n{os.cpu_count()} CPUs, "
                             f"load {env['loadavg_at_start'][0]:.1f}-{env['loadavg_at_end'][0]:.1f}, disk "
                             f"{os.path.abspath(args.dir)}")
    print(f"wrote {args.out} and {plot_path} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
