"""The coordinator publishes a version of slices only when every rank sliced the same replicated state where all see it.

Real files under a real root and a real (in-process) coordination store; the shards are stood in by
their committed version directories, which is all ``publish_global`` looks at besides the reports.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asymstore.dist.kv import KV, MemoryStore
from asymstore.errors import ReplicasDifferError
from asymstore.format.globalmanifest import ShardInfo
from asymstore.format.names import rank_dirname, version_dirname
from asymstore.format.replicas import REPLICAS_KEY, ReplicaClaim
from asymstore.multirank import globaldir
from asymstore.multirank.protocol import CommitRound, GlobalAnswer, ShardReport, commit_tag
from asymstore.multirank.publish import publish_global
from asymstore.multirank.store import RankStore
from asymstore.tiers.local import LocalTier


def _job(root: Path, world: int = 2) -> RankStore:
    store = RankStore(root, rank=0, world_size=world, kv=MemoryStore())
    store.job.client = KV(MemoryStore())
    (root / globaldir.GLOBAL_DIR).mkdir(parents=True, exist_ok=True)
    return store


def _commit(store: RankStore, step: int, digests: list[str | None], *, on_disk: bool = True) -> GlobalAnswer | None:
    rnd = CommitRound.of(store.job.kv, 0, commit_tag(step), store.world_size)
    for r, digest in enumerate(digests):
        if on_disk:
            (Path(store.root) / rank_dirname(r) / version_dirname(step)).mkdir(parents=True, exist_ok=True)
        summary = {} if digest is None else {REPLICAS_KEY: ReplicaClaim(store.world_size, digest, True).to_json()}
        rnd.report(r, ShardReport(ShardInfo(r, step, "0123456789abcdef", 8, 1, summary)))
    try:
        publish_global(store.job, rnd, step, {})
    except ReplicasDifferError:
        return rnd.wait_answer(1.0, "the answer")
    return None


def test_slices_of_one_state_are_published_and_differing_ones_never(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    store = _job(tmp_path)
    assert store.slices_readable and not store.replicas_whole
    assert _commit(store, 1, ["aa", "aa"]) is None
    assert store.global_steps() == [1]
    with caplog.at_level(logging.WARNING, logger="asymstore.multirank.publish"):
        answer = _commit(store, 2, ["aa", "bb"])
    assert answer is not None and answer.dropped and "replicas differ" in (answer.failed or "")
    assert "falls back to whole copies" in caplog.text
    assert store.replicas_whole and store.global_steps() == [1]
    assert _commit(store, 3, ["cc", "cc"]) is not None  # the job fell back: slices are refused from now on
    assert _commit(store, 4, [None, "cc"]) is not None
    assert _commit(store, 5, [None, None]) is None  # whole copies on every rank: published
    assert store.global_steps() == [1, 5]


def test_slices_rank_0_cannot_see_under_the_root_are_refused(tmp_path: Path) -> None:
    store = _job(tmp_path)
    answer = _commit(store, 1, ["aa", "aa"], on_disk=False)
    assert answer is not None and "does not see the shards" in (answer.failed or "")
    assert store.replicas_whole and store.global_steps() == []


def test_ranks_with_their_own_tiers_cut_slices_they_exchange_unless_told_whole(tmp_path: Path) -> None:
    """Tiers of each rank's own (node-local): slices are cut and exchanged at a restore (asymcheck.restore.exchange);
    ``own_tier_slices="whole"`` keeps whole copies."""
    own = RankStore(tmp_path / "root", rank=0, world_size=2, tiers=[LocalTier(tmp_path / "own")])
    assert own.slices_readable and own.job.exchange_slices
    assert RankStore(tmp_path / "root", rank=0, world_size=2,
                     peer_tiers=lambda r: [LocalTier(tmp_path / f"p{r}")]).slices_readable
    for kw in ({"tiers": [LocalTier(tmp_path / "own")]}, {"peer_tiers": lambda r: [LocalTier(tmp_path / f"p{r}")]}):
        assert not RankStore(tmp_path / "root", rank=0, world_size=2, own_tier_slices="whole", **kw).slices_readable
    assert not _job(tmp_path / "shared").job.exchange_slices  # the default tiers: read where written
    with pytest.raises(ValueError, match="own_tier_slices"):
        RankStore(tmp_path / "root", rank=0, world_size=2, own_tier_slices="maybe")  # type: ignore[arg-type]


def test_slices_on_tiers_of_each_ranks_own_are_published_though_not_under_the_root(tmp_path: Path) -> None:
    store = RankStore(tmp_path / "root", rank=0, world_size=2, kv=MemoryStore(), tiers=[LocalTier(tmp_path / "own")])
    store.job.client = KV(MemoryStore())
    (tmp_path / "root" / globaldir.GLOBAL_DIR).mkdir(parents=True, exist_ok=True)
    assert _commit(store, 1, ["aa", "aa"], on_disk=False) is None  # the ranks exchange them when they resume
    assert store.global_steps() == [1] and not store.replicas_whole
    assert _commit(store, 2, ["aa", "bb"], on_disk=False) is not None  # replicas that differ: still refused
    assert store.replicas_whole and store.global_steps() == [1]
