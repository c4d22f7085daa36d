"""fsck on split layouts: shards on node-local disks and in peers' memory, the commit points on the shared root.

4 DDP ranks as 2 simulated nodes of 2 with the README's peer layout — a shared-memory host_tier (durable), a
PeerTier and a LocalTier per rank on its node's own disk, outside the root — are SIGKILLed mid-training, lose
node 1 (memory and disks) and resume from the peers. fsck then finds every shard where the placement record
says it lives: the recovered root verifies and ``--repair`` changes nothing; a shard it cannot see is
``unreachable`` and ``--repair`` refuses to touch its version (exit 2); a per-node check examines one node.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asymstore.errors import GlobalManifestError
from asymstore.format import placement
from asymstore.format.globalmanifest import GlobalManifest
from asymstore.format.names import rank_dirname
from asymstore.format.placement import Placement
from asymstore.fsck import check, repair
from asymstore.fsck.__main__ import main as fsck_main
from asymstore.multirank import globaldir
from tests.support.mr_harness import Case, run_cases

WORLD, PER_NODE, N = 4, 2, 8


def tree(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``roots`` with its size and modification time (what a repair would change)."""
    out = {}
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for f in files:
                st = os.stat(os.path.join(dirpath, f))
                if f != ".lock":  # rewritten by whoever takes the lock
                    out[os.path.join(dirpath, f)] = (st.st_size, st.st_mtime_ns)
    return out


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The README's peer layout with node-local disks, SIGKILLed, node 1 lost, and resumed to the end."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    shm = Path(tempfile.mkdtemp(prefix="asymstore-fsck-", dir=base))
    out = tmp_path_factory.mktemp("fsckplace") / "out"
    disks = out.parent / "disks"
    case = {"kind": "ddp", "mode": "attach", "dir": str(out.parent / "root"), "ordered": True, "step_s": 0.2,
            "peer": {"shm": str(shm), "per_node": PER_NODE, "disks": str(disks)}}
    try:
        run_cases([{**case, "name": "k1", "iterations": N, "kill": {"rank": None, "at": "forward:5"}}], WORLD, out)
        shutil.rmtree(shm / "node-1")  # node 1 is gone: its memory and its disks
        shutil.rmtree(disks / "node-1")
        run_cases([{**case, "name": "k2", "iterations": N}], WORLD, out)
        for r in range(WORLD):
            assert Case(out, "k2", WORLD).rc(r) == 0, Case(out, "k2", WORLD).log(r)
        yield {"root": Path(case["dir"]), "shm": shm, "disks": disks}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def own(job: dict[str, Any], rank: int) -> Path:
    return job["shm"] / f"node-{rank // PER_NODE}" / "own" / rank_dirname(rank)


def disk(job: dict[str, Any], rank: int) -> Path:
    return job["disks"] / f"node-{rank // PER_NODE}" / rank_dirname(rank)


def replica(job: dict[str, Any], rank: int) -> Path:
    return job["shm"] / f"node-{1 - rank // PER_NODE}" / "replicas" / f"of-rank-{rank:05d}"


def segment(version_dir: Path) -> Path:
    return next(p for p in sorted(version_dir.iterdir()) if p.name != "MANIFEST.json")


def test_the_placement_record_lists_every_ranks_tiers_where_they_are(job: dict[str, Any]) -> None:
    gdir = str(job["root"] / "global")
    g = globaldir.read_global(gdir, max(globaldir.list_global_steps(gdir)))
    assert g.placement is not None
    record = globaldir.read_placement(gdir, g.placement)
    for r in range(WORLD):
        where = {t.location for _, t in record.holders(r)}
        assert where == {str(own(job, r)), str(disk(job, r)), str(replica(job, r))}, (r, where)
    assert not any(p.name.startswith("rank-") for p in job["root"].iterdir())  # nothing under the root


def test_fsck_and_repair_on_the_recovered_root_find_it_clean_and_change_nothing(
        job: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    report = check(str(job["root"]), deep=True)
    assert report.ok, report.problems
    assert [e.status for e in report.entries if e.name.startswith("global/v")] == ["committed"] * 3
    before = tree(job["root"], job["shm"], job["disks"])
    assert fsck_main([str(job["root"]), "--repair", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["repaired"] == [] and doc["refused"] == []
    assert tree(job["root"], job["shm"], job["disks"]) == before


def test_another_host_sees_copies_but_concludes_nothing_from_what_it_lacks(
        job: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "this_host", lambda: "another-node")
    report = check(str(job["root"]))
    assert report.ok, report.problems  # every shard's copy verified, wherever fsck runs
    gdir = str(job["root"] / "global")
    newest = max(globaldir.list_global_steps(gdir))
    victims = [own(job, 0), disk(job, 0), replica(job, 0)]
    saved = {v: (segment(v / f"v{newest:012d}"), segment(v / f"v{newest:012d}").read_bytes()) for v in victims}
    try:
        for seg, _ in saved.values():
            flip(seg)
        report = check(str(job["root"]), deep=True)
        [entry] = [e for e in report.entries if e.name == f"global/{globaldir.global_filename(newest)}"]
        assert entry.status == "unreachable", entry  # damaged here, but these may be other disks of that name
    finally:
        for seg, data in saved.values():
            seg.write_bytes(data)


def test_a_shard_fsck_cannot_see_is_unreachable_and_repair_refuses_it(
        job: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    gdir = job["root"] / "global"
    steps = globaldir.list_global_steps(str(gdir))
    newest = steps[-1]
    saved = job["shm"].parent / (job["shm"].name + "-node1")
    shutil.move(job["shm"] / "node-1", saved)  # node 1's memory is out of sight (another machine, or gone)
    shutil.move(job["disks"] / "node-1", job["disks"] / "elsewhere")
    victims = [own(job, 0), disk(job, 0)]  # rank 0's copies on node 0 damaged; its replica lived on node 1
    segs = {v: segment(v / f"v{newest:012d}") for v in victims}
    data = {v: s.read_bytes() for v, s in segs.items()}
    try:
        for s in segs.values():
            flip(s)
        before = tree(job["root"], job["shm"], job["disks"])
        assert fsck_main([str(job["root"]), "--deep", "--json"]) == 1
        doc = json.loads(capsys.readouterr().out)
        status = {v["name"]: v["status"] for v in doc["versions"]}
        assert status[f"global/{globaldir.global_filename(newest)}"] == "unreachable"
        assert "corrupt" not in {status[f"global/{globaldir.global_filename(s)}"] for s in steps}
        # the per-node check of node 0 examines what node 0 holds: rank 0's copies are damaged there
        node0 = [str(job["shm"] / "node-0"), str(job["disks"] / "node-0")]
        assert fsck_main([str(job["root"]), "--deep", "--json", "--node-local", *node0]) == 1
        doc = json.loads(capsys.readouterr().out)
        bad = [v["name"] for v in doc["versions"] if v["status"] == "corrupt"]
        assert any(name.endswith(f"node-0/own/rank-00000/v{newest:012d}") for name in bad), bad
        assert any(name.endswith(f"node-0/rank-00000/v{newest:012d}") for name in bad), bad
        assert fsck_main([str(job["root"]), "--repair"]) == 2
        err = capsys.readouterr().err
        assert f"refused: global/{globaldir.global_filename(newest)}" in err and "local to" in err
        assert globaldir.list_global_steps(str(gdir)) == steps  # no global version removed
        after = tree(job["root"], job["shm"], job["disks"])
        assert {k: v for k, v in after.items() if "global" in k} == {k: v for k, v in before.items() if "global" in k}
        assert any(".quarantine" in k for k in after)  # the damaged copies seen on node 0: moved aside, not deleted
    finally:
        for v, s in segs.items():
            if s.exists():
                s.write_bytes(data[v])
        shutil.move(saved, job["shm"] / "node-1")
        shutil.move(job["disks"] / "elsewhere", job["disks"] / "node-1")
    node1 = [str(job["shm"] / "node-1"), str(job["disks"] / "node-1")]
    assert fsck_main([str(job["root"]), "--deep", "--node-local", *node1]) == 0
    capsys.readouterr()


def test_a_shard_damaged_everywhere_it_lives_is_corrupt_and_repair_quarantines_only_its_version(
        job: dict[str, Any]) -> None:
    gdir = job["root"] / "global"
    steps = globaldir.list_global_steps(str(gdir))
    newest = steps[-1]
    victims = [own(job, 3), disk(job, 3), replica(job, 3)]
    for v in victims:
        flip(segment(v / f"v{newest:012d}"))
    report = check(str(job["root"]), deep=True)
    [entry] = [e for e in report.entries if e.name == f"global/{globaldir.global_filename(newest)}"]
    assert entry.status == "corrupt" and "rank 3" in entry.problems[0], entry
    repair(report)
    assert globaldir.list_global_steps(str(gdir)) == steps[:-1]
    assert any(n.startswith(globaldir.global_filename(newest)) for n in os.listdir(gdir / ".quarantine"))
    assert globaldir.read_global_latest(str(gdir)) == steps[-2]
    for r in range(3):  # the other ranks' good shards of that step were not destroyed... nor needed
        assert (disk(job, r) / f"v{steps[-2]:012d}" / "MANIFEST.json").exists()


def test_placement_and_global_manifests_are_sealed() -> None:
    rec = placement.RankPlacement(0, "h", (placement.TierPlace("local", "local", "/x", 0),))
    data = Placement(1, (rec,)).to_json()
    assert Placement.from_json(data) == Placement(1, (rec,))
    for i in range(len(data) - 25):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(GlobalManifestError):
            Placement.from_json(bytes(bad))
    g = GlobalManifest(3, 1, (), placement="0123456789abcdef").to_json()
    bad = bytearray(g)
    bad[g.index(b'"step"') + 8] ^= 0x01
    with pytest.raises(GlobalManifestError):
        GlobalManifest.from_json(bytes(bad))


def test_shards_on_remote_tiers_are_verified_there(tmp_path: Path, s3_uri: str,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Each rank's disk outside the root plus a remote tier (rank 0 on S3, rank 1 on file://): fsck reads them there."""
    import torch
    import torch.distributed as dist

    from asymstore import LocalTier
    from asymstore.multirank import RankStore
    from asymstore.tiers.remote.tier import RemoteTier
    from tests.support.ranks import run_ranks

    for key, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")):
        monkeypatch.setenv(key, value)  # fsck's credentials: the placement record never holds any
    base, _, query = s3_uri.partition("?")
    remote = {0: f"{base}/rank-0?{query}", 1: (tmp_path / "nfs" / "rank-1").as_uri()}
    (tmp_path / "nfs" / "rank-1").mkdir(parents=True)
    root, kv = tmp_path / "root", dist.HashStore()

    async def rank_fn(rank: int) -> None:
        tiers = [LocalTier(tmp_path / f"disk-{rank}"), RemoteTier(remote[rank])]
        async with RankStore(root, rank=rank, world_size=2, kv=kv, tiers=tiers, timeout_s=20.0,
                             segment_bytes=1 << 20, compression="never") as s:
            for step in (1, 2):
                await s.put_many(step, {"w": torch.full((64,), float(step + rank))})
                await s.commit(step)
            await s.flushed(timeout=20.0)

    assert all(v is None for v in run_ranks(2, rank_fn).values())
    gdir = str(root / "global")
    record = globaldir.read_placement(gdir, globaldir.read_global(gdir, 2).placement or "")
    assert "secret" not in json.dumps([t.to_json() for r in record.ranks for t in r.tiers])
    assert check(str(root), deep=True).ok
    shutil.rmtree(tmp_path / "disk-0")  # both disks gone: the remote copies serve every shard
    shutil.rmtree(tmp_path / "disk-1")
    report = check(str(root), deep=True)
    assert report.ok, report.problems
    assert any(loc.startswith("s3://") for loc in report.to_json()["locations"])
    (tmp_path / "nfs").rename(tmp_path / "nfs-away")  # the file:// remote cannot be reached
    assert fsck_main([str(root), "--repair"]) == 2
    assert "refused" in capsys.readouterr().err
    assert globaldir.list_global_steps(gdir) == [1, 2]
    (tmp_path / "nfs-away").rename(tmp_path / "nfs")
    assert fsck_main([str(root), "--deep"]) == 0
