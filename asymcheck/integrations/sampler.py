"""A ``DistributedSampler`` whose position goes into a version and resumes on any number of ranks.

``torch.utils.data.DistributedSampler`` has no state: a job restarted inside an epoch either trains the
epoch again from its start or skips batches by count, which is only right on the same number of ranks.
:class:`ResumableDistributedSampler` draws the same order (for a fresh epoch, rank for rank, the
indices ``DistributedSampler`` draws) and counts the indices it hands out. Its ``state_dict`` is the
epoch and how many positions of the epoch's global order were consumed: positions are handed out
round-robin (rank ``r`` of ``W`` takes positions ``r, r + W, ...``), so after each rank took ``k`` indices
the first ``k * W`` positions are the consumed ones, on every rank alike. The state holds no rank and no
world size. After a resume on ``W'`` ranks the rest of the epoch, positions ``consumed ...``, is dealt out
round-robin over the ``W'`` ranks (padded by repeating its first indices, or cut with ``drop_last``, as
``DistributedSampler`` does for a whole epoch): every sample of the epoch not yet trained comes once,
none trained comes again, on the same or another number of ranks.

Give it to the loader and to the Checkpointer as a ``data=`` object (its position changes when a batch
is drawn, so it is taken when the step returns)::

    sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, generator=torch.Generator())
    with Checkpointer(model, optimizer, "ckpt", data={"sampler": sampler}) as ckpt:
        ...

Give the loader a ``generator`` of its own: a ``DataLoader`` draws a base seed for its workers at every
``iter()``, from its ``generator`` or else from the global RNG. From the global RNG, a resumed process
draws it at the resume instead of at the interrupted epoch's start, so every random draw after it
(dropout) differs from the uninterrupted run.

It counts the indices the loader took from it. A loader with ``num_workers > 0`` takes indices ahead of
the batches trained (its prefetch), so the count would run ahead of training: such a loader is refused
with :class:`asymcheck.errors.UnsupportedConfigError` at its first batch. Use it with ``num_workers=0``.
``len()`` is a whole epoch's count per rank, as ``DistributedSampler``'s (so ``step // len(loader)``
still names the epoch after a resume); :attr:`ResumableDistributedSampler.left` is what a resumed
pass hands out.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sized
from types import FrameType
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from asymcheck.errors import StateMismatchError, UnsupportedConfigError

__all__ = ["ResumableDistributedSampler"]


def _refuse_worker_loader(frame: FrameType | None) -> None:
    """Refuse a loader iterator with worker processes among the callers: it takes indices ahead of training.

    The count of indices handed out is the position only when the loader takes a batch's indices as the
    loop asks for that batch; a worker loader takes ``prefetch_factor * num_workers`` batches ahead, and a
    position counted so would skip them after a resume. Torch's loader iterators keep their worker
    count as ``_num_workers``; the test of this refusal (tests/asymcheck/integrations/test_sampler.py)
    fails if a torch release renames it.
    """
    for _ in range(12):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        workers = getattr(owner, "_num_workers", 0) if hasattr(owner, "_sampler_iter") else 0
        if isinstance(workers, int) and workers > 0:
            raise UnsupportedConfigError(
                f"ResumableDistributedSampler under a DataLoader with num_workers={workers}: the loader takes "
                "indices ahead of the batches trained (its prefetch), so the position in a version would skip "
                "them after a resume; use num_workers=0, or the framework's ResumableLoader, which counts batches")
        frame = frame.f_back


class ResumableDistributedSampler(DistributedSampler[int]):
    """``DistributedSampler`` with a position that a version takes and any number of ranks resumes.

    Args:
        dataset: the dataset sampled (its ``len`` is the epoch's size).
        num_replicas: ranks (default: the process group's world size).
        rank: this rank (default: the process group's rank).
        shuffle: shuffle each epoch by ``seed + epoch``, as ``DistributedSampler``.
        seed: the shuffle's seed, the same on every rank.
        drop_last: cut the epoch's rest to a multiple of the ranks instead of padding it.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        """Sample ``dataset`` as ``DistributedSampler`` does, counting what is handed out."""
        if num_replicas is None or rank is None:
            world, me = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() \
                else (1, 0)
            num_replicas = world if num_replicas is None else num_replicas
            rank = me if rank is None else rank
        super().__init__(cast("Dataset[Any]", dataset), num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self._size = len(dataset)
        self._start = 0  # positions of the epoch's order consumed before this pass
        self._taken = 0  # indices this rank handed out in this pass
        self._restored_epoch: int | None = None  # set_epoch of this epoch keeps the restored position

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self._size, generator=g).tolist()
        return list(range(self._size))

    def _rest(self) -> list[int]:
        """The epoch's positions not yet consumed, padded or cut to a multiple of the ranks."""
        rest = self._order()[self._start:]
        if self.drop_last:
            return rest[:len(rest) - len(rest) % self.num_replicas]
        pad = -len(rest) % self.num_replicas
        while pad > 0 and rest:
            rest += rest[:pad]
            pad = -len(rest) % self.num_replicas
        return rest

    def __iter__(self) -> Iterator[int]:
        """This rank's indices of the rest of the epoch (the whole epoch unless resumed inside it).

        Raises:
            UnsupportedConfigError: (at the first index) a loader with worker processes draws from it.
        """
        mine = self._rest()[self.rank::self.num_replicas]
        self._taken = 0
        _refuse_worker_loader(sys._getframe(1))
        for index in mine:
            self._taken += 1
            yield index
        self._start, self._taken, self._restored_epoch = 0, 0, None  # the pass is over: the next is whole

    def __len__(self) -> int:
        """This rank's indices in a whole epoch, as ``DistributedSampler`` (a resumed pass hands out :attr:`left`)."""
        return self.num_samples

    @property
    def left(self) -> int:
        """This rank's indices still to come in the current pass (fewer than ``len`` after a resume inside it)."""
        return len(self._rest()) // self.num_replicas - self._taken

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (from its beginning, unless it is the epoch a resume put the sampler inside)."""
        if epoch != self._restored_epoch:
            self._start, self._taken, self._restored_epoch = 0, 0, None
        super().set_epoch(epoch)

    @property
    def consumed(self) -> int:
        """Positions of the current epoch's order consumed on all ranks together."""
        return min(self._start + self._taken * self.num_replicas, self._size)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the positions of its order consumed; no rank, no world size."""
        return {"epoch": self.epoch, "consumed": self.consumed, "size": self._size, "seed": self.seed,
                "shuffle": self.shuffle}

    def check_state_dict(self, state: Any) -> None:
        """Refuse ``state`` unless it is a position of this sampler's epochs (a resume asks before loading).

        Raises:
            StateMismatchError: the state is of another dataset size, seed or shuffle setting, or malformed.
        """
        try:
            consumed = int(state["consumed"])
            int(state["epoch"])
            same = (int(state["size"]), int(state["seed"]), bool(state["shuffle"])) == (
                self._size, self.seed, self.shuffle)
        except (KeyError, TypeError, ValueError) as exc:
            raise StateMismatchError(f"not a ResumableDistributedSampler state: {state!r}") from exc
        if not same:
            raise StateMismatchError(
                f"the sampler state is of a dataset of {state['size']} samples, seed {state['seed']}, shuffle "
                f"{state['shuffle']}; this sampler has {self._size}, {self.seed}, {self.shuffle}")
        if not 0 <= consumed <= self._size:
            raise StateMismatchError(f"consumed {consumed} is outside the epoch of {self._size} samples")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the epoch ``state`` describes at its first unconsumed position, on this sampler's ranks.

        Raises:
            StateMismatchError: see :meth:`check_state_dict` (a Checkpointer asks that before loading anything).
        """
        self.check_state_dict(state)
        self.epoch = int(state["epoch"])
        self._start, self._taken = int(state["consumed"]), 0
        self._restored_epoch = self.epoch
