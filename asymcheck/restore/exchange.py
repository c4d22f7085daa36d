"""Resuming slices of a replicated state kept on tiers only their own ranks read: the ranks exchange them.

Under DDP each rank writes only its slice of the replicated state (``CommitOptions(dedup="replicas")``).
With each rank's tiers its own (node-local disks, shared memory, a peer tier), a restore of such a
version gives each rank only its own shard (from its own tiers, or after a node loss from the peer
replica of it), verified against the global manifest (:func:`asymstore.multirank.reshard.restore_own_slices`).
:func:`restore_exchanged` then exchanges the slices over the training process group, on the thread
that calls ``resume()`` (the main thread, before training): ``torch.distributed`` collectives, on a
gloo group (the default group when it is gloo, else a gloo group made for the exchange and destroyed after):

1. every rank's shard manifest goes to every rank (``all_gather``); each is checked against the
   digest the global manifest records for its rank;
2. each rank's slices go to every rank (one ``broadcast`` per rank, of the size its checked
   manifest says); every chunk is verified against its checksum in the sender's manifest before it lands;
3. the ranks agree on the outcome (``all_gather`` of a flag): a peer's bytes that do not verify
   refuse the version on every rank (:class:`~asymstore.errors.SliceExchangeError`), and every rank
   restores the published version before it; none left: the error.

What travels and how it is checked: :mod:`asymstore.multirank.sliceexchange`.
Guide: docs/guides/multirank.md (Replicated state written once per job).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from asymcheck.restore.resume import restore_live
from asymcheck.state.trainstate import TrainingState
from asymstore.errors import CorruptVersionError, SliceExchangeError
from asymstore.format.globalmanifest import GlobalManifest
from asymstore.format.manifest import MAX_MANIFEST_BYTES, Manifest
from asymstore.multirank import sliceexchange
from asymstore.protocols import CheckpointStore, CollectiveStore
from asymstore.values import Checkpoint

logger = logging.getLogger(__name__)

BROADCAST_BYTES = 256 << 20
"""The largest message of the exchange: a rank's slices go in broadcasts of at most this many bytes."""


def restore_exchanged(run: Callable[[Coroutine[Any, Any, Any]], Any], store: CheckpointStore,
                      state: TrainingState) -> tuple[Checkpoint, bool]:
    """Restore as :func:`~asymcheck.restore.resume.restore_live`, then exchange slices where the version needs it.

    Call on the training thread of every rank (collective when it exchanges); ``run`` runs a
    coroutine on the store's loop and returns its result (``StoreLoop.run``).

    Returns:
        The checkpoint (whole tensors) and whether the live tensors may hold bytes of a version.

    Raises:
        SliceExchangeError: no published version, from the one restored down to the oldest kept, restored
            and exchanged on every rank (each one's reason in the message).
        Everything :func:`~asymcheck.restore.resume.restore_live` raises.
    """
    ckpt, in_place = run(restore_live(store, state))
    if not isinstance(store, CollectiveStore) or not sliceexchange.needs_exchange(ckpt):
        return ckpt, in_place
    notes: list[str] = []
    g = store.restored_global
    if g is None:  # never here: a collective restore sets it
        raise SliceExchangeError("the store restored slices but names no global version")
    try:
        done = exchange(store.rank, store.world_size, g, ckpt)
        return done, in_place
    except SliceExchangeError as exc:
        notes.append(f"global step {g.step}: {exc}")
        logger.warning("rank %d: the slices of global step %d did not verify (%s); restoring the version before",
                       store.rank, g.step, exc)
    for step in sorted((s for s in store.global_steps() if s < g.step), reverse=True):
        try:  # collective: every rank heard the same refusal, and hears the same outcome here
            ckpt = run(store.restore(step=step))
        except CorruptVersionError as exc:
            notes.append(f"global step {step}: {exc}")
            continue
        older = store.restored_global
        if not sliceexchange.needs_exchange(ckpt) or older is None:
            ckpt.fallbacks[:0] = notes
            return ckpt, False
        try:
            done = exchange(store.rank, store.world_size, older, ckpt)
        except SliceExchangeError as exc:
            notes.append(f"global step {older.step}: {exc}")
            continue
        done.fallbacks[:0] = notes
        return done, False
    raise SliceExchangeError("no published version's slices verified on every rank: " + "; ".join(notes))


def exchange(rank: int, world: int, g: GlobalManifest, own: Checkpoint) -> Checkpoint:
    """Exchange this rank's slices of ``g`` (``own``: its verified shard) with every rank (see the module docstring).

    Raises:
        SliceExchangeError: a rank's manifest or chunk did not verify (on every rank alike), or the
            training process group is not there or is not this job's.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise SliceExchangeError(f"global step {g.step} holds slices on tiers only their own ranks read: resuming it "
                                 "exchanges them over torch.distributed's process group, which is not initialized")
    if dist.get_rank() != rank or dist.get_world_size() != world or g.world_size != world:
        raise SliceExchangeError(f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}) is not the "
                                 f"store's (rank {rank} of {world}; global step {g.step} of {g.world_size} ranks)")
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        manifests = _manifests(rank, world, g, own, group)
        assembler = sliceexchange.Assembler(g, own, rank)
        mine = sliceexchange.payload(own)
        problem: SliceExchangeError | None = None
        for src in range(world):
            size = sliceexchange.payload_bytes(manifests[src])  # the same on every rank: the manifests are
            if not size:
                continue
            if src == rank:
                if len(mine) != size:  # never here: both come from this rank's manifest
                    raise SliceExchangeError(f"rank {rank}'s slices are {len(mine)} bytes, its manifest says {size}")
                buf = torch.frombuffer(mine, dtype=torch.uint8)
            else:
                buf = torch.empty(size, dtype=torch.uint8)
            for at in range(0, size, BROADCAST_BYTES):  # bounded messages, whatever the slices' size
                dist.broadcast(buf[at:at + BROADCAST_BYTES], src, group=group)
            if src != rank and problem is None:
                try:
                    assembler.take(src, manifests[src], memoryview(buf.numpy()).cast("B"))  # type: ignore[arg-type]
                except SliceExchangeError as exc:
                    problem = exc
        done: Checkpoint | None = None
        if problem is None:
            try:
                done = assembler.result(f"{own.tier}, {sliceexchange.EXCHANGED} with {world} rank(s)")
            except SliceExchangeError as exc:
                problem = exc
        _agree(problem, world, g, group)
        assert done is not None
        logger.info("rank %d: global step %d: slices exchanged with %d rank(s), %d tensor(s) assembled",
                    rank, g.step, world, len(assembler.names))
        return done
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def _manifests(rank: int, world: int, g: GlobalManifest, own: Checkpoint, group: Any) -> dict[int, Manifest]:
    """Every rank's shard manifest, each checked against ``g`` (every rank raises alike)."""
    import torch.distributed as dist

    data = own.manifest.to_json()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    lengths = [int(s.item()) for s in sizes]
    if max(lengths) > MAX_MANIFEST_BYTES or min(lengths) <= 0:
        raise SliceExchangeError(f"global step {g.step}: a rank's shard manifest is {max(lengths)} bytes "
                                 f"(at most {MAX_MANIFEST_BYTES})")
    longest = max(lengths)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, buf, group=group)
    out: dict[int, Manifest] = {rank: own.manifest}
    problem: SliceExchangeError | None = None
    for r in range(world):
        if r == rank:
            continue
        try:
            out[r] = sliceexchange.check_manifest(g, r, gathered[r][:lengths[r]].numpy().tobytes())
        except SliceExchangeError as exc:
            problem = problem or exc
    _agree(problem, world, g, group)
    return out


def _agree(problem: SliceExchangeError | None, world: int, g: GlobalManifest, group: Any) -> None:
    """Every rank says whether it refused what it received; any refusal is raised on every rank."""
    import torch.distributed as dist

    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([int(problem is not None)], dtype=torch.int64), group=group)
    refused = [r for r, f in enumerate(flags) if int(f.item())]
    if problem is not None:
        raise problem
    if refused:
        raise SliceExchangeError(f"rank(s) {refused} refused what a peer sent of global step {g.step}")
