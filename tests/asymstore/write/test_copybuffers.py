"""CopyBuffers: idle buffers are reused by exact size, and no more than ``keep`` are kept."""

from __future__ import annotations

import pytest

from asymstore.write.copybuffers import CopyBuffers


def test_a_buffer_given_back_is_taken_again_for_the_same_size_only() -> None:
    pool = CopyBuffers(keep=2)
    a = pool.take(1000)
    pool.give_back(a)
    assert pool.take(999).data_ptr() != a.data_ptr()  # another size: fresh memory
    b = pool.take(1000)
    assert b.data_ptr() == a.data_ptr() and b.numel() == 1000
    assert (pool.allocations, pool.reuses) == (2, 1)


def test_at_most_keep_idle_buffers_are_kept_newest_first() -> None:
    pool = CopyBuffers(keep=2)
    bufs = [pool.take(4096) for _ in range(3)]
    for b in bufs:
        pool.give_back(b)
    assert pool.idle_bytes == 2 * 4096
    kept = {pool.take(4096).data_ptr(), pool.take(4096).data_ptr()}
    assert kept == {bufs[1].data_ptr(), bufs[2].data_ptr()}
    none = CopyBuffers(keep=0)
    none.give_back(none.take(10))
    assert none.idle_bytes == 0
    with pytest.raises(ValueError):
        CopyBuffers(keep=-1)
