"""asymcheck for the Hugging Face Trainer: a version every optimizer step, resumed without a ``checkpoint-N``.

Two lines::

    ckpt = asymcheck.hf.AsymCheckCallback("ckpt")                      # Trainer(..., callbacks=[ckpt]) too
    trainer.add_callback(ckpt)
    trainer.train(resume_from_checkpoint=ckpt.resume_from(trainer))    # None on a fresh start

A version holds the parameters and optimizer state as ``optimizer.step()`` left them, the LR
scheduler, the RNG states and the Trainer's ``TrainerState`` (strict JSON, nothing pickled). Why a
callback plus the Trainer's own ``resume_from_checkpoint`` (the resume directory and what it
holds), DDP under ``torchrun``, DeepSpeed, what is refused (a table of
:data:`asymcheck.integrations.settings.HF_TRAINER`) and the private names relied on:
docs/guides/hf-trainer.md. Importing this module imports transformers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from typing import Any, Unpack

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.training_args import ParallelMode

from asymcheck.checkpointer import Checkpointer
from asymcheck.errors import (
    InvalidOptionError,
    StateMismatchError,
    TrainerResumeError,
    UnsupportedTrainerConfigError,
)
from asymcheck.integrations import names, support
from asymcheck.integrations.attributes import RenamedAttribute, RetentionField
from asymcheck.integrations.callback import DeferredCheckpointer
from asymcheck.integrations.forward import TrainerCallbackOptions, forwarded_options, with_retention
from asymcheck.integrations.settings import HF_TRAINER, refusal
from asymcheck.options import CheckpointerOptions, PartitionOptions, RetentionOptions, renamed_location
from asymcheck.snapshot.hooks import HooksFactory, StepHooks
from asymcheck.state.encode import decode
from asymcheck.state.replicas import Replication
from asymcheck.state.trainstate import RENAMED, Stateful
from asymcheck.versions.storespec import StoreSpec
from asymstore import KeepBest, Manifest, NoCheckpointError
from asymstore.opener import open_store
from asymstore.protocols import CheckpointStore, CollectiveStore
from asymstore.runtime.loop import StoreLoop

logger = logging.getLogger(__name__)

__all__ = ["AsymCheckCallback", "BaseFingerprint", "TrainerResumeError", "TrainerStateful",
           "UnsupportedTrainerConfigError",
           "base_fingerprint", "check_trainer"]

STATE_NAME = names.HF_TRAINER_STATE  # the stateful name of the TrainerState in a version
SCHEDULER_NAME = names.HF_SCHEDULER
BASE_NAME = names.reserved("hf", "peft_base")  # a PEFT model's frozen-base fingerprint in a version
SCALER_NAME = names.reserved("hf", "scaler")  # fp16: the GradScaler Accelerate steps the optimizer through
_OLD_NAMES = {old: new for old, new in RENAMED.items() if new in (STATE_NAME, SCHEDULER_NAME)}  # earlier releases'
_EMPTY_SHARD = "asymcheck-no-weights.safetensors"
_EMPTY_WEIGHTS = "model.safetensors"  # a PEFT model: the Trainer loads this (no tensor) instead of adapters
_MISSING_KEYS = "There were missing keys in the checkpoint model loaded"  # the Trainer's warning for it
_SUMMARY_KEY = "train_runtime"  # only the summary that ends train() logs it


class TrainerStateful:
    """The Trainer's ``TrainerState`` as a stateful object of a version: the fields of ``trainer_state.json``.

    ``state_dict()`` returns them as the Trainer writes them (``dataclasses.asdict``, with the
    current ``TrainerControl`` state under ``stateful_callbacks`` as its own checkpoints do);
    after training ended, the summary entry of the log history (``train_runtime``...) is left
    out, so the version is the state at the end of the last step. ``load_state_dict`` only keeps
    the dict: the Trainer itself loads it, from the resume directory, before training starts.
    """

    def __init__(self) -> None:
        """Bind nothing yet (the Trainer makes its state at the start of ``train()``)."""
        self.state: TrainerState | None = None
        self.control: TrainerControl | None = None
        self.ended = False
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The TrainerState's fields as ``trainer_state.json`` holds them."""
        if self.state is None:
            raise TrainerResumeError("the TrainerState is captured only during trainer.train()")
        out = dataclasses.asdict(self.state)
        if self.control is not None:
            out.setdefault("stateful_callbacks", {})["TrainerControl"] = self.control.state()
        if self.ended:
            history = out.get("log_history", [])
            while history and _SUMMARY_KEY in history[-1]:
                history.pop()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep ``state`` (checked against the live TrainerState by the callback)."""
        self.loaded = dict(state)


def _is_peft(model: object) -> bool:
    """Whether ``model`` is a PEFT model (``peft.PeftModel`` and the Trainer's own test: a ``peft_config``)."""
    return model is not None and hasattr(model, "peft_config")


def base_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """A fingerprint of the frozen parameters of ``model`` (``requires_grad=False``): the base under the adapters.

    SHA-256 over each frozen parameter's name, dtype, shape and bytes, in ``named_parameters()``
    order (one pass over the frozen bytes).

    Returns:
        ``{"algorithm": "sha256", "digest": ..., "tensors": n, "bytes": b}`` (JSON).
    """
    digest = hashlib.sha256()
    count = size = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                continue
            data = p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            digest.update(f"{name}|{p.dtype}|{tuple(p.shape)}|".encode())
            digest.update(data.numpy().tobytes() if data.numel() else b"")
            count += 1
            size += data.numel()
    return {"algorithm": "sha256", "digest": digest.hexdigest(), "tensors": count, "bytes": size}


class BaseFingerprint:
    """A PEFT model's frozen-base fingerprint as a stateful object of a version (named ``hf.peft_base``).

    The fingerprint is computed once, when training begins (before a version is loaded into the
    model); every version carries it, and loading a version whose base differs raises
    :class:`~asymcheck.errors.StateMismatchError` instead of training adapters on another base.
    """

    def __init__(self, model: torch.nn.Module, live: Mapping[str, Any] | None = None) -> None:
        """Fingerprint the frozen parameters of ``model`` now (``live``: its fingerprint, computed already)."""
        self.live = dict(live) if live is not None else base_fingerprint(model)

    def state_dict(self) -> dict[str, Any]:
        """The fingerprint (JSON)."""
        return dict(self.live)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check a version's fingerprint against the live base.

        Raises:
            StateMismatchError: the base differs (or the version holds no fingerprint).
        """
        _check_base(state, self.live, "the version")


def _check_base(saved: Any, live: Mapping[str, Any], where: str) -> None:
    """Refuse a version whose frozen-base fingerprint ``saved`` is not ``live``.

    Raises:
        StateMismatchError: naming both fingerprints.
    """
    if not isinstance(saved, Mapping) or "digest" not in saved:
        raise StateMismatchError(f"{where} holds no fingerprint of a PEFT model's frozen base (written without "
                                 "PEFT?): the adapters would be put on a base nothing checked")
    if saved.get("algorithm") != live["algorithm"] or saved.get("digest") != live["digest"]:
        raise StateMismatchError(
            f"{where} was trained on another frozen base: its fingerprint is {saved.get('digest')} over "
            f"{saved.get('tensors')} tensors ({saved.get('bytes')} bytes), the model's is {live['digest']} over "
            f"{live['tensors']} tensors ({live['bytes']} bytes); load the base the adapters were trained on, "
            "or give the callback a fresh directory")


class _QuietEmptyLoad(logging.Filter):
    """Drops the Trainer's missing-keys warning while it loads the resume directory's empty weights (PEFT)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_MISSING_KEYS)


_TRAINER_LOGGER = "transformers.trainer"


def _drop_quiet(quiet: logging.Filter, directory: str | None) -> None:
    """Remove ``quiet`` from the Trainer's logger and the resume ``directory`` (every path, garbage collection too)."""
    logging.getLogger(_TRAINER_LOGGER).removeFilter(quiet)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def _is_deepspeed(args: TrainingArguments) -> bool:
    return args.deepspeed is not None or getattr(args, "deepspeed_plugin", None) is not None


def _replication(args: TrainingArguments) -> Replication:
    """``"replicated"`` when the Trainer trains under DDP (``parallel_mode``: a process per rank; no DeepSpeed, FSDP).

    The Trainer hands the callback the module inside its ``DistributedDataParallel``; the Checkpointer
    then writes the replicated state in slices (``CommitOptions(dedup=...)``), the replicas compared first.
    """
    ddp = (args.parallel_mode == ParallelMode.DISTRIBUTED and args.world_size > 1 and not _is_deepspeed(args)
           and not args.fsdp)
    return "replicated" if ddp else "detect"


def _fullgraph() -> bool:
    """Whether the Trainer compiles with ``fullgraph``.

    Its ``TorchDynamoPlugin`` reads ``ACCELERATE_DYNAMO_USE_FULLGRAPH``; the accelerator's shared
    state holds the plugin ``prepare`` compiles with.
    """
    from accelerate.state import AcceleratorState

    plugin = getattr(AcceleratorState(), "dynamo_plugin", None)
    return bool(getattr(plugin, "fullgraph", False))


def check_trainer(args: TrainingArguments, model: torch.nn.Module | None = None) -> None:
    """Refuse a Trainer configuration whose state the callback would not capture, or not resume, exactly.

    Args:
        args: the Trainer's ``TrainingArguments``.
        model: the model trained (a PEFT model: not under DeepSpeed).

    Raises:
        UnsupportedTrainerConfigError: naming every refused setting.
    """
    problems = support.version_problems("transformers", transformers.__version__)
    if args.fsdp:
        problems.append(refusal(HF_TRAINER, "fsdp").line(f"fsdp={args.fsdp!r}"))
    fp16_apart = args.fp16 and (_is_deepspeed(args) or getattr(args, "world_size", 1) > 1)
    for setting, on in (("fp16=True under DDP or DeepSpeed", fp16_apart),
                        ("auto_find_batch_size=True", args.auto_find_batch_size),
                        ("ignore_data_skip=True", args.ignore_data_skip),
                        ("accelerator_config.use_seedable_sampler=False",
                         getattr(getattr(args, "accelerator_config", None), "use_seedable_sampler", True) is False),
                        ("train_sampling_strategy='group_by_length'",
                         getattr(args, "train_sampling_strategy", None) == "group_by_length"),
                        ("torch_compile=True under DeepSpeed", args.torch_compile and _is_deepspeed(args))):
        if on:
            problems.append(refusal(HF_TRAINER, setting).line())
    if args.n_gpu > 1:
        problems.append(refusal(HF_TRAINER, "n_gpu").line(f"n_gpu={args.n_gpu}"))
    if _is_peft(model) and _is_deepspeed(args):
        problems.append(refusal(HF_TRAINER, "a PEFT model under DeepSpeed").line())
    support.require_supported(problems, UnsupportedTrainerConfigError,
                              "asymcheck.hf.AsymCheckCallback does not support")


async def _newest_manifest(store: CheckpointStore) -> Manifest | None:
    """The manifest of the newest version whose manifest reads (no tensor is read); None when there is none."""
    try:
        return await store.read_manifest()
    except NoCheckpointError:
        return None


def _stateful_names(meta: Mapping[str, Any]) -> dict[str, str]:
    """The names the callback's own objects have in a version's ``meta`` (an earlier release's, or today's)."""
    held = meta.get("stateful") if isinstance(meta.get("stateful"), dict) else {}
    assert isinstance(held, dict)
    return {new: old if old in held and new not in held else new for old, new in _OLD_NAMES.items()}


def _trainer_state_of(meta: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = _stateful_names(meta)[STATE_NAME]
    tree = meta.get("stateful", {}).get(name) if isinstance(meta.get("stateful"), dict) else None
    if not isinstance(tree, dict):
        raise TrainerResumeError(f"{where} holds no TrainerState: it was not written by asymcheck.hf.AsymCheckCallback")
    state = decode(tree, {})
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise TrainerResumeError(f"{where}: the TrainerState is malformed")
    return state


def _write_state(directory: str, state: Mapping[str, Any]) -> None:
    with open(os.path.join(directory, "trainer_state.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(state, indent=2, sort_keys=True, default=_plain) + "\n")  # as save_to_json writes it


def _plain(value: Any) -> Any:
    """NumPy scalars and arrays (a metric of ``compute_metrics``) as JSON numbers and lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _write_no_weights(directory: str, model: torch.nn.Module) -> None:
    """A sharded-weights index naming every key of ``model`` in one shard that holds no tensor.

    For a PEFT model an empty ``model.safetensors`` instead: the Trainer would load adapters from
    the directory when it finds an index, and loads the (empty) weights file with ``strict=False``.
    """
    from safetensors.torch import save_file

    if _is_peft(model):
        save_file({}, os.path.join(directory, _EMPTY_WEIGHTS), metadata={"format": "pt"})
        return
    save_file({}, os.path.join(directory, _EMPTY_SHARD), metadata={"format": "pt"})
    index = {"metadata": {"asymcheck": "the weights are read from the asymstore version, not from here"},
             "weight_map": dict.fromkeys(model.state_dict(), _EMPTY_SHARD)}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f)


class AsymCheckCallback(TrainerCallback):
    """A version of the Trainer's training state every ``every`` optimizer steps, resumed bit-exact.

    ::

        ckpt = AsymCheckCallback("ckpt")
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt])
        trainer.train(resume_from_checkpoint=ckpt.resume_from(trainer))

    What a version holds, when each part is taken and what is refused: the module docstring
    (:mod:`asymcheck.hf`) and docs/guides/hf-trainer.md. The Trainer's own ``save_steps``
    checkpoints go on beside the versions.

    Args:
        location: where the checkpoint lives: a directory, a list of tiers (fastest first) or an
            unopened store, as for :class:`asymcheck.Checkpointer` (under DDP, a directory is the
            multi-rank root: a shard per rank, global versions); under DeepSpeed, what
            :func:`asymcheck.deepspeed.attach` takes (a directory: the multi-rank root).
        every: take a version every ``every``-th optimizer step.
        keep_last: versions kept (when the store is built here); the same rule as
            ``retention=RetentionOptions(keep_last=...)`` (give it one way).
        stateful: further name -> object with ``state_dict``/``load_state_dict`` updated after the
            step (your own counters); the names ``hf.trainer_state``, ``hf.scheduler`` and their
            earlier ``trainer_state``, ``lr_scheduler`` are taken.
        metrics: give the metrics of each evaluation to the version of its step
            (``Checkpointer.log_metrics``, which ``keep_best`` reads).
        keep_best: also keep the best versions by an evaluation metric. An int ``k`` keeps the
            ``k`` best by the Trainer's own ``metric_for_best_model`` and ``greater_is_better``
            (``metric_for_best_model`` must be set); a :class:`~asymstore.KeepBest` names the
            metric (as the Trainer logs it, for example ``"eval_loss"``) and the mode itself.
        root_or_store: the former name of ``location``, deprecated (a ``DeprecationWarning``; goes
            in the next release).
        **options: the Checkpointer's typed option groups (:class:`asymcheck.options.CheckpointerOptions`),
            passed to :class:`asymcheck.Checkpointer` (or to ``deepspeed.attach()``):
            ``retention=RetentionOptions(keep_every=10)``, ``pacing=PacingOptions(max_overhead=None)``,
            ``commits=CommitOptions(host_slots=1)``... The flat keywords of earlier releases
            (``keep_every=10``) still work, with a ``DeprecationWarning``.

    Raises:
        ValueError: ``every``, ``keep_best`` or a ``stateful`` name is refused.
        InvalidOptionError: an option out of its range, a flat keyword beside its own group, or a
            retention rule given both as an argument and in ``retention=``.
        TypeError: a keyword that is no option.
    """

    def __init__(self, location: StoreSpec | None = None, *, every: int = 1, keep_last: int | None = 3,
                 stateful: Mapping[str, Stateful] | None = None, metrics: bool = True,
                 keep_best: KeepBest | int | None = None, root_or_store: StoreSpec | None = None,
                 **options: Unpack[TrainerCallbackOptions]) -> None:
        """Keep the options; the Checkpointer is made at ``on_train_begin``, when the optimizer exists."""
        where: StoreSpec = renamed_location(location, root_or_store, old="root_or_store", caller="AsymCheckCallback")
        taken = {STATE_NAME, SCHEDULER_NAME, BASE_NAME, SCALER_NAME, *_OLD_NAMES} & set(stateful or {})
        if taken:
            raise ValueError(f"stateful names {sorted(taken)} are the callback's own")
        if every < 1:
            raise ValueError("every must be >= 1")
        if isinstance(keep_best, bool) or not (keep_best is None or isinstance(keep_best, KeepBest)
                                               or (isinstance(keep_best, int) and keep_best >= 1)):
            raise ValueError(f"keep_best must be a KeepBest or an int >= 1, got {keep_best!r}")
        asked = options.get("partitions")
        self._partitioning = asked.partitioning if isinstance(asked, PartitionOptions) else options.get("partitioning")
        self.options = forwarded_options("AsymCheckCallback", options, keep_last=keep_last)
        """The Checkpointer's option groups (``keep_best`` is added when training begins)."""
        self.keep_best = keep_best
        if isinstance(keep_best, KeepBest):  # a rule given twice is refused here, not when training begins
            with_retention(self.retention, "AsymCheckCallback", keep_best=keep_best)
        self.location: StoreSpec = where
        self.every = every
        self.stateful = dict(stateful or {})
        self.metrics = metrics
        self._run: DeferredCheckpointer[Checkpointer] = DeferredCheckpointer()
        self.resumed_step: int | None = None
        """The version the current ``train()`` resumed from (None: a fresh start)."""
        self.final_versions: dict[str, list[int]] | None = None
        """The store's versions once the last ``train()`` ended."""
        self._trainer: Trainer | None = None
        self._expect: int | None = None  # the step resume_from() positioned the Trainer at
        self._resume_dir: str | None = None
        self._cleanup: weakref.finalize[Any, Any] | None = None
        self._quiet = _QuietEmptyLoad()  # this callback's own: removed when its resume directory goes
        self._fingerprint: tuple[weakref.ref[torch.nn.Module], dict[str, Any]] | None = None  # resume_from()'s
        self._holder = TrainerStateful()
        self._rng_at_epoch = False  # the held RNG states (self._run.rng) go back at the epoch's start
        self._names = {STATE_NAME: STATE_NAME, SCHEDULER_NAME: SCHEDULER_NAME}  # as the version to resume has them

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The Checkpointer of the current ``train()`` (a ``DeepSpeedCheckpointer`` under DeepSpeed)."""
        return self._run.checkpointer

    @property
    def retention(self) -> RetentionOptions:
        """The retention rules (``keep_best=k`` by the Trainer's metric is added when training begins)."""
        return self.options["retention"]

    keep_last = RetentionField[int | None]("keep_last")
    """Versions kept per tier (``retention.keep_last``)."""

    root_or_store = RenamedAttribute[StoreSpec]("location")
    """Deprecated: :attr:`location`."""

    # -- resume ----------------------------------------------------------

    def resume_from(self, trainer: Trainer) -> str | None:
        """Pick the newest version and return the directory to give ``trainer.train(resume_from_checkpoint=...)``.

        Call it right before each ``train()``; it also hands the callback the Trainer (for its
        DeepSpeed engine). The directory (see the module docstring) is temporary: the callback
        removes it when training begins. The version itself is loaded, and verified, at
        ``on_train_begin``.

        Returns:
            The resume directory, or None when the store holds no version (a fresh start).

        Raises:
            UnsupportedTrainerConfigError: the Trainer's configuration is refused (see :func:`check_trainer`).
            TrainerResumeError: the newest version was not written by this callback, or
                ``TrainingArguments.resume_from_checkpoint`` is set (``--resume_from_checkpoint`` of
                ``run_clm.py``): it would not be read once this method's directory replaces it.
            TrainerResumeError: the train dataset has no length (an ``IterableDataset``) and the
                newest version was taken after its first pass ended (the Trainer would skip batches of
                a fresh pass).
        """
        check_trainer(trainer.args, trainer.model)
        flag = getattr(trainer.args, "resume_from_checkpoint", None)
        if flag:  # the stock scripts' --resume_from_checkpoint: never silently ignored
            raise TrainerResumeError(
                f"TrainingArguments.resume_from_checkpoint={flag!r} (--resume_from_checkpoint) names a checkpoint of "
                "the Trainer's own, which trainer.train(resume_from_checkpoint=callback.resume_from(trainer)) does "
                "not read: the callback resumes from its own store, the newest version, without the flag. Drop "
                "--resume_from_checkpoint; nothing was written")
        self._trainer = trainer
        self._drop_resume_dir()
        self._expect = None
        self._fingerprint = None
        self._names = {STATE_NAME: STATE_NAME, SCHEDULER_NAME: SCHEDULER_NAME}
        if _is_deepspeed(trainer.args):
            return self._resume_dir_deepspeed(trainer)
        kept = self._retention(trainer.args)  # as the Checkpointer will open it
        store = open_store(self.location, keep_last=kept.keep_last, keep_every=kept.keep_every,
                           keep_best=kept.keep_best, across_layouts=self.options.get("across_layouts", "resume"))
        loop = StoreLoop(store, name="asymcheck-hf-peek")
        try:
            manifest = loop.run(_newest_manifest(store))
        finally:
            loop.close()
        if manifest is None:
            return None
        state = _trainer_state_of(manifest.meta, f"version {manifest.step}")
        _check_iterable_position(trainer.train_dataset, state, manifest.step)
        if not isinstance(trainer.model, torch.nn.Module):
            raise TrainerResumeError("the Trainer has no model")
        if _is_peft(trainer.model):  # before anything is written: adapters on another base are refused
            held = manifest.meta.get("stateful")
            saved = decode(held[BASE_NAME], {}) if isinstance(held, dict) and BASE_NAME in held else None
            live = base_fingerprint(trainer.model)  # once per train(): on_train_begin reuses it
            _check_base(saved, live, f"version {manifest.step}")
            self._fingerprint = (weakref.ref(trainer.model), live)
        directory = self._new_resume_dir()
        if _is_peft(trainer.model):  # the Trainer's warning that the empty weights file has no keys
            logging.getLogger(_TRAINER_LOGGER).addFilter(self._quiet)
        _write_state(directory, state)
        _write_no_weights(directory, trainer.model)
        self._expect = manifest.step
        logger.info("resuming from version %d (global step %d) through %s", manifest.step, state["global_step"],
                    directory)
        return directory

    def _retention(self, args: TrainingArguments) -> RetentionOptions:
        """The retention rules with ``keep_best`` (see :meth:`_keep_best`)."""
        return with_retention(self.retention, "AsymCheckCallback", keep_best=self._keep_best(args))

    def _keep_best(self, args: TrainingArguments) -> KeepBest | None:
        """The ``keep_best`` rule: as given, or ``k`` best by the Trainer's ``metric_for_best_model``.

        Raises:
            UnsupportedTrainerConfigError: ``keep_best=k`` without ``metric_for_best_model``.
        """
        if self.keep_best is None or isinstance(self.keep_best, KeepBest):
            return self.keep_best
        name = args.metric_for_best_model
        if not name:
            raise UnsupportedTrainerConfigError(
                f"keep_best={self.keep_best} takes its metric from TrainingArguments.metric_for_best_model, "
                "which is not set: set it, or pass keep_best=KeepBest(metric, mode, k)")
        metric = name if name.startswith("eval_") else f"eval_{name}"  # the Trainer's own rule
        greater = args.greater_is_better
        if greater is None:
            greater = not metric.endswith("loss")
        return KeepBest(metric, "max" if greater else "min", self.keep_best)

    def _deepspeed_root(self) -> str:
        """The multi-rank root under DeepSpeed (a directory)."""
        root = self.location
        if not isinstance(root, (str, os.PathLike)):
            raise UnsupportedTrainerConfigError("deepspeed: the callback takes a directory (the multi-rank root)")
        return os.fspath(root)

    def _resume_dir_deepspeed(self, trainer: Trainer) -> str | None:
        """The resume directory under DeepSpeed: the version's DeepSpeed files too (the Trainer loads them)."""
        from asymcheck.deepspeed.export import read_version, write_files
        from asymstore.multirank import globaldir, is_multirank

        root = self._deepspeed_root()
        if not is_multirank(root) or not globaldir.list_global_steps(os.path.join(root, globaldir.GLOBAL_DIR)):
            return None
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # asyncio.run: fine under a running loop (Jupyter)
            step, tag, shards = pool.submit(asyncio.run, read_version(root)).result()
        state = _trainer_state_of(shards[0].meta, f"global version {step}")
        self._names = _stateful_names(shards[0].meta)  # the DeepSpeed adapter loads the names the version has
        directory = self._new_resume_dir()
        write_files(shards, tag, directory)  # DeepSpeed's files of every rank, and `latest`
        os.makedirs(os.path.join(directory, f"global_step{state['global_step']}"), exist_ok=True)  # for its glob
        _write_state(directory, state)
        sched = shards[0].meta.get("stateful", {}).get(self._names[SCHEDULER_NAME])
        if sched is not None:
            torch.save(decode(sched, shards[0].tensors), os.path.join(directory, "scheduler.pt"))
        self._expect = step
        return directory

    def _new_resume_dir(self) -> str:
        directory = tempfile.mkdtemp(prefix="asymcheck-hf-resume-")
        self._resume_dir = directory
        # also if train() never runs (the callback collected): the directory and the log filter go
        self._cleanup = weakref.finalize(self, _drop_quiet, self._quiet, directory)
        return directory

    def _drop_resume_dir(self) -> None:
        _drop_quiet(self._quiet, None)
        if self._cleanup is not None:
            self._cleanup()
        self._resume_dir = self._cleanup = None

    # -- events ----------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Make the Checkpointer on the Trainer's model and optimizer; load the version resume_from() chose."""
        model = kwargs.get("model")
        check_trainer(args, model)
        self._run.stop_stale()  # the previous train() raised: commit what it sealed, seal nothing more
        expect, self._expect = self._expect, None
        self._drop_resume_dir()
        self._holder.state, self._holder.control, self._holder.ended = state, control, False
        self.resumed_step = None
        names = self._names if _is_deepspeed(args) else {STATE_NAME: STATE_NAME, SCHEDULER_NAME: SCHEDULER_NAME}
        stateful: dict[str, Stateful] = {names[STATE_NAME]: self._holder, **self.stateful}
        scheduler = kwargs.get("lr_scheduler")
        if scheduler is not None:
            stateful[names[SCHEDULER_NAME]] = scheduler
        scaler = getattr(kwargs.get("optimizer"), "scaler", None)  # AcceleratedOptimizer's: fp16 on a GPU
        if scaler is not None:  # its scale and growth tracker, as the step that the version is left them
            stateful[SCALER_NAME] = scaler
        held, self._fingerprint = self._fingerprint, None
        if _is_peft(model):
            assert isinstance(model, torch.nn.Module)
            live = held[1] if held is not None and held[0]() is model else None  # resume_from() computed it
            stateful[BASE_NAME] = BaseFingerprint(model, live)  # once per train(), before a version is loaded
        options: CheckpointerOptions = {**self.options, "retention": self._retention(args)}
        if _is_deepspeed(args):
            if self._trainer is None:
                raise TrainerResumeError("under deepspeed, call trainer.train(resume_from_checkpoint="
                                         "callback.resume_from(trainer)): it hands the callback the Trainer's engine")
            import asymcheck.deepspeed

            ckpt: Checkpointer = asymcheck.deepspeed.attach(self._trainer.model_wrapped, self._deepspeed_root(),
                                                            self.every, stateful=stateful, **options)
        else:
            optimizer = _torch_optimizer(kwargs.get("optimizer"))
            if not isinstance(model, torch.nn.Module):
                raise TrainerResumeError("the Trainer passed no model to on_train_begin")
            hooks = None
            if args.torch_compile and _fullgraph():  # a hook that breaks the graph would be an error
                hooks = self._step_hooks(optimizer, options)
            ckpt = Checkpointer(model, optimizer, self.location, stateful=stateful, every=self.every, hooks=hooks,
                                replication=_replication(args), **options)
        self._run.start(ckpt)
        try:
            self._begin(state, expect, kwargs.get("train_dataloader"), args)
        except BaseException:
            with contextlib.suppress(Exception):
                ckpt.close()  # nothing of this run was trained: nothing is sealed
            self._run.checkpointer = None
            raise

    def _begin(self, state: TrainerState, expect: int | None, loader: Any, args: TrainingArguments) -> None:
        ckpt = self.checkpointer
        assert ckpt is not None
        if expect is None:
            if state.global_step != 0:
                raise TrainerResumeError(
                    f"the Trainer resumed at global step {state.global_step} from a directory resume_from() did not "
                    "make (its own checkpoint-N?): the callback's versions would not continue it; resume through "
                    "resume_from(trainer), or give the callback a fresh directory")
            newest = _newest(ckpt)
            if newest is not None:
                raise TrainerResumeError(
                    f"the store already holds version {newest}: call trainer.train(resume_from_checkpoint="
                    "callback.resume_from(trainer)) to continue it, or give the callback a fresh directory")
            if ckpt.resume() is not None:  # nothing to load: it only records that the store was checked
                raise TrainerResumeError("the store gained a version while training began")
            return
        step = ckpt.resume()
        if step != expect:
            raise TrainerResumeError(
                f"resume_from() positioned the Trainer at version {expect}, but it no longer verifies and the store "
                f"fell back to {step}: nothing was trained; `python -m asymstore.fsck --repair` moves a damaged "
                "version aside")
        loaded = self._holder.loaded or {}
        if loaded.get("global_step") != state.global_step:
            raise TrainerResumeError(f"version {step} holds global step {loaded.get('global_step')}, the Trainer "
                                     f"started at {state.global_step}")
        self.resumed_step = step
        self._run.rng.hold()  # the version's RNG states, put back when the Trainer's are
        self._rng_at_epoch = _at_epoch_start(state.global_step, loader, args)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """End the last step's loop body (an epoch ended); put RNG states back when resuming at an epoch's start."""
        self._mark(state, control)
        if self._rng_at_epoch:
            self._run.rng.put_back()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        """End the last step's loop body; put RNG states back when resuming inside an epoch (the Trainer's point)."""
        self._run.rng.put_back()
        self._mark(state, control)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Give the evaluation's metrics to the version of the step (``keep_best`` reads them)."""
        metrics = kwargs.get("metrics")
        ckpt = self.checkpointer
        if self.metrics and ckpt is not None and isinstance(metrics, Mapping):
            ckpt.log_metrics({k: float(v) for k, v in metrics.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)})

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        """At the summary that ends ``train()``: commit the last version before the Trainer loads a best model."""
        if logs is not None and _SUMMARY_KEY in logs:
            self._finish(state, control)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Commit the last step and close the Checkpointer."""
        self._finish(state, control)

    # -- internals -------------------------------------------------------

    def _step_hooks(self, optimizer: torch.optim.Optimizer, options: CheckpointerOptions) -> HooksFactory:
        """The optimizer-step hooks only (``fullgraph=True``: no hook inside the compiled graph), copying at the step.

        Sets ``options["partitions"]`` to ``partitioning="step"`` (its other fields kept).

        Raises:
            InvalidOptionError: the callback was given a partitioning other than ``"step"``.
        """
        if self._partitioning is not None and self._partitioning != "step":
            raise InvalidOptionError(
                f"partitioning={self._partitioning!r} under torch_compile=True with fullgraph "
                "(ACCELERATE_DYNAMO_USE_FULLGRAPH): the forward and grad hooks that spread the copy over the next "
                "step would break the graph, which fullgraph forbids; use PartitionOptions(partitioning=\"step\") "
                "(the copy at the optimizer step) or leave it out")
        options["partitions"] = dataclasses.replace(options["partitions"], partitioning="step")
        return lambda driver: StepHooks(optimizer, driver)

    def _mark(self, state: TrainerState, control: TrainerControl) -> None:
        """The loop body of the newest step is over: the open version takes RNG, scheduler and TrainerState now."""
        ckpt = self.checkpointer
        if ckpt is not None and self._run.due(state.global_step):
            self._holder.state, self._holder.control = state, control  # as the Trainer passes them now
            ckpt.mark()

    def _finish(self, state: TrainerState, control: TrainerControl) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        self._holder.ended = True
        try:
            self._mark(state, control)  # an evaluation after the last step drew from the RNGs
            self._run.checkpointer = None
            ckpt.close()
        finally:
            self._run.checkpointer = None
            self.final_versions = ckpt.final_versions
            self._holder.state = self._holder.control = None
            self._drop_resume_dir()


def _check_iterable_position(dataset: Any, state: Mapping[str, Any], step: int) -> None:
    """Refuse to resume an iterable train dataset (no length) from a version taken after its first pass ended.

    Without a length the Trainer counts its whole ``max_steps`` as one epoch: resuming, it reads
    ``global_step`` batches from the start of a fresh pass and skips them, which is the trained
    position only while the first pass runs; a version taken after a pass ended (its TrainerState's
    ``epoch`` >= 1) would resume at the wrong sample.

    Raises:
        TrainerResumeError: naming the dataset, the version and the epoch.
    """
    iterable = isinstance(dataset, torch.utils.data.IterableDataset) or (
        dataset is not None and not hasattr(dataset, "__len__"))
    epoch = state.get("epoch")
    if iterable and isinstance(epoch, (int, float)) and epoch >= 1:
        raise TrainerResumeError(
            f"version {step} of an iterable train dataset ({type(dataset).__name__}, no length) was taken after its "
            f"first pass ended (epoch {epoch:.4g}): the Trainer resumes such a dataset by reading global_step batches "
            "from the start of a fresh pass, which is not where the run was once a pass ended; nothing was written. "
            "Give the Trainer a map-style dataset (datasets.Dataset), or start again in a fresh directory")


def _newest(ckpt: Checkpointer) -> int | None:
    """The newest version a resume would load (a multi-rank store: the newest global version)."""
    store = ckpt.store
    if isinstance(store, CollectiveStore):
        return max(store.global_steps(), default=None)
    return max((max(v) for v in ckpt.versions().values() if v), default=None)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (whose ``step`` calls its)."""
    from accelerate.optimizer import AcceleratedOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TrainerResumeError(f"the Trainer's optimizer is a {type(optimizer).__name__}, not a torch optimizer")
    return inner


def _at_epoch_start(global_step: int, loader: Any, args: TrainingArguments) -> bool:
    """Whether the Trainer resumes ``global_step`` at the start of an epoch (it skips no batch there).

    The Trainer's own arithmetic (``set_initial_training_values``, ``_init_training_state``):
    ``num_update_steps_per_epoch`` from the loader's length and gradient accumulation.
    """
    try:
        length = len(loader)
    except TypeError:
        return global_step == 0  # no length: one long "epoch" of max_steps
    ga = args.gradient_accumulation_steps
    per_epoch = max(length // ga + int(length % ga > 0), 1)
    return global_step % per_epoch == 0
