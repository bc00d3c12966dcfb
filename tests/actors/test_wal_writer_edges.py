"""The WAL writer's edges added with its writer and syncer threads (issue 18).

On a real full disk, one batch part of which fits is acked in part: a write the kernel
cuts short is cut back whole by WalFiles (no torn entry); the writer then retries with
half as many entries, down to one, before it calls the disk full, so every entry that
fits is written and acked while the rest wait for space. And a commit that arrives
after the segment builder is gone (the shard failing) is still acked, quietly.
"""

from __future__ import annotations

import anyio
import pytest

from quiverd.kernel.config import WalConfig
from quiverd.protocol.frames import Ack
from tests.actors.test_wal_writer import (  # noqa: F401 - fixtures
    ENTRY_BYTES,
    drain_replies,
    leave_free,
    make,
    replay,
    running,
    sequences,
    small_fs,
    until,
)


@pytest.mark.asyncio
async def test_one_batch_on_a_nearly_full_disk_is_acked_as_far_as_it_fits(small_fs, make):  # noqa: F811
    h = make(root=small_fs)
    for rid in range(1, 9):  # queued before the writer starts: drained as one batch
        await h.append(rid, tag=rid)
    ballast = leave_free(small_fs, 3 * ENTRY_BYTES + ENTRY_BYTES // 2)
    async with running(h, WalConfig(flush_policy="interval", flush_interval_ms=5)):
        await until(lambda: h.stats.disk_full.value == 1)
        await until(lambda: h.stats.acks.value >= 1)
        await anyio.sleep(0.2)
        before = drain_replies(h)
        ballast.unlink()
        after = [await h.ack() for _ in range(8 - len(before))]
    assert 1 <= len(before) <= 3 and all(isinstance(r, Ack) for r in before)
    acks = [r for r in before if isinstance(r, Ack)] + after
    assert [(a.request_id, a.sequence) for a in acks] == [(i, i) for i in range(1, 9)]
    assert h.stats.no_space.value >= 2  # the whole batch, then halves, then held
    state = replay(h.layout)
    assert sequences(state.entries) == list(range(1, 9))
    assert (state.torn_tail_bytes, state.corrupt_entries) == (0, 0)


@pytest.mark.asyncio
async def test_a_commit_after_the_builder_is_gone_is_acked_without_a_callback_error(make):  # noqa: F811
    """The shard is failing (its segment builder stopped): a commit posted by the syncer
    still acks its durable bundles and raises nothing inside the loop's callback."""
    import asyncio

    from quiverd.kernel.config import WalConfig as Cfg

    h = make()
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    h.out.close()  # the builder's end: sends now raise BrokenResourceError
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: h.run(Cfg(flush_policy="always"),
                                                     task_status=task_status))
            await h.append(1)
            ack = await h.ack()
            await anyio.sleep(0.05)  # the loop ran the commit's callback
            tg.cancel_scope.cancel()
    assert ack.request_id == 1
    assert errors == [], [e.get("message") for e in errors]
