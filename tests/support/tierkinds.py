"""Every kind of tier a version can be written to, built by name, and a bit-exact digest of a state.

The format tests write a version through one kind and restore it through the same kind in another
process (:mod:`tests.support.restorer`), so the kinds are built from a name and a path alone.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from typing import Any, Literal

import torch

from asymstore import LocalTier, NVMeTier, Tier, host_tier
from asymstore.tiers.remote.tier import RemoteTier

Kind = Literal["memory", "shm", "local", "nvme", "remote", "s3"]
"""``memory``: process memory (restored in the writing process); the rest are files or objects another process
reads (``remote``: a pyarrow ``file://`` filesystem; ``s3``: the loopback moto S3 server, the path is the URI)."""
FILE_KINDS: tuple[Kind, ...] = ("shm", "local", "nvme", "remote")

Digest = tuple[str, tuple[int, ...], str]
"""A tensor as compared: dtype, shape and the SHA-256 of its bytes in row-major order."""


def make_tier(kind: Kind, path: str) -> Tier:
    """A fresh tier of ``kind`` over ``path`` (ignored for process memory)."""
    if kind == "memory":
        return host_tier(256 << 20, pin=False)
    if kind == "shm":
        return host_tier(256 << 20, path=path)
    if kind == "local":
        return LocalTier(path)
    if kind == "nvme":
        return NVMeTier(path, engine="posix", num_threads=2, task_size=1 << 16)
    if kind == "remote":
        return RemoteTier(f"file://{path}", part_size=1 << 16)
    if kind == "s3":
        return RemoteTier(path, part_size=1 << 16)
    raise ValueError(f"unknown tier kind {kind!r}")


def digest(t: torch.Tensor) -> Digest:
    """dtype, shape and SHA-256 of the row-major bytes of ``t`` (whatever its strides)."""
    flat = t.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), hashlib.sha256(data).hexdigest()


def digests(state: dict[str, torch.Tensor]) -> dict[str, Digest]:
    """:func:`digest` of every tensor."""
    return {name: digest(t) for name, t in state.items()}


class Restorer:
    """A child process (tests/procs/restorer.py) that restores what this process wrote, asked line by line."""

    def __init__(self) -> None:
        """Start the child."""
        from tests.support.launch import proc_argv, proc_env

        self.proc = subprocess.Popen(proc_argv("restorer"), env=proc_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def restore(self, kind: Kind, path: str, into: Literal["none", "all", "some"] = "none") -> dict[str, Any]:
        """The child's answer for the newest version on ``kind`` at ``path``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"kind": kind, "path": path, "into": into}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the restorer exited with {self.proc.wait(10)}")
        answer: dict[str, Any] = json.loads(line)
        answer["tensors"] = {n: (d, tuple(s), h) for n, (d, s, h) in answer.get("tensors", {}).items()}
        return answer

    def close(self) -> None:
        """End the child."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class BytesProvedLocalTier(LocalTier):
    """A local tier whose segments are proved by their bytes, as a peer tier's are.

    For tests that hand a local tier's files to a peer's receiver, which checks each segment's bytes
    on arrival (:class:`~asymstore.tiers.protocol.BytesProofTier`).
    """

    def wants_bytes_proof(self) -> bool:
        """True."""
        return True
