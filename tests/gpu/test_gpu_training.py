"""Training on CUDA: every committed version is exactly one step's state, and the demo resumes bit-exact.

On a GPU the snapshot is copied by a side CUDA stream into pinned host slots while the next iteration's
kernels run; the compute stream waits for those copies only before ``optimizer.step()`` overwrites the
tensors. These tests train on the device with that path, record the true state after every step (on the
device, at the step post-hook) and load every version back into fresh device tensors, bit for bit: a copy
that raced the optimizer, a host slot read before its copy landed, or a missing CUDA RNG state fails here.
Run with ``make gpu-test`` (skipped without CUDA).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from asymcheck import Checkpointer, DroppedVersionWarning
from asymstore import LocalTier, host_tier
from tests.support.asymcheck_train import (
    Recorder,
    check_version,
    data,
    finish_iteration,
    make_model,
    make_opt,
    open_ckpt,
    read_versions,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU machine)")]

REPO = Path(__file__).resolve().parents[2]
HIDDEN = 2048  # about 4.2 M parameters, 50 MB with AdamW: copies long enough to still run at the next step


def cuda_model(seed: int = 0) -> nn.Sequential:
    return make_model(seed, hidden=HIDDEN).cuda()


def ema_swap(model: nn.Module, ckpt: Checkpointer, it: int) -> None:
    """EMA weights into the model for an eval forward on the device, originals back, inside ``editing()``."""
    params = list(model.parameters())
    with ckpt.editing(), torch.no_grad():
        backup = [p.detach().clone() for p in params]
        for p in params:
            p.mul_(0.5)
        model.eval()
        model(data(it)[0].cuda())
        model.train()
        for p, b in zip(params, backup, strict=True):
            p.copy_(b)


def data_mul(model: nn.Module, ckpt: Checkpointer, it: int) -> None:
    """An edit the version counter cannot see: the version must be dropped or recopied, never mixed."""
    model[0].weight.data.mul_(0.99)


def train(root: Path, iterations: int, *, accum: int = 1, amp: bool = False, host: bool = False,
          edit: Any = None) -> tuple[Recorder, Checkpointer, dict[str, Any]]:
    model = cuda_model()
    opt, sched = make_opt(model)
    stateful: dict[str, Any] = {"sched": sched}
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**20, growth_interval=2) if amp else None
    if scaler is not None:
        stateful["scaler"] = scaler
    where: Any = [host_tier(256 << 20), LocalTier(root)] if host else root
    rec = Recorder()
    with open_ckpt(model, opt, where, stateful=stateful) as ckpt:
        rec.hook(model, opt, lambda: ckpt.step)
        for it in range(iterations):
            if edit is not None:
                edit(model, ckpt, it)
            for micro in range(accum):
                x, y = (t.cuda() for t in data(it, micro))
                ctx = torch.autocast("cuda", dtype=torch.float16) if amp else contextlib.nullcontext()
                with ctx:
                    out = model(x).float()
                loss = nn.functional.mse_loss(out, y) / accum
                (scaler.scale(loss) if scaler is not None else loss).backward()
            finish_iteration(opt, sched, scaler, rec, lambda: ckpt.step, stateful)
    return rec, ckpt, stateful


def fresh(amp: bool) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = cuda_model(seed=99)  # other values: the load must overwrite every byte
    opt, sched = make_opt(model)
    stateful: dict[str, Any] = {"sched": sched}
    if amp:
        stateful["scaler"] = torch.amp.GradScaler("cuda")
    return model, opt, stateful


CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "accumulation": {"accum": 3},
    "amp": {"amp": True},
    "host-then-disk": {"host": True},
    "ema-in-editing": {"edit": ema_swap},
}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("case", list(CASES))
def test_every_version_trained_on_cuda_is_one_steps_state(tmp_path: Path, case: str) -> None:
    opts = CASES[case]
    rec, ckpt, _ = train(tmp_path, 12, **opts)
    versions = read_versions(tmp_path)
    steps = ckpt.step
    if opts.get("amp"):
        assert steps < 12, "the scaler should have skipped some steps"
    assert sorted(versions) == list(range(1, steps + 1))
    for version in versions.values():
        check_version(version, rec, *fresh(bool(opts.get("amp"))))
    assert ckpt.plan is not None and ckpt.plan.warm
    assert ckpt.stats().commits_failed == 0


def test_an_edit_the_version_counter_misses_never_commits_a_mixed_version(tmp_path: Path) -> None:
    with pytest.warns(DroppedVersionWarning):
        rec, ckpt, _ = train(tmp_path, 10, edit=data_mul)
    stats = ckpt.stats()
    assert stats.versions_dropped == 1  # the first edit; the tensor is copied eagerly after it
    assert "model/0.weight" in stats.eager_tensors
    versions = read_versions(tmp_path)
    assert len(versions) == 10 - stats.versions_dropped
    for version in versions.values():
        check_version(version, rec, *fresh(False))


@pytest.mark.parametrize("tiers", ["local", "host,local"])
def test_demo_on_cuda_is_bit_exact_after_a_kill(tmp_path: Path, tiers: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "demo" / "run.py"), "--device", "cuda",
                           "--steps", "40", "--seed", "7", "--tiers", tiers, "--dir", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "bit-exact        OK" in proc.stdout
    versions = read_versions(tmp_path / "ckpt")
    newest = versions[max(versions)]
    assert any(k.endswith("rng/cuda/0") for k in newest.tensors), sorted(newest.tensors)[:20]  # dropout's generator
