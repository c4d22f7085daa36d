"""Conversions between tensors and raw little-endian bytes, without pickle.

A tensor is stored as its dtype name (``"bfloat16"``), its shape and the raw
bytes of its contiguous CPU copy. Restoring builds a tensor of the same dtype
and shape over those bytes.
"""

from __future__ import annotations

import ctypes

import torch

from asymstore.errors import InvalidValueError, ManifestError
from asymstore.format.checksum import checksum
from asymstore.format.manifest import DTYPE_SIZES


def dtype_name(dtype: torch.dtype) -> str:
    """Return the manifest name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype named ``name``; raise :class:`ManifestError` unless it is a storable dtype."""
    value = getattr(torch, name, None) if name in DTYPE_SIZES else None
    if not isinstance(value, torch.dtype) or dtype_name(value) != name or value.itemsize != DTYPE_SIZES[name]:
        raise ManifestError(f"unknown dtype {name!r} in manifest")
    return value


def host_copy(value: object) -> torch.Tensor:
    """Return a private, contiguous CPU copy of ``value`` that later writes cannot change.

    Raises:
        InvalidValueError: ``value`` is not a dense, storable tensor.
    """
    if not isinstance(value, torch.Tensor):
        raise InvalidValueError(f"expected a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise InvalidValueError(f"only dense (strided) tensors are stored, got {value.layout}")
    if value.is_quantized or dtype_name(value.dtype) not in DTYPE_SIZES:  # quantized and opaque bit dtypes
        raise InvalidValueError(f"dtype {value.dtype} cannot be stored")
    if value.is_meta:
        raise InvalidValueError("meta tensors have no data to store")
    src = value.detach()
    if src.is_conj():
        src = src.resolve_conj()
    if src.is_neg():
        src = src.resolve_neg()
    out = torch.empty(src.shape, dtype=src.dtype, device="cpu")
    if src.device.type == "cpu" and src.is_contiguous() and out.numel():
        # one memmove, GIL released: no OpenMP team of its own competing with the training threads
        ctypes.memmove(out.data_ptr(), src.data_ptr(), out.numel() * out.element_size())
    else:
        out.copy_(src)
    return out


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """Return a zero-copy byte view of a contiguous CPU tensor.

    The view keeps ``tensor`` alive for as long as the view itself lives.
    """
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise InvalidValueError("as_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())  # writable, like every other view this returns
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array._owner = tensor  # type: ignore[attr-defined]  # keeps the storage alive
    return memoryview(array).cast("B")


def chunk_views(tensor: torch.Tensor, chunk_bytes: int) -> list[memoryview]:
    """The raw bytes of a contiguous CPU ``tensor`` cut as a store cuts them into chunks.

    Chunks of ``chunk_bytes`` rounded down to a multiple of the element size (so every chunk
    splits into whole byte planes), the last one shorter; one empty chunk for an empty tensor.
    """
    data = as_bytes(tensor)
    itemsize = tensor.element_size()
    size = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    return [data[i:i + size] for i in range(0, len(data), size)] or [data]


def chunk_checksums(tensor: torch.Tensor, chunk_bytes: int) -> tuple[str, ...]:
    """The checksums of ``tensor``'s chunks (:func:`chunk_views`), as a store would take them when staging it."""
    return tuple(checksum(view) for view in chunk_views(tensor, chunk_bytes))


def from_bytes(buffer: memoryview | bytearray | bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Build a tensor of ``dtype`` and ``shape`` over ``buffer`` (no copy when writable).

    Raises:
        ManifestError: the byte count does not match ``dtype`` and ``shape``.
    """
    numel = 1
    for dim in shape:
        numel *= dim
    itemsize = dtype.itemsize
    if len(buffer) != numel * itemsize:
        raise ManifestError(f"{len(buffer)} bytes do not hold {shape} of {dtype}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(buffer, bytes):
        buffer = bytearray(buffer)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
