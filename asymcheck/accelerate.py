"""asymcheck for Hugging Face Accelerate: a version every optimizer step of what ``accelerator.prepare`` returned.

Two lines after ``accelerator.prepare(...)``, on every process::

    ckpt = asymcheck.accelerate.attach(accelerator, model, optimizer, "ckpt", scheduler=lr_scheduler,
                                       data=train_dataloader)
    completed_steps = ckpt.resume() or 0    # optimizer steps already done; None on a fresh start

and the loop iterates ``ckpt.loader`` where it iterated ``train_dataloader``. One process and DDP
get an :class:`asymcheck.Checkpointer`, the DeepSpeed plugin :func:`asymcheck.deepspeed.attach`
(the FSDP plugin is refused: FSDP1 always, FSDP2 until its GPU-only route is tested). What a
version holds, the data position, what is refused (a table of
:data:`asymcheck.integrations.settings.ACCELERATE`) and the Accelerate names relied on:
docs/guides/accelerate.md. Importing this module imports Accelerate (the ``accelerate`` extra).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import warnings
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Unpack

import accelerate
import torch
from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from asymcheck.checkpointer import Checkpointer, RestoreInfo
from asymcheck.errors import (
    AsymcheckError,
    DataPositionError,
    InexactResumeWarning,
    InvalidOptionError,
    StateMismatchError,
    UnresumableDataError,
    UnsupportedAccelerateConfigError,
)
from asymcheck.integrations import names, position, settings, support
from asymcheck.integrations.forward import forwarded_options
from asymcheck.integrations.rng import set_pass_states
from asymcheck.integrations.settings import ACCELERATE, refusal
from asymcheck.options import CheckpointerOptions, PartitionOptions, renamed_location
from asymcheck.policy.preempt import PreemptionRecord
from asymcheck.snapshot.hooks import HooksFactory, StepHooks
from asymcheck.state.replicas import Replication
from asymcheck.state.trainstate import Stateful
from asymcheck.stats import CheckpointStats, StepRecord
from asymcheck.versions.storespec import StoreSpec
from asymstore.protocols import CheckpointStore

logger = logging.getLogger(__name__)

__all__ = ["AccelerateCheckpointer", "DataPositionError", "MissingLocationError", "ResumableLoader",
           "UnsupportedAccelerateConfigError", "attach", "unsupported_settings"]

STEP_NAME = names.ACCELERATE_STEP  # the data object holding ``accelerator.step``
SCHEDULER_NAME = names.ACCELERATE_SCHEDULER
SCALER_NAME = names.ACCELERATE_SCALER
LOADER_NAME = "loader"  # the name of a single loader passed as ``data=``
GENERATORS = "generators"  # a loader position's live generator states (when the version was taken), by role

_DDP = {DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
_SUPPORTED = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.DEEPSPEED,
              DistributedType.FSDP}


# -- what is refused -----------------------------------------------------------


class MissingLocationError(AsymcheckError, TypeError):
    """:func:`attach` was given no location (None): the message names the line that gives it one.

    A ``TypeError`` as Python's own for a missing argument; ``run_clm_no_trainer.py``'s ``--output_dir``
    is None unless given, so ``attach(..., args.output_dir, ...)`` lands here.
    """


def unsupported_settings(accelerator: Any) -> list[str]:
    """The settings of ``accelerator`` whose state :func:`attach` would not capture correctly, or untested.

    Args:
        accelerator: an ``accelerate.Accelerator``.

    Returns:
        One line per refused setting (empty: supported).
    """
    out = support.version_problems("accelerate", accelerate.__version__)
    kind = accelerator.distributed_type
    if kind not in _SUPPORTED:
        out.append(refusal(ACCELERATE, "distributed_type").line(f"distributed_type={kind}"))
    state = accelerator.state
    if kind == DistributedType.FSDP:
        version = getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None)
        if version != 2:
            out.append(refusal(ACCELERATE, "fsdp_version").line(f"fsdp_version={version}"))
        else:  # GPU-only in Accelerate 1.15, not yet run through attach() on a GPU
            out.append(refusal(ACCELERATE, "fsdp_version=2").line())
    if _compiled(accelerator):
        plugin = state.dynamo_plugin
        if kind == DistributedType.DEEPSPEED:
            out.append(refusal(ACCELERATE, "dynamo_backend under DeepSpeed").line())
        if getattr(plugin, "use_regional_compilation", None):
            out.append(refusal(ACCELERATE, "TorchDynamoPlugin(use_regional_compilation=True)").line())
    if str(accelerator.mixed_precision) == "fp8":
        out.append(refusal(ACCELERATE, "mixed_precision=fp8").line())
    config = accelerator.parallelism_config
    if config is not None:
        for axis in ("tp", "cp", "sp"):
            size = getattr(config, f"{axis}_size", None) or 1
            if int(size) > 1:
                out.append(refusal(ACCELERATE, "parallelism_config").line(f"parallelism_config.{axis}_size={size}"))
    return out


def _compiled(accelerator: Any) -> bool:
    """``prepare`` compiles the model (``Accelerator(dynamo_backend=...)`` or a ``TorchDynamoPlugin``)."""
    dynamo = getattr(getattr(getattr(accelerator, "state", None), "dynamo_plugin", None), "backend", None)
    return dynamo is not None and str(getattr(dynamo, "value", dynamo)).upper() != "NO"


def _check(accelerator: Any) -> None:
    support.require_supported(unsupported_settings(accelerator), UnsupportedAccelerateConfigError,
                              "asymcheck.accelerate.attach() does not capture this accelerator correctly")


# -- small stateful objects ----------------------------------------------------


class _AcceleratorStep:
    """``accelerator.step``: micro-steps since the last synchronising one (decides the next sync)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


# -- data position -------------------------------------------------------------


class ResumableLoader(position.ResumableLoader):
    """A data loader prepared by Accelerate whose position goes into every version, and comes back without re-reading.

    Made by :func:`attach` for each prepared loader given as ``data=``; iterate it where the loop
    iterated the loader (``for batch in ckpt.loader``). Each pass yields the loader's batches and
    counts them; a version holds the epoch (the loader's ``iteration``), the batches of the pass
    yielded so far, and the RNG states the pass began with (the global torch CPU generator and the
    sampler's and loader's generators: they decide the pass's order). After ``resume()`` the next
    pass continues the interrupted one: the RNG states are set to those the pass began with while
    the continuation starts, then put back, and it goes on after the batches already trained through
    ``accelerator.skip_first_batches`` (a map-style dataset: the skipped batches' indices are drawn,
    their samples never read; an ``IterableDataset`` is read through them). Passes after that are the
    loader's own. The attributes shared with every framework's loader:
    :class:`asymcheck.integrations.ResumableLoader`.

    Attributes:
        loader: the prepared loader.
        name: its name in the version's ``data``.
        batches: batches yielded by the current (or last) pass.
        position: the pass position (:class:`asymcheck.integrations.LoaderPosition`).
    """

    def __init__(self, accelerator: Any, loader: Any, name: str) -> None:
        """Wrap ``loader`` (a ``DataLoaderShard`` or ``DataLoaderDispatcher``)."""
        super().__init__(loader, name)
        self._accelerator = accelerator
        self._active = False
        self._resume_epoch = 0
        self._stateful = bool(getattr(loader, "use_stateful_dataloader", False))  # torchdata's StatefulDataLoader
        self._fresh = True  # no pass of this loader yet in this process (a StatefulDataLoader's is special)
        self._first = False  # the current pass is (the continuation of) the loader's first after prepare
        self._loader_state: dict[str, Any] | None = None  # a StatefulDataLoader's, for the pass to continue

    @property
    def epoch(self) -> int:
        """The loader's epoch: the current pass's while one runs, else the next one's (its ``iteration``)."""
        return int(getattr(self.loader, "iteration", 0))

    @property
    def active(self) -> bool:
        """A pass is in progress."""
        return self._active

    def __iter__(self) -> Iterator[Any]:
        """One pass: the loader's own, or the continuation of the pass a version was taken in."""
        pending = self.position.pending
        if pending is not None:
            self.position.resumed()  # the pass after this one is the loader's own
            return self._continue_stateful(*pending) if self._stateful else self._continue(*pending)
        return self._pass()

    def _continue_stateful(self, trained: int, start: dict[str, torch.Tensor]) -> Iterator[Any]:
        """The interrupted pass of a StatefulDataLoader: its iterator rebuilt from the version's loader state.

        torchdata draws a seed from the global torch generator (or the loader's) each time it builds an
        iterator: when a pass starts, or when the loader's state is read with no iterator (Accelerate
        reads it in ``prepare``, and the first pass after that reuses the iterator so built). Accelerate's
        sampler keeps no state, so torchdata's fast-forward over the trained batches draws the pass's
        order again. Both happen here under the RNG states the pass began with: the build's draw where the
        uninterrupted pass made it (at its start; before it, undone, for the first pass after prepare),
        then the order, then the fast-forward; after the first batch the version's RNG states are back.
        """
        self._fresh = False
        loader_state = self._loader_state or {}
        self._loader_state = None
        if loader_state.get("_iterator_finished"):  # the version came after the pass's last batch: nothing left
            # (load_state_dict set the generators where the finished pass left them: the next pass's order)
            self.loader.load_state_dict({})  # the next pass builds its iterator, as the uninterrupted run's did
            self.loader.set_epoch(self._resume_epoch + 1)
            return

        def rest() -> Iterator[Any]:
            self.loader.load_state_dict(loader_state)  # the next iterator fast-forwards the trained batches
            if self._first:  # its build drew before the pass began: build it now, the draw undone
                own = self.generators().get("loader")
                generators = [torch.default_generator, *([own] if own is not None else [])]
                saved = [g.get_state() for g in generators]
                self.loader.base_dataloader.state_dict()
                for g, st in zip(generators, saved, strict=True):
                    g.set_state(st)
            return iter(self.loader)

        self._active = True
        try:
            for batch in self.position.continued(self.generators(), rest, (trained, start)):
                self.position.batches += 1
                yield batch
        finally:
            self._active = False

    def _pass(self) -> Iterator[Any]:
        self._first, self._fresh = self._fresh, False
        self.position.begin(self.generators())
        self._active = True
        try:
            for batch in self.loader:
                self.position.batches += 1
                yield batch
        finally:
            self._active = False

    def _continue(self, skip: int, start: dict[str, torch.Tensor]) -> Iterator[Any]:
        epoch = self._resume_epoch
        self._active = True
        try:
            source = self._accelerator.skip_first_batches(self.loader, skip) if skip > 0 else self.loader
            for batch in self.position.continued(self.generators(), lambda: iter(source), (skip, start)):
                self.position.batches += 1
                yield batch
            if skip > 0:  # a pass of the skipping loader counted its own epoch, not the loader's
                self.loader.set_epoch(epoch + 1)
        finally:
            self._active = False

    def generators(self) -> dict[str, torch.Generator]:
        """The generators that decide a pass's order, by role (each object once)."""
        found: dict[str, torch.Generator] = {}
        sampler = getattr(self.loader, "sampler", None)
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        for _ in range(4):  # SkipBatchSampler / BatchSamplerShard wrap the BatchSampler that holds the sampler
            inner = getattr(batch_sampler, "batch_sampler", None)
            if inner is None:
                break
            batch_sampler = inner
        candidates = [("sampler", getattr(getattr(batch_sampler, "sampler", None), "generator", None)),
                      ("sampler", getattr(getattr(sampler, "sampler", None), "generator", None)),
                      ("sampler", getattr(sampler, "generator", None)),
                      ("synchronized", getattr(self.loader, "synchronized_generator", None)),
                      ("loader", getattr(self.loader, "generator", None))]
        seen: set[int] = set()
        for role, g in candidates:
            if isinstance(g, torch.Generator) and id(g) not in seen and role not in found:
                seen.add(id(g))
                found[role] = g
        return found

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch, batches of the pass yielded, whether a pass runs, the RNG states it began with.

        Raises:
            DataPositionError: the loader is being iterated directly, not through this object,
                so the position is unknown.
        """
        active = getattr(getattr(self._accelerator, "gradient_state", None), "active_dataloader", None)
        if active is self.loader and not self._active:
            raise DataPositionError(
                f"data[{self.name!r}] is iterated directly: iterate the ResumableLoader that attach() made "
                f"(ckpt.loader, or ckpt.loaders[{self.name!r}]) so that versions hold its position")
        state: dict[str, Any] = {"epoch": self.epoch, "batches": self.batches, "active": self._active,
                                 "start": dict(self.position.start) if self._active else {},
                                 GENERATORS: {role: g.get_state() for role, g in self.generators().items()}}
        if self._stateful:  # Accelerate's copy of the loader's state after the batches yielded so far
            state["loader"] = copy.deepcopy(self.loader.state_dict())
            state["first"] = self._first
            state["fresh"] = self._fresh
        return state

    def _complete(self, state: Mapping[str, Any]) -> bool:
        """The version's pass had yielded its last batch (or none ran): the next pass is a new one.

        Its order then comes from the loader's generators where the finished pass left them, which no
        redraw of the pass gives back (a StatefulDataLoader's resume skips the finished pass; between
        passes there is no pass to redraw): the version's live generator states are set instead.
        """
        inner = state.get("loader")
        return not bool(state.get("active")) or (
            self._stateful and isinstance(inner, Mapping) and bool(inner.get("_iterator_finished")))

    def _held_generators(self, state: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
        """The live generator states the version holds, checked against this loader's generators (None: none).

        Raises:
            StateMismatchError: the states are malformed or of other generators than this loader's.
        """
        held = state.get(GENERATORS)
        if held is None:
            return None
        if not isinstance(held, Mapping) or not all(isinstance(v, torch.Tensor) for v in held.values()):
            raise StateMismatchError(f"data[{self.name!r}]: not generator states: {type(held).__name__}")
        roles = sorted(self.generators())
        if sorted(str(k) for k in held) != roles:
            raise StateMismatchError(
                f"data[{self.name!r}]: the version holds the states of the generators {sorted(held)}, this loader "
                f"has {roles} (another sampler, or a loader generator given or taken away?)")
        return {str(k): v for k, v in held.items()}

    def check_state_dict(self, state: Any) -> None:
        """Refuse ``state`` before anything is loaded when the resume could not draw the next pass's order exactly.

        A version taken after its pass's last batch (a StatefulDataLoader's) or between passes resumes at a
        new pass, whose order the loader's generators (Accelerate's synchronized sampler generator under
        DDP, a loader's own ``generator``) draw from where the finished pass left them: the version must
        hold those states (versions taken before they were recorded hold none).

        Raises:
            StateMismatchError: such a version holds no (or other) generator states for this loader's generators.
        """
        if not isinstance(state, Mapping):
            raise StateMismatchError(f"data[{self.name!r}]: not a loader position: {type(state).__name__}")
        held = self._held_generators(state)
        if held is None and self._complete(state) and self.generators():
            raise StateMismatchError(
                f"data[{self.name!r}]: the version was taken after its pass's last batch (or between passes) and "
                f"holds no state of the loader's generators {sorted(self.generators())} (an earlier release): the "
                "next pass would be shuffled differently from the uninterrupted run's. Resume from a version "
                "taken inside a pass, or restart the epoch")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the loader's epoch; the next pass continues the one the version was taken in.

        A version taken after its pass's last batch, or between passes, also sets the loader's
        generators to the states they had then (the next pass draws its order from them).

        Raises:
            StateMismatchError: the position does not fit this loader.
        """
        self.check_state_dict(state)
        try:
            epoch, batches, active = int(state["epoch"]), int(state["batches"]), bool(state["active"])
            start = {str(k): v for k, v in state["start"].items() if isinstance(v, torch.Tensor)}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateMismatchError(f"data[{self.name!r}]: not a loader position: {exc!r}") from exc
        if epoch < 0 or batches < 0:
            raise StateMismatchError(f"data[{self.name!r}]: epoch {epoch}, batches {batches}")
        inner = state.get("loader")
        if self._stateful != isinstance(inner, Mapping):
            raise StateMismatchError(
                f"data[{self.name!r}]: the version was taken with use_stateful_dataloader="
                f"{not self._stateful}, this loader has {self._stateful}")
        length = _length(self.loader)
        if active and length is not None and batches > length:
            raise StateMismatchError(f"data[{self.name!r}]: the version had trained {batches} batches of a pass, "
                                     f"this loader has {length} per pass")
        if isinstance(inner, Mapping):
            self._loader_state = dict(inner) if active else None
            self._first = bool(state.get("first", False))
            self._fresh = bool(state.get("fresh", False)) and not active
            if not active and not self._fresh:  # the next pass builds its iterator (and draws), as it did
                self.loader.load_state_dict({})  # uninterrupted (a fresh loader's reuses the one prepare built)
        held = self._held_generators(state)
        if held is not None and self._complete(state):  # where the finished pass left them: the next pass's order
            set_pass_states(held, self.generators())
        self.loader.set_epoch(epoch)
        self.batches = batches if active else 0
        self._active = False
        self._resume_epoch = epoch
        if active:
            self.position.continue_at(batches, start)
        else:
            self.position.resumed()


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _is_prepared_loader(obj: object) -> bool:
    return isinstance(obj, (DataLoaderShard, DataLoaderDispatcher))


# -- the checkpointer ----------------------------------------------------------


class AccelerateCheckpointer:
    """Per-iteration versions of an Accelerate job; made by :func:`attach`.

    Wraps the :class:`asymcheck.Checkpointer` (or :class:`asymcheck.deepspeed.DeepSpeedCheckpointer`)
    that takes them (``checkpointer``) and the :class:`ResumableLoader` of each prepared data loader
    (``loader``, ``loaders``). A context manager: leaving the block closes it.
    """

    def __init__(self, checkpointer: Checkpointer, loaders: Mapping[str, ResumableLoader],
                 engine: Any = None) -> None:
        """Keep the parts (use :func:`attach`)."""
        self.checkpointer = checkpointer
        self.loaders: dict[str, ResumableLoader] = dict(loaders)
        self.engine = engine  # the DeepSpeed engine, under the DeepSpeed plugin

    @property
    def loader(self) -> ResumableLoader:
        """The one data loader given as ``data=`` (see ``loaders`` when there are several)."""
        if len(self.loaders) != 1:
            raise AttributeError(f"attach() was given {len(self.loaders)} prepared data loaders: use "
                                 f"ckpt.loaders[name] ({sorted(self.loaders)})")
        return next(iter(self.loaders.values()))

    def resume(self) -> int | None:
        """Load the newest version that verifies (collective under several processes).

        Returns:
            Optimizer steps completed (the version's step), or None when the store holds no
            version (nothing is changed). The loaders' next pass continues the version's.

        Raises:
            StateMismatchError: the version does not fit the live objects; nothing was loaded.
            CorruptVersionError: no version verifies.
            CheckpointerStateError: training already started, or closed.
        """
        return self.checkpointer.resume()

    def mark(self) -> None:
        """See :meth:`asymcheck.Checkpointer.mark`."""
        self.checkpointer.mark()

    @contextlib.contextmanager
    def editing(self) -> Iterator[None]:
        """See :meth:`asymcheck.Checkpointer.editing`."""
        with self.checkpointer.editing():
            yield

    def flush(self) -> None:
        """Wait until every sealed version is committed (see :meth:`asymcheck.Checkpointer.flush`)."""
        self.checkpointer.flush()

    def preempt(self, deadline_s: float | None = None) -> PreemptionRecord:
        """Commit the newest completed step durably, then close (see :meth:`asymcheck.Checkpointer.preempt`)."""
        return self.checkpointer.preempt(deadline_s)

    def close(self) -> None:
        """Capture the last step if not saved, commit it, wait for every commit, release everything.

        Raises:
            CommitFailedError: the final version was not committed.
        """
        self.checkpointer.close()

    @property
    def step(self) -> int:
        """Optimizer steps completed (including those before a resume); read it from the training loop.

        Under the DeepSpeed plugin ``accelerator.backward`` runs ``engine.step()``, whose completion the
        adapter's hooks deliver only at the next forward: the step is delivered here first
        (:meth:`asymcheck.Checkpointer.settle`), so that it counts right after the optimizer step too.
        """
        self.checkpointer.settle()
        return self.checkpointer.step

    def settle(self) -> None:
        """Deliver a step the DeepSpeed plugin's hooks report late (see :meth:`asymcheck.Checkpointer.settle`)."""
        self.checkpointer.settle()

    @property
    def restored(self) -> RestoreInfo | None:
        """Where ``resume()`` found its version (None before, or on a fresh start)."""
        return self.checkpointer.restored

    @property
    def store(self) -> CheckpointStore:
        """The store (runs on the checkpointer's thread)."""
        return self.checkpointer.store

    @property
    def last_record(self) -> StepRecord | None:
        """The newest step's record."""
        return self.checkpointer.last_record

    @property
    def final_versions(self) -> dict[str, list[int]] | None:
        """``versions()`` when closed."""
        return self.checkpointer.final_versions

    def stats(self) -> CheckpointStats:
        """Stall, copy time and bytes per step, commits, dropped versions, pacing."""
        return self.checkpointer.stats()

    def versions(self) -> dict[str, list[int]]:
        """Committed versions per tier name."""
        return self.checkpointer.versions()

    def __enter__(self) -> AccelerateCheckpointer:
        """Return self."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close (see :meth:`asymcheck.Checkpointer.__exit__`)."""
        self.checkpointer.__exit__(exc_type, exc, tb)


def _named(kind: str, objs: Any, single: str) -> dict[str, Any]:
    if objs is None:
        return {}
    if isinstance(objs, Mapping):
        return dict(objs)
    if kind == "data":
        return {single: objs}
    raise TypeError(f"{kind}= takes a mapping of name -> object with state_dict/load_state_dict")


def _check_data(data: Any, datas: Mapping[str, Any]) -> None:
    """Refuse a loader whose position no version could hold; name what a resume would not continue exactly.

    Raises:
        UnresumableDataError: an entry of ``data`` is a torch ``DataLoader`` that ``accelerator.prepare()``
            did not return (its order and position are the loop's own, out of the versions' reach).
    """
    if data is None:
        warnings.warn(InexactResumeWarning(
            "asymcheck.accelerate.attach() was given no data=: the versions hold no data position, so a "
            "resumed run draws its batches from a new order and the interrupted epoch's rest is not what an "
            "uninterrupted run would train on. Pass the loader accelerator.prepare() returned as data= (and "
            "iterate ckpt.loader), or data={} when the loop draws no batches from a loader."), stacklevel=3)
        return
    for name, obj in datas.items():
        inner = obj.loader if isinstance(obj, ResumableLoader) else obj
        if isinstance(inner, torch.utils.data.DataLoader) and not _is_prepared_loader(inner):
            raise UnresumableDataError(
                f"data[{name!r}] is a DataLoader that accelerator.prepare() did not return: its order and "
                "position are the loop's own, so a resume could not continue its epoch. Pass the loader "
                "prepare() returned.")
        if _is_prepared_loader(inner) and getattr(inner, "num_workers", 0) > 0:
            warnings.warn(InexactResumeWarning(
                f"data[{name!r}] loads with num_workers={inner.num_workers}: after a resume the interrupted "
                "epoch's batches go to other workers, whose random number generators are seeded anew, so "
                "random transforms inside the dataset differ from an uninterrupted run (the batches' samples "
                "and order do not)."), stacklevel=3)


def _add(into: dict[str, Any], name: str, obj: Any) -> None:
    if name in into:
        raise ValueError(f"the name {name!r} is attach()'s own; give your object another")
    into[name] = obj


def attach(accelerator: Any, model: Any, optimizer: Any, location: StoreSpec | None = None, *, scheduler: Any = None,
           data: Any = None, stateful: Mapping[str, Stateful] | None = None, every: int = 1,
           root_or_store: StoreSpec | None = None, **options: Unpack[CheckpointerOptions]) -> AccelerateCheckpointer:
    """Take a version of an Accelerate job after every optimizer step (or every ``every``); call after ``prepare``.

    ::

        model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, lr_scheduler)
        ckpt = asymcheck.accelerate.attach(accelerator, model, optimizer, "ckpt", scheduler=lr_scheduler,
                                           data=train_dataloader)
        completed_steps = ckpt.resume() or 0
        for epoch in range(ckpt.loader.epoch, num_epochs):
            for batch in ckpt.loader:            # a resumed epoch goes on after the version's batches
                with accelerator.accumulate(model):
                    accelerator.backward(model(**batch).loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
        ckpt.close()

    Every process calls it (under several, ``resume()`` and the commits are collective).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared the objects.
        model: the prepared model (under DeepSpeed, the engine ``prepare`` returned).
        optimizer: the prepared optimizer.
        location: where the checkpoint lives: a directory (one process: a ``LocalTier`` there;
            several: a multi-rank root), an unopened store, or a list of tiers (see
            :class:`asymcheck.Checkpointer`; under DeepSpeed, :func:`asymcheck.deepspeed.attach`).
        scheduler: the prepared LR scheduler, if any (under DeepSpeed, one the engine steps is in
            the engine's own state already).
        data: a prepared data loader, or a mapping of names to prepared loaders and other objects
            with ``state_dict``/``load_state_dict`` that advance when a batch is drawn. Each
            prepared loader becomes a :class:`ResumableLoader` (``ckpt.loader`` /
            ``ckpt.loaders[name]``), to be iterated instead of the loader.
        stateful: name -> object with ``state_dict``/``load_state_dict`` updated after the step
            (your own counters, an EMA).
        every: a version every ``every``-th optimizer step.
        root_or_store: the former name of ``location``, deprecated (a ``DeprecationWarning``; goes
            in the next release).
        **options: the Checkpointer's typed option groups (:class:`asymcheck.options.CheckpointerOptions`:
            ``retention=RetentionOptions(keep_last=5)``, ``pacing=PacingOptions(max_overhead=None)``,
            ...), passed to :class:`asymcheck.Checkpointer` or, under DeepSpeed, to
            :func:`asymcheck.deepspeed.attach`. The flat keywords of earlier releases
            (``keep_last=5``) still work, with a ``DeprecationWarning``.

    Returns:
        The :class:`AccelerateCheckpointer`: ``resume()``, ``close()``, ``loader``.

    Raises:
        UnsupportedAccelerateConfigError: the accelerator uses a setting whose state would be
            missed, or one not tested (see :func:`unsupported_settings`); nothing was hooked.
        UnsupportedConfigError: under DeepSpeed, a configuration :func:`asymcheck.deepspeed.attach`
            refuses.
        UnresumableDataError: ``data`` holds a torch ``DataLoader`` that ``prepare`` did not return.
        MissingLocationError: ``location`` is None (a ``TypeError``; a script's ``--output_dir`` that
            was not given); nothing was hooked.
        InvalidOptionError: an option out of its range, or a flat keyword beside its own group; under
            ``TorchDynamoPlugin(fullgraph=True)``, a partitioning other than ``"step"``.
        TypeError: a keyword that is no option.

    Warns:
        InexactResumeWarning: no ``data`` was given (pass ``data={}`` when the loop draws no batches
            from a loader), or a prepared loader uses worker processes (random transforms in them
            differ after a resume).
    """
    if location is None and root_or_store is None:
        raise MissingLocationError(
            "attach() missing the argument 'location' (where the checkpoint lives), or it was None: a script's "
            "--output_dir is None unless given (run_clm_no_trainer.py's is); pass a directory, e.g. "
            "os.path.join(args.output_dir or \".\", \"asymcheck\")")
    where: StoreSpec = renamed_location(location, root_or_store, old="root_or_store", caller="attach")
    forwarded = forwarded_options("attach", options)
    _check(accelerator)
    datas = _named("data", data, LOADER_NAME)
    states = _named("stateful", stateful, "")
    _check_data(data, datas)
    loaders: dict[str, ResumableLoader] = {}
    for name, obj in list(datas.items()):
        if isinstance(obj, ResumableLoader):
            obj = obj.loader
        if _is_prepared_loader(obj):
            loaders[name] = datas[name] = ResumableLoader(accelerator, obj, name)
    _add(datas, STEP_NAME, _AcceleratorStep(accelerator))
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return _attach_deepspeed(accelerator, model, where, scheduler, datas, states, loaders, every,
                                 forwarded)
    inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected the optimizer accelerator.prepare() returned, got {type(optimizer)}")
    if scheduler is not None:
        _add(states, SCHEDULER_NAME, scheduler)
    if accelerator.scaler is not None:  # fp16 on CUDA: AcceleratedOptimizer steps through it
        _add(states, SCALER_NAME, accelerator.scaler)
    module = accelerator.unwrap_model(model)
    hooks = None
    if _compiled(accelerator):  # the model's own names, not the compiled wrapper's (_orig_mod.)
        module = accelerator.unwrap_model(model, keep_torch_compile=False)
        if getattr(accelerator.state.dynamo_plugin, "fullgraph", None):
            hooks = _step_hooks(inner, options, forwarded)  # a hook that breaks the graph would be an error
    ckpt = Checkpointer(module, inner, where, stateful=states, data=datas, every=every, hooks=hooks,
                        replication=_replication(accelerator), **forwarded)
    return AccelerateCheckpointer(ckpt, loaders)


def _replication(accelerator: Any) -> Replication:
    """``"replicated"`` under DDP (``distributed_type`` ``MULTI_CPU``/``MULTI_GPU`` on several processes).

    ``prepare`` wraps the model in ``DistributedDataParallel`` and the Checkpointer is handed the module
    inside it; it then writes the replicated state in slices (``CommitOptions(dedup=...)``), the
    replicas compared first.
    """
    ddp = accelerator.distributed_type in _DDP and accelerator.num_processes > 1
    return "replicated" if ddp else "detect"


def _step_hooks(optimizer: torch.optim.Optimizer, given: Mapping[str, Any],
                options: CheckpointerOptions) -> HooksFactory:
    """The optimizer-step hooks only (no forward or grad hook inside the compiled graph), copying at the step.

    Sets ``options["partitions"]`` to ``partitioning="step"`` (its other fields kept).

    Raises:
        InvalidOptionError: the user's options (``given``) ask for a partitioning other than ``"step"``.
    """
    part = options["partitions"]
    asked = given.get("partitions")
    chosen = asked.partitioning if isinstance(asked, PartitionOptions) else given.get("partitioning")
    if chosen is not None and chosen != "step":
        raise InvalidOptionError(
            f"partitioning={chosen!r} under TorchDynamoPlugin(fullgraph=True): the forward and grad hooks that "
            "spread the copy over the next iteration would break the graph, which fullgraph forbids; use "
            "PartitionOptions(partitioning=\"step\") (the copy at the optimizer step) or leave it out")
    options["partitions"] = dataclasses.replace(part, partitioning="step")
    return lambda driver: StepHooks(optimizer, driver)


def _attach_deepspeed(accelerator: Any, model: Any, location: Any, scheduler: Any, datas: dict[str, Any],
                      states: dict[str, Any], loaders: dict[str, ResumableLoader], every: int,
                      options: CheckpointerOptions) -> AccelerateCheckpointer:
    from accelerate.utils.deepspeed import DeepSpeedSchedulerWrapper

    import asymcheck.deepspeed

    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    engine = model if hasattr(model, "module") and hasattr(model, "optimizer") else getattr(wrapped, "engine", None)
    if engine is None:
        raise TypeError("under the DeepSpeed plugin, model must be the engine accelerator.prepare() returned")
    if scheduler is not None and not isinstance(scheduler, DeepSpeedSchedulerWrapper):
        _add(states, SCHEDULER_NAME, scheduler)  # stepped by the loop through AcceleratedScheduler, not by the engine
    ckpt = asymcheck.deepspeed.attach(engine, location, every, stateful=states, data=datas, **options)
    return AccelerateCheckpointer(ckpt, loaders, engine=engine)


def __getattr__(name: str) -> Any:
    """Names of earlier releases, with a DeprecationWarning (removed in the next release)."""
    if name == "TESTED":
        warnings.warn('asymcheck.accelerate.TESTED is now asymcheck.integrations.settings.TESTED["accelerate"]',
                      DeprecationWarning, stacklevel=2)
        return settings.TESTED["accelerate"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
