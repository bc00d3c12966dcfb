"""The pending-bytes budget: take before allocating, wait in line, give back on answer."""

from __future__ import annotations

import random

import anyio
import pytest

from quiverd.net.budget import ByteBudget


@pytest.mark.asyncio
async def test_budget_take_waits_until_released_then_grants_in_arrival_order() -> None:
    budget = ByteBudget(100)
    assert budget.try_take(80)
    order: list[str] = []

    async def take(name: str, nbytes: int) -> None:
        await budget.take(nbytes)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "big", 90)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(take, "small", 10)
        await anyio.wait_all_tasks_blocked()
        # 20 bytes are free, but "small" does not jump the queue ahead of "big".
        assert order == [] and budget.waiting == 2 and budget.available == 20
        assert not budget.try_take(5)  # nobody else jumps it either
        budget.release(80)
    assert order == ["big", "small"]
    assert budget.held == 100 and budget.waiting == 0


@pytest.mark.asyncio
async def test_budget_cancelled_waiter_takes_nothing_and_unblocks_the_next() -> None:
    budget = ByteBudget(100)
    assert budget.try_take(50)
    got: list[int] = []

    async def take(nbytes: int) -> None:
        await budget.take(nbytes)
        got.append(nbytes)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, 60)  # cannot fit while 50 are held
        waiter_scope = anyio.CancelScope()

        async def cancellable() -> None:
            with waiter_scope:
                await budget.take(90)

        tg.start_soon(cancellable)
        await anyio.wait_all_tasks_blocked()
        assert got == [] and budget.waiting == 2
        budget.release(50)  # 60 granted; 90 still waits
        await anyio.wait_all_tasks_blocked()
        waiter_scope.cancel()
    assert got == [60]
    assert budget.held == 60 and budget.waiting == 0
    budget.release(60)
    assert budget.available == 100


@pytest.mark.asyncio
async def test_budget_cancelled_head_of_line_lets_smaller_waiters_through() -> None:
    budget = ByteBudget(100)
    assert budget.try_take(30)
    got: list[int] = []
    head = anyio.CancelScope()

    async def big() -> None:
        with head:
            await budget.take(100)

    async def small() -> None:
        await budget.take(20)
        got.append(20)

    async with anyio.create_task_group() as tg:
        tg.start_soon(big)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(small)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # queued behind the big one although 70 are free
        head.cancel()
    assert got == [20] and budget.held == 50


def test_budget_rejects_more_than_it_holds() -> None:
    budget = ByteBudget(10)
    with pytest.raises(AssertionError):
        budget.try_take(11)
    with pytest.raises(ValueError):
        ByteBudget(0)


@pytest.mark.asyncio
async def test_budget_uid_at_its_share_waits_while_another_uid_takes_at_once() -> None:
    budget = ByteBudget(100, per_uid_bytes=60)
    assert budget.try_take(40, uid=1) and budget.try_take(20, uid=1)
    assert not budget.try_take(10, uid=1)  # uid 1 holds its share; 40 bytes are still free
    got: list[tuple[int, int]] = []

    async def take(uid: int, nbytes: int) -> None:
        await budget.take(nbytes, uid)
        got.append((uid, nbytes))

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, 1, 30)  # first in line, but over uid 1's share
        await anyio.wait_all_tasks_blocked()
        assert budget.try_take(10, uid=2)  # uid 1's waiter holds up no other uid
        assert not budget.try_take(1, uid=1)  # nor does anything of uid 1 jump it
        tg.start_soon(take, 3, 40)  # within its share; only 30 free: waits in line
        await anyio.wait_all_tasks_blocked()
        assert got == [] and budget.waiting == 2
        assert not budget.try_take(5, uid=2)  # uid 3 is first in line for free bytes
        budget.release(30, uid=1)  # 60 free: uid 1 (30 + 30 within its share) comes first
        await anyio.wait_all_tasks_blocked()
        assert got == [(1, 30)] and budget.available == 30
        budget.release(10, uid=2)
    assert got == [(1, 30), (3, 40)]
    assert budget.by_uid == {1: 60, 3: 40} and budget.waiting == 0


def test_budget_share_must_fit_the_budget_and_each_uid_releases_its_own() -> None:
    with pytest.raises(ValueError):
        ByteBudget(100, per_uid_bytes=101)
    budget = ByteBudget(100, per_uid_bytes=50)
    assert budget.try_take(50, uid=7)
    with pytest.raises(AssertionError):
        budget.release(10, uid=8)  # uid 8 holds nothing
    with pytest.raises(AssertionError):
        budget.try_take(51, uid=8)  # larger than any share: the caller's bug


@pytest.mark.asyncio
async def test_budget_contended_names_whose_bytes_a_waiter_needs() -> None:
    """Issue 26: the reader cuts a stalled frame short only when a waiter needs its
    bytes: a waiter of its own uid, or any waiter within its share when all is spent."""
    budget = ByteBudget(100, per_uid_bytes=60)
    assert budget.try_take(60, uid=1) and budget.try_take(30, uid=2)
    assert not budget.contended(1) and not budget.contended(2)
    queued: list[str] = []
    scopes: list[anyio.CancelScope] = []

    async def take(uid: int, nbytes: int, name: str) -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await budget.take(nbytes, uid, queued=lambda: queued.append(name))

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, 1, 10, "uid 1 over its share")
        await anyio.wait_all_tasks_blocked()
        assert queued == ["uid 1 over its share"]  # in line when told
        assert budget.contended(1) and not budget.contended(2)  # only uid 1's bytes help
        tg.start_soon(take, 3, 20, "uid 3 short of the total")
        await anyio.wait_all_tasks_blocked()
        assert budget.contended(2) and budget.contended(1)  # any uid's bytes would help
        budget.release(30, uid=2)  # uid 3 granted: only uid 1's own waiter is left
        await anyio.wait_all_tasks_blocked()
        assert budget.by_uid.get(3) == 20 and budget.contended(1) and not budget.contended(2)
        scopes[0].cancel()
    assert not budget.contended(1) and budget.waiting == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(40))
async def test_budget_whoever_waits_some_holder_is_contended_seeded(seed: int) -> None:
    """Seeded scheduler (replays by seed): takes, cancellations and releases of three
    uids in any order. After every step the books add up, nothing queued could be
    granted, and while anyone waits some uid holding bytes is ``contended``: a stalled
    frame of that uid is cut short, so no waiter depends on idle timeouts alone."""
    rng = random.Random(seed)
    budget = ByteBudget(100, per_uid_bytes=60)
    holdings: list[tuple[int, int]] = []  # (uid, nbytes) granted and not released
    waiting: dict[int, tuple[anyio.CancelScope, int, int]] = {}

    async def take(key: int, uid: int, nbytes: int) -> None:
        with anyio.CancelScope() as scope:
            waiting[key] = (scope, uid, nbytes)
            await budget.take(nbytes, uid)
            holdings.append((uid, nbytes))
        waiting.pop(key, None)

    async with anyio.create_task_group() as tg:
        for step in range(60):
            action = rng.random()
            if action < 0.5:
                tg.start_soon(take, step, rng.randrange(3), rng.randint(1, 60))
            elif action < 0.65 and waiting:
                waiting[rng.choice(sorted(waiting))][0].cancel()
            elif holdings:
                uid, nbytes = holdings.pop(rng.randrange(len(holdings)))
                budget.release(nbytes, uid)
            await anyio.wait_all_tasks_blocked()
            held: dict[int, int] = {}
            for uid, nbytes in holdings:
                held[uid] = held.get(uid, 0) + nbytes
            assert budget.by_uid == held and budget.held == sum(held.values())
            assert all(n <= 60 for n in held.values()) and budget.held <= 100
            assert budget.waiting == len(waiting), f"seed {seed} step {step}"
            if waiting:
                assert any(budget.contended(uid) for uid in held), f"seed {seed} step {step}"
            else:
                assert not any(budget.contended(uid) for uid in range(3))
        for scope, _, _ in list(waiting.values()):
            scope.cancel()
