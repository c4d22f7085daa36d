"""What a restore returns; reading and verifying a version lives in :mod:`asymstore.verify`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from asymstore.errors import AsymstoreError
from asymstore.manifest import Manifest
from asymstore.verify import load_version, read_manifest

__all__ = ["Checkpoint", "describe", "load_version", "read_manifest"]

logger = logging.getLogger(__name__)



@dataclass
class Checkpoint:
    """A restored version.

    Attributes:
        step: the version's step.
        tensors: name -> tensor, bit-exact with dtype and shape as put.
        meta: the user's JSON metadata.
        tier: name of the tier it was read from.
        manifest: the version's parsed manifest.
        fallbacks: one line per newer version or faster tier that was tried
            and failed verification before this one; empty when none failed.
    """

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    tier: str
    manifest: Manifest
    fallbacks: list[str] = field(default_factory=list)

    @property
    def fell_back(self) -> bool:
        """True when a newer or faster copy failed and this one was used instead."""
        return bool(self.fallbacks)


def describe(exc: BaseException) -> str:
    """Return a one-line reason for a failed load."""
    if isinstance(exc, AsymstoreError):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc!r}"
