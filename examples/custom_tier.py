"""Writing a tier: a dictionary that implements the ``asymstore.Tier`` protocol, under a real store.

The tier keeps each published version as its manifest bytes and its
segments. The store drives it (begin, write_segment, publish, retention,
reads); restore verifies what it reads, so a damaged segment in the newest
version makes restore fall back to the previous one. Writes nothing to disk.
"""

import asyncio
from collections.abc import Sequence

import torch

from asymstore import AsymStore, Tier, VersionNotFoundError

Buffer = memoryview | bytes | bytearray


class DictTier:
    """Versions in a dictionary: step -> (manifest, {segment name: bytes})."""

    def __init__(self, name: str = "dict", keep_last: int | None = None) -> None:
        self.name = name
        self.persistent = True        # the store may make it the durable tier
        self.keep_last = keep_last
        self.versions: dict[int, tuple[bytes, dict[str, bytes]]] = {}
        self.latest: int | None = None

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def list_versions(self) -> list[int]:
        return sorted(self.versions)

    async def begin(self, step: int, nbytes: int) -> "DictWriter":
        return DictWriter(self, step)

    async def read_manifest(self, step: int) -> bytes:
        if step not in self.versions:
            raise VersionNotFoundError(f"{self.name}: no version {step}")
        return self.versions[step][0]

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        return bytearray(self.versions[step][1][name])  # a buffer the caller owns

    async def delete_version(self, step: int) -> None:
        self.versions.pop(step, None)

    async def quarantine(self, step: int) -> None:
        self.versions.pop(step, None)

    async def write_latest(self, step: int) -> None:
        self.latest = step

    async def read_latest(self) -> int | None:
        return self.latest


class DictWriter:
    """One version being written: nothing is visible before ``publish``."""

    def __init__(self, tier: DictTier, step: int) -> None:
        self.tier, self.step = tier, step
        self.segments: dict[str, bytes] = {}

    async def write_segment(self, name: str, parts: Sequence[Buffer]) -> None:
        self.segments[name] = b"".join(bytes(p) for p in parts)  # the buffers are only lent until we return

    async def publish(self, manifest: bytes) -> None:
        self.tier.versions[self.step] = (bytes(manifest), self.segments)  # one assignment: atomic

    async def abort(self) -> None:
        self.segments.clear()


async def main() -> None:
    tier = DictTier(keep_last=2)
    assert isinstance(tier, Tier)                 # the protocol is runtime-checkable
    async with AsymStore([tier], calibration_cache=False) as store:
        for step in range(4):
            await store.put_many(step, {"w": torch.full((1000,), float(step))})
            await store.commit(step)
        print("versions:", store.versions())      # retention kept the newest 2
        segments = tier.versions[3][1]
        name = next(iter(segments))
        damaged = bytearray(segments[name])
        damaged[100] ^= 0xFF
        segments[name] = bytes(damaged)           # one damaged byte in the newest version
        ckpt = await store.restore()
        print(f"restored step {ckpt.step}; fallbacks: {ckpt.fallbacks}")
    assert ckpt.step == 2 and ckpt.fell_back and torch.equal(ckpt.tensors["w"], torch.full((1000,), 2.0))


asyncio.run(main())
