"""Every-iteration checkpoints inside the frameworks: asymcheck vs the framework's own checkpointing vs none.

Run by hand (never a timed test), from the repository root::

    .venv/bin/python benches/integrations.py            # every row, GPT-2 8m, 4 rounds: about 32 minutes on 2 cores
    .venv/bin/python benches/integrations.py --rows single             # the one-process rows only: about 11 minutes
    .venv/bin/python benches/integrations.py --rows single --frameworks torchtitan  # TorchTitan's row: about 3 minutes
    .venv/bin/python benches/integrations.py --rows ddp,fsdp2 --ranks 2  # the multi-process rows only
    .venv/bin/python benches/integrations.py --rows ddp --frameworks ddploop --config 30m  # dedup off vs replicas
    .venv/bin/python benches/integrations.py --quick    # tiny GPT-2, 1 round, fewer steps: about 6 minutes
    .venv/bin/python benches/integrations.py --frameworks hf,lightning --rounds 4 --out bench-out/x.json

Rows (``--rows``, default all): ``single`` (one process, every framework below), ``ddp`` (the
Trainer, Accelerate and Lightning under DDP on ``--ranks`` processes, default 2), ``fsdp2`` (a plain
loop under ``fully_shard`` on ``--ranks`` processes). A multi-process run is ``--ranks`` fresh
processes started together with the environment ``torchrun --nproc_per_node N`` gives each rank
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``..., as the DDP tests launch
theirs), gloo on the CPU; each child checks that the framework ran on that many processes (a
Trainer without ``use_cpu`` or a Lightning Trainer without ``strategy="ddp"`` would train alone in
each). The frameworks' own FSDP2 needs a GPU: the bench says so in its output and JSON (``not_run``).

The one-process rows:

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
  with ``checkpoint_id=str(step)``; ``stager`` (this row only): the same writer with
  ``async_stager=asymcheck.dcp.Stager(optimizer)``, whose copy runs through the next step's forward and
  backward (the optimizer's step pre-hook waits for what is left); ``async_save`` then returns DCP's
  ``AsyncSaveResponse`` and the loop waits for its ``upload_completion``; ``stager-memory``: the same
  saves into a ``host_tier`` alone (no disk, no fsync: the floor of the stager's path, DCP's planning
  and the staging included). The row's target is the ``stager`` method's overhead against ``own``
  (``TARGET_METHOD``).
- ``torchtitan``: TorchTitan 0.3's ``Trainer.train`` loop over TorchTitan's own parts (its trainer
  needs triton, which a CPU build of torch lacks, so the loop is the trainer's, written out as
  tests/procs/titan_train.py drives the manager): a one-process gloo group, ``GarbageCollection``
  (``gc_freq=50``), ``default_adamw`` built into an ``OptimizersContainer``, an
  ``LRSchedulersContainer``, a ``ParallelAwareDataloader`` over stateful token samples,
  ``CrossEntropyLoss``, ``clip_grad_norm_``, then ``maybe_wait_for_staging()``, the optimizer's and the
  scheduler's step and ``save(step, last_step=...)``; the manager built from its config as the trainer
  builds it (``config.build(dataloader=..., model_parts=..., optimizers=..., lr_schedulers=...,
  states={"train_state": ...})``) and ``load()`` before the first step.
  ``none``: ``CheckpointManager.Config(enable=False)`` (TorchTitan's default: every call a no-op);
  ``own``: TorchTitan's ``CheckpointManager`` with ``interval=1, keep_latest_k=2, async_mode="async"``:
  ``dcp.async_save`` to ``step-N`` (DCP's default stager copies the state on the training thread, a
  thread writes it with ``FileSystemWriter``; each save first waits for the previous write, and
  collects garbage twice), older ``step-N`` removed by its purge thread (its own rule: all but the
  newest 2 present when a save starts; none at the last step). ``async_mode="async"`` is the one
  asynchronous mode that runs on the CPU: ``"async_with_pinned_mem"`` stages through DCP's
  ``DefaultStager`` with non-blocking copies, which asserts an accelerator, and ``"disabled"`` is
  ``dcp.save`` on the training thread. ``asymcheck``: ``asymcheck.torchtitan.AsymCheckManager`` with
  ``interval=1, keep_latest_k=2``. Each run trains ``--warmup`` + ``--steps`` + 1 steps: the last is
  TorchTitan's ``last_step``, whose save in TorchTitan's own manager is its final model-only export
  (synchronous); that save and ``close()`` are the run's finish, not a measured step.

The ``ddp`` rows: the same three methods of the Trainer (``use_cpu=True, ddp_backend="gloo"``),
Accelerate (``Accelerator(cpu=True)``, ``MULTI_CPU``, gloo) and Lightning (``strategy="ddp"``,
``devices=--ranks``; every method's loader carries a ``DistributedSampler`` given by hand, as the
guide asks for a ``ResumableLoader`` under DDP), each rank training ``--batch`` samples a step (the
data is ``--ranks`` times larger). asymcheck's directory is then a multi-rank root (a shard per
rank, global versions); the frameworks' own saves write the model and optimizer from rank 0 (and
RNG states per rank).

The ``ddp`` row of framework ``ddploop``: GPT-2 under ``DistributedDataParallel`` in a plain loop with
the own ``asymcheck.Checkpointer``; its ``own`` method is the Checkpointer with ``dedup="off"`` (every
rank writes the whole replicated state, as before slices) and ``asymcheck`` the default
``dedup="replicas"`` (each rank its slice; docs/guides/multirank.md): a table gives the bytes each rank
wrote per version, the step against no checkpoint, and the CPU cost of the identity check (one sampled
digest per version, one full digest in the first versions), measured on the trained state.

The ``fsdp2`` row (framework ``loop``): GPT-2 with every block and the root ``fully_shard``ed, AdamW,
a plain loop. ``none``; ``own``: ``torch.distributed.checkpoint.save`` of
``get_state_dict(model, optimizer)`` to ``FileSystemWriter(dir/step-N)`` after every step (the newest
2 kept); ``asymcheck``: ``asymcheck.Checkpointer(model, optimizer, dir)`` (its FSDP2 path).
benches/fsdp2_overhead.py compares the same Checkpointer with ``dcp.async_save`` and times resumes.

Every asymcheck method keeps 2 versions and takes one every step, always
(``pacing=PacingOptions(max_overhead=None)``: no pacing); its commits are durable (fsync) when they
complete. Of the frameworks' own saves only DCP's ``FileSystemWriter`` fsyncs (``sync_files=True``, its
default; TorchTitan's ``CheckpointManager`` writes through it); ``save_state``, the Trainer's and
Lightning's saves leave their files in the page cache.

Timing: a step is the wall time between consecutive step boundaries (the end of the loop body in the
plain loops and TorchTitan's, after the checkpoint call; ``on_step_end`` for the Trainer, whose save follows it, and
``on_train_batch_end`` for Lightning, whose ``ModelCheckpoint`` saves there), so each step holds one
checkpoint's cost on the training thread: the save itself, or what the previous background save makes
it wait for. The first ``--warmup`` steps are not measured (asymcheck plans its copies after 3). Also
per run: CPU seconds per measured step (this process, all threads), the peak RSS growth over the run
(``RssSampler``, from before the model is built), ``finish_s`` (from the last boundary until the
framework returned: the last save and its drain), and for asymcheck its counters (versions committed,
skipped, dropped; its own stall per step).

Threads: one torch thread per run by default (``--threads``). With as many compute threads as cores,
the background threads of any asynchronous save (asymcheck's copy and commit threads, DCP's save
thread, TorchTitan's purge thread) and any other process take cores from OpenMP, whose spin-waits
then make step times erratic (on the 2-core development VM under load, a tiny GPT-2 step took 35 ms
with 1 thread and 1.3-2.0 s with 2); one thread leaves a core to them, as a GPU job leaves host
cores to the checkpoint.

Ranks: in a multi-process run each rank times its own step boundaries; a step's time is the
slowest rank's (the ranks wait for each other in the collectives anyway), and CPU seconds per step
and the finish are the largest rank's.

Rounds: each round runs every row's methods, each row's order rotated per round and reversed every
other round (ABC CBA BCA ACB...), so drifts of the machine fall on every method alike. The cores,
``uptime``'s line before and after, and the load average at each run's start are recorded.

Reported per row: median and mean step per method (all rounds' measured steps pooled), the ratio
to ``none``, the overhead over ``none`` (of the medians), and the target: asymcheck's overhead /
the framework's own overhead <= 0.5 (also given from the means). Writes JSON (``--out``, default
bench-out/integrations.json) and prints markdown tables. Checkpoints go to a temporary directory
under ``--dir`` (default bench-out/, on the disk to test), removed at the end.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
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
from harness import Run, add_child_flag, add_quick_flag, child_argv, order, run_fresh, settle, take_json

FRAMEWORKS = ["accelerate", "hf", "lightning", "dcp", "torchtitan", "loop", "ddploop"]
ROWS: dict[str, list[str]] = {  # row -> its frameworks
    "single": ["accelerate", "hf", "lightning", "dcp", "torchtitan"],  # one process
    "ddp": ["accelerate", "hf", "lightning", "ddploop"],  # --ranks processes, DDP on gloo
    "fsdp2": ["loop"],  # --ranks processes, fully_shard on gloo, a plain loop
}
NOT_RUN = {  # configurations the bench names instead of omitting them silently
    "fsdp2": "the frameworks' own FSDP2 (the Trainer's fsdp/fsdp_config, Accelerate's "
             "FullyShardedDataParallelPlugin(fsdp_version=2), Lightning's ModelParallelStrategy) needs a GPU "
             "(Accelerate 1.15 on the CPU ignores the FSDP plugin and prepares DDP): not measured here; "
             "the fsdp2 row is the Checkpointer's FSDP2 path in a plain loop against dcp.save",
}
METHODS = ["none", "own", "asymcheck"]
EXTRA_METHODS: dict[str, list[str]] = {"dcp": ["stager", "stager-memory"]}  # methods of one framework's rows only
TARGET_METHOD: dict[str, str] = {"dcp": "stager"}  # the method whose overhead the row's target compares (asymcheck)
KEEP = 2  # checkpoints kept by every method that keeps some
TARGET_OVERHEAD_RATIO = 0.5  # asymcheck's overhead over none / the framework's own overhead over none
LABELS: dict[str, dict[str, str]] = {
    "accelerate": {"none": "no checkpoint", "own": "accelerator.save_state()",
                   "asymcheck": "asymcheck.accelerate.attach"},
    "hf": {"none": "save_strategy=no", "own": "Trainer save_steps=1", "asymcheck": "asymcheck.hf.AsymCheckCallback"},
    "lightning": {"none": "no checkpoint", "own": "ModelCheckpoint(every_n_train_steps=1)",
                  "asymcheck": "asymcheck.lightning.AsymCheckCallback"},
    "dcp": {"none": "no checkpoint", "own": "dcp.async_save + FileSystemWriter",
            "asymcheck": "dcp.async_save + asymstore.dcp.StorageWriter",
            "stager": "dcp.async_save + asymcheck.dcp.Stager + StorageWriter",
            "stager-memory": "the same into a host memory tier only (no disk: the floor)"},
    "loop": {"none": "no checkpoint", "own": "dcp.save + FileSystemWriter",
             "asymcheck": "asymcheck.Checkpointer (FSDP2)"},
    "ddploop": {"none": "no checkpoint", "own": "Checkpointer dedup='off' (every rank writes all)",
                "asymcheck": "Checkpointer dedup='replicas' (a slice per rank)"},
    "torchtitan": {"none": "checkpoint.enable=False", "own": "CheckpointManager async_mode='async', interval=1",
                   "asymcheck": "asymcheck.torchtitan.AsymCheckManager, interval=1"},
}


@dataclass(frozen=True)
class Case:
    """One row of the tables: a framework in a configuration (``row``) on ``ranks`` processes."""

    row: str
    framework: str
    ranks: int

    @property
    def key(self) -> str:
        """Its name in the JSON and the work directory: ``hf``, ``hf-ddp-2ranks``, ``loop-fsdp2-2ranks``."""
        return self.framework if self.row == "single" else f"{self.framework}-{self.row}-{self.ranks}ranks"

    @property
    def title(self) -> str:
        """Its name in the tables: ``hf``, ``hf DDP x2``, ``loop FSDP2 x2``."""
        return self.framework if self.row == "single" else f"{self.framework} {self.row.upper()} x{self.ranks}"


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


@functools.cache  # read once, at the child's start: Lightning's teardown rewrites the variables
def world() -> int:
    """The ranks of this run (``WORLD_SIZE`` in the environment the parent gives each rank, as ``torchrun`` does)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@functools.cache
def rank() -> int:
    """This process's rank (``RANK``; 0 in a one-process run)."""
    return int(os.environ.get("RANK", "0"))


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
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration
    from transformers import get_scheduler

    n = args.warmup + args.steps
    model, optimizer, _ = build_gpt2(args.config, args.seq)
    loader = torch.utils.data.DataLoader(  # each rank's n batches (accelerator.prepare shards the loader)
        LMData(tokens(GPT2_CONFIGS[args.config]["vocab_size"], n * args.batch * world(), args.seq)),
        batch_size=args.batch, shuffle=True)
    project = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True, total_limit=KEEP) \
        if method == "own" else None
    handlers = [InitProcessGroupKwargs(backend="gloo")] if world() > 1 else []  # MULTI_CPU: DDP on gloo
    accelerator = Accelerator(cpu=True, project_config=project, kwargs_handlers=handlers)
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
    extra["framework_world"] = accelerator.num_processes
    return extra


def run_hf(method: str, args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Ticker(TrainerCallback):
        def __init__(self) -> None:
            self.callback: Any = None
            self.checkpointer: Any = None
            self.saves = 0

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.saves += 1  # the Trainer's own checkpoint-N

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.tick()
            if self.callback is not None and self.callback.checkpointer is not None:
                self.checkpointer = self.callback.checkpointer  # the callback drops it when training ends

    n = args.warmup + args.steps + 1  # boundaries at step ends: n ends make n - 1 steps
    model, _, _ = build_gpt2(args.config, args.seq)
    data = LMData(tokens(GPT2_CONFIGS[args.config]["vocab_size"], n * args.batch * world(), args.seq))
    own = method == "own"
    targs = TrainingArguments(
        output_dir=str(root / "trainer"), max_steps=n, per_device_train_batch_size=args.batch, learning_rate=1e-4,
        logging_strategy="no", save_strategy="steps" if own else "no", save_steps=1, save_total_limit=KEEP,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        ddp_backend="gloo" if world() > 1 else None)  # torchrun's environment: the Trainer's DDP
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
    if own:
        extra["saves"] = ticker.saves
    extra["framework_world"] = trainer.args.world_size
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
            data = IdsData(tokens(vocab, n * args.batch * world(), args.seq))
            if world() > 1:  # the DistributedSampler Lightning would add, given by hand in every method
                # (as the guide says for a ResumableLoader under DDP), so the three load the same batches
                sampler: Any = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
                loader = torch.utils.data.DataLoader(data, batch_size=args.batch, sampler=sampler)
            else:
                loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True)
            return ResumableLoader(loader) if method == "asymcheck" else loader

    class Ticker(pl.Callback):
        saves = 0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.tick()

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            self.saves += 1  # ModelCheckpoint's save

    ticker = Ticker()
    callbacks: list[pl.Callback] = [ticker]
    asym = None
    if method == "own":
        callbacks.append(ModelCheckpoint(dirpath=str(root), every_n_train_steps=1))
    elif method == "asymcheck":
        asym = AsymCheckCallback(str(root), keep_last=KEEP, pacing=PacingOptions(max_overhead=None))
        callbacks.append(asym)
    ddp: dict[str, Any] = {"devices": world(), "strategy": "ddp"} if world() > 1 else {"devices": 1}
    trainer = pl.Trainer(accelerator="cpu", max_steps=n, logger=False, enable_checkpointing=method == "own",
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=callbacks, **ddp)
    trainer.fit(Module())
    clock.done()
    extra: dict[str, Any] = {"global_step": trainer.global_step, "framework_world": trainer.world_size}
    if method == "own":
        extra["saves"] = ticker.saves
    if asym is not None:
        stats = asym.stats()
        if stats is not None:
            extra |= asym_stats(stats)
    return extra


def run_dcp(method: str, args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import (
        AsyncSaveResponse,
        async_save,  # dcp.async_save
    )

    from asymcheck.dcp import Stager
    from asymstore.dcp import StorageWriter

    n = args.warmup + args.steps
    model, optimizer, _ = build_gpt2(args.config, args.seq)
    ids = tokens(GPT2_CONFIGS[args.config]["vocab_size"], n * args.batch, args.seq)
    writer = StorageWriter(str(root), keep_last=KEEP) if method in ("asymcheck", "stager") else None
    if method == "stager-memory":  # the floor of the stager's path: the same saves, no disk under the store
        from asymstore import host_tier

        writer = StorageWriter([host_tier(4 << 30)], keep_last=KEEP)
    stager = Stager(optimizer) if method.startswith("stager") else None
    pending: Any = None
    dirs: list[Path] = []

    def wait() -> None:
        nonlocal pending
        if pending is not None:
            if isinstance(pending, AsyncSaveResponse):  # a stager's save: its upload (the copy finished earlier)
                pending.upload_completion.result()
            else:
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
                pending = async_save(state, storage_writer=writer, checkpoint_id=str(step), async_stager=stager)
            else:
                path = root / f"step-{step}"
                dirs.append(path)
                pending = async_save(state, storage_writer=FileSystemWriter(str(path)), checkpoint_id=str(path))
        clock.tick()
    wait()
    extra: dict[str, Any] = {}
    if stager is not None:
        stats = stager.stats()
        extra["stager"] = {"stages": stats.stages, "failed": stats.failed, "host_bytes": stats.host_bytes,
                           "step_wait_s_per_stage": stats.step_wait_s / max(1, stats.stages),
                           "stage_s_per_stage": stats.stage_s / max(1, stats.stages)}
        stager.close()
    if writer is not None:
        extra["last_step"] = writer.last_step
        writer.close()
    clock.done()
    return extra


class TitanSamples(torch.utils.data.IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """Synthetic token rows as TorchTitan's text datasets yield them: ``({"input": row[:-1]}, row[1:])``.

    Stateful like TorchTitan's ``HuggingFaceTextDataset`` (its position is ``sample_idx``), so the
    ``ParallelAwareDataloader`` over it has a position for the checkpoint managers to save.
    """

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.sample_idx = 0

    def __iter__(self) -> Any:
        while self.sample_idx < len(self.ids):
            row = self.ids[self.sample_idx]
            self.sample_idx += 1
            yield {"input": row[:-1]}, row[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample_idx = state["sample_idx"]


class TitanTrainState:
    """The trainer's ``train_state`` (TorchTitan's ``Trainer`` hands itself): ``{"step", "ntokens_seen"}``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


TITAN_ASYNC_MODE = "async"  # TorchTitan's own manager: async_with_pinned_mem needs an accelerator (see the docstring)


def run_torchtitan(method: str, args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    """GPT-2 in a loop driven as TorchTitan 0.3's ``Trainer.train`` drives its own, with TorchTitan's containers.

    TorchTitan's trainer itself needs triton (absent from a CPU build of torch), so this is its loop
    over its own parts: a world of one gloo process (``init_distributed``), ``GarbageCollection`` at
    its default ``gc_freq``, ``default_adamw`` built into an ``OptimizersContainer``, an
    ``LRSchedulersContainer`` (warmup, then linear decay), a ``ParallelAwareDataloader`` over stateful
    samples, TorchTitan's ``CrossEntropyLoss`` over the valid tokens, ``clip_grad_norm_`` (``max_norm`` 1),
    ``maybe_wait_for_staging()`` before the optimizer's step and ``save(step, last_step=...)`` after the
    scheduler's; the manager is built as the trainer builds it (``config.checkpoint.build(...)``) and
    ``load()`` is called before the first step.

    ``none``: TorchTitan's ``CheckpointManager.Config(enable=False)`` (its default: every call a no-op);
    ``own``: ``CheckpointManager.Config(enable=True, interval=1, keep_latest_k=KEEP, async_mode="async")``;
    ``asymcheck``: ``AsymCheckManager.Config(enable=True, interval=1, keep_latest_k=KEEP)``. The run has
    one step more than the measured ones: the last (``last_step=True``: TorchTitan's own manager then
    writes its final model-only export, synchronously) ends the run, its save and ``close()`` are the finish.
    """
    import torch.distributed as dist
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.tools.utils import GarbageCollection

    from asymcheck.torchtitan import AsymCheckManager

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the trainer's process group
    n = args.warmup + args.steps + 1
    gc_handler = GarbageCollection(gc_freq=50)  # TorchTitan's training.gc_freq default: automatic GC off
    loss_fn = CrossEntropyLoss.Config().build()  # TorchTitan's default loss: a sum, divided by the valid tokens
    model, _, _ = build_gpt2(args.config, args.seq)
    model_parts: list[torch.nn.Module] = [model]
    optimizers = default_adamw(lr=1e-4).build(model_parts=model_parts)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_type="linear").build(
        optimizers=optimizers, training_steps=n)
    dataloader = ParallelAwareDataloader(
        TitanSamples(tokens(GPT2_CONFIGS[args.config]["vocab_size"], n * args.batch, args.seq + 1)),
        dp_rank=0, dp_world_size=1, batch_size=args.batch)
    train_state = TitanTrainState()
    config: Any
    if method == "asymcheck":
        config = AsymCheckManager.Config(enable=True, interval=1, folder="checkpoint", keep_latest_k=KEEP)
    else:
        config = CheckpointManager.Config(enable=method == "own", interval=1, folder="checkpoint",
                                          keep_latest_k=KEEP, async_mode=TITAN_ASYNC_MODE)
    checkpointer = config.build(dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state}, sd_adapter=None,
                                base_folder=str(root))
    extra: dict[str, Any] = {"resumed": checkpointer.load(step=config.load_step)}
    data_iterator = iter(dataloader)
    saves = 0
    model.train()
    clock.tick()
    while train_state.step < n:
        train_state.step += 1
        gc_handler.run(train_state.step)
        input_dict, labels = next(data_iterator)
        train_state.ntokens_seen += labels.numel()
        optimizers.zero_grad(set_to_none=True)  # the trainer's with training.disable_cuda_graphs=True
        loss, _ = loss_fn(model(input_ids=input_dict["input"]).logits, labels, (labels != IGNORE_INDEX).sum())
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for m in model_parts for p in m.parameters()], 1.0, foreach=True)
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        last = train_state.step == n
        if last:
            clock.tick()  # the last step's save and close() are the finish
        saves += bool(checkpointer.save(train_state.step, last_step=last))
        if not last:
            clock.tick()
    checkpointer.close()
    clock.done()
    if method == "asymcheck":
        extra |= asym_stats(checkpointer.checkpointer.stats())
    elif method == "own":
        extra |= {"saves": saves, "async_mode": TITAN_ASYNC_MODE}
    extra["global_step"] = train_state.step
    extra["framework_world"] = dist.get_world_size()
    dist.destroy_process_group()
    return extra


def train_step(model: Any, optimizer: torch.optim.Optimizer, ids: torch.Tensor, step: int, batch: int) -> None:
    """One optimizer step of a GPT-2 language model on this rank's batch of ``ids`` (the ranks' batches interleaved)."""
    at = (step * world() + rank()) * batch
    x = ids[at:at + batch]
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_fsdp2(method: str, args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    """A plain loop over a GPT-2 sharded by ``fully_shard`` (every block and the root) on ``WORLD_SIZE`` gloo ranks.

    ``own``: ``torch.distributed.checkpoint.save`` of ``get_state_dict(model, optimizer)`` to
    ``FileSystemWriter(dir/step-N)`` after every step (the newest KEEP directories kept);
    ``asymcheck``: ``asymcheck.Checkpointer(model, optimizer, dir)`` (its FSDP2 path: each rank's
    DTensor shards in a multi-rank root).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    n = args.warmup + args.steps
    model, _, _ = build_gpt2(args.config, args.seq)
    for block in model.transformer.h:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = tokens(GPT2_CONFIGS[args.config]["vocab_size"], n * args.batch * world(), args.seq)
    ckpt: Any = None
    if method == "asymcheck":
        from asymcheck import Checkpointer
        from asymcheck.options import PacingOptions, RetentionOptions

        ckpt = Checkpointer(model, optimizer, str(root), retention=RetentionOptions(keep_last=KEEP),
                            pacing=PacingOptions(max_overhead=None))
    dirs: list[Path] = []
    saves = 0
    dist.barrier()
    model.train()
    clock.tick()
    for step in range(n):
        train_step(model, optimizer, ids, step, args.batch)
        if method == "own":
            msd, osd = get_state_dict(model, optimizer)
            path = root / f"step-{step}"
            dcp_save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(str(path)))
            dirs.append(path)  # complete on every rank: save ends with a collective
            saves += 1
            while len(dirs) > KEEP:
                old = dirs.pop(0)
                if rank() == 0:
                    shutil.rmtree(old, ignore_errors=True)
        clock.tick()
    extra: dict[str, Any] = {"saves": saves} if method == "own" else {}
    if ckpt is not None:
        ckpt.close()
        extra |= asym_stats(ckpt.stats())
    dist.barrier()
    clock.done()
    dist.destroy_process_group()
    return extra


def run_ddp_loop(method: str, args: argparse.Namespace, root: Path, clock: Clock) -> dict[str, Any]:
    """A plain loop over GPT-2 under ``DistributedDataParallel`` on ``WORLD_SIZE`` gloo ranks, the own Checkpointer.

    ``own`` here is the Checkpointer with ``CommitOptions(dedup="off")`` (every rank copies, hashes and
    writes the whole replicated state: the code before slices), ``asymcheck`` the default
    ``dedup="replicas"`` (each rank its slice). Each reports the bytes it wrote per version
    (``bytes_per_version``, per rank in ``per_rank``) and, measured in the same process on the trained
    state after the loop, the CPU cost of the identity check: one sampled digest of the replicated state
    (``digest_sample_s``, every version) and one full digest (``digest_full_s``, the first versions).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    n = args.warmup + args.steps
    net, _, _ = build_gpt2(args.config, args.seq)
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = tokens(GPT2_CONFIGS[args.config]["vocab_size"], n * args.batch * world(), args.seq)
    ckpt: Any = None
    if method != "none":
        from asymcheck import Checkpointer
        from asymcheck.options import CommitOptions, PacingOptions, RetentionOptions

        ckpt = Checkpointer(model, optimizer, str(root), retention=RetentionOptions(keep_last=KEEP),
                            pacing=PacingOptions(max_overhead=None),
                            commits=CommitOptions(dedup="off" if method == "own" else "replicas"))
    dist.barrier()
    model.train()
    clock.tick()
    for step in range(n):
        train_step(model, optimizer, ids, step, args.batch)
        clock.tick()
    extra: dict[str, Any] = {}
    if ckpt is not None:
        ckpt.close()
        stats = ckpt.stats()
        extra |= asym_stats(stats)
        extra["bytes_per_version"] = stats.stored_bytes // stats.versions_committed if stats.versions_committed \
            else None
    dist.barrier()
    clock.done()
    if method == "asymcheck":
        from asymcheck.state.replicas import replica_digest
        from asymcheck.state.trainstate import TrainingState

        cap = TrainingState(model, optimizer).capture_step()
        started = time.process_time()
        for i in range(20):
            replica_digest(cap.names, cap.sources, i, full=False)
        extra["digest_sample_s"] = (time.process_time() - started) / 20
        started = time.process_time()
        replica_digest(cap.names, cap.sources, 0, full=True)
        extra["digest_full_s"] = time.process_time() - started
    dist.destroy_process_group()
    return extra


RUNNERS: dict[str, Callable[[str, argparse.Namespace, Path, Clock], dict[str, Any]]] = {
    "accelerate": run_accelerate, "hf": run_hf, "lightning": run_lightning, "dcp": run_dcp, "loop": run_fsdp2,
    "ddploop": run_ddp_loop, "torchtitan": run_torchtitan}


def child(args: argparse.Namespace) -> None:
    framework, method, root, result = args.child
    world(), rank()  # before any framework touches the environment
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
    if extra.get("framework_world", world()) != world():  # e.g. ranks that each trained alone, not distributed
        raise RuntimeError(f"{framework}/{method}: the framework ran on {extra['framework_world']} process(es), "
                           f"the launch gave WORLD_SIZE={world()}")
    walls = [w for w, _ in clock.marks]
    steps = [b - a for a, b in itertools.pairwise(walls)]
    if len(steps) < args.warmup + args.steps:
        raise RuntimeError(f"{framework}/{method}: {len(steps)} steps timed, expected {args.warmup + args.steps}")
    measured = steps[args.warmup:args.warmup + args.steps]
    first, last = clock.marks[args.warmup], clock.marks[args.warmup + args.steps]
    write_json(rank_result(result, rank()), {
        "framework": framework, "method": method, "step_s": measured, "warmup_step_s": steps[:args.warmup],
        "cpu_s_per_step": (last[1] - first[1]) / args.steps, "finish_s": clock.returned - walls[-1],
        "setup_s": walls[0] - started, "rss": rss.as_dict(), "threads": torch.get_num_threads(), "rank": rank(),
        "world": world(), **extra})


def rank_result(result: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a run writes its result (rank 0: ``result`` itself)."""
    return Path(result) if rank == 0 else Path(f"{result}.rank{rank}")


# -- the parent: rounds of fresh processes, the summary ----------------------------------------


def run_ranks_fresh(argv: list[str], ranks: int, env: dict[str, str], timeout: float, logs: Path) -> Run:
    """Run ``argv`` as ``ranks`` fresh processes of one job, each with the environment ``torchrun`` gives a rank.

    As tests/asymcheck/hf/test_trainer.py launches its DDP runs: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``NODE_RANK`` and a free
    loopback ``MASTER_ADDR``/``MASTER_PORT`` per job. Each rank's output goes to a file under ``logs``;
    past ``timeout`` every rank still running is killed (code -1). The code is the first non-zero rank's.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    procs: list[subprocess.Popen[bytes]] = []
    files = []
    for r in range(ranks):
        penv = dict(os.environ, **env, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                    LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", ROLE_RANK=str(r), ROLE_WORLD_SIZE=str(ranks),
                    NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        log = (logs / f"rank{r}.log").open("wb")
        files.append(log)
        procs.append(subprocess.Popen(argv, env=penv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    codes: list[int] = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:  # a hung collective: every rank still running goes
                if q.poll() is None:
                    q.kill()
            proc.wait()
            codes.append(-1)
    for log in files:
        log.close()
    text = "".join(f"--- rank {r} ---\n" + (logs / f"rank{r}.log").read_text(errors="replace")[-3000:]
                   for r in range(ranks))
    return Run(next((c for c in codes if c != 0), 0), text, "", time.perf_counter() - t0, load)


def merge_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's result from its ranks': per step the slowest rank's time (the ranks wait for each other anyway).

    CPU seconds per step and the finish are the largest rank's, the RSS growth the largest; the
    per-rank figures are kept (``per_rank``); the rest is rank 0's.
    """
    if len(results) == 1:
        return results[0]
    out = dict(results[0])
    out["step_s"] = [max(ts) for ts in zip(*(r["step_s"] for r in results), strict=True)]
    out["warmup_step_s"] = [max(ts) for ts in zip(*(r["warmup_step_s"] for r in results), strict=True)]
    for key in ("cpu_s_per_step", "finish_s", "setup_s"):
        out[key] = max(r[key] for r in results)
    out["rss"] = max((r["rss"] for r in results), key=lambda x: int(x["peak_growth_bytes"]))
    out["per_rank"] = [{k: r.get(k) for k in ("rank", "cpu_s_per_step", "finish_s", "step_s", "bytes_per_version")}
                       for r in results]
    return out


def run_child(case: Case, method: str, args: argparse.Namespace, work: Path, timeout: float) -> dict[str, Any]:
    name = f"{case.key}-{method}"
    root = work / name
    result = work / f"{name}.json"
    argv = child_argv(__file__, "--child", case.framework, method, str(root), str(result),
                      "--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup),
                      "--batch", str(args.batch), "--seq", str(args.seq))
    argv += ["--threads", str(args.threads)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    settle()  # the previous run's dirty pages must not be written back during this one
    if case.ranks > 1:
        logs = work / f"{name}-logs"
        logs.mkdir(parents=True, exist_ok=True)
        run = run_ranks_fresh(argv, case.ranks, env, timeout, logs)
        shutil.rmtree(logs, ignore_errors=True)
    else:
        run = run_fresh(argv, env=env, timeout=timeout, cwd=REPO)
    shutil.rmtree(root, ignore_errors=True)
    paths = [rank_result(result, r) for r in range(case.ranks)]
    base = {"case": case.key, "row": case.row, "framework": case.framework, "method": method, "ranks": case.ranks}
    if run.code != 0 or not all(path.exists() for path in paths):
        for path in paths:
            path.unlink(missing_ok=True)
        return base | {"error": f"exit code {run.code}", "log_tail": run.log[-4000:], "loadavg_1m": run.loadavg_1m,
                       "process_s": run.seconds}
    return merge_ranks([take_json(path) for path in paths]) | base | {"loadavg_1m": run.loadavg_1m,
                                                                       "process_s": run.seconds}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def methods_of(framework: str) -> list[str]:
    """The methods a framework's rows run: every framework's, then its own (``EXTRA_METHODS``)."""
    return METHODS + EXTRA_METHODS.get(framework, [])


def summarize(runs: list[dict[str, Any]], framework: str = "") -> dict[str, Any]:
    """Per method: the pooled median step, ratio and overhead over none, CPU, RSS; the overhead-ratio target.

    The target compares the framework's ``TARGET_METHOD`` (default ``asymcheck``) with ``own``.
    """
    methods: dict[str, Any] = {}
    for method in methods_of(framework):
        ok = [r for r in runs if r["method"] == method and "error" not in r]
        failed = [r for r in runs if r["method"] == method and "error" in r]
        if not ok and not failed:
            continue
        steps = [s for r in ok for s in r["step_s"]]
        growth = [int(r["rss"]["peak_growth_bytes"]) for r in ok]
        entry: dict[str, Any] = {
            "label": "", "runs": len(ok), "failed": len(failed), "median_step_s": _median(steps),
            "mean_step_s": statistics.fmean(steps) if steps else None,
            "step_s": steps, "median_step_s_per_run": [statistics.median(r["step_s"]) for r in ok],
            "cpu_s_per_step": _median([r["cpu_s_per_step"] for r in ok]),
            "cpu_s_per_step_per_run": [r["cpu_s_per_step"] for r in ok],
            "finish_s": _median([r["finish_s"] for r in ok]),
            "max_rss_growth_bytes": max(growth) if growth else None, "rss_growth_bytes": growth}
        for key in ("versions_committed", "versions_skipped", "versions_dropped", "commits_failed"):
            if any(key in r for r in ok):
                entry[key] = [r.get(key) for r in ok]
        per_rank = [p["bytes_per_version"] for r in ok for p in r.get("per_rank", [r])
                    if p.get("bytes_per_version") is not None]
        if per_rank:
            entry["bytes_per_rank_per_version"] = statistics.median(per_rank)
        for key in ("digest_sample_s", "digest_full_s"):
            if any(key in r for r in ok):
                entry[key] = _median([r[key] for r in ok if key in r])
        stalls = [r["asym_median_stall_s"] for r in ok if r.get("asym_median_stall_s") is not None]
        if stalls:
            entry["asym_median_stall_s"] = statistics.median(stalls)
        methods[method] = entry
    base = methods.get("none", {}).get("median_step_s")
    base_mean = methods.get("none", {}).get("mean_step_s")
    base_cpu = methods.get("none", {}).get("cpu_s_per_step")
    for entry in methods.values():
        med, mean = entry["median_step_s"], entry["mean_step_s"]
        entry["ratio_vs_none"] = med / base if med is not None and base else None
        entry["overhead_s"] = med - base if med is not None and base is not None else None
        entry["mean_overhead_s"] = mean - base_mean if mean is not None and base_mean is not None else None
        cpu = entry["cpu_s_per_step"]
        entry["cpu_s_per_checkpoint"] = cpu - base_cpu if cpu is not None and base_cpu is not None else None
    target_method = TARGET_METHOD.get(framework, "asymcheck")
    own = methods.get("own", {}).get("overhead_s")
    asym = methods.get(target_method, {}).get("overhead_s")
    ratio = asym / own if asym is not None and own is not None and own > 0 else None
    met = ratio is not None and ratio <= TARGET_OVERHEAD_RATIO
    own_mean = methods.get("own", {}).get("mean_overhead_s")
    asym_mean = methods.get(target_method, {}).get("mean_overhead_s")
    mean_ratio = asym_mean / own_mean if asym_mean is not None and own_mean is not None and own_mean > 0 else None
    target = {"value": ratio, "target": TARGET_OVERHEAD_RATIO, "met": met, "asymcheck_overhead_s": asym,
              "own_overhead_s": own, "value_of_means": mean_ratio, "method": target_method}
    return {"methods": methods, "overhead_ratio": target}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any]) -> str:
    """The markdown tables: a line per row (a framework in a configuration) and method; a line per row: the target."""
    lines = ["| row | method | median step | mean step | x none | overhead | CPU s / step | peak RSS growth "
             "| versions |",
             "|---|---|---|---|---|---|---|---|---|"]
    for fw in results["frameworks"].values():
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
            lines.append(f"| {fw['title']} | {m['label']} | {fmt(m['median_step_s'], '.3f')} s | "
                         f"{fmt(m['mean_step_s'], '.3f')} s | "
                         f"{fmt(m['ratio_vs_none'], '.2f')} | {fmt(m['overhead_s'], '+.3f')} s | "
                         f"{fmt(m['cpu_s_per_step'], '.2f')} | "
                         f"{'-' if growth is None else f'{growth / (1 << 20):.0f} MiB'} | {versions} |")
    lines += ["", "| row | asymcheck overhead | own overhead | asymcheck / own (target ≤ 0.5) | the same of means |",
              "|---|---|---|---|---|"]
    for fw in results["frameworks"].values():
        t = fw["overhead_ratio"]
        verdict = "-" if t["value"] is None else f"{t['value']:.2f} ({'met' if t['met'] else 'NOT met'})"
        which = "" if t.get("method", "asymcheck") == "asymcheck" else f" ({t['method']})"
        lines.append(f"| {fw['title']} | {fmt(t['asymcheck_overhead_s'], '+.3f')} s{which} | "
                     f"{fmt(t['own_overhead_s'], '+.3f')} s | {verdict} | {fmt(t['value_of_means'], '.2f')} |")
    written = [(fw, m) for fw in results["frameworks"].values() for m in fw["methods"].values()
               if "bytes_per_rank_per_version" in m]
    if written:
        lines += ["", "| row | method | bytes written per rank per version | x none step | CPU of the identity "
                  "check: sampled digest / version, full digest |", "|---|---|---|---|---|"]
        for fw, m in written:
            digest = ""
            if m.get("digest_sample_s") is not None:
                digest = f"{m['digest_sample_s'] * 1e3:.2f} ms, {fmt(m.get('digest_full_s'), '.3f')} s"
            lines.append(f"| {fw['title']} | {m['label']} | {m['bytes_per_rank_per_version'] / (1 << 20):.1f} MiB | "
                         f"{fmt(m['ratio_vs_none'], '.2f')} | {digest} |")
    return "\n".join(lines)


def machine_load() -> str:
    """The cores and ``uptime``'s line (its load averages over 1, 5 and 15 minutes)."""
    try:
        up = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    except OSError:
        up = ""
    if not up:
        up = "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"cores: {os.cpu_count()}; uptime: {up}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_flag(ap, "tiny GPT-2, 1 round, fewer steps (about 5 minutes for every row)")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"comma-separated configurations, from {list(ROWS)}: single = one process, ddp = --ranks "
                         "processes under DDP (gloo), fsdp2 = --ranks processes under fully_shard (gloo)")
    ap.add_argument("--ranks", type=int, default=2, help="processes of the ddp and fsdp2 rows")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                    help=f"comma-separated, from {FRAMEWORKS} (each row runs those of its own it is given)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every method (default 4; --quick 1)")
    ap.add_argument("--config", choices=sorted(GPT2_CONFIGS), default=None,
                    help="GPT-2 size (default 8m; --quick tiny)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per run (default 10; --quick 6)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured steps per run (asymcheck plans after 3)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256; --quick 128)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (0: torch's default; see the module docstring)")
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
    rows = [r for r in args.rows.split(",") if r]
    if sorted(set(rows) - set(ROWS)):
        ap.error(f"unknown rows {sorted(set(rows) - set(ROWS))} (from {list(ROWS)})")
    if args.ranks < 2 and set(rows) - {"single"}:
        ap.error("--ranks: the ddp and fsdp2 rows need 2 or more")
    cases = [Case(row, fw, 1 if row == "single" else args.ranks)
             for row in rows for fw in ROWS[row] if fw in frameworks]
    if not cases:
        ap.error(f"no framework of {frameworks} is in the rows {rows}")
    _, _, nparams = build_gpt2(args.config, args.seq)
    state_bytes = 3 * 4 * nparams  # fp32 parameters and AdamW's two moments
    load_before = os.getloadavg()
    print(f"GPT-2 {args.config}: {nparams / 1e6:.1f}M parameters, {state_bytes / (1 << 20):.0f} MiB of state per "
          f"checkpoint (all ranks together); {args.rounds} round(s) x {len(cases)} row(s) x {len(METHODS)}+ methods, "
          f"{args.warmup} + {args.steps} steps each; {machine_load()}", flush=True)
    not_run = {row: why for row, why in NOT_RUN.items() if row in rows}
    for row, why in not_run.items():
        print(f"  not run ({row}): {why}", flush=True)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="integrations-", dir=args.dir))
    runs: dict[str, list[dict[str, Any]]] = {c.key: [] for c in cases}
    started = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            for case in cases:
                for method in order(methods_of(case.framework), rnd):
                    r = run_child(case, method, args, work, args.timeout) | {"round": rnd}
                    runs[case.key].append(r)
                    if "error" in r:
                        print(f"  round {rnd} {case.title:>18} {method:>9}: FAILED ({r['error']})\n{r['log_tail']}",
                              flush=True)
                        continue
                    extra = (f", {r['versions_committed']} versions committed" if "versions_committed" in r else "")
                    extra += f", {r['saves']} saves" if "saves" in r else ""
                    print(f"  round {rnd} {case.title:>18} {method:>9}: "
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
        "warmup": args.warmup, "rounds": args.rounds, "threads": args.threads, "keep": KEEP, "rows": rows,
        "ranks": args.ranks, "not_run": not_run, "loadavg_before": load_before, "loadavg_after": load_after,
        "wall_s": time.perf_counter() - started, "frameworks": {}}
    for case in cases:
        summary = summarize(runs[case.key], case.framework)
        for method, entry in summary["methods"].items():
            entry["label"] = LABELS[case.framework][method]
        results["frameworks"][case.key] = summary | {"title": case.title, "row": case.row,
                                                     "framework": case.framework, "ranks": case.ranks,
                                                     "runs": runs[case.key]}
    write_json(args.out, results, indent=1)
    print()
    print(table(results))
    for row, why in not_run.items():
        print(f"\nnot run ({row}): {why}")
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f}; {machine_load()}; "
          f"{results['wall_s']:.0f} s in all; wrote {args.out}")
    failed = sum(1 for rs in runs.values() for r in rs if "error" in r)
    return 1 if failed else 0


def versions() -> dict[str, str | None]:
    """The versions of torch and of each framework measured."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "lightning", "torchtitan", "torchdata", "asymstore"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    raise SystemExit(main())
