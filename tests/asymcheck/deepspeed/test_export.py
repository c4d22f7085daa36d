"""asymcheck.deepspeed.export refuses what it cannot export, and never writes outside its output directory."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")

from asymcheck.deepspeed.export import _inside, assemble_slices, find_root, main
from asymcheck.errors import DeepSpeedExportError
from asymstore.format.manifest import Manifest
from asymstore.values import Checkpoint


def test_a_directory_without_a_multirank_root_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DeepSpeedExportError, match="no multi-rank"):
        find_root(str(tmp_path))
    assert main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "no multi-rank" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["../evil.pt", "/etc/passwd", "a/../../b.pt", ".", "a/../.."])
def test_file_names_from_a_manifest_never_leave_the_output(tmp_path: Path, key: str) -> None:
    with pytest.raises(DeepSpeedExportError, match="would leave"):
        _inside(str(tmp_path), key)
    name = "tag/mp_rank_00_model_states.pt"
    assert _inside(str(tmp_path), name) == str(tmp_path / name)


def _sliced_shards(tensors: list[torch.Tensor], world: int) -> list[Checkpoint]:
    """Each rank's shard as attach() writes it with slices: its pieces, ``meta["layout"]`` saying where they sit."""
    from asymcheck.state.replicas import slice_plan
    from asymstore.format.pieces import LAYOUT_KEY, layout_meta

    shards = []
    for rank in range(world):
        plan = dict(slice_plan(tensors, rank, world))
        held = {f"m/{i}": t.narrow(0, plan[i].offsets[0], plan[i].shape[0]).clone() if i in plan else t.clone()
                for i, t in enumerate(tensors)}
        meta = {LAYOUT_KEY: layout_meta({f"m/{i}": lay for i, lay in plan.items()})}
        shards.append(Checkpoint(7, held, meta, "test", cast(Manifest, None)))
    return shards


@settings(deadline=None, max_examples=40)
@given(shapes=st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6),
       world=st.integers(2, 5), seed=st.integers(0, 1000))
def test_the_export_puts_every_slice_back_together(shapes: list[tuple[int, ...]], world: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=g) for s in shapes]
    shards = _sliced_shards(tensors, world)
    assemble_slices(shards)
    for shard in shards:
        for i, t in enumerate(tensors):
            assert torch.equal(shard.tensors[f"m/{i}"], t)


def test_the_export_refuses_slices_that_do_not_cover_their_tensor() -> None:
    tensors = [torch.arange(12.0).reshape(6, 2)]
    shards = _sliced_shards(tensors, 3)
    with pytest.raises(DeepSpeedExportError, match="slice"):
        assemble_slices(shards[:2])  # a rank's shard missing
    shards = _sliced_shards(tensors, 3)
    shards[1].tensors["m/0"] = shards[1].tensors["m/0"][:1]  # a piece of another shape than its layout says
    with pytest.raises(DeepSpeedExportError, match="not a slice"):
        assemble_slices(shards)
