"""Frozen parameters known unchanged without reading them: copied to host once, then handed over as they are.

A LoRA run's base model is most of its state and never changes, yet every version would copy it
from the device and hash it again. A parameter is *known unchanged* since the version that last
copied it when, at the moment a version opens (the step returned):

- it does not require grad and is in no optimizer param group (nothing the step does writes it);
- it is the same parameter object, over the same memory (data address), with the same version
  counter (``Tensor._version``: every in-place write through the parameter, ``torch.no_grad()``
  included, moves it), dtype and shape as when it was copied;
- and, checked before the version is committed, the edit detector's byte sample of it
  (:mod:`asymcheck.snapshot.version`, about 16 bytes spread over the tensor, gathered right after
  the step) equals the same sample of the copy. ``p.data`` edits do not move the counter; a
  whole-tensor one changes the sample. A sample that differs drops the version (never committed
  with the old bytes) and forgets the copy.

Such a parameter is not copied from the device: the version takes the private host copy made
when it was last copied (one host-to-host copy and one hash, once) with its chunk checksums, and
the store stages it without hashing (:class:`asymstore.protocols.KnownBytesStore`); each
referencing tier references the chunks it holds, every other tier writes these bytes. Anything
that may have changed it forgets the copy, so the next version copies it again: a (re)start (the
cache lives in memory), ``resume()``, a block under ``ckpt.editing()``, ``requires_grad`` turned
on, ``add_param_group``, ``load_state_dict`` or any in-place write (the counter), ``p.data = ...``
(the address).

What this cannot see: a ``p.data`` edit of bytes the sample does not cover, outside
``ckpt.editing()``. The guide (docs/guides/checkpointer.md) says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from asymcheck.snapshot.version import Snapshot, gather_samples, sample_view
from asymcheck.state.capture import Capture
from asymcheck.state.dtensors import address_of
from asymstore.format.tensors import chunk_checksums
from asymstore.values import KnownChunks

logger = logging.getLogger(__name__)

MIN_BYTES = (64 << 10) + 1
"""Smaller parameters are copied every version: a store packs tensors of up to 64 KiB (and always writes
packs), and they cost next to nothing."""


@dataclass
class _Entry:
    """The private host copy of one frozen parameter, and what it was copied from."""

    owner: torch.Tensor
    ptr: int
    version: int
    dtype: torch.dtype
    shape: torch.Size
    host: torch.Tensor  # contiguous CPU, never written
    sample: torch.Tensor  # sample_view of host's bytes
    known: KnownChunks | None  # with the store's chunk checksums (None: the store hashes it)


@dataclass
class _Learn:
    """A frozen parameter copied by this version, to be kept once the version proves clean."""

    name: str
    owner: torch.Tensor
    ptr: int
    version: int


@dataclass
class FrozenUse:
    """What one version takes from the cache, and what it copies for it.

    Attributes:
        entries: name -> the host copy the version takes instead of reading the parameter.
        learn: parameters this version copies that the cache keeps if the version is clean.
        samples: per device, the names sampled at open and their samples (host).
        event: a CUDA event after the samples' copy to the host, or None.
    """

    entries: dict[str, _Entry] = field(default_factory=dict)
    learn: list[_Learn] = field(default_factory=list)
    samples: list[tuple[list[str], torch.Tensor]] = field(default_factory=list)
    event: Any = None
    epoch: int = 0

    @property
    def nbytes(self) -> int:
        """Raw bytes taken from the cache (not copied from the device)."""
        return sum(e.host.numel() * e.host.element_size() for e in self.entries.values())


def _eligible(src: torch.Tensor, owner: torch.Tensor | None, counter: torch.Tensor, in_groups: set[int],
              min_bytes: int) -> bool:
    return (owner is not None and counter is owner and type(src) is torch.Tensor and not owner.requires_grad
            and id(owner) not in in_groups and src.device.type in ("cpu", "cuda") and src.is_contiguous()
            and src.numel() == owner.numel() and src.data_ptr() == address_of(owner)
            and src.numel() * src.element_size() >= min_bytes)


class FrozenTensors:
    """The host copies of frozen parameters, kept across versions (see the module docstring).

    Args:
        chunk_bytes: the store's chunk size, to precompute the checksums it would take (None: the
            store is no :class:`~asymstore.protocols.KnownBytesStore` and hashes them itself).
        min_bytes: smaller parameters are always copied.
    """

    def __init__(self, chunk_bytes: int | None, min_bytes: int = MIN_BYTES) -> None:
        """Nothing known yet: the first version copies every parameter."""
        self.chunk_bytes = chunk_bytes
        self.min_bytes = min_bytes
        self._entries: dict[str, _Entry] = {}
        self._epoch = 0  # moves at every forget(): a version opened before one teaches the cache nothing
        self.taken_bytes = 0
        """Raw bytes versions took from the cache instead of copying them (all versions together)."""

    def forget(self, reason: str) -> None:
        """Forget every copy: the next version copies every parameter again."""
        if self._entries:
            logger.debug("frozen parameters forgotten (%s): %d", reason, len(self._entries))
        self._entries.clear()
        self._epoch += 1

    def select(self, cap: Capture, optimizer: torch.optim.Optimizer) -> FrozenUse:
        """Take the parameters known unchanged out of ``cap``'s sources (when its version opens).

        Returns:
            What the version takes from the cache, what it copies that the cache may keep, and
            the samples its seal compares.
        """
        use = FrozenUse(epoch=self._epoch)
        in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
        keep: list[int] = []
        for i, (name, src, owner, counter) in enumerate(zip(cap.names, cap.sources, cap.owners, cap.versioned,
                                                            strict=True)):
            entry = self._entries.pop(name, None)
            if (owner is None or name in cap.layouts  # a piece of a global tensor (DTensor, replica slice)
                    or not _eligible(src, owner, counter, in_groups, self.min_bytes)):
                keep.append(i)
                continue
            if (entry is not None and entry.owner is owner and entry.version == owner._version
                    and entry.ptr == src.data_ptr() and entry.dtype == src.dtype and entry.shape == src.shape):
                use.entries[name] = self._entries[name] = entry
            else:
                use.learn.append(_Learn(name, owner, src.data_ptr(), owner._version))
                keep.append(i)
        self._entries = {n: e for n, e in self._entries.items() if n in use.entries}  # the others are gone
        if not use.entries:
            return use
        by_name = dict(zip(cap.names, cap.sources, strict=True))
        for device in dict.fromkeys(by_name[n].device for n in use.entries):
            names = [n for n in use.entries if by_name[n].device == device]
            sample = gather_samples([by_name[n] for n in names], list(range(len(names))))
            if sample is not None:
                use.samples.append((names, sample))
                if device.type == "cuda":
                    use.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    use.event.record()
        cap.known = list(use.entries)
        cap.names = [cap.names[i] for i in keep]
        cap.sources = [cap.sources[i] for i in keep]
        cap.owners = [cap.owners[i] for i in keep]
        cap.counters = [cap.versioned[i] for i in keep]
        self.taken_bytes += use.nbytes
        return use

    def check(self, use: FrozenUse) -> list[str]:
        """Before the version is committed: the names whose bytes at the step differ from their copy.

        A parameter whose counter or address moved since the version opened keeps its value of the
        step in the version (its copy is that value), but is copied again by the next one.
        """
        if use.event is not None:
            use.event.synchronize()
        dirty: list[str] = []
        for names, sample in use.samples:
            at = 0
            for name in names:
                entry = use.entries[name]
                n = entry.sample.numel()
                if not torch.equal(sample[at:at + n], entry.sample):
                    dirty.append(name)
                at += n
        for name, entry in use.entries.items():
            if name in dirty or entry.owner._version != entry.version or address_of(entry.owner) != entry.ptr:
                self._entries.pop(name, None)
        if dirty:
            logger.warning("%d frozen parameter(s) changed without moving their version counter (a p.data edit "
                           "outside ckpt.editing()?): %s", len(dirty), ", ".join(dirty[:4]))
        return dirty

    def learn(self, snap: Snapshot, use: FrozenUse) -> None:
        """After a clean version: keep host copies of the frozen parameters it copied (one host copy each, once)."""
        if not use.learn or snap.slot is None or use.epoch != self._epoch:
            return  # forgotten since the version opened (editing(), resume): its copies may be stale already
        index = {name: i for i, name in enumerate(snap.capture.names)}
        for item in use.learn:
            i = index.get(item.name)
            if i is None or item.owner._version != item.version or address_of(item.owner) != item.ptr:
                continue  # changed since the version opened: the next version copies it
            src = snap.capture.sources[i]
            host = snap.slot.view(i, src).clone()
            flat = host.reshape(-1).view(torch.uint8)
            known = (KnownChunks(host, self.chunk_bytes, chunk_checksums(host, self.chunk_bytes))
                     if self.chunk_bytes is not None else None)
            self._entries[item.name] = _Entry(item.owner, item.ptr, item.version, src.dtype, src.shape, host,
                                              sample_view(flat).clone(), known)

    def tensors(self, use: FrozenUse) -> tuple[dict[str, torch.Tensor], dict[str, KnownChunks]]:
        """The version's host copies: those without checksums (the store hashes them), those with."""
        plain = {n: e.host for n, e in use.entries.items() if e.known is None}
        known = {n: e.known for n, e in use.entries.items() if e.known is not None}
        return plain, known
