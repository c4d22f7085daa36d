"""One way to open a store (asymstore/opener.py): every location kind x read_only x world, one rank/world rule.

Real stores over real directories (a ``file://`` URI for the remote tier); the world is set as a
launcher sets it (``RANK``/``WORLD_SIZE``) or by a real one-process gloo group. RankStores are only
built, never opened here: the collective paths run in tests/multirank (through the Checkpointer,
which opens its store with :func:`asymstore.open_store`).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import asymstore
from asymcheck import Checkpointer
from asymstore import AsymStore, LocalTier, RemoteTier, open_store
from asymstore.dcp import StorageReader, StorageWriter
from asymstore.dcp.spec import own_store
from asymstore.dist.world import rank_world
from asymstore.errors import InvalidValueError, RootLayoutError, StoreClosedError
from asymstore.format.names import parse_rank_dirname, rank_dirname
from asymstore.multirank import RankStore
from asymstore.runtime.loop import LoopThread, StoreLoop
from asymstore.tiers import from_location, rank_tier
from tests.support.ranks import run_ranks, store

Kind = str


@pytest.fixture
def world(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """The job as the environment describes it: one process (nothing set) or rank 1 of 2 (``RANK``/``WORLD_SIZE``)."""
    rank, size = request.param
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if size > 1:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(size))
    assert not (dist.is_available() and dist.is_initialized())
    return rank, size


def tensors(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(8, dtype=torch.float32) + step}


def commit_single(root: Path, steps: list[int]) -> None:
    async def go() -> None:
        async with AsymStore([LocalTier(root)], keep_last=None, compression="never") as s:
            for step in steps:
                await s.put_many(step, tensors(step))
                await s.commit(step)

    asyncio.run(go())


def commit_multirank(root: Path, steps: list[int]) -> None:
    async def go(rank: int) -> None:
        async with store(root, rank, 1, dist.HashStore()) as s:
            for step in steps:
                await s.put_many(step, tensors(step))
                await s.commit(step)

    out = run_ranks(1, go)
    assert out == {0: None}, out


def location_of(kind: Kind, tmp_path: Path) -> Any:
    """A location of ``kind``, with what the root holds made real."""
    root = tmp_path / "ckpt"
    if kind == "store":
        return AsymStore([LocalTier(root)])
    if kind == "tiers":
        return [LocalTier(tmp_path / "fast"), LocalTier(root)]
    if kind == "uri":
        root.mkdir()
        return f"file://{root}"
    if kind == "empty-dir":
        return str(root)
    if kind == "single-root":
        commit_single(root, [1, 2])
        return str(root)
    if kind == "multirank-root":
        commit_multirank(root, [1, 2])
        return root  # an os.PathLike
    raise AssertionError(kind)


ONE, TWO = (0, 1), (1, 2)

# (location kind, read_only, world) -> what open_store gives: a class name, "same" (the store itself),
# or the typed error it raises
TABLE: list[tuple[Kind, bool, tuple[int, int], str]] = [
    ("store", False, ONE, "same"), ("store", True, ONE, "same"), ("store", False, TWO, "same"),
    ("tiers", False, ONE, "AsymStore"), ("tiers", True, ONE, "AsymStore"), ("tiers", False, TWO, "AsymStore"),
    ("uri", False, ONE, "AsymStore"), ("uri", True, ONE, "AsymStore"), ("uri", True, TWO, "AsymStore"),
    ("empty-dir", False, ONE, "AsymStore"), ("empty-dir", True, ONE, "AsymStore"),
    ("empty-dir", False, TWO, "RankStore"), ("empty-dir", True, TWO, "AsymStore"),
    ("single-root", False, ONE, "AsymStore"), ("single-root", True, TWO, "AsymStore"),
    ("single-root", False, TWO, "RankStore"),  # several ranks resume a single-process root as a RankStore
    ("multirank-root", False, ONE, "RankStore"),  # one process goes on in the multi-rank layout
    ("multirank-root", False, TWO, "RankStore"),
    ("multirank-root", True, ONE, "RootLayoutError"), ("multirank-root", True, TWO, "RootLayoutError"),
]


@pytest.mark.parametrize(("kind", "read_only", "world", "expected"), TABLE, indirect=["world"],
                         ids=[f"{k}-{'ro' if r else 'rw'}-world{w[1]}" for k, r, w, _ in TABLE])
def test_each_location_kind_opens_the_store_its_layout_and_world_call_for(
        kind: Kind, read_only: bool, world: tuple[int, int], expected: str, tmp_path: Path) -> None:
    location = location_of(kind, tmp_path)
    if expected == "RootLayoutError":
        with pytest.raises(RootLayoutError, match="multi-rank root"):
            open_store(location, read_only=read_only)
        return
    opened = open_store(location, read_only=read_only, keep_last=2)
    if expected == "same":
        assert opened is location
        return
    assert type(opened).__name__ == expected
    if isinstance(opened, RankStore):
        rank, size = world if world[1] > 1 else (0, 1)
        assert (opened.rank, opened.world_size) == (rank, size)
        assert opened.root == os.path.abspath(os.fspath(location))
        assert opened.job.global_keep_last == 2
        return
    assert isinstance(opened, AsymStore)
    assert opened.read_only is read_only
    assert opened.retention.keep_last == (None if read_only else 2)  # a reader keeps (deletes) nothing
    tiers = opened.tiers
    if kind == "tiers":
        assert tiers == location
    elif kind == "uri":
        assert len(tiers) == 1 and isinstance(tiers[0], RemoteTier)
    else:
        assert len(tiers) == 1 and isinstance(tiers[0], LocalTier)
        assert tiers[0].root == os.path.abspath(location) and tiers[0].fsync is not read_only


@pytest.mark.parametrize("world", [ONE, TWO], indirect=True)
def test_a_read_only_store_reads_the_newest_version_and_writes_nothing(world: tuple[int, int], tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    commit_single(root, [3, 4])
    before = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))

    async def read() -> tuple[int, torch.Tensor]:
        s = await open_store(str(root), read_only=True).open()
        try:
            ckpt = await s.restore()
            return ckpt.step, ckpt.tensors["w"]
        finally:
            await s.close()

    step, w = asyncio.run(read())
    assert step == 4 and torch.equal(w, tensors(4)["w"])
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == before


def test_the_store_options_reach_the_store_built(tmp_path: Path) -> None:
    s = open_store(str(tmp_path / "a"), keep_last=None, keep_every=5, segment_bytes=1 << 16, compression="never",
                   close_timeout_s=7.0, wait_global=True)  # a RankStore's option: not the AsymStore's
    assert isinstance(s, AsymStore)
    assert (s.retention.keep_last, s.retention.keep_every) == (None, 5)
    assert (s.segment_bytes, s.compression, s.close_timeout_s) == (1 << 16, "never", 7.0)
    r = open_store(str(tmp_path / "b"), multirank=True, keep_last=4, keep_every=10, timeout_s=9.0,
                   restore_timeout_s=11.0, wait_global=True, segment_bytes=1 << 16)
    assert isinstance(r, RankStore)
    assert (r.job.timeout_s, r.job.restore_timeout_s, r.wait_global) == (9.0, 11.0, True)
    assert r.job.global_keep_last == 4 and r.job.rules is not None and r.job.rules.keep_every == 10
    assert r.local.segment_bytes == 1 << 16


def test_this_ranks_tiers_with_root_make_a_rankstore_over_them(tmp_path: Path) -> None:
    tiers = [LocalTier(tmp_path / "nvme")]
    r = open_store(tiers, root=tmp_path / "root", multirank=True)
    assert isinstance(r, RankStore) and r.local.tiers == tiers and r.root == str(tmp_path / "root")


@pytest.mark.parametrize(("location", "kw", "match"), [
    ("store", {"segment_bytes": 1}, "go to the store itself"),
    ("tiers", {"multirank": True}, "needs root="),
    ("uri", {"multirank": True}, "not a URI"),
    ("empty-dir", {"multirank": True, "read_only": True}, "never read-only"),
    ("empty-dir", {"multirank": True, "retention_floor": lambda: 3}, "retention floor"),
])
def test_what_cannot_be_opened_is_a_typed_error(location: Kind, kw: dict[str, Any], match: str,
                                                tmp_path: Path) -> None:
    with pytest.raises(InvalidValueError, match=match):
        open_store(location_of(location, tmp_path), **kw)


# -- one rank/world rule ---------------------------------------------------------------------------


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real gloo group of one process, while the environment claims rank 1 of 2."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_process_group")
def test_torch_distributed_when_initialised_wins_over_the_environment(tmp_path: Path) -> None:
    assert rank_world() == (0, 1)
    with pytest.warns(DeprecationWarning, match="env_rank_world is deprecated"):
        from asymstore.dist.world import env_rank_world
    assert env_rank_world(None, None) == (0, 1)  # the former name is the same rule
    assert env_rank_world(None, 3) == (0, 3)
    assert isinstance(open_store(str(tmp_path)), AsymStore)  # one process: not a RankStore of 2
    assert isinstance(open_store(str(tmp_path), keep_last=3), AsymStore)


@pytest.mark.parametrize("caller", ["rule", "checkpointer", "dcp"])
@pytest.mark.parametrize("world", [TWO], indirect=True)
def test_the_environment_rules_when_torch_distributed_is_not_initialised(world: tuple[int, int], caller: str,
                                                                         tmp_path: Path) -> None:
    if caller == "rule":
        assert rank_world() == world and rank_world(0, 4) == (0, 4)
        return
    # every caller follows it: the Checkpointer's store and the DCP writer's store are this rank's RankStore
    built = open_store(str(tmp_path), keep_last=3) if caller == "checkpointer" else own_store(str(tmp_path), 3, {},
                                                                                     read_only=False)
    assert isinstance(built, RankStore) and (built.rank, built.world_size) == world


@pytest.mark.parametrize("world", [ONE], indirect=True)
def test_nothing_set_is_one_process(world: tuple[int, int]) -> None:
    assert rank_world() == (0, 1)


def test_a_malformed_rank_in_the_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "one")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK='one'"):
        rank_world()


# -- the Checkpointer's store spec goes through open_store -------------------------------------------


def test_the_checkpointers_store_at_a_uri_is_a_remote_tier(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    s = open_store(f"file://{tmp_path / 'r'}", keep_last=3)
    assert isinstance(s, AsymStore) and isinstance(s.tiers[0], RemoteTier)


# -- tiers from a location -------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 7, 12345, 123456])
def test_rank_tier_is_the_directory_the_multirank_layout_names(rank: int, tmp_path: Path) -> None:
    name = rank_dirname(rank)
    assert name == f"rank-{rank:05d}" and parse_rank_dirname(name) == rank
    tier = rank_tier(tmp_path, rank)
    assert tier.root == os.path.join(str(tmp_path), name)
    assert tier.fsync is False  # read-only by default
    assert rank_tier(tmp_path, rank, read_only=False).fsync is True
    assert rank_tier(tmp_path, rank, read_only=False, fsync=False).fsync is False


def test_from_location_builds_the_tier_a_location_names(tmp_path: Path) -> None:
    local = from_location(tmp_path)
    assert isinstance(local, LocalTier) and local.root == str(tmp_path) and local.fsync
    reader = from_location(str(tmp_path), read_only=True)
    assert isinstance(reader, LocalTier) and not reader.fsync
    assert isinstance(from_location(f"file://{tmp_path}"), RemoteTier)
    assert asymstore.tiers.from_location is from_location and asymstore.open_store is open_store


# -- one loop thread -------------------------------------------------------------------------------


def test_one_loop_thread_class_serves_the_checkpointer_and_the_dcp_storage(tmp_path: Path) -> None:
    with Checkpointer(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters()),
                      tmp_path / "c") as ckpt:
        assert type(ckpt._loop) is StoreLoop and ckpt._loop.thread.name == "asymcheck-store"
    writer = StorageWriter(str(tmp_path / "w"))
    try:
        writer.open()
        assert writer._session is not None
        loop = writer._session.loop  # the store the root's writers of this process share, on its loop thread
        assert isinstance(loop, StoreLoop) and loop.thread.name == "asymstore-dcp-writer"
    finally:
        writer.close()
    assert writer._session is None
    reader = StorageReader(str(tmp_path / "w"))
    try:
        reader.steps()
        assert isinstance(reader._loop, StoreLoop) and reader._loop.thread.name == "asymstore-dcp-reader"
    finally:
        reader.close()


@pytest.mark.parametrize(("old", "name", "new"), [
    ("asymstore.dcp.loop", "LoopThread", LoopThread),
    ("asymstore.dist.world", "env_rank_world", rank_world),
    ("asymstore.dcp.spec", "dist_world", rank_world),
    ("asymstore.multirank.globaldir", "rank_dirname", rank_dirname),
])
def test_the_former_names_work_for_one_release_with_a_deprecation_warning(old: str, name: str,
                                                                          new: object) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} is deprecated"):
        assert getattr(module, name) is new
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_the_checkpointers_former_loop_and_store_builder_warn_for_one_release(tmp_path: Path) -> None:
    from asymcheck.versions import storeloop, storespec

    with pytest.warns(DeprecationWarning, match="storeloop.StoreLoop is deprecated"):
        old_loop = storeloop.StoreLoop
    assert issubclass(old_loop, StoreLoop)
    with pytest.warns(DeprecationWarning, match="make_store is deprecated"):
        built = storespec.make_store(str(tmp_path), 3)
    assert isinstance(built, AsymStore) and built.keep_last == 3
    loop = old_loop(AsymStore([LocalTier(tmp_path / "s")], keep_last=None, compression="never"))
    try:
        assert loop.thread.name == "asymcheck-store"
    finally:
        loop.close()


def test_the_store_loop_opens_runs_and_closes_the_store_on_its_thread(tmp_path: Path) -> None:
    s = AsymStore([LocalTier(tmp_path)], keep_last=None, compression="never")

    async def put_commit(step: int) -> None:
        await s.put_many(step, tensors(step))
        await s.commit(step)

    loop = StoreLoop(s, name="asymcheck-store")
    assert loop.thread.name == "asymcheck-store" and loop.thread.running
    loop.run(put_commit(5))
    fut = loop.submit(put_commit(6))
    assert fut.result(30) is None
    assert loop.close(timeout=30) is True
    assert not loop.thread.running
    with pytest.raises(StoreClosedError):
        loop.run(put_commit(7))
    assert asyncio.run(_versions(tmp_path)) == [5, 6]


async def _versions(root: Path) -> list[int]:
    async with AsymStore([LocalTier(root)], read_only=True) as s:
        return sorted(s.versions()[s.tiers[0].name])


def test_the_loop_refuses_to_wait_for_itself() -> None:
    thread = LoopThread("t")
    try:
        async def inner() -> None:
            thread.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="own loop thread"):
            thread.run(inner())
    finally:
        thread.stop()
    assert not thread.running


def test_a_store_that_fails_to_open_leaves_no_loop_thread(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(Exception):  # noqa: B017 (the tier's own error)
        StoreLoop(AsymStore([LocalTier(tmp_path / "file" / "sub")]), name="failing-open")
    assert "failing-open" not in {t.name for t in threading.enumerate()} - before


# -- "location" is the parameter's name -------------------------------------------------------------


def test_the_dcp_storages_take_location_and_their_former_keywords_warn(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        w = StorageWriter(location=str(tmp_path), keep_last=None)
        r = StorageReader(location=w)
    with pytest.warns(DeprecationWarning, match=r"StorageWriter\(store_or_tiers=...\) is deprecated"):
        old_w = StorageWriter(store_or_tiers=str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match=r"StorageReader\(source=...\) is deprecated"):
        old_r = StorageReader(source=str(tmp_path))
    assert old_w._spec == str(tmp_path / "old") and old_r._source_spec == str(tmp_path)
    assert w._spec == str(tmp_path) and r._source_spec is w
    with pytest.raises(TypeError, match="both location= and its former name store_or_tiers="):
        StorageWriter(str(tmp_path), store_or_tiers=str(tmp_path))
    with pytest.raises(TypeError, match="missing the argument 'location'"):
        StorageReader()


@pytest.mark.parametrize("world", [ONE, TWO], indirect=True)
def test_tiers_with_root_are_a_rankstore_only_when_several_ranks_run(world: tuple[int, int], tmp_path: Path) -> None:
    tiers = [LocalTier(tmp_path / "nvme")]
    opened = open_store(tiers, root=tmp_path / "root")
    if world[1] > 1:
        assert isinstance(opened, RankStore) and (opened.rank, opened.world_size) == world
        assert opened.local.tiers == tiers
    else:
        assert isinstance(opened, AsymStore) and opened.tiers == tiers
