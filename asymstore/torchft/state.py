"""A torchft state dict as one store version: tensors by index, the rest as a strict-JSON skeleton.

torchft hands a transport nested dicts and lists (``{"user": {key: state}, "torchft": {...}}``):
model and optimizer state dicts with int keys, tuples (Adam's ``betas``), floats, bools, None and
tensors. :func:`flatten` turns one into ``name -> tensor`` (names ``t/000000``, ``t/000001``, ... in
walk order) and a skeleton that refers to them; :func:`unflatten` rebuilds it from a restored
version. No pickle: a value of any other type is refused (:class:`~asymstore.errors.HealProtocolError`).
The skeleton is untrusted on the receiving side: its depth, node count and every reference are checked.

Tags (one-key dicts, so a plain dict never looks like one): ``{"$t": i}`` the i-th tensor;
``{"$tuple": [...]}``; ``{"$dict": [[key, value], ...]}`` a dict whose keys are not all plain str;
``{"$float": "nan" | "inf" | "-inf"}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from asymstore.errors import HealCorruptError, HealProtocolError

MAX_DEPTH = 64
"""Deepest nesting accepted from a peer."""

MAX_NODES = 1 << 20
"""Most skeleton nodes accepted from a peer."""


def tensor_name(index: int) -> str:
    """The store name of the ``index``-th tensor of a flattened state."""
    return f"t/{index:06d}"


def flatten(value: object) -> tuple[Any, dict[str, torch.Tensor]]:
    """The strict-JSON skeleton of ``value`` and its tensors by name (detached, not copied).

    Raises:
        HealProtocolError: a value that has no pickle-free form (names its path).
    """
    tensors: dict[str, torch.Tensor] = {}
    return _walk(value, "", tensors, 0), tensors


def _walk(value: object, path: str, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise HealProtocolError(f"{path or '/'}: state nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Tensor):
        name = tensor_name(len(tensors))
        tensors[name] = value.detach()
        return {"$t": len(tensors) - 1}
    if isinstance(value, tuple):
        return {"$tuple": [_walk(v, f"{path}/{i}", tensors, depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_walk(v, f"{path}/{i}", tensors, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _walk(v, f"{path}/{k}", tensors, depth + 1) for k, v in value.items()}
        return {"$dict": [[_walk(k, f"{path}/<key>", tensors, depth + 1), _walk(v, f"{path}/{k}", tensors, depth + 1)]
                          for k, v in value.items()]}
    raise HealProtocolError(f"{path or '/'}: cannot send a {type(value).__module__}.{type(value).__qualname__} "
                            "without pickle; keep torchft state dicts to tensors, numbers, strings, lists and dicts")


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild what :func:`flatten` described, from a peer's skeleton and the verified tensors.

    Every tensor of ``tensors`` must be referenced exactly once.

    Raises:
        HealCorruptError: the skeleton is malformed, too deep or too large, refers to a tensor the version
            lacks, refers to one twice, or leaves one unreferenced.
    """
    used: set[str] = set()
    budget = [MAX_NODES]
    out = _build(skeleton, tensors, used, budget, 0)
    if used != set(tensors):
        raise HealCorruptError(f"the state record leaves {len(set(tensors) - used)} stored tensor(s) unreferenced")
    return out


def _build(node: Any, tensors: Mapping[str, torch.Tensor], used: set[str], budget: list[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise HealCorruptError(f"the state record is larger than {MAX_NODES} nodes or deeper than {MAX_DEPTH}")
    if node is None or isinstance(node, (bool, str, int, float)):
        return node
    if isinstance(node, list):
        return [_build(v, tensors, used, budget, depth + 1) for v in node]
    if not isinstance(node, dict):
        raise HealCorruptError(f"the state record holds a {type(node).__name__}")
    if not any(k.startswith("$") for k in node):
        return {k: _build(v, tensors, used, budget, depth + 1) for k, v in node.items()}
    if len(node) != 1:
        raise HealCorruptError(f"the state record has a malformed tag {sorted(node)[:4]}")
    tag, arg = next(iter(node.items()))
    if tag == "$t":
        if isinstance(arg, bool) or not isinstance(arg, int) or tensor_name(arg) not in tensors:
            raise HealCorruptError(f"the state record names tensor {arg!r}, which the version does not hold")
        name = tensor_name(arg)
        if name in used:
            raise HealCorruptError(f"the state record names tensor {arg} twice")
        used.add(name)
        return tensors[name]
    if tag == "$tuple" and isinstance(arg, list):
        return tuple(_build(v, tensors, used, budget, depth + 1) for v in arg)
    if tag == "$dict" and isinstance(arg, list):
        out = {}
        for pair in arg:
            if not isinstance(pair, list) or len(pair) != 2:
                raise HealCorruptError("the state record has a malformed $dict entry")
            key = _build(pair[0], tensors, used, budget, depth + 1)
            if isinstance(key, (dict, list, torch.Tensor)):
                raise HealCorruptError(f"the state record has an unhashable key of type {type(key).__name__}")
            try:
                out[key] = _build(pair[1], tensors, used, budget, depth + 1)
            except TypeError as exc:
                raise HealCorruptError(f"the state record has an unhashable key: {exc}") from exc
        return out
    if tag == "$float" and arg in ("nan", "inf", "-inf"):
        return float(arg)
    raise HealCorruptError(f"the state record has an unknown tag {tag!r}")
