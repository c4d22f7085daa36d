"""ResumableDistributedSampler: torch's order for a fresh epoch, and a cut resumed on any number of ranks.

Property-based (hypothesis): for a dataset size, a world size before and after the cut, a cut point,
shuffle, drop_last, seed and epoch, each rank's indices of a fresh epoch are ``DistributedSampler``'s;
after each rank took ``k`` indices, every rank's ``state_dict`` is the same, and the epoch resumed from
it on another number of ranks hands out every sample not yet taken once (padding aside), none taken
again; the pass after it is a whole epoch again. A state of another dataset is a typed error.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from asymcheck import StateMismatchError
from asymcheck.integrations.sampler import ResumableDistributedSampler


class Data:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def samplers(n: int, world: int, **kw: object) -> list[ResumableDistributedSampler]:
    return [ResumableDistributedSampler(Data(n), num_replicas=world, rank=r, **kw) for r in range(world)]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(1, 6), shuffle=st.booleans(), drop_last=st.booleans(),
       seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_a_fresh_epoch_is_distributed_samplers(n: int, world: int, shuffle: bool, drop_last: bool, seed: int,
                                               epoch: int) -> None:
    for r in range(world):
        ours = ResumableDistributedSampler(Data(n), num_replicas=world, rank=r, shuffle=shuffle, seed=seed,
                                           drop_last=drop_last)
        torchs = DistributedSampler(Data(n), num_replicas=world, rank=r, shuffle=shuffle, seed=seed,  # type: ignore[arg-type]
                                    drop_last=drop_last)
        ours.set_epoch(epoch)
        torchs.set_epoch(epoch)
        assert list(ours) == list(torchs)
        assert len(ours) == len(torchs)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(1, 6), after=st.integers(1, 6), cut=st.integers(0, 60),
       shuffle=st.booleans(), drop_last=st.booleans(), seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_a_cut_epoch_resumes_on_any_number_of_ranks(n: int, world: int, after: int, cut: int, shuffle: bool,
                                                    drop_last: bool, seed: int, epoch: int) -> None:
    kw = {"shuffle": shuffle, "seed": seed, "drop_last": drop_last}
    before = samplers(n, world, **kw)
    for s in before:
        s.set_epoch(epoch)
    k = min(cut, len(before[0]))
    taken = [list(islice(iter(s), k)) if k else [] for s in before]
    states = [s.state_dict() for s in before]
    assert all(state == states[0] for state in states)  # no rank in it: any rank's state resumes any rank
    order = DistributedSampler(Data(n), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
    order.set_epoch(epoch)
    epoch_order = list(order)
    consumed = states[0]["consumed"]
    assert consumed == min(k * world, n)
    assert Counter(x for t in taken for x in t) >= Counter(epoch_order[:consumed])  # what was taken: its head

    resumed = samplers(n, after, **kw)
    for s in resumed:
        s.load_state_dict(states[0])
        s.set_epoch(epoch)  # the loop sets the epoch it resumes in: the position stays
    rest = [x for s in resumed for x in s]
    assert not set(rest) & set(epoch_order[:consumed])  # nothing taken comes again
    if drop_last:
        assert set(rest) <= set(epoch_order[consumed:])
        assert 0 <= (n - consumed) - len(rest) < after
    else:
        assert set(rest) == set(epoch_order[consumed:])  # every sample not yet taken comes
        assert 0 <= len(rest) - (n - consumed) < after  # padding only
    for s in resumed:  # the next pass of the same epoch is whole again
        assert len(list(s)) == len(samplers(n, after, **kw)[s.rank])


def test_a_state_of_another_dataset_or_seed_is_refused() -> None:
    state = samplers(10, 2, seed=1)[0].state_dict()
    with pytest.raises(StateMismatchError, match="dataset of 10 samples"):
        samplers(11, 2, seed=1)[0].load_state_dict(state)
    with pytest.raises(StateMismatchError, match="seed 1"):
        samplers(10, 2, seed=2)[0].load_state_dict(state)
    with pytest.raises(StateMismatchError, match="not a ResumableDistributedSampler state"):
        samplers(10, 2)[0].load_state_dict({"epoch": 0})
    with pytest.raises(StateMismatchError, match="outside the epoch"):
        samplers(10, 2, seed=1)[0].load_state_dict({**state, "consumed": 11})


def test_a_new_epoch_starts_whole_after_a_resume() -> None:
    s = samplers(12, 3, seed=4)[1]
    s.set_epoch(2)
    list(islice(iter(s), 2))
    state = s.state_dict()
    t = samplers(12, 2, seed=4)[0]
    t.load_state_dict(state)
    t.set_epoch(3)  # another epoch than the one resumed: from its start
    assert len(list(t)) == 6


def test_len_is_a_whole_epoch_and_left_is_what_a_resumed_pass_hands_out() -> None:
    s = samplers(20, 2, seed=1)[0]
    list(islice(iter(s), 4))
    t = samplers(20, 2, seed=1)[1]
    t.load_state_dict(s.state_dict())
    assert len(t) == 10 and t.left == 6  # step // len(loader) still names the epoch after a resume
    assert len(list(t)) == 6


def test_a_loader_with_workers_is_refused_at_its_first_batch() -> None:
    """Workers prefetch indices ahead of training: a position counted from them would skip batches."""
    import torch

    from asymcheck import UnsupportedConfigError

    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    sampler = ResumableDistributedSampler(dataset, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=1)
    with pytest.raises(UnsupportedConfigError, match="num_workers=1"):
        next(iter(loader))
    plain = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=0)
    assert sum(len(b[0]) for b in plain) == 16


def test_a_resume_with_another_seed_is_refused_before_anything_loads(tmp_path: Path) -> None:
    import torch

    from asymcheck import Checkpointer

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, ResumableDistributedSampler]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 4)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), samplers(8, 1, seed=seed)[0]

    model, opt, sampler = build(0)
    with Checkpointer(model, opt, tmp_path, data={"sampler": sampler}) as ckpt:
        ckpt.resume()
        for index in islice(iter(sampler), 3):
            model(torch.full((1, 4), float(index))).sum().backward()
            opt.step()
            opt.zero_grad()
    model, opt, sampler = build(1)
    before = [p.detach().clone() for p in model.parameters()]
    with Checkpointer(model, opt, tmp_path, data={"sampler": sampler}) as ckpt:
        with pytest.raises(StateMismatchError, match="seed 0"):
            ckpt.resume()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        ckpt.save_on_close = False
