"""Broadcasts through the node stores (asymstore.dist.fabric): the tree, a dead node, a notice from another rank.

Every rank here leads a node of one rank (``Topology(WORLD, 1)``: 4 nodes besides node 0, in 2 relay groups),
each a real :class:`~asymstore.dist.fabric.Fabric` connected to one real TCPStore, as threads of this process.
A dead node is a real process serving its node store, SIGKILLed.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from asymstore.dist import fabric as fabric_module
from asymstore.dist.fabric import Fabric, node_address_key
from asymstore.dist.kv import KV
from asymstore.dist.topology import Topology

WORLD = 5
SESSION = "s1/nodes"
TIMEOUT_S = 20.0
TOP = Topology(WORLD, 1)


class Counted:
    """A store client that counts its puts (instrumentation of a real client, not a fake)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.puts = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if name in ("set", "multi_set", "compare_set", "add"):
                self.puts += 1
            return attr(*args, **kwargs)

        return call if callable(attr) else attr


def _client(port: int) -> Any:
    return dist.PrefixStore("asymstore/t", dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30), wait_for_workers=False))


_DEAD_NODE = """
import datetime, json, sys, time
import torch.distributed as dist
port, key = int(sys.argv[1]), sys.argv[2]
served = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
job = dist.PrefixStore("asymstore/t", dist.TCPStore("127.0.0.1", port, None, False,
                                                    timeout=datetime.timedelta(seconds=30), wait_for_workers=False))
job.set(key, json.dumps({"host": "127.0.0.1", "port": served.port}))
print("serving", flush=True)
time.sleep(600)
"""


class Job:
    """One TCPStore, a fabric per rank (connected), and the nodes played by a process of their own."""

    def __init__(self, away: tuple[int, ...] = ()) -> None:
        self.server = dist.TCPStore("127.0.0.1", 0, None, True,  # type: ignore[attr-defined]
                                    timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
        port = self.server.port
        self.procs = {n: subprocess.Popen([sys.executable, "-c", _DEAD_NODE, str(port),
                                           node_address_key(SESSION, n)],
                                          stdout=subprocess.PIPE, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})
                      for n in away}
        for p in self.procs.values():  # its address posted before any rank waits for it (torch's import is slow)
            assert p.stdout is not None and p.stdout.readline().strip() == b"serving"
        self.fabrics = {r: Fabric(KV(_client(port)), TOP, r) for r in range(WORLD) if TOP.node_of(r) not in away}
        errors: list[BaseException] = []

        def connect(f: Fabric) -> None:
            try:
                f.connect(SESSION, TIMEOUT_S)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=connect, args=(f,)) for f in self.fabrics.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors

    def kill(self, node: int) -> None:
        """SIGKILL the process that serves ``node``'s store."""
        self.procs[node].send_signal(signal.SIGKILL)
        self.procs[node].wait(30)

    def close(self) -> None:
        for f in self.fabrics.values():
            f.close()
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)


@pytest.fixture(scope="module", autouse=True)
def _quick_resolver() -> Iterator[None]:
    """One short try of a name lookup per connect (c10d looks each socket's name up; this VM has no DNS)."""
    before = os.environ.get("RES_OPTIONS")
    os.environ["RES_OPTIONS"] = "timeout:1 attempts:1"
    yield
    if before is None:
        del os.environ["RES_OPTIONS"]
    else:
        os.environ["RES_OPTIONS"] = before


@pytest.fixture
def job() -> Iterator[Job]:
    made = Job()
    yield made
    made.close()


@pytest.fixture(scope="module")
def job_dead_head() -> Iterator[Job]:
    """One job for the tests with a dead head (node 1 heads the relay group of nodes 1 and 2)."""
    made = Job(away=(1,))
    made.kill(1)
    yield made
    made.close()


def _heard_everywhere(job: Job, key: str, raw: str) -> None:
    for r, f in job.fabrics.items():
        if r != 0:
            assert f.hear(key, TIMEOUT_S, f"rank {r} hearing {key}") == raw.encode(), r


def test_the_coordinator_puts_a_broadcast_into_the_relay_heads_only(job: Job) -> None:
    """One put per relay group (2 for 4 nodes), the retention counter riding with the answer; every leader hears."""
    coordinator = job.fabrics[0]
    assert coordinator.broadcaster is not None
    stores = coordinator.broadcaster.stores
    for kv in stores.values():
        kv.store = Counted(kv.store)
    coordinator.raise_counter("retain/all", 5)
    coordinator.announce("s1/commit/3/global", '{"step": 3}')
    puts = sum(kv.store.puts for kv in stores.values())
    assert puts == len(TOP.relay_groups()) == 2, puts  # not one per node (4)
    _heard_everywhere(job, "s1/commit/3/global", '{"step": 3}')
    for r, f in job.fabrics.items():
        assert f.read_int("retain/all") == 5, r  # in every node store with the answer
    coordinator.raise_counter("retain/all", 5)  # unchanged: nothing more to tell the nodes
    coordinator.announce("s1/commit/4/global", '{"step": 4}')
    assert sum(kv.store.puts for kv in stores.values()) == 2 * puts
    _heard_everywhere(job, "s1/commit/4/global", '{"step": 4}')


def test_a_dead_group_head_cuts_no_node_off_and_stalls_nothing(job_dead_head: Job) -> None:
    """Node 1 (a relay head) is SIGKILLed: the broadcast returns at once, and node 2 hears it from rank 0."""
    coordinator = job_dead_head.fabrics[0]
    started = time.monotonic()
    coordinator.announce("s1/agree/0", '{"step": 9}')
    assert time.monotonic() - started < 5.0
    _heard_everywhere(job_dead_head, "s1/agree/0", '{"step": 9}')
    assert coordinator.broadcaster is not None and coordinator.broadcaster.dead == {1}


def test_a_notice_from_another_rank_reaches_every_node_through_the_coordinator(
        job_dead_head: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 publishes a notice with node 1 dead: back within seconds, every live node store holds it, no connect."""
    connects: list[tuple[str, int]] = []
    real = fabric_module.connect_store

    def counted(host: str, port: int, timeout_s: float) -> Any:
        connects.append((host, port))
        return real(host, port, timeout_s)

    monkeypatch.setattr(fabric_module, "connect_store", counted)
    publisher = job_dead_head.fabrics[3]
    notice = json.dumps({"step": 7, "rank": 3, "reason": "SIGTERM"})
    publisher.kv.store.compare_set("s1/preempt", "", notice)
    started = time.monotonic()
    publisher.fan_out("s1/preempt", notice)
    took = time.monotonic() - started
    assert took < 10.0, took  # not a connect to the dead node's port retried until its timeout
    assert connects == []
    for r, f in job_dead_head.fabrics.items():
        assert f.peek("s1/preempt") == notice.encode(), r  # already there: the very next read sees it
