"""DeepSpeed step time with a checkpoint every iteration: none vs attach() vs save_checkpoint, ZeRO-2 and ZeRO-3.

A GPT-2 model (transformers ``GPT2Config``, randomly initialised, nothing
downloaded) trains with DeepSpeed on ``--world`` ranks (CPU accelerator, gloo
on 127.0.0.1), once per stage and method (order rotated per repetition):

- ``none``: no checkpoint (the baseline);
- ``attach``: ``asymcheck.deepspeed.attach(engine, dir)``: a version every
  iteration, copied during the next forward/backward, committed by every rank
  in the background, published globally by rank 0 (the default
  ``commits=CommitOptions(when_busy="wait")``: a commit still running when
  the next version is sealed makes the step wait);
- ``attach-off`` (only with ``--methods``): ``attach()`` with ``CommitOptions(dedup="off")``: below
  ZeRO-3 rank 0 writes the whole model states file, as before slices (``attach`` slices it over the
  ranks: docs/guides/deepspeed.md);
- ``save_checkpoint``: ``engine.save_checkpoint(dir)`` after every step with
  DeepSpeed's default engine (``torch.save``, synchronous; the previous tag is
  deleted after each save, outside the timing).

Reported per stage and method: median and mean iteration time (forward,
backward, ``engine.step()`` and the checkpoint call; the slowest rank), the
ratio to ``none``, and for ``attach`` the stall per step (time the training
thread spent in asymcheck), versions committed and the bytes each rank's shard of the last global
version holds (``shard_bytes``, rank order). Writes JSON and a PNG.

    python benches/deepspeed_overhead.py --quick     # 8M-parameter GPT-2, seq 64, ~5 minutes on 2 cores
    python benches/deepspeed_overhead.py             # GPT-2 124M (slow on CPU)
    python benches/deepspeed_overhead.py --quick --stages 1,2 --methods none,attach,attach-off  # slices vs rank 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import GPT2_CONFIGS, build_gpt2, pyplot, run_ranks, save_figure, slowest_rank_times, write_json

METHODS = ["none", "attach", "save_checkpoint"]
ALL_METHODS = ["none", "attach", "attach-off", "save_checkpoint"]


def engine_for(args: argparse.Namespace, stage: int) -> tuple[Any, int]:
    import deepspeed

    model, opt, nparams = build_gpt2(args.config, args.seq)
    ds = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    return engine, nparams


def run_one(args: argparse.Namespace, stage: int, method: str, rank: int, work: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    engine, nparams = engine_for(args, stage)
    root = work / f"z{stage}-{method}"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    ckpt = None
    if method in ("attach", "attach-off"):
        from asymcheck.deepspeed import attach
        from asymcheck.options import CommitOptions, PartitionOptions, RetentionOptions

        ckpt = attach(engine, root, retention=RetentionOptions(keep_last=2),
                      partitions=PartitionOptions(warmup=min(3, args.warmup)),
                      commits=CommitOptions(dedup="off" if method == "attach-off" else "replicas"))
    vocab = GPT2_CONFIGS[args.config]["vocab_size"]
    times: list[float] = []
    for it in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(it * 7 + rank))
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if method == "save_checkpoint":
            engine.save_checkpoint(str(root), tag=f"step{it}")
        elapsed = time.perf_counter() - t0
        if method == "save_checkpoint" and rank == 0 and it:
            shutil.rmtree(root / f"step{it - 1}", ignore_errors=True)
        if it >= args.warmup:
            times.append(elapsed)
    extra: dict[str, Any] = {}
    if ckpt is not None:
        t0 = time.perf_counter()
        ckpt.close()
        stats = ckpt.stats()
        stalls = [s.overhead_s for s in stats.steps[args.warmup:]]
        extra = {"stall_median_s": statistics.median(stalls) if stalls else 0.0,
                 "versions_committed": stats.versions_committed, "versions_skipped": stats.versions_skipped,
                 "close_s": time.perf_counter() - t0, "plan_partitions": len(ckpt.plan.partitions) if ckpt.plan else 0}
    dist.barrier()
    if ckpt is not None and rank == 0:  # every rank's shard of the last global version
        from asymstore.format.globalmanifest import GlobalManifest

        last = max((GlobalManifest.from_json(p.read_bytes()) for p in (root / "global").glob("v*.json")),
                   key=lambda g: g.step)
        extra["shard_bytes"] = [s.nbytes for s in sorted(last.shards, key=lambda s: s.rank)]
    return {"stage": stage, "method": method, "times": times, "params": nparams, **extra}


def worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch

    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    work = Path(args.dir)
    results = []
    for rep in range(args.reps):
        for stage in args.stages:
            order = args.methods[rep % len(args.methods):] + args.methods[:rep % len(args.methods)]
            for method in order:
                results.append(run_one(args, stage, method, rank, work) | {"rep": rep})
                if rank == 0:
                    r = results[-1]
                    print(f"ZeRO-{stage} {method:<16} median {statistics.median(r['times']):.3f} s", flush=True)
    Path(args.out).with_suffix(f".rank{rank}.json").write_text(json.dumps(results))


def summarize(per_rank: list[list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    import deepspeed
    import torch

    out: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                           "deepspeed": deepspeed.__version__, "world": args.world, "config": args.config,
                           "gpt2": GPT2_CONFIGS[args.config], "seq": args.seq, "batch": args.batch, "steps": args.steps,
                           "warmup": args.warmup, "reps": args.reps, "params": per_rank[0][0]["params"], "stages": {}}
    for stage in args.stages:
        methods: dict[str, Any] = {}
        for method in args.methods:
            runs = [[r for r in rank if r["stage"] == stage and r["method"] == method] for rank in per_rank]
            times = slowest_rank_times(runs)
            entry = {"median_s": statistics.median(times), "mean_s": statistics.fmean(times), "n": len(times)}
            first = runs[0][0]
            for key in ("stall_median_s", "versions_committed", "versions_skipped", "plan_partitions", "close_s",
                        "shard_bytes"):
                if key in first:
                    entry[key] = first[key]
            methods[method] = entry
        base = methods["none"]["median_s"]
        for entry in methods.values():
            entry["ratio_to_none"] = entry["median_s"] / base
        out["stages"][str(stage)] = methods
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    stages = list(results["stages"])
    fig, ax = plt.subplots(figsize=(7, 4))
    methods = list(results["stages"][stages[0]])
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [results["stages"][s][method]["median_s"] for s in stages]
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(stages))]
        bars = ax.bar(xs, values, width, label=method)
        for bar, s in zip(bars, stages, strict=True):
            ratio = results["stages"][s][method]["ratio_to_none"]
            ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(range(len(stages)), [f"ZeRO-{s}" for s in stages])
    ax.set_ylabel("median iteration time (s)")
    ax.set_title(f"GPT-2 {results['config']} ({results['params'] / 1e6:.0f}M params), {results['world']} ranks, "
                 f"checkpoint every iteration", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


def launch(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    codes = run_ranks([sys.executable, __file__, "--worker", *sys.argv[1:]], args.world, args.threads,
                      DS_ACCELERATOR="cpu")
    if any(codes):
        raise SystemExit(f"workers failed: {codes}")
    per_rank = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(args.world)]
    results = summarize(per_rank, args)
    write_json(out.with_suffix(".json"), results, indent=1)
    plot(results, out.with_suffix(".png"))
    shutil.rmtree(args.dir, ignore_errors=True)
    for stage, methods in results["stages"].items():
        for method, e in methods.items():
            extra = f"  stall {e['stall_median_s'] * 1e3:.1f} ms" if "stall_median_s" in e else ""
            if "shard_bytes" in e:
                extra += "  bytes per rank " + " / ".join(f"{b / 2**20:.1f} MiB" for b in e["shard_bytes"])
            print(f"ZeRO-{stage} {method:<16} median {e['median_s']:.3f} s  x{e['ratio_to_none']:.2f}{extra}")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8M-parameter GPT-2, few steps")
    ap.add_argument("--config", choices=sorted(GPT2_CONFIGS), default=None)
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"of {','.join(ALL_METHODS)}")
    ap.add_argument("--steps", type=int, default=None, help="measured iterations per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=None, help="repetitions (method order rotated)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--dir", default="bench-out/deepspeed_overhead-work", help="checkpoint directory (disk to test)")
    ap.add_argument("--out", default="bench-out/deepspeed_overhead")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.config = args.config or ("8m" if args.quick else "124m")
    args.steps = args.steps or (6 if args.quick else 10)
    args.seq = args.seq or (64 if args.quick else 256)
    args.batch = args.batch or (1 if args.quick else 2)
    args.reps = args.reps or (2 if args.quick else 3)
    args.stages = [int(s) for s in str(args.stages).split(",")]
    args.methods = [m for m in str(args.methods).split(",") if m]
    if set(args.methods) - set(ALL_METHODS) or "none" not in args.methods:
        ap.error(f"--methods: of {ALL_METHODS}, with none (the baseline)")
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
