"""The state of a DeepSpeed engine at one step: the files its ``save_checkpoint`` would write, captured lazily.

A version holds, per rank, the state dicts DeepSpeed's own ``save_checkpoint`` builds (built by the
engine's own code with a capturing checkpoint engine swapped in, so every ZeRO stage and precision is
described DeepSpeed's way), RNG states, the user's stateful objects and this rank's own module
buffers; restoring goes through ``load_checkpoint``. Tensors only the optimizer step changes are
copied in partitions during the next iteration, the rest at once. Private engine names used (nothing
patched, no collective): ``_save_checkpoint``, ``_get_ckpt_name``, ``_get_zero_ckpt_name``,
``save_zero_checkpoint``, ``save_non_zero_checkpoint``, ``micro_steps``.

Below ZeRO-3 the model states file (``mp_rank_00_model_states.pt``: the module's parameters, at stage 0
the optimizer's state too) is the same on every data-parallel rank, and DeepSpeed writes it from rank 0
only. When the job slices replicated state (:class:`asymcheck.state.replicas.ReplicatedState`,
``CommitOptions(dedup="replicas")`` on a shared root of several ranks), every rank captures that file and
writes only its balanced slice of its lazily copied tensors (:meth:`DeepSpeedState.replicated`); the
replicas are compared by digest first, and a job whose replicas differ writes the whole file on every
rank (each rank then loads its own). The ZeRO partitions stay per rank.

Guide: ``docs/guides/deepspeed.md`` (What a version holds; Private DeepSpeed names).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import deepspeed
import torch

from asymcheck.deepspeed.files import (
    META_KEY,
    CapturingEngine,
    ServingEngine,
    decode_file,
    encode_files,
    file_keys,
    write_stubs,
)
from asymcheck.deepspeed.hooks import inner_optimizer
from asymcheck.deepspeed.types import register_deepspeed_types
from asymcheck.errors import StateMismatchError, UnsupportedStateError
from asymcheck.state import loaders, rng
from asymcheck.state.encode import decode, encode
from asymcheck.state.trainstate import Capture, Moment, Stateful, TrainingState, check_states
from asymstore.errors import AsymstoreError
from asymstore.format.tensors import host_copy
from asymstore.protocols import CollectiveStore
from asymstore.values import Checkpoint

logger = logging.getLogger(__name__)

FORMAT = 1
KIND = "deepspeed-attach"
TAG = "asymcheck"
BUFFERS = "buffers/"  # this rank's module buffers (BatchNorm statistics differ per rank)
_BASE = "/asymcheck-capture"  # saved paths are only ever made relative to this; nothing is written there

T = TypeVar("T")
Runner = Callable[[Coroutine[Any, Any, Any]], Any]


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


class DeepSpeedState(TrainingState):
    """What one version of a DeepSpeed engine holds, and how it goes back in.

    Args:
        engine: the DeepSpeed engine.
        store: the rank store (other ranks' files are read from it on restore; capture needs none).
        run: runs a store coroutine on the store's loop and returns its result (with ``store``).
        stateful: name -> object with ``state_dict``/``load_state_dict`` (data position, sampler).
    """

    def __init__(self, engine: Any, store: CollectiveStore | None = None, run: Runner | None = None,
                 stateful: Mapping[str, Stateful] | None = None, data: Mapping[str, Stateful] | None = None) -> None:
        """Keep references to the live objects."""
        if getattr(engine, "has_moe_layers", False):
            raise UnsupportedStateError("attach() does not support MoE engines yet")
        super().__init__(engine.module, inner_optimizer(engine), stateful, data)
        register_deepspeed_types()
        self.engine = engine
        self.store = store
        self.run = run
        self.model_file = os.path.relpath(engine._get_ckpt_name(_BASE, TAG), _BASE)
        """The key of the model states file (``<tag>/mp_rank_00_model_states.pt`` below ZeRO-3)."""
        self.slicing = False
        """Every rank captures the model states file (the job slices it; see :meth:`slice_replicas`)."""

    def replicated(self, name: str) -> bool:
        """Whether captured tensor ``name`` is the same on every rank: the model states file's, below ZeRO-3."""
        return (not self.engine.zero_optimization_partition_weights()
                and name.startswith(f"ds/{self.model_file}/"))

    def slice_replicas(self, enabled: bool) -> None:
        """Capture the model states file on every rank (``enabled``), not on data-parallel rank 0 only."""
        self.slicing = enabled and not self.engine.zero_optimization_partition_weights()

    def signature(self) -> tuple[int, ...]:
        """Identities of the model's parameters and buffers (ZeRO keeps them across steps)."""
        return (*(id(p) for p in self.model.parameters()), -1, *(id(b) for b in self.model.buffers()))

    def _lazy_storages(self) -> set[int]:
        """Storages that only the optimizer step writes: parameters, ZeRO-3 partitions, masters, moments."""
        out: set[int] = set()
        for p in self.model.parameters():
            out.add(_storage(p))
            ds = getattr(p, "ds_tensor", None)
            if isinstance(ds, torch.Tensor):
                out.add(_storage(ds))
        for key, state in self.optimizer.state.items():
            if isinstance(key, torch.Tensor):
                out.add(_storage(key))
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    out.add(_storage(value))
        for group in self.optimizer.param_groups:
            out |= {_storage(p) for p in group["params"]}
        out.discard(0)
        return out

    def capture_files(self) -> dict[str, Any]:
        """Build the state dicts ``save_checkpoint`` would write for this rank (live tensors, by reference)."""
        engine = self.engine
        capture = CapturingEngine(_BASE)
        saved_engine, engine.checkpoint_engine = engine.checkpoint_engine, capture
        writer = engine.save_non_zero_checkpoint
        try:
            if self.slicing:  # every rank holds the replicated file: each writes its slice (or, fallen back, all)
                engine.save_non_zero_checkpoint = True
            engine._save_checkpoint(_BASE, TAG, client_state={})
            if engine.save_zero_checkpoint:
                name = engine._get_zero_ckpt_name(_BASE, TAG)
                capture.save({"optimizer_state_dict": engine.optimizer.state_dict(), "ds_config": engine.config,
                              "ds_version": deepspeed.__version__}, name)
        finally:
            engine.checkpoint_engine = saved_engine
            engine.save_non_zero_checkpoint = writer
        if engine.zero_optimization_partition_weights():
            self._as_partitioned(capture.saved)
        return capture.saved

    def _as_partitioned(self, files: dict[str, Any]) -> None:
        """ZeRO-3: describe every partitioned parameter as ``save_checkpoint`` does after its prologue.

        ``save_checkpoint`` first releases every gathered parameter (the small
        persistent ones too, gathered again afterwards: a collective), so its
        model states hold empty tensors for them. Here nothing is released: the
        persistent parameters' entries are replaced by the same empty tensors
        (their values are in the fp32 partitions, and the load gathers them).
        """
        partitioned = {name: p for name, p in self.model.named_parameters(remove_duplicate=False)  # tied: every name
                       if hasattr(p, "ds_id")}
        for sd in files.values():
            module = sd.get("module") if isinstance(sd, dict) else None
            if not isinstance(module, dict):
                continue
            for key, p in partitioned.items():
                value = module.get(key)
                if isinstance(value, torch.Tensor) and value.numel():
                    module[key] = torch.empty(0, dtype=p.dtype, device=p.device)

    def capture_step(self, moment: Moment | None = None) -> Capture:
        """Capture the engine's files (called once ``engine.step()`` is complete) and ``moment`` (default: now)."""
        cap = Capture(signature=self.signature())
        tensors: dict[str, torch.Tensor] = {}
        trees = encode_files(self.capture_files(), tensors)
        lazy = self._lazy_storages()
        eager: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if t.numel() and _storage(t) in lazy:
                cap.names.append(name)
                cap.sources.append(t.detach())
            else:
                eager[name] = t
        for name, t in eager.items():
            cap.eager[name] = host_copy(t)
        for name, b in self.model.named_buffers():  # this rank's own: DeepSpeed saves rank 0's module only
            cap.eager[f"{BUFFERS}{name}"] = host_copy(b)
        cap.meta = {
            "asymcheck": {"format": FORMAT, "kind": KIND},
            META_KEY: {"tag": TAG, "files": trees,
                       "engine": {"micro_steps": int(self.engine.micro_steps),
                                  "global_steps": int(self.engine.global_steps)}},
        }
        (moment or self.capture_moment()).apply(cap)
        return cap

    def capture_next(self, cap: Capture) -> None:
        """Capture the ``stateful`` objects (after the loop's own bookkeeping of the step)."""
        eager: dict[str, torch.Tensor] = {}
        cap.meta["stateful"] = {name: encode(loaders.state_dict(obj), f"stateful/{name}", eager)
                                for name, obj in self.stateful.items()}
        for name, t in eager.items():
            cap.eager[name] = host_copy(t)

    def capture_all(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Capture everything now, synchronously."""
        cap = self.capture_step()
        self.capture_next(cap)
        tensors = dict(cap.eager)
        for name, src in zip(cap.names, cap.sources, strict=True):
            tensors[name] = host_copy(src)
        return tensors, cap.meta

    def layout_meta(self, tensors: Mapping[str, torch.Tensor], cap: Capture) -> dict[str, Any] | None:
        """The slices of the replicated model states file, if this version holds them; else None.

        ZeRO's flat partitions are not described as pieces of global tensors (so a version of
        DeepSpeed is never resharded to another number of ranks).
        """
        return super().layout_meta(tensors, cap) if cap.layouts else None

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Load a version into the engine through its own ``load_checkpoint`` (collective), then RNG and stateful.

        Raises:
            StateMismatchError: not a version of ``attach()``, or the stateful objects differ.
        """
        self.touched = False
        info = meta.get("asymcheck")
        if not isinstance(info, dict) or info.get("format") != FORMAT or info.get("kind") != KIND:
            raise StateMismatchError(f"not a DeepSpeed attach() version: {info!r}")
        stateful = meta.get("stateful", {})
        if set(stateful) != set(self.stateful):
            raise StateMismatchError(f"stateful objects differ: checkpoint has {sorted(stateful)}, "
                                     f"live {sorted(self.stateful)}")
        data = meta.get("data", {})
        if set(data) != set(self.data):
            raise StateMismatchError(f"data objects differ: checkpoint has {sorted(data)}, live {sorted(self.data)}")
        states = {name: decode(tree, tensors) for name, tree in stateful.items()}
        datas = {name: decode(tree, tensors) for name, tree in data.items()}
        check_states("stateful", self.stateful, states)
        check_states("data", self.data, datas)
        fetch = self._fetcher(tensors, meta)
        self.touched = True
        base = tempfile.mkdtemp(prefix="asymcheck-ds-load-")
        engine = self.engine
        saved_engine = engine.checkpoint_engine
        try:
            write_stubs(base, fetch.keys, {"tag": TAG})
            engine.checkpoint_engine = ServingEngine(base, fetch)
            path, _ = engine.load_checkpoint(base, tag=TAG, load_module_strict=True, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
            if path is None:
                raise StateMismatchError("DeepSpeed's load_checkpoint loaded nothing")
        finally:
            engine.checkpoint_engine = saved_engine
            shutil.rmtree(base, ignore_errors=True)
        engine.micro_steps = int(meta[META_KEY]["engine"]["micro_steps"])
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                own = tensors.get(f"{BUFFERS}{name}")
                if own is not None:
                    b.copy_(own)
        for name, state in states.items():
            loaders.load_state_dict(self.stateful[name], state)
        for name, state in datas.items():
            loaders.load_state_dict(self.data[name], state)
        rng.restore(meta["rng"], tensors)

    def _fetcher(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> _Fetcher:
        store, run = self.store, self.run
        g = store.restored_global if store is not None else None
        if store is None or run is None or g is None:
            raise StateMismatchError("load() needs the RankStore, after its restore()")
        own = file_keys(meta)
        others: dict[str, tuple[int, int]] = {}
        unreadable: list[str] = []
        for shard in g.shards:
            if shard.rank != store.rank:
                try:
                    manifest = run(store.read_shard_manifest(shard.rank, shard.step))
                except AsymstoreError as exc:  # e.g. a lost node's disk: its files are only needed if asked for
                    unreadable.append(f"rank {shard.rank}: {exc}")
                    continue
                for key in file_keys(manifest.meta):
                    others.setdefault(key, (shard.rank, shard.step))
        return _Fetcher(self, tensors, meta, own, others, unreadable)


class _Fetcher:
    """key -> state dict: own files from the restored shard, others from their rank's shard (read once)."""

    def __init__(self, state: DeepSpeedState, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                 own: list[str], others: dict[str, tuple[int, int]], unreadable: list[str]) -> None:
        self.state = state
        self.unreadable = unreadable
        self.tensors = tensors
        self.meta = meta
        self.own = set(own)
        self.others = others
        self.keys = sorted(self.own | set(others))
        self._read: dict[tuple[int, int], Checkpoint] = {}

    def __call__(self, key: str) -> Any:
        key = os.path.normpath(key)
        if key in self.own:
            return decode_file(self.meta, self.tensors, key)
        where = self.others.get(key)
        if where is None:
            raise StateMismatchError(f"DeepSpeed asked for {key}, which no readable rank's shard holds"
                                     + (f" (unreadable: {'; '.join(self.unreadable)})" if self.unreadable else ""))
        ckpt = self._read.get(where)
        if ckpt is None:
            store, run = self.state.store, self.state.run
            assert store is not None and run is not None
            ckpt = self._read[where] = run(store.read_shard(*where))
        return decode_file(ckpt.meta, ckpt.tensors, key)
