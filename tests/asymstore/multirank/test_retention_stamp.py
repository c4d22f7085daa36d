"""Retention.stamp: the one place that records a retention decision, for a single store and a multi-rank one alike."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from asymstore import AsymStore, KeepBest, LocalTier
from asymstore.errors import InvalidMetaError
from asymstore.policy.retention import META_KEY, Retention

RULES = Retention(keep_last=2, keep_every=10, keep_best=KeepBest("loss", "min", 1))


def test_stamp_records_the_pin_the_metric_and_the_rules_and_copies_the_metrics_into_another_meta() -> None:
    shard = {"metrics": {"loss": 0.5}, "x": 1}
    into: dict[str, Any] = {"tag": "t"}
    RULES.stamp(20, shard, into)
    assert into[META_KEY] == {"retention": {"rules": RULES.to_json(), "pinned": "keep_every",
                                            "metric": {"name": "loss", "value": 0.5}}}
    assert into["metrics"] == {"loss": 0.5} and into["tag"] == "t" and "x" not in into
    assert RULES.note_of(into).pinned and RULES.note_of(into).metric == 0.5
    own = dict(shard)
    RULES.stamp(21, own, own)  # a single store: the version's own meta
    assert own[META_KEY]["retention"] == {"rules": RULES.to_json(), "metric": {"name": "loss", "value": 0.5}}


def test_stamp_writes_nothing_when_no_rule_reads_notes_and_refuses_the_reserved_key() -> None:
    meta: dict[str, Any] = {META_KEY: "mine"}
    Retention(keep_last=3).stamp(10, meta, meta)
    assert meta == {META_KEY: "mine"}
    with pytest.raises(InvalidMetaError, match="own record"):
        RULES.stamp(10, {}, {META_KEY: {}})


def test_a_single_store_and_a_rank_store_stamp_the_same_record(tmp_path: Path) -> None:
    from asymstore.multirank import RankStore

    meta = {"metrics": {"loss": 0.25}}

    async def single() -> dict[str, Any]:
        async with AsymStore([LocalTier(tmp_path / "single")], keep_last=2, keep_every=10,
                             keep_best=KeepBest("loss", "min", 1)) as s:
            await s.put(10, "w", torch.ones(3))
            return dict((await s.commit(10, meta)).manifest.meta)

    async def multi() -> dict[str, Any]:
        async with RankStore(tmp_path / "multi", rank=0, world_size=1, keep_last=2, keep_every=10,
                             keep_best=KeepBest("loss", "min", 1)) as s:
            await s.put(10, "w", torch.ones(3))
            await s.commit(10, meta)
            assert s.last_global is not None
            return dict(s.last_global.meta)

    one, glob = asyncio.run(single()), asyncio.run(multi())
    assert one[META_KEY] == glob[META_KEY] and glob["metrics"] == meta["metrics"]

    async def refused() -> None:
        async with RankStore(tmp_path / "multi2", rank=0, world_size=1, keep_every=10) as s:
            await s.put(10, "w", torch.ones(3))
            await s.commit(10, global_meta={META_KEY: 1})

    with pytest.raises(InvalidMetaError):
        asyncio.run(refused())
