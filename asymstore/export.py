"""Take the weights anywhere: export one verified version as safetensors or as a DCP checkpoint.

``python -m asymstore.export LOCATION [--step N] --to safetensors|dcp OUT [--prefix model/]``

LOCATION is any tier location fsck takes (a directory, ``file://``, ``s3://``,
``hdfs://``) or a multi-rank root (then rank 0's shard of the newest global
version: the whole model under DDP). The newest version that verifies is
exported (``--step`` picks one). Tensors whose names start with ``--prefix``
are exported with the prefix removed: ``model/`` is what
:class:`asymcheck.Checkpointer` stores the model's ``state_dict`` under, so
the output loads with ``model.load_state_dict``; ``--prefix ""`` exports
every tensor under its stored name.

- ``safetensors``: one file written as a stream: the header first (computed
  from the manifest), then each tensor's bytes, chunk by chunk, every chunk
  verified by its checksums as it is read. Memory: one segment and one chunk
  at a time, whatever the model's size. Readable by ``safetensors.safe_open``
  / ``safetensors.torch.load_file`` and by Hugging Face ``from_pretrained``.
- ``dcp``: a ``torch.distributed.checkpoint`` directory that
  ``torch.distributed.checkpoint.load`` reads. DCP's writer takes whole
  tensors, so each tensor is decoded (and verified) into memory first;
  memory is the exported tensors' size.

A multi-rank root whose shards record tensor layouts (FSDP2's sharded
parameters, :mod:`asymstore.format.pieces`) is consolidated: every rank's
shard manifest is checked against the global manifest, and each sharded
tensor is assembled whole from the pieces of every rank (each chunk read
verified), one tensor at a time; tensors held whole come from rank 0. Memory:
the largest tensor. DeepSpeed's flat ZeRO partitions record no layout: export
them with ``python -m asymcheck.deepspeed.export`` and DeepSpeed's own tools.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal

from asymstore.errors import AsymstoreError, ExportError, NoCheckpointError, VersionNotFoundError
from asymstore.format.manifest import Manifest, TensorEntry
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




def open_tier(location: str) -> tuple[Tier, str]:
    """The tier to read for ``location`` (rank 0's for a multi-rank root), and a description."""
    if "://" in location:
        from asymstore.tiers.remote.tier import RemoteTier

        return RemoteTier(location), location
    from asymstore.multirank import globaldir
    from asymstore.tiers.local import LocalTier

    if os.path.isdir(os.path.join(location, globaldir.GLOBAL_DIR)):
        return LocalTier(os.path.join(location, globaldir.rank_dirname(0)), fsync=False), f"{location} (rank 0)"
    if not os.path.isdir(location):
        raise FileNotFoundError(f"{location} is not a tier root")
    return LocalTier(location, fsync=False), location


def _global_step(location: str, step: int | None) -> int | None:
    """For a multi-rank root: rank 0's shard step of the global version ``step`` (or the newest)."""
    from asymstore.multirank import globaldir

    gdir = os.path.join(location, globaldir.GLOBAL_DIR)
    if "://" in location or not os.path.isdir(gdir):
        return step
    steps = globaldir.list_global_steps(gdir)
    if not steps:
        raise NoCheckpointError(f"no global version under {gdir}")
    chosen = step if step is not None else steps[-1]
    if chosen not in steps:
        raise VersionNotFoundError(f"global step {chosen} is not published under {gdir}")
    return globaldir.read_global(gdir, chosen).shard(0).step


async def _pick(tier: Tier, step: int | None) -> Manifest:
    """The manifest of ``step``, or of the newest version whose manifest verifies."""
    from asymstore.read.verify import read_manifest

    steps = await tier.list_versions()
    if step is not None:
        if step not in steps:
            raise VersionNotFoundError(f"step {step} is not on {tier.name}")
        return await read_manifest(tier, step)
    errors = []
    for s in reversed(steps):
        try:
            return await read_manifest(tier, s)
        except AsymstoreError as exc:
            errors.append(f"step {s}: {exc}")
    raise NoCheckpointError(f"no version of {tier.name} verifies" + (": " + "; ".join(errors) if errors else ""))


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
        self._pack: tuple[tuple[str, int], memoryview] | None = None  # the last pack verified, for the next tensors

    async def tensor_bytes(self, name: str, entry: TensorEntry, sink: Callable[[memoryview], None]) -> None:
        from asymstore.read.verify import decode_one, verify_segment

        for chunk, lo, hi in entry.pieces():
            key = (chunk.segment, chunk.offset)
            if self._pack is not None and self._pack[0] == key:
                sink(self._pack[1][lo:hi])
                continue
            if chunk.segment != self._name:
                self._data = None
                raw = await self.tier.read_segment(self.manifest.step, chunk.segment, self.sizes[chunk.segment])
                verify_segment(self.manifest, chunk.segment, raw, deep=False)
                self._name, self._data = chunk.segment, memoryview(raw).cast("B")
            assert self._data is not None
            stored = self._data[chunk.offset:chunk.offset + chunk.length]
            decoded = await asyncio.to_thread(decode_one, name, chunk, stored, None)
            if entry.pack_offset is not None:
                self._pack = (key, decoded)
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
    await asyncio.to_thread(save, state, storage_writer=FileSystemWriter(out), no_dist=True)
    return sum(t.numel() * t.element_size() for t in state.values())


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


async def _open_sharded(location: str, step: int | None) -> tuple[ShardSet, dict[str, TensorLayout]] | None:
    """For a local multi-rank root whose version has sharded tensors: its shards (opened) and those layouts."""
    from asymstore.multirank import globaldir

    gdir = os.path.join(location, globaldir.GLOBAL_DIR)
    if "://" in location or not os.path.isdir(gdir):
        return None
    steps = globaldir.list_global_steps(gdir)
    chosen = step if step is not None else (steps[-1] if steps else None)
    if chosen is None or chosen not in steps:
        return None  # _global_step reports it
    shards = ShardSet.of_root(location, globaldir.read_global(gdir, chosen))
    await shards.open()
    sharded = {n: lay for n, lay in shards.layouts[0].items() if not lay.is_whole or lay.mesh is not None}
    if not sharded:
        await shards.close()
        return None
    return shards, sharded


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

    Raises:
        ExportError: nothing under ``prefix``, or a dtype the format lacks.
        NoCheckpointError, VersionNotFoundError: no such version.
        CorruptVersionError: a chunk fails verification (the output is not written).
    """
    if to not in ("safetensors", "dcp"):
        raise ValueError(f"--to must be safetensors or dcp, got {to!r}")
    found = await _open_sharded(location, step)
    if found is not None:  # FSDP2-style shards: assemble each global tensor from every rank's piece
        shards, sharded = found
        try:
            manifest = shards.manifests[0]
            chosen = _whole_entries(select(manifest, prefix), sharded)
            reader: _ChunkReader | _WholeReader = _WholeReader(shards, sharded)
            where = f"{location} ({shards.g.world_size} ranks, global step {shards.g.step})"
            return await _write(to, reader, manifest, chosen, out, where, progress)
        finally:
            await shards.close()
    tier, where = open_tier(location)
    await tier.open()
    try:
        manifest = await _pick(tier, _global_step(location, step))
        chosen = select(manifest, prefix)
        return await _write(to, _ChunkReader(tier, manifest), manifest, chosen, out, where, progress)
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
    """Run the exporter; return the exit status (0 done, 1 nothing exportable, 2 usage)."""
    parser = argparse.ArgumentParser(prog="python -m asymstore.export", description=__doc__.splitlines()[0])
    parser.add_argument("location", help="a tier's directory, a multi-rank root, or a file://, s3://, hdfs:// URI")
    parser.add_argument("--to", required=True, choices=["safetensors", "dcp"])
    parser.add_argument("out", help="the safetensors file, or the DCP directory, to write")
    parser.add_argument("--step", type=int, default=None, help="export this step (default: the newest that verifies)")
    parser.add_argument("--prefix", default="model/", help="export tensors named PREFIX* without it (default model/)")
    args = parser.parse_args(argv)

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
