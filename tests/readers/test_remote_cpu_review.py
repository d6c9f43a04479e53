"""What the review of a streamed sample's host cost (issue 21, examples/results/remote-cpu-vm-2026-12-02.txt)
relies on: a read's GETs share one client and its connection pool, and the S3 store drops that client
(its connections) when the read's session ends, so the next read (the next epoch) opens new
connections. On the 2-core VM a GET on a new connection cost the client about twice the CPU a byte
of one on a reused connection; a reader alone still starts each read cold; the Loader holds the
reader's connections over each epoch (``Reader.connections``), so its epochs run ahead take them
over warm (tests/readers/test_loader_connections.py).
No test asserts a time.
"""

from __future__ import annotations

from headrace import readers
from headrace.readers._storage import S3Store

from test_storage_latency import RETRY, _big_shard, _pairs, _read_all, slow, slow_server  # noqa: F401 - fixtures


async def test_a_session_shares_one_client_and_the_last_one_out_drops_it():
    store = S3Store("bucket", endpoint="http://127.0.0.1:9", access_key_id="key-id", secret_access_key="secret-key")
    async with store.session():
        client = store._store()
        assert store._store() is client  # every GET of the read: one client, one pool of connections
        async with store.session():  # a second read overlapping the first (a run ahead)
            assert store._store() is client
        assert store._client is client  # the first read still holds it
    assert store._client is None  # the last session out dropped the client and its connections
    async with store.session():
        assert store._store() is not client  # the next read builds a new one: new connections


async def test_each_read_opens_its_own_connections_and_leaves_none_open(slow, leaks):
    # Two epochs of one reader over the big shard: the second reuses the first's Link (its GETs
    # start at once), but not its connections: they were closed with the first read's session.
    reader = readers.webdataset(slow.source("s3", "big/big-0.tar"), buffer_bytes=4 << 20, chunk_size=4,
                                storage_options={"retry": RETRY})
    assert _pairs(await _read_all(reader, epoch=0)) == _big_shard(slow)
    await slow.idle()  # every connection of the first read closed at the server
    first = slow.stats()["connections"]
    assert _pairs(await _read_all(reader, epoch=1)) == _big_shard(slow)
    await slow.idle()
    stats = slow.stats()
    assert stats["connections"] > first  # the second read connected anew
    assert stats["open"] == 0
    await leaks.check()


async def test_reads_within_one_session_share_the_client(slow, leaks):
    # A run ahead whose read starts before the last one's session ends keeps the client, and so the
    # connections: the session count, not the read, decides.
    reader = readers.webdataset(slow.source("s3", "big/big-0.tar"), buffer_bytes=4 << 20, chunk_size=4,
                                storage_options={"retry": RETRY})
    store = reader.storage.locate(slow.source("s3", "big/big-0.tar"))[0]
    async with store.session():
        clients = set()
        for epoch in range(2):
            assert _pairs(await _read_all(reader, epoch=epoch)) == _big_shard(slow)
            clients.add(id(store._client))
        assert len(clients) == 1 and store._client is not None
    assert store._client is None
    await leaks.check()  # before idle(): its to_thread may start a second default-executor thread
    await slow.idle()
