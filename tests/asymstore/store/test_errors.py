"""Every bad input gets its typed error, and the last committed version stays intact."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from asymstore import (
    AsymStore,
    AsymstoreError,
    CapacityError,
    LocalTier,
    NoCheckpointError,
    StepOrderError,
    VersionNotFoundError,
)
from asymstore.errors import (
    DuplicateNameError,
    EmptyStepError,
    InvalidMetaError,
    InvalidNameError,
    InvalidStepError,
    InvalidValueError,
    ManifestError,
    StepCommittedError,
    StoreClosedError,
)
from asymstore.format.manifest import seal_document
from asymstore.format.parse import parse_manifest
from asymstore.fsck import check


@pytest.fixture
async def store(tmp_path: object):  # type: ignore[no-untyped-def]
    async with AsymStore([LocalTier(str(tmp_path))]) as s:
        await s.put(5, "w", torch.arange(4))
        await s.commit(5, meta={"ok": True})
        yield s


async def assert_intact(store: AsymStore) -> None:
    ckpt = await store.restore()
    assert ckpt.step == 5 and torch.equal(ckpt.tensors["w"], torch.arange(4)) and ckpt.meta == {"ok": True}
    assert not ckpt.fell_back
    assert check(store.tiers[0].root, deep=True).ok  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["", "/abs/name", "a/../b", "..", "x\x00y", "C:\\win", 7, None])
async def test_bad_names(store: AsymStore, name: object) -> None:
    with pytest.raises(InvalidNameError):
        await store.put(6, name, torch.ones(1))  # type: ignore[arg-type]
    await assert_intact(store)


async def test_dotted_names_are_fine(store: AsymStore) -> None:
    await store.put(6, "model.layers.0..weight/..x", torch.ones(1))
    await store.put(6, "...", torch.ones(1))
    await store.commit(6)
    assert set((await store.restore()).tensors) == {"model.layers.0..weight/..x", "..."}


async def test_duplicate_name_in_one_step(store: AsymStore) -> None:
    await store.put(6, "a", torch.ones(1))
    with pytest.raises(DuplicateNameError):
        await store.put(6, "a", torch.zeros(1))
    with pytest.raises(DuplicateNameError):
        await store.put_many(6, {"b": torch.ones(1), "a": torch.ones(1)})
    await store.commit(6)
    ckpt = await store.restore()
    assert torch.equal(ckpt.tensors["a"], torch.ones(1))
    assert "b" not in ckpt.tensors  # put_many checked the batch before staging any of it


async def test_put_after_commit(store: AsymStore) -> None:
    with pytest.raises(StepCommittedError):
        await store.put(5, "x", torch.ones(1))
    await assert_intact(store)


async def test_put_older_than_newest(store: AsymStore) -> None:
    with pytest.raises(StepOrderError):
        await store.put(4, "x", torch.ones(1))
    await assert_intact(store)


async def test_commit_not_newer(store: AsymStore) -> None:
    with pytest.raises(StepCommittedError):
        await store.commit(5)
    with pytest.raises(StepOrderError):
        await store.commit(3)
    await assert_intact(store)


async def test_commit_nothing_put(store: AsymStore) -> None:
    with pytest.raises(EmptyStepError):
        await store.commit(6)
    await assert_intact(store)


@pytest.mark.parametrize("value", [[1, 2], 3.0, "tensor", None,
                                   torch.ones(2, 2).to_sparse(), torch.quantize_per_tensor(
                                       torch.ones(2), 0.1, 0, torch.qint8), torch.empty(2, device="meta")])
async def test_not_a_storable_tensor(store: AsymStore, value: object) -> None:
    with pytest.raises(InvalidValueError):
        await store.put(6, "x", value)
    with pytest.raises(EmptyStepError):
        await store.commit(6)  # the failed put left nothing behind
    await assert_intact(store)


@pytest.mark.parametrize("meta", [{"x": float("nan")}, {"x": object()}, {1: 2}, [1, 2], {"t": (1, 2)}])
async def test_bad_meta(store: AsymStore, meta: object) -> None:
    await store.put(6, "x", torch.ones(1))
    with pytest.raises(InvalidMetaError):
        await store.commit(6, meta=meta)  # type: ignore[arg-type]
    await store.commit(6)  # the staged step survived the refused commit
    assert (await store.restore()).step == 6


@pytest.mark.parametrize("step", [-1, 1.5, "7", True, None])
async def test_bad_steps(store: AsymStore, step: object) -> None:
    with pytest.raises(InvalidStepError):
        await store.put(step, "x", torch.ones(1))  # type: ignore[arg-type]
    await assert_intact(store)


async def test_restore_missing_step(store: AsymStore) -> None:
    with pytest.raises(VersionNotFoundError):
        await store.restore(step=4)
    await assert_intact(store)


async def test_restore_empty_store(tmp_path: object) -> None:
    async with AsymStore([LocalTier(str(tmp_path))]) as s:
        with pytest.raises(NoCheckpointError):
            await s.restore()


async def test_closed_store(tmp_path: object) -> None:
    s = AsymStore([LocalTier(str(tmp_path))])
    with pytest.raises(StoreClosedError):
        await s.put(0, "x", torch.ones(1))


def test_all_errors_share_one_root() -> None:
    for err in (DuplicateNameError, EmptyStepError, InvalidMetaError, InvalidNameError, InvalidValueError,
                ManifestError, NoCheckpointError, StepCommittedError, StepOrderError, VersionNotFoundError):
        assert issubclass(err, AsymstoreError)


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(format_version=99),
    lambda d: d["segments"][0].update(name="../../etc/passwd"),
    lambda d: d["segments"][0].update(name=".hidden"),
    lambda d: d["tensors"]["w"]["chunks"][0].update(offset=10**9),
    lambda d: d["tensors"]["w"].update(nbytes=3),
    lambda d: d.update(step=-1),
    lambda d: d["tensors"].update({"../x": d["tensors"]["w"]}),
])
async def test_manifest_validation_refuses_tampering(store: AsymStore, mutate: object) -> None:
    import json
    path = os.path.join(store.tiers[0].root, "v000000000005", "MANIFEST.json")  # type: ignore[attr-defined]
    with open(path, "rb") as f:
        doc = json.load(f)
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(ManifestError):  # re-sealed, as a forger would: the structural checks must catch it
        parse_manifest(seal_document(doc))


class _DiskFull(LocalTier):
    """Fault injection: the durable tier refuses one publish (OSError, or CapacityError when ``capacity``)."""

    fail = True
    capacity = False

    async def begin(self, step: int, nbytes: int):  # type: ignore[no-untyped-def]
        writer = await super().begin(step, nbytes)
        tier = self

        class W:
            async def write_segment(self, name, parts):  # type: ignore[no-untyped-def]
                if tier.fail and tier.capacity:
                    raise CapacityError("the durable tier is full")
                if tier.fail:
                    raise OSError(28, "No space left on device")
                await writer.write_segment(name, parts)

            async def publish(self, manifest):  # type: ignore[no-untyped-def]
                await writer.publish(manifest)

            async def abort(self):  # type: ignore[no-untyped-def]
                await writer.abort()

        return W()


@pytest.mark.parametrize("capacity", [False, True])
async def test_durable_failure_keeps_previous_and_allows_retry(tmp_path: object, capacity: bool) -> None:
    from asymstore import TierError, host_tier
    disk = _DiskFull(str(tmp_path))
    disk.fail = False
    disk.capacity = capacity
    async with AsymStore([host_tier(capacity_bytes=1 << 20), disk]) as s:
        await s.put(1, "w", torch.ones(2))
        await s.commit(1)
        disk.fail = True
        await s.put(2, "w", torch.full((2,), 2.0))
        with pytest.raises(CapacityError if capacity else TierError):
            await s.commit(2)
        assert s.versions() == {"host:memory": [1], disk.name: [1]}  # host copy rolled back
        assert not [n for n in os.listdir(str(tmp_path)) if n.startswith(".tmp")]  # aborted cleanly
        assert (await s.restore()).step == 1
        disk.fail = False
        await s.commit(2)  # the staged step is still there: retry succeeds
        assert (await s.restore()).tensors["w"].tolist() == [2.0, 2.0]


class _Gated(LocalTier):
    """Fault injection: the write of step 6 waits at ``begin`` until ``gate`` is set."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def begin(self, step: int, nbytes: int):  # type: ignore[no-untyped-def]
        if step == 6:
            self.entered.set()
            await self.gate.wait()
        return await super().begin(step, nbytes)


async def test_an_older_commit_started_during_a_newer_one_is_refused_typed(tmp_path: object) -> None:
    tier = _Gated(str(tmp_path))
    async with AsymStore([tier]) as s:
        await s.put(5, "w", torch.full((2,), 5.0))
        await s.put(6, "w", torch.full((2,), 6.0))
        six = asyncio.ensure_future(s.commit(6))
        await tier.entered.wait()  # commit 6 holds the tier
        five = asyncio.ensure_future(s.commit(5))
        await asyncio.sleep(0.05)
        tier.gate.set()
        await six
        with pytest.raises(StepOrderError):
            await five
        assert s.versions() == {tier.name: [6]}
        assert (await s.restore()).tensors["w"].tolist() == [6.0, 6.0]


async def test_a_read_only_store_reads_beside_a_live_writer_and_refuses_writes(tmp_path: object) -> None:
    from asymstore.errors import ReadOnlyStoreError

    root = str(tmp_path)
    async with AsymStore([LocalTier(root)]) as writer:
        await writer.put(1, "w", torch.ones(3))
        await writer.commit(1)
        pending = await writer.tiers[0].begin(2, 10)  # the writer's commit in flight
        async with AsymStore([LocalTier(root)], read_only=True) as reader:
            assert (await reader.restore()).step == 1
            with pytest.raises(ReadOnlyStoreError):
                await reader.put(2, "w", torch.ones(3))
            with pytest.raises(ReadOnlyStoreError):
                await reader.commit(2)
        assert os.path.isdir(pending.tmp)  # the reader swept nothing  # type: ignore[attr-defined]
        await pending.abort()
        await writer.put(2, "w", torch.full((3,), 2.0))
        await writer.commit(2)  # the writer still holds its root


# -- where the errors live ---------------------------------------------------------------------------

TOP_LEVEL_ERRORS = ["AsymstoreError", "CapacityError", "CorruptVersionError", "GlobalCommitError", "NoCheckpointError",
                    "RootLockedError", "StepOrderError", "TierError", "VersionNotFoundError", "WorldSizeMismatchError"]


def test_the_errors_training_code_catches_are_at_top_level_and_every_error_in_asymstore_errors() -> None:
    import asymstore
    import asymstore.errors as errors

    every = {name for name, value in vars(errors).items()
             if isinstance(value, type) and issubclass(value, errors.AsymstoreError)}
    assert set(TOP_LEVEL_ERRORS) <= every
    exported = {name for name in asymstore.__all__ if name in every}
    assert exported == set(TOP_LEVEL_ERRORS)
    for name in TOP_LEVEL_ERRORS:
        assert getattr(asymstore, name) is getattr(errors, name)


@pytest.mark.parametrize("name", ["InvalidValueError", "StepCommittedError", "ReadOnlyStoreError", "DCPStorageError",
                                  "PeerError", "ExportError", "StoreClosedError", "SnapshotSkippedError"])
def test_an_error_moved_off_the_top_level_works_there_for_one_release_with_a_warning(name: str) -> None:
    import asymstore
    import asymstore.errors as errors

    with pytest.warns(DeprecationWarning, match=rf"asymstore\.{name} is deprecated.*asymstore\.errors\.{name}"):
        assert getattr(asymstore, name) is getattr(errors, name)
    with pytest.warns(DeprecationWarning):  # every use warns (the name is not cached on the package)
        getattr(asymstore, name)
