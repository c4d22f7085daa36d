"""Export falls back as documented: without ``--step`` the newest version that verifies is written and the
versions skipped are named; with ``--step`` that version or nothing; every version damaged: nothing.

Roots written for real: a single-process store (LocalTier, fsync), and multi-rank roots of two ranks (threads
with their own event loops over a real c10d HashStore, as tests/asymstore/multirank/test_reshard.py) holding DDP-like
shards (every tensor whole: rank 0's shard is exported) and FSDP2-like ones (a sharded tensor assembled from
both ranks' pieces). Damage: every byte of one segment flipped, the manifests intact.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from asymstore import AsymStore, CorruptVersionError, LocalTier, NoCheckpointError
from asymstore.errors import ExportError
from asymstore.export import export, main
from asymstore.format.names import version_dirname
from asymstore.format.pieces import LAYOUT_KEY, MeshInfo, TensorLayout, layout_meta
from tests.support.ranks import run_ranks, store

Layout = Literal["single", "ddp", "fsdp"]
STEPS = [1, 2, 3]
WORLD = 2


def weights(step: int) -> torch.Tensor:
    """The whole ``model/w`` of ``step`` (7 x 3: two uneven row pieces over two ranks)."""
    return torch.arange(21, dtype=torch.float32).reshape(7, 3) * 10 + step


def piece(rank: int) -> TensorLayout:
    return TensorLayout.sharded((7, 3), "float32", MeshInfo((WORLD,), tuple(range(WORLD)), (rank,)), ["S(0)"])


def box(t: torch.Tensor, lay: TensorLayout) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(lay.offsets, lay.shape, strict=True))]


def expected(layout: Layout, step: int) -> dict[str, torch.Tensor]:
    """What the export of ``step`` holds (prefix ``model/`` removed); a multi-rank root gives rank 0's whole ones."""
    if layout == "single":
        return {"w": weights(step), "b": torch.full((5,), float(step), dtype=torch.bfloat16)}
    return {"w": weights(step), "rng": torch.tensor([0, step])}


def write_root(root: Path, layout: Layout) -> None:
    if layout == "single":
        async def single() -> None:
            async with AsymStore([LocalTier(root)], keep_last=None, segment_bytes=1 << 20,
                                 compression="never") as s:
                for step in STEPS:
                    await s.put_many(step, {"model/w": weights(step), "optim/m": torch.ones(4) * step,
                                            "model/b": torch.full((5,), float(step), dtype=torch.bfloat16)})
                    await s.commit(step)
        asyncio.run(single())
        return
    kv = dist.HashStore()

    async def rank_fn(rank: int) -> None:
        lay = piece(rank) if layout == "fsdp" else TensorLayout.whole((7, 3), "float32")
        async with store(root, rank, WORLD, kv, keep_last=None) as s:
            for step in STEPS:
                await s.put_many(step, {"model/w": box(weights(step), lay).clone(),
                                        "model/rng": torch.tensor([rank, step])})
                await s.commit(step, {LAYOUT_KEY: layout_meta({"model/w": lay,
                                                               "model/rng": TensorLayout.whole((2,), "int64")})})

    assert run_ranks(WORLD, rank_fn) == dict.fromkeys(range(WORLD))
    assert sorted(os.listdir(root / "global")).count("v000000000003.json") == 1


def damage(root: Path, layout: Layout, step: int) -> None:
    """Flip every byte of the segments of ``step`` (rank 1's pieces for FSDP2: only the assembly reads them)."""
    where = root if layout == "single" else root / ("rank-00001" if layout == "fsdp" else "rank-00000")
    segments = sorted((where / version_dirname(step)).glob("seg-*"))
    assert segments
    for seg in segments:
        seg.write_bytes(bytes(b ^ 0xFF for b in seg.read_bytes()))


def loaded(out: Path, fmt: str, want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if fmt == "safetensors":
        return load_file(str(out))
    import torch.distributed.checkpoint as dcp

    state = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    return state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def left_behind(directory: Path) -> list[str]:
    """Anything an export left beside its inputs (outputs, temporary files or directories)."""
    return sorted(p for p in os.listdir(directory) if p != "root")


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
@pytest.mark.parametrize("layout", ["single", "ddp", "fsdp"])
def test_a_damaged_newest_version_exports_the_previous_one_and_names_it(
        tmp_path: Path, layout: Layout, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    write_root(root, layout)
    damage(root, layout, 3)
    out = tmp_path / ("model.safetensors" if fmt == "safetensors" else "model-dcp")

    summary = asyncio.run(export(str(root), fmt, str(out)))  # type: ignore[arg-type]
    assert summary["step"] == 2
    [skipped] = summary["skipped"]
    assert skipped["step"] == 3 and skipped["error"].startswith("CorruptVersionError")
    assert same(loaded(out, fmt, expected(layout, 2)), expected(layout, 2))
    assert left_behind(tmp_path) == [out.name]  # no temporary output of the version discarded

    # --step on the damaged version: that version or nothing, and a non-zero exit
    pinned = tmp_path / ("pinned.safetensors" if fmt == "safetensors" else "pinned-dcp")
    with pytest.raises(CorruptVersionError):
        asyncio.run(export(str(root), fmt, str(pinned), step=3))  # type: ignore[arg-type]
    capsys.readouterr()
    assert main([str(root), "--to", fmt, str(pinned), "--step", "3"]) == 1
    assert "CorruptVersionError" in capsys.readouterr().err
    assert left_behind(tmp_path) == [out.name]
    assert main([str(root), "--to", fmt, str(pinned), "--step", "1"]) == 0  # an intact version, asked for
    assert json.loads(capsys.readouterr().out)["skipped"] == []
    assert same(loaded(pinned, fmt, expected(layout, 1)), expected(layout, 1))


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
@pytest.mark.parametrize("layout", ["single", "ddp", "fsdp"])
def test_every_version_damaged_exports_nothing_and_says_which_were_tried(
        tmp_path: Path, layout: Layout, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    write_root(root, layout)
    for step in STEPS:
        damage(root, layout, step)
    out = tmp_path / ("model.safetensors" if fmt == "safetensors" else "model-dcp")
    with pytest.raises(NoCheckpointError) as info:
        asyncio.run(export(str(root), fmt, str(out)))  # type: ignore[arg-type]
    assert all(f"step {s}: CorruptVersionError" in str(info.value) for s in STEPS), info.value
    capsys.readouterr()
    assert main([str(root), "--to", fmt, str(out)]) == 1
    assert "NoCheckpointError" in capsys.readouterr().err
    assert left_behind(tmp_path) == []


def test_the_command_names_the_skipped_version_on_stderr_and_in_its_summary(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_root(root, "single")
    damage(root, "single", 3)
    out = tmp_path / "model.safetensors"
    done = subprocess.run([sys.executable, "-m", "asymstore.export", str(root), "--to", "safetensors", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["step"] == 2 and [s["step"] for s in summary["skipped"]] == [3]
    [line] = [ln for ln in done.stderr.splitlines() if "skipped step 3" in ln]
    assert "CorruptVersionError" in line
    assert same(load_file(str(out)), expected("single", 2))


def test_a_dcp_export_that_fails_while_writing_leaves_no_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in DCP's writer (the data files written, the metadata not): the OUT directory never appears."""
    from torch.distributed.checkpoint import filesystem

    root = tmp_path / "root"
    write_root(root, "single")

    class FailsAtFinish(filesystem.FileSystemWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(filesystem, "FileSystemWriter", FailsAtFinish)
    out = tmp_path / "model-dcp"
    with pytest.raises(ExportError, match="injected"):
        asyncio.run(export(str(root), "dcp", str(out)))
    assert left_behind(tmp_path) == []


def test_a_dcp_out_is_replaced_only_when_it_holds_a_dcp_checkpoint_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_root(root, "single")
    out = tmp_path / "model-dcp"
    assert asyncio.run(export(str(root), "dcp", str(out), step=1))["step"] == 1
    assert asyncio.run(export(str(root), "dcp", str(out)))["step"] == 3  # a DCP checkpoint: replaced
    assert same(loaded(out, "dcp", expected("single", 3)), expected("single", 3))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"notes\.txt"):
        asyncio.run(export(str(root), "dcp", str(out), step=1))
    assert (out / "notes.txt").read_text() == "mine"
    assert same(loaded(out, "dcp", expected("single", 3)), expected("single", 3))
    assert left_behind(tmp_path) == ["model-dcp"]
