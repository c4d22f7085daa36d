"""Rank coordination over a torch.distributed key-value store (TCPStore), never a collective.

Every exchange of the multi-rank protocol is a few keys on the job's c10d
store: a rank ``set``s a JSON value, the reader waits for the keys. Waiting
polls ``check`` (with a short back-off) instead of calling the store's
blocking ``wait``: a blocking wait holds the client's connection lock for its
whole duration, and the same client must stay usable from another thread.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from asymstore.errors import CoordinationTimeoutError
from asymstore.runtime.exiting import exiting

logger = logging.getLogger(__name__)

_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.02


def store_from_env(namespace: str, *, timeout_s: float = 300.0) -> Any:
    """Connect a new client to the job's TCPStore (``MASTER_ADDR``/``MASTER_PORT``), keys under ``namespace``.

    The server is the one ``torch.distributed`` init (or torchrun) started;
    a client of our own keeps our waits off the connection torch uses.

    Raises:
        KeyError: ``MASTER_ADDR`` or ``MASTER_PORT`` is not set.
    """
    import torch.distributed as dist

    client = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"asymstore/{namespace}", client)  # type: ignore[attr-defined]


class KV:
    """JSON values and waits over a c10d store (``set``, ``get``, ``check``, ``add``).

    Args:
        store: a ``torch.distributed.Store`` (TCPStore, PrefixStore, HashStore).
        poll_max_s: the longest pause between two polls of a wait (a node-local store affords short ones).
    """

    def __init__(self, store: Any, *, poll_max_s: float = _POLL_MAX_S) -> None:
        """Wrap ``store``."""
        self.store = store
        self.poll_max_s = poll_max_s

    def put(self, key: str, value: Any) -> None:
        """Set ``key`` to ``value`` as JSON."""
        self.store.set(key, json.dumps(value, allow_nan=False))

    def get(self, key: str) -> Any:
        """Return the JSON value of ``key`` (it must exist)."""
        return json.loads(bytes(self.store.get(key)).decode())

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        """Return the JSON values of ``keys`` (they must exist), in one request where the store can."""
        if not keys:
            return []
        multi_get = getattr(self.store, "multi_get", None)
        raw = multi_get(list(keys)) if multi_get is not None else [self.store.get(k) for k in keys]
        return [json.loads(bytes(v).decode()) for v in raw]

    def has(self, key: str) -> bool:
        """True when ``key`` is set."""
        return bool(self.store.check([key]))

    def missing(self, keys: Sequence[str]) -> list[str]:
        """Return the keys of ``keys`` not set yet."""
        return [k for k in keys if not self.store.check([k])]

    def wait(self, keys: Sequence[str], timeout_s: float, what: str) -> None:
        """Wait until every key is set.

        Raises:
            CoordinationTimeoutError: ``timeout_s`` passed first (names ``what`` and the missing keys), or
                the interpreter is exiting (the wait must not hold up its exit: see :mod:`asymstore.runtime.exiting`).
        """
        deadline = time.monotonic() + timeout_s
        pending = list(keys)
        delay = _POLL_MIN_S
        while True:  # one request per poll, however many keys (a per-key poll grows as N x polls per commit)
            if not pending or self.store.check(pending):
                return
            if exiting():
                raise CoordinationTimeoutError(f"{what}: the process is exiting; still missing: {pending}")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = self.missing(pending)
                if not missing:
                    return
                raise CoordinationTimeoutError(f"{what}: still missing after {timeout_s:g} s: {missing}")
            time.sleep(min(delay, left))
            delay = min(delay * 2, self.poll_max_s)

    def read_int(self, key: str) -> int:
        """Return the integer counter ``key`` (0 when never set), without blocking."""
        return int(self.store.add(key, 0))

    def raise_int(self, key: str, value: int) -> int:
        """Raise the counter ``key`` to ``value`` (never lowers it); return the counter's value after."""
        current = self.read_int(key)
        if value > current:
            return int(self.store.add(key, value - current))
        return current


class MemoryStore:
    """A process-local stand-in for a c10d store (``set``/``get``/``check``/``add``), for a world of one."""

    def __init__(self) -> None:
        """Start empty."""
        self._data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        """Set ``key``."""
        self._data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        """Return the value of ``key`` (KeyError when unset)."""
        return self._data[key]

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key is set."""
        return all(k in self._data for k in keys)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of ``keys`` (KeyError when one is unset)."""
        return [self._data[k] for k in keys]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer ``key`` and return the new value."""
        value = int(self._data.get(key, b"0")) + amount
        self._data[key] = str(value).encode()
        return value
