"""Where a checkpoint's CPU goes: CPU seconds per checkpointed GiB, in total and per thread.

A GPT-2 (``benches/common.py``: ``build_gpt2``) is trained for ``--steps``
iterations twice per round, each run in a fresh process: once without a
checkpoint (``none``) and once with an :class:`asymcheck.Checkpointer`
checkpointing every step into a :class:`asymstore.LocalTier` (``asymcheck``).
Rounds alternate the order (ABBA). Each run reads every thread's user+system
ticks from ``/proc/self/task/<tid>/stat`` after the warm-up and at the end,
and names the thread by its Python name (``threading.enumerate``, by native
id; the process's main thread is ``main``, other native threads such as
OpenMP's ``native``). Names ending in a number are grouped (``asyncio_3`` is
``asyncio_*``). What ``Checkpointer.close`` spends (the last commits, after which its
threads end) is ``close``: the process total (``CLOCK_PROCESS_CPUTIME_ID``)
less every thread's ticks read before it.

Reported: per thread group, CPU seconds per checkpointed GiB (the asymcheck
run's CPU less the none run's, per GiB of the versions committed in the
window: the warm-up's are flushed before it starts), and the
total; the load average at the start and the end of every run.

    python benches/cpu_profile.py --config 30m --steps 20
    python benches/cpu_profile.py --config 124m --steps 10 --rounds 2 --json bench-out/cpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import add_child_flag, child_argv, rounds, run_fresh

GIB = 1 << 30
TICK = os.sysconf("SC_CLK_TCK")


def thread_ticks() -> dict[int, float]:
    """CPU seconds (user + system) of every live thread of this process, by native id."""
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)
    return out


def thread_names() -> dict[int, str]:
    """Python thread names by native id; the main thread is ``main``."""
    names = {t.native_id: re.sub(r"[_-]?\d+$", "_*", t.name) for t in threading.enumerate() if t.native_id}
    names[os.getpid()] = "main"
    return names


def by_group(ticks: dict[int, float], names: dict[int, str]) -> dict[str, float]:
    groups: dict[str, float] = {}
    for tid, cpu in ticks.items():
        name = names.get(tid, "native")
        groups[name] = groups.get(name, 0.0) + cpu
    return groups


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process; returns per-group CPU seconds and the bytes checkpointed."""
    import torch
    from common import build_gpt2

    torch.manual_seed(0)
    model, opt, _ = build_gpt2(args.config, args.seq)
    vocab = model.config.vocab_size
    root = Path(tempfile.mkdtemp(prefix="cpu-profile-", dir=args.dir))
    ckpt = None
    committed0 = stored0 = 0
    if args.child == "asymcheck":
        from asymcheck import Checkpointer
        from asymcheck.options import RetentionOptions
        from asymstore import LocalTier
        ckpt = Checkpointer(model, opt, [LocalTier(root)], retention=RetentionOptions(keep_last=2))
    load0 = os.getloadavg()
    t0 = c0 = 0.0
    before: dict[int, float] = {}
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            if ckpt is not None:  # the warm-up's sealed versions are committed outside the window
                ckpt.flush()
                stats0 = ckpt.stats()
                committed0, stored0 = stats0.versions_committed, stats0.stored_bytes
            before, c0, t0 = thread_ticks(), time.process_time(), time.perf_counter()
        x = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(i))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    names = thread_names()  # before close (the Checkpointer's threads end there)
    after = thread_ticks()
    committed = stored = 0
    if ckpt is not None:
        ckpt.close()  # commits what is in flight: its CPU is the "close" group (threads ended by then)
        stats = ckpt.stats()
        committed, stored = stats.versions_committed - committed0, stats.stored_bytes - stored0
    c1 = time.process_time()
    wall = time.perf_counter() - t0
    delta = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    groups = by_group(delta, names)
    total = c1 - c0
    groups["close"] = max(0.0, total - sum(groups.values()))
    shutil.rmtree(root, ignore_errors=True)
    return {"method": args.child, "groups": groups, "total_cpu_s": total, "wall_s": wall,
            "versions_committed": committed, "stored_bytes": stored, "steps": args.steps,
            "load_start": load0, "load_end": os.getloadavg()}


def spawn(method: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = child_argv(__file__, "--child", method, "--config", args.config, "--steps", str(args.steps),
                      "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq))
    if args.dir:
        argv += ["--dir", args.dir]
    run = run_fresh(argv, env={"OMP_NUM_THREADS": str(args.threads)})
    if run.code:
        sys.stderr.write(run.stderr)
        raise SystemExit(f"{method} run failed ({run.code})")
    return run.last_json()


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds: per-group CPU s per committed GiB (asymcheck less none)."""
    none = [r for r in runs if r["method"] == "none"]
    asym = [r for r in runs if r["method"] == "asymcheck"]
    groups = sorted({g for r in asym + none for g in r["groups"]})
    per_gib: dict[str, float] = {}
    for g in groups:
        base = statistics.median(r["groups"].get(g, 0.0) / r["steps"] for r in none)
        vals = [(r["groups"].get(g, 0.0) - base * r["steps"]) / (r["stored_bytes"] / GIB) for r in asym]
        per_gib[g] = statistics.median(vals)
    base_total = statistics.median(r["total_cpu_s"] / r["steps"] for r in none)
    totals = [(r["total_cpu_s"] - base_total * r["steps"]) / (r["stored_bytes"] / GIB) for r in asym]
    return {"cpu_s_per_gib": statistics.median(totals), "cpu_s_per_gib_reps": totals, "by_thread": per_gib,
            "gib_per_version": statistics.median(r["stored_bytes"] / max(1, r["versions_committed"]) / GIB
                                                 for r in asym),
            "versions_committed": [r["versions_committed"] for r in asym],
            "step_s": {m: statistics.median(r["wall_s"] / r["steps"] for r in rs)
                       for m, rs in (("none", none), ("asymcheck", asym))},
            "load": [(r["method"], r["load_start"][0], r["load_end"][0]) for r in runs]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="30m")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the training (default 1)")
    p.add_argument("--dir", default=None, help="where the LocalTier writes (default: the temp dir)")
    p.add_argument("--json", default=None)
    add_child_flag(p)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs = []
    for r, m in rounds(["none", "asymcheck"], args.rounds, rotate=False):  # AB BA AB ...
        runs.append(spawn(m, args))
        x = runs[-1]
        print(f"round {r} {m:9s}: {x['total_cpu_s']:.2f} CPU s over {x['steps']} steps, "
              f"{x['stored_bytes'] / GIB:.2f} GiB committed, load {x['load_start'][0]:.2f}->"
              f"{x['load_end'][0]:.2f}", flush=True)
    s = summarize(runs)
    print(f"\n{args.config}: {s['gib_per_version']:.3f} GiB per version, step none {s['step_s']['none']:.3f} s, "
          f"asymcheck {s['step_s']['asymcheck']:.3f} s")
    print(f"CPU s per checkpointed GiB: {s['cpu_s_per_gib']:.3f} (reps "
          f"{', '.join(f'{v:.3f}' for v in s['cpu_s_per_gib_reps'])})")
    for g, v in sorted(s["by_thread"].items(), key=lambda kv: -kv[1]):
        print(f"  {g:20s} {v:+.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": s}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
