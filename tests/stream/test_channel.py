from __future__ import annotations

import asyncio

import pytest

from headrace import ClosedError, ConfigError
from headrace._channel import open_channel
from headrace._markers import END


async def test_items_pass_in_order_then_end():
    tx, rx = open_channel(4)
    for i in range(3):
        await tx.send(i)
    await tx.aclose()
    assert [item async for item in rx] == [0, 1, 2]
    assert await rx.receive() is END


async def test_full_channel_makes_sender_wait_until_receive():
    tx, rx = open_channel(2)
    await tx.send("a")
    await tx.send("b")
    blocked = asyncio.create_task(tx.send("c"))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    assert tx.statistics().waiting_senders == 1
    assert await rx.receive() == "a"
    await asyncio.wait_for(blocked, 1)
    assert tx.statistics().items == 2


async def test_byte_bound_waits_but_lets_one_large_item_through_an_empty_channel():
    tx, rx = open_channel(100, max_bytes=10)
    await tx.send("big", 50)  # larger than max_bytes, but the channel is empty: no deadlock
    blocked = asyncio.create_task(tx.send("small", 1))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    assert await rx.receive() == "big"
    await asyncio.wait_for(blocked, 1)
    stats = rx.statistics()
    assert (stats.items, stats.bytes, stats.peak_bytes) == (1, 1, 50)


async def test_cancelled_send_leaves_channel_unchanged():
    tx, rx = open_channel(1)
    await tx.send(1)
    blocked = asyncio.create_task(tx.send(2))
    await asyncio.sleep(0.01)
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    assert tx.statistics().waiting_senders == 0
    await tx.aclose()
    assert [item async for item in rx] == [1]


async def test_receiver_close_breaks_waiting_and_later_senders():
    tx, rx = open_channel(1)
    await tx.send(1)
    blocked = asyncio.create_task(tx.send(2))
    await asyncio.sleep(0.01)
    await rx.aclose()
    await rx.aclose()  # twice is fine
    with pytest.raises(ClosedError):
        await blocked
    with pytest.raises(ClosedError):
        await tx.send(3)


async def test_receive_waits_for_sender_and_end_wakes_it():
    tx, rx = open_channel(1)
    waiting = asyncio.create_task(rx.receive())
    await asyncio.sleep(0.01)
    assert rx.statistics().waiting_receivers == 1
    await tx.aclose()
    assert await asyncio.wait_for(waiting, 1) is END


async def test_send_after_close_raises():
    tx, _ = open_channel(1)
    await tx.aclose()
    with pytest.raises(ClosedError):
        await tx.send(1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bounds_must_be_positive_ints(bad):
    with pytest.raises(ConfigError):
        open_channel(bad)
    with pytest.raises(ConfigError):
        open_channel(1, bad)


def test_stats_say_none_for_a_channel_bounded_by_items_alone():
    _, rx = open_channel(4)
    assert rx.statistics().max_bytes is None
    _, rx = open_channel(4, max_bytes=1024)
    assert rx.statistics().max_bytes == 1024


def test_closing_an_end_whose_waiter_sits_on_a_closed_loop_is_quiet():
    """A loop closed without cancelling its tasks (``run_until_complete``, then ``close()``) leaves
    a receiver waiting on it; when the garbage collector later closes the loader's coroutine, its
    ``finally`` closes the send end, whose wake-up of that receiver raised RuntimeError('Event
    loop is closed'), an exception Python could only print as ignored. Nobody can wake there."""
    tx, rx = open_channel(2)
    loop = asyncio.new_event_loop()
    waiting = loop.create_task(rx.receive())
    loop.run_until_complete(asyncio.sleep(0))  # the receiver now waits on a future of this loop
    assert rx.statistics().waiting_receivers == 1
    loop.close()
    closing = tx.aclose()
    with pytest.raises(StopIteration):  # it completes without awaiting, and raises nothing else
        closing.send(None)
    del waiting
