"""Chunks of no bytes share their place with the chunk stored after them; a reader must never confuse the two.

An empty tensor (or a pack of empty tensors) is a chunk of length 0 at the offset where the next
chunk starts. Restores that found staged chunks and packs by (segment, offset) handed one the
other's bytes, and every version of such a state failed verification: on a shared-memory tier with
compression (the ranged read of every raw tensor into fresh memory), and on any directory tier
once 32 or more small tensors began with a run of empty ones (an empty pack). These tests restore
such states in another process, on every file tier kind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asymstore import AsymStore
from asymstore.format.manifest import Chunk, Manifest, SegmentEntry, TensorEntry
from asymstore.format.parse import parse_manifest
from tests.support.tierkinds import FILE_KINDS, Kind, Restorer, digests, make_tier


def where(kind: Kind, tmp_path: Path, shm_dir: str) -> str:
    return str(Path(shm_dir) / "tier") if kind == "shm" else str(tmp_path / "tier")


def commit(kind: Kind, path: str, state: dict[str, torch.Tensor], compression: str) -> None:
    async def go() -> None:
        async with AsymStore([make_tier(kind, path)], compression=compression, chunk_bytes=4096,  # type: ignore[arg-type]
                             segment_bytes=1 << 16) as store:
            await store.put_many(1, state)
            await store.commit(1)

    asyncio.run(go())


def test_the_reported_shared_memory_store_restores_in_a_new_process(shm_dir: str, restorer: Restorer) -> None:
    state = {"e": torch.empty(0, 3), "c": torch.full((100,), 2.0)}
    commit("shm", shm_dir, state, "always")
    answer = restorer.restore("shm", shm_dir)
    assert answer.get("error") is None, answer
    assert answer["step"] == 1 and answer["tensors"] == digests(state)


def empty_first(n: int = 40) -> dict[str, torch.Tensor]:
    """A run of empty tensors (packed together: a pack of no bytes), then a large tensor and small ones."""
    g = torch.Generator().manual_seed(n)
    state = {f"empty{i}": torch.empty(0, i % 3) for i in range(n)}
    state["big"] = torch.randn(5000, generator=g)  # several chunks of its own
    state.update({f"zero{i}": torch.empty(0) for i in range(n)})
    state.update({f"small{i}": torch.randn(3, i + 1, generator=g) for i in range(n)})
    return state


def two_packs_at_one_place() -> dict[str, torch.Tensor]:
    """A pack of empty tensors and, at the same offset, the next pack (staging starts a pack every 4096 tensors)."""
    state = {f"empty{i}": torch.empty(0) for i in range(4096)}
    state.update({f"small{i}": torch.full((5,), float(i)) for i in range(40)})
    return state


@pytest.mark.parametrize("compression", ["never", "always"])
@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("into", ["none", "all", "some"])
def test_an_empty_pack_beside_a_large_tensor_restores_bit_exact(kind: Kind, compression: str, into: str,
                                                                tmp_path: Path, shm_dir: str,
                                                                restorer: Restorer) -> None:
    check_restore(kind, compression, into, tmp_path, shm_dir, restorer, empty_first())


@pytest.mark.parametrize("into", ["none", "all"])
def test_two_packs_at_one_place_restore_bit_exact(into: str, tmp_path: Path, shm_dir: str,
                                                  restorer: Restorer) -> None:
    check_restore("local", "never", into, tmp_path, shm_dir, restorer, two_packs_at_one_place())


def check_restore(kind: Kind, compression: str, into: str, tmp_path: Path, shm_dir: str, restorer: Restorer,
                  state: dict[str, torch.Tensor]) -> None:
    path = where(kind, tmp_path, shm_dir)
    commit(kind, path, state, compression)
    answer = restorer.restore(kind, path, into)  # type: ignore[arg-type]
    assert answer.get("error") is None, answer
    assert answer["tensors"] == digests(state)
    assert answer["same"]


def test_two_packs_at_one_place_stay_two_packs_through_the_manifest() -> None:
    empty = Chunk("seg-000000.bin", 64, 0, 0, "ef46db3751d8e999", raw_checksum="ef46db3751d8e999")
    full = Chunk("seg-000000.bin", 64, 8, 8, "0123456789abcdef", raw_checksum="0123456789abcdef")
    tensors = {"a": TensorEntry("float32", (0,), 0, (empty,), pack_offset=0),
               "b": TensorEntry("float32", (2,), 8, (full,), pack_offset=0)}
    manifest = Manifest(3, tensors, (SegmentEntry("seg-000000.bin", 72, "0123456789abcdef"),))
    assert manifest.packs == (empty, full)
    back = parse_manifest(manifest.to_json())
    assert back.tensors["a"].chunks[0] == empty and back.tensors["b"].chunks[0] == full


@pytest.mark.parametrize("make", [empty_first, two_packs_at_one_place])
@pytest.mark.parametrize("to", ["safetensors", "dcp"])
def test_export_of_chunks_that_share_a_place_is_bit_exact(to: str, make: Callable[[], dict[str, torch.Tensor]],
                                                          tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import load

    from asymstore.export import export

    state = {f"model/{k}": v for k, v in make().items()}
    commit("local", str(tmp_path / "root"), state, "never")
    out = str(tmp_path / "out")
    summary = asyncio.run(export(str(tmp_path / "root"), to, out))  # type: ignore[arg-type]
    assert summary["step"] == 1
    if to == "safetensors":
        got = load_file(out)
    else:
        got = {k.removeprefix("model/"): torch.empty_like(v) for k, v in state.items()}
        load(got, checkpoint_id=out, no_dist=True)  # type: ignore[call-arg]
    assert digests(got) == digests({k.removeprefix("model/"): v for k, v in state.items()})
