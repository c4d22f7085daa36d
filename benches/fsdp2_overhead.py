"""FSDP2: a checkpoint every iteration with asymcheck vs DCP ``async_save``, and resuming on another number of ranks.

Run by hand (never a timed test)::

    .venv/bin/python benches/fsdp2_overhead.py                 # GPT-2 30m, 2 ranks (gloo, CPU)
    .venv/bin/python benches/fsdp2_overhead.py --quick         # tiny GPT-2, a minute

Phase 1 (``--world`` ranks, default 2): GPT-2 from ``GPT2Config`` with every block and the root
sharded by ``fully_shard``, AdamW; per method, ``warmup + steps`` iterations, method order rotated
per repetition:

- ``none``: no checkpoint;
- ``asymcheck``: ``asymcheck.Checkpointer(model, opt, DIR)`` (a RankStore per rank) every iteration;
- ``dcp.async_save``: ``torch.distributed.checkpoint.async_save`` of ``get_state_dict(model, opt)``
  every iteration, the previous save awaited before the next (as its docs advise).

Reported: per iteration the slowest rank's time, median per method, ratio to ``none``.

Phase 2: the state after phase 1 is saved both ways on ``--world`` ranks, then resumed on each
of ``--resume-worlds`` (default 1 and 2) ranks, each method in its own fresh processes, ``--resume-reps``
times in ABBA order (median reported, with its ratio to ``dcp.load``): ``Checkpointer.resume()``
(each rank reads the byte ranges its new pieces overlap) against ``dcp.load`` into
``get_state_dict`` then ``set_state_dict`` (DCP reshards through DTensor). Before every
resume launch both saved versions are dropped from the page cache (``fdatasync`` then
``POSIX_FADV_DONTNEED`` on every file): DCP writes through the page cache and the store with
O_DIRECT, so otherwise ``dcp.load`` would read from memory and the resume from the disk. Each resumed rank
checks its local pieces against the saved global tensors. The floor is measured in the same run,
in fresh processes like the methods (``floor``): each rank reads the segment files the resume reads
(its own shard's on the same world, every shard's on one rank) as the tier does (O_DIRECT, a 16 MiB
bounce), then one xxh3 pass over those bytes (what "never wrong" adds); and the DCP files it reads,
buffered (from the page cache where they are), plus one xxh3 pass over them: ``dcp.load`` with our
verification added costs about ``dcp.load + dcp_hash_s``. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import GPT2_CONFIGS, build_gpt2, evict, files_under, run_ranks, slowest_rank_times, write_json

METHODS = ["none", "asymcheck", "dcp.async_save"]


def sharded(args: argparse.Namespace) -> tuple[Any, Any, int]:
    import torch
    from torch.distributed.fsdp import fully_shard

    model, _, nparams = build_gpt2(args.config, args.seq)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, nparams


def train_step(model: Any, opt: Any, args: argparse.Namespace, it: int, rank: int) -> None:
    import torch

    vocab = GPT2_CONFIGS[args.config]["vocab_size"]
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(it * 7 + rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_method(args: argparse.Namespace, method: str, rank: int, work: Path) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, nparams = sharded(args)
    root = work / method.replace(".", "_")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    ckpt = None
    if method == "asymcheck":
        from asymcheck import Checkpointer
        from asymcheck.options import PacingOptions, RetentionOptions

        ckpt = Checkpointer(model, opt, str(root), retention=RetentionOptions(keep_last=2),
                            pacing=PacingOptions(max_overhead=None))
    pending = None
    # DCP's async save runs collectives from its own thread: on the training group they would interleave
    # with FSDP2's all-gathers (a size mismatch); a dedicated group, as DCP's docs advise
    dcp_group = dist.new_group(backend="gloo") if method == "dcp.async_save" else None
    times: list[float] = []
    for it in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        train_step(model, opt, args, it, rank)
        if method == "dcp.async_save":
            if pending is not None:
                pending.result()
            msd, osd = get_state_dict(model, opt)
            pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"step{it}"),
                                     process_group=dcp_group)
        if it >= args.warmup:
            times.append(time.perf_counter() - t0)
    if pending is not None:
        pending.result()
    if ckpt is not None:
        ckpt.close()
    dist.barrier()
    return {"method": method, "times": times, "params": nparams}


def save_both(args: argparse.Namespace, rank: int, work: Path) -> None:
    """Train ``warmup`` steps, then save the same state with a Checkpointer (on close) and dcp.save."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from asymcheck import Checkpointer
    from asymcheck.options import PacingOptions

    model, opt, _ = sharded(args)
    if rank == 0:
        for d in ("resume-asym", "resume-dcp"):
            shutil.rmtree(work / d, ignore_errors=True)
    dist.barrier()
    with Checkpointer(model, opt, str(work / "resume-asym"), pacing=PacingOptions(max_overhead=None)):
        for it in range(args.warmup):
            train_step(model, opt, args, it, rank)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(work / "resume-dcp"))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in msd.items()}
    if rank == 0:
        torch.save(full, work / "expected-model.pt")
    dist.barrier()


def resume(args: argparse.Namespace, rank: int, work: Path, method: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, _ = sharded(args)
    train_step(model, opt, args, 0, rank)  # the optimizer state exists, as in a job that resumes mid-run
    dist.barrier()
    t0 = time.perf_counter()
    if method == "floor":
        return floor(args, dist.get_rank(), dist.get_world_size(), work)
    if method == "asymcheck":
        from asymcheck import Checkpointer
        from asymcheck.options import PacingOptions

        ckpt = Checkpointer(model, opt, str(work / "resume-asym"),
                            pacing=PacingOptions(max_overhead=None, save_on_close=False))
        if args.profile and rank == 0:
            import cProfile

            prof = cProfile.Profile()
            step = prof.runcall(ckpt.resume)
            seconds = time.perf_counter() - t0
            prof.dump_stats(str(Path(args.out).with_suffix(f".resume{dist.get_world_size()}.prof")))
        else:
            step = ckpt.resume()
            seconds = time.perf_counter() - t0
        ckpt.close()
        assert step == args.warmup, step
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(work / "resume-dcp"))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        seconds = time.perf_counter() - t0
    expected = torch.load(work / "expected-model.pt", weights_only=True)
    msd, _ = get_state_dict(model, opt)
    exact = all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, expected[k]) for k, v in msd.items())
    dist.barrier()
    return {"method": method, "seconds": seconds, "exact": exact}


def floor(args: argparse.Namespace, rank: int, world: int, work: Path) -> dict[str, Any]:
    """Read the files this rank's resume reads, as the tier reads them, and hash them once; the same for DCP's."""
    import torch.distributed as dist
    import xxhash

    from asymstore.io.files import read_large, read_whole
    from asymstore.multirank.globaldir import list_global_steps, read_global

    root = work / "resume-asym"
    g = read_global(str(root / "global"), max(list_global_steps(str(root / "global"))))
    old = [r for r in range(g.world_size) if world == 1 or r == rank]  # the same world: its own shard only
    segs = [f for r in old for f in sorted((root / f"rank-{r:05d}" / f"v{g.shard(r).step:012d}").glob("seg-*"))]
    dcp_files = [f for f in sorted((work / "resume-dcp").glob("*.distcp"))
                 if world == 1 or f.name.startswith(f"__{rank}_")]
    out: dict[str, Any] = {"method": "floor"}
    for key, files, read in (("", segs, read_large), ("dcp_", dcp_files, read_whole)):
        t0 = time.perf_counter()
        bufs = [read(str(f)) for f in files]
        t1 = time.perf_counter()
        for b in bufs:
            xxhash.xxh3_64(b).digest()
        out |= {f"{key}read_s": t1 - t0, f"{key}hash_s": time.perf_counter() - t1,
                f"{key}bytes": sum(len(b) for b in bufs)}
        del bufs
        dist.barrier()
    out["seconds"] = out["read_s"] + out["hash_s"]
    out["exact"] = True
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = Path(args.dir)
    results: list[dict[str, Any]] = []
    if args.phase == "train":
        for rep in range(0 if args.resume_only else args.reps):
            for method in METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]:
                results.append(run_method(args, method, rank, work) | {"rep": rep})
                if rank == 0:
                    print(f"  {method:<16} median {statistics.median(results[-1]['times']):.3f} s", flush=True)
        save_both(args, rank, work)
    else:
        for method in [args.resume_method] if args.resume_method else ["asymcheck", "dcp.load", "floor"]:
            results.append(resume(args, rank, work, method) | {"world": world})
    Path(args.out).with_suffix(f".{args.phase}{world}.rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def launch(args: argparse.Namespace, phase: str, world: int, *extra: str) -> list[list[dict[str, Any]]]:
    argv = [sys.executable, __file__, "--worker", "--phase", phase, *sys.argv[1:], *extra]
    codes = run_ranks(argv, world, args.threads)
    if any(codes):
        raise SystemExit(f"{phase} workers on {world} rank(s) failed: {codes}")
    out = Path(args.out)
    return [json.loads(out.with_suffix(f".{phase}{world}.rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny GPT-2, few steps")
    ap.add_argument("--config", choices=sorted(GPT2_CONFIGS), default=None)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--resume-worlds", default="1,2")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--dir", default="bench-out/fsdp2_overhead-work")
    ap.add_argument("--out", default="bench-out/fsdp2_overhead")
    ap.add_argument("--resume-only", action="store_true",
                    help="skip phase 1's per-iteration timing: train --warmup steps, save both ways, resume")
    ap.add_argument("--resume-reps", type=int, default=1, help="resume launches per world (median reported)")
    ap.add_argument("--resume-method", choices=["asymcheck", "dcp.load", "floor"], help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile rank 0's asymcheck resume (writes OUT.resumeM.prof)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="train", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.config = args.config or ("tiny" if args.quick else "30m")
    args.steps = args.steps or (4 if args.quick else 8)
    args.seq = args.seq or (64 if args.quick else 256)
    args.reps = args.reps or (1 if args.quick else 2)
    if args.worker:
        worker(args)
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    per_rank = launch(args, "train", args.world)
    methods: dict[str, Any] = {}
    for method in [] if args.resume_only else METHODS:
        runs = [[r for r in rank if r["method"] == method] for rank in per_rank]
        times = slowest_rank_times(runs)
        methods[method] = {"median_s": statistics.median(times), "n": len(times)}
    for entry in methods.values():
        entry["ratio_to_none"] = entry["median_s"] / methods["none"]["median_s"]
    resumes: dict[str, Any] = {}
    for world in (int(w) for w in args.resume_worlds.split(",")):
        per_rep: dict[str, list[dict[str, Any]]] = {}
        for rep in range(args.resume_reps):  # a fresh set of processes per method and repetition, ABBA
            for method in ("asymcheck", "dcp.load", "floor")[::1 if rep % 2 == 0 else -1]:
                # every resume starts cold: DCP wrote through the page cache, the store with O_DIRECT
                cached = evict(files_under(str(Path(args.dir) / "resume-asym"))
                               + files_under(str(Path(args.dir) / "resume-dcp")), "fadvise")
                ranks = launch(args, "resume", world, "--resume-method", method)
                rows = [next(r for r in rank if r["method"] == method) for rank in ranks]
                row: dict[str, Any] = {"seconds": max(r["seconds"] for r in rows),
                                       "exact": all(r["exact"] for r in rows), "resident_before": cached}
                if method == "floor":  # the slowest rank's of each part
                    row |= {k: max(r[k] for r in rows) for k in ("read_s", "hash_s", "dcp_read_s", "dcp_hash_s")}
                per_rep.setdefault(method, []).append(row)
        for method, reps in per_rep.items():
            entry: dict[str, Any] = {"seconds": statistics.median(r["seconds"] for r in reps),
                                     "all_s": [r["seconds"] for r in reps], "exact": all(r["exact"] for r in reps),
                                     "resident_before": max(r["resident_before"] for r in reps)}
            if method == "floor":
                entry |= {k: statistics.median(r[k] for r in reps)
                          for k in ("read_s", "hash_s", "dcp_read_s", "dcp_hash_s")}
            resumes[f"{args.world}->{world} {method}"] = entry
        asym, ref = (resumes[f"{args.world}->{world} {m}"]["seconds"] for m in ("asymcheck", "dcp.load"))
        fl = resumes[f"{args.world}->{world} floor"]
        resumes[f"{args.world}->{world} asymcheck"] |= {
            "ratio_to_dcp_load": asym / ref, "ratio_to_floor": asym / fl["seconds"],
            "ratio_to_dcp_load_plus_hash": asym / (ref + fl["dcp_hash_s"])}
    params = per_rank[0][0]["params"] if per_rank[0] else None  # --resume-only: no phase 1 rows
    results = {"config": args.config, "gpt2": GPT2_CONFIGS[args.config], "params": params,
               "world": args.world, "seq": args.seq, "batch": args.batch, "steps": args.steps, "reps": args.reps,
               "threads": args.threads, "cpus": os.cpu_count(), "methods": methods, "resume": resumes,
               "load_avg": os.getloadavg()}
    write_json(Path(args.out).with_suffix(".json"), results, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    for method, e in methods.items():
        print(f"{method:<16} median {e['median_s']:.3f} s  x{e['ratio_to_none']:.2f}")
    for key, e in resumes.items():
        if key.endswith(" floor"):
            print(f"resume {key:<24} {e['seconds']:.3f} s  (O_DIRECT read {e['read_s']:.3f} + xxh3 {e['hash_s']:.3f}; "
                  f"DCP files buffered read {e['dcp_read_s']:.3f} + xxh3 {e['dcp_hash_s']:.3f})")
            continue
        ratio = (f"  x{e['ratio_to_dcp_load']:.2f} dcp.load, x{e['ratio_to_dcp_load_plus_hash']:.2f} dcp.load+xxh3, "
                 f"x{e['ratio_to_floor']:.2f} floor") if "ratio_to_dcp_load" in e else ""
        print(f"resume {key:<24} {e['seconds']:.3f} s  {'bit-exact' if e['exact'] else 'NOT EXACT'}{ratio}"
              f"  (page cache before: {e['resident_before']:.0%} resident)")
    print(f"wrote {Path(args.out).with_suffix('.json')}")


if __name__ == "__main__":
    main()
