"""How one rank exchanges the coordination protocol's messages: through its node's leader, not one store per rank.

Every round of the multi-rank protocol (:mod:`asymstore.multirank.protocol`) is a *gather* (each rank puts
its part, the coordinator reads them all: shard reports, restore lists, fits and results, flush notes) or
a *broadcast* (the coordinator puts one value every rank reads: the global answer, the agreed step, a
restore candidate, the go). With one TCPStore and N ranks that is O(N) requests on the one server per
round, and N ranks polling it while they wait. :class:`Fabric` routes both through the job's topology
(:class:`~asymstore.dist.topology.Topology`):

- **Node 0** (the coordinator's node, where ``torchrun`` hosts the job's store) talks to the job's
  store directly, as before. A job of one node therefore runs exactly the direct protocol.
- **Every other node** gets a node store: a TCPStore its leader (``LOCAL_RANK`` 0) serves on the node
  (``127.0.0.1``), whose address the leader posts once per session. Its ranks put their parts and wait
  for broadcasts there (waits that block in that store's server; they cost the job's store nothing).
- **Gathers go up the relay tree** (:meth:`~asymstore.dist.topology.Topology.relay_groups`: about
  √(nodes) groups of consecutive nodes, each with a head). Each leader's relay (:class:`NodeRelay`, a
  thread of the leader's process per gather, waiting in its node store's server) hands its node's
  parts (every part, and which ranks are missing when its wait ran out) to its group's head's store
  (``<prefix>/node/<n>``); the head's relay forwards the whole group's as one value into the
  gather's queue in the job's store (``<prefix>/nodes``, ``TCPStore.queue_push``; a store without
  queues: ``<prefix>/node/<head>``): one request per group per gather on the job's store. The
  coordinator pops the groups' values as they come (blocking in the server, on a connection of its
  own made at ``open``) and reads each group's parts at once, so that after the last group only its
  parts are left to parse; node 0's parts it waits for in one blocking wait.
- **Broadcasts go down a tree of depth two** (:meth:`~asymstore.dist.topology.Topology.relay_groups`):
  the coordinator puts each one into the job's store (for its own node) and into the store of each
  group's head node, about √(nodes) puts; each head's leader puts it into the rest of its group. Every
  broadcast travels as one ``multi_set`` per node store with a numbered relay message (``_relay/<n>``)
  after its keys, so a node's store holds the keys before its leader hears of them. Each leader's relay
  service (a thread blocked in its node store's server) reads the messages in order, relays them to its
  group, and wakes the leader's own waits (:meth:`Fabric.hear`): no leader polls. The values ranks read
  every commit (the retention counters) ride with the next broadcast (the commit's answer), and only
  when they changed: one fan-out per commit.
- **A dead node store does not stall a broadcast**: every node store's connection is made at ``open``
  and kept (the coordinator holds one to every node store), so a put into a dead one fails at once. A
  dead head's group is then served by the coordinator directly, the last few messages resent first.
- **A broadcast from another rank** (the preemption notice, :meth:`Fabric.fan_out`) is handed to the
  coordinator's fan-out service (a thread of the coordinator's, blocked in the job's store's server on
  the next request key), which puts it into every node store directly and acknowledges: the publisher
  goes on once every node store holds it, and never connects to a node store itself.

A leader's death is its ranks' death: their node store dies with it (their requests fail, typed by the
store as ``RuntimeError``), the coordinator misses the node's part and abandons the round, and the next
session (the job restarted) elects the leaders anew. Values a node store holds are copies of what the
job's store held: a stale retention counter only keeps more shards than needed, never fewer.

Threads blocked in a store served by their own process (a leader's relay service, the coordinator's
gather and fan-out service where the coordinator hosts the job's store) are released at exit by
:func:`~asymstore.runtime.exiting.at_exit` callbacks that set the keys they wait for (keys no one else
reads, or a gather's parts that only the exiting coordinator reads).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asymstore.dist.kv import KV
from asymstore.dist.topology import Topology
from asymstore.errors import CoordinationProtocolError, CoordinationTimeoutError
from asymstore.runtime.exiting import EXIT_WAIT_S, at_exit, exiting

logger = logging.getLogger(__name__)

LEADER_SHARE = 0.8
"""A leader forwards its node's parts of a gather after this share of the round's timeout at most (partial
parts then, naming the missing ranks), so that the coordinator hears which ranks are missing before its own
wait for the nodes runs out."""

CONNECT_TIMEOUT_S = 60.0
"""The least time a connect to a node store gets (see :func:`connect_store`)."""

NODE_POLL_MAX_S = 0.02
"""The longest pause between two polls of a node store (served on the node: a poll costs the job's store nothing)."""

CHILD_SHARE = 0.875
"""A group member's leader hands its node's parts to its group's head after this share of the head's wait at
most, so that the head hears which of them are missing before its own wait runs out."""

RESEND = 8
"""How many of its latest broadcasts the coordinator resends to a dead head's group before serving it directly."""

FAN_OUT_ACK_S = 30.0
"""How long a rank other than the coordinator waits at most for the coordinator to fan its broadcast out."""

RELAY_PREFIX = "_relay"
"""Node-store keys of the numbered relay messages (read by the node's leader only)."""

_FOREVER_S = 7 * 24 * 3600.0
_ARRIVALS_KEPT = 32  # gathers whose arrived nodes the coordinator remembers (to name the missing ranks)

T = TypeVar("T")


def node_address_key(session_prefix: str, node: int) -> str:
    """Where the leader of ``node`` posts its node store's address in session ``session_prefix``."""
    return f"{session_prefix}/node-store/{node}"


def node_part_key(prefix: str, node: int) -> str:
    """Where the leader of ``node`` puts its node's parts of the gather under ``prefix``."""
    return f"{prefix}/node/{node}"


def part_key(prefix: str, rank: int) -> str:
    """Where ``rank`` puts its part of the gather under ``prefix``."""
    return f"{prefix}/{rank}"


def node_queue_key(prefix: str) -> str:
    """The queue (``TCPStore.queue_push``) the leaders put their nodes' parts of the gather under ``prefix`` in."""
    return f"{prefix}/nodes"


def has_queues(store: Any) -> bool:
    """Whether ``store`` has the queues of a TCPStore (``queue_push``, ``queue_pop``, ``queue_len``)."""
    return all(callable(getattr(store, name, None)) for name in ("queue_push", "queue_pop", "queue_len"))


def relay_key(seq: int) -> str:
    """The node-store key of the ``seq``-th relay message of a session (from 1)."""
    return f"{RELAY_PREFIX}/{seq}"


def fan_out_key(session_prefix: str, n: int) -> str:
    """The ``n``-th request (from 1) to the coordinator's fan-out service in session ``session_prefix``."""
    return f"{session_prefix}/fan-out/{n}"


def fan_out_counter(session_prefix: str) -> str:
    """The counter that numbers the requests to the coordinator's fan-out service."""
    return f"{session_prefix}/fan-out"


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _clone(store: Any) -> Any | None:
    """A new connection to ``store``'s server (None: the store cannot make one, e.g. not a TCPStore)."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return None
    try:
        return clone()
    except Exception as exc:  # a HashStore, a FileStore, a wrapper without a server
        logger.debug("no connection of its own for blocking waits: %s", exc)
        return None


class Fabric:
    """One rank's routes to the coordinator and back (see the module docstring).

    A fabric without a node link (``Fabric(kv)``: node 0, a job of one node, a world of one) reads and
    writes the job's store directly.

    Args:
        kv: the job's coordination store (this rank's client).
        topology: the job's nodes (None: one node).
        rank: this rank.
    """

    def __init__(self, kv: KV, topology: Topology | None = None, rank: int = 0) -> None:
        """Direct until :meth:`connect` links a rank of another node to its node store."""
        self.kv = kv
        self.topology = topology
        self.rank = rank
        self.local = kv
        """Where this rank puts its parts and reads broadcasts: its node store, or the job's store."""
        self.relay: NodeRelay | None = None
        """The node's relay, on a leader of a node other than 0."""
        self.broadcaster: Broadcaster | None = None
        """The coordinator's fan-out into the node stores (rank 0 of a job of several nodes)."""
        self._prefix: str | None = None
        self._timeout_s = 300.0
        self._waiter: Any = None  # a member's connection to its node store for waits that block in the server
        self._gather_waiters: list[Any] = []  # the coordinator's connections for its gathers' blocking waits
        self._gathering: dict[int, list[str]] = {}  # the keys each blocked gather waits for (released at exit)
        self._popping: dict[int, str] = {}  # the queue each blocked gather pops (released at exit)
        self._queues = False  # the coordinator pops the nodes' parts from a queue as they come
        self._head_of: dict[int, int] = {}  # node -> the head of its relay group
        self._arrived: OrderedDict[str, dict[int, list[int]]] = OrderedDict()  # prefix -> node -> its missing ranks
        self._lock = threading.Lock()
        self._queued: dict[str, str] = {}  # node-store values that ride with the next broadcast
        self._told: dict[str, str] = {}  # what the node stores were last told of each such value
        self._exit_handle: int | None = None

    # -- topology ----------------------------------------------------------------------------------

    @property
    def node(self) -> int:
        """This rank's node (0 without a topology)."""
        return 0 if self.topology is None else self.topology.node_of(self.rank)

    @property
    def direct(self) -> bool:
        """True when this rank talks to the job's store itself (node 0, one node)."""
        return self.local is self.kv

    def connect(self, session_prefix: str, timeout_s: float) -> None:
        """Link this rank to its node store (blocking; nothing for a job of one node).

        The leader of a node other than 0 serves the node store and posts its address, then connects to
        the stores of its relay group (a group's head); the node's other ranks wait for it (once per
        session). The coordinator connects to every node store and starts its fan-out service.

        Raises:
            CoordinationTimeoutError: a leader did not post its node store within ``timeout_s``.
        """
        top = self.topology
        self._prefix = session_prefix
        self._timeout_s = timeout_s
        if top is None or top.nodes == 1:
            return
        if self.rank == 0:
            stores = {n: self._node_store(n) for n in range(1, top.nodes)}
            self.broadcaster = Broadcaster(stores, top.relay_groups(), self.rank)
            self._queues = has_queues(self.kv.store)
            waiter = _clone(self.kv.store)
            if waiter is not None:
                self._gather_waiters.append(waiter)
            service = _clone(self.kv.store)
            if service is not None:  # else a fan-out request waits for nothing and times out with a warning
                self.broadcaster.serve_requests(self.kv, service, session_prefix)
            self._exit_handle = at_exit(self._release, phase=1)
            return
        if self.node == 0:
            return
        if top.is_leader(self.rank):
            self.relay = NodeRelay(self.kv, top, self.node, timeout_s)
            self.local = self.relay.local
            self.kv.store.set(node_address_key(session_prefix, self.node),
                              json.dumps({"host": self.relay.host, "port": self.relay.port}))
            head = top.relay_head(self.node)
            self.relay.start({c: self._node_store(c) for c in top.relay_children(self.node)},
                             None if head == self.node else self._node_store(head))
            return
        self.local = self._node_store(self.node)
        self._waiter = self.local.store.clone()  # for the waits in the node store's server, made at open

    def _node_store(self, node: int) -> KV:
        assert self._prefix is not None
        key = node_address_key(self._prefix, node)
        self.kv.wait([key], self._timeout_s, f"rank {self.rank}: the node store of node {node}")
        addr = json.loads(bytes(self.kv.store.get(key)).decode())
        return KV(connect_store(str(addr["host"]), int(addr["port"]), self._timeout_s), poll_max_s=NODE_POLL_MAX_S)

    def close(self) -> None:
        """Stop this rank's relay's forwards (a leader's); the node store and its relay service stay until exit.

        A node's store and a group's relay go on serving after the leader closes its store: the node's
        ranks, and the ranks of the nodes it relays to, may still wait for the last commit's answer.
        """
        if self.relay is not None:
            self.relay.stop()
        if self.broadcaster is not None:
            self.broadcaster.stop()

    def _release(self) -> None:
        """At exit (the coordinator): end the gathers still blocked in the job's store (their parts set empty)."""
        with self._lock:
            pending = [k for keys in self._gathering.values() for k in keys]
            queues = list(self._popping.values())
        for key in pending:
            try:
                if not self.kv.has(key):
                    self.kv.store.set(key, "")
            except Exception as exc:
                logger.debug("rank %d: %s", self.rank, exc)
        for queue in queues:
            try:
                self.kv.store.queue_push(queue, "")
            except Exception as exc:
                logger.debug("rank %d: %s", self.rank, exc)
        deadline = time.monotonic() + EXIT_WAIT_S
        while (self._gathering or self._popping) and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- gathers -------------------------------------------------------------------------------------

    def contribute(self, prefix: str, rank: int, raw: str) -> None:
        """Put ``rank``'s part of the gather under ``prefix`` (a leader's relay forwards its node's parts)."""
        self.local.store.set(part_key(prefix, rank), raw)
        if self.relay is not None:
            self.relay.forward(prefix)

    def _gather_keys(self, prefix: str, ranks: Sequence[int]) -> list[tuple[str, list[int] | None]]:
        """The keys the coordinator reads for ``ranks``: a rank's own (None) or a relay group's parts (its ranks).

        A group's parts are under its head's node (:func:`node_part_key`, or its queue item).
        """
        top = self.topology
        out: list[tuple[str, list[int] | None]] = []
        groups: dict[int, list[int]] = {}
        if top is not None and top.nodes > 1 and not self._head_of:
            self._head_of = {n: head for head, rest in top.relay_groups() for n in (head, *rest)}
        for r in ranks:
            if top is None or top.nodes == 1 or top.node_of(r) == 0:
                out.append((part_key(prefix, r), None))
            else:
                groups.setdefault(self._head_of[top.node_of(r)], []).append(r)
        return out + [(node_part_key(prefix, head), members) for head, members in groups.items()]

    def gather(self, prefix: str, ranks: Sequence[int], timeout_s: float, what: str) -> list[bytes]:
        """The coordinator: every part of ``ranks`` under ``prefix``, in the order of ``ranks`` (blocking).

        Raises:
            CoordinationTimeoutError: a part did not come within ``timeout_s`` (names the missing ranks).
            CoordinationProtocolError: a node's forwarded parts are malformed.
        """
        return self.gather_each(prefix, ranks, timeout_s, what, lambda _r, raw: raw)

    def gather_each(self, prefix: str, ranks: Sequence[int], timeout_s: float, what: str,
                    read: Callable[[int, bytes], T]) -> list[T]:
        """As :meth:`gather`, reading each part with ``read(rank, part)`` as it comes.

        The coordinator of a job of several nodes pops the nodes' parts from the gather's queue in the
        order their leaders forward them and reads each node's at once (the shard reports are parsed
        while the slower nodes still commit): after the last node's parts, only that node's are left to
        read. The parts of node 0's ranks are read once they are all in.

        Raises:
            CoordinationTimeoutError: a part did not come within ``timeout_s`` (names the missing ranks).
            CoordinationProtocolError: a node's forwarded parts are malformed, or ``read`` raised it.
        """
        keyed = self._gather_keys(prefix, ranks)
        deadline = time.monotonic() + timeout_s
        out: dict[int, T] = {}
        lost: list[int] = []
        nodes = {int(k.rsplit("/", 1)[1]): m for k, m in keyed if m}  # group head -> its ranks
        if nodes and self._queues:
            lost += self._pop_nodes(prefix, nodes, deadline, timeout_s, what, read, out)
            keyed = [(k, m) for k, m in keyed if m is None]
        try:
            self._wait_parts([k for k, _ in keyed], max(0.0, deadline - time.monotonic()), what)
        except CoordinationTimeoutError as exc:
            raise CoordinationTimeoutError(f"{what}: rank(s) {self.missing(prefix, ranks)} missing after "
                                           f"{timeout_s:g} s") from exc
        for (key, members), value in zip(keyed, self._get_many([k for k, _ in keyed]), strict=True):
            if members is None:
                rank = int(key.rsplit("/", 1)[1])
                out[rank] = read(rank, value)
                continue
            got, gone = _node_parts(value, members, key)
            for rank, part in got.items():
                out[rank] = read(rank, part)
            lost += gone
        if lost:
            raise CoordinationTimeoutError(f"{what}: rank(s) {sorted(lost)} missing after {timeout_s:g} s "
                                           f"(their node's leader waited for them)")
        return [out[r] for r in ranks]

    def _pop_nodes(self, prefix: str, nodes: dict[int, list[int]], deadline: float, timeout_s: float, what: str,
                   read: Callable[[int, bytes], T], out: dict[int, T]) -> list[int]:
        """Pop the nodes' parts from the gather's queue as they come, reading each; return the ranks missing.

        Raises:
            CoordinationTimeoutError: a node's parts did not come before ``deadline`` (its ranks named).
            CoordinationProtocolError: a node's parts are malformed.
        """
        queue = node_queue_key(prefix)
        arrived = self._arrived.setdefault(prefix, {})
        while len(self._arrived) > _ARRIVALS_KEPT:
            self._arrived.popitem(last=False)
        with self._lock:
            waiter = self._gather_waiters.pop() if self._gather_waiters else None
            if waiter is not None:
                self._popping[id(waiter)] = queue
        lost: list[int] = []
        try:
            while len(arrived) < len(nodes):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(r for n, m in nodes.items() if n not in arrived for r in m)
                    raise CoordinationTimeoutError(f"{what}: rank(s) {missing} missing after {timeout_s:g} s")
                raw = self._pop(waiter, queue, left)
                if exiting():
                    raise CoordinationTimeoutError(f"{what}: the process is exiting")
                if raw is None:
                    continue
                node, parts, gone = _queued_parts(raw, nodes, queue)
                if node in arrived:
                    logger.warning("rank %d: node %d forwarded its parts of %s twice; the first kept",
                                   self.rank, node, prefix)
                    continue
                for rank, part in parts.items():
                    out[rank] = read(rank, part)
                arrived[node] = gone
                lost += gone
        finally:
            if waiter is not None:
                with self._lock:
                    self._popping.pop(id(waiter), None)
                    self._gather_waiters.append(waiter)
        return lost

    def _pop(self, waiter: Any, queue: str, left: float) -> bytes | None:
        """The next value of ``queue``, blocking in the server up to ``left`` seconds (None: none came).

        Raises:
            RuntimeError: the job's store is gone (DistNetworkError).
        """
        if waiter is not None:
            waiter.set_timeout(_timeout(max(left, 0.001)))
            try:
                return bytes(waiter.queue_pop(queue))
            except RuntimeError as exc:
                if type(exc).__name__ == "DistNetworkError":
                    raise
                return None  # DistStoreError: the pop timed out
        store, delay = self.kv.store, 0.001  # no connection of its own: poll the queue's length
        end = time.monotonic() + left
        while int(store.queue_len(queue)) == 0:
            if exiting() or time.monotonic() >= end:
                return None
            time.sleep(min(delay, max(0.0, end - time.monotonic())))
            delay = min(delay * 2, self.kv.poll_max_s)
        return bytes(store.queue_pop(queue, False))

    def _wait_parts(self, keys: list[str], timeout_s: float, what: str) -> None:
        """Wait for a gather's keys: blocking in the job's store's server where the coordinator has a connection.

        Polls (:meth:`KV.wait`) in a job of one node, or when no connection of its own is free.

        Raises:
            CoordinationTimeoutError: not within ``timeout_s``, or the process is exiting.
        """
        if not keys:
            return
        with self._lock:
            waiter = self._gather_waiters.pop() if self._gather_waiters else None
            if waiter is not None:
                self._gathering[id(waiter)] = keys
        if waiter is None:
            self.kv.wait(keys, timeout_s, what)
            return
        try:
            waiter.set_timeout(_timeout(max(timeout_s, 0.001)))
            waiter.wait(keys, _timeout(max(timeout_s, 0.001)))
        except RuntimeError as exc:  # DistStoreError: the wait ran out (or the store is gone)
            if exiting():
                raise CoordinationTimeoutError(f"{what}: the process is exiting") from exc
            missing = self.kv.missing(keys)
            if missing:
                raise CoordinationTimeoutError(f"{what}: still missing after {timeout_s:g} s: {missing}") from exc
        finally:
            with self._lock:
                self._gathering.pop(id(waiter), None)
                self._gather_waiters.append(waiter)
        if exiting():  # released by the exit callback: the parts may be the empty ones it set
            raise CoordinationTimeoutError(f"{what}: the process is exiting")

    def missing(self, prefix: str, ranks: Sequence[int]) -> list[int]:
        """The ranks of ``ranks`` whose part under ``prefix`` the coordinator cannot read yet."""
        out: list[int] = []
        arrived = self._arrived.get(prefix, {})
        for key, members in self._gather_keys(prefix, ranks):
            if members is not None and self._queues:  # the groups' parts came by the queue: as popped
                head = int(key.rsplit("/", 1)[1])
                out += arrived[head] if head in arrived else members
                continue
            present = self.kv.has(key)
            if members is None:
                if not present:
                    out.append(int(key.rsplit("/", 1)[1]))
                continue
            if not present:
                out += members
                continue
            try:
                out += _node_parts(bytes(self.kv.store.get(key)), members, key)[1]
            except CoordinationProtocolError:
                out += members
        return sorted(out)

    def _get_many(self, keys: Sequence[str]) -> list[bytes]:
        store = self.kv.store
        multi_get = getattr(store, "multi_get", None)
        raw = multi_get(list(keys)) if multi_get is not None else [store.get(k) for k in keys]
        return [bytes(v) for v in raw]

    # -- broadcasts ----------------------------------------------------------------------------------

    def announce(self, key: str, raw: str) -> None:
        """The coordinator: put the broadcast ``key`` into the job's store and every node store (down the tree).

        The values queued by :meth:`raise_counter` go with it, before it.
        """
        self.kv.store.set(key, raw)
        if self.broadcaster is None:
            return
        with self._lock:
            items = list(self._queued.items())
            self._told.update(self._queued)
            self._queued.clear()
        self.broadcaster.send([*items, (key, raw)])

    def announce_each(self, key: str, raw_of: Callable[[int], str]) -> None:
        """The coordinator: a broadcast whose value differs by node: ``raw_of(n)`` into node ``n``'s store.

        Node 0's value goes into the job's store (its ranks read it there); every other node's is put
        into its store by the coordinator itself (not down the tree: each node's value is its own). Each
        rank then reads only what its node needs (e.g. a restore candidate's entries of its node's ranks,
        not every rank's).

        Raises:
            RuntimeError: the job's store could not be reached (a dead node's store is skipped, as in
                :meth:`announce`).
        """
        self.kv.store.set(key, raw_of(0))
        if self.broadcaster is not None:
            self.broadcaster.send_each(key, raw_of)

    def raise_counter(self, key: str, value: int) -> None:
        """The coordinator: raise the counter ``key`` to ``value`` (never lower) in the job's store.

        The node stores get its new value with the next broadcast (:meth:`announce`; in a commit, its
        answer), and only when it changed: until then they hold an older, lower value, which only keeps
        more shards than needed.
        """
        now = str(self.kv.raise_int(key, value))
        if self.broadcaster is None:
            return
        with self._lock:
            if self._told.get(key) != now:
                self._queued[key] = now
            else:
                self._queued.pop(key, None)

    def hear(self, key: str, timeout_s: float, what: str) -> bytes:
        """Wait for the broadcast ``key`` in this rank's node store (the job's store on node 0) and return it.

        A leader of another node waits for its relay service to hear it (an in-process wait: no request);
        its other ranks wait in their node store's server (``TCPStore.wait`` on a connection of their own,
        in a daemon thread: the store lives in their leader's process, so the wait never holds up this
        process's exit); node 0's ranks poll the job's store.

        Raises:
            CoordinationTimeoutError: not within ``timeout_s`` (or the process is exiting).
            RuntimeError: the node store is gone (the leader died).
        """
        if self.relay is not None:
            self.relay.await_key(key, timeout_s, what)
        elif not self.direct and not self.local.has(key):
            self._block_for(key, timeout_s, what)
        else:
            self.local.wait([key], timeout_s, what)
        return bytes(self.local.store.get(key))

    def _block_for(self, key: str, timeout_s: float, what: str) -> None:
        waiter = self._waiter
        self._waiter = None  # held by this wait (a wait that times out keeps it: the next makes another)
        if waiter is None:
            waiter = self.local.store.clone()
        done, failed = threading.Event(), []

        def wait() -> None:
            try:
                waiter.wait([key], _timeout(_FOREVER_S))
            except Exception as exc:  # the node store is gone
                failed.append(exc)
            done.set()

        threading.Thread(target=wait, name="asymstore-hear", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not done.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
            if exiting():
                raise CoordinationTimeoutError(f"{what}: the process is exiting; still missing: {[key]}")
            if time.monotonic() >= deadline:
                raise CoordinationTimeoutError(f"{what}: still missing after {timeout_s:g} s: {[key]}")
        if failed:
            raise failed[0]
        self._waiter = waiter

    def has(self, key: str) -> bool:
        """Whether the broadcast ``key`` is set, without waiting (in this rank's node store)."""
        return self.local.has(key)

    def peek(self, key: str) -> bytes | None:
        """The value of the broadcast ``key`` (one the coordinator changes over time), or None when unset."""
        return bytes(self.local.store.get(key)) if self.local.has(key) else None

    def read_int(self, key: str) -> int:
        """The counter ``key`` (0 when never set), as the coordinator last told this rank's node."""
        if self.direct:
            return self.kv.read_int(key)
        raw = self.peek(key)
        return 0 if raw is None else int(raw)

    def fan_out(self, key: str, raw: str) -> None:
        """Put ``key`` (already in the job's store) into every node store too, and return once it is there.

        The preemption notice needs it: a rank that reads its node store right after a collective must
        see a notice published before that collective. The coordinator puts it into every node store
        itself; any other rank hands it to the coordinator's fan-out service and waits for its
        acknowledgement (at most :data:`FAN_OUT_ACK_S`; then it goes on with a warning: the coordinator
        is gone, and the job with it). No rank but the coordinator connects to a node store for it.
        """
        top, prefix = self.topology, self._prefix
        if top is None or top.nodes == 1 or prefix is None:
            return
        if self.broadcaster is not None:
            self.broadcaster.send([(key, raw)], direct=True)
            return
        store = self.kv.store
        n = int(store.add(fan_out_counter(prefix), 1))
        request = fan_out_key(prefix, n)
        store.set(request, json.dumps({"key": key, "value": raw}))
        wait = min(self._timeout_s, FAN_OUT_ACK_S)
        try:
            self.kv.wait([f"{request}/done"], wait, f"rank {self.rank}: the coordinator fanning {key} out")
        except CoordinationTimeoutError as exc:
            logger.warning("rank %d: the coordinator did not fan %s out to the node stores within %g s: the "
                           "other nodes' ranks may hear it one iteration late: %s", self.rank, key, wait, exc)


class Broadcaster:
    """The coordinator's puts into the node stores (see the module docstring): the tree, and the direct fan-out.

    Args:
        stores: node -> the coordinator's client of its store (every node but 0, connected at ``open``).
        groups: the broadcast tree (:meth:`~asymstore.dist.topology.Topology.relay_groups`).
        rank: the coordinator's rank (for the log).
    """

    def __init__(self, stores: dict[int, KV], groups: list[tuple[int, tuple[int, ...]]], rank: int = 0) -> None:
        """Nothing is put before the first broadcast."""
        self.stores = stores
        self.groups = groups
        self.rank = rank
        self.dead: set[int] = set()
        """Nodes whose store could not be reached (their leader is gone)."""
        self.adopted: set[int] = set()
        """Heads found dead: the coordinator puts into the rest of their group itself."""
        self.puts = 0
        """``multi_set`` requests made into node stores (each a whole broadcast)."""
        self._seq = 0
        # the last messages, for a dead head's group: one batch for every node, or (send_each) one per node
        self._recent: deque[tuple[list[str], list[str]] | dict[int, tuple[list[str], list[str]]]] = deque(
            maxlen=RESEND)
        self._lock = threading.RLock()  # a confirmation made inline (one node) adopts under it
        self._count = threading.Lock()
        self._pool = ThreadPoolExecutor(min(8, len(stores)), thread_name_prefix="asymstore-fan-out") \
            if len(stores) > 1 else None
        self._serving: str | None = None
        self._service: threading.Thread | None = None
        self._requests: tuple[KV, str, int] | None = None  # the job's store, the request counter, the next request
        self._service_lock = threading.Lock()
        self._stopped = False

    def send(self, items: Sequence[tuple[str, str]], *, direct: bool = False) -> None:
        """Put ``items`` (key, value) into every node store still served: down the tree, or ``direct`` into each.

        Down the tree the coordinator does not wait for the heads' stores to answer: each head's put is
        confirmed afterwards, in the background (one ``check``); a head found dead then has its group
        served by the coordinator directly, the last :data:`RESEND` messages first. ``direct`` returns
        once every node store still served answered (it holds ``items``).
        """
        with self._lock:  # one broadcast at a time: every node store gets the relay messages in order
            self._seq += 1
            msg = json.dumps({"keys": [k for k, _ in items], "direct": direct})
            batch = ([k for k, _ in items] + [relay_key(self._seq)], [v for _, v in items] + [msg])
            self._recent.append(batch)
            pool = None if self._stopped else self._pool
            if direct:
                self._put_each(lambda node: batch)
                return
            for head, rest in self.groups:
                if head in self.adopted:
                    for node in rest:
                        self._put(node, [batch])
                elif not self._put(head, [batch]):
                    self._adopt(head, rest)
                elif pool is not None:
                    pool.submit(self._confirm, head, rest, batch[0][-1])
                else:
                    self._confirm(head, rest, batch[0][-1])

    def send_each(self, key: str, raw_of: Callable[[int], str]) -> None:
        """Put ``key`` into every node store still served, ``raw_of(n)`` into node ``n``'s: directly, each its own.

        One relay message as :meth:`send` ``direct=True`` puts it (the leaders hear ``key``, nobody relays
        it), a value per node. Returns once every node store still served answered (a dead one is noted
        in :attr:`dead`).
        """
        with self._lock:  # in order with the other broadcasts: a leader reads the relay messages in order
            self._seq += 1
            msg = json.dumps({"keys": [key], "direct": True})
            seq = relay_key(self._seq)
            batches = {n: ([key, seq], [raw_of(n), msg]) for n in self.stores}
            self._recent.append(batches)
            self._put_each(batches.__getitem__)

    def _put_each(self, batch_of: Callable[[int], tuple[list[str], list[str]]]) -> None:
        """Put ``batch_of(n)`` into the store of every node ``n`` still served, confirmed, in parallel."""
        nodes = [n for n in self.stores if n not in self.dead]
        pool = None if self._stopped else self._pool
        if pool is None or len(nodes) < 2:
            for node in nodes:
                self._put(node, [batch_of(node)], confirm=True)
        else:
            list(pool.map(lambda node: self._put(node, [batch_of(node)], confirm=True), nodes))

    def _confirm(self, head: int, rest: tuple[int, ...], key: str) -> None:
        """Check that the store of ``head`` holds the relay message ``key`` (a put is not answered); else adopt."""
        try:
            if self.stores[head].store.check([key]):
                return
        except RuntimeError as exc:  # DistNetworkError: the leader's process is gone
            logger.debug("rank %d: node %d: %s", self.rank, head, str(exc).splitlines()[0][:200])
        with self._lock:
            if head not in self.adopted:
                self._adopt(head, rest)

    def _adopt(self, head: int, rest: tuple[int, ...]) -> None:
        """Serve the group of the dead ``head`` directly from now on, the last messages resent (under the lock)."""
        self.adopted.add(head)
        self.dead.add(head)
        logger.warning("rank %d: the store of node %d is gone (its leader died); its relay group %s hears from "
                       "rank %d directly", self.rank, head, list(rest), self.rank)
        recent = list(self._recent)
        for node in rest:
            self._put(node, [b[node] if isinstance(b, dict) else b for b in recent
                             if not isinstance(b, dict) or node in b])

    def _put(self, node: int, batches: Sequence[tuple[list[str], list[str]]], *, confirm: bool = False) -> bool:
        """Put ``batches`` into the store of ``node``, in order; False when it is gone (noted in :attr:`dead`).

        ``confirm``: wait for the store to answer that it holds them (a put alone is not answered).
        """
        if node in self.dead:
            return False
        store = self.stores[node].store
        try:
            for keys, values in batches:
                store.multi_set(keys, values)
                with self._count:
                    self.puts += 1
            if confirm and not store.check([batches[-1][0][-1]]):
                raise RuntimeError(f"node {node}'s store does not hold what was just put into it")
            return True
        except RuntimeError as exc:  # DistNetworkError: the leader's process is gone
            self.dead.add(node)
            logger.warning("rank %d: the store of node %d is gone (its leader died), its ranks hear nothing more: "
                           "%s", self.rank, node, str(exc).splitlines()[0][:200])
            return False

    def serve_requests(self, kv: KV, waiter: Any, session_prefix: str) -> None:
        """Start the fan-out service: other ranks' broadcasts (:meth:`Fabric.fan_out`), put directly, acknowledged.

        The service waits for the next request key in the job's store's server on ``waiter`` (a
        connection of its own) until the process exits; the exit releases the wait.
        """

        def serve() -> None:
            n = 1
            while True:
                key = fan_out_key(session_prefix, n)
                with self._service_lock:  # the release reads it under the lock: it sees this wait or we see the exit
                    if exiting() or self._stopped:
                        return
                    self._requests = (kv, fan_out_counter(session_prefix), n)
                    self._serving = key
                try:
                    waiter.wait([key], _timeout(_FOREVER_S))
                    raw = bytes(waiter.get(key))
                except Exception as exc:  # the job's store is gone
                    logger.debug("rank %d: fan-out service ends: %s", self.rank, exc)
                    return
                finally:
                    with self._service_lock:
                        self._serving = None
                if exiting() or not raw:
                    return
                try:
                    doc = json.loads(raw)
                    self.send([(str(doc["key"]), str(doc["value"]))], direct=True)
                    waiter.set(f"{key}/done", "1")
                except (ValueError, TypeError, KeyError) as exc:
                    logger.warning("rank %d: a malformed fan-out request %s ignored: %s", self.rank, key, exc)
                except Exception as exc:
                    logger.warning("rank %d: fan-out service ends: %s", self.rank, exc)
                    return
                n += 1

        def release() -> None:
            with self._service_lock:
                key = self._serving
            if key is not None:
                try:
                    kv.store.set(key, "")
                except Exception as exc:
                    logger.debug("rank %d: %s", self.rank, exc)
            if self._service is not None:
                self._service.join(EXIT_WAIT_S)

        self._service = threading.Thread(target=serve, name="asymstore-fan-out-service", daemon=True)
        self._service.start()
        at_exit(release, phase=1)

    def stop(self) -> None:
        """The coordinator closed its store: no more broadcasts; end the fan-out service unless a rank asked for more.

        Its wait is released by setting the request key it waits for empty, which only the service reads.
        """
        with self._service_lock:
            self._stopped = True
            key, requests = self._serving, self._requests
        if self._pool is not None:  # the confirmations already asked for still run; later puts run inline
            with self._lock:
                self._pool.shutdown(wait=False)
        if key is None or requests is None:
            return
        kv, counter, n = requests
        try:
            if int(kv.store.add(counter, 0)) < n:  # no rank holds request n
                kv.store.set(key, "")
        except Exception as exc:  # the job's store is gone: so is the service's wait
            logger.debug("rank %d: %s", self.rank, exc)


def _child_parts(store: KV, key: str, members: Sequence[int]) -> tuple[dict[str, str], list[int]] | None:
    """A group member's node parts, as its leader handed them to the head (None: not there, or malformed)."""
    try:
        if not store.has(key):
            return None
        doc = json.loads(bytes(store.store.get(key)))
        parts = {str(int(r)): str(v) for r, v in dict(doc["parts"]).items()}
        missing = [int(r) for r in doc.get("missing", [])]
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        logger.warning("%s: malformed parts of a node of the group: %s", key, str(exc)[:200])
        return None
    if {int(r) for r in parts} | set(missing) != set(members):
        logger.warning("%s: a node's parts name ranks other than its own", key)
        return None
    return parts, missing


def _queued_parts(raw: bytes, nodes: dict[int, list[int]], key: str) -> tuple[int, dict[int, bytes], list[int]]:
    """Parse a node's parts popped from a gather's queue: (node, rank -> part, ranks missing).

    Raises:
        CoordinationProtocolError: malformed, or from no node of the gather.
    """
    try:
        doc = json.loads(raw)
        node = int(doc["node"])
    except (ValueError, TypeError, KeyError) as exc:
        raise CoordinationProtocolError(f"{key}: malformed parts of a node: {str(exc)[:200]}") from exc
    if node not in nodes:
        raise CoordinationProtocolError(f"{key}: parts of node {node}, which is not in this gather")
    parts, missing = _node_parts(raw, nodes[node], key, doc)
    return node, parts, missing


def _node_parts(raw: bytes, members: Sequence[int], key: str,
                parsed: Any = None) -> tuple[dict[int, bytes], list[int]]:
    """Parse a node's forwarded parts: (rank -> part, ranks missing)."""
    try:
        doc = json.loads(raw) if parsed is None else parsed
        parts = {int(r): str(v).encode() for r, v in dict(doc["parts"]).items()}
        missing = [int(r) for r in doc.get("missing", [])]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CoordinationProtocolError(f"{key}: malformed parts of a node: {str(exc)[:200]}") from exc
    if set(parts) | set(missing) != set(members) or set(parts) & set(missing):
        raise CoordinationProtocolError(f"{key}: a node's parts name ranks {sorted(parts)} and missing "
                                        f"{sorted(missing)}, not its ranks {list(members)}")
    return parts, missing


def connect_store(host: str, port: int, timeout_s: float) -> Any:
    """A new client of the TCPStore at ``host:port`` (given at least :data:`CONNECT_TIMEOUT_S` to connect).

    A connect can stall seconds on a name lookup (seen here: one in about 40 waited 5 s on a VM whose
    resolver does not answer), so the round's timeout is not the connect's.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=max(timeout_s, CONNECT_TIMEOUT_S))
    return dist.TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False)  # type: ignore[attr-defined]


class NodeRelay:
    """A leader's relay: its node's parts to the job's store, broadcasts to its group (see the module docstring).

    Args:
        central: the leader's client of the job's store.
        topology: the job's nodes.
        node: the leader's node (not 0).
        timeout_s: the protocol's round timeout (a gather's parts are forwarded by ``LEADER_SHARE`` of it).
    """

    def __init__(self, central: KV, topology: Topology, node: int, timeout_s: float) -> None:
        """Serve the node store."""
        import torch.distributed as dist

        self.central = central
        self.topology = topology
        self.node = node
        self.timeout_s = timeout_s
        self.host = "127.0.0.1"
        server = dist.TCPStore(self.host, 0, None, True,  # type: ignore[attr-defined]
                               timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        _SERVED.append(server)  # served until the process ends: the node's ranks may read it after our close
        self.port = int(server.port)
        self.local = KV(connect_store(self.host, self.port, timeout_s), poll_max_s=NODE_POLL_MAX_S)
        self._lock = threading.Lock()
        self._forwarded: set[str] = set()
        self._pending: dict[str, list[str]] = {}
        # connections for the forwards' waits, made now: a connect may stall seconds on a name lookup
        # (seen on a VM without DNS), which must not happen inside a commit's round
        self._waiters: list[Any] = [self.local.store.clone() for _ in range(2)]
        self._stopped = False
        self.children: dict[int, KV] = {}
        """The stores of the nodes this leader relays broadcasts to (its relay group, when it heads one)."""
        self.head: KV | None = None
        """The store of this node's relay head, when another node heads its group."""
        self._child_nodes: tuple[int, ...] = ()
        self._heard: set[str] = set()
        self._heard_cond = threading.Condition()
        self._serving: str | None = None
        self._service: threading.Thread | None = None
        self._service_waiter: Any = self.local.store.clone()
        at_exit(self._release, phase=1)

    def start(self, children: dict[int, KV], head: KV | None = None) -> None:
        """Start the relay service: the broadcasts into this node store, relayed to ``children``, heard here.

        Args:
            children: the stores of the rest of this leader's relay group (it heads it).
            head: the store of this node's group head, which forwards this node's parts of a gather
                (None: this leader heads its group and forwards them to the coordinator itself).
        """
        self.children = dict(children)
        self.head = head
        self._child_nodes = tuple(children)
        self._service = threading.Thread(target=self._serve, name="asymstore-relay-service", daemon=True)
        self._service.start()

    def _serve(self) -> None:
        """Read the relay messages in order (blocking in this node store's server) until the process exits."""
        seq = 1
        waiter = self._service_waiter
        while True:
            key = relay_key(seq)
            with self._lock:  # the exit's release reads it under the lock: it sees this wait or we see the exit
                if exiting():
                    return
                self._serving = key
            try:
                waiter.wait([key], datetime.timedelta(seconds=_FOREVER_S))
                raw = bytes(waiter.get(key))
            except Exception as exc:  # the store went with the process
                logger.debug("node %d: relay service ends: %s", self.node, exc)
                return
            finally:
                with self._lock:
                    self._serving = None
            if exiting() or not raw:
                return
            try:
                msg = json.loads(raw)
                keys = [str(k) for k in msg["keys"]]
                if keys and self.children and not msg.get("direct"):
                    values = [bytes(v) for v in waiter.multi_get(keys)]
                    self._relay([*keys, key], [*values, raw])
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                logger.warning("node %d: relay message %d not relayed: %s", self.node, seq, exc)
                keys = []
            with self._heard_cond:
                self._heard.update(keys)
                self._heard_cond.notify_all()
            seq += 1

    def _relay(self, keys: list[str], values: list[bytes]) -> None:
        """Put one broadcast into every store of this leader's group still served (in order, one request each)."""
        for node, kv in list(self.children.items()):
            try:
                kv.store.multi_set(keys, values)
            except RuntimeError as exc:  # DistNetworkError: that node's leader is gone, its ranks with it
                logger.warning("node %d: the store of node %d is gone (its leader died): %s", self.node, node,
                               str(exc).splitlines()[0][:200])
                del self.children[node]

    def await_key(self, key: str, timeout_s: float, what: str) -> None:
        """Wait until the relay service heard the broadcast ``key`` (no request while waiting).

        Raises:
            CoordinationTimeoutError: not within ``timeout_s``, or the process is exiting.
        """
        if self.local.has(key):
            return
        if self._service is None or not self._service.is_alive():
            self.local.wait([key], timeout_s, what)  # no service (it ended): poll this node store
            return
        deadline = time.monotonic() + timeout_s
        with self._heard_cond:
            while key not in self._heard:
                if exiting():
                    raise CoordinationTimeoutError(f"{what}: the process is exiting; still missing: {[key]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    if self.local.has(key):
                        return
                    raise CoordinationTimeoutError(f"{what}: still missing after {timeout_s:g} s: {[key]}")
                self._heard_cond.wait(min(0.25, left))

    def stop(self) -> None:
        """Start no new forward (one in flight still forwards: the node's ranks may be behind their leader)."""
        self._stopped = True

    def forward(self, prefix: str) -> None:
        """Forward the node's parts of the gather under ``prefix`` once they are all in (in a thread)."""
        with self._lock:
            if prefix in self._forwarded or self._stopped:
                return
            self._forwarded.add(prefix)
        threading.Thread(target=self._forward, args=(prefix,), name="asymstore-relay", daemon=True).start()

    def _forward(self, prefix: str) -> None:
        """Wait for the node's parts (a head: and its group's nodes'), then forward them as one value.

        A group member's leader hands its node's parts to its head's store (after at most
        :data:`CHILD_SHARE` of :data:`LEADER_SHARE` of the timeout); a head forwards its whole group's
        to the coordinator (the gather's queue, or its node's key) after at most :data:`LEADER_SHARE`.
        """
        members = list(self.topology.members(self.node))
        keys = [part_key(prefix, r) for r in members]
        children = () if self.head is not None else self._child_nodes
        keys += [node_part_key(prefix, c) for c in children]
        share = LEADER_SHARE * (CHILD_SHARE if self.head is not None else 1.0)
        with self._lock:  # a connection of its own for a wait that blocks in the node store's server (no polls)
            waiter = self._waiters.pop() if self._waiters else None
            self._pending[prefix] = keys
        try:
            if waiter is None:  # connections are kept: a connect may stall on a name lookup
                waiter = self.local.store.clone()
            waiter.wait(keys, datetime.timedelta(seconds=self.timeout_s * share))
        except RuntimeError:
            pass  # DistStoreError: the wait ran out; forward what came, naming the missing ranks
        finally:
            with self._lock:
                self._pending.pop(prefix, None)
                if waiter is not None:
                    self._waiters.append(waiter)
        if exiting():
            return
        node = self.local
        try:
            present = [r for r in members if node.has(part_key(prefix, r))]
            values = node.store.multi_get([part_key(prefix, r) for r in present]) if present else []
            parts = {str(r): bytes(v).decode() for r, v in zip(present, values, strict=True)}
            missing = [r for r in members if r not in present]
            for child in children:  # the group's other nodes, as their leaders handed them over
                got = _child_parts(node, node_part_key(prefix, child), self.topology.members(child))
                if got is None:
                    missing += list(self.topology.members(child))
                else:
                    parts.update(got[0])
                    missing += got[1]
            doc = json.dumps({"node": self.node, "parts": parts, "missing": missing})
            if self.head is not None:  # to the group's head
                self.head.store.set(node_part_key(prefix, self.node), doc)
            elif has_queues(self.central.store):  # the coordinator pops the groups' parts as they come
                self.central.store.queue_push(node_queue_key(prefix), doc)
            else:
                self.central.store.set(node_part_key(prefix, self.node), doc)
        except Exception as exc:  # the head's or the job's store is gone: the coordinator misses this node
            logger.warning("node %d: could not forward %s: %s", self.node, prefix, exc)

    def _release(self) -> None:
        """At exit: end the forwards still waiting in this process's node store (see :mod:`asymstore.runtime.exiting`).

        A thread still blocked in a call to a store this process serves would return from it while the
        interpreter finalizes (the server goes with it): SIGABRT. Their missing parts are set (the store
        dies with this process; nothing else reads a part) and the forwards end without forwarding; the
        relay service's next message key is set empty (only this leader reads it) and the service ends.
        """
        with self._lock:
            pending = [k for keys in self._pending.values() for k in keys]
            if self._serving is not None:  # the relay service's wait (a key only this leader reads)
                pending.append(self._serving)
        for key in pending:
            try:
                if not self.local.has(key):
                    self.local.store.set(key, "")
            except Exception as exc:
                logger.debug("node %d: %s", self.node, exc)
        deadline = time.monotonic() + EXIT_WAIT_S
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._service is not None:
            self._service.join(max(0.0, deadline - time.monotonic()))


_SERVED: list[Any] = []
