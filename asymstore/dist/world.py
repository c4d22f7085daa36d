"""This process's place in the job: its rank and the job's size, by one rule.

torch.distributed when its default process group is initialised; else ``RANK`` and
``WORLD_SIZE`` from the environment (a launcher such as ``torchrun`` sets both); else
rank 0 of a job of one process. Arguments given explicitly win over all three. Every
part of the library that derives a rank or a world size asks here (:func:`rank_world`;
its former name ``env_rank_world`` works for one release, with a ``DeprecationWarning``).
"""

from __future__ import annotations

import os
import sys

from asymstore.runtime.lazy import moved_getattr


def _from_torch() -> tuple[int, int] | None:
    """torch.distributed's rank and world size when its default group is initialised (None: it is not).

    torch is not imported here: a process that never imported ``torch.distributed`` cannot have
    initialised it (light tools such as ``python -m asymstore.fsck`` start without torch).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def _from_env() -> tuple[int, int] | None:
    """``RANK`` and ``WORLD_SIZE`` from the environment (None: either is missing).

    Raises:
        ValueError: either is set but is not an integer.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} must be "
                         "integers") from None


def rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """This process's rank and the job's size: as given, else torch.distributed, else the environment, else (0, 1).

    Args:
        rank: this process's rank (None: by the rule).
        world_size: the job's number of processes (None: by the rule).

    Raises:
        ValueError: ``RANK`` or ``WORLD_SIZE`` is needed and is not an integer.
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    found = _from_torch() or _from_env() or (0, 1)
    return (found[0] if rank is None else rank), (found[1] if world_size is None else world_size)


__getattr__ = moved_getattr(__name__, {"env_rank_world": (__name__, "rank_world")})
