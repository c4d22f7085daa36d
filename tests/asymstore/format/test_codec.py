"""The byte-plane codec: every path round-trips bit-exact for every dtype, and damage is caught."""

from __future__ import annotations

import struct

import pytest
import torch

from asymstore import AsymStore, CorruptVersionError, LocalTier
from asymstore.errors import CodecError
from asymstore.format.checksum import checksum
from asymstore.format.codec import (
    RAW,
    PlaneCodec,
    codec_name,
    decode,
    decode_chunk,
    encode,
    parse_codec,
    plane_width,
    sample,
    split_planes,
)
from asymstore.format.manifest import Chunk
from asymstore.format.tensors import as_bytes
from tests.support.tensors import DTYPES, SHAPES, assert_same, random_tensor

CODEC = PlaneCodec(level=1, threads=0)
MASKS = ["all", "none", "sampled"]  # compress every plane / store every plane raw / what the sample says


def smooth_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Values with structure (shared exponents, small ints), so some planes compress."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(numel, dtype=torch.complex128, generator=g).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 0.02).to(dtype)
    return torch.randint(0, 7, (numel,), generator=g).to(dtype)


def stored_bytes(parts: list[object]) -> bytearray:
    out = bytearray()
    for p in parts:
        out += bytes(p)  # type: ignore[call-overload]
    return out


def roundtrip(view: memoryview, width: int, mask: tuple[bool, ...] | None) -> bytes:
    enc = encode(view, width, CODEC, mask)
    stored = stored_bytes(enc.parts)
    assert len(stored) == enc.nbytes
    assert checksum(stored) == enc.checksum  # the checksum covers the stored bytes
    chunk = Chunk("seg-000000.bin", 0, len(stored), len(view), enc.checksum, codec_name(width), checksum(view))
    return bytes(decode_chunk(chunk, memoryview(stored)))


def mask_for(kind: str, view: memoryview, width: int) -> tuple[bool, ...] | None:
    if kind == "all":
        return None
    if kind == "none":
        return (False,) * width
    return sample(view, width, CODEC).mask


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_through_every_codec_path(dtype: torch.dtype, kind: str) -> None:
    width = plane_width(dtype)
    for numel in (0, 1, 7, 333, 4097):
        for make in (random_tensor, None):
            t = random_tensor(dtype, (numel,), seed=numel) if make else smooth_tensor(dtype, numel, seed=numel)
            view = as_bytes(t.contiguous())
            assert roundtrip(view, width, mask_for(kind, view, width)) == bytes(view), (dtype, numel, kind)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("extra", [1, 3, 7])
def test_trailing_bytes_that_form_no_whole_element(width: int, extra: int) -> None:
    data = bytearray(torch.arange(1000, dtype=torch.int16).view(torch.uint8).tolist()[:width * 50 + extra])
    view = memoryview(data)
    planes, tail = split_planes(view, width)
    assert len(planes) == width and len(tail) == extra % width
    for mask in (None, (False,) * width):
        assert roundtrip(view, width, mask) == bytes(data)


def test_planes_hold_byte_i_of_every_element() -> None:
    t = torch.tensor([0x0403_0201, 0x0807_0605], dtype=torch.int32)
    planes, tail = split_planes(as_bytes(t), 4)
    assert [bytes(p) for p in planes] == [b"\x01\x05", b"\x02\x06", b"\x03\x07", b"\x04\x08"]
    assert len(tail) == 0


def test_plane_width_per_dtype() -> None:
    assert [plane_width(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)] == [2, 2, 4, 8]
    assert [plane_width(d) for d in (torch.bool, torch.uint8, torch.float8_e4m3fn)] == [1, 1, 1]
    assert [plane_width(d) for d in (torch.complex32, torch.complex64, torch.complex128)] == [2, 4, 8]


def test_exponent_plane_compresses_and_mantissa_plane_is_stored_raw() -> None:
    t = (torch.randn(1 << 16) * 0.02).to(torch.bfloat16)
    smp = sample(as_bytes(t), 2, CODEC)
    assert smp.mask == (False, True)  # the low byte is mantissa noise, the high one sign + exponent
    assert 1.2 < smp.ratio < 2.0
    enc = encode(as_bytes(t), 2, CODEC, smp.mask)
    header = stored_bytes(enc.parts)[:16]
    low, high = struct.unpack("<2Q", header)
    assert low & 1 == 0 and low >> 1 == t.numel()  # raw plane: flag 0, full length
    assert high & 1 == 1 and high >> 1 < t.numel() * 0.8


def test_sample_of_a_small_chunk_is_its_full_encoding() -> None:
    t = torch.zeros(1000, dtype=torch.float32)
    smp = sample(as_bytes(t), 4, CODEC)
    assert smp.encoded is not None and smp.nbytes == 4000
    assert smp.ratio > 20
    stored = stored_bytes(smp.encoded.parts)
    out = bytearray(4000)
    decode(memoryview(stored), 4, memoryview(out))
    assert bytes(out) == bytes(4000)


def test_codec_names() -> None:
    assert parse_codec(RAW) is None
    assert [parse_codec(codec_name(w)) for w in (1, 2, 4, 8)] == [1, 2, 4, 8]
    for bad in ("zstd", "zstd-planes:3", "zstd-planes:", "lz4"):
        with pytest.raises(CodecError):
            parse_codec(bad)
    with pytest.raises(ValueError):
        codec_name(3)


def _encoded_chunk(t: torch.Tensor, width: int) -> tuple[bytearray, Chunk]:
    view = as_bytes(t)
    enc = encode(view, width, CODEC, (False, True))
    stored = stored_bytes(enc.parts)
    return stored, Chunk("seg-000000.bin", 0, len(stored), len(view), enc.checksum, codec_name(width), checksum(view))


def test_damaged_stored_bytes_fail_the_stored_checksum() -> None:
    stored, chunk = _encoded_chunk((torch.randn(4096) * 0.02).to(torch.bfloat16), 2)
    stored[len(stored) // 2] ^= 0x10
    with pytest.raises(CorruptVersionError, match="stored checksum mismatch"):
        decode_chunk(chunk, memoryview(stored))


def test_damage_behind_a_matching_stored_checksum_fails_the_raw_checksum() -> None:
    stored, chunk = _encoded_chunk((torch.randn(4096) * 0.02).to(torch.bfloat16), 2)
    stored[16 + 5] ^= 0x01  # inside plane 0, stored raw: decodes fine, to the wrong bytes
    forged = Chunk(chunk.segment, 0, chunk.length, chunk.raw_length, checksum(stored), chunk.codec, chunk.raw_checksum)
    with pytest.raises(CorruptVersionError, match="raw checksum mismatch"):
        decode_chunk(forged, memoryview(stored))


@pytest.mark.parametrize("damage", ["header", "frame", "unknown codec"])
def test_undecodable_chunks_raise_codec_error(damage: str) -> None:
    stored, chunk = _encoded_chunk((torch.randn(4096) * 0.02).to(torch.bfloat16), 2)
    codec = chunk.codec
    if damage == "header":
        stored[0] ^= 0x02  # plane 0's length no longer adds up
    elif damage == "frame":
        (low,) = struct.unpack_from("<Q", stored, 0)
        start = 16 + (low >> 1)
        stored[start:start + 4] = b"\x00\x00\x00\x00"  # the zstd magic number
    else:
        codec = "zstd-planes:16"
    forged = Chunk(chunk.segment, 0, len(stored), chunk.raw_length, checksum(stored), codec, chunk.raw_checksum)
    with pytest.raises(CodecError):
        decode_chunk(forged, memoryview(stored))


@pytest.mark.parametrize("compression", ["always", "never"])
async def test_store_round_trips_every_dtype_and_shape(tmp_path: object, compression: str) -> None:
    expected: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            expected[f"{dtype}.{j}"] = random_tensor(dtype, shape, seed=i * 100 + j)
        expected[f"{dtype}.smooth"] = smooth_tensor(dtype, 999, seed=i)
    # ~1 KB chunks (1001 rounds down to whole elements): several chunks per tensor, each decoded into place
    async with AsymStore([LocalTier(str(tmp_path))], compression=compression,  # type: ignore[arg-type]
                         chunk_bytes=1001, segment_bytes=1 << 16) as store:
        await store.put_many(1, expected)
        result = await store.commit(1)
        ckpt = await store.restore()
    codecs = {c.codec for e in result.manifest.tensors.values() for c in e.chunks}
    if compression == "always":
        assert {"zstd-planes:1", "zstd-planes:2", "zstd-planes:4", "zstd-planes:8"} <= codecs
        stats = result.flush[store.tiers[0].name]
        assert stats.chunks_compressed > 0 and stats.stored_bytes < stats.raw_bytes
    else:
        assert codecs == {RAW}
    for name, tensor in expected.items():
        assert_same(ckpt.tensors[name], tensor)
