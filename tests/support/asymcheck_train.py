"""Small deterministic training loops shared by the in-process asymcheck tests."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asymcheck import Checkpointer
from asymcheck.options import PartitionOptions, RetentionOptions
from asymcheck.state.trainstate import TrainingState
from asymstore import AsymStore, LocalTier
from asymstore.format.names import version_dirname
from asymstore.values import Checkpoint


def make_model(seed: int = 0, hidden: int = 64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, hidden),
                         nn.BatchNorm1d(hidden), nn.GELU(), nn.Linear(hidden, 16))


def make_opt(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def data(it: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(it * 100 + micro)
    x = torch.randn(8, 16, generator=g)
    return x, x.roll(1, 1)


def tensors_of(obj: Any) -> Any:
    """A deep copy of a (nested) state dict with every tensor cloned."""
    return copy.deepcopy(obj)


def equal_state(a: Any, b: Any, path: str = "") -> None:
    """Assert two nested state dicts are equal, tensors bit for bit (tuples and lists alike)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert set(a) == set(b), f"{path}: {sorted(a)} != {sorted(b)}"
        for k in a:
            equal_state(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            equal_state(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def read_versions(root: Path) -> dict[int, Checkpoint]:
    async def read() -> dict[int, Checkpoint]:
        async with AsymStore([LocalTier(root)], keep_last=None) as store:
            steps = store.versions()[store.tiers[0].name]
            return {s: await store.restore(s) for s in steps}

    return asyncio.run(read())


@dataclass
class Recorder:
    """The state of every step as the training loop saw it (the ground truth for snapshots)."""

    after_step: dict[int, dict[str, Any]] = field(default_factory=dict)  # at the step post-hook
    before_next: dict[int, dict[str, Any]] = field(default_factory=dict)  # at the end of the loop body
    added: dict[str, torch.Tensor] = field(default_factory=dict)  # parameters added mid-run

    def hook(self, model: nn.Module, opt: torch.optim.Optimizer, steps: Callable[[], int]) -> None:
        def post(o: Any, a: Any, k: Any) -> None:
            self.after_step[steps()] = {"model": tensors_of(model.state_dict()),
                                        "optim": tensors_of(opt.state_dict()["state"])}
        opt.register_step_post_hook(post)

    def end_of_body(self, step: int, opt: torch.optim.Optimizer, stateful: dict[str, Any]) -> None:
        if step and step not in self.before_next:  # the first iteration after the step (skips leave it)
            self.before_next[step] = {"param_groups": tensors_of(opt.state_dict()["param_groups"]),
                                      **{k: tensors_of(v.state_dict()) for k, v in stateful.items()}}


def finish_iteration(opt: torch.optim.Optimizer, sched: Any, scaler: Any, rec: Recorder,
                     steps: Callable[[], int], stateful: dict[str, Any]) -> None:
    """The tail of a recorded loop body: the optimizer step (through ``scaler`` when given), the scheduler,
    ``zero_grad(set_to_none=True)``, and the recorder's note of what the step left."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    rec.end_of_body(steps(), opt, stateful)


def check_version(ckpt: Checkpoint, rec: Recorder, model: nn.Module, opt: torch.optim.Optimizer,
                  stateful: dict[str, Any]) -> None:
    """Load a version into fresh objects and compare with what the loop recorded for that step."""
    TrainingState(model, opt, stateful).load(ckpt.tensors, ckpt.meta)
    want = rec.after_step[ckpt.step]
    equal_state(want["model"], model.state_dict(), "model")
    equal_state(want["optim"], opt.state_dict()["state"], "optim")
    small = rec.before_next[ckpt.step]
    equal_state(small["param_groups"], opt.state_dict()["param_groups"], "param_groups")
    for k, obj in stateful.items():
        equal_state(small[k], obj.state_dict(), k)


FAST_PARTITIONS = PartitionOptions(warmup=2, min_partition_bytes=1024)
"""Partitions the tests' small models can use: sized after 2 iterations, partitions of 1 KiB or more."""

KEEP_ALL = RetentionOptions(keep_last=None)
"""Retention that keeps every version (the tests read them all back)."""


def fast_partitions(**changes: Any) -> PartitionOptions:
    """:data:`FAST_PARTITIONS` with ``changes`` (``fast_partitions(partitioning="uniform")``)."""
    return dataclasses.replace(FAST_PARTITIONS, **changes)


def open_ckpt(model: nn.Module, opt: torch.optim.Optimizer, where: Any, **kwargs: Any) -> Checkpointer:
    """A Checkpointer with test-friendly defaults over ``where`` (a directory, tiers or a store).

    Unless given, ``partitions=`` is :data:`FAST_PARTITIONS` and ``retention=`` :data:`KEEP_ALL`
    (the typed option groups; pass ``fast_partitions(...)`` to change one partition option).
    """
    kwargs.setdefault("partitions", FAST_PARTITIONS)
    kwargs.setdefault("retention", KEEP_ALL)
    return Checkpointer(model, opt, where, **kwargs)


def step_once(model: nn.Module, opt: torch.optim.Optimizer, it: int, sched: Any = None) -> None:
    x, y = data(it)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)


def train(root: Path | str | list[Any], steps: int, **kwargs: Any) -> tuple[nn.Module, Any, dict[int, Any]]:
    model = make_model()
    opt, sched = make_opt(model)
    states: dict[int, Any] = {}
    with open_ckpt(model, opt, root, stateful={"sched": sched}, **kwargs) as ckpt:
        for it in range(steps):
            step_once(model, opt, it, sched)
            states[ckpt.step] = tensors_of(model.state_dict())
    return model, opt, states


def corrupt_newest_segment(root: Path, step: int) -> None:
    vdir = root / version_dirname(step)
    segment = sorted(p for p in vdir.iterdir() if p.name.startswith("seg-"))[0]
    with open(segment, "r+b") as f:
        f.seek(os.path.getsize(segment) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
