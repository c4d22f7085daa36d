"""Training overhead of a checkpoint every iteration: none vs asymcheck vs torch.save vs DCP async_save.

The same GPT-2 model, optimizer and synthetic data are trained with each
method in turn, each run in a fresh process (runs interleaved, the method order
rotated and reversed every other repetition, ABBA); every method checkpoints
after every optimizer step into its own directory:

- ``none``: no checkpoint (the baseline).
- ``asymcheck``: ``asymcheck.Checkpointer`` into a LocalTier (fsynced, atomic);
  when a commit is still running as the next version is sealed, it waits.
- ``asymcheck-skip``: the same with ``commits=CommitOptions(when_busy="skip")``:
  it drops that version instead (the counts of committed and skipped versions are reported).
- ``asymcheck-inline`` (only with ``--methods``): copies inside the hooks
  instead of on the copy thread, to measure what the thread buys.
- ``asymcheck-1slot`` (only with ``--methods``): one host slot instead of the
  default two, for half the staging memory: a version opened while the last
  one is still written is copied by the hooks once that write gives the slot
  back (only the drain waits for it).
- ``torch.save``: ``torch.save`` of the model and optimizer state dicts to a
  temporary file, fsync, ``os.replace`` (synchronous, the classic way).
- ``dcp.async_save``: ``torch.distributed.checkpoint.async_save`` (stages a
  CPU copy synchronously, writes in the background; one save in flight, the
  previous one awaited before the next starts, as its docs advise).
- ``floor``: the least work a per-iteration checkpoint of these bytes can do
  on this machine, without any of the library: after each step a background
  thread copies every parameter and optimizer tensor once (memmove into a
  buffer reused from step to step, GIL released), hashes the copy once (xxh3)
  and writes it with O_DIRECT and fsync (``asymstore.io.files.write_parts``);
  one in flight, the next step waits for it. No consistency (the copy races
  the next step), no manifest: a lower bound on what a checkpoint every step
  costs here, for the targets to be read against.

Reported per config and method: median iteration time, its ratio to
``none``, and the stall per step (time the training thread spent inside the
checkpointing code), and the process CPU seconds per step (training plus
every background thread of the method) with, beside it, the CPU seconds per
checkpoint (that figure less ``none``'s) and per GiB checkpointed (that, over
the state's bytes times the share of steps whose version was committed;
``benches/cpu_profile.py`` splits it per thread), and the peak RSS growth of each run
over the RSS at its start (sampled every 10 ms, and the kernel's VmHWM;
median and max over the repetitions, in GiB and as a multiple of the state:
fp32 parameters + two AdamW moments). Per config, for each asymcheck method,
the targets as ratios: step time <= 1.10x none; its overhead over none <= 0.5
of dcp.async_save's; peak RSS growth <= ``CommitOptions.host_slots`` (2, the
Checkpointer's default) x state + 256 MiB. Between runs the page cache is synced (and the
C heap trimmed), so one method's write-back or freed memory does not affect
the next. Writes JSON and a PNG of stall per step.

    python benches/train_overhead.py                 # ~30M and 124M GPT-2 (slow on CPU)
    python benches/train_overhead.py --quick         # small configs, a few minutes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    GIB,
    GPT2_CONFIGS,
    MIB,
    RssSampler,
    build_gpt2,
    cpu_seconds,
    pyplot,
    release_free_memory,
    save_figure,
    write_json,
)
from harness import add_child_flag, add_quick_flag, order, run_fresh, take_json
from harness import child_argv as harness_argv

from asymcheck import Checkpointer
from asymcheck.options import CommitOptions, CopyMode, RetentionOptions, WhenBusy
from asymstore import LocalTier

METHODS = ["none", "asymcheck", "asymcheck-skip", "torch.save", "dcp.async_save", "floor"]
HOST_SLOTS: int = CommitOptions().host_slots  # what Asym runs with (the Checkpointer's default)
RSS_SLACK = 256 * MIB  # the RSS target: peak growth <= HOST_SLOTS x state + this
TARGET_STEP_RATIO = 1.10  # asymcheck step time / none
TARGET_OVERHEAD_VS_DCP = 0.5  # asymcheck's step-time overhead / dcp.async_save's
TARGET_RSS_X_STATE = 1.25  # peak RSS growth less none's / state


def tokens(vocab: int, batch: int, seq: int, step: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(step))


class Method:
    """One way of checkpointing; ``after_step`` runs after each optimizer step, returns its stall."""

    def __init__(self, root: Path) -> None:
        self.root = root
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)

    def after_step(self, step: int) -> float:
        return 0.0

    def close(self) -> list[float] | None:
        """Finish; return per-step stalls measured by the method itself, if it has its own."""
        return None


class TorchSave(Method):
    def __init__(self, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(root)
        self.model, self.opt = model, opt

    def after_step(self, step: int) -> float:
        t0 = time.perf_counter()
        tmp = self.root / "ckpt.pt.tmp"
        with open(tmp, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / "ckpt.pt")
        fd = os.open(self.root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter() - t0


class DcpAsync(Method):
    def __init__(self, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(root)
        self.model, self.opt = model, opt
        self.pending: Any = None
        self.dirs: list[Path] = []

    def _wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
            while len(self.dirs) > 2:
                shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def after_step(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self._wait()
        path = self.root / f"step-{step}"
        self.dirs.append(path)
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        self.pending = dcp.async_save(state, checkpoint_id=str(path))
        return time.perf_counter() - t0

    def close(self) -> list[float] | None:
        self._wait()
        return None


class Floor(Method):
    def __init__(self, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(root)
        import concurrent.futures

        self.model, self.opt = model, opt
        self.tensors: list[torch.Tensor] = []
        self.buf: torch.Tensor | None = None  # allocated on the first save (the optimizer state exists by then)
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.pending: Any = None

    def _save(self, step: int) -> None:
        import ctypes

        import xxhash

        from asymstore.format.tensors import as_bytes
        from asymstore.io.files import write_parts

        assert self.buf is not None
        at = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            ctypes.memmove(self.buf.data_ptr() + at, t.data_ptr(), n)
            at += n
        data = as_bytes(self.buf)
        xxhash.xxh3_64_hexdigest(data)
        path = self.root / f"floor-{step % 2}.bin"
        path.unlink(missing_ok=True)
        write_parts(str(path), [data], fsync=True)

    def after_step(self, step: int) -> float:
        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.result()
        if self.buf is None:  # AdamW's moments exist after the first step
            self.tensors = [p.detach() for p in self.model.parameters()] + [
                v for st in self.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
            buf = torch.empty(nbytes + 4096, dtype=torch.uint8)
            skew = -buf.data_ptr() % 4096  # page aligned, so O_DIRECT writes from it in place
            self.buf = buf[skew:skew + nbytes]
        self.pending = self.pool.submit(self._save, step)
        return time.perf_counter() - t0

    def close(self) -> list[float] | None:
        if self.pending is not None:
            self.pending.result()
        self.pool.shutdown()
        return None


class Asym(Method):
    def __init__(self, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, when_busy: WhenBusy,
                 copy: CopyMode = "thread", host_slots: int = HOST_SLOTS) -> None:
        super().__init__(root)
        self.ckpt = Checkpointer(model, opt, [LocalTier(root)], retention=RetentionOptions(keep_last=2),
                                 commits=CommitOptions(when_busy=when_busy, copy=copy, host_slots=host_slots))

    def close(self) -> list[float] | None:
        self.ckpt.close()
        stats = self.ckpt.stats()
        self.committed, self.skipped = stats.versions_committed, stats.versions_skipped
        return [r.overhead_s for r in stats.steps]


def run(method: str, model: torch.nn.Module, opt: torch.optim.Optimizer, vocab: int, args: argparse.Namespace,
        root: Path, first_step: int) -> dict[str, Any]:
    makers: dict[str, Callable[[], Method]] = {
        "none": lambda: Method(root),
        "asymcheck": lambda: Asym(root, model, opt, "wait"),
        "asymcheck-skip": lambda: Asym(root, model, opt, "skip"),
        "asymcheck-inline": lambda: Asym(root, model, opt, "wait", copy="inline"),
        "asymcheck-1slot": lambda: Asym(root, model, opt, "wait", host_slots=1),
        "torch.save": lambda: TorchSave(root, model, opt),
        "dcp.async_save": lambda: DcpAsync(root, model, opt),
        "floor": lambda: Floor(root, model, opt),
    }
    os.sync()  # the previous run's dirty pages must not be written back during this one
    time.sleep(1.0)
    release_free_memory()  # what earlier runs freed but the allocator kept must not hide this run's growth
    rss = RssSampler().start()  # the baseline: before the method allocates anything
    m = makers[method]()
    iters, stalls = [], []
    cpu0 = 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        x = tokens(vocab, args.batch, args.seq, first_step + i)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stall = m.after_step(first_step + i)
        iters.append(time.perf_counter() - t0)
        stalls.append(stall)
    own = m.close()
    cpu_per_step = (cpu_seconds() - cpu0) / args.steps  # includes the method's background threads
    rss.stop()
    if own is not None:  # asymcheck measures itself: all time in its hooks, drain included
        stalls = own[:len(iters)] + [0.0] * (len(iters) - len(own))
    shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"iter_s": iters[args.warmup:], "stall_s": stalls[args.warmup:], "cpu_s": cpu_per_step,
                           "rss": rss.as_dict()}
    if isinstance(m, Asym):
        out["committed"], out["skipped"] = m.committed, m.skipped
    return out


def summarize(per: dict[str, dict[str, list[float]]], counts: dict[str, list[int]],
              state_bytes: int) -> dict[str, dict[str, Any]]:
    """Per method: medians of step, stall and CPU time; CPU s per checkpoint; peak RSS growth over the reps."""
    base = statistics.median(per["none"]["iter_s"]) if "none" in per else None
    base_cpu = statistics.median(per["none"]["cpu_s"]) if "none" in per else None
    summary: dict[str, dict[str, Any]] = {}
    for method, data in per.items():
        med = statistics.median(data["iter_s"])
        cpu = statistics.median(data["cpu_s"])
        growth = [int(g) for g in data["rss_growth"]]
        summary[method] = {
            "median_step_s": med, "ratio_vs_none": med / base if base else None,
            "median_stall_s": statistics.median(data["stall_s"]),
            "cpu_s_per_step": cpu,
            "iter_s": data["iter_s"], "stall_s": data["stall_s"],
            # every step checkpoints: the method's CPU s per step over none's is its CPU cost per checkpoint
            "overhead_s": med - base if base is not None else None,
            "cpu_s_per_step_reps": data["cpu_s"],
            "cpu_s_per_checkpoint": cpu - base_cpu if base_cpu is not None else None,
            # per GiB of state checkpointed (asymcheck-skip: of the versions it committed, not skipped)
            "cpu_s_per_gib": ((cpu - base_cpu) / (state_bytes * _committed_share(counts.get(method)) / GIB)
                              if base_cpu is not None and method != "none" and _committed_share(counts.get(method))
                              else None),
            # peak RSS over the RSS at the start of each run (before the method allocated anything)
            "rss_growth_bytes": growth, "rss_baseline_bytes": [int(b) for b in data["rss_baseline"]],
            "median_rss_growth_bytes": statistics.median(growth), "max_rss_growth_bytes": max(growth),
            "median_rss_growth_x_state": statistics.median(growth) / state_bytes,
            "max_rss_growth_x_state": max(growth) / state_bytes,
        }
        if method in counts:
            summary[method]["versions_committed"], summary[method]["versions_skipped"] = counts[method]
    return summary


def _committed_share(count: list[int] | None) -> float:
    """The share of steps whose checkpoint was taken: committed / (committed + skipped); 1 for other methods."""
    if not count or not sum(count):
        return 1.0
    return count[0] / sum(count)


def _goal(value: float | None, target: float, **extra: Any) -> dict[str, Any]:
    return {"value": value, "target": target, "met": value is not None and value <= target, **extra}


def targets(summary: dict[str, dict[str, Any]], state_bytes: int) -> dict[str, dict[str, Any]]:
    """For each asymcheck method run: the targets as ratios (value <= target).

    ``step_ratio``: median step / none's (<= 1.10); ``overhead_vs_dcp``: its
    step-time overhead over none / dcp.async_save's (<= 0.5); ``rss_growth``:
    the largest peak RSS growth of its reps / (host_slots x state + 256 MiB) (<= 1);
    ``rss_over_none``: the same less ``none``'s largest growth (the training step's own
    activations and gradients grow the RSS too; this is what checkpointing adds).
    """
    dcp = summary.get("dcp.async_save", {}).get("overhead_s")
    none_growth = summary.get("none", {}).get("max_rss_growth_bytes")
    rss_limit = HOST_SLOTS * state_bytes + RSS_SLACK
    out: dict[str, dict[str, Any]] = {}
    for method, s in summary.items():
        if not method.startswith("asymcheck"):
            continue
        overhead = s["overhead_s"]
        out[method] = {
            "step_ratio": _goal(s["ratio_vs_none"], TARGET_STEP_RATIO),
            "overhead_vs_dcp": _goal(overhead / dcp if overhead is not None and dcp else None,
                                     TARGET_OVERHEAD_VS_DCP, overhead_s=overhead, dcp_overhead_s=dcp),
            "rss_growth": _goal(s["max_rss_growth_bytes"] / rss_limit, 1.0, growth_bytes=s["max_rss_growth_bytes"],
                                limit_bytes=rss_limit, host_slots=HOST_SLOTS, slack_bytes=RSS_SLACK),
            "rss_over_none": _goal((s["max_rss_growth_bytes"] - none_growth) / rss_limit
                                   if none_growth is not None else None, 1.0,
                                   growth_bytes=s["max_rss_growth_bytes"] - (none_growth or 0), limit_bytes=rss_limit),
            # issue 21's target: what checkpointing adds to the peak RSS, as a multiple of the state
            "rss_x_state": _goal((s["max_rss_growth_bytes"] - none_growth) / state_bytes
                                 if none_growth is not None else None, TARGET_RSS_X_STATE),
            # the least a checkpoint every step costs here (``floor``), measured in the same run
            "floor_step_ratio": {"value": summary.get("floor", {}).get("ratio_vs_none")},
        }
    return out


def print_targets(goals: dict[str, dict[str, Any]]) -> None:
    """One line per asymcheck method: each target as a ratio, met or not."""
    def verdict(g: dict[str, Any], fmt: str) -> str:
        if g["value"] is None:
            return "n/a"
        return f"{g['value']:{fmt}} (<= {g['target']:g}: {'met' if g['met'] else 'NOT met'})"

    for method, g in goals.items():
        o, r = g["overhead_vs_dcp"], g["rss_growth"]
        overhead = (f"overhead {o['overhead_s']:.3f} s / dcp.async_save's {o['dcp_overhead_s']:.3f} s = "
                    if o["value"] is not None else "overhead vs dcp.async_save's: ")
        print(f"  targets {method}: step / none = {verdict(g['step_ratio'], '.3f')}; {overhead}"
              f"{verdict(o, '.2f')}; peak RSS growth (max of reps) {r['growth_bytes'] / GIB:.2f} GiB / "
              f"({r['host_slots']} x state + {r['slack_bytes'] // MIB} MiB = {r['limit_bytes'] / GIB:.2f} GiB) = "
              f"{verdict(r, '.2f')}; less none's growth: {g['rss_over_none']['growth_bytes'] / GIB:.2f} GiB = "
              f"{verdict(g['rss_over_none'], '.2f')}; that over the state: {verdict(g['rss_x_state'], '.2f')}"
              + (f"; floor's step / none = {g['floor_step_ratio']['value']:.3f}"
                 if g["floor_step_ratio"]["value"] is not None else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_flag(ap, "small configs, fewer steps")
    ap.add_argument("--configs", default=None, help=f"comma-separated, from {sorted(GPT2_CONFIGS)}")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=None, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps per run (asymcheck plans after 3)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of every method")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dir", default="bench-out/train_overhead-work", help="scratch directory on the disk to test")
    ap.add_argument("--out", default="bench-out/train_overhead")
    add_child_flag(ap, nargs=4, metavar=("CONFIG", "METHOD", "FIRST_STEP", "RESULT"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.child:
        return child(args)
    configs = (args.configs or ("tiny,8m" if args.quick else "30m,124m")).split(",")
    args.steps = args.steps or (4 if args.quick else 6)
    args.reps = args.reps or 2
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    results: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "batch": args.batch, "seq": args.seq,
                               "steps": args.steps, "warmup": args.warmup, "reps": args.reps, "configs": {}}
    for name in configs:
        _, _, nparams = build_gpt2(name, args.seq)  # its size; every run builds its own in its process
        state_bytes = 3 * 4 * nparams
        per: dict[str, dict[str, list[float]]] = {
            m: {"iter_s": [], "stall_s": [], "cpu_s": [], "rss_growth": [], "rss_baseline": []} for m in methods}
        counts: dict[str, list[int]] = {}
        step = 0
        print(f"{name}: {nparams / 1e6:.1f}M parameters, {state_bytes / 2**30:.2f} GiB of state per checkpoint")
        for rep in range(args.reps):
            for method in order(methods, rep):  # each run in a fresh process: no method inherits another's heap
                r = run_child(name, method, step, args)
                step += args.warmup + args.steps
                per[method]["iter_s"] += r["iter_s"]
                per[method]["stall_s"] += r["stall_s"]
                per[method]["cpu_s"].append(r["cpu_s"])
                per[method]["rss_growth"].append(r["rss"]["peak_growth_bytes"])
                per[method]["rss_baseline"].append(r["rss"]["baseline_bytes"])
                if "committed" in r:
                    c = counts.setdefault(method, [0, 0])
                    c[0] += r["committed"]
                    c[1] += r["skipped"]
                print(f"  rep {rep} {method:>15}: median step {statistics.median(r['iter_s']):.3f} s, "
                      f"median stall {statistics.median(r['stall_s']):.3f} s, "
                      f"{r['cpu_s']:.2f} CPU s/step, peak RSS +{r['rss']['peak_growth_bytes'] / GIB:.2f} GiB "
                      f"({r['rss']['peak_growth_bytes'] / state_bytes:.2f}x state)", flush=True)
        summary = summarize(per, counts, state_bytes)
        goals = targets(summary, state_bytes)
        results["configs"][name] = {"params": nparams, "state_bytes": state_bytes, "methods": summary,
                                    "host_slots": HOST_SLOTS, "targets": goals}
        for method, s in summary.items():
            ratio = f"{s['ratio_vs_none']:.3f}x" if s["ratio_vs_none"] else "-"
            extra = (f", {s['versions_committed']} versions committed, {s['versions_skipped']} skipped"
                     if "versions_committed" in s else "")
            per_ckpt = (f" ({s['cpu_s_per_checkpoint']:+.2f} CPU s per checkpoint"
                        + (f", {s['cpu_s_per_gib']:.2f} CPU s per GiB" if s["cpu_s_per_gib"] is not None else "")
                        + ")" if s["cpu_s_per_checkpoint"] is not None else "")
            print(f"  {method:>15}: median step {s['median_step_s']:.3f} s ({ratio}), "
                  f"median stall {s['median_stall_s']:.3f} s, {s['cpu_s_per_step']:.2f} CPU s/step{per_ckpt}, "
                  f"peak RSS growth median {s['median_rss_growth_bytes'] / GIB:.2f} GiB "
                  f"({s['median_rss_growth_x_state']:.2f}x state), max {s['max_rss_growth_bytes'] / GIB:.2f} GiB "
                  f"({s['max_rss_growth_x_state']:.2f}x state){extra}")
        print_targets(goals)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), results, indent=1)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


def child_argv(args: argparse.Namespace) -> list[str]:
    """The options a child run shares with the parent."""
    argv = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
            "--seq", str(args.seq), "--dir", args.dir]
    return argv + (["--threads", str(args.threads)] if args.threads else [])


def run_child(config: str, method: str, first_step: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``method`` in a fresh process; its result."""
    result = Path(args.dir) / f"result-{method.replace('.', '_')}.json"
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    run = run_fresh(harness_argv(__file__, *child_argv(args), "--child", config, method, str(first_step),
                                 str(result)), capture=False)
    if run.code != 0:
        raise subprocess.CalledProcessError(run.code, f"{method} child")
    return take_json(result)


def child(args: argparse.Namespace) -> int:
    """``--child``: build the model, run one method, write its result as JSON."""
    config, method, first_step, result = args.child
    if args.threads:
        torch.set_num_threads(args.threads)
    model, opt, _ = build_gpt2(config, args.seq)
    vocab = GPT2_CONFIGS[config]["vocab_size"]
    r = run(method, model, opt, vocab, args, Path(args.dir) / method.replace(".", "_"), int(first_step))
    Path(result).write_text(json.dumps(r))
    return 0


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    configs = results["configs"]
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4), squeeze=False)
    for ax, (name, cfg) in zip(axes[0], configs.items(), strict=True):
        for method, s in cfg["methods"].items():
            ax.plot(range(len(s["stall_s"])), s["stall_s"], marker="o", ms=3, label=(
                f"{method} ({s['ratio_vs_none']:.2f}x)" if s["ratio_vs_none"] else method))
        ax.set_title(f"GPT-2 {name} ({cfg['params'] / 1e6:.0f}M params, {cfg['state_bytes'] / 2**30:.2f} GiB/ckpt)")
        ax.set_xlabel("measured step (all runs)")
        ax.set_ylabel("stall per step (s)")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
