"""A pickle-free codec for state dicts: strict JSON for structure, tensors on the side.

:func:`encode` walks a state dict (nested dicts, lists, tuples, scalars,
tensors, NumPy arrays) and returns a strict-JSON tree in which every tensor
is replaced by a reference to a named entry of ``tensors``. :func:`decode`
inverts it. Values JSON cannot hold exactly are tagged with a one-key dict:

- ``{"$tensor": name}`` a tensor; ``{"$ndarray": name, "dtype": d}`` a NumPy array
- ``{"$tuple": [...]}``; ``{"$dict": [[key, value], ...]}`` for non-str keys
- ``{"$float": "nan" | "inf" | "-inf"}``; ``{"$bytes": hex}``
- ``{"$dtype": "float32"}``; ``{"$device": "cuda:0"}``; ``{"$np": dtype, "value": v}``
- ``{"$size": [2, 3]}`` a ``torch.Size``; ``{"$odict": [[key, value], ...]}`` an ``OrderedDict``
- ``{"$object": "module.Class", "state": {...}}`` / ``{"$enum": "module.Class", "value": v}``: an
  instance of a class registered with :func:`register_type` (its ``__dict__``, or an Enum's
  value); decoding only ever builds registered classes, never imports a name from the data.
"""

from __future__ import annotations

import enum
import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from asymcheck.errors import UnsupportedStateError

_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_TYPES: dict[str, type] = {}
T = TypeVar("T", bound=type)


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_type(cls: T) -> T:
    """Allow instances of ``cls`` in encoded state: an Enum by value, any other class by its ``__dict__``.

    Decoding rebuilds only registered classes (``cls.__new__`` plus the decoded
    ``__dict__``, or ``cls(value)`` for an Enum), so register plain state holders
    only. Returns ``cls`` (usable as a decorator).
    """
    _TYPES[_type_name(cls)] = cls
    return cls


def _piece(key: object) -> str:
    text = _SAFE.sub("_", str(key))[:64]
    return "_" if text in ("", ".", "..") else text


def _unique(name: str, tensors: Mapping[str, object]) -> str:
    if name not in tensors:
        return name
    n = 1
    while f"{name}~{n}" in tensors:
        n += 1
    return f"{name}~{n}"


def _is_numpy(value: object, kind: str) -> bool:
    cls = type(value)
    if not cls.__module__.startswith("numpy"):
        return False
    return any(base.__name__ == kind for base in cls.__mro__)


def encode(value: object, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Return a strict-JSON tree for ``value``; tensors go into ``tensors`` under names below ``path``.

    Tensors are stored by reference (not copied): the caller decides when to copy.

    Raises:
        UnsupportedStateError: a value has no pickle-free encoding.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    registered = _TYPES.get(_type_name(type(value)))
    if registered is not None:
        if isinstance(value, enum.Enum):
            return {"$enum": _type_name(registered), "value": encode(value.value, path, tensors)}
        return {"$object": _type_name(registered), "state": encode(vars(value), path, tensors)}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Tensor):
        name = _unique(path, tensors)
        tensors[name] = value
        return {"$tensor": name}
    if isinstance(value, (torch.dtype, torch.device)):
        key = "$dtype" if isinstance(value, torch.dtype) else "$device"
        return {key: str(value).removeprefix("torch.")}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": bytes(value).hex()}
    if _is_numpy(value, "ndarray"):
        return _encode_ndarray(value, path, tensors)
    if _is_numpy(value, "generic"):
        item = value.item()  # type: ignore[attr-defined]
        return {"$np": str(value.dtype), "value": encode(item, path, tensors)}  # type: ignore[attr-defined]
    if isinstance(value, torch.Size):
        return {"$size": [int(d) for d in value]}
    if isinstance(value, tuple):  # includes named tuples (decoded as plain tuples)
        return {"$tuple": [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, OrderedDict):
        return {"$odict": [[encode(k, f"{path}/key", tensors), encode(v, f"{path}/{_piece(k)}", tensors)]
                           for k, v in value.items()]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, f"{path}/{_piece(k)}", tensors) for k, v in value.items()}
        return {"$dict": [[encode(k, f"{path}/key", tensors), encode(v, f"{path}/{_piece(k)}", tensors)]
                          for k, v in value.items()]}
    raise UnsupportedStateError(f"{path}: cannot store a {type(value).__module__}.{type(value).__qualname__} "
                                "without pickle; keep state dicts to tensors, numbers, strings, lists and dicts")


def _encode_ndarray(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    import numpy as np

    arr = np.ascontiguousarray(value)
    try:
        tensor = torch.from_numpy(arr.copy())
    except TypeError as exc:
        raise UnsupportedStateError(f"{path}: NumPy dtype {arr.dtype} has no torch equivalent") from exc
    name = _unique(path, tensors)
    tensors[name] = tensor
    return {"$ndarray": name, "dtype": str(arr.dtype)}


def decode(node: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the value :func:`encode` described, taking tensors from ``tensors``.

    Raises:
        UnsupportedStateError: the tree names a tensor that is missing, or an unknown tag.
    """
    if isinstance(node, list):
        return [decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) >= 1 and any(k.startswith("$") for k in node):
        return _decode_tagged(node, tensors)
    return {k: decode(v, tensors) for k, v in node.items()}


def _decode_tagged(node: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    if "$tensor" in node or "$ndarray" in node:
        name = node.get("$tensor", node.get("$ndarray"))
        if not isinstance(name, str) or name not in tensors:
            raise UnsupportedStateError(f"the checkpoint has no tensor {name!r}")
        if "$tensor" in node:
            return tensors[name]
        import numpy as np

        return np.array(tensors[name].numpy(), dtype=node["dtype"], copy=True)
    if "$tuple" in node:
        return tuple(decode(v, tensors) for v in node["$tuple"])
    if "$dict" in node:
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in node["$dict"]}
    if "$size" in node:
        return torch.Size(node["$size"])
    if "$odict" in node:
        return OrderedDict((_hashable(decode(k, tensors)), decode(v, tensors)) for k, v in node["$odict"])
    if "$object" in node or "$enum" in node:
        return _decode_registered(node, tensors)
    if "$float" in node:
        return float(node["$float"])
    if "$bytes" in node:
        return bytes.fromhex(node["$bytes"])
    if "$dtype" in node:
        dtype = getattr(torch, node["$dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise UnsupportedStateError(f"unknown dtype {node['$dtype']!r}")
        return dtype
    if "$device" in node:
        return torch.device(node["$device"])
    if "$np" in node:
        import numpy as np

        return np.dtype(node["$np"]).type(decode(node["value"], tensors))
    raise UnsupportedStateError(f"unknown tag in {sorted(node)}")


def _decode_registered(node: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    name = node.get("$object", node.get("$enum"))
    cls = _TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise UnsupportedStateError(f"the checkpoint holds a {name!r}, which is not registered "
                                    "(asymcheck.state.encode.register_type)")
    if "$enum" in node:
        return cls(decode(node["value"], tensors))
    obj: Any = object.__new__(cls)
    obj.__dict__.update(decode(node["state"], tensors))
    return obj


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key
