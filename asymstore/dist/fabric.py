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
  for broadcasts there (waits that block in that store's server; they cost the job's store nothing). The
  leader's relay (:class:`NodeRelay`, a thread of the leader's process per gather, waiting in the node
  store's server) forwards the node's parts of a gather as one value (``<prefix>/node/<n>``: every
  part, and which ranks are missing when its wait ran out): one request per node per gather on the
  job's store. The coordinator waits for the parts in the job's store's server too (one blocking wait
  per gather, no polls), on a connection of its own made at ``open``.
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
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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

RESEND = 8
"""How many of its latest broadcasts the coordinator resends to a dead head's group before serving it directly."""

FAN_OUT_ACK_S = 30.0
"""How long a rank other than the coordinator waits at most for the coordinator to fan its broadcast out."""

RELAY_PREFIX = "_relay"
"""Node-store keys of the numbered relay messages (read by the node's leader only)."""

_FOREVER_S = 7 * 24 * 3600.0


def node_address_key(session_prefix: str, node: int) -> str:
    """Where the leader of ``node`` posts its node store's address in session ``session_prefix``."""
    return f"{session_prefix}/node-store/{node}"


def node_part_key(prefix: str, node: int) -> str:
    """Where the leader of ``node`` puts its node's parts of the gather under ``prefix``."""
    return f"{prefix}/node/{node}"


def part_key(prefix: str, rank: int) -> str:
    """Where ``rank`` puts its part of the gather under ``prefix``."""
    return f"{prefix}/{rank}"


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
            self.relay.start({c: self._node_store(c) for c in top.relay_children(self.node)})
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
        for key in pending:
            try:
                if not self.kv.has(key):
                    self.kv.store.set(key, "")
            except Exception as exc:
                logger.debug("rank %d: %s", self.rank, exc)
        deadline = time.monotonic() + EXIT_WAIT_S
        while self._gathering and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- gathers -------------------------------------------------------------------------------------

    def contribute(self, prefix: str, rank: int, raw: str) -> None:
        """Put ``rank``'s part of the gather under ``prefix`` (a leader's relay forwards its node's parts)."""
        self.local.store.set(part_key(prefix, rank), raw)
        if self.relay is not None:
            self.relay.forward(prefix)

    def _gather_keys(self, prefix: str, ranks: Sequence[int]) -> list[tuple[str, list[int] | None]]:
        """The keys the coordinator reads for ``ranks``: a rank's own (None) or a node's parts (its ranks)."""
        top = self.topology
        out: list[tuple[str, list[int] | None]] = []
        nodes: dict[int, list[int]] = {}
        for r in ranks:
            if top is None or top.nodes == 1 or top.node_of(r) == 0:
                out.append((part_key(prefix, r), None))
            else:
                nodes.setdefault(top.node_of(r), []).append(r)
        return out + [(node_part_key(prefix, n), members) for n, members in nodes.items()]

    def gather(self, prefix: str, ranks: Sequence[int], timeout_s: float, what: str) -> list[bytes]:
        """The coordinator: every part of ``ranks`` under ``prefix``, in the order of ``ranks`` (blocking).

        Raises:
            CoordinationTimeoutError: a part did not come within ``timeout_s`` (names the missing ranks).
            CoordinationProtocolError: a node's forwarded parts are malformed.
        """
        keyed = self._gather_keys(prefix, ranks)
        try:
            self._wait_parts([k for k, _ in keyed], timeout_s, what)
        except CoordinationTimeoutError as exc:
            raise CoordinationTimeoutError(f"{what}: rank(s) {self.missing(prefix, ranks)} missing after "
                                           f"{timeout_s:g} s") from exc
        parts: dict[int, bytes] = {}
        missing: list[int] = []
        for (key, members), value in zip(keyed, self._get_many([k for k, _ in keyed]), strict=True):
            if members is None:
                parts[int(key.rsplit("/", 1)[1])] = value
                continue
            got, lost = _node_parts(value, members, key)
            parts.update(got)
            missing += lost
        if missing:
            raise CoordinationTimeoutError(f"{what}: rank(s) {sorted(missing)} missing after {timeout_s:g} s "
                                           f"(their node's leader waited for them)")
        return [parts[r] for r in ranks]

    def _wait_parts(self, keys: list[str], timeout_s: float, what: str) -> None:
        """Wait for a gather's keys: blocking in the job's store's server where the coordinator has a connection.

        Polls (:meth:`KV.wait`) in a job of one node, or when no connection of its own is free.

        Raises:
            CoordinationTimeoutError: not within ``timeout_s``, or the process is exiting.
        """
        with self._lock:
            waiter = self._gather_waiters.pop() if self._gather_waiters else None
            if waiter is not None:
                self._gathering[id(waiter)] = keys
        if waiter is None:
            self.kv.wait(keys, timeout_s, what)
            return
        try:
            waiter.wait(keys, _timeout(timeout_s))
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
        for key, members in self._gather_keys(prefix, ranks):
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
        self._recent: deque[tuple[list[str], list[str]]] = deque(maxlen=RESEND)
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._pool = ThreadPoolExecutor(min(8, len(stores)), thread_name_prefix="asymstore-fan-out") \
            if len(stores) > 1 else None
        self._serving: str | None = None
        self._service: threading.Thread | None = None
        self._requests: tuple[KV, str, int] | None = None  # the job's store, the request counter, the next request

    def send(self, items: Sequence[tuple[str, str]], *, direct: bool = False) -> None:
        """Put ``items`` (key, value) into every node store still served: down the tree, or ``direct`` into each.

        Returns once the coordinator's own puts are done (``direct``: every node store holds them; else
        the heads', whose leaders relay them on).
        """
        with self._lock:  # one broadcast at a time: every node store gets the relay messages in order
            self._seq += 1
            msg = json.dumps({"keys": [k for k, _ in items], "direct": direct})
            keys = [k for k, _ in items] + [relay_key(self._seq)]
            values = [v for _, v in items] + [msg]
            recent = list(self._recent)
            self._recent.append((keys, values))
            tasks: list[tuple[int, tuple[int, ...], tuple[tuple[list[str], list[str]], ...]]]
            if direct:
                tasks = [(n, (), ()) for n in self.stores]
            else:
                tasks = [(head, rest, tuple(recent)) for head, rest in self.groups]
            batch = (keys, values)

            def run(task: tuple[int, tuple[int, ...], tuple[tuple[list[str], list[str]], ...]]) -> None:
                head, rest, before = task
                if head not in self.adopted and self._put(head, [batch]):
                    return
                if not direct and head not in self.adopted:  # the head is gone: its group hears from us now
                    self.adopted.add(head)
                    for node in rest:
                        self._put(node, [*before, batch])
                    return
                for node in rest:
                    self._put(node, [batch])

            if self._pool is None or len(tasks) == 1:
                for task in tasks:
                    run(task)
            else:
                list(self._pool.map(run, tasks))

    def _put(self, node: int, batches: Sequence[tuple[list[str], list[str]]]) -> bool:
        """Put ``batches`` into the store of ``node``, in order; False when it is gone (noted in :attr:`dead`)."""
        if node in self.dead:
            return False
        store = self.stores[node].store
        try:
            for keys, values in batches:
                store.multi_set(keys, values)
                with self._count:
                    self.puts += 1
            if not store.check([batches[-1][0][-1]]):  # a set is not answered: this is (a dead store fails it)
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
            while not exiting():
                key = fan_out_key(session_prefix, n)
                self._requests = (kv, fan_out_counter(session_prefix), n)
                self._serving = key
                try:
                    waiter.wait([key], _timeout(_FOREVER_S))
                    raw = bytes(waiter.get(key))
                except Exception as exc:  # the job's store is gone
                    logger.debug("rank %d: fan-out service ends: %s", self.rank, exc)
                    return
                finally:
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
        """End the fan-out service (the coordinator closed its store) unless a rank already asked for its next one.

        Its wait is released by setting the request key it waits for empty, which only the service reads.
        """
        key, requests = self._serving, self._requests
        if key is None or requests is None:
            return
        kv, counter, n = requests
        try:
            if int(kv.store.add(counter, 0)) < n:  # no rank holds request n
                kv.store.set(key, "")
        except Exception as exc:  # the job's store is gone: so is the service's wait
            logger.debug("rank %d: %s", self.rank, exc)


def _node_parts(raw: bytes, members: Sequence[int], key: str) -> tuple[dict[int, bytes], list[int]]:
    """Parse a node's forwarded parts: (rank -> part, ranks missing)."""
    try:
        doc = json.loads(raw)
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
        self._heard: set[str] = set()
        self._heard_cond = threading.Condition()
        self._serving: str | None = None
        self._service: threading.Thread | None = None
        self._service_waiter: Any = self.local.store.clone()
        at_exit(self._release, phase=1)

    def start(self, children: dict[int, KV]) -> None:
        """Start the relay service: the broadcasts into this node store, relayed to ``children``, heard here."""
        self.children = dict(children)
        self._service = threading.Thread(target=self._serve, name="asymstore-relay-service", daemon=True)
        self._service.start()

    def _serve(self) -> None:
        """Read the relay messages in order (blocking in this node store's server) until the process exits."""
        seq = 1
        waiter = self._service_waiter
        while not exiting():
            key = relay_key(seq)
            with self._lock:
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
        members = list(self.topology.members(self.node))
        keys = [part_key(prefix, r) for r in members]
        with self._lock:  # a connection of its own for a wait that blocks in the node store's server (no polls)
            waiter = self._waiters.pop() if self._waiters else None
            self._pending[prefix] = keys
        try:
            if waiter is None:  # connections are kept: a connect may stall on a name lookup
                waiter = self.local.store.clone()
            waiter.wait(keys, datetime.timedelta(seconds=self.timeout_s * LEADER_SHARE))
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
            doc = {"parts": {str(r): bytes(v).decode() for r, v in zip(present, values, strict=True)},
                   "missing": [r for r in members if r not in present]}
            self.central.store.set(node_part_key(prefix, self.node), json.dumps(doc))
        except Exception as exc:  # the job's store is gone: the coordinator misses this node
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
