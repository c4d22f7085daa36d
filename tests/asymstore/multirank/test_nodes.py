"""The protocol through node leaders (asymstore.dist.fabric): same versions as the direct path, O(nodes) requests.

8 ranks as threads of this process (each its own event loop and its own client of one real TCPStore, as
ranks of a job have), once as 4 nodes of 2 and once as one node (the direct protocol). Every request each
rank's client makes on the job's store is counted: off node 0 the ranks that do not lead make none while
committing, and each leader a bounded few per commit. Every restore candidate a rank decodes is recorded:
through nodes it carries its node's entries only, never every rank's.
"""

from __future__ import annotations

import datetime
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asymstore.dist.topology import Topology
from asymstore.errors import CoordinationProtocolError, CoordinationTimeoutError, GlobalCommitTimeoutError
from asymstore.format.globalmanifest import manifest_digest
from asymstore.multirank import protocol
from asymstore.multirank import restore as restore_module
from asymstore.multirank.globaldir import list_global_steps, read_global
from asymstore.multirank.job import Job
from asymstore.multirank.protocol import NodeCandidate, RestoreRound, TryMsg, encode
from tests.support.ranks import run_ranks, store

WORLD = 8
COMMITS = 4


class Counting:
    """A c10d store client that counts its requests (the test's request counter on the job's store)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.calls += 1
            return attr(*args, **kwargs)

        return call


class Tries:
    """Every restore candidate the ranks decode: (bytes read, shard entries carried)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        real = protocol.decode

        def decode(raw: Any, kind: Any, key: str = "a value") -> Any:
            out = real(raw, kind, key)
            if kind is TryMsg and "/try/" in key:
                whole, node = out.candidate, getattr(out, "node", None)
                if whole is not None or node is not None:
                    with self.lock:
                        self.seen.append((len(raw), len(whole.shards if whole is not None else node.shards)))
            return out

        monkeypatch.setattr(protocol, "decode", decode)

    def take(self) -> list[tuple[int, int]]:
        """The candidates decoded since the last take."""
        with self.lock:
            out, self.seen = self.seen, []
        return out


def _job(root: Path, node_size: int) -> tuple[dict[int, Any], dict[int, int]]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    clients = {r: Counting(dist.PrefixStore("asymstore/t", dist.TCPStore(
        "127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)))
        for r in range(WORLD)}
    per_commit: dict[int, int] = {}

    async def rank(r: int) -> Any:
        s = store(root, r, WORLD, clients[r], node_size=node_size, timeout_s=20.0)
        async with s:
            for step in range(COMMITS + 1):
                if step == 1:
                    start = clients[r].calls
                await s.put_many(step, {"w": torch.full((16,), float(r * 100 + step))})
                await s.commit(step)
            per_commit[r] = clients[r].calls - start
            await s.flush()
        async with store(root, r, WORLD, clients[r], node_size=node_size, timeout_s=20.0) as again:
            ckpt = await again.restore()
            return ckpt.step, ckpt.tensors["w"].clone(), again.restored_global

    out = run_ranks(WORLD, rank)
    del server
    return out, per_commit


def test_through_node_leaders_the_versions_are_the_direct_ones_with_o_nodes_requests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 nodes of 2 against one node: same global versions and restores; the non-leaders off node 0 ask nothing.

    Each rank decodes only its node's entries of the restore candidate (2, not 8: O(node), not O(ranks)),
    and the global version it restored (``restored_global``, read whole when asked) is the one on disk.
    """
    nodes, direct = tmp_path / "nodes", tmp_path / "direct"
    tries = Tries(monkeypatch)
    got, calls = _job(nodes, 2)
    node_tries = tries.take()
    want, direct_calls = _job(direct, WORLD)
    direct_tries = tries.take()
    for r in range(WORLD):
        assert not isinstance(got[r], BaseException), got[r]
        assert not isinstance(want[r], BaseException), want[r]
        assert got[r][0] == want[r][0] == COMMITS
        assert torch.equal(got[r][1], want[r][1])
        assert torch.equal(got[r][1], torch.full((16,), float(r * 100 + COMMITS)))
    assert list_global_steps(str(nodes / "global")) == list_global_steps(str(direct / "global"))
    a, b = read_global(str(nodes / "global"), COMMITS), read_global(str(direct / "global"), COMMITS)
    assert [s.digest for s in a.shards] == [s.digest for s in b.shards]
    assert all(got[r][2] == a and want[r][2] == b for r in range(WORLD))
    whole = len(encode(TryMsg(a)))
    assert len(node_tries) == WORLD - 1, node_tries  # one candidate, heard by every rank but the coordinator
    assert all(entries == 2 and size < whole / 2 for size, entries in node_tries), (node_tries, whole)
    assert len(direct_tries) == WORLD - 1 and all(entries == WORLD for _, entries in direct_tries), direct_tries
    top = Topology(WORLD, 2)
    for r in range(WORLD):
        if top.node_of(r) > 0 and not top.is_leader(r):
            assert calls[r] == 0, (r, calls)  # its node's leader speaks for it
    leaders = sum(calls[top.leader(n)] for n in range(1, top.nodes)) / COMMITS
    assert leaders <= 2 * (top.nodes - 1), calls  # each leader: its node's parts (the coordinator fans out the rest)
    for _head, rest in top.relay_groups():  # nodes 1 and 3 head the relay groups; node 2's leader hands its
        for node in rest:                   # node's parts to node 1's, so it asks the job's store nothing either
            assert calls[top.leader(node)] == 0, (node, calls)
    assert [(h, list(r)) for h, r in top.relay_groups()] == [(1, [2]), (3, [])]
    assert sum(calls.values()) < sum(direct_calls.values()), (calls, direct_calls)


def test_a_node_whose_rank_never_reports_is_named_by_its_leader(tmp_path: Path) -> None:
    """Rank 3 (node 1 of 4 nodes of 2) never commits: the coordinator's timeout names rank 3, not its node.

    (10 s: a connect at ``open`` may stall 5 s on a name lookup on a machine whose resolver does not answer.)
    """
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    port = server.port

    async def rank(r: int) -> Any:
        kv = dist.PrefixStore("asymstore/t", dist.TCPStore("127.0.0.1", port, None, False,
                                                            timeout=datetime.timedelta(seconds=30),
                                                            wait_for_workers=False))
        async with store(tmp_path, r, WORLD, kv, node_size=2, timeout_s=10.0) as s:
            await s.put_many(0, {"w": torch.zeros(4)})
            if r == 3:
                return None
            try:
                await s.commit(0)
            except GlobalCommitTimeoutError as exc:
                return str(exc)
            return None

    out = run_ranks(WORLD, rank)
    assert isinstance(out[0], str) and "rank(s) [3]" in out[0], out[0]
    assert list_global_steps(str(tmp_path / "global")) == []


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_topology_numbers_ranks_node_by_node(size: int) -> None:
    """Nodes, leaders and members of a topology; a node size that does not divide the world is refused."""
    top = Topology(24, size) if 24 % size == 0 else None
    if top is None:
        with pytest.raises(ValueError):
            Topology(24, size + 4)
        return
    assert [r for n in range(top.nodes) for r in top.members(n)] == list(range(24))
    assert all(top.is_leader(top.leader(n)) and top.node_of(top.leader(n)) == n for n in range(top.nodes))


def test_a_preemption_notice_reaches_every_node_before_the_publisher_goes_on(tmp_path: Path) -> None:
    """Rank 5 (node 2 of 4) publishes a notice; every rank's very next read of its node store sees it."""
    from asymcheck.policy.agreement import agreement_for

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    port = server.port
    opened, published, seen = threading.Barrier(WORLD), threading.Event(), {}
    wait_s = 30.0

    async def rank(r: int) -> Any:
        kv = dist.PrefixStore("asymstore/t", dist.TCPStore("127.0.0.1", port, None, False,
                                                            timeout=datetime.timedelta(seconds=30),
                                                            wait_for_workers=False))
        async with store(tmp_path, r, WORLD, kv, node_size=2, timeout_s=20.0) as s:
            agreement = agreement_for(s)
            assert agreement is not None
            assert agreement.poll() is None  # nothing yet; off node 0 this asks the leader to watch
            opened.wait(wait_s)
            if r == 5:
                agreement.publish(7, "SIGTERM")
                published.set()
            published.wait(wait_s)
            notice = agreement.poll()  # the first read after the publisher returned (a collective's order)
            seen[r] = None if notice is None else (notice.step, notice.rank)
            opened.wait(wait_s)

    out = run_ranks(WORLD, rank)
    assert all(v is None for v in out.values()), out
    assert seen == {r: (7, 5) for r in range(WORLD)}, seen


def _forged_restore(root: Path, monkeypatch: pytest.MonkeyPatch, forge: str) -> dict[int, Any]:
    """4 ranks as 2 nodes of 2 commit once, then restore with the coordinator's candidate forged (``forge``)."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    port, world = server.port, 4

    def offer(job: Job, rnd: RestoreRound, k: int, c: Any) -> None:
        g, top = c.manifest, job.fabric.topology
        assert g is not None and top is not None
        if forge == "other node":  # well-formed, but each node hears the other node's entries
            digest = manifest_digest(g)
            rnd.post_try_each(k, lambda n: TryMsg(node=NodeCandidate.of(g, top.members(1 - n), digest)))
        else:  # the right entries, but a digest that is not the whole manifest's
            rnd.post_try_each(k, lambda n: TryMsg(node=NodeCandidate.of(g, top.members(n), "0" * 16)))

    async def rank(r: int) -> Any:
        kv = dist.PrefixStore("asymstore/t", dist.TCPStore("127.0.0.1", port, None, False,
                                                            timeout=datetime.timedelta(seconds=30),
                                                            wait_for_workers=False))
        async with store(root, r, world, kv, node_size=2, timeout_s=20.0) as s:
            await s.put_many(0, {"w": torch.full((4,), float(r))})
            await s.commit(0)
            await s.flush()
        # 6 s: a connect can stall 5 s on a name lookup on a VM without DNS (the layout verdict waits this long too)
        async with store(root, r, world, kv, node_size=2, timeout_s=20.0, restore_timeout_s=6.0) as s:
            monkeypatch.setattr(restore_module, "_offer", offer)
            try:
                ckpt = await s.restore()
                return ckpt.tensors["w"].clone(), s.restored_global
            except Exception as exc:
                return exc

    out = run_ranks(world, rank)
    del server
    return out


def test_a_candidate_forged_for_another_node_is_refused_typed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each node hears the other node's entries: every follower refuses it (CoordinationProtocolError), none
    loads; the coordinator's wait for them runs out (CoordinationTimeoutError)."""
    out = _forged_restore(tmp_path, monkeypatch, "other node")
    assert isinstance(out[0], CoordinationTimeoutError), out
    for r in (1, 2, 3):
        assert isinstance(out[r], CoordinationProtocolError) and "its node holds ranks" in str(out[r]), out


def test_a_whole_manifest_that_is_not_the_offered_one_is_refused_typed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node candidates name a digest the coordinator's manifest does not have: the shards load (each checked
    against its own entry), but a follower asking for the whole manifest gets CoordinationProtocolError."""
    out = _forged_restore(tmp_path, monkeypatch, "digest")
    assert torch.equal(out[0][0], torch.zeros(4)) and out[0][1] == read_global(str(tmp_path / "global"), 0)
    for r in (1, 2, 3):
        assert isinstance(out[r], CoordinationProtocolError) and "not the global manifest" in str(out[r]), out
