"""Checks every reader of record files (TFRecord, RecordIO) must pass, on the 75 JPEGs of
``image_folder`` written in file order: the files reader's order, shards and resume, and the loader."""

from __future__ import annotations

from pathlib import Path

from headrace import Loader, ops, readers


def write_tfrecord(path: Path, examples: list[dict]) -> list[tuple[int, int]]:
    """Examples to a TFRecord file by the ``tfrecord`` package (imported here, so only a test that
    writes one needs it); each record's (offset, size), as DALI's ``tfrecord2idx`` lists them."""
    from tfrecord import writer as tfrecord_writer

    writer = tfrecord_writer.TFRecordWriter(str(path))
    spans = []
    for datum in examples:
        start = writer.file.tell()
        writer.write(datum)
        spans.append((start, writer.file.tell() - start))
    writer.close()
    return spans


async def read_all(reader, epoch=0, start=0, seed=4):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


async def reads_as_the_files_reader(records, image_folder, *, epoch: int, start: int, world: int) -> None:
    """Shuffled, the same images in the same order as ``readers.files`` of the folder; from ``start``
    on, the rest exactly; on ``world`` ranks, disjoint parts that make up the whole."""
    whole = await read_all(records, epoch=epoch)
    folder = readers.files(image_folder, shuffle=True)
    assert [bytes(s.fields["jpg"]) for s in whole] == [s.fields["jpg"] for s in await read_all(folder, epoch=epoch)]
    rest = await read_all(records, epoch=epoch, start=start)
    assert [(s.key, s.index, s.position) for s in rest] == [(s.key, s.index, s.position) for s in whole[start:]]
    parts = [await read_all(records.shard(r, world), epoch=epoch) for r in range(world)]
    assert sorted(s.key for p in parts for s in p) == sorted(s.key for s in whole)


async def a_loader_trains_on(reader, leaks) -> None:
    """A CPU training loader over ``reader`` (75 samples of 3 classes) yields every sample in
    batches of 16 images 32 px square and labels 0-2, and leaves nothing behind."""
    loader = Loader(reader, batch_size=16, device="cpu", num_threads=2, pipeline=ops.training(32))
    async with loader:
        batches = [b async for b in loader]
    assert sum(len(b.sample_keys) for b in batches) == 75
    assert batches[0]["image"].shape == (16, 3, 32, 32) and set(batches[0]["label"].tolist()) <= {0, 1, 2}
    await leaks.check()
