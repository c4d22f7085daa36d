"""Tensors of every dtype and shape class with arbitrary bit patterns, and a bit-exact comparison."""

from __future__ import annotations

import torch

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128,
    torch.complex32,
]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (3, 5), (2, 3, 4, 5)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    itemsize = dtype.itemsize
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)  # arbitrary bit patterns: NaNs, denormals, -0.0


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert tuple(a.shape) == tuple(b.shape)
    assert bits(a) == bits(b)
