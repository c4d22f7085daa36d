"""A torchft ``CheckpointTransport`` that heals a replica group from a healthy group's committed version.

torchft's ``Manager`` asks a healthy replica group to ``send_checkpoint`` (with its live state dict)
and the recovering group to ``recv_checkpoint`` the same step. :class:`StoreTransport` never sends
the live state: each group commits a version of its torchft state after every committed step
(:meth:`StoreTransport.save`, one line in the loop) to its own store — a memory tier as the durable
one, so the commit returns once the version is in host memory, and the store's slower tiers (local
disk, remote) receive it in the background. A recovering group reads that step's version from the
healthy group's fastest tier holding it, over a socket of the transport's own
(:mod:`asymstore.torchft.wire`), and verifies it with the store's read path before torchft applies it.

What a version holds: the state of every callback given to :meth:`StoreTransport.attach` (what
torchft's own transports send), torchft's counters (``step``, ``batches_committed``) and the
group's own record: its RNG states and its data position (an object with
``state_dict``/``load_state_dict``, optional). The record travels with the version and is loaded
on the healed group by the ``"asymstore"`` state callback :meth:`StoreTransport.attach` registers with the Manager.
Guide: docs/guides/torchft.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
from torchft.checkpointing.transport import CheckpointTransport

from asymstore.errors import (
    AsymstoreError,
    CorruptVersionError,
    HealCorruptError,
    HealError,
    HealProtocolError,
    HealTimeoutError,
    HealVersionMissingError,
    VersionNotFoundError,
)
from asymstore.read.load import load_version
from asymstore.runtime.loop import StoreLoop
from asymstore.runtime.sync import run_sync
from asymstore.store import AsymStore
from asymstore.torchft.state import flatten, unflatten
from asymstore.torchft.wire import ServedTier, VersionServer

logger = logging.getLogger(__name__)

__all__ = ["Healed", "ManagerLike", "Position", "StoreTransport"]

KEY = "asymstore"
"""The Manager state key under which the group's record (RNG, data position) travels."""

FORMAT = 1
"""The version of the record in a version's meta (``meta["torchft"]``)."""

MAX_METADATA_BYTES = 4096
"""Longest metadata string accepted from a peer."""


class ManagerLike(Protocol):
    """What the transport uses of ``torchft.Manager`` (its public methods)."""

    def current_step(self) -> int:
        """Steps committed so far."""
        ...

    def state_dict(self) -> dict[str, int]:
        """The Manager's own counters (``step``, ``batches_committed``)."""
        ...

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[Any], None],
                               state_dict: Callable[[], Any]) -> None:
        """Register a state that a recovering group loads."""
        ...


class Position(Protocol):
    """A data position: an object with ``state_dict``/``load_state_dict`` (a sampler, a loader's counter)."""

    def state_dict(self) -> Any:
        """The position now."""
        ...

    def load_state_dict(self, state: Any) -> None:
        """Continue from ``state``."""
        ...


@dataclass(frozen=True)
class Healed:
    """What the latest heal of this group received.

    Attributes:
        step: the version's step (torchft's ``max_step``).
        source_group: the replica group that served it.
        source_tier: the serving store's tier it was read from (``memory``, ``local:...``).
        nbytes: the version's stored bytes.
        seconds: from the request to the verified state.
    """

    step: int
    source_group: str
    source_tier: str
    nbytes: int
    seconds: float


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            states[f"cuda:{i}"] = torch.cuda.get_rng_state(i)
    return states


def _set_rng_states(states: Mapping[str, Any]) -> None:
    for role, state in states.items():
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise HealCorruptError(f"the RNG state {role!r} is not a byte tensor")
        if role == "torch":
            torch.set_rng_state(state.clone())
        elif role.startswith("cuda:") and torch.cuda.is_available() and role[5:].isdigit() \
                and int(role[5:]) < torch.cuda.device_count():
            torch.cuda.set_rng_state(state.clone(), int(role[5:]))


class StoreTransport(CheckpointTransport[dict[str, Any]]):  # type: ignore[misc]
    """Heals a torchft replica group from a healthy group's newest committed version, verified on arrival.

    ::

        store = AsymStore([host_tier(1 << 30), LocalTier(f"ckpt/group-{rid}")], durable="memory")
        transport = StoreTransport(store, replica_group=str(rid))
        manager = Manager(pg=pg, load_state_dict=load, state_dict=state, ..., checkpoint_transport=transport)
        transport.attach(manager, {"default": state}, position=sampler)
        ...
            optimizer.step()
            transport.save()          # the committed step's version, in the store

    Args:
        store: an unopened store (the transport opens it on a thread of its own and closes it at
            :meth:`shutdown`); its durable tier should be a memory tier (``durable=``), so that
            :meth:`save` returns once the version is in host memory, the rest following in the background.
        replica_group: this group's name (torchft's ``replica_id``), recorded in every version.
        host: the address this group serves on and advertises to the others.
        timeout: every socket operation of a request served (a recovering group's read is bounded by the
            timeout torchft gives ``recv_checkpoint``).

    Raises:
        RootLockedError: another live store writes one of the store's roots.
    """

    def __init__(self, store: AsymStore, *, replica_group: str, host: str = "127.0.0.1",
                 timeout: timedelta = timedelta(seconds=60)) -> None:
        """Open the store and start serving its committed versions."""
        self.replica_group = replica_group
        self._loop = StoreLoop(store, name="asymstore-torchft")
        self._store = store
        self._server = VersionServer(store.tiers, self._loop.run, host=host, timeout_s=timeout.total_seconds())
        self._manager: ManagerLike | None = None
        self._states: dict[str, Callable[[], Any]] = {}
        self._position: Position | None = None
        self._commits: dict[int, concurrent.futures.Future[Any]] = {}
        self._last_saved: int | None = None
        self.healed: Healed | None = None
        """What the latest heal received (None: this group never healed)."""
        self.served_steps: list[int] = []
        """The steps torchft asked this group to serve (``send_checkpoint``), in order."""

    @property
    def store(self) -> AsymStore:
        """The store (open; its calls run on the transport's loop: use :meth:`run`)."""
        return self._store

    def run(self, coro: Any) -> Any:
        """Run a coroutine of the store on the transport's loop and return its result."""
        return self._loop.run(coro)

    # -- the training side ------------------------------------------------------------

    def attach(self, manager: ManagerLike, states: Mapping[str, Callable[[], Any]] | Callable[[], Any],
               *, position: Position | None = None) -> None:
        """Say what each version holds, and register the group's record with ``manager``.

        Args:
            manager: the group's ``torchft.Manager``.
            states: the state callbacks registered with the Manager, by key (a single callable: the key
                ``"default"``, what ``Manager(state_dict=...)`` registers).
            position: the group's data position (saved with each version; loaded when the group heals).
        """
        self._manager = manager
        self._states = {"default": states} if callable(states) else dict(states)
        if KEY in self._states:
            raise ValueError(f"the state key {KEY!r} is the transport's own")
        self._position = position
        manager.register_state_dict_fn(KEY, self._load_record, self._record)

    def _record(self) -> dict[str, Any]:
        return {"group": self.replica_group, "rng": _rng_states(),
                "position": self._position.state_dict() if self._position is not None else None}

    def _load_record(self, record: Any) -> None:
        """Put back the served group's RNG states and data position (torchft calls it on the training thread)."""
        if not isinstance(record, dict) or not isinstance(record.get("rng"), dict):
            raise HealCorruptError("the version's group record is malformed")
        _set_rng_states(record["rng"])
        if self._position is not None and record.get("position") is not None:
            self._position.load_state_dict(record["position"])

    def save(self) -> int | None:
        """Commit the state of the step torchft just committed as a version; return its step.

        Call it after ``optimizer.step()``. The state is copied into the store here (on the training
        thread); the commit runs in the background and :meth:`send_checkpoint` waits for it. A step
        already saved (torchft did not commit: the optimizer did not step) is not saved again (None).

        Raises:
            HealProtocolError: a state that has no pickle-free form.
            RuntimeError: :meth:`attach` was not called.
        """
        if self._manager is None:
            raise RuntimeError("StoreTransport.save() before attach()")
        step = self._manager.current_step()
        if self._last_saved is not None and step <= self._last_saved:
            return None
        newest = self._loop.run(_newest(self._store))
        if newest is not None and step <= newest:  # a restarted group's own older run, on its persistent tier
            logger.info("step %d not saved: the store already holds step %d", step, newest)
            return None
        skeleton, tensors = flatten({"user": {k: fn() for k, fn in self._states.items()} | {KEY: self._record()}})
        meta = {"torchft": {"format": FORMAT, "group": self.replica_group, "state": skeleton,
                            "manager": {k: int(v) for k, v in self._manager.state_dict().items()}}}
        self._loop.run(self._store.put_many(step, tensors))
        self._commits[step] = self._loop.submit(self._store.commit(step, meta))
        for old in [s for s in self._commits if s < step and self._commits[s].done()]:
            exc = self._commits.pop(old).exception()
            if exc is not None:  # never in training's way: that step cannot be served (HealVersionMissingError)
                logger.error("the version of step %d was not committed: %s: %s", old, type(exc).__name__, exc)
        self._last_saved = step
        return step

    # -- CheckpointTransport ----------------------------------------------------------

    def metadata(self) -> str:
        """Where this group serves: ``{"addr": "host:port", "group": name}`` as JSON."""
        return json.dumps({"addr": self._server.address, "group": self.replica_group})

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any],
                        timeout: timedelta) -> None:
        """Make sure version ``step`` is committed here, to be served; ``state_dict`` (the live state) is not read.

        Raises:
            HealVersionMissingError: this group never saved ``step`` (torchft then reports the error).
            HealTimeoutError: its commit did not finish within ``timeout``.
        """
        self.served_steps.append(step)
        fut = self._commits.get(step)
        if fut is None:
            try:
                self._loop.run(self._store.read_manifest(step))
                return
            except VersionNotFoundError as exc:
                raise HealVersionMissingError(f"replica group {self.replica_group} holds no version of step {step} "
                                              "(StoreTransport.save() after each committed step saves it)") from exc
        try:
            fut.result(timeout=timeout.total_seconds())
        except concurrent.futures.TimeoutError as exc:
            raise HealTimeoutError(f"step {step} was not committed within {timeout}") from exc
        except AsymstoreError as exc:
            raise HealVersionMissingError(f"the version of step {step} was not committed here: "
                                          f"{type(exc).__name__}: {exc}") from exc

    def disallow_checkpoint(self) -> None:
        """Nothing to hold back: a committed version never changes, so training never waits for a transfer."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        """Read version ``step`` from the group ``metadata`` names, verify it, and return torchft's state dict.

        Raises:
            HealProtocolError: ``metadata`` or an answer is malformed.
            HealVersionMissingError: the serving group holds no version of ``step``.
            HealCorruptError: the bytes do not verify (a checksum, a size, the manifest, the state record).
            HealTimeoutError: the version did not arrive within ``timeout``.
            HealError: the serving group failed otherwise (its tier, the connection).
        """
        started = time.monotonic()
        addr, group = _parse_metadata(metadata)
        tier = ServedTier(addr, step, started + timeout.total_seconds())
        try:
            manifest, tensors = run_sync(load_version(tier, step))
        except HealError:
            raise
        except VersionNotFoundError as exc:
            raise HealVersionMissingError(f"replica group {group} at {addr}: {exc}") from exc
        except CorruptVersionError as exc:
            raise HealCorruptError(f"the version of step {step} from replica group {group} at {addr} "
                                   f"does not verify: {exc}") from exc
        except AsymstoreError as exc:
            raise HealError(f"step {step} from replica group {group} at {addr}: {type(exc).__name__}: {exc}") \
                from exc
        record = manifest.meta.get("torchft")
        if not isinstance(record, dict) or record.get("format") != FORMAT \
                or not isinstance(record.get("manager"), dict):
            raise HealCorruptError(f"the version of step {step} from {addr} holds no torchft state record")
        counters = record["manager"]
        if counters.get("step") != step or manifest.step != step:
            raise HealCorruptError(f"the version from {addr} is of step {counters.get('step')}, "
                                   f"torchft asked for {step}")
        state = unflatten(record.get("state"), tensors)
        if not isinstance(state, dict) or not isinstance(state.get("user"), dict):
            raise HealCorruptError(f"the version of step {step} from {addr} holds no user state")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in counters.values()):
            raise HealCorruptError(f"torchft's counters in the version from {addr} are not ints")
        self.healed = Healed(step, str(record.get("group")), tier.source or "?", manifest.nbytes,
                             time.monotonic() - started)
        logger.info("healed step %d from replica group %s (%s, %d bytes, %.3f s)", step, self.healed.source_group,
                    self.healed.source_tier, manifest.nbytes, self.healed.seconds)
        self._last_saved = None  # the next save is of the healed step's successors
        return cast(dict[str, Any], {"user": state["user"], "torchft": dict(counters)})

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving; with ``wait``, also wait for the commits in flight and close the store.

        Closing the store waits for its background tiers, so the newest versions reach the disk.
        ``wait=False`` (what ``Manager.shutdown(wait=False)`` passes on) only stops serving: the store
        stays open until ``shutdown()`` is called (or the process exits: then what the slower tiers have
        not received yet stays in memory only, as after a kill).
        """
        self._server.close()
        if not wait:
            return
        for fut in self._commits.values():
            try:
                fut.result()
            except Exception as exc:  # reported, the store still closes
                logger.error("a version's commit failed: %s", exc)
        self._loop.close(timeout=None)


async def _newest(store: AsymStore) -> int | None:
    return store.newest_step


def _parse_metadata(metadata: object) -> tuple[str, str]:
    if not isinstance(metadata, str) or len(metadata) > MAX_METADATA_BYTES:
        raise HealProtocolError("the serving group's metadata is not a short string")
    try:
        record = json.loads(metadata)
    except ValueError as exc:
        raise HealProtocolError(f"the serving group's metadata is not JSON: {metadata[:200]!r}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("addr"), str) \
            or not isinstance(record.get("group"), str):
        raise HealProtocolError(f"the serving group's metadata is malformed: {metadata[:200]!r}")
    return record["addr"], record["group"]
