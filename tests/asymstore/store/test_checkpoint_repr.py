"""A restored Checkpoint prints short: asyncio.run builds the repr of what a coroutine returns."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from asymstore import AsymStore, LocalTier


def test_the_repr_names_the_version_not_its_tensors(tmp_path: Path) -> None:
    async def go() -> object:
        async with AsymStore([LocalTier(tmp_path)]) as store:
            await store.put_many(7, {f"t{i}": torch.full((64,), float(i)) for i in range(500)})
            await store.commit(7)
            return await store.restore()

    ckpt = asyncio.run(go())
    text = repr(ckpt)
    assert text.startswith("Checkpoint(step=7, tier='local:") and "tensors=500" in text, text
    assert len(text) < 300 and "tensor(" not in text
