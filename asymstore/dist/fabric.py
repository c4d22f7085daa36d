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
  job's store.
- **Broadcasts fan out**: the coordinator puts each one into the job's store (for its own node) and
  into every node store itself (it connects to them once per session), as it puts the values ranks
  read every commit (the retention counters, the fallback to whole replicas). Nothing waits in the
  job's store for them, and nothing is blocked in a store call when a process exits.

A leader's death is its ranks' death: their node store dies with it (their requests fail, typed by the
store as ``RuntimeError``), the coordinator misses the node's part and abandons the round, and the next
session (the job restarted) elects the leaders anew. Values a node store holds are copies of what the
job's store held: a stale retention counter only keeps more shards than needed, never fewer.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
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
        self._prefix: str | None = None
        self._timeout_s = 300.0
        self._nodes: list[KV] = []  # the coordinator's clients of the other nodes' stores
        self._node_ids: dict[int, int] = {}  # id of a client of ``_nodes`` -> its node
        self._waiter: Any = None  # a member's connection to its node store for waits that block in the server

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

        The leader of a node other than 0 serves the node store and posts its address; the node's other
        ranks wait for it (once per session). The coordinator connects to every node store, for its
        broadcasts.

        Raises:
            CoordinationTimeoutError: a leader did not post its node store within ``timeout_s``.
        """
        top = self.topology
        self._prefix = session_prefix
        self._timeout_s = timeout_s
        if top is None or top.nodes == 1:
            return
        if self.rank == 0:
            self._nodes = [self._node_store(n) for n in range(1, top.nodes)]
            self._node_ids = dict(zip(map(id, self._nodes), range(1, top.nodes), strict=True))
            return
        if self.node == 0:
            return
        if top.is_leader(self.rank):
            self.relay = NodeRelay(self.kv, top, self.node, timeout_s)
            self.local = self.relay.local
            self.kv.store.set(node_address_key(session_prefix, self.node),
                              json.dumps({"host": self.relay.host, "port": self.relay.port}))
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
        """Stop this rank's relay (a leader's); the node store stays served until the process ends."""
        if self.relay is not None:
            self.relay.stop()


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
            self.kv.wait([k for k, _ in keyed], timeout_s, what)
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
        """The coordinator: put the broadcast ``key`` into the job's store and every node store.

        Raises:
            RuntimeError: a node store could not be reached (its leader is gone: its ranks with it).
        """
        self.kv.store.set(key, raw)
        self._fan_out(key, raw)

    def announce_each(self, key: str, raw_of: Callable[[int], str]) -> None:
        """The coordinator: a broadcast whose value differs by node: ``raw_of(n)`` into node ``n``'s store.

        Node 0's value goes into the job's store (its ranks read it there). Each rank then reads only
        what its node needs (e.g. a restore candidate's entries of its node's ranks, not every rank's).

        Raises:
            RuntimeError: the job's store could not be reached (a dead node's store is skipped, as in
                :meth:`announce`).
        """
        self.kv.store.set(key, raw_of(0))
        self._fan_out(key, "", raw_of)

    def _fan_out(self, key: str, raw: str, raw_of: Callable[[int], str] | None = None) -> None:
        """Put ``key`` into every node store still served (a dead node's ranks are gone with their leader).

        ``raw_of``: the value for each node instead of ``raw`` (:meth:`announce_each`).
        """
        nodes = list(self._nodes)
        if not nodes:
            return

        def put(node: KV) -> KV | None:
            try:
                node.store.set(key, raw if raw_of is None else raw_of(self._node_ids[id(node)]))
                return None
            except RuntimeError as exc:  # DistNetworkError: the leader's process is gone
                logger.warning("rank %d: a node store is gone (its leader died), its ranks hear nothing more: %s",
                               self.rank, str(exc).splitlines()[0][:200])
                return node

        if len(nodes) == 1:
            dead = [put(nodes[0])]
        else:
            with ThreadPoolExecutor(min(8, len(nodes))) as pool:  # node stores answer in parallel
                dead = list(pool.map(put, nodes))
        self._nodes = [n for n in self._nodes if n not in dead]

    def raise_counter(self, key: str, value: int) -> None:
        """The coordinator: raise the counter ``key`` to ``value`` (never lower) and tell every node store."""
        self.kv.raise_int(key, value)
        if self._nodes:
            self._fan_out(key, str(self.kv.read_int(key)))

    def hear(self, key: str, timeout_s: float, what: str) -> bytes:
        """Wait for the broadcast ``key`` in this rank's node store (the job's store on node 0) and return it.

        A rank of another node that does not lead it waits in its node store's server (``TCPStore.wait``
        on a connection of its own, in a daemon thread: the store lives in its leader's process, so the
        wait never holds up this process's exit); the others poll (a leader's own store, rank 0's node).

        Raises:
            CoordinationTimeoutError: not within ``timeout_s`` (or the process is exiting).
            RuntimeError: the node store is gone (the leader died).
        """
        if not self.local.has(key) and self.relay is None and not self.direct:
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
                waiter.wait([key], datetime.timedelta(seconds=_FOREVER_S))
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
        """Put ``key`` into every node store too (blocking): a broadcast from a rank that is not the coordinator.

        The preemption notice needs it: a rank that reads its node store right after a collective must
        see a notice published before that collective. Best effort per node (a node that cannot be
        reached is logged: its ranks are gone with their leader).
        """
        top, prefix = self.topology, self._prefix
        if top is None or top.nodes == 1 or prefix is None:
            return
        if self._nodes:
            self._fan_out(key, raw)
            return
        for node in range(1, top.nodes):
            try:
                self._node_store(node).store.set(key, raw)
            except Exception as exc:  # a dead node: its ranks are gone with their leader
                logger.warning("rank %d: could not put %s into node %d's store: %s", self.rank, key, node, exc)


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
    """A leader's relay from its node store to the job's store (see the module docstring).

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
        at_exit(self._release, phase=1)

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
        dies with this process; nothing else reads a part) and the forwards end without forwarding.
        """
        with self._lock:
            pending = [k for keys in self._pending.values() for k in keys]
        for key in pending:
            try:
                if not self.local.has(key):
                    self.local.store.set(key, "")
            except Exception as exc:
                logger.debug("node %d: %s", self.node, exc)
        deadline = time.monotonic() + EXIT_WAIT_S
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)


_SERVED: list[Any] = []
