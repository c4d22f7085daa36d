"""The peer tier's pieces in one process: the ring, the framing, and what the receiving end refuses.

Two ranks are two threads, each with its own event loop and its own end of a real gloo process
group (built over a shared ``torch.distributed.HashStore``). A segment changed in flight, a version
larger than the receiver's capacity and a malformed frame must each leave no replica and raise a
typed error; tests/asymstore/tiers/peer/test_multirank.py kills real processes.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asymstore import AsymStore
from asymstore.errors import PeerError, PeerProtocolError
from asymstore.read.load import load_version
from asymstore.tiers.peer import PeerTier, ring_of
from asymstore.tiers.peer.link import FRAME, MAGIC, TAG_REPL, connect
from tests.support.ranks import run_ranks
from tests.support.tierkinds import BytesProvedLocalTier, host_tier


def test_the_ring_sends_each_rank_to_the_same_local_rank_on_the_next_node() -> None:
    rings = [ring_of(r, 6, local_world_size=2) for r in range(6)]
    assert [(g.dst, g.src) for g in rings] == [(2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3)]
    explicit = ring_of(1, 4, node_of=[7, 3, 7, 3])  # node ids in any order: the ring goes by sorted id
    assert (explicit.dst, explicit.src, explicit.nodes) == (0, 0, 2)
    with pytest.raises(ValueError, match="two nodes"):
        ring_of(0, 2, local_world_size=2)
    with pytest.raises(ValueError, match="different numbers"):
        ring_of(0, 3, node_of=[0, 0, 1])
    with pytest.raises(ValueError, match="split"):
        ring_of(0, 5, local_world_size=2)


def peer(rank: int, kv: Any, capacity: int = 1 << 20) -> PeerTier:
    return PeerTier(capacity, rank=rank, world_size=2, node_of=[0, 1], store=kv, timeout_s=20.0,
                    close_timeout_s=10.0)


def on_source(kv: Any, fn: Callable[[PeerTier], Awaitable[Any]], capacity: int = 1 << 20) -> dict[int, Any]:
    """Open a PeerTier on both ranks, run ``fn`` on rank 0's while rank 1 only holds its replicas, close both.

    Returns each rank's outcome (rank 1's is None), exceptions as values.
    """
    async def rank_fn(rank: int) -> Any:
        tier = peer(rank, kv, capacity)
        await tier.open()
        try:
            return None if rank == 1 else await fn(tier)
        finally:
            await tier.close()

    return run_ranks(2, rank_fn)


def a_version(root: Path) -> tuple[bytes, bytes]:
    """The manifest and only segment of a real committed version."""
    async def go() -> tuple[bytes, bytes]:
        tier = BytesProvedLocalTier(root)  # replicas are proved by their bytes (what the receiver checks)
        async with AsymStore([tier], compression="never") as s:
            await s.put_many(5, {"w": torch.arange(1000, dtype=torch.float32)})
            m = (await s.commit(5)).manifest
            return await tier.read_manifest(5), bytes(await tier.read_segment(5, m.segments[0].name))

    return asyncio.run(go())


def test_replicas_round_trip_and_a_segment_changed_in_flight_is_never_published(tmp_path: Path) -> None:
    manifest, segment = a_version(tmp_path / "src")
    name = "seg-000000.bin"

    async def source(tier: PeerTier) -> Any:
        w = await tier.begin(5, len(segment))
        await w.write_segment(name, [segment])
        await w.publish(manifest)  # whole: verified and published on rank 1
        assert await tier.list_versions() == [5]
        assert bytes(await tier.read_segment(5, name, len(segment))) == segment
        dest = torch.empty(1000, dtype=torch.float32)  # a restore into live tensors: only their bytes travel
        _, tensors = await load_version(tier, 5, into={"w": dest})
        assert tensors["w"] is dest and torch.equal(dest, torch.arange(1000, dtype=torch.float32))
        await tier.delete_version(5)
        bad = bytearray(segment)
        bad[len(bad) // 2] ^= 1
        w = await tier.begin(5, len(segment))
        await w.write_segment(name, [bad])
        with pytest.raises(PeerError, match="does not verify"):
            await w.publish(manifest)
        tier._held = None  # ask the neighbour, not the cache
        return await tier.list_versions()

    out = on_source(dist.HashStore(), source)
    assert out == {0: [], 1: None}, out


def test_a_version_larger_than_the_receivers_capacity_is_refused_and_drained(tmp_path: Path) -> None:
    manifest, segment = a_version(tmp_path / "src")

    async def source(tier: PeerTier) -> Any:
        w = await tier.begin(5, len(segment))
        await w.write_segment("seg-000000.bin", [segment])
        with pytest.raises(PeerError, match="refused"):
            await w.publish(manifest)
        w = await tier.begin(6, 10)  # the link still works after the refusal
        await w.abort()
        return await tier.list_versions()

    out = on_source(dist.HashStore(), source, capacity=1024)  # the version is 4 KiB
    assert out == {0: [], 1: None}, out


def test_a_malformed_frame_is_a_protocol_error_within_bounded_memory() -> None:
    kv = dist.HashStore()

    def rank_fn(rank: int) -> Any:
        link = connect(kv, rank, 2, 1, 20.0)
        if rank == 0:
            junk = torch.zeros(16 << 10, dtype=torch.uint8)
            junk[:24] = torch.frombuffer(bytearray(
                MAGIC.to_bytes(8, "little") + (1 << 40).to_bytes(8, "little") + (0).to_bytes(8, "little")),
                dtype=torch.uint8)
            link.pg.send([junk], 1, TAG_REPL).wait()  # claims a 1 TiB header
            return None
        with pytest.raises(PeerProtocolError, match="malformed"):
            link.recv_header(0, TAG_REPL)
        with pytest.raises(PeerError, match="down"):  # and the link is not used again
            link.recv_header(0, TAG_REPL)
        return "ok"

    async def wrapped(rank: int) -> Any:
        return await asyncio.to_thread(rank_fn, rank)

    out = run_ranks(2, wrapped)
    assert out == {0: None, 1: "ok"}, out


def test_replicas_in_shared_memory_outlive_the_tier_and_are_served_to_a_new_one(tmp_path: Path) -> None:
    manifest, segment = a_version(tmp_path / "src")
    kv = dist.HashStore()
    shm = tmp_path / "shm"

    async def first(rank: int) -> Any:
        tier = PeerTier(1 << 20, path=shm / f"node-{rank}", rank=rank, world_size=2, node_of=[0, 1], store=kv)
        await tier.open()
        try:
            if rank == 0:
                w = await tier.begin(5, len(segment))
                await w.write_segment("seg-000000.bin", [segment])
                await w.publish(manifest)
        finally:
            await tier.close()

    async def second(rank: int) -> Any:
        tier = PeerTier(1 << 20, path=shm / f"node-{rank}", rank=rank, world_size=2, node_of=[0, 1], store=kv)
        await tier.open()
        try:
            return await tier.list_versions(), bytes(await tier.read_manifest(5)) if rank == 0 else None
        finally:
            await tier.close()

    assert run_ranks(2, first) == {0: None, 1: None}
    listed = host_tier(1 << 20, path=shm / "node-1" / "of-rank-00000")
    assert asyncio.run(_list(listed)) == [5]
    out = run_ranks(2, second)
    assert out[0] == ([5], manifest) and out[1] == ([], None), out


async def _list(tier: host_tier) -> list[int]:
    await tier.open()
    try:
        return await tier.list_versions()
    finally:
        await tier.close()


def test_the_link_is_calibrated_by_probes_the_neighbour_acknowledges_and_keeps_nothing_of(tmp_path: Path) -> None:
    from asymstore.policy.calibration import calibrate
    from asymstore.tiers.peer.service import MAX_PROBE_BYTES

    manifest, segment = a_version(tmp_path / "src")

    async def source(tier: PeerTier) -> Any:
        cal = await calibrate(tier, None)  # never cached: the link's cost depends on the neighbour
        assert cal.source == "measured" and cal.seconds_per_byte > 0 and cal.key is None, cal
        assert tier.calibration_key() is None
        with pytest.raises(ValueError, match="not within"):
            await tier.probe_writes([MAX_PROBE_BYTES + 1])
        w = await tier.begin(5, len(segment))  # the probes left no replica; replication goes on as before
        await w.write_segment("seg-000000.bin", [segment])
        await w.publish(manifest)
        tier._held = None  # ask the neighbour, not the cache
        return await tier.list_versions()

    out = on_source(dist.HashStore(), source)
    assert out == {0: [5], 1: None}, out


def test_a_probe_larger_than_the_bound_is_a_protocol_violation_read_in_bounded_memory() -> None:
    from asymstore.tiers.peer.service import MAX_PROBE_BYTES

    kv = dist.HashStore()

    async def rank_fn(rank: int) -> Any:
        tier = peer(rank, kv)
        await tier.open()
        try:
            if rank == 1:
                service = tier.service
                assert service is not None
                for _ in range(200):  # the source's frame arrives, and the receive loop stops on it
                    if service.last_error is not None:
                        break
                    await asyncio.sleep(0.05)
                return service.last_error, len(service._recv)
            header = {"op": "probe", "nbytes": MAX_PROBE_BYTES + 1, "pieces": [1 << 20] * 64 + [1]}
            body = json.dumps(header, separators=(",", ":")).encode()
            first = torch.zeros(FRAME, dtype=torch.uint8)  # a first message claiming 64 MiB + 1 of payload
            first[:24] = torch.frombuffer(bytearray(struct.pack("<qqq", MAGIC, len(body), -1)), dtype=torch.uint8)
            first[24:24 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            tier.link.group(1, TAG_REPL, True).send([first], 1, TAG_REPL).wait()
            return None
        finally:
            await tier.close()

    out = run_ranks(2, rank_fn)
    error, buffered = out[1]
    assert out[0] is None and "probe of" in str(error) and buffered == 0, out
