"""Write a DeepSpeed version out as the checkpoint directory DeepSpeed's own ``save_checkpoint`` would have made.

Usage::

    python -m asymcheck.deepspeed.export ROOT OUT [--step N]

Every rank's shard of the global version (the newest whose shards all verify, or ``--step``) is
verified, then written as DeepSpeed's files (``torch.save``, DeepSpeed's format; the store never
pickles) plus ``latest``, so ``engine.load_checkpoint``, ``zero_to_fp32`` and ``ds_to_universal`` take
it from there. ``ROOT`` is ``attach()``'s directory or ``install()``'s checkpoint directory; file names
come from the manifests and must stay inside ``OUT``.

Guide: ``docs/guides/deepspeed.md`` (Resuming on another number of ranks).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from asymcheck.deepspeed.files import META_KEY, decode_file, file_keys
from asymcheck.deepspeed.types import register_deepspeed_types
from asymcheck.errors import DeepSpeedExportError
from asymstore import AsymstoreError, CorruptVersionError
from asymstore.format.globalmanifest import shard_digest
from asymstore.format.pieces import LAYOUT_KEY, TensorLayout, parse_layout_meta
from asymstore.multirank import globaldir
from asymstore.opener import open_store
from asymstore.tiers.location import rank_tier
from asymstore.values import Checkpoint

logger = logging.getLogger(__name__)

STORE_DIR = "asymstore"  # where install()'s AsymCheckpointEngine keeps its store under the checkpoint directory




def find_root(location: str) -> str:
    """The multi-rank root under ``location`` (itself, or its ``asymstore/``)."""
    for root in (location, os.path.join(location, STORE_DIR)):
        if globaldir.is_multirank(root):
            return root
    raise DeepSpeedExportError(f"{location} holds no multi-rank asymstore root (attach() or install() writes one)")


async def _shard(root: str, rank: int, step: int) -> Checkpoint:
    store = await open_store([rank_tier(root, rank)], read_only=True).open()
    try:
        return await store.restore(step=step)
    finally:
        await store.close()


async def read_version(root: str, step: int | None = None) -> tuple[int, str, list[Checkpoint]]:
    """Every rank's verified shard of the global version ``step`` (default: the newest that verifies).

    Returns:
        (global step, DeepSpeed tag, shards in rank order).

    Raises:
        DeepSpeedExportError: no global version, or none whose every shard verifies and holds DeepSpeed files.
    """
    gdir = os.path.join(root, globaldir.GLOBAL_DIR)
    steps = globaldir.list_global_steps(gdir)
    if step is not None:
        if step not in steps:
            raise DeepSpeedExportError(f"global step {step} is not published under {gdir} (have {steps[-5:]})")
        steps = [step]
    reasons = []
    for s in reversed(steps):
        g = globaldir.read_global(gdir, s)
        try:
            shards = []
            for shard in sorted(g.shards, key=lambda x: x.rank):
                ckpt = await _shard(root, shard.rank, shard.step)
                if shard_digest(ckpt.manifest) != shard.digest:  # e.g. a rank's shard committed again since
                    raise CorruptVersionError(f"rank {shard.rank}'s shard {shard.step} is not the global manifest's")
                shards.append(ckpt)
        except AsymstoreError as exc:
            reasons.append(f"global step {s}: {type(exc).__name__}: {exc}")
            logger.warning("global step %d does not verify on every rank: %s", s, exc)
            continue
        if not all(file_keys(c.meta) for c in shards):
            reasons.append(f"global step {s}: a shard holds no DeepSpeed files")
            continue
        try:
            assemble_slices(shards)
        except (AsymstoreError, DeepSpeedExportError) as exc:
            reasons.append(f"global step {s}: {type(exc).__name__}: {exc}")
            continue
        tag = str(shards[0].meta[META_KEY].get("tag", f"global_step{s}"))
        return s, tag, shards
    raise DeepSpeedExportError("no exportable global version: " + ("; ".join(reasons) or f"none under {gdir}"))


def assemble_slices(shards: Sequence[Checkpoint]) -> None:
    """Put every slice of the replicated model states file back together, in place, in every shard.

    A version written with ``CommitOptions(dedup="replicas")`` below ZeRO-3 holds, on each rank, one
    ``"S(0)"`` piece of each of the file's lazily copied tensors (``meta["layout"]``); the whole tensor
    is the pieces of every rank, rows in order. Versions without slices are left as they are.

    Raises:
        DeepSpeedExportError: the pieces do not cover a tensor exactly once, or disagree on it.
        LayoutError: a shard's layout is malformed.
    """
    pieces: dict[str, list[tuple[TensorLayout, torch.Tensor]]] = {}
    for ckpt in shards:
        doc = ckpt.meta.get(LAYOUT_KEY)
        if doc is None:
            continue
        for name, lay in parse_layout_meta(doc).items():
            t = ckpt.tensors.get(name)
            if lay.mesh is None or lay.placements != ("S(0)",) or t is None or tuple(t.shape) != lay.shape:
                raise DeepSpeedExportError(f"{name}: not a slice of the replicated state this export reads ({lay})")
            pieces.setdefault(name, []).append((lay, t))
    for name, held in pieces.items():
        first = held[0][0]
        if len(held) != len(shards) or any(lay.global_shape != first.global_shape or lay.dtype != first.dtype
                                           or lay.mesh is None or lay.mesh.shape != (len(shards),)
                                           for lay, _ in held):
            raise DeepSpeedExportError(f"{name}: {len(held)} slice(s) of {len(shards)} rank(s), or slices that "
                                       "disagree on the tensor")
        whole = torch.empty(first.global_shape, dtype=held[0][1].dtype)
        covered = 0
        for lay, t in sorted(held, key=lambda p: p[0].offsets[0]):
            if lay.offsets[0] != covered and lay.shape[0]:
                raise DeepSpeedExportError(f"{name}: the slices do not cover rows {covered}..{lay.offsets[0]}")
            whole.narrow(0, lay.offsets[0], lay.shape[0]).copy_(t)
            covered = max(covered, lay.offsets[0] + lay.shape[0])
        if covered != first.global_shape[0]:
            raise DeepSpeedExportError(f"{name}: the slices cover {covered} of {first.global_shape[0]} rows")
        for ckpt in shards:
            ckpt.tensors[name] = whole


def _inside(out: str, key: str) -> str:
    path = os.path.normpath(os.path.join(out, key))
    if os.path.isabs(key) or os.path.commonpath([out, path]) != out or path == out:
        raise DeepSpeedExportError(f"file name {key!r} would leave {out}")
    return path


def write_files(shards: Sequence[Checkpoint], tag: str, out: str) -> list[str]:
    """Write every DeepSpeed file of ``shards`` under ``out`` with ``torch.save``, then ``latest``; return the keys."""
    register_deepspeed_types()  # DeepSpeed's own objects in the files (loss scaler, ...) decode as themselves
    out = os.path.abspath(out)
    written: dict[str, int] = {}
    for rank, ckpt in enumerate(shards):
        for key in file_keys(ckpt.meta):
            if key in written:
                if key.endswith("model_states.pt") and "zero_pp_rank" not in key:
                    continue  # below ZeRO-3 every rank records rank 0's model states: DeepSpeed writes one file
                raise DeepSpeedExportError(f"{key} is held by ranks {written[key]} and {rank}")
            path = _inside(out, key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            state: Any = decode_file(ckpt.meta, ckpt.tensors, key)
            torch.save(state, path)
            written[key] = rank
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(tag)
    return sorted(written)


async def export(location: str, out: str, *, step: int | None = None) -> tuple[int, str, list[str]]:
    """Export a DeepSpeed version of ``location`` to ``out``; return (global step, tag, files written)."""
    root = find_root(location)
    s, tag, shards = await read_version(root, step)
    keys = await asyncio.to_thread(write_files, shards, tag, out)
    return s, tag, keys


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m asymcheck.deepspeed.export ROOT OUT [--step N]``."""
    parser = argparse.ArgumentParser(prog="python -m asymcheck.deepspeed.export",
                                     description="Write a DeepSpeed version as DeepSpeed's own checkpoint files.")
    parser.add_argument("location", help="the directory given to attach(), or install()'s checkpoint directory")
    parser.add_argument("out", help="the DeepSpeed checkpoint directory to write")
    parser.add_argument("--step", type=int, default=None, help="the global step (default: newest that verifies)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        s, tag, keys = asyncio.run(export(args.location, args.out, step=args.step))
    except (AsymstoreError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"global step {s} (tag {tag}): {len(keys)} file(s) under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
