"""The store protocol: AsymStore and RankStore both satisfy it, and the Checkpointer takes either."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from asymcheck import Checkpointer
from asymstore import AsymStore, CheckpointStore, LocalTier, open_store
from asymstore.multirank import RankStore
from asymstore.protocols import CollectiveStore, ReshardingStore
from tests.support.asymcheck_train import data, equal_state, make_model, make_opt, tensors_of


def step_once(model: nn.Module, opt: torch.optim.Optimizer, it: int) -> None:
    x, y = data(it)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_both_stores_satisfy_the_protocol_and_nothing_else_passes_for_a_store(tmp_path: Path) -> None:
    plain = AsymStore([LocalTier(tmp_path / "plain")])
    ranked = RankStore(tmp_path / "mr", rank=0, world_size=1)
    for s in (plain, ranked):
        assert isinstance(s, CheckpointStore)
        assert open_store(s, keep_last=1) is s
    assert isinstance(ranked.local, AsymStore) and not isinstance(ranked, AsymStore)  # held, not inherited
    assert ranked.tiers == ranked.local.tiers
    # the capabilities the adapters check for: only the multi-rank store has them
    assert isinstance(ranked, CollectiveStore) and isinstance(ranked, ReshardingStore)
    assert not isinstance(plain, CollectiveStore) and not isinstance(plain, ReshardingStore)
    for other in ([LocalTier(tmp_path / "t")], str(tmp_path), tmp_path):
        assert not isinstance(other, CheckpointStore)


@pytest.mark.parametrize("kind", ["AsymStore", "RankStore"])
def test_the_checkpointer_takes_either_store_and_resumes_from_it(tmp_path: Path, kind: str) -> None:
    def make() -> Any:
        if kind == "AsymStore":
            return AsymStore([LocalTier(tmp_path / "a")], keep_last=2)
        return RankStore(tmp_path / "mr", rank=0, world_size=1, keep_last=2)

    model = make_model()
    opt, _ = make_opt(model)
    store = make()
    with Checkpointer(model, opt, store) as ckpt:
        assert ckpt.store is store
        for it in range(3):
            step_once(model, opt, it)
        after = tensors_of(model.state_dict())
    assert [vs for vs in (ckpt.final_versions or {}).values()] == [[2, 3]]
    if isinstance(store, RankStore):
        assert store.global_steps() == [2, 3]
    model2 = make_model(seed=3)
    opt2, _ = make_opt(model2)
    with Checkpointer(model2, opt2, make()) as ckpt:
        assert ckpt.resume() == 3
    equal_state(after, model2.state_dict())


def test_asymstore_api_was_split_into_values_and_protocols_and_its_names_warn_for_one_release() -> None:
    import importlib

    import asymstore.protocols
    import asymstore.values

    api = importlib.import_module("asymstore.api")
    moved = {"Checkpoint": asymstore.values, "CommitResult": asymstore.values, "TierStatus": asymstore.values,
             "FlushStats": asymstore.values, "TierCalibration": asymstore.values, "Targets": asymstore.values,
             "CheckpointStore": asymstore.protocols, "CollectiveStore": asymstore.protocols,
             "DropReportingStore": asymstore.protocols, "ReshardingStore": asymstore.protocols}
    for name, home in moved.items():
        with pytest.warns(DeprecationWarning, match=rf"asymstore\.api\.{name} is deprecated.*{home.__name__}"):
            assert getattr(api, name) is getattr(home, name)
    with pytest.raises(AttributeError):
        api.Manifest  # noqa: B018  (never lived there)
