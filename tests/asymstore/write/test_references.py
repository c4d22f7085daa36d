"""Unchanged bytes referenced, not rewritten (format 4): a frozen base is written once, and damage to it is visible.

Real LocalTiers on real files; the crash cases SIGKILL a child (tests/procs/store_child.py ``frozen``) at each
commit phase with the fault-injecting tier of :mod:`asymstore.testing`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from asymstore import AsymStore, CorruptVersionError, LocalTier, host_tier
from asymstore.export import export
from asymstore.format.manifest import MANIFEST_NAME, Manifest
from asymstore.format.names import version_dirname
from asymstore.format.parse import parse_manifest
from asymstore.fsck import check, repair
from asymstore.tiers.protocol import ReferencingTier
from tests.support.store import committed_steps, make_frozen_state, same_state, spawn, step_of, store_kw

BASE = ("base.w", "base.emb")


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def copies_on_disk(root: Path, t: torch.Tensor) -> set[int]:
    """How many times each chunk of ``t``'s bytes (store_kw's 4 KiB chunks) is in the segment files under ``root``."""
    data, on_disk = tensor_bytes(t), files_bytes(root)
    return {on_disk.count(data[at:at + 4096]) for at in range(0, len(data), 4096)}


def files_bytes(root: Path) -> bytes:
    """Every segment file under ``root`` (quarantine included), concatenated."""
    out = []
    for dirpath, _, names in os.walk(root):
        out += [Path(dirpath, n).read_bytes() for n in sorted(names) if n.startswith("seg-")]
    return b"\x00".join(out)


def manifest_of(root: Path, step: int) -> Manifest:
    return parse_manifest((root / version_dirname(step) / MANIFEST_NAME).read_bytes())


def own_bytes(state: dict[str, torch.Tensor], names: tuple[str, ...]) -> int:
    return sum(state[n].numel() * state[n].element_size() for n in names)


async def test_frozen_base_written_once_across_20_versions_and_retention(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    trainable = own_bytes(make_frozen_state(1), ("adapter.a", "step"))
    for first, last in ((1, 10), (11, 20)):  # reopened half way: the new store references what the old one wrote
        async with AsymStore([LocalTier(root)], keep_last=3, **store_kw()) as store:
            for step in range(first, last + 1):
                await store.put_many(step, make_frozen_state(step))
                result = await store.commit(step)
                if step > 1:
                    assert result.manifest.written_bytes <= trainable + 4096, step  # the adapter, not the base
                    assert set(result.manifest.references) == {1}
    state = make_frozen_state(20)
    for name in BASE:  # the base's bytes are on disk exactly once, after 20 versions and 17 retention deletes
        assert copies_on_disk(root, state[name]) == {1}, name
    kept = os.listdir(root / version_dirname(1))  # the first version: its segments, no manifest
    assert kept and MANIFEST_NAME not in kept
    assert sorted(int(d[1:]) for d in os.listdir(root) if d.startswith("v")) == [1, 18, 19, 20]
    report = check(str(root), deep=True)
    assert report.ok, report.problems
    assert {e.name: (e.status, e.referenced_by) for e in report.entries}[version_dirname(1)] == ("retained",
                                                                                                 [18, 19, 20])
    async with AsymStore([LocalTier(root)], read_only=True, **store_kw()) as store:
        for step in (18, 19, 20):
            assert same_state((await store.restore(step)).tensors, make_frozen_state(step))



async def commit_frozen(store: AsymStore, steps: range) -> None:
    """Commit the frozen-base state of each of ``steps``."""
    for step in steps:
        await store.put_many(step, make_frozen_state(step))
        await store.commit(step)

async def test_last_version_that_references_a_segment_takes_it_along(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    async with AsymStore([LocalTier(root)], keep_last=2, **store_kw()) as store:
        await commit_frozen(store, range(1, 4))
        changed = {k: v + 1 if v.is_floating_point() else v for k, v in make_frozen_state(4).items()}
        for step in (4, 5, 6):  # the base changes at 4: step 1's segments are needed until 3 goes
            await store.put_many(step, changed)
            await store.commit(step)
    # 1 went with 3, the last version that referenced it; 4 (deleted) stays for 5 and 6, which reference it
    assert sorted(d for d in os.listdir(root) if d.startswith("v")) == [version_dirname(s) for s in (4, 5, 6)]
    assert not (root / version_dirname(4) / MANIFEST_NAME).exists()
    assert set(manifest_of(root, 6).references) == {4}
    assert check(str(root), deep=True).ok


async def test_flipped_byte_in_a_referenced_chunk_fails_every_version_that_uses_it(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    changed = {k: v * 2 if v.is_floating_point() else v for k, v in make_frozen_state(0).items()}

    def state(step: int) -> dict[str, torch.Tensor]:
        return make_frozen_state(step) | ({n: changed[n] for n in BASE} if step >= 3 else {})

    async with AsymStore([LocalTier(root)], keep_last=None, **store_kw()) as store:
        for step in range(1, 7):  # 1-2: base A (2 references 1); 3-6: base B, written at 3, referenced by 4-6
            await store.put_many(step, state(step))
            await store.commit(step)
    m3 = manifest_of(root, 3)
    chunk = m3.tensors["base.w"].chunks[0]
    assert all(manifest_of(root, s).tensors["base.w"].chunks[0].segment == f"{chunk.segment}@3" for s in (4, 5, 6))
    seg = root / version_dirname(3) / chunk.segment
    data = bytearray(seg.read_bytes())
    data[chunk.offset + 100] ^= 0x10
    seg.write_bytes(bytes(data))

    report = check(str(root), deep=True)
    status = {e.step: e.status for e in report.entries}
    assert status == {1: "committed", 2: "committed", 3: "corrupt", 4: "corrupt", 5: "corrupt", 6: "corrupt"}
    for step in (3, 4, 5, 6):  # fsck names every version that uses the chunk, and the tensor
        assert any(f"{version_dirname(step)}: corrupt:" in p and "base.w" in p for p in report.problems), step
    async with AsymStore([LocalTier(root)], keep_last=None, **store_kw()) as store:
        ck = await store.restore()
        assert ck.step == 2 and same_state(ck.tensors, state(2))  # past every version that uses it
        assert [f.split()[1] for f in ck.fallbacks] == ["6", "5", "4", "3"]
        with pytest.raises(CorruptVersionError):
            await store.restore(5)
        await store.put_many(7, state(7))  # the next version never references the damaged bytes again
        result = await store.commit(7)
        assert 3 not in result.manifest.references and result.manifest.written_bytes >= own_bytes(state(7), BASE)
        assert same_state((await store.restore()).tensors, state(7))


async def test_export_follows_references(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    async with AsymStore([LocalTier(root)], keep_last=2, **store_kw()) as store:
        await commit_frozen(store, range(1, 5))
    assert set(manifest_of(root, 4).references) == {1}
    out = tmp_path / "out.safetensors"
    summary = await export(str(root), "safetensors", str(out), prefix="")
    assert summary["step"] == 4
    assert same_state(load_file(str(out)), make_frozen_state(4))


async def test_a_tier_without_the_capability_or_references_off_writes_full_bytes(tmp_path: Path) -> None:
    full = own_bytes(make_frozen_state(1), tuple(make_frozen_state(1)))
    host = host_tier(1 << 20)
    assert not isinstance(host, ReferencingTier) and isinstance(LocalTier(tmp_path), ReferencingTier)
    for tiers, options in (([host], {}), ([LocalTier(tmp_path / "off")], {"references": "off"})):
        async with AsymStore(tiers, keep_last=2, **store_kw(), **options) as store:  # type: ignore[arg-type]
            for step in range(1, 4):
                await store.put_many(step, make_frozen_state(step))
                result = await store.commit(step)
                assert not result.manifest.references and result.manifest.written_bytes >= full
                assert all("step" not in seg for seg in json.loads(result.manifest.to_json())["segments"])
            assert same_state((await store.restore()).tensors, make_frozen_state(3))
    with pytest.raises(ValueError, match="references"):
        AsymStore([LocalTier(tmp_path / "x")], references="sometimes")  # type: ignore[arg-type]


CRASHES = [
    ("retention", 0), ("manifest_half", 2),
    pytest.param("segments_written", 2, marks=pytest.mark.exhaustive),
    pytest.param("published", 1, marks=pytest.mark.exhaustive),
    pytest.param("retention", 3, marks=pytest.mark.exhaustive),
]


@pytest.mark.parametrize(("phase", "after"), CRASHES)
async def test_a_kill_at_any_phase_leaves_nothing_that_loads_wrong(tmp_path: Path, phase: str, after: int) -> None:
    root = tmp_path / "ckpt"
    proc = spawn("frozen", str(root), phase, str(after), str(after + 4))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    reported = committed_steps(out)
    async with AsymStore([LocalTier(root)], keep_last=2, **store_kw()) as store:  # opening sweeps
        ck = await store.restore()
        # the version in flight is committed once published, though the child died before it could say so
        in_flight = [step_of(len(reported))] if phase in ("published", "retention") else []
        assert ck.step in [reported[-1], *in_flight]
        assert same_state(ck.tensors, make_frozen_state(ck.step))
        for i in range(len(reported) + 1, len(reported) + 3):  # the run goes on, referencing what survived
            await store.put_many(step_of(i), make_frozen_state(step_of(i)))
            result = await store.commit(step_of(i))
            assert result.manifest.references
        assert same_state((await store.restore()).tensors, make_frozen_state(step_of(len(reported) + 2)))
    report = check(str(root), deep=True)
    assert report.ok, report.problems
    assert copies_on_disk(root, make_frozen_state(0)["base.w"]) == {1}


BOUNDED = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
Edit = st.sampled_from(["same", "same", "one_element", "all", "dtype", "shape", "gone"])


@given(edits=st.lists(st.tuples(Edit, Edit, Edit), min_size=2, max_size=6),
       keep_last=st.sampled_from([1, 2, None]), compression=st.sampled_from(["never", "always"]))
@BOUNDED
def test_any_edit_sequence_restores_every_kept_version_bit_exact(
        tmp_path_factory: pytest.TempPathFactory, edits: list[tuple[str, str, str]], keep_last: int | None,
        compression: str) -> None:
    root = tmp_path_factory.mktemp("refs")
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3 * 1024 + 5, generator=g), "b": torch.zeros(2048, dtype=torch.bfloat16),
             "c": torch.arange(700, dtype=torch.int64)}
    written: dict[int, dict[str, torch.Tensor]] = {}

    def edit(t: torch.Tensor, how: str) -> torch.Tensor | None:
        t = t.clone()
        if how == "one_element":
            t.view(-1)[min(5000, t.numel() - 1) % t.numel()] += 1
        elif how == "all":
            t += 1
        elif how == "dtype":
            t = t.to(torch.float64 if t.dtype != torch.float64 else torch.float32)
        elif how == "shape":
            t = t[: t.numel() - 1]
        return None if how == "gone" else t

    async def run() -> None:
        async with AsymStore([LocalTier(root)], keep_last=keep_last, **store_kw(compression)) as store:
            current = dict(state)
            for step, how in enumerate(edits, start=1):
                if step > 1:
                    current = {k: e for (k, t), h in zip(current.items(), how, strict=False)
                               if (e := edit(t, h)) is not None} or {"a": state["a"]}
                await store.put_many(step, current)
                manifest = (await store.commit(step)).manifest
                before = written.get(step - 1, {})
                for name, t in current.items():  # an unchanged tensor is referenced, a changed one written
                    was = before.get(name)
                    unchanged = was is not None and same_state({name: was}, {name: t}) and t.numel() > 0
                    referenced = ["@" in c.segment for c in manifest.tensors[name].chunks]  # reference keys
                    if unchanged:
                        assert all(referenced), (step, name)
                    if was is None:
                        assert not any(referenced), (step, name)
                written[step] = current
                assert same_state((await store.restore()).tensors, current)
        async with AsymStore([LocalTier(root)], read_only=True, **store_kw()) as store:
            for step in next(iter(store.versions().values())):
                assert same_state((await store.restore(step)).tensors, written[step])
    asyncio.run(run())
    report = check(str(root), deep=True)
    assert report.ok, report.problems


async def test_repair_moves_the_damaged_versions_aside_and_keeps_what_the_sound_ones_reference(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    changed = {k: v * 2 if v.is_floating_point() else v for k, v in make_frozen_state(0).items()}
    async with AsymStore([LocalTier(root)], keep_last=None, **store_kw()) as store:
        for step in range(1, 5):  # 4 changes base.emb only: its base.w chunks still come from 1
            edit = {"base.emb": changed["base.emb"]} if step == 4 else {}
            await store.put_many(step, make_frozen_state(step) | edit)
            await store.commit(step)
    m2 = manifest_of(root, 2)
    chunk = m2.tensors["adapter.a"].chunks[0]  # written by 2, referenced by none: 3 has its own adapter
    assert "@" not in chunk.segment and set(manifest_of(root, 4).references) == {1}
    emb = manifest_of(root, 1).tensors["base.emb"].chunks[0]  # written by 1, used by 1, 2, 3; not by 4
    seg = root / version_dirname(1) / emb.segment
    data = bytearray(seg.read_bytes())
    data[emb.offset] ^= 1
    seg.write_bytes(bytes(data))
    report = check(str(root), deep=True)
    assert {e.step: e.status for e in report.entries} == {1: "corrupt", 2: "corrupt", 3: "corrupt", 4: "committed"}
    repair(report)
    after = check(str(root), deep=True)
    assert after.ok, after.problems
    assert {e.step: e.status for e in after.entries if e.status != "quarantined"} == {1: "retained", 4: "committed"}
    async with AsymStore([LocalTier(root)], read_only=True, **store_kw()) as store:
        assert same_state((await store.restore()).tensors,
                          make_frozen_state(4) | {"base.emb": changed["base.emb"]})
