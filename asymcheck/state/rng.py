"""Capture and restore the random number generators, without pickle.

Python's state is a JSON list, NumPy's legacy global state a JSON object
(its 624 key words as a list), torch's CPU and CUDA states are byte tensors.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

_np: Any
try:  # NumPy is optional
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is installed in the demo extra
    _np = None

CPU_NAME = "rng/torch"
CUDA_PREFIX = "rng/cuda/"


def capture(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Return the JSON part of every RNG state; put the tensor parts into ``tensors`` (private copies)."""
    version, internal, gauss = random.getstate()
    meta: dict[str, Any] = {"python": [version, list(internal), gauss]}
    if _np is not None:
        name, keys, pos, has_gauss, cached = _np.random.get_state(legacy=True)
        meta["numpy"] = {"name": str(name), "keys": [int(k) for k in keys], "pos": int(pos),
                         "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    tensors[CPU_NAME] = torch.get_rng_state().clone()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states = torch.cuda.get_rng_state_all()
        for i, state in enumerate(states):
            tensors[f"{CUDA_PREFIX}{i}"] = state.clone()
        meta["cuda_devices"] = len(states)
    return meta


def restore(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Set every RNG captured by :func:`capture` (states absent here are left alone)."""
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    if _np is not None and "numpy" in meta:
        n = meta["numpy"]
        keys = _np.asarray(n["keys"], dtype=_np.uint32)
        _np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(tensors[CPU_NAME].clone())
    devices = int(meta.get("cuda_devices", 0))
    if devices and torch.cuda.is_available():
        for i in range(min(devices, torch.cuda.device_count())):
            torch.cuda.set_rng_state(tensors[f"{CUDA_PREFIX}{i}"].clone(), i)
