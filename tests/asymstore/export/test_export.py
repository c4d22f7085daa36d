"""Export: a version written by the Checkpointer, read back by the reference loaders (safetensors, DCP), bit-exact."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from asymcheck import Checkpointer
from asymstore import AsymStore, CorruptVersionError, LocalTier, NoCheckpointError
from asymstore.errors import ExportError
from asymstore.export import export, main
from asymstore.format.names import version_dirname


def gpt2() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(root: Path, steps: int = 3) -> torch.nn.Module:
    model, opt = gpt2()
    with Checkpointer(model, opt, str(root)) as ckpt:
        for it in range(steps):
            x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(it))
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert ckpt.step == steps
    return model


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The checkpoint root and the model's weights, each storage once (GPT-2 ties lm_head to wte, as HF saves it)."""
    root = tmp_path_factory.mktemp("export") / "ckpt"
    model = train(root)
    seen: set[int] = set()
    weights = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            weights[k] = v.detach().clone()
    assert "lm_head.weight" not in weights  # tied: the checkpoint holds it once, as transformer.wte.weight
    return root, weights


def test_safetensors_export_loads_with_the_reference_loader_and_into_the_model(
        trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, weights = trained
    out = tmp_path / "model.safetensors"
    assert main([str(root), "--to", "safetensors", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 3 and summary["tensors"] == len(weights)
    assert same(load_file(str(out)), weights)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["asymstore_step"] == "3"
    fresh, _ = gpt2()
    missing, unexpected = fresh.load_state_dict(load_file(str(out)), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to wte, loaded with it
    assert same({k: v for k, v in fresh.state_dict().items() if k in weights}, weights)
    assert torch.equal(fresh.lm_head.weight, weights["transformer.wte.weight"])


def test_dcp_export_loads_with_torch_distributed_checkpoint(trained: tuple[Path, dict[str, torch.Tensor]],
                                                            tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    root, weights = trained
    out = tmp_path / "dcp"
    summary = asyncio.run(export(str(root), "dcp", str(out)))
    assert summary["tensors"] == len(weights)
    loaded = {k: torch.zeros_like(v) for k, v in weights.items()}
    dcp.load(loaded, checkpoint_id=str(out), no_dist=True)
    assert same(loaded, weights)


@pytest.mark.parametrize("compression", ["never", "always"])
async def test_export_verifies_every_chunk_and_writes_nothing_on_damage(tmp_path: Path, compression: str) -> None:
    """Two versions: a damaged newest one is skipped for the one before (no step given), refused when asked for."""
    root = tmp_path / "store"

    def state_of(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"model/w": torch.randn(70_000, generator=g), "model/b": torch.randn(10, generator=g).to(torch.bfloat16),
                "optim/x": torch.full((3,), float(step))}

    async with AsymStore([LocalTier(root)], compression=compression, segment_bytes=128 << 10) as store:
        for step in (1, 2):
            await store.put_many(step, state_of(step))
            await store.commit(step)
    state = state_of(2)
    good = tmp_path / "good.safetensors"
    assert (await export(str(root), "safetensors", str(good)))["step"] == 2
    assert same(load_file(str(good)), {"w": state["model/w"], "b": state["model/b"]})  # prefix model/ only
    everything = tmp_path / "all.safetensors"
    await export(str(root), "safetensors", str(everything), prefix="")
    assert same(load_file(str(everything)), state)

    def damage(step: int) -> None:
        seg = sorted((root / version_dirname(step)).glob("seg-*"))[-1]
        data = bytearray(seg.read_bytes())
        data[len(data) // 2] ^= 0x04
        seg.write_bytes(bytes(data))

    def written() -> list[str]:
        return sorted(p for p in os.listdir(tmp_path) if p.startswith(("bad.", "old.", "none.")))

    damage(2)
    bad = tmp_path / "bad.safetensors"
    with pytest.raises(CorruptVersionError):  # asked for by step: that version or nothing, never another
        await export(str(root), "safetensors", str(bad), step=2)
    assert written() == []
    old = tmp_path / "old.safetensors"
    summary = await export(str(root), "safetensors", str(old))  # no step: the newest version that verifies
    assert summary["step"] == 1 and [s["step"] for s in summary["skipped"]] == [2], summary
    assert summary["skipped"][0]["error"].startswith("CorruptVersionError"), summary
    assert same(load_file(str(old)), {"w": state_of(1)["model/w"], "b": state_of(1)["model/b"]})
    assert written() == ["old.safetensors"]

    damage(1)
    none = tmp_path / "none.safetensors"
    with pytest.raises(NoCheckpointError, match="step 2: CorruptVersionError") as info:  # none verifies
        await export(str(root), "safetensors", str(none))
    assert "step 1: CorruptVersionError" in str(info.value)
    with pytest.raises(CorruptVersionError):
        await export(str(root), "safetensors", str(none), step=1)
    assert written() == ["old.safetensors"]  # nothing of the refused exports, not even a temporary file


def test_export_refuses_what_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"

    async def write() -> None:
        async with AsymStore([LocalTier(root)]) as store:
            await store.put_many(1, {"model/c": torch.zeros(2, dtype=torch.complex128), "other/w": torch.ones(2)})
            await store.commit(1)
    asyncio.run(write())
    with pytest.raises(ExportError, match="complex128"):
        asyncio.run(export(str(root), "safetensors", str(tmp_path / "x.safetensors")))
    with pytest.raises(ExportError, match="named 'nothing/'"):
        asyncio.run(export(str(root), "safetensors", str(tmp_path / "x.safetensors"), prefix="nothing/"))
    assert main([str(root), "--to", "safetensors", str(tmp_path / "x.safetensors"), "--prefix", "nothing/"]) == 1
    assert "ExportError" in capsys.readouterr().err
    assert main([str(tmp_path / "missing"), "--to", "dcp", str(tmp_path / "d")]) == 2
