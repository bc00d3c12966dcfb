"""The receive-buffer pool: reuse, size fit, and its bound with bytes in flight."""

from __future__ import annotations

from quiverd.net.buffers import GRAIN, MIN_POOLED_BYTES, BufferPool


def test_buffer_pool_reuses_a_given_back_buffer_for_a_frame_of_similar_size():
    pool = BufferPool(64 << 20)
    view, buf = pool.take(1 << 20)
    assert buf is not None and len(view) == 1 << 20 and buf.size % GRAIN == 0
    address = buf.address
    pool.give(buf)
    view2, buf2 = pool.take((1 << 20) - 100)
    assert buf2 is not None and buf2.address == address and len(view2) == (1 << 20) - 100
    assert (pool.reused, pool.allocated) == (1, 1)
    # Much smaller frames do not take a big buffer (memory would be wasted).
    pool.give(buf2)
    _, small = pool.take(MIN_POOLED_BYTES)
    assert small is not None and small.address != address


def test_buffer_pool_does_not_pool_small_frames():
    pool = BufferPool(64 << 20)
    view, buf = pool.take(MIN_POOLED_BYTES - 1)
    assert buf is None and len(view) == MIN_POOLED_BYTES - 1


def test_buffer_pool_keeps_idle_plus_busy_bytes_within_its_bound():
    busy = [0]
    pool = BufferPool(4 << 20, busy=lambda: busy[0])
    bufs = [pool.take(1 << 20)[1] for _ in range(4)]
    busy[0] = 2 << 20
    for b in bufs:
        pool.give(b)
    assert pool.idle_bytes == 2 << 20  # 2 MiB in flight + 2 MiB idle = the bound


def test_buffer_pool_keeps_at_most_max_idle_bytes_idle():
    pool = BufferPool(64 << 20, max_idle_bytes=2 << 20)
    bufs = [pool.take(1 << 20)[1] for _ in range(4)]
    for b in bufs:
        pool.give(b)
    assert pool.idle_bytes == 2 << 20
