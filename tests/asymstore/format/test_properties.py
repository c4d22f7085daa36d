"""Property-based: any state dict, written through any tier kind, restores bit-exact in a new process.

Hypothesis draws state dicts of every storable dtype (complex and bool included), empty, 0-d,
contiguous, transposed and strided tensors, with byte sizes on both sides of the chunk and pack
thresholds and contents that compress or do not, in calls large enough to be packed or not. Each
is committed through one tier kind (process memory, shared memory, local disk, NVMe with the POSIX
engine, a remote ``file://`` filesystem, S3 on the loopback moto server, a peer's memory) under each
compression mode, either alone or as the background tier of a memory tier that lends it the version
(``adopt_many``: the owner gets its memory back and scribbles over it before the background write
is awaited), and restored without destinations, into destinations for every tensor, or into some (transposed views among
them). File tiers are restored by another process (tests/procs/restorer.py) that holds nothing of
the writer's; process memory by the store that wrote it; the peer tier by asking the neighbour.

``make test`` runs a bounded, derandomized set per kind and compression; ``-m exhaustive``
(``make test-all``) runs many more, drawn afresh each time.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asymstore import AsymStore, Tier
from asymstore.read.load import load_version
from asymstore.tiers.memory.process import MemoryTier
from asymstore.tiers.peer import PeerTier
from tests.asymstore.tiers.peer.test_tier import on_source
from tests.support.tensors import DTYPES
from tests.support.tierkinds import FILE_KINDS, BytesProvedLocalTier, Kind, Restorer, digests, make_tier

CHUNK = 4096  # the store's chunk_bytes here: tensors above it span several chunks, packs hold those at most it
SEGMENT = 1 << 16
COMPRESSIONS = ["never", "always", "auto"]
SHAPES = ["0-d", "empty", "vector", "matrix", "transposed", "strided"]
CONTENTS = ["random", "zeros", "ramp"]
# byte sizes either side of the thresholds: nothing, one item, a chunk, a pack's largest tensor, several chunks
SIZES = [0, 1, 7, CHUNK - 8, CHUNK, CHUNK + 8, 3 * CHUNK + 24, 5 * CHUNK]

BOUNDED = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                          HealthCheck.data_too_large])
EXHAUSTIVE = settings(BOUNDED, max_examples=100, derandomize=False)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """One tensor: any dtype, shape class, size near a threshold, and content."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from(SHAPES))
    content = draw(st.sampled_from(CONTENTS))
    numel = max(1, draw(st.sampled_from(SIZES)) // dtype.itemsize)
    seed = draw(st.integers(0, 2**31 - 1))
    if shape == "0-d":
        dims: tuple[int, ...] = ()
        numel = 1
    elif shape == "empty":
        dims = draw(st.sampled_from([(0,), (0, 3), (3, 0, 2)]))
        numel = 0
    elif shape == "vector":
        dims = (numel,)
    else:
        cols = draw(st.sampled_from([1, 2, 3, 8]))
        dims = (max(1, numel // cols), cols)
        numel = dims[0] * cols
    if shape == "strided":  # every other row of one twice as tall: not contiguous, no gaps at the ends
        dims = (dims[0] * 2, dims[1])
        numel *= 2
    g = torch.Generator().manual_seed(seed)
    if content == "random":  # arbitrary bit patterns: NaNs, denormals, -0.0
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    elif content == "zeros":
        raw = torch.zeros(numel * dtype.itemsize, dtype=torch.uint8)
    else:
        raw = (torch.arange(numel * dtype.itemsize) // 64 % 7).to(torch.uint8)
    t = (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)
    t = t.reshape(dims)
    if shape == "transposed":
        t = t.reshape(dims[::-1]).t()
    elif shape == "strided":
        t = t[::2]
    return t


@st.composite
def states(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """A state dict: a few tensors, or a call of 32 or more (the store packs its small ones)."""
    count = draw(st.one_of(st.integers(1, 6), st.integers(32, 40)))
    values = draw(st.lists(tensors(), min_size=count, max_size=count))
    return {f"t{i}.{t.dtype}".replace("torch.", ""): t for i, t in enumerate(values)}


@pytest.fixture
def scratch(shm_dir: str, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Fresh places for one test: tmpfs for the shared-memory tiers, disk for the others, the S3 server for s3."""
    disk = tempfile.mkdtemp(prefix="asymstore-prop-")
    where: dict[str, Any] = {"disk": disk, "shm": shm_dir}
    if "s3" in request.node.name:
        where["s3"] = request.getfixturevalue("s3_server")
    try:
        yield where
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def fresh(scratch: dict[str, Any], kind: Kind) -> str:
    """A path (for ``s3``: a URI) no example used yet, for a tier of ``kind``."""
    if kind == "s3":
        return str(scratch["s3"].uri(f"prop-{uuid.uuid4().hex[:10]}"))
    return tempfile.mkdtemp(dir=scratch["shm" if kind == "shm" else "disk"])


async def write(state: dict[str, torch.Tensor], tiers: list[Tier], compression: str, lend: bool,
                into: str) -> dict[str, Any] | None:
    """Commit ``state`` as step 7 through ``tiers``; restore it from a process-memory tier while still open.

    ``lend``: the tensors are adopted (contiguous copies, scribbled over as soon as they are handed
    back), so the background tiers read the durable memory tier's lent copy.
    """
    async with AsymStore(tiers, compression=compression, chunk_bytes=CHUNK, segment_bytes=SEGMENT,  # type: ignore[arg-type]
                         keep_last=None) as store:
        if lend:
            owned = {n: t.contiguous().clone() for n, t in state.items()}
            handed_back = asyncio.Event()
            await store.adopt_many(7, owned, release=handed_back.set)
            await store.commit(7)
            await asyncio.wait_for(handed_back.wait(), 30)
            for t in owned.values():  # the owner writes its memory again before the background tier is done
                t.reshape(-1).view(torch.uint8).fill_(0xA5 if t.dtype != torch.bool else 1)
        else:
            await store.put_many(7, state)
            await store.commit(7)
        await store.flush(60)
        if not isinstance(tiers[0], MemoryTier):
            return None
        dests = None if into == "none" else {n: torch.zeros_like(t) for i, (n, t) in enumerate(state.items())
                                              if into == "all" or i % 2 == 0}
        ckpt = await store.restore(into=dests)
        return {"step": ckpt.step, "tensors": digests(ckpt.tensors),
                "same": all(ckpt.tensors[n] is d for n, d in (dests or {}).items())}


def check(kind: Kind, state: dict[str, torch.Tensor], compression: str, lend: bool, into: str,
          restorer: Restorer, scratch: dict[str, Any]) -> None:
    """Write ``state`` through ``kind`` (alone, or behind a lending memory tier) and restore it bit-exact."""
    placed: list[tuple[Kind, str]] = [(kind, fresh(scratch, kind))]
    if lend:  # a memory tier of the other sort is durable and lends the version to the slower one
        if kind == "memory":
            placed.append(("local", fresh(scratch, "local")))
        else:
            durable: Kind = "shm" if kind == "local" else "memory"
            placed.insert(0, (durable, fresh(scratch, durable)))
    tiers = [make_tier(k, p) for k, p in placed]
    answers = []
    in_process = asyncio.run(write(state, tiers, compression, lend, into))
    if in_process is not None:
        answers.append(in_process)
    answers += [restorer.restore(k, p, into) for k, p in placed if k != "memory"]  # type: ignore[arg-type]
    want = digests(state)
    assert len(answers) == len(placed)
    for answer in answers:
        assert answer.get("error") is None, answer
        assert answer["step"] == 7
        assert answer["tensors"] == want
        assert answer["same"]


KINDS: list[Kind] = ["memory", *FILE_KINDS, "s3"]


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("kind", KINDS)
@BOUNDED
@given(state=states(), lend=st.booleans(), into=st.sampled_from(["none", "all", "some"]))
def test_any_state_restores_bit_exact(kind: Kind, compression: str, state: dict[str, torch.Tensor], lend: bool,
                                      into: str, restorer: Restorer, scratch: dict[str, Any]) -> None:
    check(kind, state, compression, lend, into, restorer, scratch)


@pytest.mark.exhaustive
@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("kind", KINDS)
@EXHAUSTIVE
@given(state=states(), lend=st.booleans(), into=st.sampled_from(["none", "all", "some"]))
def test_any_state_restores_bit_exact_exhaustive(kind: Kind, compression: str, state: dict[str, torch.Tensor],
                                                 lend: bool, into: str, restorer: Restorer,
                                                 scratch: dict[str, Any]) -> None:
    check(kind, state, compression, lend, into, restorer, scratch)


def peer_round_trip(state: dict[str, torch.Tensor], compression: str, into: str, root: Path) -> dict[str, Any]:
    """Commit ``state`` on a local tier, replicate its files to the neighbour, restore from the neighbour."""
    async def committed() -> tuple[bytes, dict[str, bytes]]:
        tier = BytesProvedLocalTier(root)
        async with AsymStore([tier], compression=compression, chunk_bytes=CHUNK,  # type: ignore[arg-type]
                             segment_bytes=SEGMENT) as store:
            await store.put_many(7, state)
            manifest = (await store.commit(7)).manifest
            return await tier.read_manifest(7), {s.name: bytes(await tier.read_segment(7, s.name))
                                                  for s in manifest.segments}

    manifest, segments = asyncio.run(committed())

    async def source(tier: PeerTier) -> dict[str, Any]:
        writer = await tier.begin(7, sum(len(b) for b in segments.values()))
        for name, data in segments.items():
            await writer.write_segment(name, [data])
        await writer.publish(manifest)
        tier._held = None  # read from the neighbour, not from this rank's cache
        dests = None if into == "none" else {n: torch.zeros_like(t) for i, (n, t) in enumerate(state.items())
                                              if into == "all" or i % 2 == 0}
        _, got = await load_version(tier, 7, into=dests)
        return {"tensors": digests(got), "same": all(got[n] is d for n, d in (dests or {}).items())}

    out = on_source(dist.HashStore(), source, capacity=64 << 20)
    assert not isinstance(out[0], BaseException), out[0]
    result: dict[str, Any] = out[0]
    return result


@pytest.mark.parametrize("compression", COMPRESSIONS)
@settings(BOUNDED, max_examples=4)
@given(state=states(), into=st.sampled_from(["none", "all", "some"]))
def test_any_state_restores_bit_exact_from_a_peer(compression: str, state: dict[str, torch.Tensor], into: str,
                                                   scratch: dict[str, Any]) -> None:
    answer = peer_round_trip(state, compression, into, Path(fresh(scratch, "local")))
    assert answer["tensors"] == digests(state)
    assert answer["same"]
