"""This process's place in the job: its rank and the job's size, from arguments, the environment or torch.distributed."""

from __future__ import annotations

import os


def env_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank and the job's size: as given, else ``RANK``/``WORLD_SIZE``, else torch.distributed."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        env = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        import torch.distributed as dist

        env = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    return (env[0] if rank is None else rank), (env[1] if world_size is None else world_size)
