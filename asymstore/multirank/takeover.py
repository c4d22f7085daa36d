"""A multi-rank job taking a single-process root over: one writer meanwhile, and never beside its versions unasked.

A :class:`~asymstore.multirank.RankStore` on a root whose current versions are single-process resumes
the newest of them, or starts beside them (``across_layouts="start_fresh"``); its first global
version records the root as multi-rank (:mod:`.rootlayout`). **One writer:** the coordinator holds
the root's writer lock (``ROOT/.lock``, :class:`~asymstore.io.rootlock.DirLock`) from ``open`` until
its first global version, so a single-process writer still on the root is a
:class:`~asymstore.errors.RootLockedError`. **Every rank alike:** what the coordinator found goes to
every rank (:func:`share`, :func:`verdict`), and every rank's first ``commit`` refuses to start beside
versions it neither resumed nor was told to leave (:class:`~asymstore.errors.LayoutTakeoverError`).

Guide: ``docs/guides/fsdp2.md`` (Across the single-process / multi-rank boundary).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from asymstore.io.rootlock import DirLock
from asymstore.multirank import rootlayout
from asymstore.multirank.protocol import Verdict, Wire

if TYPE_CHECKING:
    from asymstore.multirank.job import Job

logger = logging.getLogger(__name__)

__all__ = ["Verdict", "check_commit", "hold_root", "release_root", "share", "survey_at_open", "verdict"]

def hold_root(job: Job) -> None:
    """Coordinator: take the root's writer lock for the takeover, unless held already.

    Raises:
        RootLockedError: a single-process writer (or another job) holds it.
    """
    if job.root_lock is not None:
        return
    lock = DirLock(job.root)
    lock.acquire()
    job.root_lock = lock
    logger.info("%s: holding the root's writer lock while this multi-rank job takes it over", job.root)


def release_root(job: Job) -> None:
    """Give the root's writer lock back (after the first global version, or at close)."""
    if job.root_lock is not None:
        job.root_lock.release()
        job.root_lock = None


def survey_at_open(job: Job) -> Verdict:
    """Coordinator, at ``open`` (blocking): look at the root; hold its lock until the first global version.

    The lock is held whenever no global version is published yet (a takeover pending, or an empty
    root): a single-process writer that opened the root meanwhile would commit versions beside the
    job's first one, and its own open now fails instead (``RootLockedError``). A damaged record is
    not an error here (``restore`` and the first global commit say what is wrong with it, on every
    rank): the root is judged by what it holds.

    Raises:
        RootLockedError: no global version yet and another writer holds the root.
        RootUnreadableError: the root's entries cannot be listed.
    """
    found = rootlayout.survey_for_reading(job.root)
    if found.takeover_pending() or not found.global_steps:
        hold_root(job)
        found = rootlayout.survey_for_reading(job.root)  # again, no other writer now
    newest = found.single_steps[-1] if found.single_steps else None
    return Verdict(found.takeover_pending(), found.found(), newest)


async def share(job: Job, key: str, verdict: Verdict | None = None, *, error: BaseException | None = None) -> None:
    """Coordinator: tell every rank the verdict, or the error it could not open with."""
    if error is not None:
        verdict = Verdict(False, "", None, (type(error).__name__, str(error)))
    assert verdict is not None
    await asyncio.to_thread(Wire(job.fabric).announce, key, verdict)


async def verdict(job: Job, key: str, timeout_s: float) -> Verdict:
    """The coordinator's verdict (waiting for it up to ``timeout_s``).

    Raises:
        CoordinationTimeoutError: it did not come.
        CoordinationProtocolError: it is malformed.
        RootLockedError, RootUnreadableError, RootLayoutError: the coordinator's error at ``open``.
    """
    got = await asyncio.to_thread(Wire(job.fabric).hear, key, Verdict, timeout_s,
                                  "the coordinator's look at the root's layout")
    got.raise_error()
    return got


def check_commit(job: Job, got: Verdict) -> None:
    """Every rank, before committing: refuse to start beside a single-process root's versions unasked.

    Raises:
        LayoutTakeoverError: the root's single-process versions were neither resumed by this job nor
            left on request (``across_layouts="start_fresh"``).
    """
    if got.pending and got.newest is not None and job.resumed_single is None \
            and job.across_layouts != "start_fresh":
        refusal = rootlayout.takeover_refusal(got.found, got.newest)
        refusal.every_rank = True  # every rank decides from the same verdict: callers may stop alike
        raise refusal
