"""Slicing DDP's replicated state: the balanced plan of pieces and the digest that compares replicas."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcheck import Checkpointer, InvalidOptionError
from asymcheck.state.replicas import SAMPLES, ReplicaSlicer, replica_digest, slice_plan
from asymstore.format.pieces import TensorLayout

shapes = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=12)


@settings(deadline=None)
@given(shapes=shapes, world=st.integers(2, 6))
def test_every_rank_s_pieces_cover_each_tensor_once_and_balance_the_bytes(shapes: list[tuple[int, ...]],
                                                                           world: int) -> None:
    sources = [torch.zeros(s, dtype=torch.float32) for s in shapes]
    plans = [dict(slice_plan(sources, r, world)) for r in range(world)]
    assert all(p.keys() == plans[0].keys() for p in plans)  # the same tensors sliced on every rank
    loads = [0] * world
    for i, t in enumerate(sources):
        if i not in plans[0]:
            assert t.dim() == 0 or t.shape[0] == 0
            continue
        rows = sorted((plans[r][i].offsets[0], plans[r][i].offsets[0] + plans[r][i].shape[0], r) for r in range(world))
        at = 0
        for lo, hi, r in rows:
            assert lo == at or lo == hi  # consecutive rows (empty pieces sit at the end)
            at = max(at, hi)
            layout = plans[r][i]
            assert TensorLayout.from_json(layout.to_json()) == layout  # a piece its placements give
            loads[r] += math.prod(layout.shape) * 4
        assert at == t.shape[0]
    # balanced up to each tensor's spread: its largest piece goes to the least loaded rank, so a tensor whose
    # pieces are p_0 >= ... >= p_last raises (max load - mean load) by at most p_0 - mean(p) <= p_0 - p_last
    # (equal pieces keep the balance; hypothesis found 5 ranks where "mean + the biggest piece" does not hold)
    spread = 0
    for i in range(len(sources)):
        if i in plans[0]:
            pieces = [math.prod(plans[r][i].shape) * 4 for r in range(world)]
            spread += max(pieces) - min(pieces)
    assert max(loads) <= sum(loads) / world + spread


def test_the_digest_tells_replicas_apart() -> None:
    g = torch.Generator().manual_seed(0)
    names = ["a", "b"]
    a = [torch.randn(300, 7, generator=g), torch.randn(5, generator=g)]
    b = [t.clone() for t in a]
    for full in (True, False):
        assert replica_digest(names, a, 3, full=full) == replica_digest(names, b, 3, full=full)
        assert replica_digest(["a", "c"], a, 3, full=full) != replica_digest(names, b, 3, full=full)
        assert replica_digest(names, [a[0].reshape(7, 300), a[1]], 3, full=full) != \
            replica_digest(names, a, 3, full=full)
    b[0][123, 4] += 1.0
    assert replica_digest(names, a, 3, full=True) != replica_digest(names, b, 3, full=True)
    stride = a[0].numel() // SAMPLES
    seen = {replica_digest(names, a, s, full=False) != replica_digest(names, b, s, full=False)
            for s in range(4 * stride)}
    assert seen == {True, False}  # a sample misses the changed element in some versions, not in all


@dataclass(frozen=True)
class TwoRanks:
    """What a multi-rank store tells the slicer (a RankStore of 2 ranks over a shared root), without the ranks."""

    rank: int = 0
    world_size: int = 2
    replicas_whole: bool = False
    slices_readable: bool = True


def test_a_module_declared_replicated_is_sliced_without_its_ddp_wrapper() -> None:
    """The integrations hand over the module inside the framework's DDP and say so (``replication="replicated"``)."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not ReplicaSlicer(TwoRanks(), model, optimizer, "replicas").enabled  # "detect": not a DDP model
    assert ReplicaSlicer(TwoRanks(), model, optimizer, "replicas", "replicated").enabled
    assert not ReplicaSlicer(TwoRanks(), model, optimizer, "off", "replicated").enabled  # dedup="off" wins
    assert not ReplicaSlicer(TwoRanks(world_size=1), model, optimizer, "replicas", "replicated").enabled
    assert not ReplicaSlicer(TwoRanks(slices_readable=False), model, optimizer, "replicas", "replicated").enabled


def test_an_unknown_replication_is_refused_before_anything_is_hooked(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(InvalidOptionError, match="replication"):
        Checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), str(tmp_path / "ck"),
                     replication="ddp")  # type: ignore[arg-type]
    assert not (tmp_path / "ck").exists()


def test_an_adapter_state_slices_and_digests_only_the_sources_it_names() -> None:
    """DeepSpeed below ZeRO-3: the model states file is replicated, each rank's ZeRO partition is its own."""
    from asymcheck.state.capture import Capture
    from asymcheck.state.replicas import ReplicatedState, slicer_for

    class Part:
        """A state whose ``rep/`` sources are replicated (the rest per rank)."""

        def __init__(self) -> None:
            self.told: bool | None = None

        def replicated(self, name: str) -> bool:
            return name.startswith("rep/")

        def slice_replicas(self, enabled: bool) -> None:
            self.told = enabled

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert slicer_for(TwoRanks(), object(), model, optimizer, "replicas", "replicated", adapter=True) is None
    caps, digests = [], []
    for rank in range(2):
        state = Part()
        assert isinstance(state, ReplicatedState)
        slicer = slicer_for(TwoRanks(rank=rank), state, model, optimizer, "replicas", "replicated", adapter=True)
        assert slicer is not None and slicer.enabled and state.told is True
        own = torch.full((6, 2), float(rank))  # differs per rank: neither sliced nor digested
        cap = Capture(names=["own/part", "rep/w", "rep/b"], sources=[own, torch.arange(12.0).reshape(6, 2),
                                                                    torch.arange(5.0)])
        slicer.apply(cap, 1)
        meta: dict[str, object] = {}
        slicer.finish(1, meta)
        caps.append(cap)
        digests.append(meta["replicas"]["digest"])  # type: ignore[index]
    assert digests[0] == digests[1]
    for cap in caps:
        assert sorted(cap.layouts) == ["rep/b", "rep/w"] and cap.sources[0].shape == (6, 2)
    assert caps[0].sources[1].shape[0] + caps[1].sources[1].shape[0] == 6
    assert caps[0].sources[2].shape[0] + caps[1].sources[2].shape[0] == 5
    off = Part()
    assert slicer_for(TwoRanks(), off, model, optimizer, "off", "replicated", adapter=True) is not None
    assert off.told is False  # dedup="off": the state is told nothing is sliced
