"""Take the weights anywhere: export one verified version as safetensors or as a DCP checkpoint.

``python -m asymstore.export LOCATION [--step N] --to safetensors|dcp OUT [--prefix model/]``

LOCATION is any tier location fsck takes or a multi-rank root. Without ``--step`` the newest version
that verifies is exported (the versions skipped are named); with it exactly that version, or nothing.
No output is ever left half-written. ``safetensors`` is streamed chunk by chunk, each verified as it
is read (memory: one segment and one chunk); ``dcp`` decodes each tensor whole. An FSDP2 root
(shards with tensor layouts, :mod:`asymstore.format.pieces`) is consolidated one tensor at a time;
DeepSpeed's ZeRO partitions go through ``python -m asymcheck.deepspeed.export``.

Guide: ``docs/guides/export.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import struct
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from asymstore.errors import (
    AsymstoreError,
    CorruptVersionError,
    ExportError,
    NoCheckpointError,
    RemoteUnavailableError,
    TierError,
    VersionNotFoundError,
    describe,
)
from asymstore.format.manifest import Chunk, Manifest, TensorEntry
from asymstore.format.pieces import TensorLayout
from asymstore.multirank.reshard import ShardSet
from asymstore.tiers.protocol import Tier

logger = logging.getLogger(__name__)

Format = Literal["safetensors", "dcp"]
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64", "uint64": "U64", "uint32": "U32", "uint16": "U16",
}




def is_multirank_root(location: str) -> bool:
    """Whether the local ``location`` is read as a multi-rank root: it holds published global versions.

    The decision a job opening it follows
    (:meth:`~asymstore.multirank.rootlayout.RootSurvey.reads_multirank`): a ``global/`` directory, or a
    record saying multi-rank, left by a multi-rank job that stopped before its first global version does
    not make it one while its single-process versions are the current ones. A damaged layout record is
    judged by what the root holds (fsck names it).

    Raises:
        RootUnreadableError: its entries cannot be listed.
    """
    from asymstore.opener import reads_multirank

    return reads_multirank(location)


def open_tier(location: str) -> tuple[Tier, str]:
    """The tier to read for ``location`` (rank 0's for a multi-rank root, :func:`is_multirank_root`), and its name."""
    from asymstore.format.names import is_uri
    from asymstore.tiers.location import from_location, rank_tier

    if is_uri(location):
        return from_location(location, read_only=True), location
    if not os.path.isdir(location):
        raise FileNotFoundError(f"{location} is not a tier root")
    if is_multirank_root(location):
        return rank_tier(location, 0), f"{location} (rank 0)"
    return from_location(location, read_only=True), location


def _global_candidates(location: str, step: int | None) -> list[int] | None:
    """For a local multi-rank root: the global steps to try, newest first (only ``step`` when given); else None.

    Raises:
        NoCheckpointError: no global version is published.
        VersionNotFoundError: ``step`` is not published.
    """
    from asymstore.multirank import globaldir

    if not os.path.isdir(location) or not is_multirank_root(location):
        return None
    gdir = os.path.join(location, globaldir.GLOBAL_DIR)
    steps = globaldir.list_global_steps(gdir)
    if step is not None:
        if step not in steps:
            raise VersionNotFoundError(f"global step {step} is not published under {gdir}")
        return [step]
    if not steps:
        raise NoCheckpointError(f"no global version under {gdir}")
    return steps[::-1]


def _does_not_verify(exc: AsymstoreError) -> bool:
    """Whether ``exc`` says the version itself is unusable (damaged, missing parts), so an older one is tried.

    A remote that is unreachable says nothing about the version; an ``ExportError`` (a dtype the format lacks,
    nothing under the prefix) would be the same for every version.
    """
    return (isinstance(exc, CorruptVersionError | TierError | VersionNotFoundError)
            and not isinstance(exc, RemoteUnavailableError | NoCheckpointError))


async def _first_that_verifies(candidates: Sequence[int], attempt: Callable[[int], Awaitable[dict[str, Any]]],
                               where: str, *, fall_back: bool) -> dict[str, Any]:
    """Export the first of ``candidates`` (newest first) that verifies; name the ones skipped in the summary.

    Raises:
        NoCheckpointError: every candidate failed verification (each one named).
        AsymstoreError: without ``fall_back`` (``--step``), the candidate's own failure.
    """
    skipped: list[dict[str, Any]] = []
    for step in candidates:
        try:
            summary = await attempt(step)
        except AsymstoreError as exc:
            if not fall_back or not _does_not_verify(exc):
                raise
            skipped.append({"step": step, "error": describe(exc)})
            logger.warning("skipped step %d of %s (it does not verify; trying the version before it): %s",
                           step, where, describe(exc))
            continue
        summary["skipped"] = skipped
        return summary
    raise NoCheckpointError(f"no version of {where} verifies (nothing written): "
                            + "; ".join(f"step {d['step']}: {d['error']}" for d in skipped))


def select(manifest: Manifest, prefix: str) -> dict[str, tuple[str, TensorEntry]]:
    """Exported name -> (stored name, entry) for the tensors under ``prefix``, in manifest order."""
    out = {name[len(prefix):]: (name, entry) for name, entry in manifest.tensors.items()
           if name.startswith(prefix) and len(name) > len(prefix)}
    if not out:
        raise ExportError(f"no tensor of step {manifest.step} is named {prefix!r}*"
                          f" (it holds e.g. {sorted(manifest.tensors)[:3]})")
    return out


class _ChunkReader:
    """Reads verified chunk bytes in manifest order, keeping one segment in memory at a time."""

    def __init__(self, tier: Tier, manifest: Manifest) -> None:
        self.tier = tier
        self.manifest = manifest
        self.sizes = {s.name: s.size for s in manifest.segments}
        self._name: str | None = None
        self._data: memoryview | None = None
        self._pack: tuple[Chunk, memoryview] | None = None  # the last pack verified, for the next tensors

    async def tensor_bytes(self, name: str, entry: TensorEntry, sink: Callable[[memoryview], None]) -> None:
        from asymstore.read.verify import decode_one, verify_segment

        for chunk, lo, hi in entry.pieces():
            if self._pack is not None and self._pack[0] == chunk:  # the chunk itself: an empty pack shares its place
                sink(self._pack[1][lo:hi])
                continue
            if chunk.segment != self._name:
                self._data = None
                raw = await self.tier.read_segment(*self.manifest.locate(chunk.segment),
                                                   self.sizes[chunk.segment])
                verify_segment(self.manifest, chunk.segment, raw, deep=False)
                self._name, self._data = chunk.segment, memoryview(raw).cast("B")
            assert self._data is not None
            stored = self._data[chunk.offset:chunk.offset + chunk.length]
            decoded = await asyncio.to_thread(decode_one, name, chunk, stored, None)
            if entry.pack_offset is not None:
                self._pack = (chunk, decoded)
            sink(decoded[lo:hi])


def _safetensors_header(chosen: dict[str, tuple[str, TensorEntry]], meta: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    pos = 0
    for out_name, (_, entry) in chosen.items():
        code = SAFETENSORS_DTYPES.get(entry.dtype)
        if code is None:
            raise ExportError(f"{out_name!r} is {entry.dtype}, which safetensors cannot hold")
        header[out_name] = {"dtype": code, "shape": list(entry.shape), "data_offsets": [pos, pos + entry.nbytes]}
        pos += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # the data starts 8-byte aligned


async def export_safetensors(reader: _ChunkReader | _WholeReader, chosen: dict[str, tuple[str, TensorEntry]],
                             out: str, meta: dict[str, str], progress: Callable[[int], None] | None = None) -> int:
    """Stream the chosen tensors into the safetensors file ``out`` (written to a temp name, then renamed)."""
    header = _safetensors_header(chosen, meta)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)

            def sink(data: memoryview) -> None:
                f.write(data)
                if progress:
                    progress(len(data))
            for stored, entry in chosen.values():
                await reader.tensor_bytes(stored, entry, sink)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return os.path.getsize(out)


async def export_dcp(reader: _ChunkReader | _WholeReader, chosen: dict[str, tuple[str, TensorEntry]], out: str,
                     progress: Callable[[int], None] | None = None) -> int:
    """Write the chosen tensors as a ``torch.distributed.checkpoint`` directory ``out``."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    from asymstore.format.tensors import as_bytes, dtype_from_name

    state: dict[str, torch.Tensor] = {}
    for out_name, (stored, entry) in chosen.items():
        tensor = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
        view = as_bytes(tensor.view(-1)) if entry.nbytes else memoryview(bytearray())
        pos = 0

        def sink(data: memoryview, view: memoryview = view) -> None:
            nonlocal pos
            view[pos:pos + len(data)] = data
            pos += len(data)
            if progress:
                progress(len(data))
        await reader.tensor_bytes(stored, entry, sink)
        state[out_name] = tensor
    tmp = f"{os.path.normpath(out)}.tmp-{os.getpid()}"
    try:
        try:
            await asyncio.to_thread(save, state, storage_writer=FileSystemWriter(tmp), no_dist=True)
        except CheckpointException as exc:  # DCP's own failure (a BaseException), e.g. a full disk
            raise ExportError(f"writing the DCP checkpoint {out} failed (nothing written): {exc}") from exc
        await asyncio.to_thread(_replace_dir, tmp, out)
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    return sum(t.numel() * t.element_size() for t in state.values())


def _is_dcp_file(name: str) -> bool:
    return name == ".metadata" or name.endswith(".distcp")


def _check_dcp_out(out: str) -> None:
    """Refuse a DCP OUT that exists and is not an empty directory or one holding a DCP checkpoint alone.

    Raises:
        ExportError: it is something else (it would be replaced, so it is left alone).
    """
    if not os.path.lexists(out):
        return
    if os.path.islink(out) or not os.path.isdir(out):
        raise ExportError(f"{out} exists and is not a directory; the DCP export would replace it")
    others = sorted(n for n in os.listdir(out) if not _is_dcp_file(n))
    if others:
        raise ExportError(f"{out} holds more than a DCP checkpoint (e.g. {others[:3]}); the export would "
                          "replace it: choose another OUT or empty it")


def _replace_dir(tmp: str, out: str) -> None:
    """Put the finished directory ``tmp`` at ``out`` (replacing an empty or DCP-only ``out``) by renames."""
    from asymstore.io.files import fsync_dir

    _check_dcp_out(out)
    old = None
    if os.path.lexists(out):
        old = f"{os.path.normpath(out)}.old-{os.getpid()}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        if old is not None:
            os.rename(old, out)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(out)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class _WholeReader:
    """Reads the chosen tensors of a multi-rank version whole: sharded ones assembled from every rank's pieces."""

    def __init__(self, shards: ShardSet, sharded: dict[str, TensorLayout]) -> None:
        self.shards = shards
        self.sharded = sharded
        self._rank0 = _ChunkReader(shards.tiers[0], shards.manifests[0])

    async def tensor_bytes(self, name: str, entry: TensorEntry, sink: Callable[[memoryview], None]) -> None:
        from asymstore.format.pieces import TensorLayout
        from asymstore.format.tensors import as_bytes

        layout = self.sharded.get(name)
        if layout is None:
            await self._rank0.tensor_bytes(name, self.shards.manifests[0].tensors[name], sink)
            return
        whole = await self.shards.piece(name, TensorLayout.whole(layout.global_shape, layout.dtype))
        data = as_bytes(whole.reshape(-1)) if whole.numel() else memoryview(bytearray())
        for at in range(0, len(data), 16 << 20):
            sink(data[at:at + (16 << 20)])


async def _export_global(location: str, step: int, to: Format, out: str, prefix: str,
                         progress: Callable[[int], Callable[[int], None]] | None) -> dict[str, Any]:
    """Export global version ``step`` of a local multi-rank root.

    Every rank's shard manifest is checked against the global manifest; a
    version whose shards record sharded layouts (FSDP2) is assembled whole,
    any other is rank 0's shard.
    """
    from asymstore.multirank import globaldir

    gdir = os.path.join(location, globaldir.GLOBAL_DIR)
    try:
        g = await asyncio.to_thread(globaldir.read_global, gdir, step)
    except FileNotFoundError as exc:
        raise VersionNotFoundError(f"global step {step} is gone from {gdir}") from exc
    shards = ShardSet.of_root(location, g)
    try:
        await shards.open()
        manifest = shards.manifests[0]
        chosen = select(manifest, prefix)
        sharded = {n: lay for n, lay in shards.layouts[0].items() if not lay.is_whole or lay.mesh is not None}
        if sharded:  # FSDP2-style shards: assemble each global tensor from every rank's piece
            return await _write(to, _WholeReader(shards, sharded), manifest, _whole_entries(chosen, sharded), out,
                                f"{location} ({g.world_size} ranks, global step {g.step})", progress)
        return await _write(to, _ChunkReader(shards.tiers[0], manifest), manifest, chosen, out,
                            f"{location} (rank 0)", progress)
    finally:
        await shards.close()


def _whole_entries(chosen: dict[str, tuple[str, TensorEntry]],
                   sharded: dict[str, TensorLayout]) -> dict[str, tuple[str, TensorEntry]]:
    """``chosen`` with the entries of sharded tensors describing the global tensor (shape, bytes)."""
    from asymstore.format.manifest import DTYPE_SIZES

    out = {}
    for out_name, (stored, entry) in chosen.items():
        lay = sharded.get(stored)
        if lay is not None:
            nbytes = DTYPE_SIZES[lay.dtype] * math.prod(lay.global_shape)
            entry = TensorEntry(lay.dtype, tuple(lay.global_shape), nbytes, ())
        out[out_name] = (stored, entry)
    return out


async def export(location: str, to: Format, out: str, *, step: int | None = None, prefix: str = "model/",
                 progress: Callable[[int], Callable[[int], None]] | None = None) -> dict[str, Any]:
    """Export one verified version of ``location`` (see the module docstring); return a summary.

    Without ``step``, the newest version that verifies is written: one that
    fails verification (its manifest, a shard manifest or any chunk, found as
    the chunks are written) is discarded, its temporary output removed, and the
    one before it is tried. The summary's ``"skipped"`` lists the versions
    passed over (``{"step": N, "error": "..."}``), newest first; each is also
    logged as a WARNING. With ``step``, that version is written or nothing is.

    Raises:
        ExportError: nothing under ``prefix``, a dtype the format lacks, or a
            ``dcp`` OUT that exists and holds more than a DCP checkpoint.
        NoCheckpointError: no version, or (without ``step``) none that verifies.
        VersionNotFoundError: ``step`` is not there.
        CorruptVersionError: (with ``step``) the version fails verification; nothing is written.
    """
    if to not in ("safetensors", "dcp"):
        raise ValueError(f"--to must be safetensors or dcp, got {to!r}")
    if to == "dcp":
        _check_dcp_out(out)  # before any work: never replace what is not a DCP checkpoint
    fall_back = step is None
    global_steps = _global_candidates(location, step)
    if global_steps is not None:  # a local multi-rank root: global versions, the previous one on failure
        return await _first_that_verifies(
            global_steps, lambda s: _export_global(location, s, to, out, prefix, progress), location,
            fall_back=fall_back)
    tier, where = open_tier(location)
    await tier.open()
    try:
        steps = await tier.list_versions()
        if step is not None and step not in steps:
            raise VersionNotFoundError(f"step {step} is not on {tier.name}")
        if not steps:
            raise NoCheckpointError(f"no version on {tier.name}")

        async def attempt(s: int) -> dict[str, Any]:
            from asymstore.read.verify import read_manifest

            manifest = await read_manifest(tier, s)
            return await _write(to, _ChunkReader(tier, manifest), manifest, select(manifest, prefix), out, where,
                                progress)
        return await _first_that_verifies([step] if step is not None else steps[::-1], attempt, where,
                                          fall_back=fall_back)
    finally:
        await tier.close()


async def _write(to: Format, reader: _ChunkReader | _WholeReader, manifest: Manifest,
                 chosen: dict[str, tuple[str, TensorEntry]], out: str, where: str,
                 progress: Callable[[int], Callable[[int], None]] | None) -> dict[str, Any]:
    total = sum(e.nbytes for _, e in chosen.values())
    tick = progress(total) if progress else None
    meta = {"format": "pt", "asymstore_step": str(manifest.step), "asymstore_source": where}
    if to == "safetensors":
        size = await export_safetensors(reader, chosen, out, meta, tick)
    else:
        size = await export_dcp(reader, chosen, out, tick)
    return {"step": manifest.step, "tensors": len(chosen), "bytes": size, "out": out, "format": to}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the exporter; return the exit status (0 done, 1 nothing exportable, 2 usage).

    The JSON summary goes to stdout; each version skipped (it did not verify) is a line on stderr.
    """
    parser = argparse.ArgumentParser(prog="python -m asymstore.export", description=__doc__.splitlines()[0])
    parser.add_argument("location", help="a tier's directory, a multi-rank root, or a file://, s3://, hdfs:// URI")
    parser.add_argument("--to", required=True, choices=["safetensors", "dcp"])
    parser.add_argument("out", help="the safetensors file, or the DCP directory, to write")
    parser.add_argument("--step", type=int, default=None, help="export this step (default: the newest that verifies)")
    parser.add_argument("--prefix", default="model/", help="export tensors named PREFIX* without it (default model/)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="export: %(message)s")  # the versions skipped, on stderr

    def bar(total: int) -> Callable[[int], None]:
        from tqdm import tqdm

        t = tqdm(total=total, unit="B", unit_scale=True, desc="exporting", file=sys.stderr,
                 disable=not sys.stderr.isatty())
        return t.update  # type: ignore[no-any-return]
    try:
        summary = asyncio.run(export(args.location, args.to, args.out, step=args.step, prefix=args.prefix,
                                     progress=bar))
    except FileNotFoundError as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    except AsymstoreError as exc:
        print(f"export: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
