"""readers.video over object storage: video files and tar shards of mp4 members on a real S3 server
(moto) and a real HTTP server on 127.0.0.1, behind the fault-injecting proxy of ``storage_servers.py``
(its own process, serving a folder of videos made here). Each remote source must give the clips,
labels and pixels of the same videos read locally."""

from __future__ import annotations


import pytest
import torch

av = pytest.importorskip("av")

from sample_data import make_video, video_batches  # noqa: E402
from storage_servers import ACCESS_KEY, BUCKET, SECRET_KEY, post_faults, serving  # noqa: E402

from headrace import ConfigError, ReadError, StorageError, readers  # noqa: E402

FRAMES = {"jump/v0.mp4": 40, "jump/v1.mp4": 26, "walk/v0.mkv": 33}
RETRY = {"attempts": 6, "backoff": 0.01, "max_backoff": 0.05, "timeout": 5}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``tree/`` (class folders of videos) and ``tars/`` (them packed into two shards), served by S3 and HTTP."""
    root = tmp_path_factory.mktemp("video-storage")
    for rel, n in FRAMES.items():
        make_video(root / "tree" / rel, n)
    readers.pack(root / "tree", root / "tars", format="webdataset", video=True, shard_count=2)
    with serving(root) as urls:
        yield root, urls


def _faults(urls, proxy, *rules):
    post_faults(urls[proxy], *rules)


def _options(urls, kind):
    if kind == "http":
        return {"retry": RETRY}
    return {"endpoint": urls["s3"], "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
            "region": "us-east-1", "retry": RETRY}


def _base(urls, kind):
    return f"s3://{BUCKET}" if kind == "s3" else urls["http"]


def _same(got, expected, key=lambda k: k):
    assert [b.sample_keys for b in got] == [[key(k) for k in b.sample_keys] for b in expected]
    for x, y in zip(got, expected, strict=True):
        assert torch.equal(x["video"], y["video"]) and torch.equal(x["label"], y["label"])
        assert torch.equal(x["start"], y["start"])


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_video_urls_give_the_clips_and_pixels_of_the_local_files(served, kind, leaks):
    root, urls = served
    _faults(urls, kind)
    common = dict(sequence_length=4, stride=2, step=5, shuffle=True, seed=2)
    local = readers.video([(root / "tree" / rel, i) for i, rel in enumerate(FRAMES)], **common)
    remote = readers.video([(f"{_base(urls, kind)}/tree/{rel}", i) for i, rel in enumerate(FRAMES)],
                           storage_options=_options(urls, kind), **common)
    assert len(remote) == len(local) > 0
    got, expected = await video_batches(remote), await video_batches(local)
    _same(got, expected, lambda k: k.replace(str(root), _base(urls, kind)))
    assert all(p.startswith(_base(urls, kind)) for b in got for p in b["path"])
    await leaks.check()


async def test_a_bucket_prefix_is_a_class_per_folder_tree(served, leaks):
    root, urls = served
    _faults(urls, "s3")
    remote = readers.video(f"s3://{BUCKET}/tree/", sequence_length=8, storage_options=_options(urls, "s3"))
    local = readers.video(root / "tree", sequence_length=8)
    assert remote.classes == local.classes == ("jump", "walk")
    _same(await video_batches(remote), await video_batches(local))  # keys relative to the prefix, as to the folder
    await leaks.check()


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_remote_tar_shards_give_the_clips_of_the_local_shards(served, kind, leaks):
    root, urls = served
    _faults(urls, kind)
    common = dict(sequence_length=4, stride=3, shuffle=True, seed=1)
    local = readers.video(root / "tars", **common)
    remote = readers.video(f"{_base(urls, kind)}/tars/shard-{{000000..000001}}.tar",
                           storage_options=_options(urls, kind), **common)
    assert len(remote) == len(local) > 0
    got = await video_batches(remote)
    _same(got, await video_batches(local))
    assert all(p.startswith(f"{_base(urls, kind)}/tars/shard-") and ":" in p for b in got for p in b["path"])
    await leaks.check()


async def test_dropped_connections_are_retried_and_a_missing_video_is_a_storage_error(served, leaks):
    root, urls = served
    # every video's first two GETs fail (a reset mid-body, then a 503): retries give the same pixels
    _faults(urls, "http", {"match": "/tree/", "faults": [{"kind": "reset", "after": 300},
                                                         {"kind": "status", "status": 503}], "then": None})
    items = [(f"{urls['http']}/tree/{rel}", i) for i, rel in enumerate(FRAMES)]
    remote = readers.video(items, sequence_length=8, storage_options=_options(urls, "http"))
    local = readers.video([(root / "tree" / rel, i) for i, rel in enumerate(FRAMES)], sequence_length=8)
    _same(await video_batches(remote), await video_batches(local), lambda k: k.replace(str(root), urls["http"]))
    _faults(urls, "http")
    missing = readers.video([*items, (f"{urls['http']}/tree/jump/gone.mp4", 0)], sequence_length=8,
                            storage_options=_options(urls, "http"))
    samples = [s async for chunk in missing.read(0) for s in chunk]
    bad = [s for s in samples if s.error is not None]
    assert len(bad) == 1 and isinstance(bad[0].error, StorageError) and isinstance(bad[0].error, ReadError)
    assert bad[0].error.source == f"{urls['http']}/tree/jump/gone.mp4" and bad[0].key == bad[0].error.key
    await leaks.check()


async def test_a_gzip_shard_at_a_url_is_refused_as_a_local_one_is(served):
    root, urls = served
    import gzip

    (root / "gz").mkdir(exist_ok=True)
    (root / "gz" / "s.tar.gz").write_bytes(gzip.compress((root / "tars" / "shard-000000.tar").read_bytes()))
    _faults(urls, "http")
    with pytest.raises(ConfigError, match="gzip"):
        readers.video(f"{urls['http']}/gz/s.tar.gz", sequence_length=4, storage_options=_options(urls, "http"))
