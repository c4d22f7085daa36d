"""Lightning: ``asymcheck.lightning.AsymCheckCallback`` on a real ``Trainer.fit``, killed by SIGKILL, resumed bit-exact.

A child (tests/procs/lightning_train.py) fits a small GPT-2 on CPU with a version every optimizer
step, dies by SIGKILL inside ``training_step`` at a random step, and a fresh child resumes through
the callback (``on_fit_start``) and fits to the end. Every loss either child logged (training and
validation) and the final parameters, optimizer state, scheduler, RNG state, global step and epoch
must equal those of an uninterrupted fit without the callback, byte for byte; one process, and
DDP on 2 processes (gloo, started here with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the
environment, ``strategy="ddp"``). The same under ``bf16-mixed`` and ``16-mixed`` (a GradScaler that skips
steps; on CPU through the plugin ``precision="16-mixed"`` builds on a GPU, on CUDA as a ``gpu`` test), and
under manual optimization with one optimizer and a GAN-style module with two (tests/procs/lightning_manual.py),
in one process and under DDP; each checks that the second child resumed. The one-process run also
keeps the best version by ``monitor="val_loss"`` beside ``keep_last=2``. Refused settings raise before anything is
hooked (an untested precision, ``fit(ckpt_path=...)``), and a ``ResumableLoader`` continues a pass in its
order without reading the batches already trained. Exhaustive: kills at fixed steps (before any
version, at epoch ends, at the end), under ``accumulate_grad_batches=2``; ``make test`` runs one case of the
accumulating kill and the SIGTERM path. A killed child must have died by that signal at the drawn step (its
return code and the marker it writes just before). ``LIGHTNING_KILL_SEED`` replays the random kill points.
Under DDP the root holds the replicated state in slices (each rank about half of it: the callback tells the
Checkpointer the strategy is DDP).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from asymcheck.lightning import AsymCheckCallback, ResumableLoader, UnsupportedLightningConfigError
from asymstore import AsymStore, LocalTier
from asymstore.multirank.globaldir import list_global_steps
from tests.support.launch import proc_argv, proc_env
from tests.support.mr_harness import free_ports
from tests.support.replicas import assert_sliced, nbytes

pytestmark = pytest.mark.slow

STEPS = 21  # 3 epochs of 7 batches in one process
DDP_STEPS = 12  # 3 epochs of 4 batches per process under 2
SEED = int(os.environ.get("LIGHTNING_KILL_SEED", random.randrange(1 << 30)))


def kill_point(name: str, steps: int, first: int = 2) -> int:
    """The drawn kill step of test ``name`` (``LIGHTNING_KILL_SEED`` replays it); printed for a failure report."""
    kill = random.Random(f"{SEED}-{name}").randint(first, steps - 1)
    print(f"{name}: kill after {kill} optimizer steps (LIGHTNING_KILL_SEED={SEED})")
    return kill


class _Launch:
    """One child per rank of a fit, started now; :meth:`wait` checks how they ended."""

    def __init__(self, out: Path, *args: str, ddp: bool = False, proc: str = "lightning_train") -> None:
        self.out = out
        self.done = False
        port = free_ports(1)[0]
        self.procs = []
        for rank in range(2 if ddp else 1):
            env = proc_env(OMP_NUM_THREADS="1")
            if ddp:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                           LOCAL_RANK=str(rank), NODE_RANK="0")
            argv = proc_argv(proc, "--out", str(out), *args, *(["--ddp"] if ddp else []))
            self.procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               env=env))

    def wait(self, *, killed: tuple[int, signal.Signals] | None = None) -> Path:
        """Wait for every rank; each must exit 0, or with ``killed=(step, signal)`` die by it at that step."""
        if self.done:
            return self.out
        self.done = True
        logs = []
        for p in self.procs:
            try:
                logs.append(p.communicate(timeout=180)[0])
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                raise
        for rank, (p, log) in enumerate(zip(self.procs, logs, strict=True)):
            marker = self.out / f"killed-rank{rank}.json"
            if killed is None:
                assert p.returncode == 0, f"rank {rank}: rc {p.returncode}\n{log[-3000:]}"
                continue
            step, sig = killed
            # SIGTERM: Lightning's handler ends the fit by its SIGTERMException, a SystemExit with status 0
            rc = 0 if sig == signal.SIGTERM else -sig
            assert p.returncode == rc, f"rank {rank}: rc {p.returncode}, not {rc} ({sig.name})\n{log[-3000:]}"
            assert sig != signal.SIGTERM or "Received SIGTERM" in log, log[-3000:]
            assert marker.exists(), f"rank {rank} died without reaching the kill point\n{log[-3000:]}"
            assert json.loads(marker.read_text()) == {"step": step, "signal": sig.name}, marker.read_text()
            marker.unlink()  # the resumed run must not find it
        return self.out


def _run(out: Path, *args: str, ddp: bool = False, killed: tuple[int, signal.Signals] | None = None) -> None:
    _Launch(out, *args, ddp=ddp).wait(killed=killed)


def _losses(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[row["key"]] = row["loss"]  # a resumed step logs again: the last value is the resumed run's
    return out


def _all_losses(path: Path) -> list[tuple[str, str]]:
    return [(r["key"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


def _check_same(ref: Path, got: Path, world: int) -> None:
    for rank in range(world):
        want = _losses(ref / f"losses-rank{rank}.jsonl")
        for key, loss in _all_losses(got / f"losses-rank{rank}.jsonl"):  # the killed child's too
            assert want[key] == loss, f"rank {rank}, {key}: {loss} != {want[key]}"
        assert set(_losses(got / f"losses-rank{rank}.jsonl")) == set(want)
        a = torch.load(ref / f"final-rank{rank}.pt")
        b = torch.load(got / f"final-rank{rank}.pt")
        assert set(a) == set(b)
        diff = [k for k in a if not torch.equal(a[k], b[k])]
        assert not diff, f"rank {rank}: final state differs in {diff[:5]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> _Launch:
    """The uninterrupted fit without the callback, started when first asked for (it runs beside the test's)."""
    return _Launch(tmp_path_factory.mktemp("lightning-ref"))


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> _Launch:
    return _Launch(tmp_path_factory.mktemp("lightning-ddp-ref"), ddp=True)


def _versions(root: Path) -> dict[str, list[int]]:
    async def go() -> dict[str, list[int]]:
        async with AsymStore([LocalTier(root)]) as store:
            return store.versions()
    return asyncio.run(go())


def _kill_resume(ref_run: _Launch, tmp_path: Path, kill: int) -> None:
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _run(out, "--dir", str(root), "--kill", str(kill), killed=(kill, signal.SIGKILL))
    assert (out / "losses-rank0.jsonl").exists() and not (out / "final-rank0.pt").exists()
    _run(out, "--dir", str(root))
    reference = ref_run.wait()
    _check_same(reference, out, 1)
    # retention: the newest 2 plus the best by val_loss (validated after steps 7, 14, 21)
    ref = _losses(reference / "losses-rank0.jsonl")
    val = [(torch.tensor([float.fromhex(ref[f"val:{e}:{b}"]) for b in (0, 1)]).mean().item(), 7 * (e + 1))
           for e in range(3)]
    best = min(val)[1]
    assert set(next(iter(_versions(root).values()))) == {STEPS - 1, STEPS, best}


def test_kill_and_resume(reference: _Launch, tmp_path: Path) -> None:
    _kill_resume(reference, tmp_path, kill_point("kill_and_resume", STEPS))


def test_sigterm_and_resume(reference: _Launch, tmp_path: Path) -> None:
    """SIGTERM (Lightning's handler and the Checkpointer's, composed): the newest step is committed, then resumed."""
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _run(out, "--dir", str(root), "--kill", "10", "--sigterm", killed=(10, signal.SIGTERM))
    assert not (out / "final-rank0.pt").exists()
    assert 10 in next(iter(_versions(root).values()))  # the step in flight when the signal came
    _run(out, "--dir", str(root))
    _check_same(reference.wait(), out, 1)


# 4 optimizer steps per epoch: 3 of 2 batches, 1 of 1; make test runs the first
@pytest.mark.parametrize("kill", [3, pytest.param(4, marks=pytest.mark.exhaustive),
                                  pytest.param(7, marks=pytest.mark.exhaustive)])
def test_kill_and_resume_accumulating(tmp_path: Path, kill: int) -> None:
    """``accumulate_grad_batches=2``: a version per optimizer step, taken at the first micro-batch after it."""
    ref = _Launch(tmp_path / "ref", "--accum", "2")
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _run(out, "--dir", str(root), "--kill", str(kill), "--accum", "2", killed=(kill, signal.SIGKILL))
    _run(out, "--dir", str(root), "--accum", "2")
    _check_same(ref.wait(), out, 1)


@pytest.mark.exhaustive
@pytest.mark.parametrize("kill", [1, 6, 8, 14, 20])  # no version yet, epoch boundaries, the last steps
def test_kill_and_resume_at(reference: _Launch, tmp_path: Path, kill: int) -> None:
    _kill_resume(reference, tmp_path, kill)


def test_ddp_kill_and_resume(ddp_reference: _Launch, tmp_path: Path) -> None:
    kill = kill_point("ddp_kill_and_resume", DDP_STEPS)
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _run(out, "--dir", str(root), "--kill", str(kill), ddp=True, killed=(kill, signal.SIGKILL))
    _run(out, "--dir", str(root), ddp=True)
    _check_same(ddp_reference.wait(), out, 2)
    assert (root / "global").is_dir()  # a multi-rank store: rank shards and global manifests
    # retention on the global versions: the newest 2 plus the best by val_loss (validated after 4, 8, 12)
    kept = list_global_steps(str(root / "global"))
    assert kept[-2:] == [DDP_STEPS - 1, DDP_STEPS] and len(kept) <= 3 and set(kept[:-2]) <= {4, 8}, kept
    for rank in (0, 1):
        # shard versions: their manifests (a directory kept only for later shards' references is none)
        assert sorted(int(p.parent.name[1:]) for p in (root / f"rank-{rank:05d}").glob("v*/MANIFEST.json")) == kept
    # the callback told the Checkpointer the strategy is DDP: the replicated state is written in slices
    final = torch.load(out / "final-rank0.pt")
    assert_sliced(root, 2, nbytes(v for k, v in final.items() if k.startswith(("model/", "opt/"))))


@pytest.mark.exhaustive  # ~19 s; bf16-mixed is killed in one process and DDP in fp32 in make test
def test_ddp_bf16_kill_and_resume(tmp_path: Path) -> None:
    """``bf16-mixed`` under DDP on 2 processes: every rank killed at a drawn step, resumed bit-exact."""
    ref = _Launch(tmp_path / "ref", "--precision", "bf16-mixed", ddp=True)
    kill = kill_point("ddp_bf16_kill_and_resume", DDP_STEPS, first=3)
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _Launch(out, "--dir", str(root), "--kill", str(kill), "--precision", "bf16-mixed", ddp=True).wait(
        killed=(kill, signal.SIGKILL))
    _Launch(out, "--dir", str(root), "--precision", "bf16-mixed", ddp=True).wait()
    reference = ref.wait()
    _check_same(reference, out, 2)
    assert 1 <= _resumed_step(out) < kill
    assert list_global_steps(str(root / "global"))[-1] == DDP_STEPS
    for rank in (0, 1):  # the configuration really ran: DDP on 2 processes, bf16 autocast in training_step
        ran = json.loads((reference / f"config-rank{rank}.json").read_text())
        assert ran == {"strategy": "DDPStrategy", "world_size": 2, "precision": "bf16-mixed",
                       "autocast": "torch.bfloat16"}, ran


def test_ddp_fp16_kill_and_resume(tmp_path: Path) -> None:
    """``16-mixed`` under DDP on 2 processes, with skipped steps: every rank killed at a drawn step, resumed bit-exact.

    On CPU the child passes the plugin ``precision="16-mixed"`` builds on a GPU with a CPU GradScaler
    (``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2**24, growth_interval=4))``,
    a test-only stand-in for the CUDA scaler, the same in the reference run): it skips 7 of the 12 steps, the
    first ones, so a version exists from step 8 on and the kill is drawn from 10. Each rank's version holds the
    scaler's scale and growth tracker; a skipped step is no version.
    """
    args = ("--precision", "16-mixed")
    ref = _Launch(tmp_path / "ref", *args, ddp=True)
    kill = kill_point("ddp_fp16_kill_and_resume", DDP_STEPS, first=10)
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _Launch(out, "--dir", str(root), "--kill", str(kill), *args, ddp=True).wait(killed=(kill, signal.SIGKILL))
    _Launch(out, "--dir", str(root), *args, ddp=True).wait()
    reference = ref.wait()
    _check_same(reference, out, 2)
    assert 1 <= _resumed_step(out) < kill
    for rank in (0, 1):  # the configuration really ran: DDP on 2 processes, fp16 autocast, a scaler that skipped
        ran = json.loads((reference / f"config-rank{rank}.json").read_text())
        assert ran == {"strategy": "DDPStrategy", "world_size": 2, "precision": "16-mixed",
                       "autocast": "torch.float16"}, ran
        final = torch.load(reference / f"final-rank{rank}.pt")
        optimizer_steps = int(final["opt/0/step"].flatten()[0])  # AdamW's own count: the steps not skipped
        assert "scaler/scale" in final and 1 <= optimizer_steps < int(final["global_step"]) == DDP_STEPS, final
    assert list_global_steps(str(root / "global"))[-1] == optimizer_steps  # only completed steps are versions


class _Manual(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        loss = self.layer(batch[0]).sum()
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)


def _resumed_step(out: Path) -> int:
    """The version the resumed child loaded (it must have resumed: a fresh start would also match)."""
    marker = out / "resumed-rank0.json"
    assert marker.exists(), "the second child started fresh instead of resuming"
    step: int = json.loads(marker.read_text())["step"]
    return step


# 16-mixed: fp16 autocast and a GradScaler (on CPU the plugin precision="16-mixed" builds on a GPU; see the child);
# 16-mixed-gpu: precision="16-mixed" on CUDA as users write it (make gpu-test)
@pytest.mark.parametrize("precision", [
    "bf16-mixed", "16-mixed",
    pytest.param("16-mixed-gpu", marks=[pytest.mark.gpu,
                                        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_mixed_precision_kill_and_resume(tmp_path: Path, precision: str) -> None:
    """Mixed precision: every loss after the resume and the final state (the scaler's too) equal an uninterrupted fit.

    Under 16-mixed on CPU the scaler starts high and skips 9 of the 21 steps: a skipped step is no
    version, the scaler's scale and growth tracker are in each version.
    """
    args = ("--precision", "16-mixed", "--gpu") if precision == "16-mixed-gpu" else ("--precision", precision)
    ref = _Launch(tmp_path / "ref", *args)
    kill = kill_point(f"mixed_precision_{precision}", STEPS, first=10)
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _run(out, "--dir", str(root), "--kill", str(kill), *args, killed=(kill, signal.SIGKILL))
    _run(out, "--dir", str(root), *args)
    reference = ref.wait()
    _check_same(reference, out, 1)
    final = torch.load(reference / "final-rank0.pt")
    optimizer_steps = int(final["opt/0/step"].flatten()[0])  # AdamW's own count: the steps not skipped
    versions = sorted(next(iter(_versions(root).values())))
    assert 1 <= _resumed_step(out) < kill
    if precision == "16-mixed":  # the scaler skipped steps, and only completed steps became versions
        assert "scaler/scale" in final and optimizer_steps < int(final["global_step"]), final["global_step"]
        assert versions[-1] == optimizer_steps
    elif precision == "16-mixed-gpu":  # the default scaler may skip no step here
        assert "scaler/scale" in final and versions[-1] == optimizer_steps
    else:
        assert "scaler/scale" not in final and optimizer_steps == STEPS and versions[-1] == STEPS


@pytest.mark.parametrize(("optimizers", "precision"), [
    # the GAN's 32-true case in make test-all (CI budget): its 16-mixed case runs the same two optimizers
    (1, "32-true"), pytest.param(2, "32-true", marks=pytest.mark.exhaustive), (2, "16-mixed")])
def test_manual_optimization_kill_and_resume(tmp_path: Path, optimizers: int, precision: str) -> None:
    """Manual optimization with one optimizer (and its scheduler), and a GAN-style module with two.

    A version is one ``training_step`` after all its optimizer steps (the GAN's generator steps every
    other batch): every loss after the resume and the final parameters, every optimizer's state, the
    scheduler and the RNG equal an uninterrupted fit's. Also the GAN under 16-mixed (one GradScaler that
    skips steps of either optimizer; its state is in the version).
    """
    args = ("--optimizers", str(optimizers), "--precision", precision)
    ref = _Launch(tmp_path / "ref", *args, proc="lightning_manual")
    # under 16-mixed the scaler, started at 2**24, skips the first steps: a kill before the first completed step
    # leaves no version to resume (LIGHTNING_KILL_SEED=459376108 drew 5); from 10 on there is one
    kill = kill_point(f"manual_{optimizers}_{precision}", STEPS, first=10 if precision == "16-mixed" else 3)
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _Launch(out, "--dir", str(root), "--kill", str(kill), *args, proc="lightning_manual").wait(
        killed=(kill, signal.SIGKILL))
    _Launch(out, "--dir", str(root), *args, proc="lightning_manual").wait()
    _check_same(ref.wait(), out, 1)
    assert 1 <= _resumed_step(out) < kill
    last = sorted(next(iter(_versions(root).values())))[-1]
    if precision == "16-mixed":  # a training_step whose every step the scaler skipped is no version
        assert 1 <= last < STEPS, last
    else:
        assert last == STEPS  # a version per training_step


@pytest.mark.parametrize("optimizers", [pytest.param(1, marks=pytest.mark.exhaustive), 2])  # make test: the GAN
def test_manual_optimization_ddp_kill_and_resume(tmp_path: Path, optimizers: int) -> None:
    """Manual optimization under DDP on 2 processes (every rank killed at the same drawn training_step)."""
    args = ("--optimizers", str(optimizers))
    ref = _Launch(tmp_path / "ref", *args, ddp=True, proc="lightning_manual")
    kill = kill_point(f"manual_ddp_{optimizers}", DDP_STEPS, first=3)
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _Launch(out, "--dir", str(root), "--kill", str(kill), *args, ddp=True, proc="lightning_manual").wait(
        killed=(kill, signal.SIGKILL))
    _Launch(out, "--dir", str(root), *args, ddp=True, proc="lightning_manual").wait()
    _check_same(ref.wait(), out, 2)
    assert 1 <= _resumed_step(out) < kill
    assert list_global_steps(str(root / "global"))[-1] == DDP_STEPS


def test_untested_precision_refused(tmp_path: Path) -> None:
    """``precision="bf16-true"`` (bf16 parameters) is untested: refused, typed, before anything is written."""
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, precision="bf16-true",
                         callbacks=[AsymCheckCallback(tmp_path / "ckpt")])
    with pytest.raises(UnsupportedLightningConfigError, match="precision=bf16-true"):
        trainer.fit(_Manual())
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("v*"))


class _NoOptimizer(_Manual):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return None  # Lightning warns and steps a stand-in optimizer


def test_no_optimizer_refused(tmp_path: Path) -> None:
    """``configure_optimizers`` returning None: refused, typed, before anything is written (it used to fail mid-fit)."""
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[AsymCheckCallback(tmp_path / "ckpt")])
    with pytest.raises(UnsupportedLightningConfigError, match="configure_optimizers returned no optimizer"):
        trainer.fit(_NoOptimizer())
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("v*"))


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)


def test_ckpt_path_refused(tmp_path: Path) -> None:
    quiet: dict[str, Any] = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                             "enable_progress_bar": False, "enable_model_summary": False}
    trainer = pl.Trainer(max_steps=2, **quiet)
    trainer.fit(_Tiny())
    trainer.save_checkpoint(tmp_path / "lightning.ckpt")
    trainer = pl.Trainer(max_steps=4, callbacks=[AsymCheckCallback(tmp_path / "ckpt")], **quiet)
    with pytest.raises(UnsupportedLightningConfigError, match="ckpt_path="):
        trainer.fit(_Tiny(), ckpt_path=tmp_path / "lightning.ckpt")


class _Counting(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.read: list[int] = []

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        self.read.append(i)
        return torch.tensor([i])


def test_resumable_loader_skips_without_reading() -> None:
    data = _Counting()
    loader = ResumableLoader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    torch.manual_seed(1)
    whole = [b.flatten().tolist() for b in loader]
    loader.batches = 3  # what AsymCheckCallback records after the third batch of the pass
    state = loader.state_dict()
    after = torch.get_rng_state()

    fresh = _Counting()
    resumed = ResumableLoader(torch.utils.data.DataLoader(fresh, batch_size=4, shuffle=True))
    resumed.load_state_dict(state)
    torch.manual_seed(99)  # whatever the global RNG is now, the continued pass has the interrupted one's order
    outer = torch.get_rng_state()
    rest = [b.flatten().tolist() for b in resumed]
    assert rest == whole[3:]
    assert sorted(fresh.read) == sorted(i for b in whole[3:] for i in b)  # the 3 trained batches were not read
    assert torch.equal(torch.get_rng_state(), outer)  # the continued pass leaves the global RNG as it found it
    resumed.resumed()
    assert len(list(resumed)) == 10  # the passes after it are the loader's own
    assert not torch.equal(after, outer)
