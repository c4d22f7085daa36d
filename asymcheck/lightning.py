"""asymcheck for Lightning: a version every optimizer step of a ``Trainer.fit``, through one callback.

Two lines::

    ckpt = asymcheck.lightning.AsymCheckCallback("ckpt")    # a lightning.pytorch.Callback
    trainer = Trainer(..., callbacks=[ckpt])                 # trainer.fit(model, datamodule) resumes by itself

When ``fit`` starts the callback builds a :class:`LightningCheckpointer` (sealing each version in
``on_before_optimizer_step``, since Lightning's closure runs the forward after the step pre-hook)
and loads the newest version that verifies; the fit goes on at the next batch. When each part of
a version is taken, the data position of each kind of train loader, what is refused (a table of
:data:`asymcheck.integrations.settings.LIGHTNING`) and the Lightning names relied on:
docs/guides/lightning.md. Importing this module imports Lightning (the ``lightning`` extra).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Unpack

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)

from asymcheck.checkpointer import Checkpointer, RestoreInfo
from asymcheck.errors import (
    InexactResumeWarning,
    InvalidOptionError,
    StateMismatchError,
    UnresumableDataError,
    UnsupportedLightningConfigError,
)
from asymcheck.integrations import names, position, settings, support
from asymcheck.integrations.attributes import RenamedAttribute, RetentionField
from asymcheck.integrations.callback import DeferredCheckpointer
from asymcheck.integrations.forward import CallbackOptions, forwarded_options
from asymcheck.integrations.settings import LIGHTNING, refusal
from asymcheck.options import CheckpointerOptions, PartitionOptions, RetentionOptions, renamed_location
from asymcheck.snapshot.hooks import Driver, Hooks, HookSet, StepHooks
from asymcheck.state.loaders import is_stateful_loader
from asymcheck.state.replicas import Replication
from asymcheck.state.trainstate import Stateful
from asymcheck.stats import CheckpointStats
from asymcheck.versions.storespec import StoreSpec
from asymstore import KeepBest
from asymstore.protocols import CollectiveStore

logger = logging.getLogger(__name__)

__all__ = ["AsymCheckCallback", "InexactResumeWarning", "LightningCheckpointer", "ResumableLoader",
           "UnresumableDataError", "UnsupportedLightningConfigError", "data_problems", "unsupported_settings"]

LOOPS_NAME = names.LIGHTNING_FIT_LOOP
SCHEDULER_PREFIX = names.LIGHTNING_SCHEDULER + "."
MARKED = "asymcheck_marked"  # in the recorded loop state: the version's small state was taken before training_step
DATA = "asymcheck_data"  # in the recorded loop state: the positions of the plain DataLoaders the callback positions
PRECISION_NAME = names.reserved("lightning", "precision")
"""The precision plugin's state (its GradScaler's scale and growth tracker), when it has a scaler."""
OPTIMIZER_PREFIX = names.reserved("lightning", "optimizer") + "."
"""With ``<i>``: the state of ``trainer.optimizers[i]`` for ``i >= 1`` (the first is the Checkpointer's own)."""
InexactData = Literal["raise", "warn"]
Sealing = Literal["closure", "step", "batch"]
"""Where a :class:`LightningCheckpointer` seals the previous version and opens the next:

- ``"closure"`` (automatic optimization): sealed by :meth:`LightningCheckpointer.before_step` in
  ``on_before_optimizer_step`` (the torch step pre-hook fires before Lightning's closure), opened
  by the optimizer's step post-hook.
- ``"step"`` (automatic optimization with a GradScaler): Lightning runs the closure, then
  ``scaler.step(optimizer)``, which calls ``optimizer.step()`` only when the gradients are finite:
  sealed in the optimizer's step pre-hook and opened in its post-hook, so a step the scaler skips
  is no version and leaves the open version open.
- ``"batch"`` (manual optimization, any number of optimizers): sealed at the step pre-hook of the
  first optimizer that steps in a ``training_step``; opened by :meth:`LightningCheckpointer.batch_end`
  in ``on_train_batch_end`` when an optimizer step completed in it: a version is one ``training_step``,
  after all its optimizer steps.
"""
# what the callback captures exactly: full precision, and mixed precision (a GradScaler's state is in the version)
_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed")
# samplers whose pass is decided by the global torch RNG, their ``generator`` and Lightning's set_epoch alone
_SAMPLERS = (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler,
             torch.utils.data.SubsetRandomSampler, torch.utils.data.WeightedRandomSampler,
             torch.utils.data.DistributedSampler)


# -- what is refused -----------------------------------------------------------


def unsupported_settings(trainer: Trainer, module: LightningModule) -> list[str]:
    """The settings of ``trainer`` and ``module`` whose state :class:`AsymCheckCallback` would not capture correctly.

    Args:
        trainer: the trainer, with its strategy set up (``on_fit_start``).
        module: the LightningModule fitted.

    Returns:
        One line per refused setting (empty: supported).
    """
    out = support.version_problems("lightning", lightning.__version__)
    strategy = trainer.strategy
    deepspeed = isinstance(strategy, DeepSpeedStrategy)
    params = {id(p) for p in module.parameters()}
    if not deepspeed and not any(id(p) in params for opt in trainer.optimizers for group in opt.param_groups
                                 for p in group["params"]):
        # configure_optimizers returned None: Lightning steps a stand-in optimizer of none of the module's parameters
        out.append(refusal(LIGHTNING, "configure_optimizers").line(
            "configure_optimizers returned no optimizer of the module's parameters"))
    if compiled_fullgraph(module) and not module.automatic_optimization:
        out.append(refusal(LIGHTNING, "torch.compile(fullgraph=True) with manual optimization").line())
    if str(trainer.precision) not in _PRECISIONS:
        out.append(refusal(LIGHTNING, "precision").line(f"precision={trainer.precision}"))
    if trainer.ckpt_path is not None:
        out.append(refusal(LIGHTNING, "fit(ckpt_path=...)").line(f"fit(ckpt_path={str(trainer.ckpt_path)!r})"))
    if type(strategy) is ModelParallelStrategy:
        tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel > 1:
            out.append(refusal(LIGHTNING, "ModelParallelStrategy(tensor_parallel_size>1)").line(
                f"ModelParallelStrategy(tensor_parallel_size={tensor_parallel})"))
    elif isinstance(strategy, FSDPStrategy):
        out.append(refusal(LIGHTNING, "FSDPStrategy").line(f"strategy={type(strategy).__name__}"))
    elif isinstance(strategy, DeepSpeedStrategy):
        out.extend(_deepspeed_problems(strategy, trainer, module))
    elif type(strategy) is DDPStrategy and getattr(strategy, "_start_method", "popen") != "popen":
        # ddp_spawn, ddp_fork, ddp_notebook: the fit runs in processes the strategy starts (Lightning's private name)
        start = getattr(strategy, "_start_method", None)
        out.append(refusal(LIGHTNING, "ddp_spawn").line(f"DDPStrategy(start_method={start!r})"))
    elif type(strategy) not in (DDPStrategy, SingleDeviceStrategy):
        out.append(refusal(LIGHTNING, "strategy").line(f"strategy={type(strategy).__name__}"))
    return out


def compiled_fullgraph(module: LightningModule) -> bool:
    """Whether ``module`` was passed to ``fit`` as ``torch.compile(module, fullgraph=True)``.

    Lightning unwraps the compiled wrapper (``_orig_mod``) and compiles the module's step methods
    with the wrapper's Dynamo context, which it keeps in the module's ``_compiler_ctx`` (a private
    Lightning name; the context's ``fullgraph`` is torch's): under ``fullgraph=True`` a hook that breaks
    the graph is an error, so the callback hooks only the optimizer's step (see :class:`LightningCheckpointer`).
    """
    ctx = getattr(module, "_compiler_ctx", None)
    return isinstance(ctx, dict) and bool(getattr(ctx.get("dynamo_ctx"), "fullgraph", False))


def _replication(trainer: Trainer) -> Replication:
    """``"replicated"`` under ``DDPStrategy`` on several processes (not its subclass ``DeepSpeedStrategy``).

    The strategy wraps the LightningModule in ``DistributedDataParallel`` and the Checkpointer is handed
    the LightningModule; it then writes the replicated state in slices (``CommitOptions(dedup=...)``),
    the replicas compared first.
    """
    return "replicated" if type(trainer.strategy) is DDPStrategy and trainer.world_size > 1 else "detect"


def _deepspeed_problems(strategy: DeepSpeedStrategy, trainer: Trainer, module: LightningModule) -> list[str]:
    """What is refused under ``DeepSpeedStrategy`` beyond what :func:`asymcheck.deepspeed.attach` refuses itself."""
    out: list[str] = []
    stage = strategy.config.get("zero_optimization", {}).get("stage", 0) if strategy.config else 0
    if stage == 3:
        out.append(refusal(LIGHTNING, "DeepSpeedStrategy(stage=3)").line())
    if str(trainer.precision) != "32-true":
        out.append(refusal(LIGHTNING, "DeepSpeedStrategy with precision").line(
            f"DeepSpeedStrategy with precision={trainer.precision}"))
    if not module.automatic_optimization:
        out.append(refusal(LIGHTNING, "DeepSpeedStrategy with manual optimization").line())
    if trainer.accumulate_grad_batches > 1:  # DeepSpeed's own micro-step count decides its boundaries
        out.append(refusal(LIGHTNING, "DeepSpeedStrategy with accumulate_grad_batches>1").line(
            f"DeepSpeedStrategy with accumulate_grad_batches={trainer.accumulate_grad_batches}"))
    return out


def _check(trainer: Trainer, module: LightningModule) -> None:
    support.require_supported(unsupported_settings(trainer, module), UnsupportedLightningConfigError,
                              "asymcheck.lightning.AsymCheckCallback does not capture this fit correctly")


# -- the data position ---------------------------------------------------------


class _SkipBatches:
    """A batch sampler that draws the first ``skip`` batches of ``inner`` and yields the rest."""

    def __init__(self, inner: Iterable[list[int]], skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)  # type: ignore[arg-type]


class ResumableLoader(position.ResumableLoader):
    """A train ``DataLoader`` whose position goes into every version and comes back without re-reading.

    Return it from ``train_dataloader()`` (or the datamodule's) in place of the loader. It yields the
    loader's batches; each pass records the RNG states it began with (the global torch CPU generator
    and the loader's ``generator``: they decide a shuffled pass's order). :class:`AsymCheckCallback`
    records in it, in ``on_train_batch_end``, how many batches of the pass were trained; Lightning's
    loop state carries that (``state_dict``), and after a resume the first pass sets the RNG states
    back to those the interrupted pass began with and goes on after the batches already trained: with
    a map-style dataset through a batch sampler that draws the skipped batches' indices without
    loading their samples, with an ``IterableDataset`` by reading through them. Passes after that
    are the loader's own. Under DDP give the loader a ``DistributedSampler`` yourself (Lightning
    puts one only into a plain ``DataLoader``); ``sampler`` and ``batch_sampler`` are forwarded so
    that Lightning's ``set_epoch`` reaches it. The attributes shared with every framework's loader:
    :class:`asymcheck.integrations.ResumableLoader`.

    Args:
        loader: the data loader.
        name: its name (the version holds its position in Lightning's loop state).

    Attributes:
        loader: the data loader.
        batches: batches of the current pass trained (set by :class:`AsymCheckCallback`).
        position: the pass position (:class:`asymcheck.integrations.LoaderPosition`).
    """

    loader: torch.utils.data.DataLoader[Any]

    def __init__(self, loader: torch.utils.data.DataLoader[Any], name: str = "loader") -> None:
        """Wrap ``loader``."""
        super().__init__(loader, name)

    @property
    def trained(self) -> int:
        """Deprecated: :attr:`batches`."""
        warnings.warn("ResumableLoader.trained is now ResumableLoader.batches", DeprecationWarning, stacklevel=2)
        return self.batches

    @trained.setter
    def trained(self, value: int) -> None:
        warnings.warn("ResumableLoader.trained is now ResumableLoader.batches", DeprecationWarning, stacklevel=2)
        self.batches = value

    @property
    def sampler(self) -> Any:
        """The loader's sampler (Lightning calls ``set_epoch`` on it)."""
        return self.loader.sampler

    @property
    def batch_sampler(self) -> Any:
        """The loader's batch sampler."""
        return self.loader.batch_sampler

    @property
    def dataset(self) -> Any:
        """The loader's dataset."""
        return self.loader.dataset

    def __iter__(self) -> Iterator[Any]:
        """Yield the pass's batches (after a resume: those of the interrupted pass not yet trained).

        Nothing is drawn before the first batch is asked for: the pass's RNG states are recorded
        then, right before the loader's iterator and sampler draw. The continued pass after a resume
        draws from the interrupted pass's starting states, then puts the global torch RNG back as it
        found it, so the states of the version go on.
        """
        pending = self.position.pending  # until resumed(): Lightning may begin a pass twice
        if pending is None:
            self.position.begin(self.generators())
            yield from self.loader
            return
        skip = pending[0]
        yield from self.position.continued(self.generators(),
                                           lambda: iter(self._skipped(skip) if skip else self.loader), pending)

    def resumed(self) -> None:
        """The continued pass trains (called by :class:`AsymCheckCallback`): passes after it are the loader's own."""
        self.position.resumed()

    def _skipped(self, skip: int) -> Iterable[Any]:
        loader = self.loader
        if isinstance(loader.dataset, torch.utils.data.IterableDataset) or loader.batch_sampler is None:
            it = iter(loader)
            for _ in range(skip):
                next(it, None)
            return it
        return torch.utils.data.DataLoader(
            loader.dataset, batch_sampler=_SkipBatches(loader.batch_sampler, skip), num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator, prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device)

    def state_dict(self) -> dict[str, Any]:
        """Batches of the current pass trained, and the RNG states the pass began with."""
        return _position_state(self.position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass continue the one ``state`` describes (a finished pass: a new pass)."""
        _load_position(self.position, state, len(self))


def _position_state(pos: position.LoaderPosition) -> dict[str, Any]:
    """A pass position as Lightning's versions hold it: ``trained`` batches and the ``start`` RNG states."""
    return {"trained": pos.batches, "start": dict(pos.start)}


def _load_position(pos: position.LoaderPosition, state: Mapping[str, Any], batches: int) -> None:
    """Make ``pos``'s next pass continue the one ``state`` describes (a finished pass: a new one)."""
    trained = int(state["trained"])
    start = {str(k): v for k, v in dict(state["start"]).items() if isinstance(v, torch.Tensor)}
    if 0 <= trained < batches and "torch" in start:
        pos.continue_at(trained, start)
    else:  # a finished pass: the next one is new
        pos.resumed()


class _PositionedSampler(torch.utils.data.Sampler[int]):
    """The sampler of a plain ``DataLoader``'s ``BatchSampler`` while :class:`AsymCheckCallback` positions it.

    Put in place of ``loader.batch_sampler.sampler`` in ``on_train_start`` (before the pass's first
    batch is drawn: without workers a ``DataLoader`` draws nothing from its sampler until then), and
    given back at ``teardown``. A pass yields the inner sampler's indices unchanged and records the
    RNG states it began with (the global torch generator and the sampler's ``generator``), read right
    before the inner sampler draws. After a resume the first pass sets those states back while the
    inner sampler draws (so the order is the interrupted pass's), drops the indices of the batches
    already trained (their samples are never read), then puts the global torch RNG back.

    Attributes:
        inner: the loader's own sampler.
        batch_size: the ``BatchSampler``'s batch size (a trained batch is that many indices).
        position: the pass position (:class:`~asymcheck.integrations.position.LoaderPosition`; its ``batches``
            are set by :class:`AsymCheckCallback`).
    """

    def __init__(self, inner: Any, batch_size: int) -> None:
        """Wrap ``inner``."""
        self.inner = inner
        self.batch_size = batch_size
        self.position = position.LoaderPosition()

    def __len__(self) -> int:
        """The inner sampler's length."""
        return len(self.inner)

    def _generators(self) -> dict[str, torch.Generator]:
        g = getattr(self.inner, "generator", None)
        return {"generator": g} if isinstance(g, torch.Generator) else {}

    def __iter__(self) -> Iterator[int]:
        """The pass's indices (after a resume: those of the interrupted pass's batches not yet trained)."""
        pending = self.position.pending  # until resumed(): Lightning may begin a pass twice
        if pending is None:
            self.position.begin(self._generators())
            yield from self.inner
            return
        skip = pending[0]

        def indices() -> Iterator[int]:
            it: Iterator[int] = iter(self.inner)
            for _ in range(skip * self.batch_size):  # whole batches: the pass's draws, as in the interrupted pass
                next(it)
            return it

        yield from self.position.continued(self._generators(), indices, pending)

    def resumed(self) -> None:
        """The continued pass trains: passes after it are the sampler's own."""
        self.position.resumed()

    def state_dict(self) -> dict[str, Any]:
        """Batches of the current pass trained, and the RNG states the pass began with."""
        return _position_state(self.position)

    def load_state_dict(self, state: Mapping[str, Any], batches: int) -> None:
        """Make the next pass continue the one ``state`` describes (a finished pass: a new pass).

        Args:
            state: what :meth:`state_dict` returned in the interrupted fit.
            batches: batches per pass of the loader now.
        """
        _load_position(self.position, state, batches)


def _flatten(found: Any) -> list[Any]:
    if isinstance(found, Mapping):
        return [x for v in found.values() for x in _flatten(v)]
    if isinstance(found, list | tuple):
        return [x for v in found for x in _flatten(v)]
    return [] if found is None else [found]


def _stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _plain_problem(loader: Any) -> str | None:
    """Why :class:`AsymCheckCallback` cannot position ``loader`` itself (None: it can)."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        return ("not a torch DataLoader and has no state_dict/load_state_dict: a resume inside an epoch would "
                "take the epoch's remaining batches from the start of a new pass")
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return ("reads an IterableDataset, whose stream has no position to set: a resume inside an epoch would "
                "take the epoch's remaining batches from the start of the stream")
    if loader.num_workers > 0:
        return (f"num_workers={loader.num_workers}: its iterator draws the pass's first indices when Lightning "
                "creates it, before any callback hook of a resumed fit, so the resumed epoch would take its "
                "remaining batches from the start of a new order")
    batch_sampler = loader.batch_sampler
    if batch_sampler is None or type(batch_sampler) is not torch.utils.data.BatchSampler:
        what = "batch_size=None" if batch_sampler is None else f"its batch_sampler is a {type(batch_sampler).__name__}"
        return (f"{what}: the callback positions a torch BatchSampler only; a resume inside an epoch would take "
                "the epoch's remaining batches from the start of a new pass")
    sampler = batch_sampler.sampler
    if isinstance(sampler, _PositionedSampler):
        sampler = sampler.inner
    if not isinstance(sampler, _SAMPLERS):
        return (f"its sampler is a {type(sampler).__name__}, whose draws the callback cannot replay: a resume "
                "inside an epoch would take the epoch's remaining batches from the start of a new pass")
    return None


def _describe(i: int, loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    of = f" of {type(dataset).__name__}" if dataset is not None else ""
    return f"train loader {i} ({type(loader).__name__}{of})"


def data_problems(trainer: Trainer) -> tuple[list[str], list[torch.utils.data.DataLoader[Any]]]:
    """What :class:`AsymCheckCallback` cannot resume exactly in the trainer's train loaders, and those it positions.

    A :class:`ResumableLoader` positions itself; a loader with ``state_dict``/``load_state_dict``
    (torchdata's ``StatefulDataLoader``) is positioned by Lightning's loop state; one plain
    ``DataLoader`` over a map-style dataset, without workers, batched by a torch ``BatchSampler``
    over a torch sampler, is positioned by the callback. Anything else is a problem.

    Args:
        trainer: the trainer, its train loader set up (``on_train_start`` or later).

    Returns:
        One line per loader a resume would not continue exactly (naming it and what would differ),
        and the plain loaders the callback positions.
    """
    problems: list[str] = []
    plain: list[torch.utils.data.DataLoader[Any]] = []
    for i, loader in enumerate(_flatten(trainer.train_dataloader)):
        if isinstance(loader, ResumableLoader) or _stateful(loader):
            continue
        problem = _plain_problem(loader)
        if problem is not None:
            problems.append(f"{_describe(i, loader)}: {problem}")
        else:
            plain.append(loader)
    if len(plain) > 1:
        problems.append(f"{len(plain)} plain train loaders: the callback positions one (a shorter loader "
                        "starts over inside an epoch); wrap each in ResumableLoader")
        plain = []
    return problems, plain


def _install(loader: torch.utils.data.DataLoader[Any]) -> _PositionedSampler:
    batch_sampler = loader.batch_sampler
    assert isinstance(batch_sampler, torch.utils.data.BatchSampler)
    if isinstance(batch_sampler.sampler, _PositionedSampler):
        return batch_sampler.sampler
    positioned = _PositionedSampler(batch_sampler.sampler, batch_sampler.batch_size)
    batch_sampler.sampler = positioned
    return positioned


def _uninstall(loader: torch.utils.data.DataLoader[Any], positioned: _PositionedSampler) -> None:
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, torch.utils.data.BatchSampler) and batch_sampler.sampler is positioned:
        batch_sampler.sampler = positioned.inner


def _loaders(trainer: Trainer) -> list[ResumableLoader]:
    found = trainer.train_dataloader
    if isinstance(found, ResumableLoader):
        return [found]
    values: Iterable[Any] = found.values() if isinstance(found, Mapping) else (
        found if isinstance(found, list | tuple) else ())
    return [v for v in values if isinstance(v, ResumableLoader)]


# -- the loop state ------------------------------------------------------------


class _LoopState:
    """The fit loop's state as of the last ``on_train_batch_end`` (a version takes it at the next step)."""

    def __init__(self) -> None:
        self.recorded: dict[str, Any] = {}
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.recorded

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = copy.deepcopy(dict(state))
        self.recorded = copy.deepcopy(dict(state))


# -- the checkpointer ------------------------------------------------------------


def _noop() -> None:
    pass


class _BatchHooks:
    """The hooks of manual optimization: HookSet's forward and grad hooks, every optimizer's step hooks.

    The first step pre-hook after a version opened seals it (once: a ``before_step`` only after an
    ``after_step``); each step post-hook records that a step completed; :meth:`batch_end` opens the
    next version when one did.
    """

    def __init__(self, driver: Driver, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.driver = driver
        self._inner = HookSet(model, optimizers[0], on_forward=driver.on_forward, on_grad=driver.on_grad,
                              on_step_pre=_noop, on_step_post=_noop)
        self._handles = [h for opt in optimizers for h in (
            opt.register_step_pre_hook(lambda o, args, kwargs: self._pre()),
            opt.register_step_post_hook(lambda o, args, kwargs: self._post()))]
        self._sealed = False  # before_step was delivered and no after_step since
        self._stepped = False  # an optimizer step completed since the last batch_end

    def _pre(self) -> None:
        if not self._sealed:
            self._sealed = True
            self.driver.before_step()

    def _post(self) -> None:
        self._stepped = True

    def batch_end(self) -> None:
        if self._stepped:
            self._stepped = self._sealed = False
            self.driver.after_step()

    def refresh(self) -> int:
        return self._inner.refresh()

    def settle(self) -> None:
        self._inner.settle()

    def remove(self) -> None:
        self._inner.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class LightningCheckpointer(Checkpointer):
    """A :class:`asymcheck.Checkpointer` sealing versions at Lightning's moments (made by AsymCheckCallback).

    Where it seals and opens a version is its ``sealing`` (:data:`Sealing`). Under automatic
    optimization without a GradScaler the torch step pre-hook of the plain Checkpointer fires before
    Lightning's closure (the forward and backward of the iteration), so the version of the previous
    step is sealed by :meth:`before_step`, which :class:`AsymCheckCallback` calls in
    ``on_before_optimizer_step``; the step post-hook still opens each version. The parameters and the
    first optimizer's state are copied lazily; the other optimizers' states (manual optimization)
    are ``stateful`` objects, copied at once when the version takes its small state. It drives the
    Checkpointer through its public ``hooks=`` factory and :attr:`asymcheck.Checkpointer.driver`.

    Args:
        model: the LightningModule.
        optimizer: the first optimizer (the others, under ``sealing="batch"``, go in ``optimizers``).
        location: as :class:`asymcheck.Checkpointer` takes it.
        stateful: as :class:`asymcheck.Checkpointer` takes it.
        every: a version every ``every`` steps (``"batch"``: training steps that stepped).
        sealing: where versions are sealed and opened.
        optimizers: under ``"batch"``, every optimizer whose steps are hooked (default: ``optimizer``).
        step_hooks_only: only the optimizer's step hooks (:class:`asymcheck.snapshot.hooks.StepHooks`,
            ``sealing="step"``; give ``PartitionOptions(partitioning="step")``): for a module compiled with
            ``fullgraph=True``, where a forward or grad hook would break the graph.
        replication: as :class:`asymcheck.Checkpointer` takes it (``"replicated"`` under ``DDPStrategy``:
            the strategy holds the ``DistributedDataParallel``, the LightningModule is the module inside).
        **options: the Checkpointer's typed option groups.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, location: StoreSpec, *,
                 stateful: Mapping[str, Stateful] | None = None, every: int = 1, sealing: Sealing = "closure",
                 optimizers: Sequence[torch.optim.Optimizer] = (), step_hooks_only: bool = False,
                 replication: Replication = "detect", **options: Unpack[CheckpointerOptions]) -> None:
        """Build the Checkpointer with the model's hooks and the step hooks ``sealing`` needs."""
        if step_hooks_only and sealing != "step":
            raise ValueError("step_hooks_only needs sealing='step' (the optimizer's step pre-hook seals)")
        self.sealing: Sealing = sealing
        self._batch_hooks: _BatchHooks | None = None

        def hooks(driver: Driver) -> Hooks:
            if step_hooks_only:  # fullgraph: nothing inside the compiled graph; the copy at the step pre-hook
                return StepHooks(optimizer, driver)
            if sealing == "batch":
                self._batch_hooks = _BatchHooks(driver, model, list(optimizers) or [optimizer])
                return self._batch_hooks
            return HookSet(model, optimizer, on_forward=driver.on_forward, on_grad=driver.on_grad,
                           on_step_pre=driver.before_step if sealing == "step" else _noop,
                           on_step_post=driver.after_step)

        super().__init__(model, optimizer, location, stateful=stateful, every=every, hooks=hooks,
                         replication=replication, **options)

    def before_step(self) -> None:
        """Seal the open version: the optimizer is about to step (its closure ran). For ``sealing="closure"``."""
        self.driver.before_step()

    def batch_end(self) -> None:
        """A ``training_step`` ended: open the next version if an optimizer step completed in it (``"batch"``)."""
        if self._batch_hooks is not None:
            self._batch_hooks.batch_end()


def _step_partitions(partitions: PartitionOptions, chosen: str | None) -> PartitionOptions:
    """``partitions`` with ``partitioning="step"``, for a module compiled with ``fullgraph=True``.

    Raises:
        InvalidOptionError: the user chose another partitioning (``chosen``).
    """
    if chosen is not None and chosen != "step":
        raise InvalidOptionError(
            f"partitioning={chosen!r} under torch.compile(module, fullgraph=True): the forward and grad hooks that "
            "spread the copy over the next iteration would break the graph, which fullgraph forbids; use "
            "PartitionOptions(partitioning=\"step\") (the copy at the optimizer step) or leave it out")
    return dataclasses.replace(partitions, partitioning="step")


def _deepspeed_checkpointer(engine: Any, location: StoreSpec, stateful: Mapping[str, Stateful], every: int,
                            options: CheckpointerOptions) -> Checkpointer:
    """The DeepSpeed adapter over the engine of Lightning's ``DeepSpeedStrategy`` (imports DeepSpeed).

    It seals a version at the inner optimizer's first step pre-hook of ``engine.step()`` (Lightning
    runs the closure, then ``on_before_optimizer_step``, then ``engine.step()``), takes the engine's
    files as DeepSpeed's ``save_checkpoint`` writes them; the adapter delivers the step at the next
    forward, and the callback delivers it earlier, in ``on_train_batch_end``
    (:meth:`asymcheck.Checkpointer.settle`), where the next version opens and the batch's loop state is
    recorded with its step; ``stateful`` (the loop state, schedulers) is taken at the mark
    (``on_train_batch_start``).
    """
    import asymcheck.deepspeed

    if not isinstance(location, str | os.PathLike | CollectiveStore):
        raise UnsupportedLightningConfigError(
            f"DeepSpeedStrategy: AsymCheckCallback takes a directory (the multi-rank root) or a multi-rank store, "
            f"not a {type(location).__name__}")
    return asymcheck.deepspeed.attach(engine, location, every=every, stateful=stateful, **options)


# -- the callback ----------------------------------------------------------------


class AsymCheckCallback(Callback):
    """A version every ``every`` optimizer steps of ``Trainer.fit``, and a resume when ``fit`` starts.

    Args:
        location: where the checkpoint lives: a directory (a ``LocalTier``; under DDP a multi-rank
            store there, also under FSDP2 and DeepSpeed), a list of tiers (fastest first), or an unopened store; as
            :class:`asymcheck.Checkpointer` takes it. One ``fit`` opens it and closes it.
        every: a version every ``every`` optimizer steps.
        keep_last: versions kept per tier (the same rule as ``retention=RetentionOptions(keep_last=...)``:
            give each rule one way).
        keep_every: also keep every version whose step is a multiple of it, permanently.
        monitor: a metric logged by the LightningModule (``self.log``), as ``ModelCheckpoint`` takes it:
            read from ``trainer.callback_metrics`` after each training batch and each validation, and
            recorded with the version of the step (``meta["metrics"]``).
        mode: ``"min"`` or ``"max"``: which values of ``monitor`` are best.
        save_top_k: keep the ``save_top_k`` best versions by ``monitor`` beside ``keep_last``
            (:class:`asymstore.KeepBest`; one process only). 0: record the metric only (under DDP).
        resume: load the newest version that verifies when ``fit`` starts.
        inexact_data: what to do, in ``on_train_start`` (before the first training step), with a train
            loader a resume could not continue exactly (see :func:`data_problems`): ``"raise"``
            :class:`UnresumableDataError` naming it and what would differ, or ``"warn"``
            (:class:`InexactResumeWarning`, the same words) and train.
        root_or_store: the former name of ``location``, deprecated (a ``DeprecationWarning``; goes
            in the next release).
        **options: the Checkpointer's typed option groups (:class:`asymcheck.options.CheckpointerOptions`:
            ``pacing=PacingOptions(max_overhead=None)``, ``failures=FailureOptions(on_error="raise")``,
            ``preemption=...``, ...). The flat keywords of earlier releases (``max_overhead=None``)
            still work, with a ``DeprecationWarning``.

    Raises:
        ValueError: ``every``, ``mode`` or ``inexact_data`` is out of its range.
        InvalidOptionError: an option out of its range, a flat keyword beside its own group, or a
            retention rule given both as an argument and in ``retention=``.
        TypeError: a keyword that is no option.

    Attributes:
        checkpointer: the Checkpointer of the running (or last) ``fit``.
        restored: what the resume of the last ``fit`` loaded (None: it started fresh).
    """

    def __init__(self, location: StoreSpec | None = None, *, every: int = 1, keep_last: int | None = 3,
                 keep_every: int | None = None, monitor: str | None = None, mode: Literal["min", "max"] = "min",
                 save_top_k: int = 1, resume: bool = True, inexact_data: InexactData = "raise",
                 root_or_store: StoreSpec | None = None, **options: Unpack[CallbackOptions]) -> None:
        """Keep the options; nothing is opened until ``fit`` starts."""
        where: StoreSpec = renamed_location(location, root_or_store, old="root_or_store", caller="AsymCheckCallback")
        if every < 1:
            raise ValueError("every must be >= 1")
        if inexact_data not in ("raise", "warn"):
            raise ValueError(f"inexact_data must be 'raise' or 'warn', got {inexact_data!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        keep_best = KeepBest(monitor, mode, save_top_k) if monitor is not None and save_top_k > 0 else None
        given = options.get("partitions")
        # the partitioning the user chose, if any (a module compiled with fullgraph=True needs "step")
        self._partitioning: str | None = (given.partitioning if isinstance(given, PartitionOptions) else
                                          options.get("partitioning"))
        self.options = forwarded_options("AsymCheckCallback", options, keep_last=keep_last, keep_every=keep_every,
                                         keep_best=keep_best)
        """The Checkpointer's option groups (``retention`` holds keep_last, keep_every and monitor's rule)."""
        self.location: StoreSpec = where
        self.every = every
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.resume = resume
        self.inexact_data: InexactData = inexact_data
        self._run: DeferredCheckpointer[Checkpointer] = DeferredCheckpointer()
        self.restored: RestoreInfo | None = None
        self._loops = _LoopState()
        self._validated = False  # the monitored metric comes from validation
        self._resuming = False  # until the first batch after a resume
        self._recorded = 0  # the step whose loop state is recorded (self._run: the step whose version took its state)
        self._positioned: list[tuple[torch.utils.data.DataLoader[Any], _PositionedSampler]] = []
        self._data_loaded: list[Any] | None = None  # the positions of the version resumed, until on_train_start
        self._data_unrecorded = False  # the version resumed has no positions at all (an older release's)
        self._data_told: set[str] = set()  # the problems already warned about in this fit

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The Checkpointer of the running (or last) ``fit`` (a ``DeepSpeedCheckpointer`` under DeepSpeed)."""
        return self._run.checkpointer

    @property
    def retention(self) -> RetentionOptions:
        """The retention rules: ``keep_last``, ``keep_every`` and the best versions by ``monitor``."""
        return self.options["retention"]

    keep_last = RetentionField[int | None]("keep_last")
    """Versions kept per tier (``retention.keep_last``)."""

    keep_every = RetentionField[int | None]("keep_every")
    """Every version whose step is a multiple of it is kept (``retention.keep_every``)."""

    root_or_store = RenamedAttribute[StoreSpec]("location")
    """Deprecated: :attr:`location`."""

    @property
    def state_key(self) -> str:
        """The callback's key in Lightning's own checkpoints (it keeps no state there)."""
        return "AsymCheck"  # the name of earlier releases' class: Lightning's checkpoints keep their key

    def stats(self) -> CheckpointStats | None:
        """The Checkpointer's statistics (None before ``fit``)."""
        return self.checkpointer.stats() if self.checkpointer is not None else None

    # -- fit starts: check, build, resume ------------------------------------

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Refuse what is not captured, build the Checkpointer, load the newest version (``resume=True``).

        Raises:
            UnsupportedLightningConfigError: a setting named in the message is not supported.
        """
        _check(trainer, pl_module)
        self._loops = _LoopState()
        stateful: dict[str, Stateful] = {LOOPS_NAME: self._loops}
        for i, config in enumerate(trainer.lr_scheduler_configs):
            stateful[f"{SCHEDULER_PREFIX}{i}"] = config.scheduler
        for i, optimizer in enumerate(trainer.optimizers[1:], start=1):
            stateful[f"{OPTIMIZER_PREFIX}{i}"] = optimizer
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # the GradScaler's scale and growth tracker (MixedPrecision's state_dict)
            stateful[PRECISION_NAME] = trainer.precision_plugin
        fullgraph = compiled_fullgraph(pl_module)
        sealing: Sealing = ("batch" if not pl_module.automatic_optimization else
                            "step" if scaler is not None or fullgraph else "closure")
        options = self.options
        if fullgraph:  # the copy at the step: no hook inside the compiled graph
            options = {**options, "partitions": _step_partitions(options["partitions"], self._partitioning)}
        self.restored = None
        self._positioned, self._data_loaded, self._data_told, self._data_unrecorded = [], None, set(), False
        ckpt: Checkpointer
        if isinstance(trainer.strategy, DeepSpeedStrategy):  # the DeepSpeed adapter hooks the engine Lightning made
            ckpt = _deepspeed_checkpointer(trainer.strategy.model, self.location, stateful, self.every, options)
        else:
            ckpt = LightningCheckpointer(pl_module, trainer.optimizers[0], self.location, stateful=stateful,
                                         every=self.every, sealing=sealing, optimizers=trainer.optimizers,
                                         step_hooks_only=fullgraph, replication=_replication(trainer),
                                         **options)
        self._run.start(ckpt, marked=0)
        self._recorded = 0
        self._validated = self._resuming = False
        if not self.resume:
            return
        try:
            step = ckpt.resume()
        except BaseException:
            ckpt.close()
            raise
        if step is None or self._loops.loaded is None:
            return
        self._run.set_marked(step)
        self._recorded = step
        self.restored = ckpt.restored
        self._resuming = True
        trainer.fit_loop.load_state_dict(self._loops.loaded)  # what fit(ckpt_path=...) does
        data = self._loops.loaded.get(DATA)  # None: a version of a release that did not record positions
        self._data_loaded = None if data is None else list(data) if isinstance(data, list | tuple) else [data]
        self._data_unrecorded = data is None
        if self._loops.loaded.get(MARKED):  # taken right before training_step: set back then (below)
            self._run.rng.hold()

    # -- the data position ------------------------------------------------

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Check the train loaders and position the plain one, before its first batch is drawn.

        Lightning has created the loader's iterator (``fit_loop.setup_data``) but, without workers,
        its ``BatchSampler`` has not drawn yet: the callback puts a :class:`_PositionedSampler` in front
        of the sampler here, and after a resume gives it the interrupted pass's position.

        Raises:
            UnsupportedLightningConfigError: a train loader is torchdata's ``StatefulDataLoader`` (see
                :data:`asymcheck.integrations.settings.LIGHTNING`), before the first training step.
            UnresumableDataError: a train loader could not be resumed exactly (``inexact_data="raise"``).
            StateMismatchError: the version holds positions for other train loaders than these.
        """
        self._position(trainer)
        loaded, self._data_loaded = self._data_loaded, None
        unrecorded, self._data_unrecorded = self._data_unrecorded, False
        if unrecorded and self._positioned:
            step = self.restored.step if self.restored is not None else None
            message = (f"asymcheck.lightning.AsymCheckCallback: the version resumed (step {step}) holds no position of "
                       "the plain train loader (it was written before the callback recorded one), so the "
                       "interrupted epoch's remaining batches would come from a new order; versions from now on "
                       "hold it")
            if self.inexact_data == "raise":
                raise UnresumableDataError(message + ". Pass AsymCheckCallback(inexact_data='warn') to resume it "
                                           "anyway")
            warnings.warn(message, InexactResumeWarning, stacklevel=2)
        if loaded is None or not self._positioned:
            return
        if len(loaded) != len(self._positioned):
            raise StateMismatchError(f"the version holds the positions of {len(loaded)} plain train loaders, this "
                                     f"fit has {len(self._positioned)}")
        for i, ((loader, positioned), state) in enumerate(zip(self._positioned, loaded, strict=True)):
            try:
                positioned.load_state_dict(state, len(loader))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise StateMismatchError(f"the version's position of {_describe(i, loader)} is malformed: "
                                         f"{type(exc).__name__}: {exc}") from exc

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Position a train loader Lightning reloaded (``reload_dataloaders_every_n_epochs``) before its pass."""
        self._position(trainer)

    def _position(self, trainer: Trainer) -> None:
        for i, loader in enumerate(_flatten(trainer.train_dataloader)):
            if is_stateful_loader(loader):  # Lightning restores it before any hook, one generator draw short
                support.require_supported([refusal(LIGHTNING, "StatefulDataLoader").line(
                    f"{_describe(i, loader)} is torchdata's StatefulDataLoader")], UnsupportedLightningConfigError,
                    "asymcheck.lightning.AsymCheckCallback does not capture this fit correctly")
        problems, plain = data_problems(trainer)
        new = [p for p in problems if p not in self._data_told]
        if new:
            message = ("asymcheck.lightning.AsymCheckCallback cannot resume these train loaders exactly (the losses "
                       "after a resume would differ from an uninterrupted fit): " + "; ".join(new) + ". Return "
                       "asymcheck.lightning.ResumableLoader(loader) from train_dataloader(), or pass "
                       "AsymCheckCallback(inexact_data='warn') to train anyway")
            if self.inexact_data == "raise":
                raise UnresumableDataError(message)
            self._data_told.update(new)
            warnings.warn(message, InexactResumeWarning, stacklevel=2)
        held = {id(loader) for loader, _ in self._positioned}
        for loader in plain:
            if id(loader) not in held:
                self._positioned.append((loader, _install(loader)))

    def _positions(self) -> list[dict[str, Any]]:
        return [positioned.state_dict() for _, positioned in self._positioned]

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """The first batch after a step: the open version takes its small state (RNG, loop, loaders) now.

        Here, right before ``training_step``, whatever ran since the step (validation, the end of an
        epoch, a new pass over the loader and its draws) is done, and nothing of the next step has
        drawn yet. After a resume the RNG states of the version are set back first (Lightning's new
        loader iterator drew from them).
        """
        if self._resuming:
            self._resuming = False
            for loader in _loaders(trainer):
                loader.resumed()
            for _, positioned in self._positioned:
                positioned.resumed()
        self._run.rng.put_back()
        ckpt = self.checkpointer
        if ckpt is not None:
            ckpt.settle()  # DeepSpeed: a step the hooks deliver late counts before its version takes this state
        if ckpt is None or not self._run.due(ckpt.step):
            return  # not the first batch after a step (gradient accumulation)
        loops = {**self._loops.recorded, MARKED: True}  # the RNG states are those right before training_step
        found = trainer.train_dataloader
        if isinstance(found, ResumableLoader) and isinstance(loops.get("state_dict"), dict):
            # the loader's position now: at an epoch's end a new pass has started since the step
            loops["state_dict"] = {**loops["state_dict"], "combined_loader": [found.state_dict()]}
        if self._positioned:  # likewise: the pass and its batches trained now
            loops[DATA] = self._positions()
        self._loops.recorded = loops
        ckpt.mark()

    # -- every step --------------------------------------------------------

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """Seal the previous step's version: the closure's forward and backward copied it.

        Only under automatic optimization without a GradScaler (``sealing="closure"``); otherwise the
        optimizers' own step pre-hooks seal (see :data:`Sealing`).
        """
        ckpt = self.checkpointer
        if isinstance(ckpt, LightningCheckpointer) and ckpt.sealing == "closure":
            ckpt.before_step()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """After a batch that stepped: record the loop state and the loaders' positions; the monitored metric."""
        ckpt = self.checkpointer
        if ckpt is None:
            return
        if isinstance(ckpt, LightningCheckpointer):
            ckpt.batch_end()  # manual optimization: the training_step's steps are done, its version opens
        # DeepSpeed's adapter delivers engine.step() at the next forward: without this ckpt.step is one behind
        # here, the batch's loop state goes unrecorded and version 1 would hold an empty one (a resume from it
        # restarted the epoch at batch 0 with the step's parameters)
        ckpt.settle()
        if ckpt.step != self._recorded:  # an optimizer step ran in this batch
            self._recorded = ckpt.step
            for loader in _loaders(trainer):
                loader.batches = batch_idx + 1
            for _, positioned in self._positioned:
                positioned.position.batches = batch_idx + 1
            self._loops.recorded = trainer.fit_loop.state_dict()
            if self._positioned:
                self._loops.recorded[DATA] = self._positions()
        if not self._validated:  # a validation metric stays in callback_metrics: record it once, after validation
            self._log_monitor(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Record the monitored metric of a validation with the newest step's version."""
        if not trainer.sanity_checking and self.monitor is not None and self.monitor in trainer.callback_metrics:
            self._validated = True
            self._log_monitor(trainer)

    def _log_monitor(self, trainer: Trainer) -> None:
        if self.monitor is None or self.checkpointer is None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        number = float(value.item() if isinstance(value, torch.Tensor) else value)
        if math.isfinite(number):
            self.checkpointer.log_metrics({self.monitor: number})

    # -- fit ends ----------------------------------------------------------

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Commit the last step and close the store.

        Raises:
            CommitFailedError: the final version was not committed (unless ``on_error="log"``).
        """
        if self.checkpointer is not None:
            self.checkpointer.close()  # closing again (teardown) is a no-op

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Save what is consistent and close, never masking the exception."""
        ckpt = self.checkpointer
        if ckpt is not None:
            ckpt.__exit__(type(exception), exception, exception.__traceback__)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Give the plain train loader its sampler back; close the store if ``fit`` ended without ``on_fit_end``."""
        if stage == "fit":
            for loader, positioned in self._positioned:
                _uninstall(loader, positioned)
            self._positioned = []
        ckpt = self.checkpointer
        if ckpt is not None and stage == "fit":
            try:
                ckpt.close()
            except Exception as exc:
                logger.error("closing at teardown: %s", exc)


_DEPRECATED: dict[str, tuple[str, Any]] = {
    "AsymCheck": ("asymcheck.lightning.AsymCheckCallback", AsymCheckCallback),
    "TESTED": ('asymcheck.integrations.settings.TESTED["lightning"]', settings.TESTED["lightning"]),
}


def __getattr__(name: str) -> Any:
    """Names of earlier releases, with a DeprecationWarning (removed in the next release)."""
    if name in _DEPRECATED:
        new, obj = _DEPRECATED[name]
        warnings.warn(f"asymcheck.lightning.{name} is now {new}", DeprecationWarning, stacklevel=2)
        return obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
