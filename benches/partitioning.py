"""The paper's table on our code: asymmetric vs uniform vs step-boundary partitioning of every-iteration snapshots.

Run by hand (never a timed test), from the repository root::

    .venv/bin/python benches/partitioning.py --quick     # tiny GPT-2, 1 round, fewer steps: about 2 minutes
    .venv/bin/python benches/partitioning.py             # GPT-2 8m and 30m, 4 rounds (long on 2 cores)
    .venv/bin/python benches/partitioning.py --setups single,ddp --configs 30m --rounds 6

Each method is ``asymcheck.Checkpointer(partitions=PartitionOptions(partitioning=...))`` taking a
version after every optimizer step (``pacing=PacingOptions(max_overhead=None)``: no pacing;
``retention=RetentionOptions(keep_last=2)``; commits fsynced to a directory), or none:

- ``none``: no checkpoint (the baseline);
- ``asymmetric``: partitions sized to the measured idle windows between hooks, ``r_i = R * t_i / T``
  (backward partitions larger; AsymCheck);
- ``uniform``: equal partitions, as many issued in the forward pass as in the backward pass, whatever
  the windows (symmetric schemes: DataStates-LLM, OTeaCheck);
- ``step``: the whole state copied in the step pre-hook, blocking, then committed in the background
  (CheckFreq's snapshot/persist split).

Setups, each a GPT-2 built from ``GPT2Config`` (``build_gpt2`` of benches/common.py: seeded, nothing
downloaded) trained with AdamW on synthetic tokens:

- ``single``: plain PyTorch, one process;
- ``ddp``: ``DistributedDataParallel`` on 2 ranks (gloo on 127.0.0.1), the directory a multi-rank store;
- ``zero2``: DeepSpeed ZeRO-2 on 2 ranks (CPU accelerator, gloo) through ``asymcheck.deepspeed.attach``.

Every run is a fresh process (2 for the multi-rank setups, launched by ``run_ranks``). Rounds: each round
runs every setup's methods, the order rotated per round and reversed every other round (ABCD DCBA
BCDA ADCB ...), so drifts of the machine fall on every method alike. The load average before and after,
and at each run's start, is recorded.

Reported per setup, config and method, over the measured iterations of every round (the first
``--warmup`` are not measured; the planner sizes its partitions after 3):

- step time: median wall time of an iteration (forward, backward, optimizer step; the slowest rank
  per iteration), and its ratio to ``none``;
- stall p50 / p90: the time the step pre-hook blocked (the drain: copy what is left and wait, plus
  back-pressure from a commit still running; the slowest rank per iteration); drain p50 / p90: the
  same less the back-pressure, the part the partitioning decides;
- overhead p50: all the time the training thread spent in the Checkpointer (stall, hooks, opening);
- bytes copied per window: what the forward hooks, the backward hooks and the step boundary issued,
  per version (rank 0; ZeRO-2 ranks hold about the same share);
- overlap: the share of the copy thread's busy time that ran while training computed, not while the
  step pre-hook waited for it (``StepRecord.overlap_s / copy_s``).

Threads: one torch thread per rank by default (``--threads``), as in benches/integrations.py: with
as many compute threads as cores the copy and commit threads and OpenMP's spin-waits make step times
erratic; one leaves a core to the background threads, as a GPU job leaves host cores to the checkpoint.

On a GPU (``--device cuda``, the ``single`` setup; the multi-rank setups stay on CPU and gloo) iterations
are timed with CUDA events and the pinned device-to-host limit is measured in the same run
(``d2h_limit_gbps``). The Checkpointer's windows are timed with CUDA events already; its copy engine
does not time the side-stream copies, so on a GPU ``copy_s``/``overlap`` read 0 and the GPU-side stall
shows in the step time only (what is missing: events around each side-stream batch, and achieved D2H
bandwidth against that limit).

Writes JSON (``--out``, default bench-out/partitioning.json) and prints a markdown table. Checkpoints
go to a temporary directory under ``--dir`` (default bench-out/, on the disk to test), removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from common import GPT2_CONFIGS, REPO, build_gpt2, cpu_seconds, git_state, run_ranks, write_json
from harness import add_child_flag, add_quick_flag, child_argv, order, run_fresh, settle

from asymcheck import PARTITIONINGS

METHODS: list[str] = ["none", *PARTITIONINGS]
SETUPS = ["single", "ddp", "zero2"]
WORLD = 2  # ranks of the multi-rank setups
MIB = 1 << 20

logger = logging.getLogger(__name__)


# -- the child: one setup, one method, fresh process(es) -----------------------------------------


class StepTimer:
    """Seconds per iteration: ``perf_counter`` on CPU; CUDA events on a GPU (read once, at the end)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._marks: list[Any] = []

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def start(self) -> None:
        self._marks.append([self._mark(), None])

    def stop(self) -> None:
        self._marks[-1][1] = self._mark()

    def seconds(self) -> list[float]:
        if not self.cuda:
            return [b - a for a, b in self._marks]
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in self._marks]


def d2h_limit_gbps(nbytes: int = 256 * MIB) -> float | None:
    """Device-to-host bandwidth into pinned memory (GB/s, best of 5), the limit of the copies; None on CPU."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return nbytes / best / 1e9


def quiet() -> None:
    """Keep the frameworks' warnings and progress output out of the log."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("transformers", "torch.distributed", "deepspeed", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def tokens(vocab: int, args: argparse.Namespace, it: int, rank: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(it * 7 + rank)
    return torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)


def record_fields(record: Any) -> dict[str, Any]:
    """What one ``StepRecord`` tells about the version it sealed."""
    return {"sealed": record.sealed, "stall_s": record.stall_s, "overhead_s": record.overhead_s,
            "backpressure_s": record.backpressure_s, "copy_s": record.copy_s, "overlap_s": record.overlap_s,
            "forward_bytes": record.forward_bytes, "backward_bytes": record.backward_bytes,
            "boundary_bytes": record.boundary_bytes}


def child(args: argparse.Namespace) -> None:
    setup, method, root_s, result = args.child
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", "0"))
    root = Path(root_s)
    cuda = setup == "single" and args.device == "cuda"
    device = "cuda" if cuda else "cpu"
    vocab = GPT2_CONFIGS[args.config]["vocab_size"]
    ckpt: Any = None
    mode = None if method == "none" else method
    opts: dict[str, Any] = {}  # the Checkpointer's option groups (none for the baseline)
    if mode is not None:
        from asymcheck.options import PacingOptions, PartitionOptions, RetentionOptions

        opts = {"retention": RetentionOptions(keep_last=2), "pacing": PacingOptions(max_overhead=None),
                "partitions": PartitionOptions(partitioning=mode, warmup=3)}
    dist: Any = None
    if setup == "single":
        from asymcheck import Checkpointer

        model, opt, nparams = build_gpt2(args.config, args.seq)
        model.to(device)  # in place: the optimizer keeps the same parameters
        if mode is not None:
            ckpt = Checkpointer(model, opt, root, **opts)

        def step(ids: torch.Tensor) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif setup == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from asymcheck import Checkpointer

        dist.init_process_group("gloo")
        model, _, nparams = build_gpt2(args.config, args.seq)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        if mode is not None:  # a directory in a job of several ranks: a multi-rank store
            ckpt = Checkpointer(ddp, opt, root, **opts)

        def step(ids: torch.Tensor) -> None:
            ddp(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif setup == "zero2":
        import deepspeed
        import torch.distributed as dist

        deepspeed.init_distributed(dist_backend="gloo")
        model, opt, nparams = build_gpt2(args.config, args.seq)
        cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
               "steps_per_print": 10**9, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        if mode is not None:
            from asymcheck.deepspeed import attach

            ckpt = attach(engine, root, **opts)

        def step(ids: torch.Tensor) -> None:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    else:
        raise SystemExit(f"unknown setup {setup!r}")
    if dist is not None:
        dist.barrier()
    timer = StepTimer(cuda)
    total = args.warmup + args.steps
    cpu0 = 0.0
    for it in range(total):
        if it == args.warmup:
            cpu0 = cpu_seconds()
        ids = tokens(vocab, args, it, rank, device)
        timer.start()
        step(ids)
        timer.stop()
    cpu_per_step = (cpu_seconds() - cpu0) / args.steps
    out: dict[str, Any] = {"setup": setup, "method": method, "rank": rank, "params": nparams, "device": device,
                           "step_s": timer.seconds()[args.warmup:], "cpu_s_per_step": cpu_per_step,
                           "threads": torch.get_num_threads(), "d2h_limit_gbps": d2h_limit_gbps() if cuda else None}
    if ckpt is not None:
        t0 = time.perf_counter()
        ckpt.close()
        stats = ckpt.stats()
        records = list(stats.steps)[args.warmup:total]  # one record per step pre-hook: per iteration
        plan = ckpt.plan.to_dict() if ckpt.plan is not None else {}
        plan.pop("partitions", None)
        out |= {"close_s": time.perf_counter() - t0, "records": [record_fields(r) for r in records],
                "versions_committed": stats.versions_committed, "versions_skipped": stats.versions_skipped,
                "versions_dropped": stats.versions_dropped, "commits_failed": stats.commits_failed,
                "plan": plan | {"partitions": len(ckpt.plan.partitions) if ckpt.plan is not None else 0},
                "state_bytes": ckpt.plan.total_bytes if ckpt.plan is not None else 0}
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()
    write_json(f"{result}.rank{rank}", out)


# -- the parent: rounds of fresh processes, the summary -----------------------------------------


def run_one(setup: str, config: str, method: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One run in fresh process(es); the merged result of its ranks, or an ``error``."""
    import json

    root = work / f"{setup}-{config}-{method}"
    result = work / f"{setup}-{config}-{method}.json"
    world = 1 if setup == "single" else WORLD
    argv = child_argv(__file__, "--child", setup, method, str(root), str(result),
                      "--configs", config, "--steps", str(args.steps), "--warmup", str(args.warmup),
                      "--batch", str(args.batch), "--seq", str(args.seq), "--threads", str(args.threads),
                      "--device", args.device)
    settle()  # the previous run's dirty pages must not be written back during this one
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    env = {"OMP_NUM_THREADS": str(args.threads or 1), "DS_ACCELERATOR": "cpu"}
    if world == 1:
        run = run_fresh(argv, env=env, timeout=args.timeout, cwd=REPO)
        codes, log = [run.code], run.log
    else:
        codes, log = run_ranks(argv, world, args.threads or 1, timeout=args.timeout, DS_ACCELERATOR="cpu"), ""
    wall = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    files = [Path(f"{result}.rank{r}") for r in range(world)]
    base = {"setup": setup, "config": config, "method": method, "loadavg_1m": load, "process_s": wall}
    if any(codes) or not all(f.exists() for f in files):
        return base | {"error": f"exit codes {codes}", "log_tail": log[-4000:]}
    ranks = [json.loads(f.read_text()) for f in files]
    for f in files:
        f.unlink()
    return base | {"ranks": ranks}


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (the median for 0.5, else nearest rank), None when empty."""
    if not values:
        return None
    if q == 0.5:
        return statistics.median(values)
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: pooled step time (slowest rank per iteration), stall, bytes per window, overlap."""
    methods: dict[str, Any] = {}
    for method in METHODS:
        ok = [r for r in runs if r["method"] == method and "error" not in r]
        failed = [r for r in runs if r["method"] == method and "error" in r]
        if not ok and not failed:
            continue
        steps = [max(ts) for r in ok for ts in zip(*(rk["step_s"] for rk in r["ranks"]), strict=True)]
        entry: dict[str, Any] = {"runs": len(ok), "failed": len(failed), "step_p50_s": pct(steps, 0.5),
                                 "step_p90_s": pct(steps, 0.9), "step_s": steps,
                                 "cpu_s_per_step": statistics.median(rk["cpu_s_per_step"] for r in ok
                                                                     for rk in r["ranks"]) if ok else None,
                                 "loadavg_1m": [r["loadavg_1m"] for r in ok]}
        with_records = [r for r in ok if "records" in r["ranks"][0]]
        if with_records:
            per_iter = [list(zip(*(rk["records"] for rk in r["ranks"]), strict=True)) for r in with_records]
            stall = [max(x["stall_s"] for x in recs) for its in per_iter for recs in its]
            overhead = [max(x["overhead_s"] for x in recs) for its in per_iter for recs in its]
            drain = [max(x["stall_s"] - x["backpressure_s"] for x in recs) for its in per_iter for recs in its]
            rank0 = [rec for r in with_records for rec in r["ranks"][0]["records"] if rec["sealed"]]
            every = [rec for r in with_records for rk in r["ranks"] for rec in rk["records"]]
            copy_s = sum(x["copy_s"] for x in every)
            entry |= {
                "stall_p50_s": pct(stall, 0.5), "stall_p90_s": pct(stall, 0.9), "overhead_p50_s": pct(overhead, 0.5),
                "drain_p50_s": pct(drain, 0.5), "drain_p90_s": pct(drain, 0.9),
                "backpressure_p50_s": pct([x["backpressure_s"] for x in every], 0.5),
                "forward_bytes": pct([x["forward_bytes"] for x in rank0], 0.5),
                "backward_bytes": pct([x["backward_bytes"] for x in rank0], 0.5),
                "boundary_bytes": pct([x["boundary_bytes"] for x in rank0], 0.5),
                "copy_s_per_step": copy_s / len(every) if every else None,
                "overlap_fraction": sum(x["overlap_s"] for x in every) / copy_s if copy_s > 0 else None,
                "state_bytes": with_records[0]["ranks"][0]["state_bytes"],
                "plan": with_records[0]["ranks"][0]["plan"],
                "versions_committed": [rk["versions_committed"] for r in with_records for rk in r["ranks"]],
                "versions_skipped": sum(rk["versions_skipped"] for r in with_records for rk in r["ranks"]),
                "versions_dropped": sum(rk["versions_dropped"] for r in with_records for rk in r["ranks"]),
                "commits_failed": sum(rk["commits_failed"] for r in with_records for rk in r["ranks"]),
            }
        methods[method] = entry
    base = methods.get("none", {}).get("step_p50_s")
    for entry in methods.values():
        med = entry["step_p50_s"]
        entry["ratio_vs_none"] = med / base if med is not None and base else None
    return methods


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def table(results: dict[str, Any]) -> str:
    """One markdown row per setup, config and method."""
    lines = ["| setup | GPT-2 | method | step p50 | x none | stall p50 / p90 | drain p50 / p90 | overhead p50 | "
             "copied fwd / bwd / boundary | copy overlapped | partitions | versions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, cell in results["cells"].items():
        setup, config = key.split("/")
        for method, m in cell["methods"].items():
            if m["runs"] == 0:
                lines.append(f"| {setup} | {config} | {method} | FAILED ({m['failed']} run(s)) |" + " - |" * 9)
                continue
            mib = (f"{fmt(m.get('forward_bytes'), '.1f', 1 / MIB)} / {fmt(m.get('backward_bytes'), '.1f', 1 / MIB)} / "
                   f"{fmt(m.get('boundary_bytes'), '.1f', 1 / MIB)} MiB" if "forward_bytes" in m else "-")
            versions = "-"
            if "versions_committed" in m:
                versions = f"{min(m['versions_committed'])} committed"
                extra = [f"{m[k]} {k.split('_')[1]}" for k in ("versions_skipped", "versions_dropped",
                                                                 "commits_failed") if m[k]]
                versions += "".join(f", {e}" for e in extra)
            if m["failed"]:
                versions += f" ({m['failed']} run(s) FAILED)"
            def ms(key: str, m: dict[str, Any] = m) -> str:
                if f"{key}_p50_s" not in m:
                    return "-"
                return f"{fmt(m[f'{key}_p50_s'], '.1f', 1e3)} / {fmt(m[f'{key}_p90_s'], '.1f', 1e3)} ms"

            overhead = f"{fmt(m['overhead_p50_s'], '.1f', 1e3)} ms" if "overhead_p50_s" in m else "-"
            lines.append(
                f"| {setup} | {config} | {method} | {fmt(m['step_p50_s'], '.3f')} s | "
                f"{fmt(m['ratio_vs_none'], '.3f')} | {ms('stall')} | {ms('drain')} | {overhead} | {mib} | "
                f"{fmt(m.get('overlap_fraction'), '.0%')} | {m.get('plan', {}).get('partitions', '-')} | {versions} |")
    return "\n".join(lines)


def versions() -> dict[str, str | None]:
    """The versions of torch, transformers and DeepSpeed measured."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "deepspeed", "asymstore"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_flag(ap, "tiny GPT-2, 1 round, fewer steps (about 2 minutes)")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, from {SETUPS}")
    ap.add_argument("--configs", default=None, help=f"comma-separated GPT-2 sizes from {sorted(GPT2_CONFIGS)} "
                                                    "(default 8m,30m; --quick tiny)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {METHODS}")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every method (default 4; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="measured iterations per run (default 12; --quick 6)")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured iterations per run (the plan is sized after 3)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256; --quick 128)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: torch's default)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="where the single-process setup trains (default cuda when available)")
    ap.add_argument("--dir", default=str(REPO / "bench-out"), help="where the temporary checkpoint directory goes")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "partitioning.json"), help="JSON output")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    add_child_flag(ap, nargs=4, metavar=("SETUP", "METHOD", "ROOT", "RESULT"))
    args = ap.parse_args()
    args.configs = args.configs or ("tiny" if args.quick else "8m,30m")
    args.steps = args.steps or (6 if args.quick else 12)
    args.seq = args.seq or (128 if args.quick else 256)
    args.rounds = args.rounds or (1 if args.quick else 4)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.child:
        args.config = args.configs
        child(args)
        return 0
    logging.basicConfig(level=logging.WARNING)
    setups = [s for s in args.setups.split(",") if s]
    configs = [c for c in args.configs.split(",") if c]
    methods = [m for m in args.methods.split(",") if m]
    for name, given, known in (("setups", setups, SETUPS), ("configs", configs, list(GPT2_CONFIGS)),
                               ("methods", methods, METHODS)):
        if unknown := sorted(set(given) - set(known)):
            ap.error(f"unknown {name} {unknown} (from {known})")
    if "zero2" in setups:
        with contextlib.suppress(ImportError):
            import deepspeed  # noqa: F401
        if "deepspeed" not in sys.modules:
            logger.warning("DeepSpeed is not installed: the zero2 setup is left out")
            setups.remove("zero2")
    load_before = os.getloadavg()
    print(f"{len(setups)} setup(s) x {len(configs)} config(s) x {len(methods)} methods x {args.rounds} round(s), "
          f"{args.warmup} + {args.steps} iterations each; load average before {load_before[0]:.2f} "
          f"(cores: {os.cpu_count()})", flush=True)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="partitioning-", dir=args.dir))
    runs: dict[str, list[dict[str, Any]]] = {f"{s}/{c}": [] for s in setups for c in configs}
    started = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            for config in configs:
                for setup in setups:
                    for method in order(methods, rnd):
                        r = run_one(setup, config, method, args, work) | {"round": rnd}
                        runs[f"{setup}/{config}"].append(r)
                        if "error" in r:
                            print(f"  round {rnd} {setup:>6} {config:>5} {method:>10}: FAILED ({r['error']})\n"
                                  f"{r['log_tail']}", flush=True)
                            continue
                        steps = [max(ts) for ts in zip(*(rk["step_s"] for rk in r["ranks"]), strict=True)]
                        print(f"  round {rnd} {setup:>6} {config:>5} {method:>10}: median step "
                              f"{statistics.median(steps):.3f} s, process {r['process_s']:.1f} s, "
                              f"load {r['loadavg_1m']:.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    results: dict[str, Any] = {
        "bench": "partitioning", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
        "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "versions": versions(), "git": git_state(), "device": args.device, "world": WORLD, "batch": args.batch,
        "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "threads": args.threads,
        "loadavg_before": load_before, "loadavg_after": load_after, "wall_s": time.perf_counter() - started,
        "cells": {}}
    for key, cell_runs in runs.items():
        ok = [r for r in cell_runs if "error" not in r]
        params = ok[0]["ranks"][0]["params"] if ok else None
        results["cells"][key] = {"params": params, "gpt2": GPT2_CONFIGS[key.split("/")[1]],
                                 "methods": summarize(cell_runs), "runs": cell_runs}
    write_json(args.out, results, indent=1)
    print()
    print(table(results))
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f} (cores: {os.cpu_count()}); "
          f"{results['wall_s']:.0f} s in all; wrote {args.out}")
    failed = sum(1 for rs in runs.values() for r in rs if "error" in r)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
