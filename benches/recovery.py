"""Recovery: resume a GPT-2 training state into a live model and optimizer, each way in a fresh process.

Run by hand (never a timed test)::

    .venv/bin/python benches/recovery.py                    # 30m and 124m GPT-2 + AdamW state
    .venv/bin/python benches/recovery.py --configs 30m --repeat 3

The parent trains one step of GPT-2 (from ``GPT2Config``, no download) with
AdamW, under an ``asymcheck.Checkpointer``, then saves the model and optimizer
state five ways:

- ``local``: an ``AsymStore`` over a ``LocalTier`` (fsynced, atomic);
- ``shm``: an ``AsymStore`` over ``host_tier(path=/dev/shm/...)``;
- ``torch.load``: ``torch.save`` of both state dicts, fsynced;
- ``dcp.load``: ``torch.distributed.checkpoint.save`` of both state dicts;
- ``checkpointer``: the version the Checkpointer (over a ``LocalTier``)
  committed of that step as it closed.

Each resume runs in a fresh process that builds the live model and optimizer,
drops the saved files from the page cache (``posix_fadvise`` after
``fdatasync``; shm files stay in memory, as after a process crash), then
times loading the saved state into them: ``AsymStore.restore(into=...)``
straight into the live parameters and optimizer tensors; ``torch.load`` then
``load_state_dict`` of both; ``dcp.load`` into the state dicts then
``load_state_dict``; ``Checkpointer(model, opt, [LocalTier(...)])`` and its
``resume()`` (the constructor opens the store; both are timed, and each apart).
Each child checks the loaded state bit-exact against
the parent's. Limits measured in the same run: an O_DIRECT read of the
``local`` version's segment files (page cache dropped), and one memcpy of
the whole state into preallocated tensors. Targets: shm resume <= 3x the
memcpy; local resume <= 1.25x the O_DIRECT read. Writes JSON and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO, build_gpt2, evict, files_under, git_state, odirect_read, same_bytes, write_json
from harness import add_child_flag, child_argv, run_fresh

METHODS = ["local", "shm", "torch.load", "dcp.load", "checkpointer"]


def live(config: str, ckpt_root: Path | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer with state after one step (deterministic).

    With ``ckpt_root``, the step runs under an ``asymcheck.Checkpointer`` over
    a LocalTier there, which commits the state after the step when it closes.
    """
    model, opt, _ = build_gpt2(config, 64)
    model.train()
    ckpt: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if ckpt_root is not None:
        from asymcheck import Checkpointer
        from asymcheck.options import RetentionOptions
        from asymstore import LocalTier

        ckpt = Checkpointer(model, opt, [LocalTier(ckpt_root)], retention=RetentionOptions(keep_last=1))
    with ckpt:
        x = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the training state, by a stable name: parameters (and buffers) and optimizer tensors."""
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[id(p)]}/{k}"] = v
    return out


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# -- the parent: save four ways, measure limits ------------------------------


async def save_store(tiers: list[Any], state: dict[str, torch.Tensor]) -> None:
    from asymstore import AsymStore

    async with AsymStore(tiers, keep_last=1) as store:
        await store.put_many(1, state)
        await store.commit(1)


def save_all(config: str, work: Path, shm: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from asymstore import LocalTier, host_tier

    model, opt = live(config, work / "ckpt")  # "checkpointer": the Checkpointer commits the step as it closes
    state = flat_state(model, opt)
    asyncio.run(save_store([LocalTier(work / "local")], state))
    asyncio.run(save_store([host_tier(capacity_bytes=4 * nbytes(state) + (64 << 20), path=str(shm))], state))
    path = work / "torch" / "state.pt"
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(work / "dcp"))
    torch.save(state, work / "expected.pt")  # the children's reference (not part of any timing)
    return {"tensors": len(state), "nbytes": nbytes(state)}


def memcpy_seconds(config: str, repeat: int) -> float:
    model, opt = live(config)
    state = flat_state(model, opt)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    threads = torch.get_num_threads()
    best = []
    for n in sorted({1, threads}):  # the floor is the faster way: on a busy host torch's threads can spin
        torch.set_num_threads(n)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            for k, v in state.items():
                dest[k].copy_(v)
            times.append(time.perf_counter() - start)
        best.append(statistics.median(times))
    torch.set_num_threads(threads)
    return min(best)


def odirect_seconds(root: Path) -> float:
    files = [f for f in files_under(str(root)) if os.path.basename(f).startswith("seg-")]
    evict(files, "fadvise")
    buf = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return sum(odirect_read(f, buf)[0] for f in files)


# -- the child: one resume ------------------------------------------------------


def child(config: str, method: str, work: Path, shm: Path) -> dict[str, Any]:
    model, opt = live(config)  # the live objects a restarted job has before it resumes
    for p in model.parameters():
        with torch.no_grad():
            p.zero_()  # so a resume that loads nothing cannot pass the check
    targets = flat_state(model, opt)
    if method == "local":
        evict(files_under(str(work / "local")), "fadvise")
    elif method == "torch.load":
        evict([str(work / "torch" / "state.pt")], "fadvise")
    elif method == "dcp.load":
        evict(files_under(str(work / "dcp")), "fadvise")
    elif method == "checkpointer":
        evict(files_under(str(work / "ckpt")), "fadvise")
    extra: dict[str, Any] = {}
    start = time.perf_counter()
    if method == "checkpointer":
        from asymcheck import Checkpointer
        from asymcheck.options import RetentionOptions
        from asymstore import LocalTier

        ckpt = Checkpointer(model, opt, [LocalTier(work / "ckpt")], retention=RetentionOptions(keep_last=1))
        opened = time.perf_counter()
        step = ckpt.resume()
        extra = {"open_s": opened - start, "resume_s": time.perf_counter() - opened, "step": step}
    elif method in ("local", "shm"):
        from asymstore import AsymStore, LocalTier, host_tier

        tier: Any = LocalTier(work / "local") if method == "local" else host_tier(capacity_bytes=1 << 40,
                                                                                   path=str(shm))

        async def restore() -> None:
            async with AsymStore([tier]) as store:
                await store.restore(into=targets)
        asyncio.run(restore())
    elif method == "torch.load":
        doc = torch.load(work / "torch" / "state.pt", weights_only=True)
        model.load_state_dict(doc["model"])
        opt.load_state_dict(doc["optim"])
    else:
        import torch.distributed.checkpoint as dcp

        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=str(work / "dcp"))
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    seconds = time.perf_counter() - start
    if method == "checkpointer":
        ckpt.close()  # untimed; saves nothing: the step restored is the one it holds
    expected = torch.load(work / "expected.pt", weights_only=True)
    got = flat_state(model, opt)
    exact = got.keys() == expected.keys() and all(same_bytes(got[k], expected[k]) for k in expected)
    return {"method": method, "seconds": seconds, "exact": exact, **extra}


def run_child(config: str, method: str, work: Path, shm: Path) -> dict[str, Any]:
    run = run_fresh(child_argv(__file__, "--child", config, method, str(work), str(shm)))
    if run.code != 0:
        raise RuntimeError(f"{method} child failed:\n{run.stderr[-3000:]}")
    return run.last_json()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="30m,124m")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "recovery.json"))
    ap.add_argument("--methods", default=",".join(METHODS), help="the resumes to time (default: all)")
    add_child_flag(ap, nargs=4)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], Path(args.child[2]), Path(args.child[3]))))
        return 0
    methods = [m for m in METHODS if m in args.methods.split(",")]
    results = []
    for config in args.configs.split(","):
        work = Path(tempfile.mkdtemp(prefix="recovery-", dir=args.dir))
        shm = Path(tempfile.mkdtemp(prefix="recovery-", dir="/dev/shm")) / "tier"
        try:
            info = save_all(config, work, shm)
            row: dict[str, Any] = {"config": config, **info, "memcpy_s": memcpy_seconds(config, 3),
                                   "odirect_read_s": statistics.median(odirect_seconds(work / "local")
                                                                       for _ in range(args.repeat))}
            for method in methods:
                runs = [run_child(config, method, work, shm) for _ in range(args.repeat)]
                row[method] = {"seconds": statistics.median(r["seconds"] for r in runs),
                               "samples": [r["seconds"] for r in runs], "exact": all(r["exact"] for r in runs)}
                for key in ("open_s", "resume_s"):  # checkpointer: the constructor and resume() apart
                    if key in runs[0]:
                        row[method][key] = statistics.median(r[key] for r in runs)
            nan = float("nan")
            sec = {m: row[m]["seconds"] if m in row else nan for m in METHODS}
            row["shm_vs_memcpy"] = sec["shm"] / row["memcpy_s"]
            row["local_vs_odirect"] = sec["local"] / row["odirect_read_s"]
            row["checkpointer_vs_odirect"] = sec["checkpointer"] / row["odirect_read_s"]
            row["checkpointer_vs_local"] = sec["checkpointer"] / sec["local"]
            results.append(row)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(shm.parent, ignore_errors=True)
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load": os.getloadavg()},
           "git": git_state(), "results": results}
    write_json(args.out, doc)
    for r in results:
        print(f"{r['config']}: {r['nbytes'] / 2**30:.2f} GiB in {r['tensors']} tensors; "
              f"memcpy {r['memcpy_s']:.2f} s, O_DIRECT read {r['odirect_read_s']:.2f} s")
        for m in (m for m in METHODS if m in r):
            apart = (f"  (constructor {r[m]['open_s']:.2f} s + resume() {r[m]['resume_s']:.2f} s)"
                     if "resume_s" in r[m] else "")
            print(f"  {m:<12} {r[m]['seconds']:6.2f} s  exact={r[m]['exact']}{apart}")
        print(f"  shm / memcpy = {r['shm_vs_memcpy']:.2f} (target <= 3); "
              f"local / O_DIRECT = {r['local_vs_odirect']:.2f} (target <= 1.25); "
              f"checkpointer / O_DIRECT = {r['checkpointer_vs_odirect']:.2f}, / local = "
              f"{r['checkpointer_vs_local']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
