"""Every-iteration checkpoints inside the frameworks: asymcheck vs the framework's own checkpointing vs none.

Run by hand (never a timed test), from the repository root::

    .venv/bin/python benches/integrations.py            # GPT-2 8m, 4 rounds: about 9 minutes on 2 cores
    .venv/bin/python benches/integrations.py --quick    # tiny GPT-2, 1 round, fewer steps: 1-2 minutes
    .venv/bin/python benches/integrations.py --frameworks hf,lightning --rounds 4 --out bench-out/x.json

For each framework, three methods, each a fresh process (this script with ``--child``), one process,
CPU, the same GPT-2 (from ``GPT2Config``: nothing downloaded; ``--config``, ``build_gpt2`` of
benches/common.py) training on synthetic tokens, a checkpoint after every optimizer step:

- ``accelerate``: the ``run_clm_no_trainer.py`` loop shape (a prepared loader, ``accumulate()``,
  ``accelerator.backward``, a linear LR scheduler).
  ``none``; ``own``: ``accelerator.save_state()`` after every step (``ProjectConfiguration`` with
  ``automatic_checkpoint_naming=True, total_limit=2``: Accelerate keeps the newest 2);
  ``asymcheck``: ``asymcheck.accelerate.attach(accelerator, model, optimizer, dir, scheduler=..., data=...)``,
  ``resume()`` and the loop over ``ckpt.loader``.
- ``hf``: ``transformers.Trainer``.
  ``none``: ``save_strategy="no"``; ``own``: ``save_strategy="steps", save_steps=1, save_total_limit=2``;
  ``asymcheck``: ``asymcheck.hf.AsymCheckCallback(dir)`` added to the Trainer and
  ``trainer.train(resume_from_checkpoint=callback.resume_from(trainer))``.
- ``lightning``: ``lightning.pytorch.Trainer.fit``.
  ``none``: ``enable_checkpointing=False``; ``own``: ``ModelCheckpoint(dirpath=dir, every_n_train_steps=1)``
  (its default ``save_top_k=1`` without ``monitor``: the newest checkpoint is kept, the one before deleted);
  ``asymcheck``: ``asymcheck.lightning.AsymCheckCallback(dir)`` with ``train_dataloader()`` returning a
  ``ResumableLoader``.
- ``dcp``: a plain loop saving ``get_state_dict(model, optimizer)`` with ``dcp.async_save`` after every
  step, the previous save's future awaited before the next (as DCP's docs and TorchTitan do).
  ``none``; ``own``: ``storage_writer=FileSystemWriter(dir/step-N)`` (directories beyond the newest 2
  removed once their successor's save is done); ``asymcheck``: one ``asymstore.dcp.StorageWriter(dir)``
  with ``checkpoint_id=str(step)``.

Every asymcheck method keeps 2 versions and takes one every step, always
(``pacing=PacingOptions(max_overhead=None)``: no pacing); its commits are durable (fsync) when they
complete. Of the frameworks' own saves only DCP's ``FileSystemWriter`` fsyncs (``sync_files=True``, its
default); ``save_state``, the Trainer's and Lightning's saves leave their files in the page cache.

Timing: a step is the wall time between consecutive step boundaries (the end of the loop body in the
plain loops, after the checkpoint call; ``on_step_end`` for the Trainer, whose save follows it, and
``on_train_batch_end`` for Lightning, whose ``ModelCheckpoint`` saves there), so each step holds one
checkpoint's cost on the training thread: the save itself, or what the previous background save makes
it wait for. The first ``--warmup`` steps are not measured (asymcheck plans its copies after 3). Also
per run: CPU seconds per measured step (this process, all threads), the peak RSS growth over the run
(``RssSampler``, from before the model is built), ``finish_s`` (from the last boundary until the
framework returned: the last save and its drain), and for asymcheck its counters (versions committed,
skipped, dropped; its own stall per step).

Threads: one torch thread per run by default (``--threads``). With as many compute threads as cores,
the background threads of any asynchronous save (asymcheck's copy and commit threads, DCP's save
thread) and any other process take cores from OpenMP, whose spin-waits then make step times erratic
(on the 2-core development VM under load, a tiny GPT-2 step took 35 ms with 1 thread and 1.3-2.0 s
with 2); one thread leaves a core to them, as a GPU job leaves host cores to the checkpoint.

Rounds: each round runs every framework's methods, each framework's order rotated per round and
reversed every other round (ABC CBA BCA ACB...), so drifts of the machine fall on every method alike.
The load average before and after (``os.getloadavg``) and at each run's start are recorded.

Reported per framework: median step per method (all rounds' measured steps pooled), the ratio to
``none``, the overhead over ``none``, and the target: asymcheck's overhead / the framework's own
overhead <= 0.5. Writes JSON (``--out``, default bench-out/integrations.json) and prints a markdown
table. Checkpoints go to a temporary directory under ``--dir`` (default bench-out/, on the disk to
test), removed at the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    GPT2_CONFIGS,
    REPO,
    RssSampler,
    build_gpt2,
    cpu_seconds,
    git_state,
    release_free_memory,
    write_json,
)
from harness import add_child_flag, add_quick_flag, child_argv, order, run_fresh, settle, take_json

FRAMEWORKS = ["accelerate", "hf", "lightning", "dcp"]
METHODS = ["none", "own", "asymcheck"]
KEEP = 2  # checkpoints kept by every method that keeps some
TARGET_OVERHEAD_RATIO = 0.5  # asymcheck's overhead over none / the framework's own overhead over none
LABELS: dict[str, dict[str, str]] = {
    "accelerate": {"none": "no checkpoint", "own": "accelerator.save_state()",
                   "asymcheck": "asymcheck.accelerate.attach"},
    "hf": {"none": "save_strategy=no", "own": "Trainer save_steps=1", "asymcheck": "asymcheck.hf.AsymCheckCallback"},
    "lightning": {"none": "no checkpoint", "own": "ModelCheckpoint(every_n_train_steps=1)",
                  "asymcheck": "asymcheck.lightning.AsymCheckCallback"},
    "dcp": {"none": "no checkpoint", "own": "dcp.async_save + FileSystemWriter",
            "asymcheck": "dcp.async_save + asymstore.dcp.StorageWriter"},
}


# -- the child: one framework, one method, one fresh process ----------------------------------


class Clock:
    """Step boundaries: (wall, CPU) at each, and the moment the framework returned."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []
        self.returned = 0.0

    def tick(self) -> None:
        self.marks.append((time.perf_counter(), cpu_seconds()))

    def done(self) -> None:
        self.returned = time.perf_counter()


def quiet() -> None:
    """Keep the frameworks' warnings and progress output out of the child's log."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import logging

    for name in ("transformers", "accelerate", "lightning", "lightning.pytorch", "lightning.fabric",
                 "torch.distributed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def tokens(vocab: int, n: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1234))


class LMData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Synthetic causal-LM examples (``input_ids`` = ``labels``), as the Trainer and Accelerate loops take them."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class IdsData(torch.utils.data.Dataset[torch.Tensor]):
    """Synthetic token rows (Lightning's ``training_step`` takes them as they are)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def asym_stats(stats: Any) -> dict[str, Any]:
    """What a Checkpointer's ``CheckpointStats`` says about the run."""
    stalls = [s.overhead_s for s in stats.steps]
    return {"versions_committed": stats.versions_committed, "versions_skipped": stats.versions_skipped,
            "versions_dropped": stats.versions_dropped, "commits_failed": stats.commits_failed,
            "last_error": stats.last_error, "asym_median_stall_s": statistics.median(stalls) if stalls else None}


def run_accelerate(method: str, args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from transformers import get_scheduler

    n = args.warmup + args.steps
    model, optimizer, _ = build_gpt2(args.config, args.seq)
    loader = torch.utils.data.DataLoader(LMData(tokens(GPT2_CONFIGS[args.config]["vocab_size"], n * args.batch,
                                                       args.seq)), batch_size=args.batch, shuffle=True)
    project = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True, total_limit=KEEP) \
        if method == "own" else None
    accelerator = Accelerator(cpu=True, project_config=project)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=n)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    extra: dict[str, Any] = {}
    ckpt: Any = None
    batches: Any = loader
    if method == "asymcheck":
        import asymcheck.accelerate
        from asymcheck.options import PacingOptions, RetentionOptions

        ckpt = asymcheck.accelerate.attach(accelerator, model, optimizer, str(root), scheduler=scheduler, data=loader,
                                           retention=RetentionOptions(keep_last=KEEP),
                                           pacing=PacingOptions(max_overhead=None))
        extra["resumed"] = ckpt.resume()
        batches = ckpt.loader
    model.train()
    saves = 0
    clock.tick()
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if method == "own":
            accelerator.save_state()
            saves += 1
        clock.tick()
    if ckpt is not None:
        ckpt.close()
        extra |= asym_stats(ckpt.stats())
    clock.done()
    if method == "own":
        extra["saves"] = saves
    return extra


def run_hf(method: str, args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Ticker(TrainerCallback):
        def __init__(self) -> None:
            self.callback: Any = None
            self.checkpointer: Any = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.tick()
            if self.callback is not None and self.callback.checkpointer is not None:
                self.checkpointer = self.callback.checkpointer  # the callback drops it when training ends

    n = args.warmup + args.steps + 1  # boundaries at step ends: n ends make n - 1 steps
    model, _, _ = build_gpt2(args.config, args.seq)
    data = LMData(tokens(GPT2_CONFIGS[args.config]["vocab_size"], n * args.batch, args.seq))
    own = method == "own"
    targs = TrainingArguments(
        output_dir=str(root / "trainer"), max_steps=n, per_device_train_batch_size=args.batch, learning_rate=1e-4,
        logging_strategy="no", save_strategy="steps" if own else "no", save_steps=1, save_total_limit=KEEP,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    ticker = Ticker()
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[ticker])
    extra: dict[str, Any] = {}
    resume = None
    if method == "asymcheck":
        from asymcheck.hf import AsymCheckCallback
        from asymcheck.options import PacingOptions

        callback = AsymCheckCallback(str(root / "asym"), keep_last=KEEP, pacing=PacingOptions(max_overhead=None))
        ticker.callback = callback
        trainer.add_callback(callback)
        resume = callback.resume_from(trainer)
        extra["resumed"] = resume
    trainer.train(resume_from_checkpoint=resume)
    clock.done()
    if ticker.checkpointer is not None:
        extra |= asym_stats(ticker.checkpointer.stats())
    extra["global_step"] = trainer.state.global_step
    return extra


def run_lightning(method: str, args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from asymcheck.lightning import AsymCheckCallback, ResumableLoader
    from asymcheck.options import PacingOptions

    n = args.warmup + args.steps + 1  # boundaries at batch ends: n ends make n - 1 steps
    vocab = GPT2_CONFIGS[args.config]["vocab_size"]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_gpt2(args.config, args.seq)[0]

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            loader = torch.utils.data.DataLoader(IdsData(tokens(vocab, n * args.batch, args.seq)),
                                                 batch_size=args.batch, shuffle=True)
            return ResumableLoader(loader) if method == "asymcheck" else loader

    class Ticker(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.tick()

    callbacks: list[pl.Callback] = [Ticker()]
    asym = None
    if method == "own":
        callbacks.append(ModelCheckpoint(dirpath=str(root), every_n_train_steps=1))
    elif method == "asymcheck":
        asym = AsymCheckCallback(str(root), keep_last=KEEP, pacing=PacingOptions(max_overhead=None))
        callbacks.append(asym)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=n, logger=False, enable_checkpointing=method == "own",
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=callbacks)
    trainer.fit(Module())
    clock.done()
    extra: dict[str, Any] = {"global_step": trainer.global_step}
    if asym is not None:
        stats = asym.stats()
        if stats is not None:
            extra |= asym_stats(stats)
    return extra


def run_dcp(method: str, args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import async_save  # dcp.async_save

    from asymstore.dcp import StorageWriter

    n = args.warmup + args.steps
    model, optimizer, _ = build_gpt2(args.config, args.seq)
    ids = tokens(GPT2_CONFIGS[args.config]["vocab_size"], n * args.batch, args.seq)
    writer = StorageWriter(str(root), keep_last=KEEP) if method == "asymcheck" else None
    pending: Any = None
    dirs: list[Path] = []

    def wait() -> None:
        nonlocal pending
        if pending is not None:
            pending.result()
            pending = None
            while len(dirs) > KEEP:  # the newest KEEP complete saves stay
                shutil.rmtree(dirs.pop(0), ignore_errors=True)

    model.train()
    clock.tick()
    for step in range(n):
        x = ids[step * args.batch:(step + 1) * args.batch]
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if method != "none":
            wait()
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
            if writer is not None:
                pending = async_save(state, storage_writer=writer, checkpoint_id=str(step))
            else:
                path = root / f"step-{step}"
                dirs.append(path)
                pending = async_save(state, storage_writer=FileSystemWriter(str(path)), checkpoint_id=str(path))
        clock.tick()
    wait()
    extra: dict[str, Any] = {}
    if writer is not None:
        extra["last_step"] = writer.last_step
        writer.close()
    clock.done()
    return extra


RUNNERS: dict[str, Callable[[str, argparse.Namespace, Path, Clock], dict[str, Any]]] = {
    "accelerate": run_accelerate, "hf": run_hf, "lightning": run_lightning, "dcp": run_dcp}


def child(args: argparse.Namespace) -> None:
    framework, method, root, result = args.child
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet()
    Path(root).mkdir(parents=True, exist_ok=True)
    clock = Clock()
    release_free_memory()
    rss = RssSampler().start()
    started = time.perf_counter()
    extra = RUNNERS[framework](method, args, Path(root), clock)
    rss.stop()
    walls = [w for w, _ in clock.marks]
    steps = [b - a for a, b in itertools.pairwise(walls)]
    if len(steps) < args.warmup + args.steps:
        raise RuntimeError(f"{framework}/{method}: {len(steps)} steps timed, expected {args.warmup + args.steps}")
    measured = steps[args.warmup:args.warmup + args.steps]
    first, last = clock.marks[args.warmup], clock.marks[args.warmup + args.steps]
    write_json(result, {
        "framework": framework, "method": method, "step_s": measured, "warmup_step_s": steps[:args.warmup],
        "cpu_s_per_step": (last[1] - first[1]) / args.steps, "finish_s": clock.returned - walls[-1],
        "setup_s": walls[0] - started, "rss": rss.as_dict(), "threads": torch.get_num_threads(), **extra})


# -- the parent: rounds of fresh processes, the summary ----------------------------------------


def run_child(framework: str, method: str, args: argparse.Namespace, work: Path, timeout: float) -> dict[str, Any]:
    root = work / f"{framework}-{method}"
    result = work / f"{framework}-{method}.json"
    argv = child_argv(__file__, "--child", framework, method, str(root), str(result),
                      "--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup),
                      "--batch", str(args.batch), "--seq", str(args.seq))
    argv += ["--threads", str(args.threads)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    settle()  # the previous run's dirty pages must not be written back during this one
    run = run_fresh(argv, env=env, timeout=timeout, cwd=REPO)
    shutil.rmtree(root, ignore_errors=True)
    if run.code != 0 or not result.exists():
        return {"framework": framework, "method": method, "error": f"exit code {run.code}",
                "log_tail": run.log[-4000:], "loadavg_1m": run.loadavg_1m, "process_s": run.seconds}
    return take_json(result) | {"loadavg_1m": run.loadavg_1m, "process_s": run.seconds}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: the pooled median step, ratio and overhead over none, CPU, RSS; the overhead-ratio target."""
    methods: dict[str, Any] = {}
    for method in METHODS:
        ok = [r for r in runs if r["method"] == method and "error" not in r]
        failed = [r for r in runs if r["method"] == method and "error" in r]
        if not ok and not failed:
            continue
        steps = [s for r in ok for s in r["step_s"]]
        growth = [int(r["rss"]["peak_growth_bytes"]) for r in ok]
        entry: dict[str, Any] = {
            "label": "", "runs": len(ok), "failed": len(failed), "median_step_s": _median(steps),
            "step_s": steps, "median_step_s_per_run": [statistics.median(r["step_s"]) for r in ok],
            "cpu_s_per_step": _median([r["cpu_s_per_step"] for r in ok]),
            "cpu_s_per_step_per_run": [r["cpu_s_per_step"] for r in ok],
            "finish_s": _median([r["finish_s"] for r in ok]),
            "max_rss_growth_bytes": max(growth) if growth else None, "rss_growth_bytes": growth}
        for key in ("versions_committed", "versions_skipped", "versions_dropped", "commits_failed"):
            if any(key in r for r in ok):
                entry[key] = [r.get(key) for r in ok]
        stalls = [r["asym_median_stall_s"] for r in ok if r.get("asym_median_stall_s") is not None]
        if stalls:
            entry["asym_median_stall_s"] = statistics.median(stalls)
        methods[method] = entry
    base = methods.get("none", {}).get("median_step_s")
    base_cpu = methods.get("none", {}).get("cpu_s_per_step")
    for entry in methods.values():
        med = entry["median_step_s"]
        entry["ratio_vs_none"] = med / base if med is not None and base else None
        entry["overhead_s"] = med - base if med is not None and base is not None else None
        cpu = entry["cpu_s_per_step"]
        entry["cpu_s_per_checkpoint"] = cpu - base_cpu if cpu is not None and base_cpu is not None else None
    own = methods.get("own", {}).get("overhead_s")
    asym = methods.get("asymcheck", {}).get("overhead_s")
    ratio = asym / own if asym is not None and own is not None and own > 0 else None
    met = ratio is not None and ratio <= TARGET_OVERHEAD_RATIO
    target = {"value": ratio, "target": TARGET_OVERHEAD_RATIO, "met": met, "asymcheck_overhead_s": asym,
              "own_overhead_s": own}
    return {"methods": methods, "overhead_ratio": target}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any]) -> str:
    """The markdown tables: one row per framework and method, then one per framework with the target."""
    lines = ["| framework | method | median step | x none | overhead | CPU s / step | peak RSS growth | versions |",
             "|---|---|---|---|---|---|---|---|"]
    for framework, fw in results["frameworks"].items():
        for m in fw["methods"].values():
            versions = ""
            if "versions_committed" in m:
                versions = f"{sum(v or 0 for v in m['versions_committed'])} committed"
                skipped = sum(v or 0 for v in m.get("versions_skipped", []))
                dropped = sum(v or 0 for v in m.get("versions_dropped", []))
                if skipped or dropped:
                    versions += f", {skipped} skipped, {dropped} dropped"
            if m["failed"]:
                versions += f" ({m['failed']} run(s) FAILED)"
            growth = m["max_rss_growth_bytes"]
            lines.append(f"| {framework} | {m['label']} | {fmt(m['median_step_s'], '.3f')} s | "
                         f"{fmt(m['ratio_vs_none'], '.2f')} | {fmt(m['overhead_s'], '+.3f')} s | "
                         f"{fmt(m['cpu_s_per_step'], '.2f')} | "
                         f"{'-' if growth is None else f'{growth / (1 << 20):.0f} MiB'} | {versions} |")
    lines += ["", "| framework | asymcheck overhead | own overhead | asymcheck / own (target ≤ 0.5) |",
              "|---|---|---|---|"]
    for framework, fw in results["frameworks"].items():
        t = fw["overhead_ratio"]
        verdict = "-" if t["value"] is None else f"{t['value']:.2f} ({'met' if t['met'] else 'NOT met'})"
        lines.append(f"| {framework} | {fmt(t['asymcheck_overhead_s'], '+.3f')} s | "
                     f"{fmt(t['own_overhead_s'], '+.3f')} s | {verdict} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_flag(ap, "tiny GPT-2, 1 round, fewer steps (1-2 minutes)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"comma-separated, from {FRAMEWORKS}")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every method (default 4; --quick 1)")
    ap.add_argument("--config", choices=sorted(GPT2_CONFIGS), default=None,
                    help="GPT-2 size (default 8m; --quick tiny)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per run (default 10; --quick 6)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured steps per run (asymcheck plans after 3)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256; --quick 128)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per run (0: torch's default; see the module docstring)")
    ap.add_argument("--dir", default=str(REPO / "bench-out"), help="where the temporary checkpoint directory goes")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "integrations.json"), help="JSON output")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed")
    add_child_flag(ap, nargs=4, metavar=("FRAMEWORK", "METHOD", "ROOT", "RESULT"))
    args = ap.parse_args()
    args.config = args.config or ("tiny" if args.quick else "8m")
    args.steps = args.steps or (6 if args.quick else 10)
    args.seq = args.seq or (128 if args.quick else 256)
    args.rounds = args.rounds or (1 if args.quick else 4)
    if args.child:
        child(args)
        return 0
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown:
        ap.error(f"unknown frameworks {unknown} (from {FRAMEWORKS})")
    _, _, nparams = build_gpt2(args.config, args.seq)
    state_bytes = 3 * 4 * nparams  # fp32 parameters and AdamW's two moments
    load_before = os.getloadavg()
    print(f"GPT-2 {args.config}: {nparams / 1e6:.1f}M parameters, {state_bytes / (1 << 20):.0f} MiB of state per "
          f"checkpoint; {args.rounds} round(s) x {len(frameworks)} framework(s) x {len(METHODS)} methods, "
          f"{args.warmup} + {args.steps} steps each; load average before {load_before[0]:.2f} "
          f"(cores: {os.cpu_count()})", flush=True)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="integrations-", dir=args.dir))
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in frameworks}
    started = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            for framework in frameworks:
                for method in order(METHODS, rnd):
                    r = run_child(framework, method, args, work, args.timeout) | {"round": rnd}
                    runs[framework].append(r)
                    if "error" in r:
                        print(f"  round {rnd} {framework:>10} {method:>9}: FAILED ({r['error']})\n{r['log_tail']}",
                              flush=True)
                        continue
                    extra = (f", {r['versions_committed']} versions committed" if "versions_committed" in r else "")
                    print(f"  round {rnd} {framework:>10} {method:>9}: "
                          f"median step {statistics.median(r['step_s']):.3f} s, "
                          f"{r['cpu_s_per_step']:.2f} CPU s/step, finish {r['finish_s']:.2f} s, "
                          f"peak RSS +{r['rss']['peak_growth_bytes'] / (1 << 20):.0f} MiB, "
                          f"process {r['process_s']:.1f} s, load {r['loadavg_1m']:.2f}{extra}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    results: dict[str, Any] = {
        "bench": "integrations", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
        "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "versions": versions(), "git": git_state(), "config": args.config, "gpt2": GPT2_CONFIGS[args.config],
        "params": nparams, "state_bytes": state_bytes, "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "warmup": args.warmup, "rounds": args.rounds, "threads": args.threads, "keep": KEEP,
        "loadavg_before": load_before, "loadavg_after": load_after, "wall_s": time.perf_counter() - started,
        "frameworks": {}}
    for framework in frameworks:
        summary = summarize(runs[framework])
        for method, entry in summary["methods"].items():
            entry["label"] = LABELS[framework][method]
        results["frameworks"][framework] = summary | {"runs": runs[framework]}
    write_json(args.out, results, indent=1)
    print()
    print(table(results))
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f} (cores: {os.cpu_count()}); "
          f"{results['wall_s']:.0f} s in all; wrote {args.out}")
    failed = sum(1 for rs in runs.values() for r in rs if "error" in r)
    return 1 if failed else 0


def versions() -> dict[str, str | None]:
    """The versions of torch and of each framework measured."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "lightning", "asymstore"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    raise SystemExit(main())
