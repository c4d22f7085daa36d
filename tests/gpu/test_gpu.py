"""CUDA-only checks: device tier, pinned pool, GDS/kvikio with the real driver. Run with `make gpu-test`."""

from __future__ import annotations

import os

import pytest
import torch

from asymstore import AsymStore, GPUTier, host_tier
from asymstore.tiers.nvme import NVMeTier

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU machine)")]


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {"w": torch.randn(1 << 20, device="cuda", generator=g),
            "h": torch.randn(4097, device="cuda", generator=g).half()}


async def test_gpu_tier_holds_versions_in_device_memory() -> None:
    tier = GPUTier(64 << 20)
    async with AsymStore([tier], compression="never") as store:
        src = state()
        await store.put_many(0, src)
        await store.commit(0)
        assert tier._pool is not None and tier._pool.device.type == "cuda"
        ckpt = await store.restore()
    for name, t in src.items():
        assert torch.equal(ckpt.tensors[name], t.cpu())


async def test_host_pool_is_pinned_with_cuda() -> None:
    tier = host_tier(64 << 20)
    async with AsymStore([tier], compression="never") as store:
        await store.put_many(0, state())
        await store.commit(0)
        assert tier._pool is not None and tier._pool.pinned
        buf = next(iter(tier._mem[0].segments.values()))
        assert buf.is_pinned()


async def test_kvikio_with_the_real_driver(tmp_path: object) -> None:
    pytest.importorskip("kvikio")
    tier = NVMeTier(os.path.join(str(tmp_path), "nvme"), engine="kvikio")
    async with AsymStore([tier], compression="never") as store:
        src = state()
        await store.put_many(0, src)
        await store.commit(0)
        ckpt = await store.restore()
    assert all(torch.equal(ckpt.tensors[k], v.cpu()) for k, v in src.items())
