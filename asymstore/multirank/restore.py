"""The collective restore of a :class:`~asymstore.multirank.RankStore`: every rank loads the same global version.

Through a :class:`~asymstore.multirank.protocol.RestoreRound`: every rank lists its shard steps; the
coordinator offers the candidates one by one (newest first; other world sizes through
:mod:`.reshard`); every rank checks its destinations against its shard (``fit``) before the
coordinator says ``go``, then loads and verifies its shard against the digest the global manifest
records for it. The first candidate that loads on every rank wins.

What a rank hears of a candidate is O(its node), not O(ranks): each node hears a
:class:`~asymstore.multirank.protocol.NodeCandidate` (the global step, world size and
:func:`~asymstore.format.globalmanifest.manifest_digest`, and the entries of the node's ranks only),
unless the candidate is read through :mod:`.reshard` (another world size, a single-process version,
slices of a replicated state), where every rank reads other ranks' shards and hears the whole manifest.
Once done, the coordinator puts the whole manifest in the job's store; a rank reads it from there only
when asked (:attr:`Chosen.manifest` None: :func:`whole_manifest`), checked against the digest.

The coordinator's errors, and a destination a rank refused
(:class:`~asymstore.errors.DestinationMismatchError`, before any byte is written), are raised on every
rank alike. With ``into`` each rank reads straight into its destinations (:mod:`asymstore.read.load`).

Guide (the restore step by step): ``docs/guides/multirank.md``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asymstore.errors import (
    AsymstoreError,
    CoordinationProtocolError,
    CorruptVersionError,
    DestinationMismatchError,
    GlobalManifestError,
    NoCheckpointError,
    RootLayoutError,
    RootLockedError,
    VersionNotFoundError,
    WorldSizeMismatchError,
    describe,
)
from asymstore.format.globalmanifest import GlobalManifest, ShardInfo, manifest_digest, shard_digest
from asymstore.format.replicas import is_sliced
from asymstore.multirank import rootlayout, takeover
from asymstore.multirank.protocol import Fit, Go, Have, LoadResult, NodeCandidate, Relayed, RestoreRound, TryMsg
from asymstore.multirank.reshard import restore_resharded
from asymstore.read.load import check_destinations
from asymstore.values import Checkpoint

if TYPE_CHECKING:
    from asymstore.dist.kv import KV
    from asymstore.multirank.job import Job
    from asymstore.store import AsymStore
    from asymstore.values import Into, Targets

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class Chosen:
    """A restore candidate as this rank knows it (the one chosen, once the restore is done).

    Attributes:
        step: the global step.
        world_size: the global version's ranks.
        shard: this rank's entry (None: the rank is beyond the version's world).
        resharded: read through :mod:`.reshard` (see :func:`_resharded`).
        manifest: the whole global manifest (None: this rank heard its node's entries only).
        node: what this rank's node heard (None: the whole manifest came).
        key: the restore round's prefix (where the coordinator puts the whole manifest once done).
    """

    step: int
    world_size: int
    shard: ShardInfo | None
    resharded: bool
    manifest: GlobalManifest | None = None
    node: NodeCandidate | None = None
    key: str = ""

    @classmethod
    def whole(cls, job: Job, g: GlobalManifest, key: str = "") -> Chosen:
        """The candidate ``g`` heard whole."""
        return cls(g.step, g.world_size, g.shard(job.rank) if job.rank < g.world_size else None,
                   _resharded(job, g), g, None, key)


def whole_manifest(kv: KV, chosen: Chosen) -> GlobalManifest:
    """The whole global manifest of ``chosen``: the one heard, else the coordinator's (one request on ``kv``).

    Raises:
        CoordinationProtocolError: the manifest in the job's store is malformed, or not the one the
            coordinator offered (another step or digest).
    """
    if chosen.manifest is not None:
        return chosen.manifest
    assert chosen.node is not None
    return RestoreRound.of(kv, chosen.key, chosen.world_size).whole(chosen.node)


Restored = tuple[Chosen, Checkpoint, list[str]]
"""The global version chosen, this rank's checkpoint of it, and notes on the candidates skipped."""


def own_steps(local: AsymStore) -> list[int]:
    """The shard steps any of this rank's own tiers (``local``) holds, ascending."""
    return sorted({v for vs in local.versions().values() for v in vs})


async def restore_collective(job: Job, local: AsymStore, reshard: Targets | None, key: str, step: int | None,
                             into: Into | None) -> Restored:
    """Agree with every rank on a global version and load this rank's part of it (see the module docstring).

    Args:
        job: this rank's job.
        local: this rank's own store (open, its versions refreshed).
        reshard: restore versions of another world size through these targets (None: refuse them).
        key: the coordination key prefix of this restore (the same on every rank:
            :func:`~asymstore.multirank.protocol.round_key`).
        step: restore exactly this global step.
        into: this rank's tensors to fill in place (see :meth:`asymstore.AsymStore.restore`).

    Raises:
        NoCheckpointError, VersionNotFoundError, WorldSizeMismatchError, CorruptVersionError,
        CoordinationTimeoutError: see :meth:`asymstore.multirank.RankStore.restore`.
        DestinationMismatchError: a rank refused the destinations of the candidate (see the module docstring).
        CoordinationProtocolError: a rank put a malformed message.
    """
    rnd = RestoreRound.of(job.fabric, key, job.world_size)
    if job.is_coordinator:
        haves = await asyncio.to_thread(_gather_haves, job, rnd, local)
        return await _coordinate(job, local, reshard, rnd, haves, step, into)
    await asyncio.to_thread(rnd.have, job.rank, Have(tuple(own_steps(local))))
    return await _follow(job, local, reshard, rnd, into)


def _gather_haves(job: Job, rnd: RestoreRound, local: AsymStore) -> dict[int, set[int]]:
    rnd.have(job.rank, Have(tuple(own_steps(local))))
    return {r: set(h.steps) for r, h in enumerate(rnd.haves(job.restore_timeout_s))}


def _candidates(job: Job, reshard: Targets | None, haves: dict[int, set[int]], step: int | None,
                notes: list[str]) -> list[GlobalManifest]:
    found = rootlayout.survey(job.root)  # RootLayoutError: a damaged record
    _ = found.layout  # RootLayoutConflictError: both layouts and nothing saying which is current
    steps = sorted(job.global_steps(), reverse=True)
    if not steps and found.adoptable_single():
        if job.across_layouts == "resume":
            return _single_candidates(job, found, reshard, step, notes)
        logger.warning("%s: not resuming them (across_layouts='start_fresh'): this job's multi-rank versions "
                       "begin beside them", found.found())
    if step is not None:
        if step not in steps:
            raise VersionNotFoundError(f"global step {step} is not published under {job.global_dir}")
        steps = [step]
    if not steps:
        raise NoCheckpointError(f"no global version under {job.global_dir}")
    out: list[GlobalManifest] = []
    for s in steps:
        try:
            g = job.read_global(s)
        except (GlobalManifestError, OSError) as exc:
            notes.append(f"global step {s}: {describe(exc)}")
            continue
        if g.world_size != job.world_size and reshard is not None:
            out.append(g)  # read from every old rank's shard (reshardread), not from this rank's own
            continue
        if g.world_size != job.world_size:
            if not out:
                raise WorldSizeMismatchError(
                    f"global step {s} was written by {g.world_size} rank(s); this job has {job.world_size}. "
                    "Restore needs the same world size, or resharding (RankStore.reshard)")
            continue
        lacking = [r for r in range(job.world_size) if g.shard(r).step not in haves[r]]
        if lacking:
            notes.append(f"global step {s}: rank(s) {lacking} do not hold their shard")
            continue
        out.append(g)
    return out


def _single_candidates(job: Job, found: rootlayout.RootSurvey, reshard: Targets | None, step: int | None,
                       notes: list[str]) -> list[GlobalManifest]:
    """The single-process versions of the root, newest first, each as a global version of one rank."""
    steps = sorted(found.adoptable_single(), reverse=True)
    if step is not None:
        if step not in steps:
            raise VersionNotFoundError(f"{found.found()}: step {step} is not among its single-process versions")
        steps = [step]
    if reshard is None:
        raise WorldSizeMismatchError(
            f"{found.found()}: its versions were written by a single process; this job has {job.world_size} "
            "rank(s). Resuming them needs resharding (RankStore.reshard, which the Checkpointer sets), or "
            "across_layouts='start_fresh' to start beside them")
    takeover.hold_root(job)  # RootLockedError: a single-process writer still writes them (held since open, mostly)
    out: list[GlobalManifest] = []
    for s in steps:
        try:
            out.append(rootlayout.single_version(job.root, s))
        except (CorruptVersionError, OSError) as exc:
            notes.append(f"single-process version {s} of {job.root}: {describe(exc)}")
    return out


async def _coordinate(job: Job, local: AsymStore, reshard: Targets | None, rnd: RestoreRound,
                      haves: dict[int, set[int]], step: int | None, into: Into | None) -> Restored:
    notes: list[str] = []
    try:
        candidates = _candidates(job, reshard, haves, step, notes)
    except (NoCheckpointError, WorldSizeMismatchError, RootLayoutError, RootLockedError) as exc:
        await asyncio.to_thread(rnd.post_try, 0, TryMsg(error=Relayed.of(exc)))
        raise
    for k, g in enumerate(candidates):
        c = Chosen.whole(job, g, rnd.prefix)
        await asyncio.to_thread(_offer, job, rnd, k, c)
        refused = await _check_fit(job, local, c, into)
        early = await _load_early(job, local, reshard, rnd, k, c, into, refused)
        fits = await asyncio.to_thread(rnd.fits, k, job.restore_timeout_s, f"ranks checking global step {g.step}")
        misfits = {r: fit.reason for r, fit in enumerate(fits) if not fit.ok}
        if misfits:  # the live objects do not fit this version: nothing is read, no older one is tried
            msg = f"global step {g.step}: rank(s) {sorted(misfits)} refused it: " + "; ".join(
                f"rank {r}: {why}" for r, why in sorted(misfits.items()))
            relay = Relayed("DestinationMismatchError", msg)
            await asyncio.to_thread(rnd.go, k, Go(relay))
            await asyncio.to_thread(rnd.post_try, k + 1, TryMsg(error=relay))  # the ranks that loaded early hear it
            raise refused or DestinationMismatchError(msg)
        await asyncio.to_thread(rnd.go, k, Go())
        ckpt, _, refused = early or await _load(job, local, reshard, rnd, k, c, into)
        results = await asyncio.to_thread(rnd.results, k, job.restore_timeout_s, f"ranks loading global step {g.step}")
        bad = {r: res.reason for r, res in enumerate(results) if not res.ok}
        refusals = {r: res.reason for r, res in enumerate(results) if res.refused}
        if refusals:  # the live objects do not fit this version: no older one is tried
            msg = f"global step {g.step}: rank(s) {sorted(refusals)} refused it: " + "; ".join(
                f"rank {r}: {why}" for r, why in sorted(refusals.items()))
            await asyncio.to_thread(rnd.post_try, k + 1, TryMsg(error=Relayed("DestinationMismatchError", msg)))
            raise refused or DestinationMismatchError(msg)
        if not bad and ckpt is not None:
            if not c.resharded:  # the ranks heard their nodes' entries: the whole manifest, for who asks later
                await asyncio.to_thread(rnd.chosen, g)
            await asyncio.to_thread(rnd.post_try, k + 1, TryMsg(done=g.step, notes=tuple(notes)))
            return c, ckpt, notes
        notes.append(f"global step {g.step}: failed on rank(s) {bad}")
        logger.warning("restore: global step %d failed on rank(s) %s; trying the one before", g.step, sorted(bad))
    msg = "no global version verified on every rank: " + "; ".join(notes)
    await asyncio.to_thread(rnd.post_try, len(candidates), TryMsg(error=Relayed("CorruptVersionError", msg)))
    raise CorruptVersionError(msg)


def _offer(job: Job, rnd: RestoreRound, k: int, c: Chosen) -> None:
    """Offer candidate ``k``: whole when read through :mod:`.reshard`, else each node its own ranks' entries."""
    g = c.manifest
    assert g is not None
    if c.resharded:
        rnd.post_try(k, TryMsg(g))
        return
    digest = manifest_digest(g)
    rnd.post_try_each(k, lambda node: TryMsg(node=NodeCandidate.of(g, _node_ranks(job, node), digest)))


def _node_ranks(job: Job, node: int) -> range:
    """The ranks of ``node`` as this job's fabric routes them (every rank: one node)."""
    top = job.fabric.topology
    if top is None or top.nodes == 1:
        return range(job.world_size)
    return top.members(node)


def _heard(job: Job, rnd: RestoreRound, k: int, msg: TryMsg) -> Chosen:
    """What a rank heard of a candidate, checked: a node's candidate must be for its world and its node.

    Raises:
        CoordinationProtocolError: it is not (another world size, other ranks, a version of slices).
    """
    if msg.candidate is not None:
        return Chosen.whole(job, msg.candidate, rnd.prefix)
    node = msg.node
    assert node is not None
    want = _node_ranks(job, job.fabric.node)
    if node.world_size != job.world_size or node.ranks != want or is_sliced([s.summary for s in node.shards]):
        raise CoordinationProtocolError(
            f"{rnd.key('try', k)}: rank {job.rank} heard a candidate of global step {node.step} for ranks "
            f"{node.ranks.start}..{node.ranks.stop - 1} of {node.world_size}; its node holds ranks "
            f"{want.start}..{want.stop - 1} of {job.world_size} (and slices come whole)")
    return Chosen(node.step, node.world_size, node.shard(job.rank), False, None, node, rnd.prefix)


async def _follow(job: Job, local: AsymStore, reshard: Targets | None, rnd: RestoreRound,
                  into: Into | None) -> Restored:
    k = 0
    ckpt: Checkpoint | None = None
    g: Chosen | None = None
    refused: DestinationMismatchError | None = None
    while True:
        msg = await asyncio.to_thread(rnd.wait_try, k, job.restore_timeout_s)
        if msg.error is not None:
            if refused is not None and msg.error.error == "DestinationMismatchError":
                raise refused  # this rank's own refusal, with its cause
            raise msg.error.exception(CorruptVersionError)
        if msg.done is not None:
            if ckpt is None or g is None or g.step != msg.done:
                raise CoordinationProtocolError(f"the coordinator says global step {msg.done} was restored; "
                                                f"this rank loaded {None if g is None else g.step}")
            return g, ckpt, list(msg.notes)
        g = _heard(job, rnd, k, msg)
        refused = await _check_fit(job, local, g, into)
        early = await _load_early(job, local, reshard, rnd, k, g, into, refused)
        if early is None:  # it writes into live objects: only after the coordinator's go
            go = await asyncio.to_thread(rnd.wait_go, k, job.restore_timeout_s)
            if go.error is not None:
                if refused is not None:
                    raise refused  # this rank's own refusal, with its cause
                raise go.error.exception(CorruptVersionError)
        ckpt, _, refused = early or await _load(job, local, reshard, rnd, k, g, into)
        k += 1


Loaded = tuple[Checkpoint | None, str, DestinationMismatchError | None]
"""A rank's load of a candidate: the checkpoint, or None with the reason (and the refusal, if refused)."""


async def _load_early(job: Job, local: AsymStore, reshard: Targets | None, rnd: RestoreRound, k: int, g: Chosen,
                      into: Into | None, refused: DestinationMismatchError | None) -> Loaded | None:
    """Say whether this rank's destinations fit candidate ``k``; without ``into``, load it first and say both.

    Without ``into`` nothing is written into live objects, so a rank need not wait for the coordinator's
    ``go`` to read its shard: it loads, then puts its result and its fit together, and waits for the next
    ``try`` (the coordinator reads the results only after its ``go``; when the ``go`` is an error it also
    puts that error as the next ``try``, which this rank raises, dropping what it loaded). So the ``go``
    costs the agreement no round trip. With ``into`` the rank writes nothing before the ``go``: it puts
    its fit alone (None returned) and loads after the ``go`` (:func:`_load`).
    """
    if into is not None:
        await asyncio.to_thread(rnd.fit, k, job.rank, _fit(refused))
        return None
    loaded = await _try_shard(job, local, reshard, g, into)
    await asyncio.to_thread(_fit_and_result, rnd, k, job.rank, _fit(refused), _result(*loaded))
    return loaded


async def _load(job: Job, local: AsymStore, reshard: Targets | None, rnd: RestoreRound, k: int, g: Chosen,
                into: Into | None) -> Loaded:
    """After the ``go``: load this rank's part of candidate ``k`` and put the result."""
    loaded = await _try_shard(job, local, reshard, g, into)
    await asyncio.to_thread(rnd.result, k, job.rank, _result(*loaded))
    return loaded


def _fit_and_result(rnd: RestoreRound, k: int, rank: int, fit: Fit, result: LoadResult) -> None:
    """The result first: once the coordinator has every fit, it has every result of the ranks that loaded early."""
    rnd.result(k, rank, result)
    rnd.fit(k, rank, fit)


async def _check_fit(job: Job, local: AsymStore, g: Chosen,
                     into: Into | None) -> DestinationMismatchError | None:
    """Whether this rank's destinations fit its shard of ``g`` (checked on the manifest; nothing is read).

    Returns:
        The refusal, or None: they fit, or no manifest of the shard could be read here (the load that
        follows then fails and says why), or nothing is read into destinations (no ``into``; a reshard).
    """
    if into is None or g.resharded or g.shard is None:
        return None
    step = g.shard.step
    versions = local.versions()
    for tier in local.tiers:
        if step not in versions.get(tier.name, []):
            continue
        try:
            await check_destinations(tier, step, into)
        except DestinationMismatchError as exc:
            return exc
        except (AsymstoreError, OSError) as exc:  # this copy's manifest: the next tier's, or the load reports it
            logger.debug("restore: checking destinations on %s: %s", tier.name, describe(exc))
            continue
        return None
    return None


def _fit(refused: DestinationMismatchError | None) -> Fit:
    return Fit(refused is None, describe(refused) if refused is not None else "")


def _result(ckpt: Checkpoint | None, reason: str, refused: DestinationMismatchError | None) -> LoadResult:
    return LoadResult(ckpt is not None, reason, refused is not None)


async def _try_shard(job: Job, local: AsymStore, reshard: Targets | None, g: Chosen, into: Into | None) -> Loaded:
    """Load this rank's part of ``g``: the checkpoint, or None with the reason (and the refusal, if refused)."""
    if g.resharded or g.shard is None:
        if reshard is None:  # a version of slices (the other world sizes were not offered): never one slice alone
            return None, (f"global step {g.step} holds slices of a replicated state: restoring it needs "
                          "RankStore.reshard (the Checkpointer sets it)"), None
        if g.manifest is None:  # a node's candidate is never resharded (_heard): the coordinator's word is wrong
            return None, f"global step {g.step}: read through resharding but heard without its manifest", None
        try:
            return await restore_resharded(job, local.tiers, g.manifest, reshard), "", None
        except (AsymstoreError, OSError) as exc:
            return None, describe(exc), None
    shard = g.shard
    try:
        ckpt = await local.restore(step=shard.step, into=into)
    except DestinationMismatchError as exc:
        return None, describe(exc), exc
    except (AsymstoreError, OSError) as exc:
        return None, describe(exc), None
    digest = shard_digest(ckpt.manifest)
    if digest != shard.digest:
        return None, f"shard {shard.step} digest {digest} != {shard.digest} in the global manifest", None
    return ckpt, "", None


def _resharded(job: Job, g: GlobalManifest) -> bool:
    """Whether ``g`` is read through the resharding path.

    So it is for another world size, a single-process version, or shards holding slices of a replicated
    state (each rank reads every slice it needs where it lives).
    """
    return g.world_size != job.world_size or rootlayout.is_single_root(g) or is_sliced([s.summary for s in g.shards])
