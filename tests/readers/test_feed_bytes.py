"""The feed between a shard's parser thread and the reader: past its item bound, a byte bound.

A shard read ahead of the one being consumed parses into its feed until the samples waiting hold
``buffer_bytes``; with the item bound alone (two chunks) the shards in flight were parsed one after
the other. These tests drive a ``Feed`` from a real thread, as the parsers do.
"""

from __future__ import annotations

import asyncio
import threading
import time

from headrace.readers._feed import END, Feed


def _producer(feed: Feed, sizes: list[int], queued: list[int]) -> threading.Thread:
    def run() -> None:
        for i, size in enumerate(sizes):
            if not feed.put(i, size=size):
                return
            queued.append(i)
        feed.put(END, force=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _settled(queued: list[int], timeout: float = 5.0) -> int:
    """How many items the producer queued once it stopped making progress (blocked or done)."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        if len(queued) != last:
            last, since = len(queued), time.monotonic()
        elif time.monotonic() - since > 0.2:
            return last
        time.sleep(0.01)
    return len(queued)


async def _drain(feed: Feed) -> list[object]:
    items = []
    while (item := await feed.get()) is not END:
        items.append(item)
    return items


async def test_past_its_item_bound_a_feed_takes_items_while_they_fit_its_bytes():
    feed = Feed(asyncio.get_running_loop(), capacity=2, max_bytes=100)
    queued: list[int] = []
    thread = _producer(feed, [30] * 6, queued)
    # Two by the item bound, a third while 90 bytes wait; a fourth would make 120.
    assert await asyncio.to_thread(_settled, queued) == 3
    assert await _drain(feed) == [0, 1, 2, 3, 4, 5]  # then the rest, in order, as room is made
    thread.join(5)
    assert not thread.is_alive()


async def test_without_a_byte_bound_a_feed_holds_its_item_bound():
    feed = Feed(asyncio.get_running_loop(), capacity=2)
    queued: list[int] = []
    thread = _producer(feed, [1] * 5, queued)
    assert await asyncio.to_thread(_settled, queued) == 2
    assert await _drain(feed) == [0, 1, 2, 3, 4]
    thread.join(5)


async def test_an_item_larger_than_the_byte_bound_still_passes_the_item_bound():
    # The item bound is a floor: two waiting items are always allowed, whatever their size.
    feed = Feed(asyncio.get_running_loop(), capacity=2, max_bytes=10)
    queued: list[int] = []
    thread = _producer(feed, [50, 50, 50], queued)
    assert await asyncio.to_thread(_settled, queued) == 2
    assert await _drain(feed) == [0, 1, 2]
    thread.join(5)


async def test_stop_wakes_a_producer_blocked_by_the_byte_bound():
    feed = Feed(asyncio.get_running_loop(), capacity=1, max_bytes=40)
    queued: list[int] = []
    thread = _producer(feed, [20] * 10, queued)
    assert await asyncio.to_thread(_settled, queued) == 2
    feed.stop()
    thread.join(5)
    assert not thread.is_alive() and queued == [0, 1]
