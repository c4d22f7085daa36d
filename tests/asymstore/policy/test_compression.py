"""The pure policies: which chunks are worth compressing for a tier, which versions retention lets go."""

from __future__ import annotations

from asymstore.policy.compression import pays, worth_sampling
from asymstore.policy.retention import beyond_keep_last, keep_last_of


def test_compression_pays_only_when_the_bytes_saved_cost_more_to_write_than_compressing() -> None:
    slow, fast = 1e-8, 1e-10  # 100 MB/s remote, 10 GB/s NVMe
    n = 64 << 20
    assert pays(n, slow, compress_s=0.2, ratio=2.0)  # saves 0.34 s of writing for 0.2 s of compressing
    assert not pays(n, fast, compress_s=0.2, ratio=2.0)  # saves 3.4 ms: not worth 0.2 s
    assert not pays(n, slow, compress_s=0.2, ratio=1.0)  # nothing saved
    assert worth_sampling(n, slow, overhead_s=1e-4) and not worth_sampling(4096, fast, overhead_s=1e-4)


def test_retention_keeps_the_newest_and_lets_the_oldest_go() -> None:
    assert beyond_keep_last([5, 1, 3, 4, 2], 2) == [1, 2, 3]
    assert beyond_keep_last([1, 2], 3) == []
    assert beyond_keep_last([1, 2, 3], None) == []
    assert keep_last_of(None, 3) == 3 and keep_last_of(1, 3) == 1 and keep_last_of(None, None) is None
