"""The open store the DCP writers of one process share per root, and the save in progress on it.

DCP's own idiom builds a new ``StorageWriter`` for every save (``dcp.save(state,
storage_writer=StorageWriter(root), checkpoint_id=step)``). A store holds its root's lock while it
is open, so each writer opening a store of its own would meet the first one's lock. Instead, the
writers of one process that name the same directory or URI share one :class:`Session`: one store,
opened on one loop thread, plus what one long-lived writer would keep between saves (the save in
progress, the newest step chosen or committed). So a new writer per save behaves exactly as one
writer used for every save: one save at a time per root (a newer save supersedes an unfinished
one), steps only ever newer. Another process still meets the lock (``RootLockedError``).

A session is counted by its writers: :func:`release` from a writer's ``close`` closes the store once
no writer holds it. A writer dropped without ``close`` (the idiom never calls it) lets go of its count
without closing anything (it may be collected on any thread, the store's loop thread included); the
session stays open for the next writer, and is closed at the interpreter's exit (bounded by
:data:`~asymstore.runtime.exiting.EXIT_WAIT_S`) or by the ``close`` of any writer of that root, even one
that never saved (:func:`close_idle`).

Guide: ``docs/guides/dcp.md`` (Steps, and what the lock refuses).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asymstore.dist.world import rank_world
from asymstore.errors import DCPStorageError
from asymstore.format.names import is_uri
from asymstore.multirank.store import RankStore
from asymstore.runtime.exiting import EXIT_WAIT_S, at_exit, cancel
from asymstore.runtime.loop import StoreLoop
from asymstore.store import AsymStore

logger = logging.getLogger(__name__)

SessionKey = tuple[str, int, int]
"""A shared session's key: the resolved directory (or the URI), the process's rank and world size."""


@dataclass
class Save:
    """One ``dcp.save`` in progress."""

    rank: int
    coordinator: bool
    requested: int | None
    save_id: str
    step: int | None = None
    done: bool = False
    superseded: bool = False


@dataclass
class Session:
    """An open store and the save state of every writer over it (see the module docstring).

    Attributes:
        loop: the store, open on its loop thread.
        options: ``(keep_last, store options)`` it was opened with (a writer sharing it must give the same).
        key: its key in the registry (None: a store or tiers given to one writer, not shared).
        refs: writers holding it.
        saves: the save in progress, by the thread DCP runs it on.
        last_chosen: the newest step a save took.
        last_step: the newest step a save committed.
        exit_handle: its exit callback (closes it at the interpreter's exit).
        closed: set once it closes (or began closing).
    """

    loop: StoreLoop[AsymStore | RankStore]
    options: tuple[int | None, dict[str, Any]]
    key: SessionKey | None = None
    refs: int = 1
    saves: dict[int, Save] = field(default_factory=dict)
    last_chosen: int | None = None
    last_step: int | None = None
    exit_handle: int | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while a save takes over from the previous one."""


_lock = threading.Lock()
_open: dict[SessionKey, Session] = {}


def shared_key(location: object) -> SessionKey | None:
    """The key writers of ``location`` share a session under: a directory or a URI; None for anything else."""
    if not isinstance(location, (str, os.PathLike)):
        return None
    path = os.fspath(location)
    if not isinstance(path, str):
        return None
    resolved = path if is_uri(path) else os.path.realpath(path)
    rank, world = rank_world()
    return (resolved, rank, world)


def acquire(key: SessionKey | None, options: tuple[int | None, dict[str, Any]],
            build: Callable[[], AsymStore | RankStore], name: str) -> Session:
    """The open session of ``key`` (one more writer holds it), or a new one with the store ``build()`` makes.

    Raises:
        DCPStorageError: the root is open in this process with other options.
        RootLockedError: another process writes the root.
    """
    with _lock:
        if key is not None:
            session = _open.get(key)
            if session is not None and not session.closed:
                if session.options != options:
                    raise DCPStorageError(
                        f"{key[0]} is open in this process by a StorageWriter with keep_last={session.options[0]} "
                        f"and store options {session.options[1]}: the writers of one root share its store, so "
                        "give them the same options (or close the others first)")
                session.refs += 1
                return session
        session = Session(StoreLoop(build(), name=name), options, key)
        if key is not None:
            _open[key] = session
            session.exit_handle = at_exit(lambda: _close_at_exit(session))
        return session


def release(session: Session, *, close: bool) -> None:
    """One writer lets go of ``session``; with ``close``, the store closes once no writer holds it.

    Without ``close`` (a writer collected without being closed) nothing is closed here: the finalizer may
    run on any thread, the store's own loop thread included.
    """
    with _lock:
        session.refs = max(0, session.refs - 1)
        if not close or session.refs > 0 or session.closed:
            return
        session.closed = True
        if session.key is not None and _open.get(session.key) is session:
            del _open[session.key]
    cancel(session.exit_handle)
    session.loop.close()


def close_idle(key: SessionKey | None) -> None:
    """Close the session of ``key`` if no writer holds it (its writers were dropped without ``close``)."""
    with _lock:
        session = _open.get(key) if key is not None else None
        if session is None or session.refs > 0:
            return
        session.refs = 1
    release(session, close=True)


def _close_at_exit(session: Session) -> None:
    """The interpreter exits with the session open: close its store if no save is in progress (bounded)."""
    with _lock:
        if session.closed:
            return
        session.closed = True
        if session.key is not None and _open.get(session.key) is session:
            del _open[session.key]
    if any(not s.done for s in session.saves.values()):
        logger.warning("a DCP save into %s was in progress at exit: the store is left as a killed process leaves it",
                       session.key[0] if session.key else "the store")
        return
    session.loop.close(timeout=EXIT_WAIT_S)
