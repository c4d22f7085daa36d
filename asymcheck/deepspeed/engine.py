"""AsymCheckpointEngine: DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` through asymstore.

DeepSpeed hands every checkpoint file to ``checkpoint_engine`` (``create``, ``save`` per file,
``commit``) and writes ``latest`` itself, not atomically. This engine keeps each rank's files as one
shard of a multi-rank version under ``save_dir/asymstore`` (a
:class:`~asymstore.multirank.RankStore` opened by :func:`asymstore.open_store`); ``commit`` returns
on every rank once rank 0 published the global manifest, then writes JSON stubs at the files' paths
and replaces ``latest`` atomically. :func:`load_checkpoint` takes the tag from the global manifests,
never from ``latest``. Every rank must see ``save_dir``.

Guide: ``docs/guides/deepspeed.md`` (DeepSpeed's own save_checkpoint through asymstore).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Unpack

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from asymcheck.deepspeed.files import META_KEY, decode_file, encode_files, file_keys, write_stubs
from asymcheck.deepspeed.support import check_engine
from asymcheck.deepspeed.types import register_deepspeed_types
from asymcheck.errors import NotInStoreError
from asymstore.io.files import atomic_write
from asymstore.multirank import GlobalManifest, RankStore, WorldSizeMismatchError
from asymstore.opener import OpenOptions, open_store
from asymstore.runtime.loop import StoreLoop
from asymstore.values import Checkpoint

logger = logging.getLogger(__name__)

STORE_DIR = "asymstore"
FORMAT = 1
_EMPTY = "ds/.empty"  # a rank that saved no file still commits a shard (every rank takes part)


@dataclass
class _Save:
    save_dir: str
    tag: str
    step: int
    trees: dict[str, Any] = field(default_factory=dict)


class AsymCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """A DeepSpeed ``CheckpointEngine`` whose checkpoints are multi-rank asymstore versions.

    Install it after ``deepspeed.initialize`` with :func:`install` (or set
    ``engine.checkpoint_engine`` yourself), then call ``save_checkpoint`` and
    ``load_checkpoint`` as usual; prefer :func:`load_checkpoint` for loading.

    Args:
        engine: the DeepSpeed engine (its ``global_steps`` numbers the versions); optional.
        keep_last: global versions kept per checkpoint directory; None (default) keeps all.
        timeout_s: how long a commit waits for every rank.
        **store_kwargs: options of each :class:`asymstore.multirank.RankStore`
            (:class:`asymstore.opener.OpenOptions`; ``wait_global`` is always True here).
    """

    def __init__(self, engine: Any = None, *, keep_last: int | None = None, timeout_s: float = 300.0,
                 **store_kwargs: Unpack[OpenOptions]) -> None:
        """Create the engine; stores open lazily, one per checkpoint directory."""
        super().__init__(None)
        register_deepspeed_types()
        self.name = "AsymCheckpointEngine"
        self.engine = engine
        self.keep_last = keep_last
        self.timeout_s = timeout_s
        self.store_kwargs = store_kwargs
        self._loops: dict[str, StoreLoop[RankStore]] = {}
        self._current: _Save | None = None
        self._shards: dict[tuple[str, int, int], Checkpoint] = {}

    # -- stores ----------------------------------------------------------

    def loop(self, save_dir: str) -> StoreLoop[RankStore]:
        """The store loop of checkpoint directory ``save_dir`` (opened on first use)."""
        key = os.path.abspath(save_dir)
        loop = self._loops.get(key)
        if loop is None:
            options: OpenOptions = {**self.store_kwargs, "wait_global": True}  # commit returns once published
            store = open_store(os.path.join(key, STORE_DIR), keep_last=self.keep_last, timeout_s=self.timeout_s,
                               multirank=True, **options)
            assert isinstance(store, RankStore), "multirank=True opens a directory as a RankStore"
            loop = self._loops[key] = StoreLoop(store, name="asymcheck-store")
        return loop

    def store(self, save_dir: str) -> RankStore:
        """The multi-rank store of ``save_dir`` (opened on first use)."""
        return self.loop(save_dir).store

    def close(self) -> None:
        """Close every store (call once training is done)."""
        for loop in self._loops.values():
            loop.close()
        self._loops.clear()
        self._shards.clear()

    # -- saving ----------------------------------------------------------

    def create(self, info: Any) -> None:
        """Agree with every rank on the step of the new version (collective)."""
        loop = self.loop(info.save_dir)
        hint = int(getattr(self.engine, "global_steps", 0) or 0)
        step = loop.run(self.store(info.save_dir).agree_step(hint))
        self._current = _Save(os.path.abspath(info.save_dir), str(info.tag), step)
        self._shards.clear()
        logger.debug("checkpoint %s of %s is version %d", info.tag, info.save_dir, step)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Create the directory (it receives the stubs)."""
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Stage one file of this rank's shard (its tensors are copied before this returns)."""
        cur = self._current
        if cur is None:
            raise RuntimeError("AsymCheckpointEngine.save before create")
        key = os.path.relpath(os.path.abspath(path), cur.save_dir)
        if key.startswith(".."):
            raise ValueError(f"{path} is outside the checkpoint directory {cur.save_dir}")
        tensors: dict[str, torch.Tensor] = {}
        cur.trees.update(encode_files({key: state_dict}, tensors))
        self.loop(cur.save_dir).run(self.store(cur.save_dir).put_many(cur.step, tensors))

    def commit(self, info: Any) -> bool:
        """Commit this rank's shard; return once the global version is published (collective)."""
        cur, self._current = self._current, None
        if cur is None:
            raise RuntimeError("AsymCheckpointEngine.commit before create")
        store = self.store(cur.save_dir)
        loop = self.loop(cur.save_dir)
        if not cur.trees:
            loop.run(store.put_many(cur.step, {_EMPTY: torch.zeros(0)}))
        meta = {"asymcheck": {"format": FORMAT, "kind": "deepspeed-engine"},
                META_KEY: {"tag": cur.tag, "files": cur.trees}}
        keys = sorted(cur.trees)
        loop.run(store.commit(cur.step, meta, summary={"files": keys}, global_meta={"tag": cur.tag}))
        write_stubs(cur.save_dir, keys, {"tag": cur.tag, "version": cur.step})
        if store.is_coordinator and getattr(info, "save_latest", False):
            atomic_write(os.path.join(cur.save_dir, "latest"), cur.tag.encode())
        logger.info("rank %d: checkpoint %s committed as global version %d", store.rank, cur.tag, cur.step)
        return True

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed passes live tensors without cloning them; ``save`` copies them."""
        return False

    # -- loading ---------------------------------------------------------

    def _find(self, save_dir: str, key: str) -> GlobalManifest:
        store = self.store(save_dir)
        for step in reversed(store.global_steps()):
            g = store.read_global(step)
            if any(key in s.summary.get("files", []) for s in g.shards):
                if g.world_size != store.world_size:
                    raise WorldSizeMismatchError(
                        f"{key} was saved by {g.world_size} rank(s); this job has {store.world_size} "
                        "(DeepSpeed versions are not resharded)")
                return g
        raise NotInStoreError(f"{key} is in no global version under {os.path.join(save_dir, STORE_DIR)}")

    def load(self, path: str, map_location: Any = None) -> Any:
        """Return the state dict DeepSpeed saved at ``path`` (tensors on the CPU, verified)."""
        save_dir = _checkpoint_dir(path)
        key = os.path.relpath(os.path.abspath(path), save_dir)
        g = self._find(save_dir, key)
        shard = next(s for s in g.shards if key in s.summary.get("files", []))
        cache = (save_dir, shard.rank, shard.step)
        ckpt = self._shards.get(cache)
        if ckpt is None:
            ckpt = self.loop(save_dir).run(self.store(save_dir).read_shard(shard.rank, shard.step))
            self._shards = {k: v for k, v in self._shards.items() if k[0] == save_dir and k[2] == shard.step}
            self._shards[cache] = ckpt
        return decode_file(ckpt.meta, ckpt.tensors, key)

    def newest_tag(self, save_dir: str) -> str | None:
        """The tag of the newest global version under ``save_dir`` (None when there is none)."""
        store = self.store(save_dir)
        newest = store.newest_global()
        return None if newest is None else str(newest.meta.get("tag"))

    def ensure_stubs(self, save_dir: str, tag: str) -> None:
        """Write the stubs of ``tag``'s files if missing (a crash after the global commit)."""
        store = self.store(save_dir)
        for step in reversed(store.global_steps()):
            g = store.read_global(step)
            if g.meta.get("tag") == tag:
                keys = [k for s in g.shards for k in s.summary.get("files", [])]
                missing = [k for k in keys if not os.path.exists(os.path.join(save_dir, k))]
                write_stubs(os.path.abspath(save_dir), missing, {"tag": tag, "version": step})
                return


def _checkpoint_dir(path: str) -> str:
    """The checkpoint directory holding ``path``: the nearest ancestor with an asymstore store."""
    d = os.path.dirname(os.path.abspath(path))
    for _ in range(3):
        if os.path.isdir(os.path.join(d, STORE_DIR)):
            return d
        d = os.path.dirname(d)
    raise NotInStoreError(f"{path}: no {STORE_DIR}/ directory above it; not saved by AsymCheckpointEngine")


def install(engine: Any, **kwargs: Any) -> AsymCheckpointEngine:
    """Make ``engine.save_checkpoint`` / ``load_checkpoint`` go through asymstore; return the new engine.

    Call after ``deepspeed.initialize``. ``kwargs`` go to :class:`AsymCheckpointEngine`.

    Raises:
        UnsupportedConfigError: the engine uses a setting the tests do not exercise with this
            checkpoint engine (offload, MoE, pipeline or model parallelism, ZeRO++ hpZ; see
            :mod:`asymcheck.deepspeed.support`) or an untested DeepSpeed version.
    """
    check_engine(engine, "install")
    ce = AsymCheckpointEngine(engine, **kwargs)
    engine.checkpoint_engine = ce
    return ce


def load_checkpoint(engine: Any, load_dir: str, tag: str | None = None, **kwargs: Any) -> tuple[Any, Any]:
    """``engine.load_checkpoint`` with the tag taken from asymstore's global manifests (collective).

    Without ``tag``, every rank agrees on the newest global version that every
    rank can load and verify (a damaged newest one falls back to the one
    before); DeepSpeed's own ``latest`` file is not read.

    Returns:
        What ``engine.load_checkpoint`` returns: ``(load_path, client_state)``,
        or ``(None, None)`` when the directory holds no version.
    """
    ce = engine.checkpoint_engine
    if not isinstance(ce, AsymCheckpointEngine):
        raise TypeError("load_checkpoint needs AsymCheckpointEngine installed (asymcheck.deepspeed.install)")
    store = ce.store(load_dir)
    loop = ce.loop(load_dir)
    step = None
    if tag is not None:
        step = next((s for s in reversed(store.global_steps()) if store.read_global(s).meta.get("tag") == tag), None)
        if step is None:
            raise NotInStoreError(f"no version tagged {tag!r} under {os.path.join(load_dir, STORE_DIR)}")
    from asymstore import NoCheckpointError

    try:
        ckpt = loop.run(store.restore(step))
    except NoCheckpointError:
        logger.warning("no checkpoint in %s", load_dir)
        return None, None
    g = store.restored_global
    assert g is not None
    tag = str(g.meta.get("tag"))
    ce._shards[(os.path.abspath(load_dir), store.rank, ckpt.step)] = ckpt
    ce.ensure_stubs(load_dir, tag)
    return engine.load_checkpoint(load_dir, tag=tag, **kwargs)  # type: ignore[no-any-return]


__all__ = ["AsymCheckpointEngine", "file_keys", "install", "load_checkpoint"]
