"""The interim main job: write, commit, restore and verify a multi-tensor checkpoint.

Runs on local disk (``./ckpt-example`` by default, or the first argument),
through a host-memory tier and a LocalTier, then checks the directory with
fsck. Exits non-zero if anything does not round-trip bit-exact.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time

import torch

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.fsck import check


def make_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    state: dict[str, torch.Tensor] = {}
    for layer in range(8):
        state[f"layers.{layer}.weight"] = torch.randn(512, 512, generator=g).to(torch.bfloat16)
        state[f"layers.{layer}.bias"] = torch.randn(512, generator=g)
        state[f"optim.{layer}.exp_avg"] = torch.randn(512, 512, generator=g)
    state["step"] = torch.tensor(step)
    state["mask"] = torch.rand(1000, generator=g) > 0.5
    state["empty"] = torch.empty(0, 4, dtype=torch.float16)
    state["fp8"] = torch.randn(64, generator=g).to(torch.float8_e4m3fn)
    state["complex"] = torch.randn(16, dtype=torch.complex64, generator=g)
    state["transposed"] = torch.randn(32, 16, generator=g).t()  # non-contiguous
    return state


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


async def main(root: str) -> int:
    shutil.rmtree(root, ignore_errors=True)
    async with AsymStore([host_tier(capacity_bytes=64 << 20), LocalTier(root)], keep_last=3) as store:
        for step in range(5):
            t0 = time.perf_counter()
            await store.put_many(step, make_state(step))
            result = await store.commit(step, meta={"lr": 1e-3, "step": step})
            print(f"step {step}: committed {result.nbytes / 2**20:.1f} MiB to {result.tiers} "
                  f"in {time.perf_counter() - t0:.3f} s")
        print("versions per tier:", store.versions())
    async with AsymStore([LocalTier(root)]) as store:  # a fresh store: disk only
        ckpt = await store.restore()
    expected = make_state(4)
    bad = [n for n, t in expected.items() if not same(t, ckpt.tensors[n])]
    print(f"restored step {ckpt.step} from {ckpt.tier}: {len(ckpt.tensors)} tensors, meta {ckpt.meta}")
    report = check(root, deep=True)
    print(f"fsck --deep: {'OK' if report.ok else report.problems}")
    if bad or ckpt.step != 4 or not report.ok:
        print(f"FAILED: mismatched tensors {bad}")
        return 1
    print("bit-exact: OK")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "ckpt-example")))
