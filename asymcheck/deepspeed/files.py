"""DeepSpeed checkpoint files as asymstore tensors plus JSON, and small CheckpointEngines over them.

A DeepSpeed checkpoint is a set of files (``mp_rank_00_model_states.pt``,
``zero_pp_rank_0_mp_rank_00_optim_states.pt``, …), each one state dict. Here
a file is a JSON tree (:mod:`asymcheck.state.encode`) in the shard's meta under
``meta["deepspeed"]["files"][key]`` and its tensors under names
``ds/<key>/…``; ``key`` is the file's path relative to the checkpoint
directory (``global_step10/mp_rank_00_model_states.pt``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from asymcheck.errors import NotInStoreError
from asymcheck.state.encode import decode, encode

logger = logging.getLogger(__name__)

META_KEY = "deepspeed"
STUB_FORMAT = "asymcheck.deepspeed.stub"




def encode_files(files: Mapping[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Encode every file's state dict; tensors (by reference) go into ``tensors``."""
    return {key: encode(sd, f"ds/{key}", tensors) for key, sd in files.items()}


def decode_file(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], key: str) -> Any:
    """Rebuild the state dict of file ``key`` from a shard's meta and tensors.

    Raises:
        NotInStoreError: the shard does not hold ``key``.
    """
    files = meta.get(META_KEY, {}).get("files", {})
    if key not in files:
        raise NotInStoreError(f"{key} is not in this shard (it holds {sorted(files)})")
    return decode(files[key], tensors)


def file_keys(meta: Mapping[str, Any]) -> list[str]:
    """The file keys a shard's meta lists."""
    return sorted(meta.get(META_KEY, {}).get("files", {}))


def write_stubs(root: str, keys: Iterable[str], note: Mapping[str, Any]) -> None:
    """Write small JSON placeholders at the files' paths under ``root``.

    DeepSpeed's ``load_checkpoint`` finds checkpoint files with ``glob`` and
    asserts they exist before it asks the checkpoint engine for them; the
    stubs are what it finds. They hold no data (a hint only).
    """
    for key in keys:
        path = os.path.join(root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"format": STUB_FORMAT, "key": key, **note}, f)
            f.write("\n")


class CapturingEngine(CheckpointEngine):  # type: ignore[misc]
    """Records what DeepSpeed ``save``s (live tensors, by reference) instead of writing it.

    Args:
        base: the directory the saved paths are relative to.
    """

    def __init__(self, base: str) -> None:
        """Start with nothing saved."""
        super().__init__(None)
        self.name = "AsymcheckCapture"
        self.base = base
        self.saved: dict[str, Any] = {}

    def create(self, info: Any) -> None:
        """Nothing to prepare."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Nothing is written."""

    def save(self, state_dict: Any, path: str) -> None:
        """Record ``state_dict`` under the path's key."""
        self.saved[os.path.relpath(path, self.base)] = state_dict

    def load(self, path: str, map_location: Any = None) -> Any:
        """Not a reading engine."""
        raise NotImplementedError("CapturingEngine does not load")

    def commit(self, info: Any) -> bool:
        """Nothing to commit."""
        return True

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed passes live tensors (no clones); they are copied later, lazily."""
        return False


class ServingEngine(CheckpointEngine):  # type: ignore[misc]
    """Answers DeepSpeed's ``load`` calls from a function of the file key (relative to ``base``).

    Args:
        base: the directory DeepSpeed is told to load from.
        fetch: key -> state dict.
    """

    def __init__(self, base: str, fetch: Callable[[str], Any]) -> None:
        """Serve files through ``fetch``."""
        super().__init__(None)
        self.name = "AsymcheckServe"
        self.base = base
        self.fetch = fetch

    def create(self, info: Any) -> None:
        """Not a writing engine."""
        raise NotImplementedError("ServingEngine does not save")

    def save(self, state_dict: Any, path: str) -> None:
        """Not a writing engine."""
        raise NotImplementedError("ServingEngine does not save")

    def load(self, path: str, map_location: Any = None) -> Any:
        """Return the state dict of ``path``."""
        return self.fetch(os.path.relpath(path, self.base))

    def commit(self, info: Any) -> bool:
        """Nothing to commit."""
        return True
