"""Restoring from the peer tier: pipelined requests, answers straight into the destination, the holder's lent views.

Two ranks are two threads, each with its own event loop and its own end of a real gloo process group
(as in tests/asymstore/tiers/peer/test_tier.py); rank 0 sends its version to rank 1 and reads it back. The holder's
replica tier is real process memory or real shared-memory files. Faults are injected only where a
peer misbehaves (a wrong size, a wrong answer id, a holder gone mid-restore, a replica deleted and
its memory refilled while it is being sent): each gives a typed error or the right bytes, never
wrong bytes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asymstore import AsymStore
from asymstore.errors import CorruptVersionError, PeerError, PeerProtocolError, TierError
from asymstore.read.load import load_version
from asymstore.tiers.memory.process import MemoryTier
from asymstore.tiers.memory.shm import ShmTier
from asymstore.tiers.peer import PeerTier
from asymstore.tiers.peer.service import ReplicaService
from asymstore.tiers.peer.tier import PIPELINE
from asymstore.tiers.protocol import ViewTier
from tests.support.ranks import run_ranks
from tests.support.tierkinds import BytesProvedLocalTier

STEP = 7


def state() -> dict[str, torch.Tensor]:
    """Tensors of several sizes: several segments, some tensors split over two, small ones packed."""
    g = torch.Generator().manual_seed(3)
    out = {f"big{i}": torch.randn(300_000 + 1000 * i, generator=g) for i in range(4)}
    out |= {f"small{i}": torch.randn(17 + i, generator=g) for i in range(40)}
    out["bytes"] = torch.randint(0, 255, (2_000_001,), dtype=torch.uint8, generator=g)
    return out


def a_version(root: Path) -> tuple[bytes, dict[str, bytes]]:
    """The manifest and segments of a real committed version of :func:`state` (segments of 1 MiB)."""
    async def go() -> tuple[bytes, dict[str, bytes]]:
        tier = BytesProvedLocalTier(root)  # replicas are proved by their bytes (what the receiver checks)
        async with AsymStore([tier], compression="never", segment_bytes=1 << 20) as s:
            await s.put_many(STEP, state())
            m = (await s.commit(STEP)).manifest
            return await tier.read_manifest(STEP), {seg.name: bytes(await tier.read_segment(STEP, seg.name))
                                                   for seg in m.segments}

    return asyncio.run(go())


def peer(rank: int, kv: Any, shm: Path | None) -> PeerTier:
    return PeerTier(64 << 20, path=None if shm is None else shm / f"node-{rank}", rank=rank, world_size=2,
                    node_of=[0, 1], store=kv, timeout_s=20.0, close_timeout_s=10.0)


async def send(tier: PeerTier, manifest: bytes, segments: dict[str, bytes]) -> None:
    w = await tier.begin(STEP, sum(len(b) for b in segments.values()))
    for name, data in segments.items():
        await w.write_segment(name, [data])
    await w.publish(manifest)


@pytest.mark.parametrize("where", ["memory", "shm"])
def test_a_pipelined_restore_is_bit_identical(tmp_path: Path, where: str) -> None:
    manifest, segments = a_version(tmp_path / "src")
    assert len(segments) > PIPELINE  # more segments than requests in flight
    kv = dist.HashStore()
    shm = tmp_path / "shm" if where == "shm" else None

    async def rank_fn(rank: int) -> Any:
        tier = peer(rank, kv, shm)
        await tier.open()
        try:
            if rank == 1:
                replicas = tier.service.tier if tier.service is not None else None
                return type(replicas).__name__
            await send(tier, manifest, segments)
            want = state()
            # every tensor, into fresh destinations: the store's reads, several segments at a time
            dests = {n: torch.empty_like(t) for n, t in want.items()}
            _, got = await load_version(tier, STEP, into=dests)
            assert all(got[n] is dests[n] and torch.equal(dests[n], t) for n, t in want.items())
            # whole segments, all at once (more than the pipeline holds), each its own bytes
            names = sorted(segments) * 2
            reads = await asyncio.gather(*(tier.read_segment(STEP, n, len(segments[n])) for n in names))
            assert [bytes(r) for r in reads] == [segments[n] for n in names]
            # a segment read as many small ranges: more than one request's header holds, answered in order
            name = max(segments, key=lambda n: len(segments[n]))
            data = segments[name]
            offsets = list(range(0, len(data) - 64, len(data) // 3000))
            views = [memoryview(bytearray(37)) for _ in offsets]
            await asyncio.gather(tier.read_segment_into(STEP, name, len(data), list(zip(offsets, views, strict=True))),
                                 tier.read_segment(STEP, name, len(data)))
            assert all(bytes(v) == data[o:o + 37] for o, v in zip(offsets, views, strict=True))
            with pytest.raises(CorruptVersionError):  # a range outside the segment is refused before it is asked
                await tier.read_segment_into(STEP, name, len(data), [(len(data) - 4, memoryview(bytearray(8)))])
            with pytest.raises(TierError):  # the holder's refusal is typed, and the link stays up
                await tier.read_segment(STEP, "seg-999999.bin", 10)
            return await tier.list_versions()
        finally:
            await tier.close()

    out = run_ranks(2, rank_fn)
    assert out == {0: [STEP], 1: "ShmTier" if where == "shm" else "MemoryTier"}, out


def _faulty(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """The holder answers its fourth ``ranges`` request wrongly (fault injection on rank 1's service)."""
    original = ReplicaService._ranges
    calls = {"n": 0}

    async def ranges(self: ReplicaService, header: dict[str, Any], lent: Any) -> list[memoryview]:
        out = await original(self, header, lent)
        calls["n"] += 1
        if calls["n"] == 4 and fault == "short":
            out[-1] = out[-1][:-1]  # one byte short
        return out

    def serving(self: ReplicaService, answer: dict[str, Any], nbytes: int) -> None:
        if fault == "id" and calls["n"] == 4 and "id" in answer and not calls.get("done"):
            calls["done"] = 1
            answer["id"] += 1  # the answer to another request

    monkeypatch.setattr(ReplicaService, "_ranges", ranges)
    monkeypatch.setattr(ReplicaService, "_serving", serving)


def _restore_from_rank_1(manifest: Any, segments: Any,
                         check: Callable[[PeerTier, dict[str, torch.Tensor]], Awaitable[str]]) -> Any:
    """Rank 0 replicates a version to rank 1, then runs ``check`` on restoring it into zeros; rank 0's result."""
    kv = dist.HashStore()

    async def rank_fn(rank: int) -> Any:
        tier = peer(rank, kv, None)
        await tier.open()
        try:
            if rank == 1:
                return None
            await send(tier, manifest, segments)
            return await check(tier, {n: torch.zeros_like(t) for n, t in state().items()})
        finally:
            await tier.close()

    return run_ranks(2, rank_fn)[0]


@pytest.mark.parametrize("fault", ["short", "id"])
def test_an_answer_of_the_wrong_size_or_order_is_a_protocol_error_not_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    manifest, segments = a_version(tmp_path / "src")
    _faulty(monkeypatch, fault)

    async def check(tier: PeerTier, dests: dict[str, torch.Tensor]) -> str:
        with pytest.raises(PeerProtocolError):
            await load_version(tier, STEP, into=dests)
        with pytest.raises(PeerError, match="down"):  # nothing more is read from that link
            await tier.read_segment(STEP, sorted(segments)[0])
        return "refused"

    assert _restore_from_rank_1(manifest, segments, check) == "refused"


def test_a_holder_gone_mid_restore_is_a_peer_error_not_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest, segments = a_version(tmp_path / "src")
    served = {"n": 0}

    def serving(self: ReplicaService, header: dict[str, Any], nbytes: int) -> None:
        if nbytes:
            served["n"] += 1
            if served["n"] == 3:  # the holder's node is lost while it serves the restore
                self.link.end("killed by the test", timeout_s=5.0)

    monkeypatch.setattr(ReplicaService, "_serving", serving)

    async def check(tier: PeerTier, dests: dict[str, torch.Tensor]) -> str:
        with pytest.raises(PeerError):
            await load_version(tier, STEP, into=dests)
        return "lost"

    assert _restore_from_rank_1(manifest, segments, check) == "lost" and served["n"] == 3


# -- the replica tiers' views -------------------------------------------------


async def _write(tier: MemoryTier | ShmTier, step: int, data: bytes) -> None:
    w = await tier.begin(step, len(data) + 100)
    await w.write_segment("seg-000000.bin", [data])
    await w.publish(b"{}")


@pytest.mark.parametrize("kind", ["memory", "shm"])
def test_a_lent_view_keeps_its_bytes_when_the_version_is_deleted_and_its_memory_wanted(
        tmp_path: Path, kind: str) -> None:
    async def go() -> None:
        tier = MemoryTier(3 << 20) if kind == "memory" else ShmTier(3 << 20, path=tmp_path / "shm")
        assert isinstance(tier, ViewTier)
        await tier.open()
        try:
            first, second = bytes(range(256)) * 4096, b"\xee" * (1 << 20)
            await _write(tier, 1, first)
            with pytest.raises(CorruptVersionError):
                with tier.view_segment(1, "seg-000000.bin", 5):
                    pass
            with pytest.raises(TierError):
                with tier.view_segment(2, "seg-000000.bin"):
                    pass
            with tier.view_segment(1, "seg-000000.bin", len(first)) as view:
                assert view.readonly and view == first
                await tier.delete_version(1)
                assert await tier.list_versions() == []
                await _write(tier, 2, second)  # the memory a dropped version gave back is refilled
                await _write(tier, 3, second)
                assert view == first  # still the lent version's bytes
            if isinstance(tier, MemoryTier):  # given back once the view closed: the next version reuses it
                allocated = tier._pool.allocated_bytes
                await tier.delete_version(2)
                await _write(tier, 4, second)
                assert tier._pool.allocated_bytes == allocated
        finally:
            await tier.close()

    asyncio.run(go())


def test_the_holder_sends_a_replica_deleted_and_refilled_mid_send_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The version is held while its view is sent: deleting it and writing another cannot change what is sent."""
    manifest, segments = a_version(tmp_path / "src")
    name = max(segments, key=lambda n: len(segments[n]))
    size = len(segments[name])
    refilled = threading.Event()
    hits = {"n": 0}

    def serving(self: ReplicaService, answer: dict[str, Any], nbytes: int) -> None:
        if nbytes != size or hits["n"]:
            return
        hits["n"] += 1
        tier, link = self.tier, self.link

        async def churn() -> None:  # on the service's loop, while the send waits for it
            for s in await tier.list_versions():
                await tier.delete_version(s)
            for s in (100, 101):
                w = await tier.begin(s, sum(len(b) for b in segments.values()))
                for n, b in segments.items():
                    await w.write_segment(n, [b"\xab" * len(b)])
                await w.publish(manifest)
            refilled.set()

        asyncio.get_running_loop().create_task(churn())
        real = link.send

        def late_send(*args: Any, **kw: Any) -> None:  # this answer's bytes leave only after the churn
            refilled.wait(10)
            monkeypatch.setattr(link, "send", real)
            real(*args, **kw)

        monkeypatch.setattr(link, "send", late_send)

    monkeypatch.setattr(ReplicaService, "_serving", serving)
    kv = dist.HashStore()

    async def rank_fn(rank: int) -> Any:
        tier = peer(rank, kv, None)
        await tier.open()
        try:
            if rank == 1:
                return None
            await send(tier, manifest, segments)
            got = await tier.read_segment(STEP, name, size)
            return bytes(got) == segments[name]
        finally:
            await tier.close()

    out = run_ranks(2, rank_fn)
    assert out[0] is True and hits["n"] == 1 and refilled.is_set(), out



def test_a_link_broken_by_a_violation_says_so_to_every_later_call() -> None:
    """Requests in flight beside the one that met a violation fail with the same kind of error.

    With four requests in flight, whichever ends first is what the restore raises: a link down
    because a peer broke the protocol must not read as a mere transport failure there.
    """
    from asymstore.tiers.peer.link import PeerLink

    link = PeerLink(None, 0, 1.0)
    raised = link.violated("rank 1 sent 3 bytes where 4 were asked for")
    assert isinstance(raised, PeerProtocolError)
    for _ in range(2):
        with pytest.raises(PeerProtocolError, match="down: rank 1 sent 3 bytes"):
            link.recv_header(1, 0)
    gone = PeerLink(None, 0, 1.0)
    gone._fail("receiving from rank 1", RuntimeError("connection reset"))
    with pytest.raises(PeerError, match="down") as info:
        gone.recv_header(1, 0)
    assert not isinstance(info.value, PeerProtocolError)  # a transport failure stays one
