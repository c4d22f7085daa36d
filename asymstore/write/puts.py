"""Staging a step's tensors in an :class:`~asymstore.AsymStore`: the copying ``put`` and the adopting ``adopt``.

``put`` / ``put_many`` take a private copy: the caller may change its tensor as soon as the call
returns. ``adopt`` / ``adopt_many`` take the caller's memory itself (a contiguous CPU tensor) and
copy nothing; the caller must neither write nor free it until its ``release`` callback runs,
exactly once, on the store's event loop. Small tensors of a large batch (at least
:data:`~asymstore.write.staging.PACK_MIN_TENSORS`, each at most
:data:`~asymstore.write.staging.PACK_TENSOR_BYTES`) are copied into packs either way.

When ``release`` runs and who owns the memory until then: docs/concepts/data-path.md; packs:
docs/concepts/format.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from asymstore.errors import DuplicateNameError, InvalidStepError
from asymstore.values import KnownChunks
from asymstore.write.staging import (
    PACK_BYTES,
    PACK_MIN_TENSORS,
    PACK_TENSOR_BYTES,
    PackArena,
    PendingStep,
    StagedTensor,
    adopt_known,
    arena_bytes,
    check_adoptable,
    stages_inline,
)

logger = logging.getLogger(__name__)

Release = Callable[[], None]


def check_step(step: object) -> int:
    """Return ``step`` if it is a non-negative int.

    Raises:
        InvalidStepError: anything else.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InvalidStepError(f"step must be a non-negative int, got {step!r}")
    return step


class Stager:
    """The steps being staged in one :class:`~asymstore.AsymStore` (it owns one; see the module docstring).

    Args:
        chunk_bytes: largest chunk of one tensor.
        admit: called with a step before anything is staged for it; raises
            when the store cannot take it (closed, read-only, already
            committed, older than the newest committed step).
        run: runs a large tensor's copy and checksums in a thread (the
            store's pipeline pool); None: ``asyncio.to_thread``.
    """

    def __init__(self, chunk_bytes: int, admit: Callable[[int], None],
                 run: Callable[[Callable[[], StagedTensor]], Awaitable[StagedTensor]] | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.admit = admit
        self.run = run  # where large tensors are copied and hashed (None: asyncio.to_thread)
        self.pending: dict[int, PendingStep] = {}
        """What is staged per uncommitted step (the store's commit takes it from here)."""

    def _pending_for(self, step: int) -> PendingStep:
        self.admit(step)
        pending = self.pending.get(step)
        if pending is None:
            pending = self.pending[step] = PendingStep(step, self.chunk_bytes, run=self.run)
        return pending

    async def put(self, step: int, name: str, tensor: object) -> None:
        """Stage a private copy of ``tensor`` under ``name`` for ``step``.

        Safe to call concurrently, in any order of names. The tensor may be
        changed by the caller as soon as this returns.

        Raises:
            AsymstoreError: see :meth:`asymstore.AsymStore.put`.
        """
        await self._stage(step, name, tensor, adopted=False)

    async def _stage(self, step: int, name: str, tensor: object,
                     *, adopted: bool) -> None:
        pending = self._pending_for(step)
        task = asyncio.ensure_future(pending.put(name, tensor, adopted=adopted))
        pending.inflight.add(task)
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                pending.inflight.discard(task)

    async def put_many(self, step: int, tensors: Mapping[str, object]) -> None:
        """Stage every ``name -> tensor`` of ``tensors`` for ``step``.

        Small tensors are staged one after another on the event loop (no task
        each: 10,000 of them cost no more scheduling than a few), yielding
        every 1024 (4096 when packing); large ones concurrently in threads. A
        call of at least :data:`~asymstore.write.staging.PACK_MIN_TENSORS`
        tensors copies its small ones into packs (one buffer and one checksum
        per pack; see :mod:`asymstore.write.staging`). On an error the rest of
        the small ones are not staged.
        """
        await self._stage_many(step, tensors, adopted=False)

    async def _stage_many(self, step: int, tensors: Mapping[str, object],
                          *, adopted: bool) -> None:
        pending = self._pending_for(step)
        for name in tensors:  # check the whole batch before staging any of it
            if name in pending.tensors:
                await pending.put(name, tensors[name])  # raises DuplicateNameError
        items = list(tensors.items())
        packing = len(items) >= PACK_MIN_TENSORS
        limit = min(PACK_TENSOR_BYTES, PACK_BYTES, self.chunk_bytes)
        every = 4096 if packing else 1024  # tensors staged between two yields to the event loop
        # the packs of every run of small tensors carved from one allocation (not a mapping per run)
        arena = PackArena(arena_bytes([v for _, v in items], limit)) if packing else None
        large = []
        i, pause = 0, every
        while i < len(items):
            if packing:  # a run of small tensors, copied into packs
                i += pending.put_packed(items[i:pause], limit, adopted=adopted, arena=arena)
            if i < pause and i < len(items):  # one that is not packed
                name, value = items[i]
                i += 1
                if stages_inline(value):
                    await pending.put(name, value, adopted=adopted)  # never suspends for an inline value
                else:
                    large.append((name, value))
            if i >= pause:
                pause += every
                await asyncio.sleep(0)
                pending = self._pending_for(step)  # the step may have been committed meanwhile
        results = await asyncio.gather(*(self._stage(step, name, value, adopted=adopted) for name, value in large),
                                       return_exceptions=True)  # none still running when this returns or raises
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def adopt(self, step: int, name: str, tensor: object, *,
                    release: Release | None = None) -> None:
        """Stage ``tensor`` itself (no copy) under ``name`` for ``step``; ``release`` hands it back.

        See the ownership rules in :mod:`asymstore.write.puts`: the caller must not
        write or free the tensor until ``release`` has run.

        Raises:
            InvalidValueError: not a contiguous CPU tensor of a storable dtype.
            Everything :meth:`put` raises. ``release`` has run when this raises.
        """
        await self.adopt_many(step, {name: tensor}, release=release)

    async def adopt_many(self, step: int, tensors: Mapping[str, object], *,
                         release: Release | None = None) -> None:
        """Stage every tensor of ``tensors`` without copying; ``release`` runs once when the store is done with all.

        Every tensor is checked before any is staged; their checksums are
        computed in place (large ones in threads). In a call of at least
        :data:`~asymstore.write.staging.PACK_MIN_TENSORS` tensors the small ones
        are copied into packs all the same (see the module docstring).

        Raises:
            InvalidValueError: a tensor is not a contiguous CPU tensor of a storable dtype.
            Everything :meth:`put_many` raises. ``release`` has run when this raises.
        """
        earlier = self.pending.get(step)
        staged_before = set(earlier.tensors) if earlier is not None else set()
        try:
            for value in tensors.values():
                check_adoptable(value)
            await self._stage_many(step, tensors, adopted=True)
        except BaseException:
            pending = self.pending.get(step)
            if pending is not None:  # what this call staged must not outlive the caller's memory
                for name in tensors:
                    st = pending.tensors.get(name)
                    if name not in staged_before and st is not None and st.adopted:
                        del pending.tensors[name]
            if release is not None:
                _call(release, step)
            raise
        if release is None:
            return
        pending = self.pending.get(step)
        if pending is None or not any(pending.tensors.get(n) is not None for n in tensors):
            _call(release, step)  # abandoned or committed while the checksums ran: nothing reads it now
        else:
            pending.releases.append(release)

    async def adopt_known(self, step: int, tensors: Mapping[str, KnownChunks]) -> None:
        """Stage every ``name -> KnownChunks`` for ``step`` as it is: no copy, no checksum (all checked first).

        Raises:
            InvalidValueError: see :func:`~asymstore.write.staging.adopt_known`.
            Everything :meth:`put` raises.
        """
        pending = self._pending_for(step)
        staged = {name: adopt_known(value, self.chunk_bytes) for name, value in tensors.items()}
        for name in staged:
            if name in pending.tensors:
                raise DuplicateNameError(f"{name!r} was already put for step {step}")
        for name, value in tensors.items():
            pending.put_known(name, value)

    def abandon(self, step: int) -> None:
        """Drop everything put for an uncommitted ``step`` (adopted tensors are released)."""
        pending = self.pending.pop(step, None)
        if pending is not None:
            pending.release_all()


def _call(release: Release, step: int) -> None:
    try:
        release()
    except Exception:
        logger.exception("a release callback of step %d failed", step)
