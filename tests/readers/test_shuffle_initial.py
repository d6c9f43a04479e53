"""WebDataset's ``initial``: the shuffle buffer starts emitting once it holds ``shuffle_initial``
samples and grows to ``shuffle_buffer`` as it goes (one output per two inputs while it grows), so an
epoch's first sample no longer waits for the whole buffer to fill from storage.

Checked over integers (the buffer and ``resume_state``) and through the reader over real tar shards:
the first output comes after ``initial`` inputs (a ``pipe:`` command per shard logs when each shard
starts), every sample once per epoch, exact resume at many positions (and on another world size),
``initial == size`` the order the buffer had before it had an ``initial``, and typed errors for
wrong values.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from headrace import ConfigError, readers
from headrace.readers._shuffle import Draws, ShuffleBuffer, resume_state

from sample_data import tar_bytes

PER_SHARD = 4
SHARDS = 60
TOTAL = PER_SHARD * SHARDS


@pytest.fixture(scope="module")
def shard_paths(tmp_path_factory) -> list[str]:
    """60 tar shards of 4 samples each (``s007-2.cls`` holds the sample's number), no index."""
    folder = tmp_path_factory.mktemp("shuffle-initial")
    paths = []
    for s in range(SHARDS):
        members = [(f"s{s:03d}-{j}.cls", str(s * PER_SHARD + j).encode()) for j in range(PER_SHARD)]
        path = folder / f"shard-{s:03d}.tar"
        path.write_bytes(tar_bytes(members))
        paths.append(str(path))
    return paths


def _reader(paths, **kw):
    return readers.webdataset(paths, counts=[PER_SHARD] * len(paths), shuffle=True, **kw)


async def _read(reader, epoch=0, start=0, seed=3, history=()):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed, history=history) for s in chunk]


def _keys(samples):
    return [s.key for s in samples]


def _old_buffer(items, size, draws):
    """The buffer as it was before ``initial``: it fills to ``size`` without emitting, then each new
    item makes it emit one of the ``size + 1`` (draw ``p`` picks slot ``floor(u_p * (size + 1))``,
    slot ``size`` being the new item), then it drains one random slot per output."""
    slots, out = [], []
    for item in items:
        if len(slots) < size:
            slots.append(item)
            continue
        i = int(draws[len(out)] * (size + 1))
        if i < size:
            item, slots[i] = slots[i], item
        out.append(item)
    while slots:
        i = int(draws[len(out)] * len(slots))
        out.append(slots[i])
        slots[i] = slots[-1]
        slots.pop()
    return out


# -- (1) the first output comes after ``initial`` inputs --------------------------------------------


@pytest.mark.parametrize(("size", "initial"), [(50, 5), (50, 1), (50, 49), (50, 50), (1000, 100)])
def test_the_buffer_emits_after_initial_inputs_and_grows_one_per_two_inputs(size, initial):
    buf, out = ShuffleBuffer(size, Draws([7, 0]), initial=initial), []
    first = None
    for n in range(1, 3 * size + 1):
        buf.push(n - 1, out)
        if out and first is None:
            first = n
        # fills to ``initial``, then holds one more per two inputs, up to ``size``
        held = n if n <= initial else min(size, initial + (n - initial) // 2)
        assert (len(buf.slots), buf.position) == (held, n - held), n
    assert first == initial + 1  # holding ``initial``, the next item makes it emit
    buf.drain(out)
    assert sorted(out) == list(range(3 * size))


async def test_the_reader_emits_its_first_sample_after_initial_samples_read(shard_paths, tmp_path):
    """Each shard is a ``pipe:`` command that appends a line to a log as it starts: when the first
    sample comes out, the log tells how many shards (4 samples each) had been opened."""
    log = tmp_path / "opened.log"

    async def shards_opened_at_first_sample(**kw) -> int:
        log.write_text("")
        commands = [f"pipe:echo {i} >> {log} && cat {p}" for i, p in enumerate(shard_paths)]
        reader = _reader(commands, shuffle_buffer=200, read_ahead=0, chunk_size=1, **kw)
        stream = reader.read(0, seed=1)
        try:
            first = await anext(stream)
            opened = len(log.read_text().split())
        finally:
            await stream.aclose()
        assert len(first) == 1
        return opened

    initial = 10  # the 11th sample read (in the 3rd shard) makes the first one come out
    opened = await shards_opened_at_first_sample(shuffle_initial=initial)
    assert opened <= math.ceil((initial + 1) / PER_SHARD) + 1, opened  # + 1: the parser may start the next
    full = await shards_opened_at_first_sample(shuffle_initial=200)  # as before: the whole buffer first
    assert full >= math.ceil((200 + 1) / PER_SHARD), full


# -- (2) every sample once per epoch -------------------------------------------------------------------


@pytest.mark.parametrize(("size", "initial"), [(50, 7), (50, 1), (300, 100)])  # 300: more than the epoch
async def test_every_sample_once_per_epoch(shard_paths, size, initial):
    reader = _reader(shard_paths, shuffle_buffer=size, shuffle_initial=initial)
    everything = sorted(_keys(await _read(_reader(shard_paths, shuffle_buffer=0))))
    orders = []
    for epoch in range(3):
        samples = await _read(reader, epoch=epoch)
        assert sorted(_keys(samples)) == everything and len(set(_keys(samples))) == TOTAL
        assert [s.position for s in samples] == list(range(TOTAL))
        orders.append(_keys(samples))
    assert len({tuple(o) for o in orders}) == 3
    for world in (2, 3):
        parts = [_keys(await _read(reader.shard(r, world), epoch=1)) for r in range(world)]
        assert sorted(k for p in parts for k in p) == everything


# -- (3) exact resume with ``initial < size`` ----------------------------------------------------------


@pytest.mark.parametrize(("size", "initial", "total"),
                         [(7, 1, 40), (7, 3, 5), (7, 3, 9), (7, 6, 30), (40, 5, 9000), (40, 10, 60), (1, 1, 6)])
def test_resume_state_agrees_with_the_buffer_at_every_position(size, initial, total):
    """As the test of the same name in test_webdataset.py, with an ``initial``: the state recorded
    for ``k`` outputs is the one just before the push that makes output ``k + 1``."""
    buf = ShuffleBuffer(size, Draws([1, 2]), initial=initial)
    out, states = [], {0: (list(range(min(initial, total))), min(initial, total))}
    for x in range(total):
        buf.push(x, out)
        states[buf.position] = (list(buf.slots), x + 1)
    while buf.slots:
        buf.drain(out, 1)
        states[buf.position] = (list(buf.slots), total)
    assert sorted(out) == list(range(total))
    # every position of the fill, the growth and the drain; the steady state's every 97th
    for k in [k for k in sorted(states) if k < 3 * size or k % 97 == 0 or k > total - 2 * size]:
        assert resume_state(size, Draws([1, 2]), total, k, initial=initial) == states[k], k


@pytest.mark.parametrize(("world", "rank", "equal"), [(1, 0, None), (3, 1, None), (3, 2, "pad"), (100, 7, "drop")])
async def test_resume_at_many_positions_equals_the_uninterrupted_order(shard_paths, world, rank, equal):
    reader = _reader(shard_paths, shuffle_buffer=40, shuffle_initial=6).shard(rank, world, equal=equal)
    full = await _read(reader, epoch=2)
    n = len(full)
    # the fill (< 6 inputs), the growth (the first 34 outputs), the steady state, the drain, the ends
    for start in sorted({0, 1, 2, 3, 5, 6, 7, 11, 20, 33, 34, 35, 41, n // 2, n - 41, n - 40, n - 3, n - 1, n}):
        if not 0 <= start <= n:
            continue
        tail = await _read(reader, epoch=2, start=start)
        assert [(s.key, s.position) for s in tail] == [(s.key, s.position) for s in full[start:]], start


@pytest.mark.parametrize("position", [0, 3, 20, 50, 119])
async def test_an_epoch_resumed_on_another_world_size_reads_every_sample_once(shard_paths, position):
    """Span 0 on 2 ranks read ``position`` samples each; the rest of the epoch on 3 ranks reads what
    they had not: the old ranks' reads are replayed through the growing buffer (``_reshard.py``)."""
    reader = _reader(shard_paths, shuffle_buffer=40, shuffle_initial=6)
    read = [k for r in range(2) for k in _keys((await _read(reader.shard(r, 2), epoch=1))[:position])]
    rest = [k for r in range(3) for k in _keys(await _read(reader.shard(r, 3), epoch=1, history=[(2, position)]))]
    assert len(read) == 2 * position
    assert sorted(read + rest) == sorted(_keys(await _read(_reader(shard_paths, shuffle_buffer=0))))
    part = reader.shard(1, 3)
    whole = await _read(part, epoch=1, history=[(2, position)])
    for start in sorted({1, 9, len(whole) // 2} & set(range(len(whole) + 1))):  # a resume in the new span too
        tail = await _read(part, epoch=1, start=start, history=[(2, position)])
        assert _keys(tail) == _keys(whole[start:]), start


# -- (4) ``initial == size``: the order as it was ------------------------------------------------------


@pytest.mark.parametrize(("size", "total"), [(1, 5), (7, 3), (7, 40), (40, 9000)])
def test_a_buffer_with_initial_equal_to_size_keeps_the_old_order(size, total):
    for initial in (size, None):  # None: no initial given
        buf, out = ShuffleBuffer(size, Draws([5, 1]), initial=initial), []
        for x in range(total):
            buf.push(x, out)
        buf.drain(out)
        assert out == _old_buffer(range(total), size, Draws([5, 1]))


async def test_the_reader_with_initial_equal_to_size_keeps_the_old_order(shard_paths):
    unbuffered = _keys(await _read(_reader(shard_paths, shuffle_buffer=0), epoch=3))  # shard order alone
    old = _old_buffer(unbuffered, 30, Draws([3, 3, 1, 0]))  # the buffer's key: (seed, epoch, 1, rank)
    for initial in (30, 31, 1000):  # more than the buffer: the whole buffer
        assert _keys(await _read(_reader(shard_paths, shuffle_buffer=30, shuffle_initial=initial), epoch=3)) == old
    new = _keys(await _read(_reader(shard_paths, shuffle_buffer=30, shuffle_initial=4), epoch=3))
    assert new != old and sorted(new) == sorted(old)
    # the default initial (100) is the whole of a buffer of 100 or less: such readers keep their order
    assert _keys(await _read(_reader(shard_paths, shuffle_buffer=30), epoch=3)) == old


def test_the_initial_is_in_the_state_and_repr(shard_paths):
    reader = _reader(shard_paths, shuffle_buffer=300, shuffle_initial=np.int64(20))
    assert reader.shuffle_initial == 20 and type(reader.shuffle_initial) is int
    assert reader.state_dict()["shuffle_initial"] == 20 and "initial=20" in repr(reader)
    assert _reader(shard_paths).state_dict()["shuffle_initial"] == 100  # the default: WebDataset's
    assert _reader(shard_paths, shuffle_buffer=30).state_dict()["shuffle_initial"] == 30  # the whole buffer
    plain = readers.webdataset(shard_paths)
    assert plain.state_dict()["shuffle_initial"] == 0 == plain.state_dict()["shuffle_buffer"]  # no buffer
    assert reader.state_dict() != _reader(shard_paths, shuffle_buffer=300, shuffle_initial=21).state_dict()


# -- (5) wrong values ---------------------------------------------------------------------------


@pytest.mark.parametrize("wrong", [0, -1, 1.5, 10.0, True, np.bool_(True), "10", None])
def test_a_wrong_initial_is_a_config_error_naming_it(shard_paths, wrong):
    with pytest.raises(ConfigError, match=r"webdataset: shuffle_initial must be a positive int"):
        _reader(shard_paths, shuffle_initial=wrong)
