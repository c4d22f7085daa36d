"""Frozen parameters known unchanged (asymcheck.snapshot.frozen): copied to host once, never wrong.

A LoRA-style own loop (a frozen base, a trainable low-rank adapter, an optimizer over the adapter
only) with a version every step: the base is copied from its device once (counted by the copy
engine's ``copy_bytes``) and every version still restores it bit-exact; an in-place edit of a
frozen parameter between steps (under ``torch.no_grad()``, through the version counter, or
through ``p.data``, which only the byte sample sees) reaches every later version; a tier that
cannot reference still gets the full bytes. The SIGKILL + resume case: tests/asymcheck/test_kill_frozen.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from asymcheck import Checkpointer
from asymcheck.options import CommitOptions
from asymstore import AsymStore, LocalTier, host_tier
from asymstore.values import Checkpoint
from tests.support.asymcheck_train import open_ckpt, read_versions

WIDTH = 160  # the frozen base: two 160 x 160 float32 weights of 100 KiB each (over 64 KiB: known), plus biases


class LoRA(nn.Module):
    """A frozen base MLP with a trainable low-rank adapter on its middle layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(4, WIDTH) * 0.01)
        self.b = nn.Parameter(torch.zeros(WIDTH, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base[1](self.base[0](x))
        out: torch.Tensor = self.base[2](h) + h @ self.a.t() @ self.b.t()
        return out


KNOWN = CommitOptions(frozen="known")
"""Frozen parameters taken as known unchanged (the default, ``"copy"``, copies them at every version)."""

def base_bytes(model: LoRA) -> int:
    return sum(p.numel() * p.element_size() for p in model.base.parameters() if p.numel() * 4 > 64 << 10)


def copied_once(model: LoRA, ckpt: Checkpointer, versions: int) -> None:
    """The base was copied from its device once: the rest is the adapter, its AdamW moments and the biases."""
    per_version = sum(p.numel() * p.element_size() for p in (model.a, model.b)) * 3 + 4 * WIDTH * 4 + 256
    assert ckpt.stats().copy_bytes <= base_bytes(model) + versions * per_version, ckpt.stats().copy_bytes


def run(where: object, steps: int, edit: Callable[[LoRA, int], None] | None = None,
        **kwargs: object) -> tuple[LoRA, Checkpointer, dict[int, torch.Tensor]]:
    """Train ``steps`` steps with a version each; return the model, the closed Checkpointer and the
    middle base weight as the loop saw it when each step returned."""
    model = LoRA()
    opt = torch.optim.AdamW([model.a, model.b], lr=1e-2)
    kwargs.setdefault("commits", KNOWN)
    ckpt = open_ckpt(model, opt, where, **kwargs)
    seen: dict[int, torch.Tensor] = {}
    for it in range(steps):
        if edit is not None:
            edit(model, it)
        g = torch.Generator().manual_seed(it)
        x = torch.randn(8, WIDTH, generator=g)
        nn.functional.mse_loss(model(x), x.flip(1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen[ckpt.step] = model.base[2].weight.detach().clone()
    ckpt.close()
    return model, ckpt, seen


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def check_versions(versions: dict[int, Checkpoint], seen: dict[int, torch.Tensor], model: LoRA) -> None:
    for step, ck in versions.items():
        assert torch.equal(bits(ck.tensors["model/base.2.weight"]), bits(seen[step])), step
        assert torch.equal(bits(ck.tensors["model/base.0.weight"]), bits(model.base[0].weight.detach())), step


def test_frozen_base_is_copied_to_host_once_and_referenced(tmp_path: Path) -> None:
    model, ckpt, seen = run(tmp_path, 12)
    stats = ckpt.stats()
    assert stats.versions_committed == 12 and stats.versions_dropped == 0
    frozen = base_bytes(model)
    copied_once(model, ckpt, 12)
    versions = read_versions(tmp_path)
    assert sorted(versions) == list(range(1, 13))
    check_versions(versions, seen, model)

    async def written() -> list[int]:
        async with AsymStore([LocalTier(tmp_path)], keep_last=None) as store:
            return [(await store.read_manifest(s)).written_bytes for s in range(2, 13)]

    assert max(asyncio.run(written())) < frozen // 2  # later versions reference the base, not write it


def test_in_place_edits_of_a_frozen_parameter_between_steps_are_captured(tmp_path: Path) -> None:
    def edit(model: LoRA, it: int) -> None:
        if it == 4:
            with torch.no_grad():  # one element, outside the byte sample: only the version counter tells
                model.base[2].weight.view(-1)[1] += 1.0
        if it == 8:
            model.base[2].weight.data.add_(1.0)  # does not: the byte sample sees it

    model, ckpt, seen = run(tmp_path, 12, edit)
    assert not torch.equal(seen[4], seen[5]) and not torch.equal(seen[8], seen[9])
    versions = read_versions(tmp_path)
    assert {5, 6, 7, 12} <= set(versions)  # an edit costs at most the version it was found in
    check_versions(versions, seen, model)  # every version holds the bytes its step saw, edited or not
    stats = ckpt.stats()
    assert stats.copy_bytes < 5 * base_bytes(model)  # the cache was in use between the edits


def test_by_default_frozen_parameters_are_copied_at_every_version_and_a_data_edit_the_sample_misses_is_kept(
        tmp_path: Path) -> None:
    """``frozen="copy"`` (the default): a teacher-style ``p.data`` edit of one element, which moves no
    version counter and lies outside the byte sample, is in the very next version ("known" would miss it)."""
    def edit(model: LoRA, it: int) -> None:
        if it in (4, 7):
            model.base[2].weight.data.view(-1)[1] += 1.0

    model, ckpt, seen = run(tmp_path, 10, edit, commits=CommitOptions())
    assert not torch.equal(seen[4], seen[5]) and not torch.equal(seen[7], seen[8])
    versions = read_versions(tmp_path)
    assert sorted(versions) == list(range(1, 11))
    # an edit between steps belongs to the version of the step before it (copied at the next forward):
    # version s holds what the loop saw when step s + 1 returned, the last one the final weight
    expected = {s: seen[s + 1] for s in range(1, 10)} | {10: model.base[2].weight.detach()}
    for step, ck in versions.items():
        assert torch.equal(bits(ck.tensors["model/base.2.weight"]), bits(expected[step])), step
    assert ckpt.stats().copy_bytes >= 9 * base_bytes(model)  # the base was read at every version


def test_a_tier_without_references_gets_every_byte(tmp_path: Path) -> None:
    tier = host_tier(64 << 20, path=tmp_path / "shm")  # files: readable after the Checkpointer closes
    model, ckpt, seen = run([tier], 10)
    copied_once(model, ckpt, 10)

    async def read() -> dict[int, Checkpoint]:
        async with AsymStore([host_tier(64 << 20, path=tmp_path / "shm")], keep_last=None) as store:
            out = {}
            for s in next(iter(store.versions().values())):
                ck = await store.restore(s)
                manifest = await store.read_manifest(s)
                assert not manifest.references and manifest.written_bytes >= base_bytes(model)
                out[s] = ck
            return out

    versions = asyncio.run(read())
    assert len(versions) >= 3
    check_versions(versions, seen, model)


def test_a_frozen_parameter_made_trainable_is_copied_again(tmp_path: Path) -> None:
    def unfreeze(model: LoRA, it: int) -> None:
        if it == 5:  # requires_grad on and into the optimizer: every later step changes it
            w = model.base[2].weight
            w.requires_grad_(True)
            opts[0].add_param_group({"params": [w], "lr": 1e-2})

    opts: list[torch.optim.Optimizer] = []
    model = LoRA()
    opt = torch.optim.AdamW([model.a, model.b], lr=1e-2)
    opts.append(opt)
    ckpt = open_ckpt(model, opt, tmp_path, commits=KNOWN)
    seen: dict[int, torch.Tensor] = {}
    for it in range(9):
        unfreeze(model, it)
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(it))
        nn.functional.mse_loss(model(x), x.flip(1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen[ckpt.step] = model.base[2].weight.detach().clone()
    ckpt.close()
    assert not torch.equal(seen[7], seen[8])  # trained now
    # everything copied every version: about 13.6 x base_bytes; with base.0 known after the first
    # version and base.2 until it was unfrozen: about 8.5 x
    assert ckpt.stats().copy_bytes < 11 * base_bytes(model)
    versions = read_versions(tmp_path)
    assert {7, 8, 9} <= set(versions)
    for step in versions:
        assert torch.equal(bits(versions[step].tensors["model/base.2.weight"]), bits(seen[step])), step
