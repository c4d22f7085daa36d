"""Slices of DDP's replicated state on node-local tiers, exchanged over the training group at resume.

2 DDP ranks as 2 simulated nodes of 1 (real processes, gloo, a TCPStore, the peer tiers' replication group);
each rank's tiers are [its node's shared memory, a PeerTier, its node's own disk] (``peer`` with ``disks`` in
tests/support/mr_cases.py): nothing of a rank's shard is under the shared root, only ``global/`` is. With
``CommitOptions(dedup="replicas")`` (the default) each rank writes only its slice; the job is SIGKILLed in the
forward of iteration 4, and three copies of what it left resume (each compared bit for bit with an uninterrupted
reference run):

- as it is: each rank loads its own shard from its shared memory and the ranks exchange the slices;
- after node 1 is lost (its shared memory, with rank 0's replicas, and its disk deleted): rank 1 loads its
  shard from the replica node 0 holds, and the exchange gives both ranks every slice;
- with rank 1 flipping a byte of the slices it sends in the first exchange: both ranks refuse that version
  (``SliceExchangeError``, in ``restored.fallbacks``) and resume the one before, exactly;
- with rank 0 flipping a byte of what it sends in every exchange: every kept version is refused, and
  ``resume()`` raises ``SliceExchangeError`` on both ranks, before any training.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asymstore import LocalTier
from asymstore.format.globalmanifest import GlobalManifest
from asymstore.format.manifest import Manifest
from asymstore.format.names import rank_dirname
from asymstore.format.pieces import read_layouts
from asymstore.format.replicas import REPLICAS_KEY
from asymstore.format.tensors import dtype_from_name
from asymstore.read.verify import read_manifest
from tests.support.mr_harness import Case, assert_same_state, run_cases
from tests.support.shm import shm_dir

pytestmark = pytest.mark.slow

WORLD, PER_NODE, N, KILL_AT = 2, 1, 6, 4


@pytest.fixture(scope="module")
def shm() -> Iterator[Path]:
    """The simulated nodes' shared memory (/dev/shm where it is a tmpfs, else a temporary directory)."""
    with shm_dir("asymstore-xchg-") as path:
        yield path


def node_local(base: Path, shm: Path, name: str) -> dict[str, Any]:
    return {"kind": "ddp", "mode": "attach", "dir": str(base / f"ck-{name}"), "step_s": 0.1,
            "peer": {"shm": str(shm / name), "per_node": PER_NODE, "disks": str(base / f"disks-{name}")}}


def copy_job(base: Path, shm: Path, src: str, dst: str) -> dict[str, Any]:
    """A copy of everything job ``src`` left (root, shared memories, disks), as job ``dst``."""
    shutil.copytree(base / f"ck-{src}", base / f"ck-{dst}")
    shutil.copytree(shm / src, shm / dst)
    shutil.copytree(base / f"disks-{src}", base / f"disks-{dst}")
    return node_local(base, shm, dst)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, shm: Path) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("xchg")
    out = base / "out"
    killed = node_local(base, shm, "a")
    run_cases([{"kind": "ddp", "mode": "ref", "name": "ref", "iterations": N},
               {**killed, "name": "a1", "iterations": N, "kill": {"rank": None, "at": f"forward:{KILL_AT}"}}],
              WORLD, out)
    lost = copy_job(base, shm, "a", "b")
    shutil.rmtree(shm / "b" / "node-1")  # node 1 is gone: its memory (rank 0's replicas too) and its disk
    shutil.rmtree(base / "disks-b" / "node-1")
    tampered = copy_job(base, shm, "a", "c")
    always = copy_job(base, shm, "a", "d")
    run_cases([{**killed, "name": "a2", "iterations": N},
               {**lost, "name": "b2", "iterations": N},
               {**tampered, "name": "c2", "iterations": N, "tamper_slices": {"rank": 1, "times": 1}},
               {**always, "name": "d2", "iterations": N, "tamper_slices": {"rank": 0, "times": 99}}], WORLD, out)
    return base, out


def newest_global(root: Path) -> GlobalManifest:
    return GlobalManifest.from_json(max((root / "global").glob("v*.json")).read_bytes())


def resumed_like_ref(out: Path, name: str, tiers: dict[int, str]) -> dict[str, Any]:
    """Every rank resumed the same step (its own slices from ``tiers[rank]``, the rest exchanged), ending as ``ref``."""
    case, ref = Case(out, name, WORLD), Case(out, "ref", WORLD)
    events = []
    for r in range(WORLD):
        assert case.rc(r) == 0, case.log(r)
        [resumed] = case.events(r, "resumed")
        assert resumed["tier"].startswith(tiers[r]) and "slices exchanged with 2 rank(s)" in resumed["tier"], resumed
        want = dict(ref.losses(r))
        got = case.losses(r)
        assert [it for it, _ in got] == list(range(resumed["step"], N))
        assert all(loss == want[it] for it, loss in got), r
        assert_same_state(ref.final(r), case.final(r))
        events.append(resumed)
    assert len({e["step"] for e in events}) == 1
    return events[0]


def test_node_local_slices_halve_bytes_and_kill_resume_exchanges_them(jobs: tuple[Path, Path]) -> None:
    base, out = jobs
    g = newest_global(base / "ck-a")
    assert not any((base / "ck-a" / rank_dirname(r)).exists() for r in range(WORLD))  # nothing under the root
    for r in range(WORLD):
        shard = g.shard(r)
        assert shard.summary[REPLICAS_KEY]["mode"] == "slices"
        m = asyncio.run(disk_manifest(LocalTier(base / "disks-a" / f"node-{r}" / rank_dirname(r)), shard.step))
        whole = sum(_nbytes(lay.global_shape, lay.dtype) for lay in read_layouts(m).values())
        assert 0.45 <= m.nbytes / whole <= 0.6, (r, m.nbytes, whole)  # about half of what dedup="off" writes
    resumed = resumed_like_ref(out, "a2", {0: "host:", 1: "host:"})
    assert 1 <= resumed["step"] < KILL_AT


async def disk_manifest(disk: LocalTier, step: int) -> Manifest:
    await disk.open()
    try:
        return await read_manifest(disk, step)
    finally:
        await disk.close()


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = dtype_from_name(dtype).itemsize
    for d in shape:
        n *= d
    return n


def test_node_loss_restores_every_slice_from_the_peers(jobs: tuple[Path, Path]) -> None:
    _, out = jobs
    resumed = resumed_like_ref(out, "b2", {0: "host:", 1: "peer:"})
    assert resumed["step"] == resumed_like_ref(out, "a2", {0: "host:", 1: "host:"})["step"]


def test_a_corrupted_slice_from_a_peer_is_refused_and_the_version_before_resumed(jobs: tuple[Path, Path]) -> None:
    _, out = jobs
    newest = resumed_like_ref(out, "a2", {0: "host:", 1: "host:"})["step"]
    resumed = resumed_like_ref(out, "c2", {0: "host:", 1: "host:"})
    assert resumed["step"] == newest - 1
    for r in range(WORLD):
        [event] = Case(out, "c2", WORLD).events(r, "resumed")
        assert any(f.startswith(f"global step {newest}:") and ("differ from the checksum" in f or "refused" in f)
                   for f in event["fallbacks"]), event


def test_when_no_versions_slices_verify_the_resume_fails_typed_and_nothing_trains(jobs: tuple[Path, Path]) -> None:
    _, out = jobs
    case = Case(out, "d2", WORLD)
    for r in range(WORLD):
        assert case.rc(r) == 1 and not case.losses(r) and not case.events(r, "resumed"), case.log(r)
        log = (out / f"driver-rank{r}.log").read_text()
        assert "asymstore.errors.SliceExchangeError: no published version's slices verified on every rank" in log


@pytest.mark.exhaustive  # ~1 min on 2 cores: 4 ranks as 2 nodes of 2 (gradients averaged in rank order)
def test_4_ranks_node_loss_restores_every_slice_from_the_peers(tmp_path: Path, shm: Path) -> None:
    out = tmp_path / "out"
    world = 4
    case = {**node_local(tmp_path, shm, "four"), "ordered": True}
    case["peer"]["per_node"] = 2
    run_cases([{"kind": "ddp", "mode": "ref", "name": "ref", "iterations": N, "ordered": True},
               {**case, "name": "k1", "iterations": N, "kill": {"rank": None, "at": f"forward:{KILL_AT}"}}], world, out)
    shutil.rmtree(shm / "four" / "node-1")
    shutil.rmtree(tmp_path / "disks-four" / "node-1")
    run_cases([{**case, "name": "k2", "iterations": N}], world, out)
    g = newest_global(tmp_path / "ck-four")
    assert all(REPLICAS_KEY in g.shard(r).summary for r in range(world))
    ref, resumed = Case(out, "ref", world), Case(out, "k2", world)
    steps = set()
    for r in range(world):
        assert resumed.rc(r) == 0, resumed.log(r)
        [event] = resumed.events(r, "resumed")
        assert event["tier"].startswith("host:" if r < 2 else "peer:"), event
        assert "slices exchanged with 4 rank(s)" in event["tier"], event
        steps.add(event["step"])
        assert_same_state(ref.final(r), resumed.final(r))
    assert len(steps) == 1 and 1 <= steps.pop() < KILL_AT
