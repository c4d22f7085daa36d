"""A process that restores versions other processes wrote, and answers with what it read.

One JSON request per line on stdin: ``{"kind": KIND, "path": PATH, "into": "none"|"all"|"some"}``.
It opens a fresh store over one tier of that kind (:func:`tests.support.tierkinds.make_tier`),
restores the newest version (``into``: none, zeroed destinations for every tensor, or for every
other tensor with the 2-D ones transposed views, so non-contiguous destinations are filled too) and
answers one JSON line: ``{"step": N, "tensors": {name: [dtype, shape, sha256]}, "same": bool}``
(``same``: each destination was returned as itself), or ``{"error": "Type: message"}``. The
process holds nothing of the writer's: a restore here proves the bytes on the tier alone.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import torch

from asymstore import AsymStore
from asymstore.format.manifest import Manifest
from asymstore.format.tensors import dtype_from_name
from tests.support.tierkinds import digests, make_tier


def destinations(manifest: Manifest, how: str) -> dict[str, torch.Tensor]:
    """Zeroed destinations for the tensors of ``manifest`` that ``how`` picks."""
    out = {}
    for i, (name, entry) in enumerate(manifest.tensors.items()):
        if how == "some" and i % 2:
            continue
        dtype = dtype_from_name(entry.dtype)
        if how == "some" and len(entry.shape) == 2:  # a transposed view: filled by a copy, not in place
            out[name] = torch.zeros(tuple(reversed(entry.shape)), dtype=dtype).t()
        else:
            out[name] = torch.zeros(entry.shape, dtype=dtype)
    return out


async def restore(request: dict[str, Any]) -> dict[str, Any]:
    """Restore the newest version of the requested tier; what it holds."""
    given: dict[str, torch.Tensor] = {}

    def into(manifest: Manifest) -> dict[str, torch.Tensor]:
        given.update(destinations(manifest, request["into"]))
        return given

    async with AsymStore([make_tier(request["kind"], request["path"])], read_only=True) as store:
        ckpt = await store.restore(into=None if request["into"] == "none" else into)
    same = all(ckpt.tensors[name] is dest for name, dest in given.items())
    return {"step": ckpt.step, "tensors": digests(ckpt.tensors), "same": same}


def main() -> None:
    """Answer requests until stdin closes."""
    for line in sys.stdin:
        try:
            answer = asyncio.run(restore(json.loads(line)))
        except Exception as exc:  # reported to the test, which fails on it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
