"""TorchTitan's checkpoint manager on the Checkpointer: a version every step, chosen in TorchTitan's own job config.

TorchTitan 0.3 builds the manager its job config names (``Trainer.Config.checkpoint`` takes any
``BaseCheckpointManager.Config``), so a config registry function of yours selects this one::

    config.checkpoint = AsymCheckManager.Config(enable=True, interval=1, folder="checkpoint")

:class:`AsymCheckManager` builds an :class:`asymcheck.Checkpointer` over the trainer's model and optimizer:
the state after step ``t`` is copied during the forward and backward of step ``t + 1`` (the asymmetric
snapshot) and committed in the background; ``save(step)`` takes the trainer's counters and schedulers;
``load()`` resumes the newest version that verifies, resharded on another number of ranks; with
``last_save_in_hf`` the last step is exported as Hugging Face safetensors (:func:`export_hf`).
Guide (what is captured, what is refused): docs/guides/torchtitan.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from asymcheck.checkpointer import Checkpointer
from asymcheck.errors import CheckpointerStateError, StateMismatchError, UnsupportedTorchTitanConfigError
from asymcheck.integrations import support
from asymcheck.integrations.names import reserved
from asymcheck.integrations.settings import TORCHTITAN, refusal
from asymcheck.options import PacingOptions, RetentionOptions
from asymcheck.state import loaders
from asymcheck.state.trainstate import Stateful
from asymstore import export as store_export
from asymstore.io.files import fsync_dir, fsync_file

try:  # the manager's base and its state names; TorchTitan is an optional dependency ([torchtitan] extra)
    from torchtitan.components.checkpointer import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        TRAIN_STATE,
        BaseCheckpointManager,
    )
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError("asymcheck.torchtitan needs torchtitan 0.3: pip install 'asymstore[torchtitan]'") from exc

logger = logging.getLogger(__name__)

__all__ = ["AsymCheckManager", "DataloaderState", "cuda_graphs", "export_hf", "unsupported_settings"]

FRAMEWORK = "torchtitan"
ExportDtype = Literal["float16", "bfloat16", "float32"]
_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


def cuda_graphs(trainer: Any) -> bool:
    """Whether ``trainer`` (the ``train_state`` TorchTitan hands the manager) replays its steps as CUDA graphs.

    TorchTitan wraps the forward and backward in a CUDA graph unless ``training.disable_cuda_graphs``, on
    NVIDIA CUDA only. A trainer without a TorchTitan ``config`` says nothing (False).
    """
    training = getattr(getattr(trainer, "config", None), "training", None)
    disabled = getattr(training, "disable_cuda_graphs", None)
    if not isinstance(disabled, bool) or disabled:
        return False
    return torch.cuda.is_available() and torch.version.hip is None


def unsupported_settings(config: Any, *, model_parts: list[torch.nn.Module], optimizers: Any, trainer: Any = None,
                         version: str | None = None) -> list[str]:
    """One line per setting of ``config`` (an :class:`AsymCheckManager.Config`) or of the trainer's parts refused.

    Args:
        config: the manager's config.
        model_parts: the trainer's model parts.
        optimizers: the trainer's ``OptimizersContainer`` (or one optimizer).
        trainer: the trainer (``states["train_state"]``), whose ``config.training`` says whether CUDA graphs run.
        version: the torchtitan version (default: the installed one).
    """
    if version is None:
        import torchtitan

        version = str(torchtitan.__version__)
    out = support.version_problems(FRAMEWORK, version)

    def refuse(setting: str, found: str | None = None) -> None:
        out.append(refusal(TORCHTITAN, setting).line(found))

    if len(model_parts) != 1:
        refuse("pipeline parallelism", f"{len(model_parts)} model parts")
    inner = list(getattr(optimizers, "optimizers", [optimizers]))
    if len(inner) != 1:
        refuse("several optimizers", f"{len(inner)} optimizers in the OptimizersContainer")
    if config.load_step != -1:
        refuse("checkpoint.load_step", f"checkpoint.load_step={config.load_step}")
    if config.initial_load_path:
        refuse("checkpoint.initial_load_path")
    if config.initial_load_in_hf:
        refuse("checkpoint.initial_load_in_hf")
    if config.create_seed_checkpoint:
        refuse("checkpoint.create_seed_checkpoint")
    if config.load_only:
        refuse("checkpoint.load_only")
    if OPTIMIZER in config.exclude_from_loading:
        refuse("checkpoint.exclude_from_loading=['optimizer']")
    if TRAIN_STATE in config.exclude_from_loading:
        refuse("checkpoint.exclude_from_loading=['train_state']")
    if cuda_graphs(trainer):
        refuse("training.disable_cuda_graphs=False")
    return out


class DataloaderState:
    """TorchTitan's data loader in a version: torchdata's own state, without TorchTitan's pickle.

    TorchTitan's ``ParallelAwareDataloader.state_dict`` pickles torchdata's state (``pickle.dumps``, and
    ``pickle.loads`` on load); a version holds it unpickled, as strict JSON and tensors, with the loader's
    generators (:mod:`asymcheck.state.loaders`) and the data-parallel rank and degree it was taken on. A
    loader of another kind goes through its own ``state_dict``.

    Args:
        loader: the trainer's data loader.
        load: whether a resume loads the position (False: ``checkpoint.exclude_from_loading`` names it).
    """

    def __init__(self, loader: Any, *, load: bool = True) -> None:
        """Keep the loader."""
        self.loader = loader
        self.load = load

    def _where(self) -> list[int] | None:
        rank, world = getattr(self.loader, "dp_rank", None), getattr(self.loader, "dp_world_size", None)
        return [rank, world] if isinstance(rank, int) and isinstance(world, int) else None

    def state_dict(self) -> dict[str, Any]:
        """The loader's position, and the data-parallel ``[rank, degree]`` it is of (or None)."""
        return {"dp": self._where(), "loader": loaders.state_dict(self.loader, own=False)}

    def check_state_dict(self, state: Any) -> None:
        """Refuse a position taken on another data-parallel rank or degree, unless it is not loaded.

        Raises:
            StateMismatchError: it does not fit this loader.
        """
        if not self.load:
            return
        if not isinstance(state, Mapping) or set(state) != {"dp", "loader"}:
            raise StateMismatchError(f"the data loader's state in the version is not a TorchTitan loader's: {state!r}"
                                     [:300])
        if state["dp"] != self._where():
            raise StateMismatchError(
                f"the version's data loader position was taken on data-parallel [rank, degree] {state['dp']}, this "
                f"loader is {self._where()}: TorchTitan cannot reshard a loader's position; resume with "
                "checkpoint.exclude_from_loading=['dataloader'] to start the data anew (the model, optimizer and "
                "schedulers are resharded)")
        loaders.check("the data loader", self.loader, state["loader"])

    def load_state_dict(self, state: Any) -> None:
        """Put the position back (nothing when the loader is excluded from loading)."""
        if self.load:
            loaders.load_state_dict(self.loader, state["loader"], own=False)


class _Excludable:
    """A stateful object whose state a resume skips when ``checkpoint.exclude_from_loading`` names it."""

    def __init__(self, obj: Stateful, *, load: bool) -> None:
        self.obj = obj
        self.load = load

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> None:
        if self.load:
            self.obj.load_state_dict(state)


class AsymCheckManager(BaseCheckpointManager):  # type: ignore[misc]  # torchtitan has no type information
    """TorchTitan checkpoint manager: the asymmetric snapshot of every ``interval``-th step into asymstore.

    The trainer builds it from ``config.checkpoint`` (an :class:`AsymCheckManager.Config`) with its model
    parts, optimizers, LR schedulers, data loader and ``states`` (``{"train_state": trainer}``). It makes
    an :class:`asymcheck.Checkpointer` over the model and the optimizer, rooted at
    ``<dump_folder>/<folder>`` (under several ranks each rank's shard there, a multi-rank root):

    - parameters and optimizer tensors (FSDP2/tensor-parallel DTensors as each rank's piece, with their
      layouts) are copied lazily during the next step's forward and backward and committed in the
      background (the hooks; ``maybe_wait_for_staging`` has nothing to wait for);
    - ``save(step)``, which the trainer calls after the LR scheduler's step, takes the trainer's
      ``step``/``ntokens_seen``, the LR schedulers and every other ``states`` object for that step's
      version (the trainer adds 1 to its step before the next batch);
    - the data loader's position and the RNG states are taken when the optimizer's step returns;
    - ``load()`` resumes the newest version that verifies (falling back past damaged ones), resharded
      when the number of ranks changed; ``close()`` commits the last step and waits for every commit,
      then exports it as Hugging Face safetensors when ``last_save_in_hf`` says so.

    Versions are numbered by optimizer steps, TorchTitan's ``step``. Retention is the store's
    (``keep_latest_k``): TorchTitan's ``step-N`` folders are not used.

    Raises:
        UnsupportedTorchTitanConfigError: a refused setting (:func:`unsupported_settings`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """TorchTitan's checkpoint policies, and the Checkpointer's own.

        Of ``BaseCheckpointManager.Config``: ``enable``, ``folder`` (the store's root, under the dump
        folder), ``interval`` (a version every ``interval`` steps), ``keep_latest_k`` (versions kept; 0:
        all), ``exclude_from_loading`` (``dataloader``, ``lr_scheduler`` and other ``states`` objects: their
        state is taken but not loaded), ``last_save_in_hf`` and ``export_dtype`` (the Hugging Face export of the
        last step) are used; ``last_save_model_only`` and ``enable_first_step_checkpoint`` change nothing
        (every version is a whole training state); the others are refused when set (docs/guides/torchtitan.md).
        """

        max_overhead: float | None = None
        """Step-time budget of checkpointing (``PacingOptions.max_overhead``); None: a version every interval."""

        hf_folder: str = "checkpoint_hf"
        """Where ``last_save_in_hf`` exports the last step (``step-N`` below it), relative to the dump folder."""

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        """Check the settings, then build the Checkpointer and hook the model and optimizer."""
        self.enable = bool(config.enable)
        self.save_future = None
        if not self.enable:
            return
        support.require_supported(unsupported_settings(config, model_parts=model_parts, optimizers=optimizers,
                                                       trainer=states.get(TRAIN_STATE)),
                                  UnsupportedTorchTitanConfigError,
                                  "asymcheck.torchtitan.AsymCheckManager does not capture this job correctly")
        if config.last_save_in_hf and sd_adapter is None:
            raise UnsupportedTorchTitanConfigError(
                "checkpoint.last_save_in_hf needs the model's state-dict adapter, and this model has none")
        self.config = config
        self.folder = os.path.join(base_folder, config.folder)
        self.hf_folder = os.path.join(base_folder, config.hf_folder)
        self.sd_adapter = sd_adapter
        excluded = set(config.exclude_from_loading)
        stateful: dict[str, Stateful] = {}
        for name, obj in states.items():
            stateful[reserved(FRAMEWORK, name)] = _Excludable(obj, load=name not in excluded)
        stateful[reserved(FRAMEWORK, LR_SCHEDULER)] = _Excludable(lr_schedulers, load=LR_SCHEDULER not in excluded)
        data: dict[str, Stateful] = {}
        if dataloader is not None:
            data[reserved(FRAMEWORK, DATALOADER)] = DataloaderState(dataloader, load=DATALOADER not in excluded)
        [optimizer] = list(getattr(optimizers, "optimizers", [optimizers]))
        self.checkpointer = Checkpointer(
            model_parts[0], optimizer, self.folder, stateful=stateful, data=data, every=config.interval,
            retention=RetentionOptions(keep_last=config.keep_latest_k or None),
            pacing=PacingOptions(max_overhead=config.max_overhead))
        self._last_step: int | None = None
        logger.info("asymcheck: a version every %d step(s) under %s (%s)", config.interval, self.folder, MODEL)

    # -- BaseCheckpointManager's hooks -------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        """Resume the newest version that verifies; False when the store holds none (a fresh start)."""
        if step != -1:  # the trainer passes checkpoint.load_step, refused unless -1
            raise UnsupportedTorchTitanConfigError(refusal(TORCHTITAN, "checkpoint.load_step").line(f"step={step}"))
        restored = self.checkpointer.resume()
        if restored is None:
            return False
        logger.info("asymcheck: resumed step %d", restored)
        return True

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Take the small state (train state, schedulers) of ``curr_step``'s version; True when it takes one.

        Raises:
            CheckpointerStateError: ``curr_step`` is not the number of optimizer steps the hooks counted.
        """
        if curr_step != self.checkpointer.step:
            raise CheckpointerStateError(
                f"TorchTitan saves step {curr_step} after {self.checkpointer.step} optimizer steps: the versions are "
                "numbered by optimizer steps (one optimizer step per TorchTitan step)")
        self.checkpointer.mark()
        if last_step:
            self._last_step = curr_step
        return bool(curr_step % self.config.interval == 0 or last_step)

    def _maybe_wait_for_staging(self) -> None:
        """Nothing: the optimizer's step pre-hook finishes the pending copy."""

    def _wait_for_saving(self) -> None:
        """Wait until every sealed version is committed (``save_future`` is never set)."""
        self.checkpointer.flush()

    def _close(self) -> None:
        """Commit the last step, wait for every commit, then export it to Hugging Face safetensors if asked."""
        self.checkpointer.close()
        if self._last_step is None or not self.config.last_save_in_hf:
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_rank() != 0:
            return
        out = os.path.join(self.hf_folder, f"step-{self._last_step}")
        summary = export_hf(self.folder, out, sd_adapter=self.sd_adapter, step=self._last_step,
                            dtype=self.config.export_dtype)
        logger.info("asymcheck: step %d exported to %s (%d tensors)", self._last_step, out, summary["tensors"])


def export_hf(location: str, out: str, *, sd_adapter: Any = None, step: int | None = None,
              dtype: ExportDtype | None = None) -> dict[str, Any]:
    """Export one verified version's model as a Hugging Face directory: ``model.safetensors`` and its index.

    The version (the newest that verifies, or ``step``) is exported by :func:`asymstore.export.export` (every
    chunk verified; an FSDP2 root consolidated); its tensors are then cast to ``dtype`` (floating ones) and
    renamed by ``sd_adapter.to_hf`` (TorchTitan's ``BaseStateDictAdapter``: Hugging Face's names and
    layouts), and written with ``model.safetensors.index.json`` into ``out``, which appears whole or not at
    all (an earlier ``out`` is replaced). Memory: the model, whole.

    Args:
        location: the store's root (a directory or a multi-rank root) or a tier location.
        out: the directory to write.
        sd_adapter: the model's state-dict adapter (None: TorchTitan's own names).
        step: the step to export (default: the newest that verifies).
        dtype: the floating-point dtype of the export (default: as stored).

    Returns:
        ``{"step", "tensors", "bytes", "out", "skipped"}``.

    Raises:
        NoCheckpointError, VersionNotFoundError, CorruptVersionError, ExportError: as
            :func:`asymstore.export.export`; nothing is written.
    """
    from safetensors.torch import load_file, save_file

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{os.path.abspath(out)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        native = os.path.join(tmp, "native.safetensors")
        summary = asyncio.run(store_export.export(location, "safetensors", native, step=step, prefix="model/"))
        tensors: dict[str, Any] = dict(load_file(native))
        os.unlink(native)
        if dtype is not None:
            want = _DTYPES[dtype]
            tensors = {k: v.to(want) if v.is_floating_point() else v for k, v in tensors.items()}
        if sd_adapter is not None:
            tensors = dict(sd_adapter.to_hf(tensors))
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, os.path.join(tmp, HF_WEIGHTS), metadata={"format": "pt"})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(tmp, HF_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict.fromkeys(sorted(tensors), HF_WEIGHTS)},
                      f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_file(os.path.join(tmp, HF_WEIGHTS))
        fsync_dir(tmp)
        old = f"{os.path.abspath(out)}.old-{os.getpid()}"
        if os.path.lexists(out):
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"step": summary["step"], "tensors": len(tensors), "bytes": total, "out": out,
            "skipped": summary["skipped"]}
