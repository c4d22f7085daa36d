"""The Checkpointer's keep_every / keep_best: 50 steps, a restart, exactly the expected versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from asymcheck import Checkpointer
from asymcheck.options import PacingOptions, PartitionOptions, RetentionOptions
from asymstore import KeepBest, open_store
from asymstore.errors import InvalidMetaError
from asymstore.multirank import RankStore
from asymstore.multirank.globaldir import list_global_steps
from tests.support.asymcheck_train import make_model, make_opt, step_once


def train(root: Path, until: int, best: KeepBest) -> dict[str, list[int]]:
    model = make_model()
    opt, _ = make_opt(model)
    with Checkpointer(model, opt, root, retention=RetentionOptions(keep_last=2, keep_every=10, keep_best=best),
                      partitions=PartitionOptions(warmup=1, min_partition_bytes=512),
                      pacing=PacingOptions(max_overhead=None)) as ckpt:
        start = ckpt.resume() or 0
        for it in range(start, until):
            step_once(model, opt, it)
            if (it + 1) % 5 == 0:  # an evaluation every 5 steps; step 15 is the best
                ckpt.log_metrics({"eval_loss": 0.1 if it + 1 == 15 else 1.0 + (it + 1) / 100})
    assert ckpt.final_versions is not None
    return ckpt.final_versions


def test_fifty_steps_then_a_restart_keep_every_tenth_the_best_and_the_newest_two(tmp_path: Path) -> None:
    best = KeepBest("eval_loss", "min", k=1)
    assert train(tmp_path / "c", 50, best) == {f"local:{tmp_path / 'c'}": [10, 15, 20, 30, 40, 49, 50]}
    assert train(tmp_path / "c", 56, best) == {f"local:{tmp_path / 'c'}": [10, 15, 20, 30, 40, 50, 55, 56]}


def test_metrics_must_be_finite_numbers(tmp_path: Path) -> None:
    model = make_model()
    opt, _ = make_opt(model)
    with Checkpointer(model, opt, tmp_path / "c") as ckpt:
        with pytest.raises(InvalidMetaError):
            ckpt.log_metrics({"loss": float("nan")})
        with pytest.raises(InvalidMetaError):
            ckpt.log_metrics({"loss": "low"})  # type: ignore[dict-item]


def test_a_multirank_root_keeps_by_the_same_rules(tmp_path: Path) -> None:
    root = tmp_path / "mr"
    (root / "global").mkdir(parents=True)  # a multi-rank root: the store is a RankStore (one rank here)
    store = open_store(root, keep_last=2, keep_every=10, keep_best=KeepBest("eval_loss", "min", k=1))
    assert isinstance(store, RankStore) and store.job.rules is not None and store.job.rules.keep_every == 10
    best = KeepBest("eval_loss", "min", k=1)
    assert list(train(root, 50, best).values()) == [[10, 15, 20, 30, 40, 49, 50]]
    assert list(train(root, 56, best).values()) == [[10, 15, 20, 30, 40, 50, 55, 56]]
    assert list_global_steps(str(root / "global")) == [10, 15, 20, 30, 40, 50, 55, 56]
