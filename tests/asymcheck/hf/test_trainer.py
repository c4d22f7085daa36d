"""asymcheck.hf with the real Hugging Face Trainer on CPU: SIGKILL at a random step, resume, bit-exact.

A small GPT-2 (``GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32)``,
dropout on, a shuffled dataset, 12 steps crossing an epoch) trains in a child process with
``AsymCheckCallback`` taking a version every step (tests/procs/hf_train.py). It is SIGKILLed at a
random global step (inside the next step's forward, in ``on_step_end`` or right after the step's
loss was logged; ``HF_KILL_SEED`` replays a draw), a second run resumes through
``trainer.train(resume_from_checkpoint=callback.resume_from(trainer))`` and trains to the end:
every logged loss (``logging_steps=1``) and the final model parameters and optimizer state must
equal those of an uninterrupted run of the plain Trainer, bit for bit. Cases: ``plain``;
``accum`` (gradient accumulation of 2 micro-batches, with the Trainer's own ``save_steps``
checkpoints beside the versions); ``deepspeed`` (ZeRO-2 through ``TrainingArguments(deepspeed=...)``
on one rank: the callback attaches the DeepSpeed adapter to the Trainer's engine, with ``keep_every=5``
beside ``keep_last=3``, which its multi-rank store must apply); ``deepspeed-2ranks`` (the same on 2 ranks);
``ddp-2ranks`` (``ddp-4ranks`` in ``make test-all``): DDP without DeepSpeed, each rank a process with the
environment ``torchrun --nproc_per_node N`` gives it, gloo on CPU (``use_cpu=True``), every rank SIGKILLed at the
same step and restarted with the same command; the callback's directory is a multi-rank root (a shard per rank,
global versions) holding the replicated state in slices (each rank about half of it, the replicas claim in every
shard: the callback tells the Checkpointer the Trainer runs DDP). The comparison is with the uninterrupted run, bit
for bit: on 2 ranks the all-reduce adds two gradients, the same sum in either order, whatever DDP's buckets (which
it rebuilds after each process's first step); on 4 ranks the order could depend on the buckets, but this model's
gradients fit DDP's first bucket and the runs came out bit-exact (seeds 5, 6, 7; if a seed ever differs there,
compare with a run restarted at the same step without a kill, as the multirank guide does); ``bf16`` (``bf16=True``:
the Trainer's CPU autocast, checked in every training forward); ``grad-ckpt`` (``gradient_checkpointing=True``:
every attention forward runs again inside backward, counted, and fires the Checkpointer's forward pre-hooks there);
``peft`` (LoRA adapters on the frozen GPT-2 through ``peft.get_peft_model``: the version holds the whole model, the
adapters' optimizer state and the frozen base's fingerprint; the resume puts the adapters back from the store, the
Trainer reads none from the resume directory), and after it the same run on a changed base, refused with
``StateMismatchError`` before a step, the store untouched; ``compile`` (``torch_compile=True,
torch_compile_backend="aot_eager"``: the model runs as an ``OptimizedModule``, the snapshot hooks run eagerly at its
graph breaks and copy the versions' bytes there); ``fp16-cpu-scaler`` (``fp16=True`` through Accelerate's own
GradScaler path on the CPU: Accelerate makes its fp16 scaler only on GPUs, so a test-only shim hands the Trainer's
``Accelerator`` a ``torch.amp.GradScaler("cpu")``, in the reference run too; the losses of four fixed steps are made
infinite in every run, so the scaler backs off and skips their updates; the scaler's state must come back equal.
With the Trainer's default fused AdamW the scaler calls the optimizer's ``step`` every time (the update is skipped
inside it), so every global step is a version; with ``fp16-cpu-scaler-unfused`` (``optim="adamw_torch"``) the scaler
does not call ``step`` on an inf: a skipped step makes no version, and a version holds the TrainerState's
``global_step`` as the Trainer counts it, the skipped steps after it included) and ``fp16-cuda`` (the real fp16 on a
GPU, ``gpu``-marked, skipped without CUDA); ``peft-ddp-2ranks`` (LoRA under DDP on 2 ranks) and
``compile-ddp-2ranks`` (``torch_compile=True`` under DDP on 2 ranks, ``exhaustive``).
All runs of the module share one driver process (torch and transformers imported once; each run a forked child).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.procs.hf_train import OVERFLOW
from tests.support.launch import proc_argv, proc_env
from tests.support.replicas import assert_sliced, nbytes

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from asymcheck.errors import TrainerResumeError, UnsupportedConfigError, UnsupportedTrainerConfigError
from asymcheck.hf import check_trainer

STEPS = 12
BATCH = 4  # tests/procs/hf_train.py: per-device batch size
SEED = int(os.environ.get("HF_KILL_SEED", random.randrange(1 << 30)))
WHERE = ("forward", "step-end", "log")

# name -> (extra options of every run, ranks, whether make test runs it)
CASES: dict[str, tuple[list[str], int, bool]] = {
    "plain": ([], 1, True),
    "accum": (["--ga", "2", "--save-steps", "4"], 1, True),
    "deepspeed": (["--deepspeed", "2", "--keep-every", "5"], 1, True),
    "eval": (["--eval", "3"], 1, True),  # evaluations between steps, the Trainer's checkpoints, best model at end
    "deepspeed-accum": (["--deepspeed", "2", "--ga", "2"], 1, False),
    "deepspeed-2ranks": (["--deepspeed", "2"], 2, True),  # the multi-rank Trainer
    "plain-late": ([], 1, False),  # a second kill point for the plain loop
    "ddp-2ranks": ([], 2, True),  # DDP (gloo on CPU, use_cpu=True) under torchrun's environment, no DeepSpeed
    "ddp-4ranks": ([], 4, False),
    "bf16": (["--bf16"], 1, True),  # the Trainer's CPU autocast to bfloat16
    "grad-ckpt": (["--grad-ckpt"], 1, True),  # gradient checkpointing: forwards recomputed inside backward
    "peft": (["--peft"], 1, True),  # LoRA adapters on a frozen GPT-2
    "compile": (["--compile", "aot_eager"], 1, True),  # torch_compile=True: the hooks run at graph breaks
    # fp16's GradScaler path on the CPU (a GradScaler("cpu") shim, in the reference run too), skipped steps
    "fp16-cpu-scaler": (["--fp16", "cpu-scaler"], 1, True),  # fused AdamW: the scaler calls its step every time
    "fp16-cpu-scaler-unfused": (["--fp16", "cpu-scaler", "--optim", "adamw_torch"], 1, True),  # skipped: no step
    "fp16-cuda": (["--fp16", "cuda"], 1, True),  # the real fp16 on a GPU (gpu-marked; skipped without CUDA)
    "peft-ddp-2ranks": (["--peft"], 2, True),  # LoRA adapters under DDP
    # torch_compile=True under DDP: make test-all (it failed once in ~10 runs in make test's set, cause not known)
    "compile-ddp-2ranks": (["--compile", "aot_eager"], 2, False),
}


def kill_point(name: str) -> tuple[int, str]:
    rnd = random.Random(f"{SEED}-{name}")
    first = 3 if "adamw_torch" in CASES[name][0] else 2  # fp16: step 2 is skipped, version 1 is sealed at step 3
    return rnd.randrange(first, STEPS - 1), rnd.choice(WHERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(name: str, argv: list[str], ranks: int, launched: bool) -> list[dict[str, Any]]:
    """The runs of one job: one per rank; ``launched``, each with the environment torchrun gives it (a port per job)."""
    if not launched:
        return [{"name": name, "argv": argv}]
    port = str(free_port())
    return [{"name": name if rank == 0 else f"{name}-rank{rank}", "argv": argv,
             "env": {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                     "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                     "ROLE_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}}
            for rank in range(ranks)]


def plan_for(names: list[str], root: Path) -> dict[str, Any]:
    """Batches run one after the other; the runs of a batch side by side (2 at a time: the machine has 2 cores)."""
    first: list[list[dict[str, Any]]] = []
    second: list[list[dict[str, Any]]] = []
    for name in names:
        extra, ranks, _ = CASES[name]
        launched = ranks > 1 or "--deepspeed" in extra  # DeepSpeed on one rank needs the launcher's environment too
        at, where = kill_point(name)
        out, ck = str(root / name), str(root / f"{name}-ck")
        ref = job(f"{name}-ref", ["--out", str(root / f"{name}-ref"), *extra], ranks, launched)
        kill = job(f"{name}-kill", ["--out", out, "--dir", ck, "--kill-at", str(at), "--kill-where", where, *extra],
                   ranks, launched)
        resume = job(f"{name}-resume", ["--out", out, "--dir", ck, *extra], ranks, launched)
        first += [ref + kill] if ranks == 1 else [ref, kill]
        second.append(resume)
    singles = [runs for runs in second if len(runs) == 1]  # independent resumes: two side by side
    batches = first + [[run for runs in singles[i:i + 2] for run in runs] for i in range(0, len(singles), 2)]
    batches += [runs for runs in second if len(runs) > 1]
    if "plain" in names:  # train() without resume_from() on a store that holds versions: refused
        batches.append(job("plain-refused", ["--out", str(root / "refused"), "--dir", str(root / "plain-ck"),
                                             "--plain-train"], 1, False))
    if "peft" in names:  # the adapters' store, resumed on a base with one weight changed: refused
        batches.append(job("peft-base-changed", ["--out", str(root / "peft-changed"), "--dir", str(root / "peft-ck"),
                                                 "--peft", "--perturb-base"], 1, False))
    return {"batches": batches, "exits": str(root / "exits.jsonl")}


def marks_of(name: str) -> list[pytest.MarkDecorator]:
    extra, _, default = CASES[name]
    marks = [] if default else [pytest.mark.exhaustive]
    if "cuda" in extra:
        marks.append(pytest.mark.gpu)
        if not torch.cuda.is_available():
            marks.append(pytest.mark.skip(reason="needs CUDA (the Trainer's fp16 GradScaler)"))
    if "--deepspeed" in extra and importlib.util.find_spec("deepspeed") is None:
        marks.append(pytest.mark.skip(reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')"))
    return marks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Run every selected case once (one driver) and return the exit codes, the output and the root."""
    names = [n for n in CASES if any(n == item.callspec.params.get("name") for item in request.session.items
                                     if hasattr(item, "callspec") and item.module is request.module
                                     and item.get_closest_marker("skip") is None)]
    root = tmp_path_factory.mktemp("hf")
    plan = root / "plan.json"
    plan.write_text(json.dumps(plan_for(names or ["plain"], root)))
    env = proc_env(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(proc_argv("hf_train", "--plan", str(plan)), env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    exits = root / "exits.jsonl"
    lines = exits.read_text().splitlines() if exits.exists() else []
    codes: dict[str, int] = {event["name"]: event["code"] for event in map(json.loads, lines)}
    return {"codes": codes, "output": done.stdout + done.stderr, "root": root, "driver": done.returncode}


def load(path: Path, name: str) -> dict[str, Any]:
    result: dict[str, Any] = torch.load(path / name, weights_only=True)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=marks_of(n)) for n in CASES])
def test_kill_resume_bit_exact(name: str, runs: dict[str, Any]) -> None:
    at, where = kill_point(name)
    context = f"case {name}, killed at global step {at} ({where}), HF_KILL_SEED={SEED}\n{runs['output'][-6000:]}"
    codes = runs["codes"]
    _, ranks, _ = CASES[name]
    assert runs["driver"] == 0, context
    for rank in range(ranks):
        suffix = f"-rank{rank}" if rank else ""
        assert codes.get(f"{name}-ref{suffix}") == 0, context
        assert codes.get(f"{name}-kill{suffix}") == -9, context
        assert codes.get(f"{name}-resume{suffix}") == 0, context
        check_case(name, runs["root"], "result.pt" if rank == 0 else f"result-rank{rank}.pt", context)


def check_case(name: str, root: Path, result: str, context: str) -> None:
    at, _ = kill_point(name)
    extra = CASES[name][0]
    ref, got = load(root / f"{name}-ref", result), load(root / name, result)
    # a version is a completed optimizer step; the Trainer's global_step counts a skipped one too (fp16)
    skipped = {s + 1 for s in OVERFLOW} if "--fp16" in extra else set()
    assert sorted(skipped) == ref["skipped"], context  # the scaler really skipped those steps
    missed = skipped if "adamw_torch" in extra else set()  # a fused optimizer's step runs (its update skipped)
    real = [s for s in range(1, STEPS + 1) if s not in missed]  # the global steps whose optimizer.step() ran
    done = sum(1 for s in real if s <= at)  # versions the kill may follow: the one before the newest (or it)
    assert got["resumed"] is not None and done - 1 <= got["resumed"] <= done, context
    # version v holds the TrainerState after the global steps before the next completed step (skipped ones too)
    began = got["began"]
    assert began == (real[got["resumed"]] - 1 if got["resumed"] < len(real) else STEPS), context
    assert not skipped or sorted(s for s in skipped if s > began) == got["skipped"], context
    assert [s for s, _ in ref["losses"]] == list(range(1, STEPS + 1))
    assert got["losses"] == ref["losses"], context  # restored log history + the resumed steps, bit for bit
    assert got["evals"] == ref["evals"], context
    assert got["scaler"] == ref["scaler"], context  # fp16: the scale and growth tracker came back
    assert bool(ref["scaler"]) == ("--fp16" in extra), context
    assert got["versions"][-1] == len(real), context  # the last step committed (before a best model is loaded)
    if "--eval" in extra:  # keep_best=1 by metric_for_best_model (eval_loss, lower is better) beside keep_last=3
        best = min(ref["evals"], key=lambda e: e[1])[0]
        assert got["versions"] == sorted({best, *range(STEPS - 2, STEPS + 1)}), context
    assert (got["global_step"], got["epoch"]) == (ref["global_step"], ref["epoch"])
    ga = int(extra[extra.index("--ga") + 1]) if "--ga" in extra else 1
    # the data position: the skipped batches were not read again (12 steps end on an epoch boundary)
    assert ref["fetched"] == STEPS * ga * BATCH
    assert got["fetched"] == (STEPS - began) * ga * BATCH, context
    assert sorted(got["state"]) == sorted(ref["state"])
    differ = [k for k in ref["state"] if not torch.equal(ref["state"][k], got["state"][k])]
    assert not differ, f"{differ[:5]}: {context}"
    ranks = CASES[name][1]
    assert ref["world"] == got["world"] == ranks, context  # the Trainer itself ran distributed
    if ranks > 1 and "--deepspeed" not in extra:  # DDP: the wrapped model, a shard per rank, global versions, in sync
        wrapper = "OptimizedModule" if "--compile" in extra else "DistributedDataParallel"
        assert ref["wrapper"] == got["wrapper"] == wrapper, context
        assert sorted(p.name for p in (root / f"{name}-ck").glob("rank-*")) == [f"rank-{r:05d}" for r in range(ranks)]
        assert (root / f"{name}-ck" / "global" / f"v{STEPS:012d}.json").exists(), context
        rank0 = load(root / name, "result.pt")["state"]
        assert all(torch.equal(rank0[k], v) for k, v in got["state"].items() if k.startswith("model/")), context
        # the callback told the Checkpointer the Trainer runs DDP: the replicated state is written in slices
        replicated = nbytes(v for k, v in got["state"].items() if k.startswith(("model/", "optim/state/")))
        assert_sliced(root / f"{name}-ck", ranks, replicated, context)
    # the configuration really ran: bf16 autocast in every training forward, every block forward recomputed
    autocast = ["torch.bfloat16"] if "--bf16" in extra else ["torch.float16"] if "cuda" in extra else ["off"]
    assert got["autocast"] == ref["autocast"] == autocast, context
    per_step = (2 if "--grad-ckpt" in extra else 1) * ga
    assert ref["block_forwards"] == STEPS * per_step, context
    assert got["block_forwards"] == (STEPS - began) * per_step, context
    if "--peft" in extra:  # only the 4 LoRA matrices train; the optimizer holds their state alone
        assert ref["trainable"] == got["trainable"] == 4, context
        assert len([k for k in got["state"] if k.startswith("optim/param/")]) == 4, context
    if "--compile" in extra:  # the model ran compiled, and the hooks inside it copied the versions' bytes
        for run in (ref, got):
            assert run["compiled"]["wrapper"] == "OptimizedModule" and run["compiled"]["graphs"] > 0, context
        assert got["copied"]["partitioning"] == "asymmetric", context
        if STEPS - began > 4:  # past the planner's warm-up (3 steps) the hooks inside the compiled model copied bytes
            assert got["copied"]["forward"] + got["copied"]["backward"] > 0, context  # (a late kill copies at steps)
    every = int(extra[extra.index("--save-steps") + 1]) if "--save-steps" in extra else 0
    if every and result == "result.pt":  # the Trainer's own checkpoints beside the versions
        for n in range(every, STEPS + 1, every):
            saved = json.loads((root / name / "hf" / f"checkpoint-{n}" / "trainer_state.json").read_text())
            assert saved["global_step"] == n
            assert [(h["step"], h["loss"]) for h in saved["log_history"] if "loss" in h] == ref["losses"][:n]


@pytest.mark.slow
def test_train_without_resume_from_is_refused(runs: dict[str, Any]) -> None:
    assert runs["codes"].get("plain-refused") == 1, runs["output"][-4000:]
    assert "TrainerResumeError" in runs["output"] and "already holds version 12" in runs["output"]


@pytest.mark.slow
def test_damaged_newest_version_refused_then_repaired(runs: dict[str, Any]) -> None:
    """The version resume_from() chose fails verification: refused; after fsck --repair, the one before resumes."""
    root: Path = runs["root"]
    assert runs["codes"].get("plain-resume") == 0, runs["output"][-4000:]
    ck = root / "plain-ck"
    newest = max(ck.glob("v*"))
    segment = newest / "seg-000000.bin"
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit pattern flipped inside a parameter's bytes
    segment.write_bytes(bytes(data))
    env = proc_env(OMP_NUM_THREADS="1")
    out = str(root / "plain-repair")
    done = subprocess.run(proc_argv("hf_train", "--out", out, "--dir", str(ck)), env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 1 and "TrainerResumeError" in done.stderr, done.stdout + done.stderr
    assert f"positioned the Trainer at version {STEPS}" in done.stderr and "no longer verifies" in done.stderr
    fsck = subprocess.run([sys.executable, "-m", "asymstore.fsck", str(ck), "--repair"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert not newest.exists(), fsck.stdout + fsck.stderr  # moved aside
    done = subprocess.run(proc_argv("hf_train", "--out", out, "--dir", str(ck)), env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    ref, got = load(root / "plain-ref", "result.pt"), load(Path(out), "result.pt")
    assert got["resumed"] == STEPS - 1
    assert got["losses"] == ref["losses"]
    assert all(torch.equal(ref["state"][k], got["state"][k]) for k in ref["state"])


def args(**over: Any) -> SimpleNamespace:
    base = {"fsdp": [], "fp16": False, "auto_find_batch_size": False, "ignore_data_skip": False,
            "torch_compile": False, "n_gpu": 1, "world_size": 1, "deepspeed": None, "deepspeed_plugin": None}
    return SimpleNamespace(**{**base, **over})


@pytest.mark.parametrize(("setting", "value", "named"), [
    ("fsdp", ["full_shard"], "fsdp="), ("auto_find_batch_size", True, "auto_find_batch_size"),
    ("ignore_data_skip", True, "ignore_data_skip"), ("n_gpu", 2, "n_gpu=2"),
    ("accelerator_config", SimpleNamespace(use_seedable_sampler=False), "use_seedable_sampler=False"),
    ("train_sampling_strategy", "group_by_length", "group_by_length"),
])
def test_refused_settings_are_named(setting: str, value: Any, named: str) -> None:
    with pytest.raises(UnsupportedTrainerConfigError, match=named) as info:
        check_trainer(args(**{setting: value}))  # type: ignore[arg-type]
    assert isinstance(info.value, UnsupportedConfigError)
    check_trainer(args(world_size=2, deepspeed={"zero_optimization": {"stage": 2}}))  # type: ignore[arg-type]
    check_trainer(args(world_size=2))  # type: ignore[arg-type]  # DDP: the ddp-2ranks kill test
    check_trainer(args(torch_compile=True))  # type: ignore[arg-type]  # the compile kill test
    check_trainer(args())  # type: ignore[arg-type]


def test_fp16_is_refused_only_under_ddp_or_deepspeed() -> None:
    for over in ({"world_size": 2}, {"deepspeed": {"zero_optimization": {"stage": 2}}}):
        with pytest.raises(UnsupportedTrainerConfigError, match="fp16=True under DDP or DeepSpeed"):
            check_trainer(args(fp16=True, **over))  # type: ignore[arg-type]
    check_trainer(args(fp16=True))  # type: ignore[arg-type]  # one process: the fp16 kill tests


def test_compile_under_deepspeed_is_refused() -> None:
    with pytest.raises(UnsupportedTrainerConfigError, match="torch_compile=True under DeepSpeed"):
        check_trainer(args(torch_compile=True, deepspeed={"zero_optimization": {"stage": 2}}))  # type: ignore[arg-type]


@pytest.mark.parametrize("setting", [{"ignore_data_skip": True}, {"auto_find_batch_size": True}])
def test_refusal_comes_before_anything_is_written(setting: dict[str, Any], tmp_path: Path) -> None:
    """A real Trainer with a refused setting: typed refusal by resume_from() and by train(), the store left empty."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from asymcheck.hf import AsymCheckCallback

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    targs = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=2,
                              use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, **setting)
    data = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32}] * 4
    ck = tmp_path / "ck"
    callback = AsymCheckCallback(str(ck))
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[callback])
    named = next(iter(setting))
    with pytest.raises(UnsupportedTrainerConfigError, match=named):
        callback.resume_from(trainer)
    with pytest.raises(UnsupportedTrainerConfigError, match=named):
        trainer.train()
    assert trainer.state.global_step == 0
    assert not ck.exists() or not any(ck.iterdir())


def test_the_scripts_resume_from_checkpoint_flag_is_refused_not_ignored(tmp_path: Path) -> None:
    """run_clm.py's --resume_from_checkpoint beside the callback's resume: a typed refusal, before anything is written.

    Without a version in the store and with one: the flag would not be read either way once
    ``resume_from(trainer)`` replaces the script's ``train(resume_from_checkpoint=checkpoint)``.
    """
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from asymcheck.hf import AsymCheckCallback

    def trainer(ck: Path, **over: Any) -> tuple[Trainer, AsymCheckCallback]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
        targs = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=2,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, **over)
        data = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32}] * 4
        callback = AsymCheckCallback(str(ck))
        return Trainer(model=model, args=targs, train_dataset=data, callbacks=[callback]), callback

    flag = str(tmp_path / "hf" / "checkpoint-2")
    fresh = tmp_path / "fresh"
    t, callback = trainer(fresh, resume_from_checkpoint=flag)
    with pytest.raises(TrainerResumeError, match=r"resume_from_checkpoint='.*checkpoint-2'.*Drop --resume_from"):
        callback.resume_from(t)
    assert not fresh.exists() or not any(fresh.iterdir())
    held = tmp_path / "held"
    t, callback = trainer(held)
    t.train(resume_from_checkpoint=callback.resume_from(t))  # two versions
    before = sorted((p.name, p.stat().st_mtime) for p in held.glob("v*/*"))
    t, callback = trainer(held, resume_from_checkpoint=flag)
    with pytest.raises(TrainerResumeError, match="the callback resumes from its own store"):
        callback.resume_from(t)
    assert sorted((p.name, p.stat().st_mtime) for p in held.glob("v*/*")) == before and before
    assert t.state.global_step == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("peft", marks=marks_of("peft"))])
def test_peft_on_a_changed_base_is_refused_before_a_step(name: str, runs: dict[str, Any]) -> None:
    """The adapters' store resumed on a base with one frozen weight changed: StateMismatchError, nothing written."""
    output = runs["output"]
    assert runs["codes"].get("peft-resume") == 0, output[-4000:]
    assert runs["codes"].get("peft-base-changed") == 1, output[-4000:]
    assert "StateMismatchError: version 12 was trained on another frozen base" in output, output[-4000:]
    root: Path = runs["root"]
    assert not (root / "peft-changed" / "result.pt").exists()
    ck = root / "peft-ck"
    resumed_at = (root / "peft" / "result.pt").stat().st_mtime
    held = sorted(p.name for p in ck.iterdir() if not p.name.startswith("."))
    assert held == ["LATEST", "LAYOUT.json", *(f"v{s:012d}" for s in range(STEPS - 2, STEPS + 1))], held
    written = [f for f in (*ck.glob("LA*"), *ck.glob("v*/*")) if f.stat().st_mtime > resumed_at]
    assert not written, written  # no new, partial or moved version, no pointer rewritten


def test_peft_model_refused_under_deepspeed_only() -> None:
    model = torch.nn.Linear(2, 2)
    model.peft_config = {}  # type: ignore[assignment]
    for over in ({"deepspeed": {"zero_optimization": {"stage": 2}}},
                 {"world_size": 2, "deepspeed": {"zero_optimization": {"stage": 2}}}):
        with pytest.raises(UnsupportedTrainerConfigError, match="a PEFT model under DeepSpeed"):
            check_trainer(args(**over), model)  # type: ignore[arg-type]
    check_trainer(args(), model)  # type: ignore[arg-type]  # one process: the peft kill test
    check_trainer(args(world_size=2), model)  # type: ignore[arg-type]  # DDP: the peft-ddp-2ranks kill test


def test_peft_base_fingerprinted_once_per_train_and_the_log_filter_never_left(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The frozen base is hashed once per train(), fresh or resumed; the missing-keys filter goes on every path.

    resume_from() fingerprints the base to refuse another one; on_train_begin reuses that fingerprint instead of
    hashing the base again. The filter resume_from() puts on the Trainer's logger (its warning about the resume
    directory's empty weights) is removed when training begins, at the next resume_from(), and when a callback
    whose train() never ran is collected: a later real missing-keys warning is never hidden.
    """
    import gc
    import logging

    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import asymcheck.hf
    from asymcheck.hf import AsymCheckCallback

    hashed: list[int] = []
    real = asymcheck.hf.base_fingerprint

    def counted(model: torch.nn.Module) -> dict[str, Any]:
        hashed.append(1)
        return real(model)

    monkeypatch.setattr(asymcheck.hf, "base_fingerprint", counted)  # counts; the real hash runs
    ck = tmp_path / "ck"

    def trainer(steps: int) -> tuple[Trainer, AsymCheckCallback]:
        torch.manual_seed(0)
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
        model = peft.get_peft_model(gpt2, peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True,
                                                          task_type="CAUSAL_LM"))
        targs = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=steps, per_device_train_batch_size=2,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
        data = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32}] * 4
        callback = AsymCheckCallback(str(ck))
        return Trainer(model=model, args=targs, train_dataset=data, callbacks=[callback]), callback

    def quiet() -> list[logging.Filter]:
        return [f for f in logging.getLogger("transformers.trainer").filters
                if type(f).__name__ == "_QuietEmptyLoad"]

    t, callback = trainer(2)
    t.train(resume_from_checkpoint=callback.resume_from(t))  # fresh: hashed once, at on_train_begin
    assert len(hashed) == 1 and callback.resumed_step is None
    hashed.clear()
    t, callback = trainer(4)
    t.train(resume_from_checkpoint=callback.resume_from(t))  # resumed: resume_from()'s hash is reused
    assert callback.resumed_step == 2 and len(hashed) == 1
    assert not quiet()
    t, callback = trainer(6)
    assert callback.resume_from(t) is not None and len(quiet()) == 1  # while the Trainer loads the empty weights
    assert callback.resume_from(t) is not None and len(quiet()) == 1  # the next resume_from() dropped the first
    del t, callback  # train() never ran
    gc.collect()
    assert not quiet()


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("deepspeed", marks=marks_of("deepspeed"))])
def test_deepspeed_takes_the_retention_rules_to_its_multirank_store(name: str, runs: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    """Under DeepSpeed the callback's keep_every reaches the multi-rank store: its versions are pruned by it."""
    from asymcheck.hf import AsymCheckCallback
    from asymcheck.options import RetentionOptions
    from asymstore.multirank.globaldir import list_global_steps

    callback = AsymCheckCallback(str(tmp_path), keep_best=1, retention=RetentionOptions(keep_every=10))
    assert callback._deepspeed_root() == str(tmp_path) and callback.retention.keep_every == 10
    at, where = kill_point(name)
    context = f"case {name}, killed at global step {at} ({where}), HF_KILL_SEED={SEED}\n{runs['output'][-6000:]}"
    assert runs["codes"].get(f"{name}-resume") == 0, context
    kept = sorted({5, 10, STEPS - 2, STEPS - 1, STEPS})  # keep_every=5 beside keep_last=3, across the kill
    ck = runs["root"] / f"{name}-ck"
    assert list_global_steps(str(ck / "global")) == kept, context
    # shard versions: their manifests (a directory kept only for later shards' references is none)
    assert sorted(int(p.parent.name[1:]) for p in (ck / "rank-00000").glob("v*/MANIFEST.json")) == kept, context
    assert load(runs["root"] / name, "result.pt")["versions"] == kept, context


class _Tiny(torch.nn.Module):
    """A model the Trainer takes that Dynamo compiles whole (fullgraph): a linear layer and its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.lin(x) - labels) ** 2).mean()}


def test_compile_fullgraph_copies_at_the_step_and_resumes_exactly(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_compile=True with fullgraph (ACCELERATE_DYNAMO_USE_FULLGRAPH): only the optimizer's step hooks.

    No hook is registered inside the compiled model (fullgraph would raise at its graph break), the copy is
    at the step (partitioning "step"), a version every step; resumed from the store, the weights equal an
    uninterrupted compiled run's; another partitioning asked for is refused (InvalidOptionError) before a step.
    """
    from torch._dynamo.utils import counters
    from transformers import Trainer, TrainingArguments

    from asymcheck.errors import InvalidOptionError
    from asymcheck.hf import AsymCheckCallback
    from asymcheck.options import PartitionOptions
    from asymcheck.snapshot.hooks import StepHooks

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "1")
    g = torch.Generator().manual_seed(3)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(8, generator=g)} for _ in range(8)]

    def train(stop: int, ck: Path | None, **options: Any) -> tuple[Trainer, AsymCheckCallback | None]:
        torch.manual_seed(0)
        targs = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=6, per_device_train_batch_size=2,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                                  learning_rate=1e-2, torch_compile=True, torch_compile_backend="aot_eager")
        callback = AsymCheckCallback(str(ck), **options) if ck is not None else None
        trainer = Trainer(model=_Tiny(), args=targs, train_dataset=data,
                          callbacks=[callback] if callback is not None else None)
        seen: list[Any] = []

        class Look(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                seen.append(callback.checkpointer if callback is not None else None)
                control.should_training_stop = state.global_step >= stop  # an interrupted run

        trainer.add_callback(Look())
        trainer.train(resume_from_checkpoint=callback.resume_from(trainer) if callback is not None else None)
        if callback is not None:
            ckpt = seen[-1]
            assert ckpt.partitioning == "step" and isinstance(ckpt._hooks, StepHooks)
        assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
        return trainer, callback

    from transformers import TrainerCallback

    counters.clear()
    ref, _ = train(6, None)
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]  # compiled whole
    ck = tmp_path / "ck"
    train(3, ck)  # stopped after step 3 (the same schedule as the whole run's)
    got, callback = train(6, ck)
    assert callback is not None and callback.resumed_step == 3
    for name, value in ref.model.state_dict().items():
        assert torch.equal(value, got.model.state_dict()[name]), name
    asked = tmp_path / "asked"
    with pytest.raises(InvalidOptionError, match="partitioning='asymmetric' under torch_compile=True with fullgraph"):
        train(2, asked, partitions=PartitionOptions(partitioning="asymmetric"))
    assert not asked.exists() or not any(asked.glob("v*"))


def test_the_trainer_has_no_stateful_dataloader_setting() -> None:
    """transformers 5.24's Trainer offers no torchdata StatefulDataLoader: its AcceleratorConfig has no such field.

    ``accelerator_config={"use_stateful_dataloader": True}`` is a TypeError of TrainingArguments itself, and the
    Trainer builds Accelerate's DataLoaderConfiguration from four fields only. The support matrix's cell is "does
    not apply"; a transformers that adds the field fails here (and is refused as untested by the version check).
    """
    import transformers
    from transformers import TrainingArguments
    from transformers.trainer_pt_utils import AcceleratorConfig

    assert transformers.__version__.startswith("5.24.")
    assert "use_stateful_dataloader" not in {f.name for f in dataclasses.fields(AcceleratorConfig)}
    with pytest.raises(TypeError, match="use_stateful_dataloader"):
        TrainingArguments(output_dir="unused", use_cpu=True, report_to=[],
                          accelerator_config={"use_stateful_dataloader": True})


def test_iterable_dataset_resumes_in_its_first_pass_and_is_refused_after(tmp_path: Path) -> None:
    """A datasets.IterableDataset (4 shards, shuffled with a seed): the Trainer reads the trained batches through.

    Stopped at step 2 (inside the first pass of 4 batches) and resumed: every loss and the final weights
    equal the uninterrupted run's. Stopped at step 5 (the second pass began): resume_from() refuses with
    TrainerResumeError before anything is written (the Trainer would skip 5 batches of a fresh pass).
    """
    datasets = pytest.importorskip("datasets")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from asymcheck.hf import AsymCheckCallback

    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(5)).tolist()
    rows = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})

    def train(stop: int, ck: Path | None) -> tuple[Trainer, AsymCheckCallback | None]:
        torch.manual_seed(0)
        data = rows.to_iterable_dataset(num_shards=4).shuffle(seed=3, buffer_size=4).with_format("torch")
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
        targs = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=6, per_device_train_batch_size=2,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                                  logging_steps=1, learning_rate=1e-2)
        callback = AsymCheckCallback(str(ck)) if ck is not None else None

        class Stop(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                control.should_training_stop = state.global_step >= stop  # an interrupted run

        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Stop()])
        if callback is not None:
            trainer.add_callback(callback)
        trainer.train(resume_from_checkpoint=callback.resume_from(trainer) if callback is not None else None)
        return trainer, callback

    def losses(t: Trainer) -> list[tuple[int, float]]:
        return [(h["step"], h["loss"]) for h in t.state.log_history if "loss" in h]

    ref, _ = train(6, None)
    assert ref.state.epoch is not None and ref.state.epoch >= 1  # the run crossed a pass
    ck = tmp_path / "ck"
    train(2, ck)
    got, callback = train(6, ck)
    assert callback is not None and callback.resumed_step == 2
    assert losses(got) == losses(ref)
    assert all(torch.equal(v, got.model.state_dict()[k]) for k, v in ref.model.state_dict().items())
    late = tmp_path / "late"
    train(5, late)
    before = sorted((p.name, p.stat().st_mtime) for p in late.glob("v*/*"))
    with pytest.raises(TrainerResumeError, match="after its first pass ended"):
        train(6, late)
    assert sorted((p.name, p.stat().st_mtime) for p in late.glob("v*/*")) == before and before


def test_keep_best_follows_metric_for_best_model(tmp_path: Path) -> None:
    from asymcheck.hf import AsymCheckCallback
    from asymstore import KeepBest

    def rule(keep_best: Any, **over: Any) -> KeepBest | None:
        targs = SimpleNamespace(**{"metric_for_best_model": None, "greater_is_better": None, **over})
        return AsymCheckCallback(str(tmp_path), keep_best=keep_best)._keep_best(targs)  # type: ignore[arg-type]

    assert rule(None) is None
    assert rule(2, metric_for_best_model="loss", greater_is_better=False) == KeepBest("eval_loss", "min", 2)
    assert rule(1, metric_for_best_model="eval_accuracy", greater_is_better=True) == KeepBest("eval_accuracy", "max", 1)
    assert rule(1, metric_for_best_model="eval_loss") == KeepBest("eval_loss", "min", 1)  # the Trainer's default
    given = KeepBest("eval_bleu", "max", 3)
    assert rule(given, metric_for_best_model="loss") is given
    with pytest.raises(UnsupportedTrainerConfigError, match="metric_for_best_model"):
        rule(1)
    for bad in (0, True, "eval_loss"):
        with pytest.raises(ValueError, match="keep_best"):
            AsymCheckCallback(str(tmp_path), keep_best=bad)


def test_errors_are_typed() -> None:
    assert issubclass(TrainerResumeError, RuntimeError)
    from asymcheck.errors import AsymcheckError

    assert issubclass(TrainerResumeError, AsymcheckError) and issubclass(UnsupportedTrainerConfigError,
                                                                            AsymcheckError)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
