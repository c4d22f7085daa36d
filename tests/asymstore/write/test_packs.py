"""Many small tensors staged in bulk (packs, manifest format 3): round trips, damage, hostile tables, old formats."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asymstore import AsymStore, LocalTier, TierCalibration, host_tier
from asymstore.errors import DuplicateNameError, InvalidNameError, ManifestError
from asymstore.format.globalmanifest import shard_digest
from asymstore.format.manifest import (
    CHUNK_PROOF_FORMAT_VERSION,
    MANIFEST_NAME,
    PACKED_FORMAT_VERSION,
    seal_document,
)
from asymstore.format.names import version_dirname
from asymstore.format.parse import parse_manifest
from asymstore.fsck import check
from asymstore.multirank.reshard import read_range
from asymstore.write.staging import PACK_MIN_TENSORS, PACK_TENSOR_BYTES, PackArena, PendingStep, StagedPack, arena_bytes
from tests.support.tensors import DTYPES, assert_same, bits, random_tensor

SLOW = TierCalibration.from_throughput(1e6, 20e-3)  # compresses whatever shrinks


def mixed_state(count: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` small tensors of every dtype and shape class, some non-contiguous, conjugate or negative views."""
    shapes = [(), (0,), (3, 0, 2), (1,), (7,), (3, 5), (2, 3, 4), (64,), (16, 16), (1000,)]
    state: dict[str, torch.Tensor] = {}
    for i in range(count):
        dtype, shape = DTYPES[i % len(DTYPES)], shapes[(i // len(DTYPES)) % len(shapes)]
        t = random_tensor(dtype, shape, seed * 100_003 + i)
        if i % 7 == 3 and t.dim() == 2:
            t = t.t()  # non-contiguous
        elif i % 7 == 5 and t.dim() >= 1 and t.shape[0] > 2:
            t = t[::2]  # strided
        elif i % 11 == 4 and dtype in (torch.complex64, torch.complex128):
            t = t.conj()  # a lazy conjugate view
        elif i % 11 == 6 and dtype == torch.float32:
            t = torch.nn.Parameter(t, requires_grad=True)
        state[f"layers.{i}.{dtype}".replace("torch.", "")] = t
    return state


def manifest_doc(root: Path, step: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((root / version_dirname(step) / MANIFEST_NAME).read_bytes())
    return doc


def expected(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg()


async def test_ten_thousand_mixed_small_tensors_round_trip_bit_exact(tmp_path: Path) -> None:
    state = mixed_state(10_000, seed=1)
    state["big"] = torch.randn(300_000)  # a chunk of its own beside the packs
    async with AsymStore([LocalTier(tmp_path)]) as store:
        await store.put_many(1, state)
        result = await store.commit(1)
    manifest = result.manifest
    assert manifest.packs and len(manifest.tensors) == len(state)
    assert manifest.tensors["big"].pack_offset is None
    doc = manifest_doc(tmp_path, 1)
    assert doc["format_version"] == CHUNK_PROOF_FORMAT_VERSION and "packs" in doc and list(doc["tensors"]) == ["big"]
    assert len(doc["packed"]["names"]) == 10_000
    assert parse_manifest((tmp_path / version_dirname(1) / MANIFEST_NAME).read_bytes()) == manifest

    async with AsymStore([LocalTier(tmp_path)]) as store:
        ckpt = await store.restore()
        for name, t in state.items():
            assert_same(ckpt.tensors[name], expected(t))
        into = {name: torch.empty_like(expected(t)) for name, t in state.items()}
        odd = next(n for n, t in into.items() if t.dim() == 2 and t.numel() and t.dtype == torch.float32)
        into[odd] = torch.empty(tuple(reversed(into[odd].shape))).t()  # not fillable in place: copied into
        back = await store.restore(into=into)
    for name, t in state.items():
        assert back.tensors[name] is into[name]
        assert_same(into[name], expected(t))
    report = check(str(tmp_path), deep=True)
    assert report.ok and [e.status for e in report.entries] == ["committed"]


async def test_adopt_many_packs_a_private_copy_and_releases_once(tmp_path: Path) -> None:
    state = {name: expected(t).contiguous().clone() for name, t in mixed_state(300, seed=2).items()}
    want = {name: t.clone() for name, t in state.items()}
    released = []
    async with AsymStore([LocalTier(tmp_path)]) as store:
        await store.adopt_many(1, state, release=lambda: released.append(1))
        for t in state.values():  # the packs are copies: the caller's memory is not read at commit
            t.zero_() if t.dtype != torch.bool else t.fill_(False)
        assert released == []  # released when the version is written, as for any adopted batch
        result = await store.commit(1)
        assert released == [1] and result.manifest.packs
        ckpt = await store.restore()
    for name, t in want.items():
        assert_same(ckpt.tensors[name], t)


async def test_few_tensors_are_not_packed(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(4) for i in range(PACK_MIN_TENSORS - 1)}
    async with AsymStore([LocalTier(tmp_path)]) as store:
        await store.put_many(1, state)
        await store.put(1, "one", torch.randn(3))  # put: always a chunk of its own
        result = await store.commit(1)
        ckpt = await store.restore()
    assert not result.manifest.packs
    doc = manifest_doc(tmp_path, 1)
    assert doc["format_version"] == CHUNK_PROOF_FORMAT_VERSION and "packs" not in doc and len(doc["tensors"]) == 32
    for name, t in state.items():
        assert_same(ckpt.tensors[name], t)


def flip_in_pack(root: Path, step: int, tensor: str) -> None:
    """Flip one bit of ``tensor``'s bytes inside its pack on disk (the manifest untouched)."""
    manifest = parse_manifest((root / version_dirname(step) / MANIFEST_NAME).read_bytes())
    entry = manifest.tensors[tensor]
    assert entry.pack_offset is not None and entry.nbytes
    pack = entry.chunks[0]
    with open(root / version_dirname(step) / pack.segment, "r+b") as f:
        f.seek(pack.offset + entry.pack_offset + entry.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("tier", ["local", "host"])
async def test_one_damaged_small_tensor_fails_its_version_and_restore_falls_back(tmp_path: Path, tier: str) -> None:
    states = {step: {f"p.{i}": torch.randn(256, generator=torch.Generator().manual_seed(step * 1000 + i))
                     for i in range(2000)} for step in (1, 2)}
    async with AsymStore([LocalTier(tmp_path)], keep_last=None) as store:
        for step, state in states.items():
            await store.put_many(step, state)
            assert (await store.commit(step)).manifest.packs
    flip_in_pack(tmp_path, 2, "p.1234")

    assert check(str(tmp_path)).ok  # sizes are right: only --deep reads the bytes
    report = check(str(tmp_path), deep=True)
    (bad,) = [e for e in report.entries if e.step == 2]
    assert bad.status == "corrupt" and report.newest_restorable == 1
    assert any("checksum mismatch" in p and "packed tensors" in p for p in bad.problems), bad.problems

    tiers = [LocalTier(tmp_path)] if tier == "local" else [host_tier(capacity_bytes=64 << 20), LocalTier(tmp_path)]
    async with AsymStore(tiers) as store:
        ckpt = await store.restore()
        assert ckpt.step == 1 and ckpt.fell_back and "checksum mismatch" in ckpt.fallbacks[-1]
        for name, t in states[1].items():
            assert_same(ckpt.tensors[name], t)
        into = {name: torch.zeros(256) for name in states[1]}
        ckpt = await store.restore(into=into)  # the damaged version filled some destinations: the older one wins
        assert ckpt.step == 1
    for name, t in states[1].items():
        assert_same(into[name], t)


async def test_packs_compress_on_a_slow_tier_and_the_shard_digest_is_tier_independent(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": (torch.randn(512, generator=g) * 0.02).to(torch.bfloat16) for i in range(400)}
    fast, slow = LocalTier(tmp_path / "fast", name="fast"), LocalTier(tmp_path / "slow", name="slow")
    async with AsymStore([fast, slow], durable=fast, calibrations={"fast": TierCalibration.from_throughput(1e12, 1e-6),
                                                                   "slow": SLOW}) as store:
        await store.put_many(1, state)
        result = await store.commit(1)
        await store.flushed(1)
    codecs = {c["codec"] for c in manifest_doc(tmp_path / "slow", 1)["packs"]}
    assert codecs == {"zstd-planes:2"}
    slow_manifest = parse_manifest((tmp_path / "slow" / version_dirname(1) / MANIFEST_NAME).read_bytes())
    assert shard_digest(slow_manifest) == shard_digest(result.manifest)
    async with AsymStore([LocalTier(tmp_path / "slow")]) as store:
        ckpt = await store.restore()
        tier = store.tiers[0]
        packs: dict[tuple[str, int], memoryview] = {}
        for name in ("w7", "w8", "w399"):  # a range of a packed tensor, the verified pack kept for the next
            data = await read_range(tier, slow_manifest, name, 100, 900, packs)
            assert bytes(data) == bytes(state[name].view(torch.uint8)[100:900].tolist()) and len(packs) == 1
    for name, t in state.items():
        assert_same(ckpt.tensors[name], t)


async def test_packs_are_bounded_by_chunk_bytes(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(256) for i in range(100)}  # 1 KiB each
    async with AsymStore([LocalTier(tmp_path)], chunk_bytes=4096, segment_bytes=8192) as store:
        await store.put_many(1, state)
        result = await store.commit(1)
        ckpt = await store.restore()
    assert len(result.manifest.packs) == 25 and all(p.raw_length <= 4096 for p in result.manifest.packs)
    for name, t in state.items():
        assert_same(ckpt.tensors[name], t)
    # a manifest built by hand may list packed tensors in any order: the table is written in place order
    shuffled = dataclasses.replace(result.manifest, tensors=dict(reversed(result.manifest.tensors.items())))
    assert parse_manifest(shuffled.to_json()) == result.manifest


async def test_put_many_stages_in_order_up_to_a_refused_name(tmp_path: Path) -> None:
    names = [f"ok.{i}" for i in range(50)] + ["../bad"] + [f"late.{i}" for i in range(20)]
    async with AsymStore([LocalTier(tmp_path)]) as store:
        with pytest.raises(InvalidNameError):
            await store.put_many(1, {n: torch.ones(2) for n in names})
        with pytest.raises(DuplicateNameError):
            await store.put_many(1, {f"new.{i}": torch.ones(2) for i in range(40)} | {"ok.3": torch.ones(2)})
        await store.commit(1)
        ckpt = await store.restore()
    assert sorted(ckpt.tensors) == sorted(names[:50])  # as one put each: those before the bad name are staged


# -- hostile packed tables: each forgery is re-sealed, so only the structural checks can refuse it ------------


def _packed(doc: dict[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = doc["packed"]
    return table


FORGERIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "misaligned offset": lambda d: _packed(d)["offsets"].__setitem__(1, _packed(d)["offsets"][1] + 2),
    "overlapping tensors": lambda d: _packed(d)["offsets"].__setitem__(1, _packed(d)["offsets"][0]),
    "past the pack's end": lambda d: _packed(d)["offsets"].__setitem__(-1, d["packs"][-1]["raw_length"]),
    "unknown pack": lambda d: _packed(d)["pack"].__setitem__(0, len(d["packs"])),
    "unknown dtype index": lambda d: _packed(d)["dtype"].__setitem__(0, 9),
    "unknown dtype": lambda d: _packed(d)["dtypes"].__setitem__(0, "float65"),
    "duplicate name": lambda d: _packed(d)["names"].__setitem__(1, _packed(d)["names"][0]),
    "absolute name": lambda d: _packed(d)["names"].__setitem__(2, "/etc/passwd"),
    "name also chunked": lambda d: _packed(d)["names"].__setitem__(0, "big"),
    "short column": lambda d: _packed(d)["shapes"].pop(),
    "bool offset": lambda d: _packed(d)["offsets"].__setitem__(0, False),
    "negative dim": lambda d: _packed(d)["shapes"].__setitem__(0, [-1]),
    "huge shape": lambda d: _packed(d)["shapes"].__setitem__(0, [2**61, 2**61]),
    "too many dims": lambda d: _packed(d)["shapes"].__setitem__(0, [1] * 65),
    "string shape": lambda d: _packed(d)["shapes"].__setitem__(0, "64"),
    "packs out of order": lambda d: _packed(d)["pack"].__setitem__(0, 1),
    "pack past its segment": lambda d: d["packs"][0].update(length=10**9, raw_length=10**9),
    "pack overlaps a chunk": lambda d: d["packs"][0].update(offset=d["tensors"]["big"]["chunks"][0]["offset"],
                                                            segment=d["tensors"]["big"]["chunks"][0]["segment"]),
    "packed table in format 2": lambda d: d.update(format_version=2),
    "packs without a table": lambda d: d.pop("packed"),
}


@pytest.mark.parametrize("case", sorted(FORGERIES))
async def test_a_forged_packed_table_is_refused_and_restore_falls_back(tmp_path: Path, case: str) -> None:
    states = {step: {f"s.{i}": torch.randn(64, generator=torch.Generator().manual_seed(step * 100 + i))
                     for i in range(300)} | {"big": torch.full((100_000,), float(step))} for step in (1, 2)}
    async with AsymStore([LocalTier(tmp_path)], keep_last=None, chunk_bytes=16 << 10) as store:  # 5 packs
        for step, state in states.items():
            await store.put_many(step, state)
            assert len((await store.commit(step)).manifest.packs) == 5
    path = tmp_path / version_dirname(2) / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    FORGERIES[case](doc)
    path.write_bytes(seal_document(doc))
    with pytest.raises(ManifestError):
        parse_manifest(path.read_bytes())
    async with AsymStore([LocalTier(tmp_path)]) as store:
        ckpt = await store.restore()
    assert ckpt.step == 1 and ckpt.fell_back
    for name, t in states[1].items():
        assert_same(ckpt.tensors[name], t)


async def test_a_format_3_manifest_without_its_checksum_is_damaged(tmp_path: Path) -> None:
    async with AsymStore([LocalTier(tmp_path)]) as store:
        await store.put_many(1, {f"t{i}": torch.randn(8) for i in range(64)})
        await store.commit(1)
    data = (tmp_path / version_dirname(1) / MANIFEST_NAME).read_bytes()
    body = data[:data.rindex(b',"manifest_checksum":')] + b"}"
    assert json.loads(body)["format_version"] >= PACKED_FORMAT_VERSION
    with pytest.raises(ManifestError, match="without its self-checksum"):
        parse_manifest(body)


def model_like_state(layers: int) -> dict[str, torch.Tensor]:
    """A model's order: each layer's large weights with its small biases and norms between them (a run each)."""
    state: dict[str, torch.Tensor] = {}
    for i in range(layers):
        state[f"l{i}.w"] = torch.randn(128, 160)  # 80 KiB: a chunk of its own
        for j in range(8):
            state[f"l{i}.b{j}"] = torch.randn(128 + j)
        state[f"l{i}.steps"] = torch.tensor(float(i + 1))
        state[f"l{i}.mask"] = torch.arange(7) % 2 == 0  # bool: another item size in the same run
    return state


async def test_the_packs_of_one_call_are_carved_from_one_mapping(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # one mapping per adopt_many call, however many runs of small tensors (one per layer here), and the
    # packs stay one per run (what references compare) and restore bit-exact from their disjoint slices
    from asymstore.write import staging

    calls: list[int] = []
    real = staging.pack_memory

    def counted(size: int) -> tuple[memoryview, int]:
        calls.append(size)
        return real(size)

    monkeypatch.setattr(staging, "pack_memory", counted)
    layers = 6
    async with AsymStore([LocalTier(tmp_path)]) as store:
        for step in (1, 2):
            state = model_like_state(layers)
            calls.clear()
            await store.adopt_many(step, {n: t.clone() for n, t in state.items()})
            assert len(calls) == 1  # was one per run: 6 here, tens per version of a real model
            result = await store.commit(step)
            assert len(result.manifest.packs) == layers
            ckpt = await store.restore()
            assert ckpt.step == step
            for name, t in state.items():
                assert_same(ckpt.tensors[name], t)
    assert check(str(tmp_path), deep=True).ok


_ITEMS = st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 40), st.booleans()), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=_ITEMS, capacity=st.sampled_from([256, 4096, 1 << 20]))
def test_packs_carved_from_an_arena_are_disjoint_exact_and_fit_its_bound(
        items: list[tuple[torch.dtype, int, bool]], capacity: int) -> None:
    # runs of small tensors of mixed item sizes between large ones (not packed), staged as _stage_many does:
    # every pack fits the arena arena_bytes sized (no mapping of its own) but those beyond one per run (a run
    # longer than a pack), no two packs overlap, and each member's bytes in its pack are the tensor's
    values: list[tuple[str, object]] = []
    for i, (dtype, n, large) in enumerate(items):
        t = random_tensor(dtype, (n,), i)
        values.append((f"t{i}", torch.zeros(PACK_TENSOR_BYTES + 8, dtype=torch.uint8) if large else t))
    limit = min(PACK_TENSOR_BYTES, capacity)
    arena = PackArena(arena_bytes([v for _, v in values], limit))
    pending = PendingStep(1, chunk_bytes=capacity)
    i = 0
    while i < len(values):
        i += pending.put_packed(values[i:], limit, arena=arena)
        if i < len(values):
            i += 1  # a large one: staged on its own by the caller
    packs = {id(p): p for p in pending.tensors.values() if isinstance(p, StagedPack)}.values()
    runs = sum(1 for k, (_, _, large) in enumerate(items) if not large and (k == 0 or items[k - 1][2]))
    assert arena.fresh <= max(0, len(packs) - runs)
    if capacity == 1 << 20:  # no run longer than a pack: all in the arena
        assert arena.fresh == 0
    spans = sorted((ctypes.addressof(ctypes.c_char.from_buffer(p.view)), len(p.view)) for p in packs if len(p.view))
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))
    for name, value in values:
        pack = pending.tensors.get(name)
        if isinstance(pack, StagedPack):
            k = pack.names.index(name)
            got = bytes(pack.view[pack.offsets[k]:pack.offsets[k] + pack.sizes[k]])
            assert isinstance(value, torch.Tensor) and got == bits(value)
