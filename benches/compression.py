"""Byte-plane zstd vs plain zstd on a small GPT-2's training state, and the cost model's choices.

Run by hand (never a timed test)::

    .venv/bin/python benches/compression.py                      # ~5 min on 2 busy CPU cores
    .venv/bin/python benches/compression.py --steps 100 --levels 1,3

1. Trains a small GPT-2 built from a ``transformers.GPT2Config`` (no
   download: n_layer=4, n_embd=256, n_head=4, vocab 8192, context 64, batch
   4) with AdamW (lr 2e-3) for ``--steps`` steps on a synthetic corpus (a
   fixed random bigram model over 1024 of the tokens, 8 successors each with
   Zipf-like weights, so the loss falls).
2. Takes three states: the fp32 weights, the same weights cast to bf16, and
   AdamW's two moments (fp32 ``exp_avg`` and ``exp_avg_sq``).
3. For each state, each zstd level (``--levels``) and thread count
   (``--threads``; -1 = one per CPU), compresses every tensor (in chunks of
   16 MiB, as the store does) with plain zstd and with the byte-plane codec
   (:mod:`asymstore.format.codec`, planes that do not shrink stored raw), and reports
   the stored/raw ratio and MB/s (10**6 raw bytes per second of compression;
   decompression MB/s for the byte planes too). "planes" is the store's path:
   a 64 KiB sample of each chunk picks the planes worth compressing, the
   others are stored raw (sampling time included); "every plane" runs zstd on
   all planes.
4. Asks the cost model what it would do with each state for two tiers: the
   local disk (a ``LocalTier`` under ``--dir``, calibrated by timed writes as
   the store does at startup) and an *assumed* slow remote tier (100 MB/s and
   20 ms per write: no S3 tier exists yet, so this is a calibration given by
   hand), and commits each state once per tier through ``AsymStore`` to
   report what was actually stored (the "remote" copy is written to local disk
   with the remote calibration injected: only the decisions are remote).

Targets: bf16 state stored at <= 0.8 of raw, fp32 weights at <= 0.9 (byte
planes, level 1). Outputs: JSON (``--out``) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import zstandard
from common import REPO, pyplot, save_figure, write_json

from asymstore import AsymStore, LocalTier, PlaneCodec, TierCalibration
from asymstore.format.codec import decode, encode, plane_width, sample
from asymstore.format.tensors import as_bytes
from asymstore.policy.calibration import CalibrationCache, calibrate
from asymstore.write.segments import VersionPlan
from asymstore.write.staging import stage

CHUNK = 16 << 20
MB = 1e6
REMOTE = {"bytes_per_second": 100e6, "latency_s": 20e-3}
TARGETS = {"bf16 weights": 0.8, "fp32 weights": 0.9}


# -- the model ---------------------------------------------------------------


def train(steps: int, seed: int) -> tuple[dict[str, dict[str, torch.Tensor]], list[float], float]:
    """Train the small GPT-2; return the states to compress, the loss curve and the seconds taken."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    vocab, ctx, batch = 8192, 64, 4
    config = GPT2Config(vocab_size=vocab, n_positions=ctx, n_embd=256, n_layer=4, n_head=4, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    # a fixed random bigram model over the first 1024 tokens: each has 8 successors with Zipf-like weights
    active = 1024
    successors = torch.randint(0, active, (active, 8), generator=g)
    weights = 1.0 / torch.arange(1, 9, dtype=torch.float32)
    chains, length = 256, 512  # the corpus: 256 chains of 512 tokens
    corpus = torch.empty(chains, length, dtype=torch.long)
    corpus[:, 0] = torch.randint(0, active, (chains,), generator=g)
    for t in range(1, length):
        pick = torch.multinomial(weights.expand(chains, -1), 1, generator=g).squeeze(1)
        corpus[:, t] = successors[corpus[:, t - 1], pick]
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(steps):
        rows = torch.randint(0, chains, (batch,), generator=g)
        start = int(torch.randint(0, length - ctx, (1,), generator=g))
        tokens = corpus[rows, start:start + ctx]
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {losses[-1]:.3f}", flush=True)
    seconds = time.perf_counter() - started
    weights_fp32 = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    moments: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        moments[f"{name}.exp_avg"] = st["exp_avg"].detach().clone()
        moments[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].detach().clone()
    states = {
        "fp32 weights": weights_fp32,
        "bf16 weights": {k: v.to(torch.bfloat16) for k, v in weights_fp32.items()},
        "adam moments (fp32)": moments,
    }
    return states, losses, seconds


# -- codecs ------------------------------------------------------------------


def chunks(state: dict[str, torch.Tensor]) -> list[tuple[memoryview, int]]:
    out = []
    for t in state.values():
        view = as_bytes(t.contiguous())
        width = plane_width(t.dtype)
        step = CHUNK - CHUNK % t.element_size()
        out.extend((view[i:i + step], width) for i in range(0, len(view), step))
    return out


def measure_codecs(state: dict[str, torch.Tensor], level: int, threads: int, repeat: int) -> dict[str, Any]:
    """Compress every chunk with plain zstd and with byte planes; medians over ``repeat`` runs."""
    parts = chunks(state)
    raw = sum(len(v) for v, _ in parts)
    comp = zstandard.ZstdCompressor(level=level, threads=threads)
    codec = PlaneCodec(level=level, threads=threads)
    plain_s, plane_s, all_s, dec_s = [], [], [], []
    plain_bytes = plane_bytes = all_bytes = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        plain_bytes = sum(len(comp.compress(v)) for v, _ in parts)
        plain_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        all_bytes = sum(encode(v, w, codec).nbytes for v, w in parts)
        all_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()  # as the store does: a 64 KiB sample picks the planes worth compressing
        encoded = [encode(v, w, codec, sample(v, w, codec).mask) for v, w in parts]
        plane_s.append(time.perf_counter() - t0)
        plane_bytes = sum(e.nbytes for e in encoded)
        blobs = [b"".join(bytes(p) for p in e.parts) for e in encoded]
        t0 = time.perf_counter()
        for blob, (v, w) in zip(blobs, parts, strict=True):
            out = bytearray(len(v))
            decode(memoryview(blob), w, memoryview(out))
        dec_s.append(time.perf_counter() - t0)
        del encoded, blobs
    return {
        "level": level, "threads": threads, "raw_bytes": raw,
        "plain_ratio": plain_bytes / raw, "plain_mbps": raw / statistics.median(plain_s) / MB,
        "planes_ratio": plane_bytes / raw, "planes_mbps": raw / statistics.median(plane_s) / MB,
        "planes_every_plane_ratio": all_bytes / raw, "planes_every_plane_mbps": raw / statistics.median(all_s) / MB,
        "planes_decode_mbps": raw / statistics.median(dec_s) / MB,
    }


# -- the cost model ------------------------------------------------------------


async def decisions(states: dict[str, dict[str, torch.Tensor]], root: Path) -> dict[str, Any]:
    """Calibrate the local disk, then plan and commit each state for the local and the assumed remote tier."""
    local = LocalTier(root / "calibrate")
    await local.open()
    local_cal = await calibrate(local, CalibrationCache(root / "calibration.json"))
    remote_cal = TierCalibration.from_throughput(REMOTE["bytes_per_second"], REMOTE["latency_s"], source="assumed")
    tiers = {"local disk": local_cal, "remote (assumed 100 MB/s, 20 ms/write)": remote_cal}
    out: dict[str, Any] = {"calibrations": {k: v.to_json() for k, v in tiers.items()}, "states": {}}
    for sname, state in states.items():
        staged = {k: stage(v, CHUNK) for k, v in state.items()}
        rows = {}
        for tname, cal in tiers.items():
            plan = VersionPlan(0, staged, {}, 0.0, codec=PlaneCodec())
            tp = plan.plan_tier(tname, cal)
            raw_plan = plan.plan_tier(tname, cal, policy="never")
            name = f"t{len(rows)}"
            vroot = root / f"{sname.split()[0]}-{name}"
            shutil.rmtree(vroot, ignore_errors=True)
            async with AsymStore([LocalTier(vroot, name=name)], calibrations={name: cal}) as store:
                await store.put_many(1, state)
                stats = (await store.commit(1)).flush[name]
            shutil.rmtree(vroot, ignore_errors=True)
            rows[tname] = {
                "chunks": len(tp.masks), "chunks_compressed_planned": tp.compressed_chunks,
                "segment_bytes": tp.segment_bytes, "est_stored_ratio": tp.est_stored_bytes / plan.raw_bytes,
                "predicted_s_all_raw": raw_plan.predicted_seconds, "predicted_s_chosen": tp.predicted_seconds,
                "committed": stats.to_json(),
            }
        out["states"][sname] = rows
    return out


# -- report ------------------------------------------------------------------


def plot(doc: dict[str, Any], path: str) -> None:
    """Left: stored/raw per state (plain vs byte planes, level 1). Right: ratio vs MB/s for every config."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5), dpi=120)
    names = list(doc["codecs"])
    lvl = min(r["level"] for r in doc["codecs"][names[0]])
    thr = doc["codecs"][names[0]][0]["threads"]
    pick = [next(r for r in doc["codecs"][n] if r["level"] == lvl and r["threads"] == thr) for n in names]
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [p["plain_ratio"] for p in pick], 0.4, label="plain zstd")
    ax1.bar([i + 0.2 for i in x], [p["planes_ratio"] for p in pick], 0.4, label="byte-plane zstd")
    for name, target in TARGETS.items():
        if name in names:
            i = names.index(name)
            ax1.hlines(target, i - 0.45, i + 0.45, colors="red", linestyles="--")
    ax1.set_xticks(list(x), names, fontsize=8)
    ax1.set_ylabel("stored / raw (lower is better); red: target")
    ax1.set_ylim(0, 1.05)
    ax1.set_title(f"zstd level {lvl}, threads {thr}", fontsize=9)
    ax1.legend(fontsize=8)
    markers = {0: "o", -1: "s"}
    for n, color in zip(names, ["tab:blue", "tab:orange", "tab:green", "tab:red"], strict=False):
        for r in doc["codecs"][n]:
            m = markers.get(r["threads"], "^")
            ax2.scatter(r["plain_mbps"], r["plain_ratio"], color=color, marker=m, facecolors="none")
            ax2.scatter(r["planes_mbps"], r["planes_ratio"], color=color, marker=m)
            ax2.annotate(f"L{r['level']}", (r["planes_mbps"], r["planes_ratio"]), fontsize=6,
                         xytext=(3, 3), textcoords="offset points")
        ax2.scatter([], [], color=color, label=n)
    ax2.scatter([], [], color="gray", marker="o", label="threads 0 (filled: planes, hollow: plain)")
    ax2.scatter([], [], color="gray", marker="s", label="threads -1")
    ax2.set_xscale("log")
    ax2.set_xlabel("compression MB/s (raw bytes)")
    ax2.set_ylabel("stored / raw")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(doc["title"], fontsize=9)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (300)")
    parser.add_argument("--levels", default="1,3,6", help="zstd levels (1,3,6)")
    parser.add_argument("--threads", default="0,-1", help="zstd thread counts (0,-1)")
    parser.add_argument("--repeat", type=int, default=3, help="timing repetitions; medians reported (3)")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to calibrate (default: a temp dir)")
    parser.add_argument("--out", default=str(REPO / "bench-out" / "compression.json"), help="JSON output")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    torch.set_num_threads(os.cpu_count() or 1)

    print(f"training GPT-2 (4 layers, 256 wide) for {args.steps} steps", flush=True)
    states, losses, train_s = train(args.steps, args.seed)
    codecs: dict[str, list[dict[str, Any]]] = {}
    for sname, state in states.items():
        codecs[sname] = []
        for lvl in levels:
            for thr in threads:
                row = measure_codecs(state, lvl, thr, args.repeat)
                codecs[sname].append(row)
                print(f"{sname:22s} L{lvl} T{thr:2d}: plain {row['plain_ratio']:.3f} @ {row['plain_mbps']:6.0f} MB/s"
                      f" | planes {row['planes_ratio']:.3f} @ {row['planes_mbps']:6.0f} MB/s"
                      f" (decode {row['planes_decode_mbps']:5.0f} MB/s)", flush=True)
    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="asymstore-compression-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        model = asyncio.run(decisions(states, scratch))
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    for sname, rows in model["states"].items():
        for tname, r in rows.items():
            c = r["committed"]
            print(f"{sname:22s} -> {tname:40s}: {c['chunks_compressed']}/{r['chunks']} chunks compressed, "
                  f"stored {c['stored_bytes'] / c['raw_bytes']:.3f} of raw, B={c['segment_bytes']}, "
                  f"compress {c['compress_seconds']:.2f} s, write {c['write_seconds']:.2f} s")
    best = {s: min(r["planes_ratio"] for r in rows if r["level"] == min(levels)) for s, rows in codecs.items()}
    targets = {s: {"target": t, "planes_ratio_level_min": best[s], "met": best[s] <= t} for s, t in TARGETS.items()}
    for s, t in targets.items():
        print(f"target {s}: <= {t['target']} -> {t['planes_ratio_level_min']:.3f} ({'met' if t['met'] else 'MISSED'})")
    doc = {
        "title": (f"GPT-2 4x256, {args.steps} steps (loss {losses[0]:.2f} -> {losses[-1]:.2f}); "
                  f"{platform.node()}, {os.cpu_count()} CPUs, zstandard {zstandard.__version__}"),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                 "torch": torch.__version__, "zstandard": zstandard.__version__},
        "training": {"steps": args.steps, "seconds": train_s, "loss_first": losses[0], "loss_last": losses[-1],
                     "params": sum(t.numel() for t in states["fp32 weights"].values())},
        "codecs": codecs, "cost_model": model, "targets": targets, "remote_assumed": REMOTE,
    }
    write_json(args.out, doc)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(doc, png)
    print(f"wrote {args.out} and {png}")
    return 0 if all(t["met"] for t in targets.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
