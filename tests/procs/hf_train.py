"""Hugging Face Trainer runs for the asymcheck.hf kill tests (``python -m tests.procs.hf_train``; never imported).

``python -m tests.procs.hf_train --plan PLAN.json`` imports torch and transformers once, then
runs the plan's batches in order; the runs of a batch run side by side (the ranks of a
DeepSpeed job, or two independent runs), each in a forked child (a fresh process to SIGKILL,
with its own ``env``). One line per run in the plan's ``exits`` file:
``{"name": ..., "code": ...}`` (a negative code: the signal). A run that outlives
``deadline_s`` is SIGKILLed by the driver (code -1000). The options of one run follow.

Trains a small GPT-2 (``GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32)``,
dropout on) on synthetic tokens with the real ``transformers.Trainer`` on CPU: a shuffled map-style
dataset of 24 sequences, batches of 4 (6 per epoch, so a run crosses epochs), ``logging_steps=1``.

``--dir`` makes it checkpoint with ``asymcheck.hf.AsymCheckCallback`` (a version every step) and
resume through ``trainer.train(resume_from_checkpoint=callback.resume_from(trainer))``; without it
the run is the plain Trainer (the uninterrupted reference). ``--kill-at S`` SIGKILLs the process
once the Trainer's global step is S, at ``--kill-where``: ``forward`` (inside the first forward of
step S+1, after its batch was fetched), ``step-end`` (in ``on_step_end`` of step S, before the
step's log) or ``log`` (right after step S's loss was logged). A run that ends writes ``OUT/result.pt``:
the loss log (global step, loss as a float), the final model parameters and optimizer state,
and how many sequences the dataset was asked for, the Trainer's world size and model wrapper, the autocast
dtype every training forward ran under and how many training forwards the first attention ran (twice a
micro-batch under gradient checkpointing). With ``WORLD_SIZE`` > 1 in the environment (what ``torchrun``
sets) and no ``--deepspeed`` the run is the Trainer's DDP, gloo on CPU (``use_cpu=True``); ``--bf16`` and
``--grad-ckpt`` pass ``bf16=True`` and ``gradient_checkpointing=True``. ``--peft`` trains LoRA adapters
(``peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.1)``) on the frozen GPT-2;
``--perturb-base`` then adds 1e-3 to one frozen weight (a changed base, which a resume must refuse).
``--compile BACKEND`` passes ``torch_compile=True, torch_compile_backend=BACKEND`` (the kill and watch
hooks are wrapped in ``torch.compiler.disable``: run, never traced) and the result records the graphs
Dynamo captured and the wrapper; ``--partitioning`` is the callback's ``PartitionOptions(partitioning=...)``.
``--fp16 cpu-scaler`` passes ``fp16=True`` on the CPU, where Accelerate makes no GradScaler (it trains in fp32
without one): a test-only shim gives the Trainer's ``Accelerator`` a ``torch.amp.GradScaler("cpu")`` before
``train()`` (the object Accelerate itself puts there on a GPU; the reference run has it too), so its
``backward`` scales the loss and its ``AcceleratedOptimizer`` steps through the scaler; ``--fp16 cuda`` is the
real thing on a GPU (``use_cpu=False``). ``--optim`` is ``TrainingArguments(optim=...)``: the default, fused
AdamW, takes the scaler into its step (``_step_supports_amp_scaling``: the scaler calls its ``step`` always, the
update skipped inside it), ``adamw_torch`` is stepped by the scaler only when no inf was found. Under either,
the loss of the training forwards of the global steps in
``OVERFLOW`` is made infinite (in every run) so that the scaler skips those optimizer steps and backs off; the
result records the scaler's state and which steps were skipped.
Every run prints the median step time (event ``timing``) and which hooks copied the versions' bytes.
Lines on stdout are JSON events.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from asymcheck.hf import AsymCheckCallback
from asymcheck.options import PacingOptions, PartitionOptions, RetentionOptions

OVERFLOW = {1, 4, 5, 8}  # under --fp16: the global steps (0-based: done before) whose forward's loss is made inf
SEQUENCES = 24
LENGTH = 16
BATCH = 4


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Synthetic token sequences (a fixed seed), as causal-LM examples."""

    def __init__(self, seed: int = 7, n: int = SEQUENCES) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, LENGTH), generator=g)
        self.fetched = 0  # sequences read: a resume that re-read the skipped batches would show here

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.fetched += 1
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Killer(TrainerCallback):
    """SIGKILLs the process at global step ``at`` (see the module docstring for where).

    Commits run in the background; so that the resume starts from the step before the kill (and
    the kill point decides which version is resumed), it first waits, up to 60 s, until that
    version is committed (globally, under DeepSpeed).
    """

    def __init__(self, at: int, where: str, model: torch.nn.Module, ckpt: AsymCheckCallback | None,
                 skipped: set[int]) -> None:
        self.at, self.where, self.ckpt = at, where, ckpt
        # a version is a completed optimizer step: the newest sealed once step `at` ran is the one before it
        self.wanted = max(sum(1 for s in range(at) if s not in skipped) - 1, 1)
        self.step = -1
        if where == "forward":  # run, never traced (--compile)
            model.register_forward_pre_hook(torch.compiler.disable(self._forward))

    def _committed(self) -> bool:
        checkpointer = self.ckpt.checkpointer if self.ckpt is not None else None
        if checkpointer is None:
            return True
        store: Any = checkpointer.store
        steps = store.global_steps() if hasattr(store, "global_steps") else \
            [v for vs in checkpointer.versions().values() for v in vs]
        return max(steps, default=0) >= self.wanted

    def kill(self, where: str, step: int) -> None:
        deadline = time.monotonic() + 60
        while not self._committed() and time.monotonic() < deadline:
            time.sleep(0.05)
        emit(event="kill", where=where, step=step)
        die()

    def _forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.step == self.at and module.training and torch.is_grad_enabled():
            self.kill("forward", self.step)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.where == "step-end" and state.global_step == self.at:
            self.kill("step-end", state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self.where == "log" and state.global_step == self.at and logs and "loss" in logs:
            self.kill("log", state.global_step)


class Overflow(TrainerCallback):
    """Makes the training loss of the global steps in ``steps`` infinite (the GradScaler then skips their step)."""

    def __init__(self, steps: set[int], model: torch.nn.Module, trainer: Trainer) -> None:
        self.steps, self.trainer = steps, trainer
        self.step = -1
        self.scale: float | None = None
        self.skipped: list[int] = []  # 1-based global steps whose update the scaler skipped (it backed off)
        model.register_forward_hook(torch.compiler.disable(self._forward))

    def _forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self.step in self.steps and module.training and torch.is_grad_enabled():
            output["loss"] = output["loss"] * float("inf")
        return output

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step
        scaler = self.trainer.accelerator.scaler
        self.scale = scaler.get_scale() if scaler is not None else None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        scaler = self.trainer.accelerator.scaler
        scale = scaler.get_scale() if scaler is not None else None
        if self.scale is not None and scale is not None and scale < self.scale:  # it backed off: inf found
            self.skipped.append(state.global_step)
        self.scale = scale


class Began(TrainerCallback):
    """The global step training began at (after a resume: the version's)."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step


class Seen(TrainerCallback):
    """Keeps the callback's Checkpointer of the run (its stats are read after train() closed it)."""

    last: Any = None

    def __init__(self, ckpt: AsymCheckCallback) -> None:
        self.ckpt = ckpt

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        Seen.last = self.ckpt.checkpointer


class Ticks(TrainerCallback):
    """Appends the time at the end of every step."""

    def __init__(self, ticks: list[float]) -> None:
        self.ticks = ticks

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ticks.append(time.perf_counter())


def deepspeed_config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}


def final_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Model parameters and the torch optimizer's state and parameters (ZeRO's fp32 partitions under DeepSpeed)."""
    out = {f"model/{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}
    opt: Any = trainer.optimizer
    for _ in range(4):  # AcceleratedOptimizer / DeepSpeed's optimizer wrap the torch one
        if type(opt).__module__.startswith("torch.optim"):
            break
        opt = opt.optimizer
    for i, (p, st) in enumerate(opt.state.items()):
        out[f"optim/param/{i}"] = p.detach().clone()
        for name, value in st.items():
            out[f"optim/state/{i}/{name}"] = torch.as_tensor(value).detach().clone()
    return out


def run(argv: list[str]) -> int:
    """One training run (the options below)."""
    ap = argparse.ArgumentParser(prog="hf_train")
    ap.add_argument("--dir", help="the callback's store directory (none: the plain Trainer)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ga", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--save-steps", type=int, default=0, help="the Trainer's own checkpoint-N every N steps")
    ap.add_argument("--deepspeed", type=int, default=-1, help="ZeRO stage (DeepSpeed through the Trainer)")
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-where", choices=["forward", "step-end", "log"], default="forward")
    ap.add_argument("--plain-train", action="store_true", help="trainer.train() without resume_from()")
    ap.add_argument("--keep-every", type=int, default=0, help="the callback's keep_every (beside keep_last=3)")
    ap.add_argument("--eval", type=int, default=0,
                    help="evaluate and save every N steps (dropout off, the eval loader draws a seed), "
                         "load_best_model_at_end by eval_loss")
    ap.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): the CPU autocast")
    ap.add_argument("--grad-ckpt", action="store_true", help="TrainingArguments(gradient_checkpointing=True)")
    ap.add_argument("--peft", action="store_true", help="LoRA adapters on the frozen model (peft)")
    ap.add_argument("--perturb-base", action="store_true", help="with --peft: change one frozen weight")
    ap.add_argument("--compile", default="", help="TrainingArguments(torch_compile=True, torch_compile_backend=...)")
    ap.add_argument("--fp16", choices=["cpu-scaler", "cuda"], default="",
                    help="fp16=True: on the CPU with a GradScaler('cpu') shim, or on CUDA")
    ap.add_argument("--optim", default="", help="TrainingArguments(optim=...) (default: the Trainer's, fused AdamW)")
    ap.add_argument("--partitioning", default="", help="the callback's PartitionOptions(partitioning=...)")
    args = ap.parse_args(argv)
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.deepspeed < 0  # torchrun's environment, no DeepSpeed
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    model: torch.nn.Module = gpt2
    if args.peft:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1, fan_in_fan_out=True,
                          task_type="CAUSAL_LM")
        model = get_peft_model(gpt2, lora)
        if args.perturb_base:
            with torch.no_grad():
                gpt2.transformer.h[1].mlp.c_fc.weight[0, 0] += 1e-3
    targs = TrainingArguments(
        output_dir=str(out / "hf"), max_steps=args.steps, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=args.ga, learning_rate=1e-3, warmup_steps=2, logging_steps=1,
        save_strategy="steps" if args.save_steps or args.eval else "no", save_steps=args.eval or args.save_steps or 500,
        eval_strategy="steps" if args.eval else "no", eval_steps=args.eval or None, per_device_eval_batch_size=BATCH,
        load_best_model_at_end=bool(args.eval), metric_for_best_model="eval_loss" if args.eval else None,
        report_to=[], use_cpu=args.fp16 != "cuda", **({"optim": args.optim} if args.optim else {}), seed=0,
        fp16=bool(args.fp16), disable_tqdm=True, dataloader_num_workers=0, bf16=args.bf16,
        ddp_backend="gloo" if ddp else None,
        **({"torch_compile": True, "torch_compile_backend": args.compile} if args.compile else {}),
        **({"gradient_checkpointing": True} if args.grad_ckpt else {}),  # as users write it (5.24: a FutureWarning)
        deepspeed=deepspeed_config(args.deepspeed) if args.deepspeed >= 0 else None)
    data = Tokens()
    held_out = Tokens(seed=8, n=8) if args.eval else None
    trainer = Trainer(model=model, args=targs, train_dataset=data, eval_dataset=held_out)
    if args.fp16 == "cpu-scaler":  # test-only shim: the scaler Accelerate gives fp16 on a GPU, on the CPU
        assert trainer.accelerator.scaler is None
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    overflow = Overflow(OVERFLOW if args.fp16 else set(), gpt2, trainer)
    trainer.add_callback(overflow)
    began = Began()
    trainer.add_callback(began)
    resume = None
    ckpt = None
    if args.dir:
        # a version every step, always; with --eval also the best by the Trainer's metric_for_best_model
        ckpt = AsymCheckCallback(args.dir, keep_best=1 if args.eval else None,
                                 retention=RetentionOptions(keep_every=args.keep_every or None),
                                 pacing=PacingOptions(max_overhead=None),
                                 **({"partitions": PartitionOptions(partitioning=args.partitioning)}
                                    if args.partitioning else {}))
        trainer.add_callback(ckpt)
        if not args.plain_train:
            resume = ckpt.resume_from(trainer)
        emit(event="resume", dir=resume is not None)
    if args.kill_at >= 0:
        # the scaler calls a fused optimizer's step every time (it skips the update itself): no step is missed
        missed = overflow.steps if args.fp16 and args.optim == "adamw_torch" else set()
        trainer.add_callback(Killer(args.kill_at, args.kill_where, model, ckpt, missed))
    autocast_seen: set[str] = set()  # the autocast the training forwards ran under
    calls = [0]  # training forwards of the first attention (gradient checkpointing recomputes each in backward)

    def watch(module: torch.nn.Module, inputs: Any) -> None:
        if module.training:
            calls[0] += 1
            device = "cuda" if args.fp16 == "cuda" else "cpu"
            on = torch.is_autocast_enabled(device)
            autocast_seen.add(str(torch.get_autocast_dtype(device)) if on else "off")

    gpt2.transformer.h[0].attn.register_forward_pre_hook(torch.compiler.disable(watch))  # recomputed; never traced
    if ckpt is not None:
        trainer.add_callback(Seen(ckpt))
    ticks: list[float] = []  # the end of every step: the step time once compiled
    trainer.add_callback(Ticks(ticks))
    trainer.train(resume_from_checkpoint=resume)
    gaps = sorted(b - a for a, b in itertools.pairwise(ticks))
    compiled: dict[str, Any] = {}
    if args.compile:  # the model ran compiled: Dynamo captured graphs of it
        from torch._dynamo.utils import counters

        compiled = {"graphs": int(counters["stats"]["unique_graphs"]), "wrapper": type(trainer.model_wrapped).__name__,
                    "breaks": sum(counters["graph_break"].values())}
    copied: dict[str, Any] = {}
    if ckpt is not None and Seen.last is not None:  # which hooks copied the versions' bytes
        stats = Seen.last.stats()
        copied = {"forward": sum(r.forward_bytes for r in stats.steps),
                  "backward": sum(r.backward_bytes for r in stats.steps),
                  "partitioning": Seen.last.partitioning}
    emit(event="timing", median_step_s=gaps[len(gaps) // 2] if gaps else None, steps=len(ticks), compiled=compiled,
         copied=copied)
    recomputed = calls[0]
    if ckpt is not None:
        emit(event="done", resumed=ckpt.resumed_step, versions=ckpt.final_versions)
    losses = [(h["step"], float(h["loss"])) for h in trainer.state.log_history if "loss" in h]
    evals = [(h["step"], float(h["eval_loss"])) for h in trainer.state.log_history if "eval_loss" in h]
    rank = os.environ.get("RANK", "0")
    versions = sorted({v for vs in (ckpt.final_versions or {}).values() for v in vs}) if ckpt else []
    torch.save({"losses": losses, "evals": evals, "versions": versions, "state": final_state(trainer),
                "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
                "resumed": ckpt.resumed_step if ckpt else None, "fetched": data.fetched,
                "world": trainer.args.world_size, "wrapper": type(trainer.model_wrapped).__name__,
                "autocast": sorted(autocast_seen), "block_forwards": recomputed,
                "trainable": sum(p.requires_grad for p in model.parameters()), "compiled": compiled,
                "copied": copied, "began": began.step, "skipped": overflow.skipped,
                "scaler": {k: float(v) for k, v in (trainer.accelerator.scaler.state_dict().items()
                                                    if trainer.accelerator.scaler is not None else ())}},
               out / ("result.pt" if rank == "0" else f"result-rank{rank}.pt"))
    return 0


def wait_child(pid: int, deadline: float) -> int:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1000
        time.sleep(0.02)


def fork_run(spec: dict[str, Any]) -> int:
    pid = os.fork()
    if pid == 0:  # the child: its own environment, then one run; never returns
        code = 1
        try:
            os.environ.update(spec.get("env", {}))
            code = run(list(spec["argv"]))
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def drive(plan: dict[str, Any]) -> int:
    with open(plan["exits"], "a", encoding="utf-8") as exits:  # not stdout, which the children's output shares
        for batch in plan["batches"]:
            started = [(spec, fork_run(spec), time.monotonic() + float(spec.get("deadline_s", 300)))
                       for spec in batch]
            for spec, pid, deadline in started:
                exits.write(json.dumps({"name": spec["name"], "code": wait_child(pid, deadline)}) + "\n")
                exits.flush()
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--plan"]:
        return drive(json.loads(Path(sys.argv[2]).read_text()))
    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
