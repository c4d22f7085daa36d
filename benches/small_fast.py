"""The fixed cost of a version: a ~7 MB-state model at ~30 ms steps, a version every step (issue 32, part 4).

A tiny GPT-2 built from transformers' config (nothing downloaded; AdamW, so the state is the
parameters and two moments: about 7 MB) is trained with the own-loop ``asymcheck.Checkpointer``
with a version at every step (``PacingOptions(max_overhead=None)``: pacing off, so every step's
version is taken however much it costs). Each method runs in a fresh process, methods interleaved
ABBA (``harness.rounds``), the 1-minute load average printed beside each figure:

- ``none``: no checkpoint (the baseline).
- ``local``: what a directory gets today: ``Checkpointer(model, opt, directory)``
  (``open_store``: an AsymStore over one fsynced ``LocalTier``).
- ``shm+local``: the list ``[host_tier(cap, path=/dev/shm/...), LocalTier(directory)]``: the
  disk is the first persistent tier, so ``commit`` waits for both (shared memory, then disk).
- ``mem+local``: ``[host_tier(cap), LocalTier(directory)]`` (process memory; waits for both too).
- ``shm>local``: ``AsymStore([host_tier(cap, path=/dev/shm/...), LocalTier(directory)],
  durable=<the shm tier>)``: ``commit`` returns once shared memory has the version (a
  ``[shm, local]`` list makes the first *persistent* tier, the disk, the one ``commit`` waits
  for); the disk takes the newest version it can in the background (backlog 1: an older one
  waiting is skipped there when a newer one arrives).
- ``local-nofsync`` (diagnostic, only with ``--methods``): ``LocalTier(fsync=False)``, to
  show how much of a version is the fsyncs; never a default (not durable).

Reported per method: median step time and its ratio to ``none``; process CPU seconds per step
(every thread) and, beside it, the CPU seconds per version (that less ``none``'s); the versions
committed; and ``os.fsync`` calls per version (counted in the child by wrapping ``os.fsync``:
every fsync of the library goes through it). With ``--strace`` one more run per method under
``strace -c -f`` prints the syscall table of the whole run (fsync, rename, openat, futex ...: divide the calls
by the steps, a version each, for the count per version).

    python benches/small_fast.py                     # 3 rounds x 300 steps per method (5-10 min on the 2-core VM)
    python benches/small_fast.py --quick             # 1 round x 60 steps, to try it
    python benches/small_fast.py --methods none local local-nofsync shm+local --strace

Timings on a busy shared machine are not results: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import add_child_flag, add_quick_flag, child_argv, rounds, run_fresh

METHODS = ["none", "local", "shm+local", "shm>local", "mem+local"]
EXTRA = ["local-nofsync"]
CONFIG = {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1536}  # ~0.6 M parameters: ~7 MB with AdamW
HOST_BYTES = 256 << 20  # the host tier's capacity (a few versions of ~7 MB; bounded RAM)


def child(method: str, args: argparse.Namespace, out: Path) -> None:
    """One run of ``method`` in this (fresh) process; the result as JSON in ``out``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from asymcheck import Checkpointer
    from asymcheck.options import PacingOptions, RetentionOptions
    from asymstore import AsymStore, LocalTier, host_tier

    torch.set_num_threads(args.threads)
    fsyncs = [0]
    real_fsync = os.fsync

    def counted(fd: Any) -> None:
        fsyncs[0] += 1
        real_fsync(fd)

    os.fsync = counted

    torch.manual_seed(0)
    cfg = GPT2Config(n_positions=max(args.seq, 128), bos_token_id=0, eos_token_id=0, n_layer=CONFIG["n_layer"],
                     n_embd=CONFIG["n_embd"], n_head=CONFIG["n_head"], vocab_size=CONFIG["vocab_size"])
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = params * 4 * 3  # fp32 parameters and two AdamW moments

    work = Path(tempfile.mkdtemp(prefix="small-fast-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="small-fast-", dir="/dev/shm")) if method.startswith("shm") else None
    ckpt: Checkpointer | None = None
    pacing = PacingOptions(max_overhead=None)
    retention = RetentionOptions(keep_last=2)
    if method == "local":
        ckpt = Checkpointer(model, opt, work, pacing=pacing, retention=retention)
    elif method == "local-nofsync":
        ckpt = Checkpointer(model, opt, [LocalTier(work, fsync=False)], pacing=pacing, retention=retention)
    elif method == "shm+local":
        ckpt = Checkpointer(model, opt, [host_tier(HOST_BYTES, path=shm), LocalTier(work)], pacing=pacing,
                            retention=retention)
    elif method == "shm>local":
        fast = host_tier(HOST_BYTES, path=shm)
        store = AsymStore([fast, LocalTier(work)], durable=fast, keep_last=2)
        ckpt = Checkpointer(model, opt, store, pacing=pacing)
    elif method == "mem+local":
        ckpt = Checkpointer(model, opt, [host_tier(HOST_BYTES), LocalTier(work)], pacing=pacing,
                            retention=retention)
    elif method != "none":
        raise SystemExit(f"unknown method {method!r}")

    gen = torch.Generator().manual_seed(1)
    iters: list[float] = []
    cpu0 = 0.0
    fs0 = 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            cpu0, fs0 = time.process_time(), fsyncs[0]
        t0 = time.perf_counter()
        x = torch.randint(0, CONFIG["vocab_size"], (args.batch, args.seq), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        iters.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    fs = fsyncs[0] - fs0
    committed = 0
    parts: dict[str, float] = {}
    if ckpt is not None:
        ckpt.close()
        stats = ckpt.stats()
        committed = stats.versions_committed
        recs = list(stats.steps)[args.warmup:]
        # the training thread's time in the Checkpointer per step, by part (medians), and the commit's latency
        parts = {"stall_ms": statistics.median(r.stall_s for r in recs) * 1e3,
                 "backpressure_ms": statistics.median(r.backpressure_s for r in recs) * 1e3,
                 "hook_ms": statistics.median(r.hook_s for r in recs) * 1e3,
                 "open_ms": statistics.median(r.open_s for r in recs) * 1e3,
                 "commit_ms": statistics.median(stats.commit_seconds) * 1e3 if stats.commit_seconds else 0.0}
    shutil.rmtree(work, ignore_errors=True)
    if shm is not None:
        shutil.rmtree(shm, ignore_errors=True)
    out.write_text(json.dumps({"iter_s": iters[args.warmup:], "cpu_s_per_step": cpu / args.steps,
                               "fsyncs_per_step": fs / args.steps, "committed": committed,
                               "state_bytes": state_bytes, "params": params, "parts": parts}))


def strace_table(method: str, args: argparse.Namespace) -> str:
    """``strace -c -f`` of one run of ``method``: the syscall summary (stderr), or why there is none."""
    if shutil.which("strace") is None:
        return "strace not installed"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = ["strace", "-c", "-f", "-o", str(Path(tmp) / "strace.txt"),
               *child_argv(__file__, *_child_args(method, args, out))]
        subprocess.run(cmd, capture_output=True, check=False)
        table = Path(tmp) / "strace.txt"
        return table.read_text() if table.exists() else "strace produced nothing"


def _child_args(method: str, args: argparse.Namespace, out: Path) -> list[str]:
    return ["--child", method, str(out), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch", str(args.batch), "--seq", str(args.seq), "--threads", str(args.threads), "--dir", args.dir]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (tune for ~30 ms steps)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training process")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir())), help="where the directory tier lives")
    ap.add_argument("--strace", action="store_true", help="one more run per method under strace -c -f")
    ap.add_argument("--json", default=None, help="write the results here too")
    add_quick_flag(ap, "1 round x 60 steps per method (a minute or two)")
    add_child_flag(ap, nargs=2, metavar=("METHOD", "OUT"))
    args = ap.parse_args()
    if args.child is not None:
        child(args.child[0], args, Path(args.child[1]))
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 60, 10
    if "none" not in args.methods:
        args.methods = ["none", *args.methods]
    per: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd, method in rounds(args.methods, args.rounds):
            out = Path(tmp) / f"{method}-{rnd}.json"
            run = run_fresh(child_argv(__file__, *_child_args(method, args, out)))
            if run.code != 0 or not out.exists():
                sys.exit(f"{method} failed (exit {run.code}):\n{run.log[-4000:]}")
            res = json.loads(out.read_text())
            res["load_1m"] = run.loadavg_1m
            per[method].append(res)
            print(f"round {rnd} {method:14s} median step {statistics.median(res['iter_s']) * 1e3:7.2f} ms  "
                  f"cpu/step {res['cpu_s_per_step'] * 1e3:6.2f} ms  fsync/step {res['fsyncs_per_step']:5.2f}  "
                  f"committed {res['committed']:4d}  load {run.loadavg_1m:.2f}  "
                  + " ".join(f"{k} {v:.2f}" for k, v in res["parts"].items()), flush=True)
    state = per["none"][0]["state_bytes"]
    print(f"\nstate: {state / 1e6:.1f} MB ({per['none'][0]['params']} parameters + 2 AdamW moments), "
          f"{args.steps} steps per run, {args.rounds} round(s); busy-machine figures are not results")
    base = statistics.median(statistics.median(r["iter_s"]) for r in per["none"])
    base_cpu = statistics.median(r["cpu_s_per_step"] for r in per["none"])
    summary: dict[str, Any] = {}
    print(f"{'method':14s} {'step ms':>8s} {'ratio':>6s} {'+ms/ver':>8s} {'cpu ms/step':>11s} {'cpu ms/ver':>10s} "
          f"{'fsync/ver':>9s} {'versions':>8s}  load (per round)")
    for method, runs in per.items():
        med = statistics.median(statistics.median(r["iter_s"]) for r in runs)
        cpu = statistics.median(r["cpu_s_per_step"] for r in runs)
        versions = statistics.median(r["committed"] for r in runs)
        per_version = (versions / (args.steps + args.warmup)) if method != "none" else 0.0
        fs = statistics.median(r["fsyncs_per_step"] for r in runs)
        summary[method] = {"median_step_s": med, "ratio_vs_none": med / base, "overhead_s": med - base,
                           "cpu_s_per_step": cpu, "cpu_s_per_version": (cpu - base_cpu) if method != "none" else 0.0,
                           "fsyncs_per_version": fs / per_version if per_version else 0.0,
                           "versions_committed": versions, "load_1m": [r["load_1m"] for r in runs]}
        s = summary[method]
        print(f"{method:14s} {med * 1e3:8.2f} {med / base:6.2f} {(med - base) * 1e3:8.2f} {cpu * 1e3:11.2f} "
              f"{s['cpu_s_per_version'] * 1e3:10.2f} {s['fsyncs_per_version']:9.2f} {versions:8.0f}  "
              + " ".join(f"{x:.2f}" for x in s["load_1m"]))
    if args.strace:
        for method in args.methods:
            print(f"\n== strace -c -f: {method} ({args.warmup + args.steps} steps) ==")
            print(strace_table(method, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "runs": per}, indent=1))


if __name__ == "__main__":
    main()
