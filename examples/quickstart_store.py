"""Quickstart: the store alone. Versions of named tensors over a memory tier and a disk tier.

Everything below this docstring is the README's quickstart, word for word.
It writes ``./ckpt``.
"""

import asyncio

import torch

from asymstore import AsymStore, LocalTier, host_tier


async def main() -> None:
    model = torch.nn.Linear(256, 256)
    async with AsymStore([host_tier(capacity_bytes=256 << 20), LocalTier("ckpt")], keep_last=3) as s:
        for step in range(3):
            await s.put(step, "rng", torch.get_rng_state())  # one name; many per step, any order, concurrently
            await s.put_many(step, model.state_dict())       # a mapping of name -> tensor
            await s.commit(step, meta={"lr": 1e-3})          # returns once durable on the first persistent tier
            await s.flushed(step)                            # waits until every tier has committed it
        ckpt = await s.restore()                             # the newest version that verifies; restore(step=N)
        print(ckpt.step, ckpt.tier, ckpt.meta, ckpt.fallbacks, s.versions())
        await s.restore(into=model.state_dict())             # fills your tensors in place, verified


asyncio.run(main())
