"""Lightning strategies beyond one device and DDP: ``ModelParallelStrategy`` (FSDP2), and what stays refused.

``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` with ``fully_shard`` over
``device_mesh["data_parallel"]`` in ``configure_model`` (tests/procs/lightning_train.py ``--fsdp2``; 2
processes, gloo on the CPU, no shim: Lightning 2.6 runs this strategy on the CPU as it is): the
callback's Checkpointer takes each rank's local shards (the FSDP2 path of :class:`asymcheck.Checkpointer`,
a multi-rank root), every rank is SIGKILLed at a drawn step, the same command resumes, and every loss
after the resume and each rank's final shards equal an uninterrupted fit's bit for bit (gloo's FSDP2
reductions are reproducible across restarts here, so the reference is the uninterrupted fit).

Refused, typed, in ``on_fit_start`` before anything is written: ``FSDPStrategy`` (FSDP1),
``DeepSpeedStrategy``, ``ModelParallelStrategy`` with ``tensor_parallel_size > 1`` (a real fit on 2
processes). FSDP1 cannot fit on the CPU at all: Lightning 2.6's accelerator connector refuses
``type(strategy) is FSDPStrategy`` without CUDA, and past that (a subclass with no body,
``_CPUFSDPStrategy``, a test-only shim) torch 2.13's ``FullyShardedDataParallel`` raises "FSDP needs a
non-CPU accelerator device" while Lightning wraps the model, before any callback hook; likewise
``DeepSpeedStrategy.setup_environment`` requires CUDA. So those two are checked on a real ``Trainer`` built
with the strategy (not fitted): the callback's ``on_fit_start`` raises the typed error naming it and the
way on, and the directory stays empty.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from asymcheck.lightning import AsymCheckCallback, UnsupportedLightningConfigError
from asymstore.multirank.globaldir import list_global_steps
from tests.asymcheck.lightning.test_callback import DDP_STEPS, STEPS, _check_same, _Launch, _resumed_step, kill_point
from tests.support.launch import proc_argv, proc_env
from tests.support.mr_harness import free_ports

pytestmark = pytest.mark.slow


def test_fsdp2_kill_and_resume(tmp_path: Path) -> None:
    """ModelParallelStrategy (FSDP2) on 2 processes: killed on every rank, resumed bit-exact."""
    ref = _Launch(tmp_path / "ref", "--fsdp2", ddp=True)
    kill = kill_point("fsdp2_kill_and_resume", DDP_STEPS, first=3)
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _Launch(out, "--dir", str(root), "--kill", str(kill), "--fsdp2", ddp=True).wait(killed=(kill, signal.SIGKILL))
    _Launch(out, "--dir", str(root), "--fsdp2", ddp=True).wait()
    reference = ref.wait()
    _check_same(reference, out, 2)
    assert 1 <= _resumed_step(out) < kill
    for rank in (0, 1):  # FSDP2 really sharded: each rank holds half of the embedding's rows, and of its moments
        ran = json.loads((reference / f"config-rank{rank}.json").read_text())
        assert ran["strategy"] == "ModelParallelStrategy" and ran["world_size"] == 2, ran
        final = torch.load(reference / f"final-rank{rank}.pt")
        assert final["model/model.transformer.wte.weight"].shape == (128, 64)
        assert any(k.startswith("opt/") and v.shape == (128, 64) for k, v in final.items())
    assert list_global_steps(str(root / "global"))[-1] == DDP_STEPS


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.exhaustive)])
def test_deepspeed_kill_and_resume(tmp_path: Path, ranks: int) -> None:
    """DeepSpeedStrategy(stage=2) on DeepSpeed's CPU accelerator, routed to asymcheck.deepspeed: resumed bit-exact.

    The child's ``_CPUDeepSpeedStrategy`` is a test-only shim past Lightning's two CUDA checks, the same class in
    the reference run. One process in make test; 2 processes (every rank killed) exhaustive.
    """
    ddp = ranks == 2
    steps = DDP_STEPS if ddp else STEPS
    ref = _Launch(tmp_path / "ref", "--deepspeed", ddp=ddp)
    kill = kill_point(f"deepspeed_{ranks}_kill_and_resume", steps, first=3)
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _Launch(out, "--dir", str(root), "--kill", str(kill), "--deepspeed", ddp=ddp).wait(killed=(kill, signal.SIGKILL))
    _Launch(out, "--dir", str(root), "--deepspeed", ddp=ddp).wait()
    reference = ref.wait()
    _check_same(reference, out, ranks)
    assert 1 <= _resumed_step(out) < kill
    for rank in range(ranks):  # the configuration really ran: Lightning's DeepSpeed strategy on `ranks` processes
        ran = json.loads((reference / f"config-rank{rank}.json").read_text())
        assert ran["strategy"] == "_CPUDeepSpeedStrategy" and ran["world_size"] == ranks, ran
    assert list_global_steps(str(root / "global"))[-1] == steps  # the DeepSpeed adapter's multi-rank root


def test_deepspeed_resumed_from_first_version(tmp_path: Path) -> None:
    """DeepSpeedStrategy(stage=2), killed after 2 steps with version 1 committed: resumed from it, bit-exact.

    The adapter delivers ``engine.step()`` at the next forward, so ``on_train_batch_end`` used to see the
    Checkpointer's step one behind: the first batch's loop state went unrecorded and version 1 held an empty
    one; resumed from it (the newest committed when the kill came before version 2's commit, as on a loaded
    machine), the fit started again at epoch 0 batch 0 with the parameters of step 1. ``--flush`` commits
    version 1 before the kill, so this resume takes it whatever the load.
    """
    ref = _Launch(tmp_path / "ref", "--deepspeed")
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _Launch(out, "--dir", str(root), "--kill", "2", "--flush", "--deepspeed").wait(killed=(2, signal.SIGKILL))
    _Launch(out, "--dir", str(root), "--deepspeed").wait()
    assert _resumed_step(out) == 1
    _check_same(ref.wait(), out, 1)


def test_deepspeed_accumulating_refused(tmp_path: Path) -> None:
    """DeepSpeedStrategy with ``accumulate_grad_batches=2``: a real fit refused, typed, before anything is written.

    Under DeepSpeed Lightning calls ``engine.step()`` on every micro-batch and DeepSpeed decides the boundaries
    from its own micro-step count, across epoch ends; Lightning's ``global_step`` counts accumulations within each
    epoch (3 epochs of 7 batches: 10 engine steps, ``global_step`` 9). Killed after 5 steps and resumed (version 4),
    the fit diverged from the uninterrupted one in its second epoch, so the callback refuses it when ``fit`` starts.
    """
    root = tmp_path / "ckpt"
    p = subprocess.run(proc_argv("lightning_train", "--out", str(tmp_path / "out"), "--dir", str(root), "--deepspeed",
                                 "--accum", "2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=proc_env(OMP_NUM_THREADS="1"), timeout=180)
    assert p.returncode != 0, p.stdout[-3000:]
    assert "UnsupportedLightningConfigError" in p.stdout, p.stdout[-3000:]
    assert "DeepSpeedStrategy with accumulate_grad_batches=2 (DeepSpeed counts the micro-batches" in p.stdout, \
        p.stdout[-3000:]
    assert not (tmp_path / "out" / "losses-rank0.jsonl").exists()  # no training step ran
    assert not root.exists() or not any(root.rglob("v*"))


def test_tensor_parallel_refused(tmp_path: Path) -> None:
    """ModelParallelStrategy(tensor_parallel_size=2) is untested: refused on every rank, before anything is written."""
    port = free_ports(1)[0]
    root = tmp_path / "ckpt"
    procs = []
    for rank in (0, 1):
        env = proc_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                       RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
        argv = proc_argv("lightning_train", "--out", str(tmp_path / "out"), "--dir", str(root), "--ddp", "--fsdp2",
                         "--tensor-parallel")
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    for p in procs:
        log = p.communicate(timeout=180)[0]
        assert p.returncode != 0, log[-3000:]
        assert "UnsupportedLightningConfigError" in log and "tensor_parallel_size=2" in log, log[-3000:]
    assert not root.exists() or not any(root.rglob("v*"))


class _CPUFSDPStrategy(FSDPStrategy):
    """FSDPStrategy itself: a test-only shim (no body) past Lightning's CUDA check on ``type(strategy)``."""


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fsdp1_refused(tmp_path: Path) -> None:
    """FSDPStrategy (FSDP1): on_fit_start raises the typed error, naming it and the switch to FSDP2; nothing written."""
    found, way_on = "strategy=_CPUFSDPStrategy (FSDP1", "strategy=ModelParallelStrategy(data_parallel_size=N"
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=_CPUFSDPStrategy(), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = _Module()
    trainer.strategy.connect(module)
    callback = AsymCheckCallback(tmp_path / "ckpt")
    with pytest.raises(UnsupportedLightningConfigError, match="strategy=") as info:
        callback.on_fit_start(trainer, module)
    assert found in str(info.value) and way_on in str(info.value), str(info.value)
    assert callback.checkpointer is None
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_ddp_spawn_refused(tmp_path: Path, strategy: str) -> None:
    """``ddp_spawn``/``ddp_fork`` (a DDPStrategy that starts its own processes): on_fit_start refuses it, typed."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = _Module()
    trainer.strategy.connect(module)
    callback = AsymCheckCallback(tmp_path / "ckpt")
    with pytest.raises(UnsupportedLightningConfigError, match=r"DDPStrategy\(start_method='(spawn|fork)'\)") as info:
        callback.on_fit_start(trainer, module)
    assert "strategy='ddp'" in str(info.value), str(info.value)
    assert callback.checkpointer is None
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_deepspeed_untested_refused(tmp_path: Path) -> None:
    """DeepSpeed with ZeRO-3, mixed precision or manual optimization: refused, typed, each named; nothing written."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(stage=3), precision="bf16-mixed",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = _Module()
    module.automatic_optimization = False
    trainer.strategy.connect(module)
    callback = AsymCheckCallback(tmp_path / "ckpt")
    with pytest.raises(UnsupportedLightningConfigError) as info:
        callback.on_fit_start(trainer, module)
    for found in ("DeepSpeedStrategy(stage=3) (untested", "DeepSpeedStrategy with precision=bf16-mixed (",
                  "DeepSpeedStrategy with manual optimization (untested"):
        assert found in str(info.value), str(info.value)
    assert callback.checkpointer is None
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
